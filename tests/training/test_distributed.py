"""Two gloo processes with a DDP model; rank 1 injects Inf at one step after the gradient
all-reduce. With agreement (the default under torch.distributed) both ranks skip that step and
stay identical; without it (negative control) they diverge."""
from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from tests.training import _dist_worker

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")
WORLD = 2
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    if "forkserver" in mp.get_all_start_methods():
        # Fresh single-threaded server process that imports torch and DDP's torch._dynamo once
        # (~10 s on 2 busy cores), then forks both workers from it: half the time of "spawn".
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([_dist_worker.__name__, "torch._dynamo"])
    else:
        ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_dist_worker.worker, args=(r, WORLD, port, str(out)))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"DDP workers did not finish within {TIMEOUT_S} s"
    assert [p.exitcode for p in procs] == [0] * WORLD
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


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
