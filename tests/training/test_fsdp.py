"""Two gloo processes train a rewritten (fp16) model under FSDP2 ``fully_shard`` with
AmpOptimizer; rank 1 injects Inf into its own gradient shard at one step. Both ranks skip that
step (each checks only its shard; the LossScaler all-reduces the flag), and the sharded run
ends with the parameters of the same rewritten model trained unsharded on both ranks' data."""
from __future__ import annotations

import multiprocessing as mp
import socket
from pathlib import Path

import pytest
import torch

from tests.training import _fsdp_worker

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")
TIMEOUT_S = 180


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp")
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")  # see test_distributed: one torch import, two forks
        ctx.set_forkserver_preload([_fsdp_worker.__name__])
    else:
        ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_fsdp_worker.worker, args=(r, _fsdp_worker.WORLD, port, str(out)))
             for r in range(_fsdp_worker.WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"FSDP workers did not finish within {TIMEOUT_S} s"
    assert [p.exitcode for p in procs] == [0] * _fsdp_worker.WORLD
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True)
            for r in range(_fsdp_worker.WORLD)]


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
