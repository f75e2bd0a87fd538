"""Bit-exact agreement with torch.amp.GradScaler on CPU.

The same gradient stream (Inf/NaN injected at chosen steps) is fed to GradScaler and to
LossScaler / AmpOptimizer; scale trajectory, skipped steps and final parameters must be equal
bit for bit, for SGD and Adam (plain and fused), with and without accumulation and clipping.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from amp_rewrite.training import AmpOptimizer, LossScaler
from tests.training._stream import STEPS, inject, injected_steps, loss_of, make_model

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}
GROWTH_INTERVAL = 3  # small, so growth happens between the injected overflows
MAX_NORM = 0.5


@dataclass
class Trace:
    scales: list[float]
    skipped: list[int]
    params: list[torch.Tensor]


def _changed(before: list[torch.Tensor], model: nn.Module) -> bool:
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _scaler_loop(make_scaler, opt_name: str, accum: int, clip: bool) -> Trace:
    """The standard GradScaler training loop, with the scaler ``make_scaler()`` returns."""
    model = make_model()
    opt = OPTIMIZERS[opt_name](list(model.parameters()))
    scaler = make_scaler()
    scales, skipped = [], []
    for step in range(STEPS):
        for micro in range(accum):
            loss = loss_of(model, step, micro)
            scaler.scale(loss / accum if accum > 1 else loss).backward()
            inject(model[0].weight, step, micro, accum)
        if clip:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        if not _changed(before, model):
            skipped.append(step)
        scales.append(scaler.get_scale())
    return Trace(scales, skipped, [p.detach() for p in model.parameters()])


def run_gradscaler(opt_name: str, accum: int, clip: bool) -> Trace:
    return _scaler_loop(lambda: torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL),
                        opt_name, accum, clip)


def run_loss_scaler(opt_name: str, accum: int, clip: bool) -> Trace:
    """LossScaler swapped in for GradScaler in the very same loop."""
    return _scaler_loop(lambda: LossScaler("cpu", growth_interval=GROWTH_INTERVAL),
                        opt_name, accum, clip)


def run_amp_optimizer(opt_name: str, accum: int, clip: bool) -> Trace:
    model = make_model()
    amp = AmpOptimizer(OPTIMIZERS[opt_name](list(model.parameters())),
                       scaler=LossScaler(growth_interval=GROWTH_INTERVAL),
                       accumulation_steps=accum)
    scales, skipped = [], []
    for step in range(STEPS):
        for micro in range(accum):
            amp.backward(loss_of(model, step, micro))
            inject(model[0].weight, step, micro, accum)
        assert amp.at_boundary
        if clip:
            amp.clip_grad_norm_(MAX_NORM)
        if not amp.step():
            skipped.append(step)
        amp.zero_grad()
        scales.append(amp.get_scale())
    assert amp.skipped_steps == len(skipped)
    return Trace(scales, skipped, [p.detach() for p in model.parameters()])


RUNNERS = {"loss_scaler": run_loss_scaler, "amp_optimizer": run_amp_optimizer}


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("accum", [1, 3], ids=["accum1", "accum3"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("api", list(RUNNERS))
def test_bit_exact_with_gradscaler(api: str, opt_name: str, accum: int, clip: bool) -> None:
    ref = run_gradscaler(opt_name, accum, clip)
    got = RUNNERS[api](opt_name, accum, clip)
    # The oracle for skipping is the injection schedule, not either implementation.
    assert ref.skipped == injected_steps()
    assert got.skipped == ref.skipped
    assert got.scales == ref.scales
    assert len(set(ref.scales)) > 2  # the trajectory both grew and backed off
    for a, b in zip(got.params, ref.params):
        assert torch.equal(a, b)
        assert torch.isfinite(a).all()


def test_default_options_match_gradscaler_defaults() -> None:
    """Defaults: init 2**16, growth x2 after 2000 clean steps, backoff x0.5."""
    ours, ref = LossScaler(), torch.amp.GradScaler("cpu")
    assert ours.get_scale() == ref.get_scale() == 2.0**16
    sd_ours, sd_ref = ours.state_dict(), ref.state_dict()
    assert {k: sd_ours[k] for k in sd_ref} == sd_ref


def test_gradscaler_state_dict_loads_into_loss_scaler() -> None:
    ref = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    ref.load_state_dict({**ref.state_dict(), "_growth_tracker": 5})
    ours = LossScaler(hysteresis=2)
    ours.load_state_dict(ref.state_dict())
    sd = ours.state_dict()
    assert (sd["scale"], sd["growth_interval"], sd["_growth_tracker"]) == (1024.0, 7, 5)
    assert sd["hysteresis"] == 2  # an extra the GradScaler dict does not carry is kept
