"""Fusion on the torch path: pattern fusion before the plan, pointwise regions after it.

Oracles: the unfused captured graph in FP32 (each pattern must compute the same), the FP32
model and ``torch.autocast`` (zoo models), the eagerly run regions (compiled regions), and
the ``fuse=False`` rewrite.
"""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import amp_rewrite
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import pointwise
from amp_rewrite.fx.capture import capture, refresh_fake_values
from amp_rewrite.fx.fusion import FUSED_TAG, FuseAttention, FuseNorms, FuseTanhGelu
from amp_rewrite.fx.pointwise import FusedRegion
from amp_rewrite.training import AmpOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")
aten = torch.ops.aten


def _targets(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _fused(module: nn.Module, args: tuple, fusion, capture_mode: str = "export"):
    """(unfused captured graph, fused copy) after running ``fusion`` on the copy."""
    gm = capture(module.eval(), args, mode=capture_mode)
    fused = copy.deepcopy(gm)
    assert fusion(fused).modified
    refresh_fake_values(fused)
    return gm, fused


def _assert_same(gm, fused, args, atol=2e-6):
    with torch.no_grad():
        torch.testing.assert_close(fused(*args), gm(*args), atol=atol, rtol=1e-5)


class Attention(nn.Module):
    """Explicit attention in the spellings models use."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style, self.drop = style, nn.Dropout(0.1)

    def forward(self, q, k, v, mask):
        d = q.shape[-1]
        if self.style == "scale_on_q":
            scores = (q * d ** -0.5) @ k.transpose(-1, -2) + mask
        elif self.style == "div":
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d) + mask
        elif self.style == "causal_fill":
            causal = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1)
            scores = (q @ k.transpose(-2, -1) * d ** -0.5).masked_fill(causal, float("-inf"))
        elif self.style == "bmm":
            b, h, s, _ = q.shape
            qf, kf, vf = (t.reshape(b * h, s, d) for t in (q, k, v))
            probs = torch.softmax(torch.bmm(qf, kf.transpose(1, 2)) * 0.25, dim=-1)
            return torch.bmm(self.drop(probs), vf).reshape(b, h, s, d)
        else:  # HF eager: scale on scores, additive mask, fp32 softmax then .to(dtype)
            scores = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5 + mask
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(self.drop(probs), v)


def _qkv_mask():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 16)
    mask[1, ..., 12:] = torch.finfo(torch.float32).min
    return q, k, v, mask


@pytest.mark.parametrize("style", ["hf_eager", "scale_on_q", "div", "causal_fill", "bmm"])
def test_attention_spellings_become_one_sdpa_and_match_fp32(style):
    args = _qkv_mask()
    gm, fused = _fused(Attention(style), args, FuseAttention())
    targets = _targets(fused)
    assert targets.count(aten.scaled_dot_product_attention.default) == 1
    assert not [t for t in targets if "softmax" in str(t)]
    _assert_same(gm, fused, args)


def test_attention_whose_probabilities_are_also_returned_is_left_alone():
    class Returning(nn.Module):
        def forward(self, q, k, v):
            probs = torch.softmax(q @ k.transpose(-1, -2), dim=-1)
            return probs @ v, probs

    gm = capture(Returning(), _qkv_mask()[:3])
    assert not FuseAttention()(gm).modified


def test_hf_llama_rms_norm_becomes_rms_norm_and_matches_fp32():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    args = (torch.randn(2, 5, 32) * 3,)
    gm, fused = _fused(norm, args, FuseNorms())
    assert aten.rms_norm.default in _targets(fused)
    assert aten.rsqrt.default not in _targets(fused)
    _assert_same(gm, fused, args)


class SpelledLayerNorm(nn.Module):
    def __init__(self, rsqrt: bool) -> None:
        super().__init__()
        self.rsqrt = rsqrt
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 32))
        self.bias = nn.Parameter(torch.linspace(-1, 1, 32))

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        if self.rsqrt:
            y = (x - u) * torch.rsqrt(s + 1e-5)
        else:
            y = (x - u) / torch.sqrt(s + 1e-5)
        return self.weight * y + self.bias


@pytest.mark.parametrize("rsqrt", [False, True])
def test_spelled_out_layer_norm_becomes_layer_norm_and_matches_fp32(rsqrt):
    args = (torch.randn(3, 7, 32) * 2 + 1,)
    gm, fused = _fused(SpelledLayerNorm(rsqrt), args, FuseNorms())
    targets = _targets(fused)
    assert targets.count(aten.layer_norm.default) == 1 and aten.mean.dim not in targets
    _assert_same(gm, fused, args, atol=1e-5)
    torch.testing.assert_close(fused(*args), F.layer_norm(args[0], (32,), fused.weight,
                                                          fused.bias, 1e-5))


def test_mean_over_another_dim_is_not_a_layer_norm():
    class ChannelsFirst(nn.Module):
        def forward(self, x):
            u = x.mean(1, keepdim=True)
            return (x - u) / torch.sqrt((x - u).pow(2).mean(1, keepdim=True) + 1e-6)

    gm = capture(ChannelsFirst(), (torch.randn(2, 8, 4, 4),))
    assert not FuseNorms()(gm).modified


@pytest.mark.parametrize("mode", ["export", "symbolic_trace"])
def test_tanh_gelu_spellings_of_export_and_symbolic_trace_are_fused(mode):
    from transformers.activations import NewGELUActivation

    args = (torch.linspace(-6, 6, 97).reshape(1, 97),)
    gm, fused = _fused(NewGELUActivation(), args, FuseTanhGelu(), capture_mode=mode)
    assert [n for n in fused.graph.nodes if n.meta.get(FUSED_TAG) == "tanh_gelu"]
    assert not [n for n in fused.graph.nodes if "tanh" in str(n.target)]
    _assert_same(gm, fused, args)


# --- pointwise regions ----------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(32, 32), nn.LayerNorm(32)

    def forward(self, x):
        return x + F.gelu(self.norm(self.fc(x))) * 0.5


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block(), Block(), Block())
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.blocks(x)))


def _stack():
    torch.manual_seed(0)
    return Stack(), (torch.randn(8, 32),)


def test_regions_show_in_the_code_with_their_ops_and_keep_parameters_and_report():
    model, args = _stack()
    gm = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16)
    flat = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16, fuse=False)
    assert "fused_0 = self.fused_0(" in gm.code
    region = gm.fused_0
    assert isinstance(region, FusedRegion)
    assert all(op in region.__doc__ for op in pointwise.op_names(region.region))
    assert gm.state_dict().keys() == model.state_dict().keys()
    assert [p.shape for p in gm.parameters()] == [p.shape for p in model.parameters()]
    assert gm.amp_report["nodes"] == flat.amp_report["nodes"]
    assert gm.amp_report["fused"]["regions"] >= 2
    assert not [m for m in flat.children() if isinstance(m, FusedRegion)]
    with torch.no_grad():
        torch.testing.assert_close(gm(*args), flat(*args))


def test_fuse_false_keeps_the_spelled_out_attention():
    model = Attention("hf_eager")
    gm = amp_rewrite.rewrite(model, _qkv_mask(), dtype=torch.bfloat16, fuse=False)
    assert [t for t in _targets(gm) if "softmax" in str(t)]
    assert "fused" not in gm.code.replace("fused\": {", "")
    assert gm.amp_report["fused"] == {"patterns": {}, "regions": 0, "distinct_regions": 0,
                                      "declined_as_too_small": 0,
                                      "compile": {"compiles": 0, "compile_seconds": 0.0,
                                                  "reused": 0}}


@pytest.mark.slow
def test_compiled_regions_match_eager_regions_forward_and_backward(monkeypatch):
    monkeypatch.setenv(pointwise.BACKEND_ENV, "inductor")
    model, args = _stack()
    gm = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16)
    eager = copy.deepcopy(gm)
    before = pointwise.compile_stats()["compiles"]
    x = args[0].clone().requires_grad_()
    gm(x).float().sum().backward()
    compiled = pointwise.compile_stats()["compiles"] - before
    assert 0 < compiled < gm.amp_report["fused"]["regions"]  # identical blocks compile once
    # the one-time cost is in the report: this graph's compilations, and those it reused
    cost = gm.amp_report["fused"]["compile"]
    assert cost["compiles"] == compiled and cost["compile_seconds"] > 0 and cost["reused"] > 0
    monkeypatch.setenv(pointwise.BACKEND_ENV, "eager")
    x_ref = args[0].clone().requires_grad_()
    ref = eager(x_ref)
    ref.float().sum().backward()
    with torch.no_grad():
        monkeypatch.setenv(pointwise.BACKEND_ENV, "inductor")
        torch.testing.assert_close(gm(args[0]), ref.detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=2e-2, rtol=2e-2)
    for p, q in zip(gm.parameters(), eager.parameters()):
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, q.grad, atol=5e-2, rtol=5e-2)


def test_regions_run_eager_with_one_log_line_when_inductor_fails(monkeypatch, caplog):
    from torch._inductor import compile_fx

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setenv(pointwise.BACKEND_ENV, "inductor")
    monkeypatch.setattr(compile_fx, "compile_fx", broken)
    monkeypatch.setitem(pointwise._STATE, "broken", None)
    model, args = _stack()
    gm = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16)
    flat = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16, fuse=False)
    with caplog.at_level(logging.WARNING, logger="amp_rewrite.fx.pointwise"):
        out = gm(*args)
        gm(*args)
    lines = [r for r in caplog.records if "run eager" in r.getMessage()]
    assert len(lines) == 1 and "no C++ compiler" in lines[0].getMessage()
    torch.testing.assert_close(out, flat(*args))


# --- zoo models -----------------------------------------------------------------------------

def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _error(out, ref) -> float:
    """Relative RMS error: max-norm errors of a 2-layer model are single-element noise."""
    return ((_first(out).float() - ref).norm() / ref.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2", "llama", "t5"])
def test_zoo_model_with_fusion_is_as_accurate_as_unfused_and_autocast(name):
    from tests.models import zoo

    model = zoo.build(name)
    kwargs = {"example_kwargs": model.kwargs, "dtype": torch.bfloat16}
    gm = amp_rewrite.rewrite(model.module, model.args, **kwargs)
    flat = amp_rewrite.rewrite(model.module, model.args, fuse=False, **kwargs)
    with torch.no_grad():
        ref = _first(model.run()).float()
        fused_err, flat_err = _error(gm(*model.args, **model.kwargs), ref), _error(
            flat(*model.args, **model.kwargs), ref)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast_err = _error(model.module(*model.args, **model.kwargs), ref)
    # the fused graph rounds at other places (SDPA, fused norms): allow 10% of the error
    assert fused_err <= 1.1 * flat_err and fused_err <= 1.1 * autocast_err
    if name in ("bert", "gpt2", "llama"):
        assert gm.amp_report["fused"]["patterns"]["attention"] == 2  # one SDPA per layer
    if name == "gpt2":
        assert gm.amp_report["fused"]["patterns"]["tanh_gelu"] == 2  # one per layer
    _first(gm(*model.args, **model.kwargs)).float().square().mean().backward()
    grads = [p.grad for p in gm.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.slow
def test_second_rewrite_of_a_fused_zoo_model_changes_nothing():
    from tests.models import zoo

    model = zoo.build("gpt2")
    gm = amp_rewrite.rewrite(model.module, model.args, example_kwargs=model.kwargs,
                             dtype=torch.bfloat16)
    again = amp_rewrite.rewrite(gm, model.args, example_kwargs=model.kwargs,
                                dtype=torch.bfloat16)
    assert again.amp_report["casts_inserted"] == 0 and not again.amp_report["modified"]
    assert again.amp_report["fused"] == gm.amp_report["fused"]
    assert sorted(m.signature for m in again.children() if isinstance(m, FusedRegion)) == \
        sorted(m.signature for m in gm.children() if isinstance(m, FusedRegion))
    with torch.no_grad():
        torch.testing.assert_close(again(*model.args), gm(*model.args))


@pytest.mark.slow
def test_fused_zoo_model_still_exports_and_compiles():
    from tests.models import zoo

    model = zoo.build("llama")
    gm = amp_rewrite.rewrite(model.module, model.args, example_kwargs=model.kwargs,
                             dtype=torch.bfloat16)
    with torch.no_grad():
        expected = gm(*model.args)
        program = torch.export.export(gm, model.args, strict=False)
        torch.testing.assert_close(program.module()(*model.args), expected)
        compiled = torch.compile(gm, backend="aot_eager", fullgraph=True)
        torch.testing.assert_close(compiled(*model.args), expected)


@pytest.mark.slow
def test_explain_names_the_fused_pattern(capsys):
    from tests.models import zoo

    model = zoo.build("bert")
    gm = amp_rewrite.rewrite(model.module, model.args, dtype=torch.bfloat16)
    sdpa = next(n.name for n in gm.graph.nodes
                if n.target is aten.scaled_dot_product_attention.default)
    lines = amp_rewrite.explain(gm, sdpa)
    assert "fused attention pattern" in lines[0] and "softmax" in lines[0]
    # the README's explain(gm, "softmax") on a model whose softmax was fused: where it went
    with pytest.raises(UsageError, match=f"softmax was fused into {sdpa}"):
        amp_rewrite.explain(gm, "softmax")
    # CPU reasons name CPU kernels, not CUDA's
    linear = amp_rewrite.explain(gm, "linear")
    assert "GEMM" in linear[0] and "Tensor Core" not in linear[0] and "cuBLAS" not in linear[0]


@pytest.mark.slow
def test_digits_training_through_compiled_regions_reaches_fp32_accuracy(monkeypatch):
    from tests.fx.test_training import LR, DigitsNet, _accuracy, _train, fp32_baseline

    monkeypatch.setenv(pointwise.BACKEND_ENV, "inductor")
    (x, y, x_test, y_test), fp32, initial = fp32_baseline()
    batch = torch.export.Dim("batch", min=1, max=4096)
    mixed = amp_rewrite.rewrite(DigitsNet(), (x[:64],), dtype=torch.bfloat16,
                                dynamic_shapes=({0: batch},))
    mixed.load_state_dict(initial)
    assert mixed.amp_report["fused"]["regions"] >= 1
    opt = AmpOptimizer(torch.optim.Adam(mixed.parameters(), lr=LR), dtype=torch.bfloat16)

    def amp_step(loss: torch.Tensor) -> None:
        opt.backward(loss)
        opt.step()
        opt.zero_grad()

    before = pointwise.compile_stats()["compiles"]
    _train(mixed, amp_step, x, y)
    assert pointwise.compile_stats()["compiles"] > before  # the regions ran compiled
    ours, reference = _accuracy(mixed, x_test, y_test), _accuracy(fp32, x_test, y_test)
    assert reference > 0.9 and abs(ours - reference) <= 0.01


@pytest.mark.parametrize("window", [7, 16])
def test_regions_proposed_in_windows_are_legal_and_compute_the_same(monkeypatch, window):
    """A window far smaller than the graph: every region still fuses (fuse_by_partitions
    rejects cyclic ones), values equal the unwindowed regions', and few regions are lost."""
    model, args = _stack()
    whole = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16)
    monkeypatch.setattr(pointwise, "WINDOW", window)
    windowed = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16)
    assert len(windowed.graph.nodes) > 3 * window  # really split into windows
    assert windowed.amp_report["fused"]["regions"] >= whole.amp_report["fused"]["regions"]
    with torch.no_grad():
        torch.testing.assert_close(windowed(*args), whole(*args), rtol=0, atol=0)
    again = amp_rewrite.rewrite(windowed, args, dtype=torch.bfloat16)
    assert again.code == windowed.code


def test_fused_nodes_get_the_fake_values_a_full_propagation_gives():
    from amp_rewrite.fx.capture import fill_missing_fake_values

    args = _qkv_mask()
    gm = capture(Attention("hf_eager").eval(), args)
    assert FuseAttention()(gm).modified
    assert fill_missing_fake_values(gm)
    filled = {n.name: n.meta["val"] for n in gm.graph.nodes if "val" in n.meta}
    refresh_fake_values(gm)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            full = node.meta["val"]
            assert (filled[node.name].shape, filled[node.name].dtype) == (full.shape, full.dtype)


def test_saved_bytes_counts_values_that_live_only_inside_a_region():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU(), nn.Sigmoid(), nn.Tanh()))
    for node in gm.graph.nodes:  # saved_bytes reads the example value's size
        node.meta["val"] = torch.empty(4, 8)
    relu, sigmoid, tanh = [n for n in gm.graph.nodes if n.op == "call_module"]
    # relu and sigmoid outputs are written once and read once inside: 2 x 2 x 128 bytes;
    # tanh's output leaves the region
    assert pointwise.saved_bytes([relu, sigmoid, tanh]) == 2 * 2 * 4 * 8 * 4
    assert pointwise.saved_bytes([sigmoid, tanh]) == 2 * 4 * 8 * 4


def test_cuda_declines_regions_too_small_to_pay_for_their_host_time():
    model, args = _stack()
    on_cpu = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16, device="cpu")
    on_cuda = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16, device="cuda")
    assert on_cpu.amp_report["fused"]["regions"] > 0
    assert on_cpu.amp_report["fused"]["declined_as_too_small"] == 0
    assert on_cuda.amp_report["fused"]["regions"] == 0  # a few KB each, far below 210 MB
    assert on_cuda.amp_report["fused"]["declined_as_too_small"] > 0
    torch.testing.assert_close(on_cuda(*args), on_cpu(*args), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("window", [7, 9, 16])
def test_a_second_rewrite_gives_the_same_code_where_gemms_are_emulated(monkeypatch, window):
    """On a CPU without native bf16 GEMMs (emulated GEMMs add casts by each GEMM) the region
    members and output numbering must not depend on node names or on where the first rewrite
    put its nodes (not ``fused_2_out1`` where the first rewrite said ``fused_2_out0``)."""
    from amp_rewrite.fx import lowering
    from tests.fx.test_lowering import measured_faster_in_fp32

    monkeypatch.setattr(lowering, "kernel_choice", measured_faster_in_fp32(lowering.KERNELS))
    monkeypatch.setattr(pointwise, "WINDOW", window)
    model, args = _stack()
    first = amp_rewrite.rewrite(model, args, dtype=torch.bfloat16)
    assert first.amp_report["emulated_gemms"]["enabled"]
    again = amp_rewrite.rewrite(first, args, dtype=torch.bfloat16)
    assert again.code == first.code
    with torch.no_grad():
        torch.testing.assert_close(again(*args), first(*args), rtol=0, atol=0)
