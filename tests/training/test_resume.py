"""Save at step k, reload into fresh objects, continue: identical to the uninterrupted run."""
from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from amp_rewrite.training import AmpOptimizer, LossScaler
from tests.training._stream import STEPS, inject, loss_of, make_model


@dataclass(frozen=True)
class Config:
    name: str
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]
    accum: int = 1
    clip: bool = False
    master: bool = False
    scaler: Callable[[], LossScaler] = lambda: LossScaler(growth_interval=3, hysteresis=2)


CONFIGS = [
    Config("sgd_hysteresis", lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9)),
    Config("adam_fused_accum_clip", lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
           accum=2, clip=True,
           scaler=lambda: LossScaler(growth_interval=2, min_scale=2.0**15, max_scale=2.0**18)),
    Config("adamw_master_weights", lambda p: torch.optim.AdamW(p, lr=1e-2), master=True),
]


def _fresh(config: Config) -> tuple[nn.Module, AmpOptimizer]:
    model = make_model()
    if config.master:
        model = model.half()
    amp = AmpOptimizer(config.optimizer(list(model.parameters())), scaler=config.scaler(),
                       accumulation_steps=config.accum, master_weights=config.master)
    return model, amp


def _loss(model: nn.Module, step: int, micro: int, master: bool) -> torch.Tensor:
    if not master:
        return loss_of(model, step, micro)
    # fp16 model: run it on fp16 inputs, compute the loss in fp32
    gen = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    return nn.functional.mse_loss(model(x.half()).float(), y)


def _train(config: Config, model: nn.Module, amp: AmpOptimizer, steps: range,
           trace: list[tuple[bool, float]]) -> None:
    for step in steps:
        for micro in range(config.accum):
            amp.backward(_loss(model, step, micro, config.master))
            # in master-weights mode the gradients live on the FP32 masters after backward
            target = amp._master.pairs[0][1] if config.master else model[0].weight
            inject(target, step, micro, config.accum)
        if config.clip:
            amp.clip_grad_norm_(0.5)
        trace.append((bool(amp.step()), amp.get_scale()))
        amp.zero_grad()


def _checkpoint(model: nn.Module, amp: AmpOptimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "amp": amp.state_dict()}, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("k", [3, 7])  # 7: right after a tolerated/backed-off overflow
def test_resume_is_identical(config: Config, k: int) -> None:
    model, amp = _fresh(config)
    full: list[tuple[bool, float]] = []
    _train(config, model, amp, range(STEPS), full)

    first, amp1 = _fresh(config)
    resumed: list[tuple[bool, float]] = []
    _train(config, first, amp1, range(k), resumed)
    blob = _checkpoint(first, amp1)
    del first, amp1

    second, amp2 = _fresh(config)
    saved = torch.load(io.BytesIO(blob), weights_only=True)
    second.load_state_dict(saved["model"])
    amp2.load_state_dict(saved["amp"])
    _train(config, second, amp2, range(k, STEPS), resumed)

    assert resumed == full
    assert not all(stepped for stepped, _ in full)  # the stream did contain skipped steps
    for a, b in zip(second.parameters(), model.parameters()):
        assert torch.equal(a, b)
    if config.master:
        for a, b in zip(amp2._master.masters(), amp._master.masters()):  # type: ignore[union-attr]
            assert torch.equal(a, b)
    assert amp2.stats() == amp.stats()


def test_resume_without_scaler_state_diverges() -> None:
    """Negative control: dropping the scaler state changes the run (the test above can fail)."""
    config = CONFIGS[0]
    model, amp = _fresh(config)
    full: list[tuple[bool, float]] = []
    _train(config, model, amp, range(STEPS), full)
    first, amp1 = _fresh(config)
    resumed: list[tuple[bool, float]] = []
    _train(config, first, amp1, range(7), resumed)
    state = amp1.state_dict()
    second, amp2 = _fresh(config)
    second.load_state_dict(first.state_dict())
    amp2.optimizer.load_state_dict(state["optimizer"])  # optimizer only, scaler left fresh
    _train(config, second, amp2, range(7, STEPS), resumed)
    assert resumed != full
