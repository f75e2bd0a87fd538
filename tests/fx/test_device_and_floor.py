"""Device kernel facts, the autocast floor, mask sentinels and the tanh-GELU fusion.

Oracles: the FP32 module's outputs, ``torch.autocast(device_type="cpu")`` on the same inputs
(conversions executed, dtypes), and hand-derived expectations of which nodes run low.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import amp_rewrite
from tests.models.measure import count_conversions, relative_error

from .conftest import casts, out_dtype

LOW = [torch.float16, torch.bfloat16]


class PostNorm(nn.Module):
    """Embedding → LayerNorm → (linear + residual → LayerNorm) × 2: BERT's residual stream."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(32, d)
        self.ln0 = nn.LayerNorm(d)
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.ln0(self.emb(ids))
        for fc, ln in zip(self.fc, self.ln):
            h = ln(h + fc(h))
        return h


class PreNorm(nn.Module):
    """Conv stem → (LayerNorm → linear, added to the stream) × 2: a vision encoder's stream."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv1d(4, d, 1)
        self.ln = nn.ModuleList(nn.LayerNorm(d) for _ in range(2))
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x).transpose(1, 2)
        for ln, fc in zip(self.ln, self.fc):
            h = h + fc(ln(h))
        return h


def _autocast_conversions(module: nn.Module, args: tuple, dtype: torch.dtype) -> int:
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=dtype):
        return count_conversions(lambda: module(*args))[0]


def _conversions(gm: torch.fx.GraphModule, args: tuple) -> int:
    with torch.no_grad():
        return count_conversions(lambda: gm(*args))[0]


def _layer_norms(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.layer_norm.default]


@pytest.mark.parametrize("dtype", LOW)
def test_layer_norm_on_cpu_runs_low_and_reads_its_fp32_weights_uncast(dtype):
    module, args = PreNorm().eval(), (torch.randn(2, 4, 8),)
    gm = amp_rewrite.rewrite(module, args, dtype=dtype, keep_io_types=False, fuse=False)
    norms = _layer_norms(gm)
    assert norms and all(out_dtype(n) == dtype for n in norms)
    cast_sources = {c.args[0].target for c in casts(gm) if c.args[0].op == "get_attr"}
    assert not {t for t in cast_sources if ".ln." in f".{t}"}  # weights read as fp32
    assert gm.amp_report["device"] == "cpu"
    assert _conversions(gm, args) <= _autocast_conversions(module, args, dtype)
    with torch.no_grad():
        assert relative_error(gm(*args), module(*args)) < 2e-2


def test_on_cuda_layer_norm_stays_fp32_as_cuda_autocast_keeps_it():
    module, args = PreNorm().eval(), (torch.randn(2, 4, 8),)
    gm = amp_rewrite.rewrite(module, args, device="cuda", keep_io_types=False)
    assert all(out_dtype(n) == torch.float32 for n in _layer_norms(gm))
    assert gm.amp_report["device"] == "cuda"


@pytest.mark.parametrize("dtype", LOW)
def test_autocast_floor_keeps_a_stream_fp32_where_autocast_does(dtype):
    module, args = PostNorm().eval(), (torch.randint(0, 32, (2, 8)),)
    # the plan's conversions (the CPU GEMM emulation of fx/lowering.py adds operand casts)
    gm = amp_rewrite.rewrite(module, args, dtype=dtype, keep_io_types=False, emulate_gemms=False)
    with torch.no_grad(), torch.autocast(device_type="cpu", dtype=dtype):
        autocast_out = module(*args)
    assert autocast_out.dtype == torch.float32  # the embedding's fp32 promotes the stream
    assert all(out_dtype(n) == torch.float32 for n in _layer_norms(gm))
    assert _conversions(gm, args) <= _autocast_conversions(module, args, dtype)
    with torch.no_grad():
        ours, ref = gm(*args), module(*args)
    assert relative_error(ours, ref) <= 1.5 * relative_error(autocast_out, ref) + 1e-7


def test_without_the_floor_the_min_cut_alone_casts_the_stream_down_once():
    module, args = PostNorm().eval(), (torch.randint(0, 32, (2, 8)),)
    floor = amp_rewrite.rewrite(module, args, keep_io_types=False)
    bare = amp_rewrite.rewrite(module, args, keep_io_types=False, autocast_floor=False)
    assert all(out_dtype(n) == torch.float16 for n in _layer_norms(bare)[1:])
    assert bare.amp_report["casts_inserted"] < floor.amp_report["casts_inserted"]
    reasons = [r["reason"] for r in floor.amp_report["nodes"]]
    assert any("autocast floor" in r for r in reasons)


class Masked(nn.Module):
    """Scores plus a mask built with ``torch.finfo(float32).min``, the way HF builds them."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        q = self.q(x)
        scores = q @ q.transpose(-1, -2)
        scores = scores.masked_fill(~keep, torch.finfo(torch.float32).min)
        return torch.softmax(scores, dim=-1) @ q


@pytest.mark.parametrize("dtype", LOW)
def test_finfo_min_mask_is_rebuilt_with_the_low_dtypes_min(dtype):
    module = Masked().eval()
    keep = torch.ones(2, 6, 6, dtype=torch.bool)
    keep[:, :, 4:] = False
    args = (torch.randn(2, 6, 8), keep)
    gm = amp_rewrite.rewrite(module, args, dtype=dtype, fuse=False)
    fill = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.masked_fill.Scalar)
    assert out_dtype(fill) == dtype and fill.args[2] == -torch.finfo(dtype).max
    with torch.no_grad():
        out, ref = gm(*args), module(*args)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < (5e-3 if dtype == torch.float16 else 3e-2)


def test_softmax_with_an_fp32_dtype_reads_fp32_on_cpu():
    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(8, 8)

        def forward(self, x):
            q = self.q(x)
            return F.softmax(q @ q.transpose(-1, -2), dim=-1, dtype=torch.float32).to(q.dtype)

    module, args = Scores().eval(), (torch.randn(2, 4, 8),)
    gm = amp_rewrite.rewrite(module, args, keep_io_types=False, emulate_gemms=False)
    reasons = {r["name"]: r["reason"] for r in gm.amp_report["nodes"]}
    assert "converts its input" in " ".join(reasons.values())
    assert _conversions(gm, args) <= _autocast_conversions(module, args, torch.float16)


class NewGelu(nn.Module):
    """Hugging Face's gelu_new between two linears (GPT-2's MLP)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.down(h)


@pytest.mark.parametrize("dtype", LOW)
def test_spelled_out_tanh_gelu_becomes_the_fused_kernel_and_runs_low(dtype):
    module, args = NewGelu().eval(), (torch.randn(4, 8) * 30,)  # |x| > 40: x**3 overflows fp16
    gm = amp_rewrite.rewrite(module, args, dtype=dtype, keep_io_types=False,
                             emulate_gemms=False)
    nodes = _nodes_with_regions(gm)  # pointwise fusion puts the gelu into a region
    assert torch.ops.aten.pow.Tensor_Scalar not in [n.target for n in nodes]
    gelu = next(n for n in nodes if n.target is torch.ops.aten.gelu.default)
    assert gelu.kwargs["approximate"] == "tanh" and out_dtype(gelu) == dtype
    with torch.no_grad():
        out, ref = gm(*args), module(*args)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < (5e-3 if dtype == torch.float16 else 3e-2)
    gm(*args).float().sum().backward()
    assert gm.get_parameter("up.weight").grad.dtype == torch.float32


def test_fuse_false_leaves_the_spelled_out_tanh_gelu():
    module, args = NewGelu().eval(), (torch.randn(4, 8),)
    gm = amp_rewrite.rewrite(module, args, fuse=False)
    targets = [n.target for n in gm.graph.nodes]
    assert torch.ops.aten.gelu.default not in targets and torch.ops.aten.tanh.default in targets
    assert gm.amp_report["fused"]["patterns"] == {}


def _nodes_with_regions(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    regions = [m.region for m in gm.children() if isinstance(getattr(m, "region", None),
                                                             torch.fx.GraphModule)]
    return [*gm.graph.nodes, *(n for r in regions for n in r.graph.nodes)]


def test_tanh_gelu_fusion_is_exact_in_fp32():
    module, args = NewGelu().eval(), (torch.randn(4, 8) * 3,)
    from amp_rewrite.fx.capture import capture
    from amp_rewrite.fx.fusion import FuseTanhGelu

    gm = capture(module, args, None)
    assert FuseTanhGelu()(gm).modified
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), module(*args), rtol=1e-5, atol=1e-5)
    assert not FuseTanhGelu()(gm).modified


class GroupedConv1d(nn.Module):
    """wav2vec 2.0's positional convolution shape: 32 channels in 4 groups, kernel 8. On CPUs
    with AMX, torch 2.13's bf16 kernel for it is off by more than 100%."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(32, 32, 8, padding=4, groups=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_grouped_conv1d_is_within_tolerance_of_fp32_on_this_cpu(dtype):
    """Whatever this CPU's low conv kernels do, the rewrite's output is the FP32 module's
    within the dtype's tolerance (on a CPU whose kernel is wrong, the probe keeps it fp32)."""
    model = GroupedConv1d().eval()
    x = torch.randn(2, 32, 50, generator=torch.Generator().manual_seed(1))
    gm = amp_rewrite.rewrite(model, (x,), dtype=dtype, fuse=False, emulate_gemms=False)
    with torch.no_grad():
        assert relative_error(gm(x), model(x)) < (5e-3 if dtype == torch.float16 else 3e-2)


def test_a_wrong_low_conv_kernel_is_found_by_the_probe_and_kept_fp32(monkeypatch):
    """The probe compares the low kernel with float32 on the same rounded operands: a
    kernel whose low results are off (simulated here) keeps the node fp32, with the reason."""
    from amp_rewrite.fx import guards

    conv1d = torch.ops.aten.conv1d.default

    class Broken:
        def __call__(self, x, *args, **kwargs):
            out = conv1d(x, *args, **kwargs)
            return out * 1.5 if x.dtype == torch.bfloat16 else out

    model = GroupedConv1d().eval()
    model.conv = nn.Conv1d(32, 32, 8, padding=4)  # one group: right on every CPU we know
    x = torch.randn(2, 32, 50)
    gm = amp_rewrite.rewrite(model, (x,), dtype="bf16", fuse=False, emulate_gemms=False)
    node = next(n for n in gm.graph.nodes if n.target is conv1d)
    guards._CONV_ERRORS.clear()
    right = guards._low_conv_error(node, conv1d, torch.bfloat16)
    guards._CONV_ERRORS.clear()
    wrong = guards._low_conv_error(node, Broken(), torch.bfloat16)
    guards._CONV_ERRORS.clear()
    threshold = guards._WRONG_KERNEL_ULPS * torch.finfo(torch.bfloat16).eps
    assert right < threshold < 0.3 < wrong

    monkeypatch.setattr(guards, "_low_conv_error", lambda *a: 0.5)
    kept = amp_rewrite.rewrite(model, (x,), dtype="bf16", fuse=False, emulate_gemms=False)
    record = next(r for r in kept.amp_report["nodes"] if r["op_type"].startswith("conv1d"))
    assert record["precision"] == "high" and "computes wrong results" in record["reason"]
