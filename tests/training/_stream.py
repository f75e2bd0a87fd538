"""A deterministic gradient stream with Inf/NaN injected at chosen steps (shared by tests)."""
from __future__ import annotations

import math

import torch
from torch import nn

# (optimizer step, micro-batch) -> value written into one gradient element after backward.
INJECT: dict[tuple[int, int], float] = {
    (2, 0): math.inf, (5, -1): math.nan, (6, 0): -math.inf, (7, 0): math.inf, (11, -1): math.nan,
}
STEPS = 14


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def loss_of(model: nn.Module, step: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(16, 8, generator=gen)
    y = torch.randn(16, 4, generator=gen)
    return nn.functional.mse_loss(model(x), y)


def inject(param: torch.Tensor, step: int, micro: int, micro_batches: int) -> None:
    """Overwrite one element of ``param.grad`` if (step, micro) is scheduled (-1 = last
    micro-batch)."""
    for (s, m), value in INJECT.items():
        if s == step and (m == micro or (m == -1 and micro == micro_batches - 1)):
            with torch.no_grad():
                param.grad[1, 2] = value


def injected_steps() -> list[int]:
    return sorted({s for s, _ in INJECT if s < STEPS})
