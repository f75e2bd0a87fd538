"""The ONNX pad step (onnx/pad.py): padded dims, Pad/Slice placement, weights padded once
(in place for tied embeddings), outputs equal to the unpadded rewrite's, no double padding."""
from __future__ import annotations

import re

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as nh
import onnx_ir as ir
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.cli import main
from amp_rewrite.core.padding import PadPolicy
from amp_rewrite.onnx.api import rewrite_onnx_model
from amp_rewrite.onnx.pad import pad_model

_RNG = np.random.default_rng(0)
# Memory traffic free: the cost model reduces to FLOPs at Tensor-Core / misaligned / fallback
# rates, so these small graphs are planned as large, compute-bound ones would be (with real
# bandwidth they are memory-bound and the runtime copies make padding not pay: see
# test_small_memory_bound_mlp_is_left_unpadded_by_the_default_cost_model).
# the 3-channel stem's padding mechanics; the default policy declines it (measured slower
# on an H200, PadPolicy docstring)
COMPUTE_BOUND = PadPolicy(memory_tbps=float("inf"), pad_small_conv_channels=True)


def _w(*shape: int, scale: float = 0.1) -> np.ndarray:
    return (_RNG.standard_normal(shape) * scale).astype(np.float32)


def _model(nodes, inputs, outputs, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = oh.make_graph(nodes, "g", inputs, outputs,
                          [nh.from_array(a, n) for n, a in weights.items()])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    return model


def mlp_100_37_1001() -> onnx.ModelProto:
    """MatMul+Add → tanh GELU spelled as Mul/Tanh/Add → MatMul+Add (a GPT-2 MLP shape)."""
    nodes = [oh.make_node("MatMul", ["x", "W1"], ["h0"]),
             oh.make_node("Add", ["h0", "b1"], ["h1"]),
             oh.make_node("Tanh", ["h1"], ["t"]), oh.make_node("Add", ["t", "one"], ["t1"]),
             oh.make_node("Mul", ["h1", "t1"], ["h2"]),
             oh.make_node("MatMul", ["h2", "W2"], ["y0"]),
             oh.make_node("Add", ["y0", "b2"], ["y"])]
    return _model(nodes, [oh.make_tensor_value_info("x", 1, ["batch", 100])],
                  [oh.make_tensor_value_info("y", 1, ["batch", 1001])],
                  {"W1": _w(100, 37), "b1": _w(37), "one": np.ones(1, np.float32),
                   "W2": _w(37, 1001), "b2": _w(1001)})


def tied_embedding() -> onnx.ModelProto:
    """Gather rows of E[1001, 40] and the lm_head MatMul(h, Transpose(E)), as exported."""
    nodes = [oh.make_node("Gather", ["E", "ids"], ["emb"]),
             oh.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
             oh.make_node("MatMul", ["emb", "Et"], ["logits"])]
    return _model(nodes, [oh.make_tensor_value_info("ids", onnx.TensorProto.INT64, [2, 5])],
                  [oh.make_tensor_value_info("logits", 1, [2, 5, 1001]),
                   oh.make_tensor_value_info("emb", 1, [2, 5, 40])], {"E": _w(1001, 40)})


def cnn_3_13_7(groups: int = 1) -> onnx.ModelProto:
    """Conv 3→13 → BatchNorm → Relu → Conv 13→7 (grouped 13→13 when groups > 1)."""
    cout2 = 7 if groups == 1 else 13
    nodes = [oh.make_node("Conv", ["x", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1]),
             oh.make_node("BatchNormalization", ["c1", "s", "b", "m", "v"], ["n1"]),
             oh.make_node("Relu", ["n1"], ["r1"]),
             oh.make_node("Conv", ["r1", "W2"], ["y"], group=groups, pads=[1, 1, 1, 1])]
    return _model(nodes, [oh.make_tensor_value_info("x", 1, [2, 3, 8, 8])],
                  [oh.make_tensor_value_info("y", 1, [2, cout2, 8, 8])],
                  {"W1": _w(13, 3, 3, 3), "B1": _w(13), "s": _w(13) + 1, "b": _w(13),
                   "m": _w(13), "v": np.abs(_w(13)) + 0.5, "W2": _w(cout2, 13 // groups, 3, 3)})


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return [np.asarray(o, np.float32) for o in ReferenceEvaluator(model).run(None, feeds)]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _fp32_padded(model: onnx.ModelProto, policy: PadPolicy = COMPUTE_BOUND,
                 strict: bool = True) -> tuple[onnx.ModelProto, object]:
    """Padding applied to the fp32 graph (the exactness oracle's setting), checked."""
    ir_model = ir.from_proto(model)
    ir.passes.common.ShapeInferencePass(strict_mode=strict)(ir_model)
    stats = pad_model(ir_model, policy, low=(ir.DataType.FLOAT,))
    proto = ir.to_proto(ir_model)
    onnx.checker.check_model(proto, full_check=True)
    return proto, stats


def test_mlp_100_37_1001_padded_with_no_pad_or_slice_between_the_gemms():
    model = mlp_100_37_1001()
    padded = rewrite_onnx_model(model, pad=COMPUTE_BOUND)
    report = padded.report["padding"]
    assert [op["dims"] for op in report["ops"]] == [{"K": "100→104", "N": "37→40"},
                                                   {"K": "37→40", "N": "1001→1008"}]
    ops = _ops(padded.proto())
    first, second = [i for i, op in enumerate(ops) if op == "MatMul"]
    assert "Pad" not in ops[first:second] and "Slice" not in ops[first:second]
    assert report["regions_propagated"] == 1
    assert (report["pads_inserted"], report["slices_inserted"]) == (1, 1)


def test_mlp_outputs_equal_the_unpadded_rewrite_in_fp16_and_bf16():
    model = mlp_100_37_1001()
    feeds = {"x": _RNG.standard_normal((4, 100)).astype(np.float32)}
    (fp32,) = _run(model, feeds)
    for dtype, tol in (("fp16", 2e-3), ("bf16", 2e-2)):
        (plain,) = _run(rewrite_onnx_model(model, dtype=dtype, pad=False).proto(), feeds)
        (padded,) = _run(rewrite_onnx_model(model, dtype=dtype, pad=COMPUTE_BOUND).proto(),
                         feeds)
        assert padded.shape == plain.shape == fp32.shape
        assert np.isfinite(padded).all()
        scale = np.abs(fp32).max()
        assert np.abs(padded - plain).max() / scale < tol
        assert np.abs(padded - fp32).max() / scale < tol


@pytest.mark.parametrize("make", [mlp_100_37_1001, cnn_3_13_7])
def test_fp32_mode_padding_changes_outputs_by_at_most_1e_6(make):
    model = make()
    name = model.graph.input[0].name
    shape = [2 if isinstance(d, str) or d == 0 else d for d in
             (d.dim_value or d.dim_param for d in model.graph.input[0].type.tensor_type.shape.dim)]
    feeds = {name: _RNG.standard_normal(shape).astype(np.float32)}
    padded, stats = _fp32_padded(model)
    assert stats.plan.padded_ops
    (want,), (got,) = _run(model, feeds), _run(padded, feeds)
    assert got.shape == want.shape
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-6


def test_tied_embedding_is_padded_in_place_and_the_gather_still_reads_its_rows():
    model = tied_embedding()
    feeds = {"ids": _RNG.integers(0, 1001, (2, 5))}
    padded, stats = _fp32_padded(model)
    assert stats.weights_padded_in_place == 1
    assert [tuple(i.dims) for i in padded.graph.initializer if i.name == "E"] == [(1008, 40)]
    assert [i.name for i in padded.graph.initializer if len(i.dims) == 2] == ["E"]  # no copy
    for want, got in zip(_run(model, feeds), _run(padded, feeds)):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_weight_with_another_reader_is_padded_as_a_copy():
    nodes = [oh.make_node("MatMul", ["x", "W"], ["y"]), oh.make_node("ReduceSum", ["W"], ["s"])]
    model = _model(nodes, [oh.make_tensor_value_info("x", 1, [4, 100])],
                   [oh.make_tensor_value_info("y", 1, [4, 37]),
                    oh.make_tensor_value_info("s", 1, [1, 1])], {"W": _w(100, 37)})
    padded, stats = _fp32_padded(model)
    assert stats.weights_padded == 1 and stats.weights_padded_in_place == 0
    feeds = {"x": _RNG.standard_normal((4, 100)).astype(np.float32)}
    for want, got in zip(_run(model, feeds), _run(padded, feeds)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_cnn_stem_padded_to_8_channels_and_batchnorm_relu_stay_padded():
    # compute-bound: the 3-channel stem pays (2.67x FLOPs on Tensor Cores vs the 7.4x slower
    # CUDA-core fallback); the old 1.5 FLOP cap refused it (replaced by the cost model)
    model = cnn_3_13_7()
    padded = rewrite_onnx_model(model, pad=COMPUTE_BOUND)
    report = padded.report["padding"]
    assert [op["dims"] for op in report["ops"]] == [{"Cin": "3→8", "Cout": "13→16"},
                                                   {"Cin": "13→16", "Cout": "7→8"}]
    assert report["ops_propagated"] == 2 and report["pads_inserted"] == 1  # the image
    feeds = {"x": _RNG.standard_normal((2, 3, 8, 8)).astype(np.float32)}
    (plain,) = _run(rewrite_onnx_model(model, pad=False).proto(), feeds)
    (got,) = _run(padded.proto(), feeds)
    assert got.shape == plain.shape
    assert np.abs(got - plain).max() / np.abs(plain).max() < 2e-3


def test_grouped_conv_is_left_unpadded():
    report = rewrite_onnx_model(cnn_3_13_7(groups=13), pad=COMPUTE_BOUND).report["padding"]
    reasons = {r["name"]: r["reasons"] for r in report["not_padded"]}
    assert any("grouped conv" in r.get("Cin", "") for r in reasons.values())


@pytest.mark.parametrize("make", [mlp_100_37_1001, tied_embedding, cnn_3_13_7])
def test_second_rewrite_changes_nothing(make):
    once = rewrite_onnx_model(make(), pad=COMPUTE_BOUND).proto()
    twice = rewrite_onnx_model(once, pad=COMPUTE_BOUND)
    assert not twice.pass_.modified
    assert twice.report["padding"]["padded_ops"] == 0
    assert _ops(twice.proto()) == _ops(once)


def compute_bound_mlp() -> onnx.ModelProto:
    """x[1024, 1024] · W1[1024, 1001] → Relu → · W2[1001, 1024]: compute-bound on an H100,
    the hidden 1001 travels padded from one GEMM to the next (no runtime copy)."""
    nodes = [oh.make_node("MatMul", ["x", "W1"], ["h"]), oh.make_node("Relu", ["h"], ["r"]),
             oh.make_node("MatMul", ["r", "W2"], ["y"])]
    return _model(nodes, [oh.make_tensor_value_info("x", 1, [1024, 1024])],
                  [oh.make_tensor_value_info("y", 1, [1024, 1024])],
                  {"W1": _w(1024, 1001), "W2": _w(1001, 1024)})


def test_cli_no_pad_and_summary_row_with_the_default_cost_model(tmp_path, capsys):
    src = tmp_path / "mlp.onnx"
    onnx.save(compute_bound_mlp(), src)
    assert main([str(src), "-o", str(tmp_path / "p.onnx")]) == 0
    assert re.search(r"padded GEMMs/convs +2 \(\+0\.[0-9]% FLOPs, 0 Pad / 0 Slice\)",
                     capsys.readouterr().out)
    assert main([str(src), "-o", str(tmp_path / "u.onnx"), "--no-pad"]) == 0
    assert "off (--no-pad)" in capsys.readouterr().out
    shapes = lambda path: sorted(tuple(i.dims) for i in onnx.load(path).graph.initializer  # noqa: E731
                                 if len(i.dims) == 2)
    assert shapes(tmp_path / "u.onnx") == [(1001, 1024), (1024, 1001)]
    assert shapes(tmp_path / "p.onnx") == [(1008, 1024), (1024, 1008)]


def test_small_memory_bound_mlp_is_left_unpadded_by_the_default_cost_model():
    # batch × 100 → 37 → 1001: every GEMM is memory-bound; padding K needs a runtime copy of
    # x and padding the last N a Slice copy of the output, more traffic than the 1.6x saves
    report = rewrite_onnx_model(mlp_100_37_1001()).report["padding"]
    assert report["padded_ops"] == 0
    reasons = [r for op in report["not_padded"] for r in op["reasons"].values()]
    assert reasons and all("cost model" in r for r in reasons)
    assert report["estimated_seconds_padded"] == report["estimated_seconds_unpadded"] > 0


def test_report_has_totals_when_no_weight_is_misaligned():
    """bf16 Conv has no kernel type at opset 18 (kept with ``opset=18``): the convs stay fp32,
    nothing is padded, and the report still has every total (the CLI row and tools read them)."""
    report = rewrite_onnx_model(cnn_3_13_7(), dtype="bf16", pad=COMPUTE_BOUND,
                                opset=18).report["padding"]
    assert report["padded_ops"] == 0 and report["extra_flop_fraction"] == 0.0
    assert report["pads_inserted"] == report["slices_inserted"] == 0


def test_gemm_trans_b_output_that_is_also_a_graph_output_is_sliced_for_it_only():
    """Gemm(transB=1, bias) → Relu → Gemm; the first Gemm's output is also a graph output:
    it keeps its name and shape through a Slice while the second Gemm reads it padded."""
    nodes = [oh.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             oh.make_node("Relu", ["h"], ["r"]),
             oh.make_node("Gemm", ["r", "W2"], ["y"], transB=1)]
    model = _model(nodes, [oh.make_tensor_value_info("x", 1, [4, 100])],
                   [oh.make_tensor_value_info("y", 1, [4, 21]),
                    oh.make_tensor_value_info("h", 1, [4, 37])],
                   {"W1": _w(37, 100), "b1": _w(37), "W2": _w(21, 37)})
    padded, stats = _fp32_padded(model)
    assert [p.dims for p in stats.plan.padded_ops][0][1].padded == 40
    assert [o.name for o in padded.graph.output] == ["y", "h"]
    feeds = {"x": _RNG.standard_normal((4, 100)).astype(np.float32)}
    for want, got in zip(_run(model, feeds), _run(padded, feeds)):
        assert got.shape == want.shape
        assert np.abs(got - want).max() / np.abs(want).max() <= 1e-6


def test_bf16_activations_for_onnxruntime_are_padded_by_concat_not_pad():
    """onnxruntime's CUDA provider has no bf16 Pad kernel: for it (target ort) the activation
    read padded is joined with a zero block (Concat of a zero Expand-ed to a run-time shape,
    here along K with a symbolic batch); for other runtimes it stays a Pad. Both compute the
    same values, exactly."""
    from amp_rewrite.onnx import validate

    model = mlp_100_37_1001()
    feeds = {"x": _RNG.standard_normal((3, 100)).astype(np.float32)}
    ort = rewrite_onnx_model(model, dtype="bf16", pad=COMPUTE_BOUND).proto()
    onnx_target = rewrite_onnx_model(model, dtype="bf16", pad=COMPUTE_BOUND,
                                     target="onnx").proto()
    assert "Pad" not in _ops(ort) and {"Concat", "Expand"} <= set(_ops(ort))
    assert "Pad" in _ops(onnx_target)
    onnx.checker.check_model(ort, full_check=True)
    (a,), (b,) = _run(ort, feeds), _run(onnx_target, feeds)
    assert a.shape == (3, 1001) and np.array_equal(a, b)
    runs_on = validate.cuda_kernels(ir.from_proto(ort))
    assert runs_on["CUDAExecutionProvider"] is True, runs_on
