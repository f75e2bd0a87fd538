"""Worker for test_distributed (a module of its own so spawned processes can import it)."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from amp_rewrite.training import AmpOptimizer, LossScaler
from tests.training._launch import gloo_group

STEPS = 8
INJECT_STEP = 3
INJECT_RANK = 1


def _run(rank: int, agree: bool | None) -> dict[str, object]:
    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2)))
    amp = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                       scaler=LossScaler(growth_interval=2, distributed=agree))
    gen = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data shard
    stepped, scales = [], []
    for step in range(STEPS):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
        amp.backward(nn.functional.mse_loss(model(x), y))  # DDP all-reduces the gradients
        if rank == INJECT_RANK and step == INJECT_STEP:
            # after DDP's all-reduce: only this rank's copy is non-finite (as with a local
            # overflow in a sharded optimizer or a rank-local gradient hook)
            with torch.no_grad():
                model.module[0].weight.grad[0, 0] = math.inf
        stepped.append(bool(amp.step()))
        scales.append(amp.get_scale())
        amp.zero_grad()
    return {"stepped": stepped, "scales": scales,
            "params": [p.detach().clone() for p in model.parameters()]}


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world_size, port):
        results = {"agreed": _run(rank, agree=None), "local": _run(rank, agree=False)}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
