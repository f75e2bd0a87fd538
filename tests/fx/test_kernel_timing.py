"""Kernel choices by measurement (``amp_rewrite/fx/kernel_timing.py``) and their use for the
fused pointwise regions (``amp_rewrite/fx/pointwise.py``).

The candidates here have known costs (a sleep of a known length against nothing), so the
right answer is known without the code under test; the region test compares the values with
the region's own eager ops.
"""
from __future__ import annotations

import time

import pytest
import torch

from amp_rewrite.fx import kernel_timing, pointwise


@pytest.fixture(autouse=True)
def _fresh_choices():
    kernel_timing.forget()
    yield
    kernel_timing.forget()


def _sleep(ms: float):
    return lambda: time.sleep(ms / 1e3)


def test_the_clearly_faster_candidate_wins_and_is_timed_once():
    calls = {"fast": 0}

    def fast() -> None:
        calls["fast"] += 1
    choice = kernel_timing.choose("kernel", "k1", {"slow": _sleep(5), "fast": fast}, "slow")
    assert choice.chosen == "fast" and choice.ms["slow"] >= 5 > choice.ms["fast"]
    # a 5 ms sleep against nothing is decisive after the first timed round
    assert choice.rounds == 1 and calls["fast"] == 2  # warm-up and one round
    assert kernel_timing.choose("kernel", "k1", {"fast": fast}, "fast") is choice
    assert calls["fast"] == 2
    assert kernel_timing.choices("kernel")[0]["cpu"] == kernel_timing.cpu_model()
    assert kernel_timing.choices("pointwise") == []


def test_a_near_tie_keeps_the_default():
    # 2.0 against 2.2 ms: faster by 1.1x, inside MARGIN (1.2x)
    choice = kernel_timing.choose("kernel", "k2", {"default": _sleep(2.2), "other": _sleep(2.0)},
                                  "default")
    assert choice.chosen == "default" and choice.rounds >= kernel_timing.MIN_ROUNDS


def test_a_candidate_that_fails_is_never_chosen():
    def broken() -> None:
        raise RuntimeError("no kernel for this dtype")
    choice = kernel_timing.choose("kernel", "k3", {"low": _sleep(3), "fp32": broken}, "low")
    assert choice.chosen == "low" and choice.ms["fp32"] != choice.ms["fp32"]  # NaN
    lost_default = kernel_timing.choose("kernel", "k4", {"low": broken, "fp32": _sleep(1)}, "low")
    assert lost_default.chosen == "fp32"
    nothing_runs = kernel_timing.choose("kernel", "k5", {"low": broken}, "low")
    assert nothing_runs.chosen == "low" and nothing_runs.rounds == 0


@pytest.mark.parametrize("grad", [False, True])
def test_a_region_runs_what_its_timing_chose_with_the_eager_values(monkeypatch, grad):
    monkeypatch.setenv(pointwise.BACKEND_ENV, "inductor")
    aten = torch.ops.aten

    def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        low = aten._to_copy.default(aten.mul.Tensor(x, y), dtype=torch.bfloat16)
        return aten.add.Tensor(aten._to_copy.default(low, dtype=torch.float32), y)

    region = pointwise.FusedRegion(torch.fx.symbolic_trace(chain))
    x = torch.randn(64, 256, requires_grad=grad)
    y = torch.randn(64, 256)
    with torch.set_grad_enabled(grad):
        out = region(x, y)
    if pointwise.compile_stats()["compiles"] == 0:
        pytest.skip("Inductor cannot compile on this machine")
    measured = region.stats["measured"]
    assert len(measured) == 1 and measured[0]["kind"] == "pointwise"
    assert measured[0]["chosen"] in ("compiled", "eager")
    assert set(measured[0]["ms"]) == {"compiled", "eager"}
    key = next(k for k in pointwise._COMPILED if k[0] == region.signature and k[2] == grad)
    assert (pointwise._COMPILED[key] is None) is (measured[0]["chosen"] == "eager")
    torch.testing.assert_close(out, chain(x, y), rtol=0, atol=0)
    if grad:  # the timing ran its own backward on detached inputs: none reached x
        assert x.grad is None
        out.sum().backward()
        torch.testing.assert_close(x.grad, y, rtol=0, atol=0)
