"""The accuracy budget with mixed plans (``--dtype mixed --max-error E``) on the ONNX path.

The search pins nodes fp32 and re-plans through ``MixedPrecisionPass.plan_view`` (fp16, bf16
or fp32 per node from one exact plan); the emulator rounds each node to the dtype the plan
gives it (onnx/emulation.py). Checked here: the emulated error agrees with true rounding
(``onnx.reference`` on the rewritten model, every op in its declared dtype), the budgeted
plan meets E on the rows searched under both, a loose E keeps the plain mixed plan, and the
emitted rule overlay gives the same per-node dtypes.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import onnx
import pytest

from amp_rewrite.core.metric import worst_relative_error
from amp_rewrite.onnx import rewrite_onnx_model, validate
from amp_rewrite.onnx.budget import default_feeds
from tests.onnx.test_mixed import wide_divisor_model


def _num(x) -> float:
    return math.inf if x == "inf" else float(x)


def _dtypes(result) -> dict[str, str]:
    return {r["name"]: r["dtype"] for r in result.report["nodes"]}


def _true_rounding_error(fp32: onnx.ModelProto, rewritten: onnx.ModelProto, feeds) -> float:
    """``core.metric`` of the rewritten model under ``onnx.reference`` (each op rounds its
    outputs to its declared dtype, as a GPU does) against the FP32 model."""
    want = validate.reference_run(fp32, feeds)
    got = validate.reference_run(rewritten, validate.as_declared(rewritten, feeds))
    return worst_relative_error(list(want.values()), list(got.values()))


# -- a small model: the emulation of a mixed plan ------------------------------------------------

def test_the_emulated_error_of_a_mixed_plan_agrees_with_true_rounding():
    model = wide_divisor_model()
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)}
    # a loose budget keeps the default plan: mm1, mm2 fp16 and div bf16 (its divisor is beyond
    # fp16's range: tests/onnx/test_mixed.py), so ``achieved`` is that plan's emulated error
    result = rewrite_onnx_model(model, dtype="mixed", calibration_data=feeds, max_error=1e9)
    assert _dtypes(result) == {"mm1": "float16", "div": "bfloat16", "mm2": "float16"}
    b = result.report["budget"]
    assert "fp16 or bf16" in b["measured_by"]
    emulated = _num(b["achieved"])
    true = _true_rounding_error(model, result.proto(), feeds)
    assert emulated > 0 and true > 0
    # rounding div to fp16 instead (the emulator's one-dtype rounding before mixed plans)
    # would turn the 1e5 divisor into inf and the output into zeros: an error of 1
    assert 0.25 <= emulated / true <= 4.0, (emulated, true)


def test_a_budget_of_zero_keeps_every_candidate_of_a_mixed_plan_fp32():
    model = wide_divisor_model()
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)}
    result = rewrite_onnx_model(model, dtype="mixed", calibration_data=feeds, max_error=0.0)
    assert result.report["budget"]["reachable"] is True
    assert _num(result.report["budget"]["achieved"]) == 0.0
    assert set(_dtypes(result).values()) == {"float32"}


# -- the calibrated hot T5 of the zoo -------------------------------------------------------------

@functools.cache
def _hot_t5():
    """(path, FP32 model, calibration data, rows searched) of the hot T5
    (tests/models/hot.py): FFN intermediates up to 3e5, which fp16 cannot hold."""
    from tests.models import hot

    path, feeds = hot.cached_hot_onnx("t5", 3e5)
    fp32 = onnx.load(path)
    return path, fp32, feeds, default_feeds(fp32, feeds)[0]


@functools.cache
def _fp16_plan() -> tuple[float, float]:
    """(error on the rows searched, low FLOP share) of the fp16 plan, calibrated on the same
    data (the budget's default plan with a loose E: its hot GEMMs stay fp32)."""
    path, _, feeds, _ = _hot_t5()
    b = rewrite_onnx_model(path, dtype="fp16", calibration_data=feeds,
                           max_error=1.0).report["budget"]
    return _num(b["default_plan_error"]), b["default_low_flop_share"]


@functools.cache
def _budgeted(overlay: str):
    path, _, feeds, _ = _hot_t5()
    budget = 0.75 * _fp16_plan()[0]  # tighter than the fp16 plan itself: the search must pin
    return budget, rewrite_onnx_model(path, dtype="mixed", calibration_data=feeds,
                                      max_error=budget, emit_rules=overlay)


@pytest.fixture(scope="module")
def budgeted(tmp_path_factory):
    """(E, the budgeted mixed rewrite, the rule overlay it wrote) at E = 0.75 x fp16's error."""
    overlay = tmp_path_factory.mktemp("mixed_budget") / "pins.toml"
    budget, result = _budgeted(str(overlay))
    return budget, result, overlay


@pytest.mark.slow  # exports a zoo model
def test_hot_t5_mixed_budget_meets_e_under_emulation_and_true_rounding(budgeted):
    budget, result, _ = budgeted
    _, fp32, _, searched = _hot_t5()
    b = result.report["budget"]
    assert b["reachable"] is True and b["evaluations"] <= 25
    # the plain mixed plan (its hot FFNs rescaled into fp16, onnx/rescale.py) misses E
    assert _num(b["default_plan_error"]) > budget
    assert _num(b["achieved"]) <= budget
    assert _num(b["held_out"]) < math.inf  # reported (emulated: no bf16 CPU kernels)
    assert b["held_out_onnxruntime"] is None
    assert result.pinned_by_budget
    pinned = {p["node"] for p in result.pinned_by_budget}
    assert all(_dtypes(result)[n] == "float32" for n in pinned)
    assert _true_rounding_error(fp32, result.proto(), searched) <= budget


@pytest.mark.slow
def test_at_one_and_a_half_times_fp16s_error_the_mixed_plan_keeps_its_flops_low():
    # the hot FFNs are rescaled into fp16's range (onnx/rescale.py): the plain mixed plan
    # runs ≥ 99% of its FLOPs low and is within 1.5x the fp16 plan's error, which keeps the
    # hot FFNs fp32 (a third of the FLOPs)
    path, fp32, feeds, searched = _hot_t5()
    fp16_error, fp16_share = _fp16_plan()
    budget = 1.5 * fp16_error
    result = rewrite_onnx_model(path, dtype="mixed", calibration_data=feeds, max_error=budget)
    b = result.report["budget"]
    assert _num(b["achieved"]) <= budget
    assert b["low_flop_share"] >= 0.99 > fp16_share
    assert _true_rounding_error(fp32, result.proto(), searched) <= budget


@pytest.mark.slow
def test_hot_t5_emitted_rules_reproduce_the_budgeted_mixed_plan(budgeted):
    _, result, overlay = budgeted
    path, _, feeds, _ = _hot_t5()
    text = overlay.read_text()
    assert "[keep_fp32]" in text and "the same --calibrate data" in text
    # a rule file pins nodes fp32 or low, not bf16: the nodes calibration sends to bf16
    # come from the same data again
    again = rewrite_onnx_model(path, dtype="mixed", calibration_data=feeds, rules=[overlay])
    assert again.report.get("budget") is None
    assert _dtypes(again) == _dtypes(result)


@pytest.mark.slow
def test_hot_t5_loose_budget_keeps_the_plain_mixed_plan():
    path, _, feeds, _ = _hot_t5()
    plain = rewrite_onnx_model(path, dtype="mixed", calibration_data=feeds)
    loose = rewrite_onnx_model(path, dtype="mixed", calibration_data=feeds, max_error=1.0)
    b = loose.report["budget"]
    assert loose.pinned_by_budget == []
    assert b["achieved"] == b["default_plan_error"]
    # with slack the budget measures low the nodes calibration kept fp32 (decision 0028 §2):
    # here the attention masks' float32-max sentinels, fp32 in the plain plan
    lowered = {n["node"] for n in loose.lowered_by_budget}
    plain_dtypes, loose_dtypes = _dtypes(plain), _dtypes(loose)
    assert all(plain_dtypes[n] == "float32" for n in lowered)
    assert {n: d for n, d in loose_dtypes.items() if n not in lowered} == {
        n: d for n, d in plain_dtypes.items() if n not in lowered}


def test_a_mixed_budget_below_opset_13_emulates_fp16_only_and_meets_e():
    """At opset 12 no Cast writes bf16: no mixed plan gives bf16, and the emulation rounds
    to fp16 only (its bf16 casts made the instrumented copy invalid in onnxruntime)."""
    from .test_rescale import _conv_feeds, conv_bn_constants_model

    fp32 = conv_bn_constants_model(opset=12)
    for value in (*fp32.graph.input, *fp32.graph.output):  # batch-dynamic: the budget splits rows
        value.type.tensor_type.shape.dim[0].dim_param = "N"
    feeds = {"x": np.concatenate([_conv_feeds(s)["x"] for s in (6, 7)])}
    result = rewrite_onnx_model(fp32, dtype="mixed", calibration_data=feeds, max_error=1e-3)
    budget = result.report["budget"]
    assert budget["reachable"] and budget["achieved"] <= 1e-3, budget
    assert result.report["dtype_counts"]["bfloat16"] == 0
    assert result.proto().opset_import[0].version == 12
