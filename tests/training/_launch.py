"""Run a two-rank gloo worker module in subprocesses and collect each rank's saved results.

A worker module defines ``worker(rank, world_size, port, out_dir)``; ``gloo_group`` sets up and
tears down its process group; each rank saves its results to ``out_dir/rank{rank}.pt``.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(module: ModuleType, world: int, out: Path, timeout_s: float,
              preload: tuple[str, ...] = ()) -> list[dict]:
    """Start ``module.worker`` on ``world`` ranks, wait, and load every rank's results."""
    if "forkserver" in mp.get_all_start_methods():
        # Fresh single-threaded server process that imports torch (and ``preload``) once
        # (~10 s on 2 busy cores), then forks the workers from it: half the time of "spawn".
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([module.__name__, *preload])
    else:
        ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=module.worker, args=(r, world, port, str(out)))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    assert not hung, f"{module.__name__} workers did not finish within {timeout_s} s"
    assert [p.exitcode for p in procs] == [0] * world
    return [torch.load(Path(out) / f"rank{r}.pt", weights_only=True) for r in range(world)]


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, port: int) -> Iterator[None]:
    """One thread per rank (two ranks share 2 cores) and a gloo group for the block."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()
