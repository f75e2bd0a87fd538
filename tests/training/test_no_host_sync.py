"""No device-to-host synchronisation in scale/unscale_/update; at most one in step (none with
a fused optimizer unless its result is used as a bool).

On CPU there is no device sync to catch, so the proxy is Python-level: every way of reading a
tensor's value on the host (item, bool, float, int, index, tolist, numpy) is patched to raise or
count while the scaler runs. On a CUDA machine, test_cuda_sync_debug_mode checks the real thing
with torch.cuda.set_sync_debug_mode("error").
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from amp_rewrite.training import AmpOptimizer, LossScaler

_READERS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__",
            "__array__")


class HostRead(AssertionError):
    pass


@contextmanager
def host_reads(mode: str) -> Iterator[list[str]]:
    """Patch every host-read path of torch.Tensor; ``mode`` 'raise' or 'count'."""
    seen: list[str] = []
    saved = {name: torch.Tensor.__dict__.get(name) for name in _READERS}

    def patched(name: str):  # noqa: ANN202
        original = getattr(torch.Tensor, name)

        def reader(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            seen.append(name)
            if mode == "raise":
                raise HostRead(f"host read via Tensor.{name}")
            return original(self, *args, **kwargs)
        return reader

    try:
        for name in _READERS:
            setattr(torch.Tensor, name, patched(name))
        yield seen
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def _setup(fused: bool) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    if fused:
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    # Non-fused Adam reads its own step counter with .item() on CPU; SGD reads nothing, so
    # any read counted below is the scaler's.
    return model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _backward(model: torch.nn.Linear, scaler: LossScaler, overflow: bool) -> None:
    scaler.scale(model(torch.randn(5, 4)).square().mean()).backward()
    if overflow:
        with torch.no_grad():
            model.weight.grad[0, 0] = math.inf


@pytest.mark.parametrize("overflow", [False, True])
def test_state_stays_on_device_through_unscale_and_update(overflow: bool) -> None:
    model, opt = _setup(fused=False)
    scaler = LossScaler(growth_interval=1, hysteresis=2, min_scale=1.0, max_scale=2.0**20)
    _backward(model, scaler, overflow)
    with host_reads("raise"):
        scaler.unscale_(opt)
        flag = scaler._records[id(opt)].found_inf
    assert isinstance(flag, torch.Tensor) and flag.shape == () and flag.dtype == torch.float32
    scaler.step(opt)  # the generic step reads the flag once (checked below)
    with host_reads("raise"):
        scaler.update()
    tensors = scaler.state_tensors()
    assert set(tensors) == {"scale", "growth_tracker", "hysteresis_tracker", "skipped_steps",
                            "updates"}
    assert all(isinstance(t, torch.Tensor) and t.shape == () for t in tensors.values())
    assert scaler.scale_tensor() is tensors["scale"]
    assert float(flag) == (1.0 if overflow else 0.0)
    assert scaler.get_scale() == (2.0**16 if overflow else 2.0**17)  # hysteresis 2 tolerates


@pytest.mark.parametrize("overflow", [False, True])
def test_generic_step_reads_the_flag_exactly_once(overflow: bool) -> None:
    model, opt = _setup(fused=False)
    scaler = LossScaler()
    _backward(model, scaler, overflow)
    with host_reads("count") as seen:
        scaler.step(opt)
    assert seen == ["item"]


@pytest.mark.parametrize("overflow", [False, True])
def test_fused_optimizer_step_makes_no_host_read(overflow: bool) -> None:
    model, opt = _setup(fused=True)
    scaler = LossScaler()
    _backward(model, scaler, overflow)
    before = model.weight.detach().clone()
    with host_reads("raise"):
        scaler.step(opt)
        scaler.update()
    assert torch.equal(model.weight.detach(), before) == overflow  # skipped on the device


@pytest.mark.parametrize("overflow", [False, True])
def test_amp_optimizer_fused_step_reads_only_when_its_result_is_used(overflow: bool) -> None:
    model, _ = _setup(fused=False)
    amp = AmpOptimizer(torch.optim.Adam(model.parameters(), fused=True), accumulation_steps=2)
    with host_reads("raise"):
        for _ in range(2):
            amp.backward(model(torch.randn(5, 4)).square().mean())
        if overflow:
            with torch.no_grad():
                model.weight.grad[0, 0] = math.inf
        amp.unscale_()
        result = amp.step()
        amp.zero_grad()
    with host_reads("count") as seen:
        assert bool(result) is (not overflow)
        assert bool(result) is (not overflow)
    assert seen == ["item"]  # once, when first used as a bool
    assert (result == (not overflow)) and float(result.found_inf) == float(overflow)


def test_amp_optimizer_generic_step_reads_once_inside_step() -> None:
    model, opt = _setup(fused=False)
    amp = AmpOptimizer(opt)
    amp.backward(model(torch.randn(5, 4)).square().mean())
    with host_reads("count") as seen:
        result = amp.step()
    assert seen == ["item"]  # the unfused optimizer must know before it steps
    with host_reads("raise"):
        assert bool(result) is True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_sync_debug_mode() -> None:
    model = torch.nn.Linear(64, 64).cuda()
    opt = torch.optim.Adam(model.parameters(), fused=True)
    scaler = LossScaler(hysteresis=2, min_scale=1.0)
    x = torch.randn(8, 64, device="cuda")

    def iteration() -> None:
        scaler.scale(model(x).square().mean()).backward()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    iteration()  # warm-up: the optimizer creates its state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            iteration()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert scaler.get_scale() == 2.0**16 and scaler.skipped_steps == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_amp_optimizer_step_does_not_synchronise() -> None:
    model = torch.nn.Linear(64, 64).cuda()
    amp = AmpOptimizer(torch.optim.AdamW(model.parameters(), fused=True))
    x = torch.randn(8, 64, device="cuda")
    for _ in range(2):  # warm-up: optimizer state and scaler state exist
        amp.backward(model(x).square().mean())
        amp.step()
        amp.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            amp.backward(model(x).square().mean())
            result = amp.step()
            amp.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert result and amp.scaler.skipped_steps == 0
