"""Two gloo processes with a DDP model; rank 1 injects Inf at one step after the gradient
all-reduce. With agreement (the default under torch.distributed) both ranks skip that step and
stay identical; without it (negative control) they diverge."""
from __future__ import annotations

import pytest
import torch

from tests.training import _dist_worker
from tests.training._launch import run_ranks

pytestmark = [pytest.mark.slow,  # two gloo processes (DDP)
              pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="torch.distributed is not available")]
WORLD = 2
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_dist_worker, WORLD, tmp_path_factory.mktemp("ddp"), TIMEOUT_S,
                     preload=("torch._dynamo",))


def test_every_rank_skips_the_step_one_rank_overflowed(results: list[dict]) -> None:
    runs = [r["agreed"] for r in results]
    expected = [step != _dist_worker.INJECT_STEP for step in range(_dist_worker.STEPS)]
    assert runs[0]["stepped"] == runs[1]["stepped"] == expected
    assert runs[0]["scales"] == runs[1]["scales"]
    k = _dist_worker.INJECT_STEP
    assert runs[0]["scales"][k] == runs[0]["scales"][k - 1] / 2   # backed off once...
    assert max(runs[0]["scales"]) > 2.0**16                       # ...and grew otherwise
    for a, b in zip(runs[0]["params"], runs[1]["params"]):
        assert torch.equal(a, b)


def test_without_agreement_the_ranks_diverge(results: list[dict]) -> None:
    runs = [r["local"] for r in results]
    assert runs[0]["stepped"][_dist_worker.INJECT_STEP] is True
    assert runs[1]["stepped"][_dist_worker.INJECT_STEP] is False
    assert runs[0]["scales"] != runs[1]["scales"]
    assert not all(torch.equal(a, b) for a, b in zip(runs[0]["params"], runs[1]["params"]))
