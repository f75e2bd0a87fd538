"""The rewrite on small modules: casts, parameters, options, report, and what the result can do.

Oracles: the FP32 module's outputs, hand-derived cast placements, and a second rewrite.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import amp_rewrite
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import rewrite_graph
from tests.models.measure import count_conversions, relative_error

from .conftest import casts, node, out_dtype

TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2}  # relative error vs FP32, per dtype
LOW = [torch.float16, torch.bfloat16]


class Block(nn.Module):
    """Pre-LN attention block with an additive mask: the shapes of a real transformer."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ln = nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        scores = self.q(h) @ self.k(h).transpose(-1, -2) / 4.0
        scores = scores.masked_fill(mask == 0, -1e4)
        return x + self.out(torch.softmax(scores, -1) @ self.v(h))


def block_inputs(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, 8, 8, dtype=torch.int64)
    mask[-1, :, 6:] = 0
    return torch.randn(batch, 8, 16, generator=g), mask


@pytest.mark.parametrize("dtype", LOW)
def test_outputs_match_fp32_within_tolerance(dtype):
    module, args = Block().eval(), block_inputs()
    # the plan's GEMM dtype; tests/fx/test_lowering.py covers the CPU GEMM emulation
    gm = amp_rewrite.rewrite(module, args, dtype=dtype, emulate_gemms=False)
    with torch.no_grad():
        error = relative_error(gm(*args), module(*args))
    assert error < TOL[dtype]
    assert any(out_dtype(n) == dtype for n in gm.graph.nodes if n.target is
               torch.ops.aten.linear.default)


def test_one_cast_per_value_shared_by_all_its_low_consumers():
    gm = amp_rewrite.rewrite(Block(), block_inputs(), fuse=False)
    ln_casts = [c for c in casts(gm) if c.args[0].name == "layer_norm"]
    assert len(ln_casts) == 1  # the layer_norm output feeds q, k and v
    assert {u.target for u in ln_casts[0].users} == {torch.ops.aten.linear.default}
    assert len(ln_casts[0].users) == 3
    assert len({(c.args[0], c.kwargs["dtype"]) for c in casts(gm)}) == len(casts(gm))


def test_casts_sit_right_after_their_producer():
    gm = amp_rewrite.rewrite(Block(), block_inputs(), fuse=False)
    for cast in casts(gm):
        producer = cast.args[0]
        if producer.op != "placeholder":
            between = producer.next
            while between is not cast:  # only other casts of the same producer in between
                assert between.args[0] is producer
                between = between.next


def test_only_floating_point_tensors_are_cast():
    gm = amp_rewrite.rewrite(Block(), block_inputs(), fuse=False)
    assert all(c.args[0].meta["val"].is_floating_point() for c in casts(gm))
    mask = node(gm, "mask")
    assert not any(u in casts(gm) for u in mask.users)  # the int64 mask is read as is


def test_parameters_stay_fp32_leaves_and_state_dict_is_identical():
    module = Block()
    gm = amp_rewrite.rewrite(module, block_inputs())
    ours, theirs = gm.state_dict(), module.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape and ours[k].dtype == theirs[k].dtype
               for k in ours)
    assert all(p.dtype == torch.float32 and p.is_leaf for p in gm.parameters())
    gm.load_state_dict(theirs)  # checkpoints load both ways
    module.load_state_dict(gm.state_dict())


def test_each_parameter_is_cast_once_per_forward_even_when_tied():
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return F.linear(F.linear(self.emb(ids), self.emb.weight), self.emb.weight.t())

    gm = amp_rewrite.rewrite(Tied(), (torch.tensor([[1, 2, 3]]),), fuse=False)
    weight_casts = [c for c in casts(gm) if c.args[0].op == "get_attr"]
    assert len(weight_casts) == 1


def test_buffers_are_untouched():
    module = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    gm = amp_rewrite.rewrite(module, (x,))
    for name, buf in gm.named_buffers():
        assert buf.dtype == module.state_dict()[name].dtype
        assert torch.equal(buf, module.state_dict()[name])
    bn = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.batch_norm.default)
    assert out_dtype(bn.args[0]) == torch.float16  # data low ...
    assert all(a.op == "get_attr" for a in bn.args[1:5])  # ... statistics and affine fp32


def test_backward_lands_fp32_gradients_on_the_fp32_parameters():
    module = Block()
    args = block_inputs()
    gm = amp_rewrite.rewrite(module, args)
    gm(*args).float().pow(2).mean().backward()
    for name, p in gm.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
    module(*args).pow(2).mean().backward()
    # Relative to the largest FP32 gradient: k.bias has an exactly-zero true gradient
    # (softmax is shift invariant), so a per-tensor relative error means nothing there.
    scale = max(p.grad.abs().max() for p in module.parameters())
    for (name, p), ref in zip(gm.named_parameters(), module.parameters()):
        assert (p.grad - ref.grad).abs().max() / scale < 1e-2, name


@pytest.mark.slow
def test_works_under_torch_compile():
    args = block_inputs()
    gm = amp_rewrite.rewrite(Block(), args)
    compiled = torch.compile(gm, backend="aot_eager")
    assert torch.equal(compiled(*args), gm(*args))
    compiled(*args).float().sum().backward()
    assert all(p.grad is not None for p in gm.parameters())


def test_result_can_be_exported_again():
    args = block_inputs()
    gm = amp_rewrite.rewrite(Block(), args, emulate_gemms=False)  # the plan's casts only
    program = torch.export.export(gm, args, strict=False)
    conversions = [n for n in program.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(conversions) == len(casts(gm))
    assert torch.equal(program.module()(*args), gm(*args))


def test_rewrite_is_deterministic():
    args = block_inputs()
    first = amp_rewrite.rewrite(Block(), args)
    second = amp_rewrite.rewrite(Block(), args)
    assert first.code == second.code
    assert torch.equal(first(*args), first(*args))


def test_second_run_changes_nothing():
    gm = amp_rewrite.rewrite(Block(), block_inputs())
    code = gm.code
    rewrite_graph(gm)
    assert gm.code == code
    assert not gm.amp_report["modified"] and gm.amp_report["casts_inserted"] == 0


def test_dynamic_batch_dimension_keeps_working():
    batch = torch.export.Dim("batch", min=1, max=32)
    gm = amp_rewrite.rewrite(Block(), block_inputs(2), dynamic_shapes=({0: batch}, {0: batch}))
    module = Block()
    args = block_inputs(5)
    with torch.no_grad():
        assert relative_error(gm(*args), module(*args)) < TOL[torch.float16]


def test_keep_fp32_pins_by_node_name_and_by_module_path():
    args = block_inputs()
    by_name = amp_rewrite.rewrite(Block(), args, keep_fp32=["linear_1"], emulate_gemms=False)
    assert out_dtype(node(by_name, "linear_1")) == torch.float32
    assert out_dtype(node(by_name, "linear")) == torch.float16
    by_path = amp_rewrite.rewrite(Block(), args, keep_fp32=["out"], emulate_gemms=False)
    assert out_dtype(node(by_path, "linear_3")) == torch.float32
    one = amp_rewrite.rewrite(Block(), args, keep_fp32="linear_1",  # one pattern, not 8 chars
                              emulate_gemms=False)
    assert out_dtype(node(one, "linear_1")) == torch.float32
    assert out_dtype(node(one, "linear")) == torch.float16


def test_keep_io_types_false_may_return_low_outputs():
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    x = torch.randn(2, 4)
    assert amp_rewrite.rewrite(Head(), (x,))(x).dtype == torch.float32
    assert amp_rewrite.rewrite(Head(), (x,), keep_io_types=False)(x).dtype == torch.float16


def test_rule_file_overlay_moves_an_op(tmp_path):
    overlay = tmp_path / "mine.toml"
    overlay.write_text('schema = 1\n[deny]\nlinear = "keep GEMMs fp32 here"\n')
    gm = amp_rewrite.rewrite(Block(), block_inputs(), rules=[str(overlay)], fuse=False)
    linears = [n for n in gm.graph.nodes if n.target is torch.ops.aten.linear.default]
    assert linears and all(out_dtype(n) == torch.float32 for n in linears)
    assert out_dtype(node(gm, "matmul")) == torch.float16  # still allow
    reasons = [r["reason"] for r in gm.amp_report["nodes"] if r["op_type"] == "linear"]
    assert all("keep GEMMs fp32 here" in r and str(overlay) in r for r in reasons)
    # one path, not a list
    one = amp_rewrite.rewrite(Block(), block_inputs(), rules=overlay, fuse=False)
    assert one.amp_report["nodes"] == gm.amp_report["nodes"]


@pytest.mark.parametrize(("dtype", "expected"), [(torch.float16, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16)])
def test_float_scalar_outside_the_low_range_keeps_its_node_high(dtype, expected):
    class Fill(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            return torch.softmax(y.masked_fill(y > 0, -1e5) * 0.5, -1)

    x = torch.randn(3, 4)
    gm = amp_rewrite.rewrite(Fill(), (x,), dtype=dtype, fuse=False)
    assert out_dtype(node(gm, "masked_fill")) == expected  # -1e5 < -65504, > -3.39e38
    assert out_dtype(node(gm, "mul")) == expected  # and so is what it flows into
    with torch.no_grad():
        assert torch.isfinite(gm(x)).all()


def test_upcast_into_a_promoting_op_is_left_to_type_promotion():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ln(x.exp() + self.fc(x))  # add(exp: fp32, GEMM: fp16) → deny op

    x = torch.randn(2, 8)
    gm = amp_rewrite.rewrite(Residual(), (x,), fuse=False)
    add = node(gm, "add")
    assert out_dtype(add.args[1]) == torch.float16 and out_dtype(add) == torch.float32
    assert gm.amp_report["upcasts_by_promotion"] == 1
    with torch.no_grad():
        n, out = count_conversions(lambda: gm(x))
        fc = F.linear(x.half(), gm.fc.weight.half(), gm.fc.bias.half())
        expected = F.layer_norm(x.exp() + fc.float(), (8,), gm.ln.weight, gm.ln.bias)
    assert n == 3  # x, weight and bias to fp16; nothing back up
    assert torch.equal(out, expected)  # promotion computes exactly what an upcast would


def test_planned_upcast_into_a_free_promoting_op_is_left_to_type_promotion():
    class Broadcast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.ln = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return self.ln(y + self.fc(x))  # y [16, 8] fp32 input, fc(x) [1, 8] fp16

    x, y = torch.randn(1, 8), torch.randn(16, 8)
    gm = amp_rewrite.rewrite(Broadcast(), (x, y), fuse=False)
    add = node(gm, "add")  # high: y, an fp32 input, promotes fc(x) for free
    assert out_dtype(add) == torch.float32 and out_dtype(add.args[1]) == torch.float16
    # x, weight and bias to fp16; the core plans no upcast of fc(x) (a free read)
    assert gm.amp_report["casts_planned"] == 3 and gm.amp_report["casts_inserted"] == 3
    assert gm.amp_report["upcasts_by_promotion"] == 1
    with torch.no_grad():
        fc = F.linear(x.half(), gm.fc.weight.half(), gm.fc.bias.half())
        assert torch.equal(gm(x, y), F.layer_norm(y + fc.float(), (8,), gm.ln.weight,
                                                  gm.ln.bias))


def test_model_conversion_to_fp32_is_retyped_only_when_every_reader_runs_low():
    class Upcasts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            low_readers = self.b(self.a(x).to(torch.float32))
            mixed_readers = self.c(x).to(torch.float32)
            return self.a(low_readers), mixed_readers.exp() + self.b(mixed_readers)

    x = torch.randn(2, 8)
    gm = amp_rewrite.rewrite(Upcasts(), (x,), fuse=False)
    conversions = [n for n in gm.graph.nodes if n.target is torch.ops.aten.to.dtype]
    assert [n.args[1] for n in conversions] == [torch.float16, torch.float32]
    assert gm.amp_report["nodes_retyped"] == 1


def test_explain_returns_the_reasons_for_one_node_without_printing_them(capsys):
    # softmax is deny there
    gm = amp_rewrite.rewrite(Block(), block_inputs(), device="cuda", fuse=False)
    lines = amp_rewrite.explain(gm, "softmax")
    assert lines and "deny" in lines[0] and "softmax" in lines[0]
    assert capsys.readouterr().out == ""  # shown once, by whoever prints it
    with pytest.raises(UsageError, match="no node named 'nope'"):
        amp_rewrite.explain(gm, "nope")
    with pytest.raises(UsageError, match=r"did you mean softmax\?"):
        amp_rewrite.explain(gm, "sofmax")
    with pytest.raises(UsageError, match="not produced by amp_rewrite"):
        amp_rewrite.explain(torch.fx.symbolic_trace(nn.ReLU()), "relu")


def test_report_has_the_onnx_report_schema():
    gm = amp_rewrite.rewrite(Block(), block_inputs(), emulate_gemms=False)
    report = gm.amp_report
    assert {"dtype", "nodes", "casts_inserted", "precision_counts", "unlisted_ops",
            "modified", "seconds", "capture_seconds"} <= set(report)
    assert report["dtype"] == "float16" and report["casts_inserted"] == len(casts(gm))
    for record in report["nodes"]:
        assert {"name", "op_type", "precision", "class", "reason"} <= set(record)
        assert record["precision"] in ("low", "high") and record["reason"]
    linear = next(r for r in report["nodes"] if r["name"] == "linear")
    assert (linear["class"], linear["precision"]) == ("allow", "low")


def test_symbolic_trace_capture_inlines_parameterised_modules():
    module = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    gm = amp_rewrite.rewrite(copy.deepcopy(module), (x,), capture="symbolic_trace")
    assert not any(n.op == "call_module" and n.target in ("0", "2", "3") for n in gm.graph.nodes)
    assert list(gm.state_dict()) == list(module.state_dict())
    with torch.no_grad():
        assert relative_error(gm(x), module(x)) < TOL[torch.float16]
