"""Two gloo processes train a rewritten (fp16) model under FSDP2 ``fully_shard`` with
AmpOptimizer; rank 1 injects Inf into its own gradient shard at one step. Both ranks skip that
step (each checks only its shard; the LossScaler all-reduces the flag), and the sharded run
ends with the parameters of the same rewritten model trained unsharded on both ranks' data."""
from __future__ import annotations

import pytest
import torch

from tests.training import _fsdp_worker
from tests.training._launch import run_ranks

pytestmark = [pytest.mark.slow,  # two gloo processes (FSDP2)
              pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="torch.distributed is not available")]
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(_fsdp_worker, _fsdp_worker.WORLD, tmp_path_factory.mktemp("fsdp"),
                     TIMEOUT_S)


def test_fsdp2_ranks_skip_the_step_one_rank_overflowed(results: list[dict]) -> None:
    runs = [r["sharded"] for r in results]
    k = _fsdp_worker.INJECT_STEP
    assert runs[0]["stepped"] == runs[1]["stepped"] and runs[0]["stepped"][k] is False
    assert runs[0]["scales"] == runs[1]["scales"]
    assert runs[0]["scales"][k] == runs[0]["scales"][k - 1] / 2
    assert sum(runs[0]["stepped"]) >= _fsdp_worker.STEPS - 2  # it trains
    for a, b in zip(runs[0]["params"], runs[1]["params"]):
        assert torch.equal(a, b)


def test_fsdp2_matches_the_unsharded_run_within_fp32_rounding(results: list[dict]) -> None:
    sharded, unsharded = results[0]["sharded"], results[0]["unsharded"]
    assert sharded["stepped"] == unsharded["stepped"]  # the same skips, injected or real
    assert sharded["scales"] == unsharded["scales"]
    initial = [p.detach() for p in _fsdp_worker._model().parameters()]
    for a, b, start in zip(sharded["params"], unsharded["params"], initial):
        assert not torch.equal(a, start)  # trained
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
