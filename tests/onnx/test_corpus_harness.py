"""The corpus harness itself: evaluate() must accept good conversions and flag bad ones.

Every expected output here is computed by numpy from the inputs, not by the harness.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import onnx
import onnx.parser
import pytest

from amp_rewrite.errors import UsageError
from benchmarks import peers
from tests.models import corpus

TOL16 = corpus.TOLERANCES["float16"]


def model(text: str) -> onnx.ModelProto:
    m = onnx.parser.parse_model(text)
    onnx.checker.check_model(m, full_check=True)
    return m


def case_for(text: str, feeds: dict, expected: list) -> corpus.Case:
    outcome = corpus.baseline_case("t", model(text), feeds, expected)
    assert isinstance(outcome, corpus.Case), outcome
    return outcome


HEADER = '<ir_version: 9, opset_import: ["": 17]>'
X = np.array([12.0, 1.0, -3.0], np.float32)

# y = exp(x) / 1000: exp(12) = 162755 overflows fp16 (max 65504) but the result does not.
EXP_FP32 = HEADER + """
g (float[3] x) => (float[3] y) {
  s = Constant<value_float = 0.001>()
  e = Exp(x)
  y = Mul(e, s)
}"""
EXP_FP16 = HEADER + """
g (float[3] x) => (float[3] y) {
  xh = Cast<to = 10>(x)
  e = Exp(xh)
  s = Constant<value_float = 0.001>()
  sh = Cast<to = 10>(s)
  m = Mul(e, sh)
  y = Cast<to = 1>(m)
}"""
RELU_FP32 = HEADER + """
g (float[3] x) => (float[3] y) {
  y = Relu(x)
}"""
RELU_FP16 = HEADER + """
g (float[3] x) => (float[3] y) {
  xh = Cast<to = 10>(x)
  r = Relu(xh)
  y = Cast<to = 1>(r)
}"""


@pytest.fixture
def exp_case() -> corpus.Case:
    return case_for(EXP_FP32, {"x": X}, [(np.exp(X.astype(np.float64)) / 1000).astype(np.float32)])


@pytest.fixture
def relu_case() -> corpus.Case:
    return case_for(RELU_FP32, {"x": X}, [np.maximum(X, 0)])


def test_identity_conversion_is_valid(exp_case):
    result = corpus.evaluate(exp_case, exp_case.model_copy(), "float16")
    assert result["valid"] and result["failure"] is None
    assert result["reference_ok"] is True
    assert result["casts"] == 0
    assert result["low_share_count"] == 0.0 and result["low_share_elems"] == 0.0


def test_fp16_overflow_is_flagged_by_the_reference_evaluator(exp_case):
    result = corpus.evaluate(exp_case, model(EXP_FP16), "float16")
    # ORT-CPU runs Exp and Mul in fp32 (no fp16 kernels) and may hide the overflow;
    # the reference evaluator computes exp(12) in fp16 and gets inf.
    assert result["reference_ok"] is False
    assert not result["valid"]
    assert "NaN/Inf" in result["failure"]
    assert result["reference_max_rel"] == math.inf


def test_correct_fp16_conversion_is_valid(relu_case):
    result = corpus.evaluate(relu_case, model(RELU_FP16), "fp16")
    assert result["valid"], result["failure"]
    assert result["casts"] == 2
    assert result["low_share_count"] == 1.0  # the Relu output; casts are not counted
    assert result["ort_max_rel"] < TOL16.atol


def test_wrong_output_is_flagged(relu_case):
    wrong = model(HEADER + """
g (float[3] x) => (float[3] y) {
  r = Relu(x)
  s = Constant<value_float = 0.05>()
  y = Add(r, s)
}""")
    result = corpus.evaluate(relu_case, wrong, "float16")
    assert not result["valid"] and not result["ort_ok"] and result["reference_ok"] is False
    assert result["failure"].startswith("ort: output 0:")
    # 0.05 off where the largest |expected| is 12: max rel err = 0.05 / 12.
    assert result["ort_max_rel"] == pytest.approx(0.05 / 12, rel=1e-5)


def test_changed_output_dtype_is_flagged(relu_case):
    fp16_out = model(HEADER + """
g (float[3] x) => (float16[3] y) {
  xh = Cast<to = 10>(x)
  y = Relu(xh)
}""")
    result = corpus.evaluate(relu_case, fp16_out, "float16")
    assert not result["ort_ok"] and "dtype float16 != float32" in result["failure"]


def test_invalid_model_is_flagged_by_the_checker(relu_case):
    broken = model(RELU_FP16)
    broken.graph.node[0].output[0] = "xh_renamed"  # Relu now reads an undefined value
    result = corpus.evaluate(relu_case, broken, "float16")
    assert not result["checker_ok"] and not result["valid"]
    assert result["failure"].startswith("checker:")


def test_integer_outputs_must_match_exactly():
    text = HEADER + """
g (float[4] x) => (int64[1] i) {
  i = ArgMax<axis = 0>(x)
}"""
    x = np.array([1.0, 2.0, 2.0004, 0.0], np.float32)  # 2.0004 rounds to 2.0 in fp16
    case = case_for(text, {"x": x}, [np.array([2], np.int64)])
    fp16 = model(HEADER + """
g (float[4] x) => (int64[1] i) {
  xh = Cast<to = 10>(x)
  i = ArgMax<axis = 0>(xh)
}""")
    result = corpus.evaluate(case, fp16, "float16")
    assert not result["valid"] and "non-float output differs" in result["failure"]


def test_reference_check_is_skipped_when_the_evaluator_cannot_run_fp32():
    text = '<ir_version: 9, opset_import: ["": 17, "com.microsoft": 1]>' + """
g (float[3] x) => (float[3] y) {
  y = com.microsoft.Gelu(x)
}"""
    x64 = X.astype(np.float64)
    gelu = 0.5 * x64 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x64]))
    case = case_for(text, {"x": X}, [gelu.astype(np.float32)])
    assert not case.reference_runs
    result = corpus.evaluate(case, case.model_copy(), "float16")
    assert result["valid"] and result["reference_ok"] is None
    assert "cannot reproduce the FP32 model" in result["reference_skipped"]


def test_baseline_rejects_a_case_ort_gets_wrong():
    outcome = corpus.baseline_case("t", model(RELU_FP32), {"x": X}, [np.maximum(X, 1)])
    assert isinstance(outcome, str) and "differs from expected" in outcome


@pytest.mark.parametrize(
    ("expected", "actual", "ok"),
    [
        ([np.nan, 1.0], [np.nan, 1.0], True),  # NaN where FP32 had NaN
        ([np.inf, 1.0], [np.inf, 1.0], True),
        ([2.0, 1.0], [np.inf, 1.0], False),  # Inf where FP32 had none
        ([2.0, 1.0], [2.0, np.nan], False),
        ([np.inf, 1.0], [-np.inf, 1.0], False),
        # allowed = 4e-3 * 100 + 1e-2 * |e| + 1e-5: 0.41 at e=1, 1.4 at e=100
        ([100.0, 1.0], [100.0, 1.40], True),
        ([100.0, 1.0], [100.0, 1.42], False),
        ([100.0, 1.0], [101.35, 1.0], True),
        ([100.0, 1.0], [101.45, 1.0], False),
    ],
)
def test_compare_outputs_fp16(expected, actual, ok):
    result = corpus.compare_outputs(
        [np.array(expected, np.float32)], [np.array(actual, np.float32)], TOL16
    )
    assert result.ok is ok, result.reason


def test_compare_outputs_sequences_and_optionals():
    seq = [np.array([1.0], np.float32), np.array([2.0], np.float32)]
    assert corpus.compare_outputs([seq, None], [list(seq), None], TOL16).ok
    assert not corpus.compare_outputs([seq], [seq[:1]], TOL16).ok
    assert not corpus.compare_outputs([None], [seq[0]], TOL16).ok


def test_count_casts_includes_subgraphs():
    m = model(HEADER + """
g (bool c, float[3] x) => (float[3] y) {
  y = If(c) <
    then_branch = t () => (float[3] a) { a = Cast<to = 1>(x) },
    else_branch = e () => (float[3] b) { h = Cast<to = 10>(x) b = Cast<to = 1>(h) }
  >
}""")
    assert corpus.count_casts(m) == 3


def test_has_float32():
    ints = model(HEADER + "\ng (int64[3] x) => (int64[3] y) { y = Neg(x) }")
    through_float = model(HEADER + """
g (int64[3] x) => (int64[3] y) {
  f = Cast<to = 1>(x)
  y = Cast<to = 7>(f)
}""")
    assert not corpus.has_float32(ints)
    assert corpus.has_float32(through_float)  # only an inferred intermediate is float32


def test_run_converter_records_a_raising_converter(relu_case):
    def broken(m: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
        raise ValueError("boom\nsecond line")

    result = corpus.run_converter(relu_case, broken, "float16")
    assert result["converted"] is False and result["valid"] is False
    assert result["failure"] == "convert: ValueError: boom"


def test_run_converter_gives_the_converter_a_copy(relu_case):
    def vandal(m: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
        m.graph.ClearField("node")
        return model(RELU_FP16)

    result = corpus.run_converter(relu_case, vandal, "float16")
    assert result["valid"]
    assert len(relu_case.model.graph.node) == 1


def test_unknown_dtype():
    with pytest.raises(UsageError, match="unknown low-precision dtype"):
        corpus.canonical_dtype("float8")


def test_summarize_and_failures(relu_case):
    good = corpus.run_converter(relu_case, lambda m, d: model(RELU_FP16), "float16")
    bad = corpus.run_converter(relu_case, lambda m, d: 1 / 0, "float16")
    summary = corpus.summarize([good, bad])
    assert summary["cases"] == 2 and summary["valid"] == 0.5 and summary["converted"] == 0.5
    assert summary["casts"] == 2
    assert corpus.failures([good, bad]) == [("t", "convert: ZeroDivisionError: division by zero")]


# ------------------------------------------------------------------ peers


def test_available_peers_reports_a_missing_module():
    ghost = peers.Peer("ghost", peers.PEERS["onnxconverter_common"].body, frozenset({"float16"}),
                       ("no_such_module_xyz",), install_hint="pip install ghost")
    reason = ghost.unavailable_reason()
    assert reason is not None and "no_such_module_xyz" in reason and "pip install ghost" in reason


def test_peer_rejects_unsupported_dtype():
    with pytest.raises(UsageError, match="does not convert to bfloat16"):
        peers.PEERS["onnxconverter_common"](model(RELU_FP32), "bfloat16")


@pytest.mark.parametrize("name", ["onnxconverter_common", "ort_transformers"])
def test_in_process_peer_converts_relu(name, relu_case):
    peer = peers.PEERS[name]
    if reason := peer.unavailable_reason():
        pytest.skip(reason)
    result = corpus.run_converter(relu_case, peer, "float16")
    # ORT's converter appends its input casts after their consumers: ORT sorts the graph
    # on load, but the checker (and the reference evaluator) reject it; hence only ORT here.
    assert result["converted"] and result["ort_ok"], result["failure"]
    assert result["low_share_count"] == 1.0 and result["casts"] == 2


def _sleepy_body(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    import time

    time.sleep(float(model.doc_string or 0))
    return model


def test_worker_converts_times_out_and_restarts():
    worker = peers.Worker(sys.executable, _sleepy_body)
    try:
        m = model(RELU_FP32)
        out, seconds = worker.convert_timed(m, "float16", timeout=60)
        assert out == m and 0 <= seconds < 5
        m.doc_string = "30"
        with pytest.raises(peers.ConverterTimeoutError):
            worker.convert_timed(m, "float16", timeout=0.5)
        m.doc_string = ""
        out, _ = worker.convert_timed(m, "float16", timeout=60)  # a fresh worker
        assert out == m
    finally:
        worker.close()


def test_worker_reports_converter_errors():
    if reason := peers.PEERS["onnxconverter_common"].unavailable_reason():
        pytest.skip(reason)
    worker = peers.Worker(sys.executable, peers.PEERS["onnxconverter_common"].body,
                          ("onnxconverter_common.float16",))
    try:
        with pytest.raises(RuntimeError, match="already converted to float16"):
            worker.convert_timed(model(RELU_FP16), "float16", timeout=60)
    finally:
        worker.close()
