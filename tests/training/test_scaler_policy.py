"""Scale policy (growth, backoff, hysteresis, min/max, static, check-only) against a
pure-Python oracle and hand-derived trajectories."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from amp_rewrite.training import LossScaler


def drive(scaler: LossScaler, overflows: list[bool]) -> tuple[list[float], list[bool]]:
    """Feed one Inf-or-clean gradient per step; return the scale after each update and
    whether each step was applied."""
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.0)
    scales, applied = [], []
    for overflow in overflows:
        scaler.scale(param.sum()).backward()
        if overflow:
            with torch.no_grad():
                param.grad[1] = math.inf
        calls = []
        opt.step = lambda *a, _c=calls, **k: _c.append(1)  # type: ignore[method-assign]
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
        applied.append(bool(calls))
    return scales, applied


def oracle(overflows: list[bool], *, init: float, growth: float, backoff: float,
           interval: int, hysteresis: int, lo: float | None, hi: float | None,
           dynamic: bool = True) -> list[float]:
    """The policy written out in plain Python, independently of LossScaler."""
    scale, tracker, budget, out = init, 0, hysteresis, []
    for overflow in overflows:
        if dynamic and overflow:
            tracker, budget = 0, max(budget - 1, 0)
            if budget == 0:
                scale *= backoff
        elif dynamic:
            tracker, budget = tracker + 1, hysteresis
            if tracker == interval:
                scale, tracker = scale * growth, 0
        if lo is not None:
            scale = max(scale, lo)
        if hi is not None:
            scale = min(scale, hi)
        out.append(scale)
    return out


def test_hysteresis_hand_derived() -> None:
    # hysteresis 2: the first overflow of a run is tolerated, later consecutive ones back off;
    # a clean step restores the budget. Every overflowing step is skipped.
    flags = [True, True, True, False, True, False, False]
    scales, applied = drive(LossScaler(init_scale=8.0, growth_interval=2, hysteresis=2), flags)
    assert scales == [8.0, 4.0, 2.0, 2.0, 2.0, 2.0, 4.0]
    assert applied == [not f for f in flags]


def test_min_max_scale_hand_derived() -> None:
    flags = [False] * 4 + [True] * 5
    scaler = LossScaler(init_scale=4.0, growth_interval=1, min_scale=1.0, max_scale=16.0)
    scales, _ = drive(scaler, flags)
    assert scales == [8.0, 16.0, 16.0, 16.0, 8.0, 4.0, 2.0, 1.0, 1.0]


def test_static_scale_keeps_value_and_skips() -> None:
    flags = [False, True, False, False, True, True]
    scaler = LossScaler(init_scale=128.0, growth_interval=1, dynamic=False)
    scales, applied = drive(scaler, flags)
    assert scales == [128.0] * len(flags)
    assert applied == [not f for f in flags]
    assert scaler.skipped_steps == 3
    assert scaler.counters()["updates"] == len(flags)


def test_check_only_mode_does_not_touch_the_loss() -> None:
    scaler = LossScaler(init_scale=1.0, dynamic=False)
    loss = torch.tensor(3.0, requires_grad=True)
    assert scaler.scale(loss) is loss
    _, applied = drive(scaler, [False, True, False])
    assert applied == [True, False, True]


def test_disabled_scaler_is_a_pass_through() -> None:
    scaler = LossScaler(enabled=False)
    _, applied = drive(scaler, [True, False])
    assert applied == [True, True]
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}


@settings(max_examples=40, derandomize=True, deadline=None)
@given(
    flags=st.lists(st.booleans(), min_size=1, max_size=30),
    interval=st.integers(1, 4),
    hysteresis=st.integers(1, 3),
    bounds=st.sampled_from([(None, None), (0.25, None), (None, 64.0), (0.5, 32.0)]),
    backoff=st.sampled_from([0.5, 0.25, 0.3]),
    growth=st.sampled_from([2.0, 1.5, 4.0]),
)
def test_policy_matches_oracle(flags: list[bool], interval: int, hysteresis: int,
                               bounds: tuple[float | None, float | None], backoff: float,
                               growth: float) -> None:
    lo, hi = bounds
    kw = dict(growth_interval=interval, hysteresis=hysteresis, min_scale=lo, max_scale=hi,
              backoff_factor=backoff, growth_factor=growth)
    scales, applied = drive(LossScaler(init_scale=4.0, **kw), flags)
    expected = oracle(flags, init=4.0, growth=growth, backoff=backoff, interval=interval,
                      hysteresis=hysteresis, lo=lo, hi=hi)
    # The scale is float32 on the device; the oracle's float64 products are rounded once.
    assert scales == [float(torch.tensor(e, dtype=torch.float32)) for e in expected]
    assert applied == [not f for f in flags]


def test_multiple_optimizers_share_one_update() -> None:
    """As in GradScaler: one overflowing optimizer backs the shared scale off once."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt_a, opt_b = torch.optim.SGD([a], lr=0.1), torch.optim.SGD([b], lr=0.1)
    scaler = LossScaler(init_scale=16.0)
    scaler.scale(a.sum() + b.sum()).backward()
    with torch.no_grad():
        b.grad[0] = math.nan
    scaler.step(opt_a)
    scaler.step(opt_b)
    scaler.update()
    assert scaler.get_scale() == 8.0
    assert torch.equal(a.detach(), torch.full((2,), 0.9)) and torch.equal(b.detach(),
                                                                         torch.ones(2))


@pytest.mark.parametrize("new_scale", [32.0, torch.tensor(32.0)])
def test_update_with_explicit_scale(new_scale: float | torch.Tensor) -> None:
    scaler = LossScaler(init_scale=4.0)
    drive(scaler, [False])
    scaler.update(new_scale)
    assert scaler.get_scale() == 32.0
