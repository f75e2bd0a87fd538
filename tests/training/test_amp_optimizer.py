"""AmpOptimizer: master weights, accumulation, bf16, fx GraphModules with in-graph casts."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from amp_rewrite.training import AmpOptimizer, LossScaler


# ------------------------------------------------------------------ master weights

def _regression(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=gen)
    w_true = 4.0 + 0.05 * torch.randn(1, 16, generator=gen)
    return x, x @ w_true.T, torch.full((1, 16), 4.0)


def _eval(weight: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> float:
    return F.mse_loss(x @ weight.float().T, y).item()


def test_master_weights_keep_updates_below_half_an_fp16_ulp() -> None:
    """The paper's first technique: every lr*grad (at most ~1e-3 here) is below half an fp16 ulp
    of a weight near 4 (2**-9), so stepping fp16 weights directly loses every update; FP32
    master weights keep them and track the FP32 run."""
    x, y, w0 = _regression()
    lr, steps = 5e-3, 150

    w32 = w0.clone().requires_grad_()                      # oracle: everything in float32
    opt32 = torch.optim.SGD([w32], lr=lr)
    w16 = w0.half().requires_grad_()                       # fp16 weights, no masters
    opt16 = torch.optim.SGD([w16], lr=lr)
    model = nn.Linear(16, 1, bias=False).half()           # fp16 weights + FP32 masters
    with torch.no_grad():
        model.weight.copy_(w0)
    amp = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=lr), master_weights=True)
    for _ in range(steps):
        opt32.zero_grad()
        F.mse_loss(x @ w32.T, y).backward()
        opt32.step()
        opt16.zero_grad()
        F.mse_loss((x.half() @ w16.T).float(), y).backward()
        opt16.step()
        amp.backward(F.mse_loss(model(x.half()).float(), y))
        assert amp.step()
        amp.zero_grad()

    initial, final32 = _eval(w0, x, y), _eval(w32.detach(), x, y)
    assert torch.equal(w16.detach(), w0.half())            # fp16-only: not one update landed
    master = amp.optimizer.param_groups[0]["params"][0]
    final_amp = _eval(master.detach(), x, y)
    assert final32 < 0.1 * initial
    assert abs(final_amp - final32) <= 0.05 * final32      # fp16 forward noise only
    assert master.dtype == torch.float32
    assert torch.equal(model.weight.detach(), master.detach().half())


@pytest.mark.parametrize("fused", [False, True])
def test_master_weights_skip_leaves_masters_and_model_unchanged(fused: bool) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    amp = AmpOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2, fused=fused),
                       master_weights=True)
    before = [p.detach().clone() for p in model.parameters()]
    masters = [m.detach().clone() for m in amp._master.masters()]  # type: ignore[union-attr]
    amp.backward(model(torch.full((3, 4), 1e4, dtype=torch.half)).float().sum() * 1e4)
    assert not amp.step()                                    # fp16 overflow -> Inf -> skipped
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.equal(b, m)
               for b, m in zip(masters, amp._master.masters()))  # type: ignore[union-attr]
    assert amp.get_scale() == 2.0**15
    amp.zero_grad()
    amp.backward(model(torch.ones(3, 4, dtype=torch.half)).float().mean())
    assert amp.step()
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


# -------------------------------------------------------------------- accumulation

def test_accumulation_equals_one_large_batch() -> None:
    """4 micro-batches of 8 == one batch of 32 in plain FP32 (oracle), up to summation order."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(32, 6, generator=gen), torch.randn(32, 2, generator=gen)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    amp = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                       accumulation_steps=4)
    for _ in range(5):
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        for chunk_x, chunk_y in zip(x.chunk(4), y.chunk(4)):
            assert not amp.at_boundary
            amp.backward(F.mse_loss(model(chunk_x), chunk_y))
        assert amp.at_boundary and amp.micro_batches == 4
        assert amp.step()
        amp.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_unscale_and_check_once_per_optimizer_step() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    amp = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=3)
    calls = []
    original = amp.scaler._check
    amp.scaler._check = lambda *a, **k: calls.append(1) or original(*a, **k)  # type: ignore
    for _ in range(2):
        for _ in range(3):
            amp.backward(model(torch.ones(2, 3)).sum())
        amp.clip_grad_norm_(1.0)
        amp.step()
        amp.zero_grad()
    assert len(calls) == 2


# ------------------------------------------------------------------------- bf16

def test_bf16_defaults_no_scaling_but_skipping() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    amp = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16)
    assert not amp.scaler.scaling and amp.get_scale() == 1.0
    x = torch.randn(3, 4)
    amp.backward(model(x).square().mean())
    expected = torch.autograd.grad(model(x).square().mean(), model.weight)[0]
    assert torch.equal(model.weight.grad, expected)        # unscaled: same bits as plain
    with torch.no_grad():
        model.weight.grad[0, 0] = math.nan
    before = model.weight.detach().clone()
    assert not amp.step() and torch.equal(model.weight.detach(), before)
    assert amp.skipped_steps == 1


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_skips_an_inf_gradient_with_fused_and_unfused_adamw(fused) -> None:
    model = nn.Linear(4, 2)
    amp = AmpOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused),
                       dtype=torch.bfloat16)
    amp.backward(model(torch.randn(3, 4)).sum())
    with torch.no_grad():
        model.bias.grad[1] = -math.inf
    before = [p.detach().clone() for p in model.parameters()]
    assert not amp.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_bf16_without_skipping_steps_through_nan() -> None:
    model = nn.Linear(4, 2)
    amp = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dtype=torch.bfloat16,
                       skip_nonfinite=False)
    amp.backward(model(torch.randn(3, 4)).sum())
    with torch.no_grad():
        model.weight.grad[0, 0] = math.nan
    assert amp.step()
    assert torch.isnan(model.weight).any()


def test_bf16_autocast_training_tracks_fp32() -> None:
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 8, generator=gen), torch.randn(64, 1, generator=gen)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        amp = AmpOptimizer(optimizer, dtype=dtype) if dtype != torch.float32 else None
        for _ in range(60):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp is not None):
                out = model(x)
            loss = F.mse_loss(out.float(), y)
            if amp is None:  # the float32 reference: a plain loop
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                continue
            amp.backward(loss)
            assert amp.step()
            amp.zero_grad()
        losses[dtype] = F.mse_loss(model(x), y).item()
    assert abs(losses[torch.bfloat16] - losses[torch.float32]) <= 0.05 * losses[torch.float32]


# ------------------------------------------- fx GraphModule with in-graph casts

class _CastNet(nn.Module):
    """What amp_rewrite's fx pass produces: FP32 parameters, fp16 compute via in-graph casts."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x.half(), self.fc1.weight.half(), self.fc1.bias.half()).relu()
        return F.linear(h, self.fc2.weight.half(), self.fc2.bias.half()).float()


def test_graph_module_with_in_graph_casts_trains_like_fp32() -> None:
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(128, 8, generator=gen), torch.randn(128, 2, generator=gen)
    torch.manual_seed(0)
    ref = _CastNet()
    gm = torch.fx.symbolic_trace(_CastNet())
    gm.load_state_dict(ref.state_dict())
    assert sum(n.target == "half" for n in gm.graph.nodes) == 5  # the casts are in the graph
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    amp = AmpOptimizer(torch.optim.Adam(gm.parameters(), lr=1e-2))
    initial = F.mse_loss(ref(x), y).item()
    for _ in range(80):
        ref_opt.zero_grad()  # oracle: the same architecture computed entirely in FP32
        F.mse_loss(_fp32_forward(ref, x), y).backward()
        ref_opt.step()
        amp.backward(F.mse_loss(gm(x), y))
        amp.step()
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in gm.parameters())
        amp.zero_grad()
    final32, final16 = F.mse_loss(_fp32_forward(ref, x), y).item(), F.mse_loss(gm(x), y).item()
    assert final32 < 0.9 * initial
    assert abs(final16 - final32) <= 0.02 * final32
    assert amp.optimizer_steps == 80 and amp.stats()["optimizer_steps"] == 80


def _fp32_forward(net: _CastNet, x: torch.Tensor) -> torch.Tensor:
    return net.fc2(net.fc1(x).relu())


def test_stats_for_logging() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    amp = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                       scaler=LossScaler(init_scale=256.0, growth_interval=2))
    for step in range(5):
        amp.backward(model(torch.ones(2, 3)).sum())
        if step == 1:
            with torch.no_grad():
                model.bias.grad.fill_(math.inf)
        amp.step()
        amp.zero_grad()
    # steps: clean (tracker 1), inf (backoff 128), clean, clean (grow 256), clean (tracker 1)
    assert amp.stats() == {"scale": 256.0, "skipped_steps": 1, "growth_tracker": 1,
                           "optimizer_steps": 5}
