"""Models users really have (issue 17): trained constants beyond the fp16 range, hot
activations under calibration, models the checker rejects but runtimes run, IR versions the
installed onnxruntime loads, bf16 on old opsets, control flow, opset-27 Scan bodies.

Every rewritten model is compared with its FP32 original (or the test case's expected
outputs) under onnx.reference, which computes each op in its declared dtype, and under
onnxruntime where it can load the model.
"""
from __future__ import annotations

import importlib

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.onnx import rewrite_onnx
from amp_rewrite.onnx.api import rewrite_onnx_model


def rel_error(expected: np.ndarray, got: np.ndarray) -> float:
    expected, got = np.asarray(expected, np.float64), np.asarray(got, np.float64)
    assert np.isfinite(got).all(), "NaN/Inf where FP32 had none"
    return float(np.abs(expected - got).max() / max(np.abs(expected).max(), 1e-12))


def linear_attention_cases() -> list:
    """onnx's LinearAttention node tests (opset 27), expanded to Scan bodies.

    Collecting all node tests takes 13 s; importing the one module registers its cases in a
    second (``_TargetOpType`` is how ``collect_testcases`` filters, a module global).
    """
    node_cases = importlib.import_module("onnx.backend.test.case.node")
    saved, node_cases._TargetOpType = node_cases._TargetOpType, "LinearAttention"
    try:  # a no-op where an earlier collect_testcases() imported it already
        importlib.import_module("onnx.backend.test.case.node.linear_attention")
    finally:
        node_cases._TargetOpType = saved
    cases = [c for c in node_cases._NodeTestCases if c.name.startswith("test_linear_attention")]
    return [c for c in cases if c.name.endswith("_expanded")]


def test_opset27_scan_bodies_with_untyped_inputs_pass_our_output_check():
    cases = linear_attention_cases()
    assert len(cases) >= 10
    for case in cases:
        onnx.checker.check_model(case.model, full_check=True)  # the input is valid
        mixed = rewrite_onnx(case.model)  # raised "B has inconsistent type" before
        onnx.checker.check_model(mixed, full_check=True)
        inputs, expected = case.data_sets[0]
        names = [i.name for i in case.model.graph.input]
        got = ReferenceEvaluator(mixed).run(None, dict(zip(names, inputs)))
        for e, g in zip(expected, got):
            assert rel_error(e, g) < 1e-2, case.name


# --- models the checker rejects, IR versions ---------------------------------------------

def if_model(output_type: onnx.ValueInfoProto | None = None, ir_version: int = 8,
             opset: int = 17) -> onnx.ModelProto:
    """y = If(c) then MatMul(x, w) else Relu(x); branch outputs and y left untyped, as
    exporters write them (onnxruntime infers them; the checker refuses the model)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    rng = np.random.default_rng(0)
    w = onnx.numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    then = h.make_graph([h.make_node("MatMul", ["x", "w"], ["a"])], "then", [],
                        [onnx.ValueInfoProto(name="a")])
    other = h.make_graph([h.make_node("Relu", ["x"], ["b"])], "else", [],
                         [onnx.ValueInfoProto(name="b")])
    graph = h.make_graph(
        [h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 8]), h.make_tensor_value_info("c", T.BOOL, [])],
        [output_type or onnx.ValueInfoProto(name="y")], [w])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


def ort_run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_untyped_graph_outputs_that_ort_runs_are_typed_and_rewritten():
    fp32 = if_model()
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(fp32)
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    mixed = rewrite_onnx(fp32)  # refused as an invalid model before
    onnx.checker.check_model(mixed, full_check=True)
    assert mixed.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert "MatMul" in [n.op_type for a in mixed.graph.node[-2].attribute for n in a.g.node]
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        (expected,) = ort_run(fp32, feeds)
        for got in (ort_run(mixed, feeds)[0], ReferenceEvaluator(mixed).run(None, feeds)[0]):
            assert rel_error(expected, got) < 1e-2


def test_output_is_checked_as_strictly_as_the_input_passed(monkeypatch, caplog):
    from onnx import helper as h

    calls = []
    real_check = onnx.checker.check_model

    def spy(model, full_check=False, **kw):
        calls.append(full_check)
        return real_check(model, full_check=full_check, **kw)

    monkeypatch.setattr(onnx.checker, "check_model", spy)
    valid = if_model(h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8]))
    rewrite_onnx(valid)
    assert True in calls  # the output got the full check the input passes
    # A value_info contradicting the real type fails only the full check (ORT ignores it):
    # the output is held to the plain check the input passed, and the user is told.
    contradicting = if_model(h.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, 8]))
    with pytest.raises(Exception):
        real_check(contradicting, full_check=True)
    calls.clear()
    rewrite_onnx(contradicting)
    assert calls[-2:] == [True, False]  # full check failed as the input's does; plain passed
    assert "fails the full ONNX check as the input does" in caplog.text


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_ir14_from_make_model_is_written_at_the_lowest_ir_ort_loads(tmp_path, dtype):
    from amp_rewrite.cli import main

    fp32 = if_model(onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8]),
                    ir_version=onnx.IR_VERSION, opset=21)
    assert fp32.ir_version == 14  # what onnx 1.23's make_model writes; ORT 1.31 refuses it
    src, out = tmp_path / "m.onnx", tmp_path / "m.amp.onnx"
    onnx.save(fp32, src)
    assert main([str(src), "-o", str(out), "--dtype", dtype, "--validate", "-q"]) == 0
    mixed = onnx.load(out)
    assert mixed.ir_version == onnx.helper.find_min_ir_version_for(list(fp32.opset_import)) == 10
    feeds = {"x": np.ones((2, 8), np.float32), "c": np.array(True)}
    fp32.ir_version = 10
    assert rel_error(ort_run(fp32, feeds)[0], ReferenceEvaluator(mixed).run(None, feeds)[0]) < (
        1e-2 if dtype == "fp16" else 5e-2)
    if dtype == "fp16":  # ORT-CPU has no bf16 MatMul kernel
        assert rel_error(ort_run(fp32, feeds)[0], ort_run(mixed, feeds)[0]) < 1e-2


# --- constants beyond the low dtype's range ---------------------------------------------

def conv_bn_model(variance: np.ndarray, rng, opset: int = 17) -> onnx.ModelProto:
    """Conv -> BatchNormalization -> Relu -> Conv, with BatchNorm statistics like a trained
    detection backbone's: running variance 1e7-1e8 (activations of ~1e4 before the norm)."""
    from onnx import TensorProto as T
    from onnx import helper as h

    c = variance.size
    arrays = {
        "w1": rng.standard_normal((c, 3, 3, 3)).astype(np.float32) * 1500,
        "scale": rng.uniform(0.5, 1.5, c).astype(np.float32),
        "bias": rng.uniform(-0.5, 0.5, c).astype(np.float32),
        "mean": rng.uniform(-500, 500, c).astype(np.float32),
        "var": variance.astype(np.float32),
        "w2": rng.standard_normal((4, c, 3, 3)).astype(np.float32) * 0.1,
    }
    inits = [onnx.numpy_helper.from_array(a, n) for n, a in arrays.items()]
    nodes = [h.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             h.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"],
                         name="bn"),
             h.make_node("Relu", ["bn"], ["r"]),
             h.make_node("Conv", ["r", "w2"], ["y"], pads=[1, 1, 1, 1])]
    graph = h.make_graph(nodes, "detector",
                         [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 16, 16])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, 4, 16, 16])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def test_batchnorm_variance_beyond_fp16_range_keeps_bn_fp32_not_clamped(rng):
    from amp_rewrite.onnx import rewrite_onnx_model

    fp32 = conv_bn_model(10 ** rng.uniform(7, 8, 8), rng)
    feeds = {"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)}
    (expected,) = ort_run(fp32, feeds)
    result = rewrite_onnx_model(fp32)
    mixed = result.proto()
    report = result.report
    assert report["values_clamped"] == 0
    assert any(k.startswith("var (values up to") for k in report["constants_kept_fp32"])
    assert "reads var" in " ".join(result.explain("bn"))  # the reason, for --explain
    assert [n.op_type for n in mixed.graph.node].count("Conv") == 2
    var = next(i for i in mixed.graph.initializer if i.name == "var")
    assert var.data_type == onnx.TensorProto.FLOAT
    for got in (ort_run(mixed, feeds)[0], ReferenceEvaluator(mixed).run(None, feeds)[0]):
        assert rel_error(expected, got) < 1e-2
    # The explicit option still clamps, and that is what made the output useless.
    clamped = rewrite_onnx(fp32, clamp_constants=True)
    assert rel_error(expected, ReferenceEvaluator(clamped).run(None, feeds)[0]) > 0.5


def test_constants_whose_significant_values_underflow_fp16_keep_readers_fp32(rng):
    from onnx import TensorProto as T
    from onnx import helper as h

    # A weight trained (or folded) to ~1e-8: fp16 flushes every entry to zero.
    w = (rng.standard_normal((8, 8)) * 1e-8).astype(np.float32)
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "w"], ["y"], name="tiny")], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 8])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 8])], [onnx.numpy_helper.from_array(w, "w")])
    fp32 = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    fp32.ir_version = 8
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32)}
    mixed = rewrite_onnx(fp32)
    assert [n.op_type for n in mixed.graph.node] == ["MatMul"]  # kept fp32: nothing to cast
    (expected,) = ort_run(fp32, feeds)
    assert rel_error(expected, ReferenceEvaluator(mixed).run(None, feeds)[0]) < 1e-3
    flushed = rewrite_onnx(fp32, clamp_constants=True)  # the old conversion: all zeros
    assert np.abs(ReferenceEvaluator(flushed).run(None, feeds)[0]).max() == 0


def test_tiny_conv_bias_that_underflows_fp16_runs_low_since_it_is_only_added(rng):
    from onnx import TensorProto as T
    from onnx import helper as h

    # Folded-BatchNorm biases of 1e-10..1e-6 (MobileNetV2's zoo export): a bias is only
    # added, so its underflow moves the fp16 sum by at most 2**-25, within the sum's own
    # rounding. The tiny *weight* beside it still keeps its reader fp32.
    w = (rng.standard_normal((8, 3, 3, 3)) * 0.3).astype(np.float32)
    b = (10.0 ** rng.uniform(-10, -6, 8)).astype(np.float32)
    tiny_w = (rng.standard_normal((8, 8, 1, 1)) * 1e-8).astype(np.float32)
    inits = [onnx.numpy_helper.from_array(a, n) for a, n in ((w, "w"), (b, "b"), (tiny_w, "tw"))]
    graph = h.make_graph(
        [h.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         h.make_node("Relu", ["c"], ["r"], name="relu"),
         h.make_node("Conv", ["r", "tw"], ["y"], name="tiny_conv")], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
        [h.make_tensor_value_info("r", T.FLOAT, [1, 8, 8, 8]),
         h.make_tensor_value_info("y", T.FLOAT, [1, 8, 8, 8])], inits)
    fp32 = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    fp32.ir_version = 8
    mixed = rewrite_onnx(fp32)
    stored = {i.name: i.data_type for i in mixed.graph.initializer}
    assert stored["w"] == stored["b"] == T.FLOAT16  # the conv and its bias run low
    assert stored["tw"] == T.FLOAT  # a tiny weight is multiplied: kept fp32 with its reader
    feeds = {"x": rng.standard_normal((1, 3, 8, 8)).astype(np.float32)}
    expected = ort_run(fp32, feeds)
    for got in (ort_run(mixed, feeds), ReferenceEvaluator(mixed).run(None, feeds)):
        assert rel_error(expected[0], got[0]) < 2e-3
        assert rel_error(expected[1], got[1]) < 2e-3


# --- bf16 on opsets that do not admit it ------------------------------------------------

def test_bf16_on_opset13_converts_to_opset22_by_default(rng, tmp_path, capsys):
    """Asked for bf16, a Conv+BatchNorm model at opset 13 (no bf16 kernels there) is converted
    to opset 22 and the summary says so; ``--keep-opset`` refuses; an explicit old opset
    leaves the model fp32 with the advice."""
    from amp_rewrite.cli import main
    from amp_rewrite.onnx import rewrite_onnx_model

    fp32 = conv_bn_model(rng.uniform(0.5, 2, 8), rng, opset=13)
    for init in fp32.graph.initializer:  # ordinary magnitudes: bf16 is the only question
        a = onnx.numpy_helper.to_array(init)
        init.CopyFrom(onnx.numpy_helper.from_array(a / np.abs(a).max(), init.name))
    feeds = {"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)}
    (expected,) = ort_run(fp32, feeds)
    pinned = rewrite_onnx_model(fp32, dtype="bf16", opset=13)
    assert pinned.report["modified"] is False  # Conv and BatchNorm admit no bf16 at 13
    assert "re-run with --opset 22" in pinned.report["opset_advice"]
    src = tmp_path / "m.onnx"
    onnx.save(fp32, src)
    assert main([str(src), "--dtype", "bf16", "-o", str(tmp_path / "out.onnx")]) == 0
    assert "converted opset 13 -> 22" in capsys.readouterr().out  # the summary says so
    assert main([str(src), "--dtype", "bf16", "--keep-opset",
                 "-o", str(tmp_path / "kept.onnx")]) == 3
    assert not (tmp_path / "kept.onnx").exists()
    converted = rewrite_onnx_model(fp32, dtype="bf16")
    mixed = converted.proto()
    assert converted.report["opset_advice"] is None
    assert "13 -> 22" in converted.report["opset_conversion"]
    assert mixed.opset_import[0].version == 22 and mixed.ir_version == 10
    assert {n.op_type for n in mixed.graph.node} >= {"Conv", "BatchNormalization", "Cast"}
    assert all(i.data_type == onnx.TensorProto.BFLOAT16 for i in mixed.graph.initializer)
    assert rel_error(expected, ReferenceEvaluator(mixed).run(None, feeds)[0]) < 5e-2


# --- hot activations under calibration ---------------------------------------------------

@pytest.mark.parametrize("name", ["t5", "llama"])
def test_hot_ffn_activations_with_calibration_are_finite_and_close(name):
    from amp_rewrite.bench import hot
    from amp_rewrite.onnx import rewrite_onnx_model, validate

    path, feeds = hot.cached_hot_onnx(name, 3e5)
    fp32 = onnx.load(path)
    maxima = validate.value_maxima(fp32, feeds)
    assert 2e5 < max(v for v in maxima.values() if v < 1e38) < 4e5  # hot, as trained T5s
    expected = validate.run(fp32, feeds)
    # clamp_constants: constants are stored as before, so calibration alone must hold.
    for clamp in (False, True):
        result = rewrite_onnx_model(path, calibration_data=feeds, clamp_constants=clamp)
        mixed = result.proto()
        for run in (validate.run, validate.reference_run):  # ORT, then true fp16 rounding
            for e in validate.compare(expected, run(mixed, feeds)):
                assert not e.new_nonfinite and e.max_rel < 1e-2, (clamp, run.__name__, e)
    # The reader of a hot FFN intermediate (the down-projection) is what calibration missed
    # (without clamping, its tiny compensating weights keep it fp32 on their own account).
    readers = [r for r in result.report["nodes"]
               if r["op_type"] == "MatMul" and "(its input)" in r["reason"]]
    assert readers and all(r["precision"] == "high" for r in readers)


# --- control flow ------------------------------------------------------------------------

def count_casts(graph: onnx.GraphProto) -> int:
    return sum(n.op_type == "Cast" for n in graph.node) + sum(
        count_casts(a.g) for n in graph.node for a in n.attribute if a.HasField("g"))


def test_if_heavy_vad_model_casts_across_branch_boundaries():
    from amp_rewrite.bench.control_flow import vad_feeds, vad_like_model
    from amp_rewrite.onnx import rewrite_onnx_model, validate

    fp32 = vad_like_model()
    mixed = rewrite_onnx(fp32)
    # One cast per graph input and output: the If outputs, the branch outputs and the
    # captured inputs are retyped like any port (12 casts when the If boundary was fixed).
    assert count_casts(mixed.graph) <= 4
    top_if = next(n for n in mixed.graph.node if n.op_type == "If")
    then = next(a.g for a in top_if.attribute if a.name == "then_branch")
    assert {o.type.tensor_type.elem_type for o in then.output} == {onnx.TensorProto.FLOAT16}
    assert rewrite_onnx_model(mixed).report["modified"] is False  # a second run: no change
    for sr in (16000, 8000):  # both branches
        feeds = vad_feeds(sr)
        expected = validate.run(fp32, feeds)
        for run in (validate.run, validate.reference_run):
            for e in validate.compare(expected, run(mixed, feeds)):
                assert not e.new_nonfinite and e.max_rel < 1e-2, (sr, run.__name__, e)


def test_loop_carried_values_and_scan_state_are_retyped_consistently(rng):
    from onnx import TensorProto as T
    from onnx import helper as h

    # Loop: acc = acc @ w + x, three times; Scan: running sum of rows through MatMul.
    w = onnx.numpy_helper.from_array((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "w")
    body = h.make_graph(
        [h.make_node("MatMul", ["acc_in", "w"], ["mm"]),
         h.make_node("Add", ["mm", "x"], ["acc_out"]),
         h.make_node("Identity", ["cond_in"], ["cond_out"])], "loop_body",
        [h.make_tensor_value_info("i", T.INT64, []),
         h.make_tensor_value_info("cond_in", T.BOOL, []),
         h.make_tensor_value_info("acc_in", T.FLOAT, [2, 8])],
        [h.make_tensor_value_info("cond_out", T.BOOL, []),
         h.make_tensor_value_info("acc_out", T.FLOAT, [2, 8])])
    scan_body = h.make_graph(
        [h.make_node("MatMul", ["row", "w"], ["rw"]), h.make_node("Add", ["s_in", "rw"], ["s_out"]),
         h.make_node("Identity", ["s_out"], ["emit"])], "scan_body",
        [h.make_tensor_value_info("s_in", T.FLOAT, [8]),
         h.make_tensor_value_info("row", T.FLOAT, [8])],
        [h.make_tensor_value_info("s_out", T.FLOAT, [8]),
         h.make_tensor_value_info("emit", T.FLOAT, [8])])
    graph = h.make_graph(
        # An explicit condition: onnx.reference mis-runs a Loop whose condition is omitted.
        [h.make_node("Loop", ["n", "c", "x"], ["acc"], body=body),
         h.make_node("ReduceSum", ["acc", "axis0"], ["s0"], keepdims=0),
         h.make_node("Scan", ["s0", "acc"], ["s", "rows"], body=scan_body, num_scan_inputs=1),
         h.make_node("MatMul", ["rows", "w"], ["y"])], "g",
        [h.make_tensor_value_info("x", T.FLOAT, [2, 8]),
         h.make_tensor_value_info("n", T.INT64, [])],
        [h.make_tensor_value_info("y", T.FLOAT, [2, 8]),
         h.make_tensor_value_info("s", T.FLOAT, [8])],
        [w, onnx.numpy_helper.from_array(np.array([0], np.int64), "axis0"),
         onnx.numpy_helper.from_array(np.array(True), "c")])
    fp32 = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    fp32.ir_version = 8
    onnx.checker.check_model(fp32, full_check=True)
    mixed = rewrite_onnx(fp32)
    onnx.checker.check_model(mixed, full_check=True)
    loop = next(n for n in mixed.graph.node if n.op_type == "Loop")
    loop_body = loop.attribute[0].g
    # The carried value is one dtype at the Loop input, body input, body output and output.
    carried = (loop_body.input[2], loop_body.output[1])
    assert len({v.type.tensor_type.elem_type for v in carried}) == 1
    feeds = {"x": rng.standard_normal((2, 8)).astype(np.float32), "n": np.array(3, np.int64)}
    expected = ort_run(fp32, feeds)
    for got in (ort_run(mixed, feeds), ReferenceEvaluator(mixed).run(None, feeds)):
        for e, g in zip(expected, got):
            assert rel_error(e, g) < 1e-2


def test_cli_opset_and_clamp_constants_flags(rng, tmp_path):
    import json

    from amp_rewrite.cli import main

    src, out, report = tmp_path / "m.onnx", tmp_path / "o.onnx", tmp_path / "r.json"
    onnx.save(conv_bn_model(10 ** rng.uniform(7, 8, 8), rng, opset=13), src)
    assert main([str(src), "-o", str(out), "--report", str(report), "-q"]) == 0
    assert json.loads(report.read_text())["values_clamped"] == 0  # default: no clamp
    assert main([str(src), "-o", str(out), "--report", str(report), "-q", "--clamp-constants",
                 "--opset", "22", "--dtype", "bf16"]) == 0
    assert onnx.load(out).opset_import[0].version == 22
    # bf16 holds 1e8, so nothing is clamped even when asked; fp16 clamps the variance
    assert json.loads(report.read_text())["values_clamped"] == 0
    assert main([str(src), "-o", str(out), "--report", str(report), "-q",
                 "--clamp-constants"]) == 0
    assert json.loads(report.read_text())["values_clamped"] == 8


def test_float32_extreme_mask_sentinel_maps_to_the_low_extreme_and_stays_low():
    """HF exports write finfo(float32).min for masked positions: a sentinel for -inf, not a
    value that needs fp32. It is stored as fp16's -65504 (softmax weight still 0) and its
    readers run low; a real out-of-range value beside it keeps the old fp32 decision."""
    from onnx import helper as oh
    from onnx import numpy_helper as onh

    from amp_rewrite.onnx import validate

    lowest = np.finfo(np.float32).min
    mask = np.where(np.triu(np.ones((4, 4), bool), 1), lowest, 0).astype(np.float32)
    nodes = [oh.make_node("MatMul", ["x", "w"], ["s"]),
             oh.make_node("Add", ["s", "mask"], ["m"]),
             oh.make_node("Softmax", ["m"], ["y"], axis=-1)]
    graph = oh.make_graph(
        nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 4])],
        [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4, 4])],
        [onh.from_array(np.eye(4, dtype=np.float32), "w"), onh.from_array(mask, "mask")])
    fp32 = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    fp32.ir_version = 8
    result = rewrite_onnx_model(fp32)
    assert result.report["constants_kept_fp32"] == []
    assert result.report["values_clamped"] == 0
    add = next(n for n in result.report["nodes"] if n["op_type"] == "Add")
    assert add["precision"] == "low"
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)}
    expected = validate.run(fp32, feeds)
    out = result.proto()
    for run in (validate.run, validate.reference_run):
        got = run(out, validate.as_declared(out, feeds))["y"].astype(np.float32)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, expected["y"], atol=2e-3)
