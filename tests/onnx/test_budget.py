"""The accuracy budget on the ONNX path (``rewrite_onnx_model(max_error=...)``) on small real
models: a hand-made MLP whose residual-like offset cancels (fp16/bf16 rounding of the
offset value destroys the signal) and tiny zoo exports with a free batch dim
(``bench.budget.model_path``).

The plan's held-out error stays within E (or E is reported unreachable), the emulation
agrees with true rounding (``onnx.reference`` on the rewritten model), budget 0 keeps every
candidate fp32, a loose budget is the default plan, the emitted rule overlay reproduces the
plan, and on a model with few candidates the search is close to brute force over all pin
sets.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from amp_rewrite.onnx import rewrite_onnx_model, validate

T = onnx.TensorProto
DTYPES = ["float16", "bfloat16"]


def cancel_model(offset: float = 1000.0) -> onnx.ModelProto:
    """x → MatMul → Add(offset + b) → Relu → Sub(offset) → MatMul → Add → Tanh → MatMul.
    The offset value (~1000) rounded to fp16/bf16 loses the O(1) signal the Sub recovers:
    the default plan's error is 0.1-0.7; pinning the two cheap offset ops brings it to the
    MatMuls' rounding. A free batch dim: calibration data splits into search/held-out."""
    rng = np.random.default_rng(0)

    def w(name, rows, cols):
        return onh.from_array((rng.standard_normal((rows, cols)) / math.sqrt(rows))
                              .astype(np.float32), name)

    inits = [w("W1", 16, 32),
             onh.from_array((offset + rng.standard_normal(32)).astype(np.float32), "B1"),
             onh.from_array(np.full(32, offset, np.float32), "C"), w("W3", 32, 16),
             onh.from_array(rng.standard_normal(16).astype(np.float32), "B3"), w("W4", 16, 8)]
    nodes = [oh.make_node("MatMul", ["x", "W1"], ["a"], name="mm1"),
             oh.make_node("Add", ["a", "B1"], ["b"], name="add_offset"),
             oh.make_node("Relu", ["b"], ["c"], name="relu"),
             oh.make_node("Sub", ["c", "C"], ["d"], name="sub_offset"),
             oh.make_node("MatMul", ["d", "W3"], ["e"], name="mm3"),
             oh.make_node("Add", ["e", "B3"], ["f"], name="add3"),
             oh.make_node("Tanh", ["f"], ["g"], name="tanh"),
             oh.make_node("MatMul", ["g", "W4"], ["y"], name="mm4")]
    graph = oh.make_graph(nodes, "cancel",
                          [oh.make_tensor_value_info("x", T.FLOAT, ["N", 16])],
                          [oh.make_tensor_value_info("y", T.FLOAT, ["N", 8])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    onnx.checker.check_model(model, full_check=True)
    return model


def cancel_feeds(rows: int = 8, seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).standard_normal((rows, 16)).astype(np.float32)}


def _num(x) -> float:
    return math.inf if x == "inf" else float(x)


def _precisions(result) -> dict[str, str]:
    return {n["name"]: n["precision"] for n in result.report["nodes"]}


def _reference_error(fp32: onnx.ModelProto, mixed: onnx.ModelProto, feeds) -> float:
    """Worst relative output error of ``mixed`` under true rounding (onnx.reference)."""
    want = validate.run(fp32, feeds)
    got = validate.reference_run(mixed, validate.as_declared(mixed, feeds))
    errors = validate.compare(want, dict(zip(want, got.values())))
    return max((math.inf if e.new_nonfinite else e.max_rel for e in errors), default=0.0)


# ----------------------------------------------------------------------------- hand-made


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("budget", [1e-2, 1e-3])
def test_cancel_model_held_out_within_budget(dtype, budget):
    result = rewrite_onnx_model(cancel_model(), dtype=dtype, calibration_data=cancel_feeds(),
                                max_error=budget)
    b = result.report["budget"]
    assert _num(b["default_plan_error"]) > 1e-2  # the default plan misses the budget
    assert b["reachable"] is True
    assert _num(b["achieved"]) <= budget
    assert _num(b["held_out"]) <= budget
    assert b["evaluations"] <= 25
    assert "rows 0-3" in b["inputs"] and "rows 4-7" in b["held_out_inputs"]
    # the two offset ops are the ones that matter; the rewritten model keeps them fp32
    precisions = _precisions(result)
    assert precisions["add_offset"] == precisions["sub_offset"] == "high"
    if dtype == "float16":
        assert _num(b["held_out_onnxruntime"]) <= budget
    if (dtype, budget) == ("float16", 1e-2):  # the MatMuls' fp16 rounding fits: they stay low
        assert b["low_flop_share"] > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
def test_budget_zero_keeps_every_candidate_fp32(dtype):
    model, feeds = cancel_model(), cancel_feeds()
    result = rewrite_onnx_model(model, dtype=dtype, calibration_data=feeds, max_error=0.0)
    b = result.report["budget"]
    assert _num(b["achieved"]) == 0.0 and _num(b["held_out"]) == 0.0
    assert b["reachable"] is True
    assert all(p == "high" for p in _precisions(result).values())
    # fp32-equivalent: true rounding gives the FP32 model's outputs bit for bit
    want = validate.reference_run(model, feeds)
    got = validate.reference_run(result.proto(), feeds)
    assert all(np.array_equal(want[k], v) for k, v in zip(want, got.values()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_loose_budget_is_the_default_plan_in_one_evaluation(dtype):
    model, feeds = cancel_model(), cancel_feeds()
    loose = rewrite_onnx_model(model, dtype=dtype, calibration_data=feeds, max_error=10.0)
    default = rewrite_onnx_model(model, dtype=dtype, calibration_data=feeds)
    assert loose.report["budget"]["evaluations"] == 1
    assert loose.report["pinned_by_budget"] == []
    assert _precisions(loose) == _precisions(default)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emitted_rules_reproduce_the_plan(dtype, tmp_path):
    model, feeds = cancel_model(), cancel_feeds()
    overlay = tmp_path / "budget-rules.yaml"
    budgeted = rewrite_onnx_model(model, dtype=dtype, calibration_data=feeds, max_error=1e-2,
                                  emit_rules=overlay)
    assert budgeted.report["pinned_by_budget"]  # something to reproduce
    assert overlay.is_file()
    again = rewrite_onnx_model(model, dtype=dtype, rules=[overlay])
    assert "budget" not in again.report or again.report.get("budget") is None
    assert _precisions(again) == _precisions(budgeted)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulation_agrees_with_true_rounding_on_the_cancel_model(dtype):
    _check_emulation_vs_reference(cancel_model(), cancel_feeds(), dtype)


def _check_emulation_vs_reference(model: onnx.ModelProto, feeds, dtype: str) -> None:
    """With a loose budget the plan is the default one and ``achieved`` is the emulated
    error of exactly the rewritten model on the search inputs: onnx.reference on the
    rewritten model (true rounding of every op) must agree within a factor of 4."""
    from amp_rewrite.onnx.budget import default_feeds

    result = rewrite_onnx_model(model, dtype=dtype, calibration_data=feeds, max_error=1e9)
    emulated = _num(result.report["budget"]["achieved"])
    search = default_feeds(model, feeds)[0]
    true = _reference_error(model, result.proto(), search)
    assert math.isfinite(emulated) and math.isfinite(true)
    assert emulated > 0 and true > 0
    assert 0.25 <= emulated / true <= 4.0, (emulated, true)


def test_graph_output_read_by_another_node():
    """A graph output that nodes also read (BERT's last hidden state, read by the pooler):
    the emulator once declared its rounded copy twice (SerdeError '<name>.low' redeclared)."""
    rng = np.random.default_rng(0)
    inits = [onh.from_array(rng.standard_normal((16, 16)).astype(np.float32) / 4, n)
             for n in ("W1", "W2")]
    nodes = [oh.make_node("MatMul", ["x", "W1"], ["h"], name="mm1"),
             oh.make_node("Tanh", ["h"], ["t"], name="tanh"),
             oh.make_node("MatMul", ["t", "W2"], ["y"], name="mm2")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", T.FLOAT, ["N", 16])],
                          [oh.make_tensor_value_info("h", T.FLOAT, ["N", 16]),
                           oh.make_tensor_value_info("y", T.FLOAT, ["N", 16])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    feeds = {"x": rng.standard_normal((8, 16)).astype(np.float32)}
    for budget in (1e-2, 0.0):
        b = rewrite_onnx_model(model, calibration_data=feeds, max_error=budget).report["budget"]
        assert _num(b["achieved"]) <= budget and _num(b["held_out"]) <= budget


# ----------------------------------------------------------------------------- brute force


@pytest.mark.parametrize("dtype,budget", [("float16", 1e-3), ("bfloat16", 1e-2),
                                          ("bfloat16", 1e-3)])
def test_search_is_close_to_brute_force(dtype, budget):
    """Every pin set of the candidate units measured with the same emulator the search
    uses: the search's plan meets E and keeps within 0.10 of the best share."""
    import dataclasses

    import onnx_ir as ir

    from benchmarks.budget import concrete_shapes
    from amp_rewrite.core import LowDtype, Precision
    from amp_rewrite.core.budget import SEARCH_MARGIN
    from amp_rewrite.onnx.budget import Emulator, default_feeds, node_flops
    from amp_rewrite.onnx.passes import MixedPrecisionPass, OnnxOptions

    model, feeds = cancel_model(), cancel_feeds()
    result = rewrite_onnx_model(model, dtype=dtype, calibration_data=feeds, max_error=budget)
    b = result.report["budget"]
    chosen = {p["node"] for p in result.pinned_by_budget}

    search = default_feeds(model, feeds)[0]
    pass_ = MixedPrecisionPass(dataclasses.replace(OnnxOptions(LowDtype.parse(dtype)),
                                                   pad=False))
    copy = ir.from_proto(model)
    pass_.prepare(copy)
    default = pass_.plan_view()
    emulator = Emulator(pass_, copy)
    # the candidates: main-graph nodes the default runs low by the rules' choice
    groups: dict[str, list] = {}
    for key, (node, _) in pass_.view.groups.items():
        if key in emulator.flags and pass_.view.graph.group(key).fixed is None:
            groups.setdefault(node.name, []).append(key)
    units = sorted(n for n, ks in groups.items()
                   if any(default.precision(k) is Precision.LOW for k in ks))
    assert 2 <= len(units) <= 12, units
    assert chosen <= set(units)
    shapes = concrete_shapes(model, search)
    nodes = {n.name: n for n in model.graph.node}
    weight = {u: node_flops(nodes[u].op_type, [shapes[i] for i in nodes[u].input],
                            [shapes[o] for o in nodes[u].output]) for u in units}
    total = sum(weight.values())
    reference = emulator.run(search, None)

    def error(pins) -> float:
        extra = {k: "brute force" for u in pins for k in groups[u]}
        return emulator.error(search, reference, pass_.plan_view(extra) if extra else default)

    def share(pins) -> float:
        return sum(w for u, w in weight.items() if u not in pins) / total

    # the search holds its plans to SEARCH_MARGIN · E on the inputs it sees: so does the best
    target = budget * SEARCH_MARGIN
    best = max((share(p) for r in range(len(units) + 1)
                for p in itertools.combinations(units, r) if error(p) <= target), default=None)
    assert best is not None  # all pinned meets any budget here
    assert error(chosen) <= target
    assert _num(b["achieved"]) == pytest.approx(error(chosen), rel=1e-3, abs=1e-12)  # 4 digits
    assert share(chosen) >= best - 0.10, (sorted(chosen), share(chosen), best)


# ----------------------------------------------------------------------------- zoo exports


@pytest.fixture(scope="module")
def zoo_model():
    """(fp32 model, 8 input rows) of tiny zoo exports with a free batch dim (exported once
    into the zoo cache)."""
    from benchmarks import budget as bench

    cache = {}

    def get(name: str):
        if name not in cache:
            path = bench.model_path(name)
            cache[name] = onnx.load(str(path)), bench.feeds_for(name, path)
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("dtype,budget", [
    ("float16", 1e-2), ("float16", 1e-3), ("bfloat16", 1e-2), ("bfloat16", 1e-3)])
def test_zoo_held_out_within_budget_or_unreachable(zoo_model, dtype, budget):
    model, feeds = zoo_model("gpt2")
    result = rewrite_onnx_model(model, dtype=dtype, calibration_data=feeds, max_error=budget)
    b = result.report["budget"]
    assert b["evaluations"] <= 25
    assert "rows 0-3" in b["inputs"]
    if b["reachable"]:
        assert _num(b["achieved"]) <= budget
        assert _num(b["held_out"]) <= budget
    else:
        assert _num(b["all_pinned_error"]) > budget


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["bert", "llama"])
def test_zoo_emulation_agrees_with_true_rounding(zoo_model, name, dtype):
    model, feeds = zoo_model(name)
    _check_emulation_vs_reference(model, feeds, dtype)
