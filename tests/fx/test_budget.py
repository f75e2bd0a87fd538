"""The accuracy budget on the torch path (``rewrite(max_error=...)``, ``fx/budget.py``).

Every check measures the result against the FP32 module itself on batches the test draws,
not against numbers the search computed.
"""
from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch

from amp_rewrite.errors import UsageError
from amp_rewrite.fx import explain, rewrite, rewrite_graph
from amp_rewrite.fx.budget import relative_error
from tests.models import hot, zoo

SEEDS = range(1, 7)  # three batches searched, three held out


def batches(name: str, seeds=SEEDS, batch: int = 2) -> list[tuple]:
    return zoo.input_batches(name, seeds, batch)


def error_vs_fp32(module, gm, data) -> float:
    """Worst relative error of ``gm`` against the FP32 ``module`` over ``data``."""
    worst = 0.0
    with torch.no_grad():
        for batch in data:
            ref = [t.float() for t in torch.utils._pytree.tree_leaves(module(*batch))]
            got = [t.float() for t in torch.utils._pytree.tree_leaves(gm(*batch))]
            worst = max(worst, relative_error(ref, got))
    return worst


def precisions(gm) -> dict[str, torch.dtype]:
    return {n.name: n.meta["val"].dtype for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


@functools.cache
def _budgeted(name: str, dtype: str, max_error: float):
    model, gm = _capture(name)
    data = batches(name)
    return model, data, rewrite_graph(copy.deepcopy(gm), dtype=dtype, max_error=max_error,
                                      calibration_data=data)


@functools.cache
def _capture(name: str):
    from amp_rewrite.fx.capture import capture

    model = zoo.build(name)
    return model, capture(model.module, model.args, model.kwargs)


_SLOW = pytest.mark.slow
MATRIX = [("bert", "float16", 1e-2), ("bert", "bfloat16", 1e-3), ("gpt2", "float16", 1e-3),
          ("gpt2", "bfloat16", 1e-2),
          pytest.param("bert", "float16", 1e-3, marks=_SLOW),
          pytest.param("bert", "bfloat16", 1e-2, marks=_SLOW),
          pytest.param("gpt2", "float16", 1e-2, marks=_SLOW),
          pytest.param("gpt2", "bfloat16", 1e-3, marks=_SLOW)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "dtype", "max_error"), MATRIX)
def test_held_out_error_is_within_the_budget_or_unreachable(name, dtype, max_error):
    model, data, gm = _budgeted(name, dtype, max_error)
    budget = gm.amp_report["budget"]
    held = data[len(data) // 2:]
    measured = error_vs_fp32(model.module, gm, held)
    assert measured == pytest.approx(budget["held_out"], rel=1e-3, abs=1e-9)
    assert measured <= max_error or budget["reachable"] is False
    assert budget["evaluations"] <= 25
    assert 0.0 <= budget["low_flop_share"] <= 1.0
    assert budget["held_out_inputs"] == "calibration_data[3:6]"


def test_zero_budget_computes_what_fp32_does_on_the_search_batches():
    model, gm = _capture("bert")
    data = batches("bert")
    out = rewrite_graph(copy.deepcopy(gm), dtype=torch.float16, max_error=0.0,
                        calibration_data=data, fuse=False, max_evaluations=6)
    assert out.amp_report["budget"]["reachable"] is True
    assert error_vs_fp32(model.module, out, data[:3]) == 0.0


def test_a_loose_budget_is_the_default_plan_in_one_evaluation():
    model, gm = _capture("bert")
    plain = rewrite_graph(copy.deepcopy(gm), dtype=torch.bfloat16)
    loose = rewrite_graph(copy.deepcopy(gm), dtype=torch.bfloat16, max_error=1.0,
                          calibration_data=batches("bert", seeds=(1, 2)))
    assert loose.amp_report["budget"]["evaluations"] == 1
    assert loose.amp_report["pinned_by_budget"] == []
    assert precisions(loose) == precisions(plain)


def test_the_emitted_overlay_reproduces_the_plan_and_explain_names_the_budget(tmp_path):
    model, data, gm = _budgeted("bert", "bfloat16", 1e-3)
    pinned = [p["node"] for p in gm.amp_report["pinned_by_budget"]]
    assert pinned, "the case must pin something to test the round trip"
    assert any("accuracy budget" in line for line in explain(gm, pinned[0]))
    path = tmp_path / "budget.toml"
    again = rewrite_graph(copy.deepcopy(_capture("bert")[1]), dtype="bfloat16",
                          max_error=1e-3, calibration_data=data, emit_rules=path)
    assert precisions(again) == precisions(gm)
    replay = rewrite_graph(copy.deepcopy(_capture("bert")[1]), dtype="bfloat16",
                           rules=[str(path)])
    assert precisions(replay) == precisions(gm)
    assert "budget" not in replay.amp_report
    assert any("accuracy budget" in line for line in explain(replay, pinned[0]))
    assert error_vs_fp32(model.module, replay, data[3:]) == pytest.approx(
        gm.amp_report["budget"]["held_out"], rel=1e-3, abs=1e-9)


@pytest.mark.slow
def test_hot_activations_get_pins_that_bring_the_error_under_the_budget():
    model = hot.hot_variant("llama")
    data = batches("llama", seeds=range(1, 5))
    gm = rewrite(model.module, model.args, dtype=torch.float16, max_error=1e-2,
                 calibration_data=data)
    budget = gm.amp_report["budget"]
    assert budget["default_plan_error"] == "inf"
    assert budget["reachable"] is True and gm.amp_report["pinned_by_budget"]
    assert error_vs_fp32(model.module, gm, data[2:]) <= 1e-2
    assert budget["low_flop_share"] > 0.5


def test_one_batch_is_held_out_and_the_examples_searched():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    held = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    gm = rewrite(model, (x,), max_error=1e-2, calibration_data=[held])
    budget = gm.amp_report["budget"]
    assert (budget["inputs"], budget["held_out_inputs"]) == ("example_inputs",
                                                            "calibration_data[0]")
    assert budget["held_out"] == pytest.approx(error_vs_fp32(model, gm, [(held,)]), rel=1e-3)


def test_a_held_out_error_above_the_budget_warns(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))
    small = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    huge = small * 1e5  # overflows fp16 in the first GEMM: only the held-out batch shows it
    with caplog.at_level(logging.WARNING, logger="amp_rewrite.fx.budget"):
        gm = rewrite(model, (small,), max_error=1e-2, calibration_data=[small, huge])
    assert gm.amp_report["budget"]["held_out"] == "inf"
    assert "held-out" in caplog.text


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"max_error": -1.0}, "max_error=-1.0"),
    ({"max_error": float("inf")}, "finite"),
    ({"max_error": "1e-2"}, "finite"),
    ({"max_error": 1e-2, "max_evaluations": 1}, "max_evaluations=1"),
    ({"max_error": 1e-2, "calibration_data": torch.ones(2, 8)}, "list of batches"),
    ({"max_error": 1e-2, "calibration_data": [1]}, "calibration_data[0]"),
    ({"calibration_data": [torch.ones(2, 8)]}, "needs max_error"),
    ({"emit_rules": "x.toml"}, "needs max_error"),
    ({"max_error": 1e-2, "mode": "both"}, "mode='both'"),
])
def test_argument_errors_are_one_line(kwargs, words):
    model = torch.nn.Linear(8, 4)
    with pytest.raises(UsageError) as info:
        rewrite(model, (torch.ones(2, 8),), **kwargs)
    assert words in str(info.value) and "\n" not in str(info.value)
