"""Worker for test_fsdp: a rewritten model under FSDP2 ``fully_shard`` on two gloo ranks, and
the same rewritten model unsharded on the two ranks' data, each with AmpOptimizer."""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

import amp_rewrite
from amp_rewrite.training import AmpOptimizer, LossScaler
from tests.training._launch import gloo_group

STEPS = 8
INJECT_STEP = 3
INJECT_RANK = 1
WORLD = 2


def _model() -> nn.Module:
    torch.manual_seed(0)  # same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def _rewritten() -> torch.nn.Module:
    return amp_rewrite.rewrite(_model(), (torch.randn(8, 6),), dtype=torch.float16)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)  # each rank's own data shard
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen))
            for _ in range(STEPS)]


def _optimizer(model: nn.Module, *, sharded: bool) -> AmpOptimizer:
    # FSDP averages the ranks' gradients; the reference sums them (one backward of the summed
    # losses, so each shard's fp16 backward sees the same scaled values as on its rank) and
    # takes half the learning rate: SGD with momentum is linear in the gradient.
    lr = 0.05 if sharded else 0.05 / WORLD
    sgd = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    # Sharded: the ranks agree on overflow (the default under torch.distributed), since each
    # checks only its own shard. The single-process reference must not all-reduce.
    return AmpOptimizer(sgd, scaler=LossScaler(growth_interval=2, distributed=None if sharded else False))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x).float(), y)


def run_sharded(rank: int) -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _rewritten()
    fully_shard(model, mesh=init_device_mesh("cpu", (WORLD,)))
    amp = _optimizer(model, sharded=True)
    stepped, scales = [], []
    for step, (x, y) in enumerate(_batches(rank)):
        amp.backward(_loss(model, x, y))  # FSDP reduce-scatters (averages) the gradients
        if rank == INJECT_RANK and step == INJECT_STEP:
            with torch.no_grad():  # only this rank's shard is non-finite
                next(iter(model.parameters())).grad._local_tensor.view(-1)[0] = math.inf
        stepped.append(bool(amp.step()))
        scales.append(amp.get_scale())
        amp.zero_grad()
    return {"stepped": stepped, "scales": scales,
            "params": [p.full_tensor().detach().clone() for p in model.parameters()]}


def run_unsharded() -> dict[str, object]:
    """One process, both ranks' data: the loss FSDP's averaged gradients correspond to."""
    model = _rewritten()
    amp = _optimizer(model, sharded=False)
    data = list(zip(*(_batches(rank) for rank in range(WORLD))))
    stepped, scales = [], []
    for step, shards in enumerate(data):
        amp.backward(sum(_loss(model, x, y) for x, y in shards))
        if step == INJECT_STEP:
            with torch.no_grad():
                next(iter(model.parameters())).grad.view(-1)[0] = math.inf
        stepped.append(bool(amp.step()))
        scales.append(amp.get_scale())
        amp.zero_grad()
    return {"stepped": stepped, "scales": scales,
            "params": [p.detach().clone() for p in model.parameters()]}


def worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_group(rank, world_size, port):
        results = {"sharded": run_sharded(rank)}
        if rank == 0:
            results["unsharded"] = run_unsharded()
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
