"""The budget around the search (core/budget.py): the estimate from recorded values, the
relaxation and the outcome, on a toy adapter whose errors are worked out by hand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from amp_rewrite.core import budget as core_budget
from amp_rewrite.core.budget import Unit


class Chain:
    """x -> a -> b -> c (the graph output), each node doubling its input. A node run low
    multiplies its result by 1.01; ``extra`` adds a fixed error per low relaxation
    candidate."""

    mask_sentinel = None
    graph_outputs = frozenset({"c"})

    def __init__(self, low_max: float = 100.0, extra: dict | None = None) -> None:
        self.low_max, self.extra = low_max, extra or {}
        self.plans: list = []

    def units(self):
        return [Unit(k, w) for k, w in (("a", 10.0), ("b", 10.0), ("c", 10.0))]

    def relax_units(self):
        return [Unit(k, 1.0 + i) for i, k in enumerate(sorted(self.extra))]

    def fp32_reason(self, key):
        return f"calibration saw {key} large"

    def plan(self, pins=frozenset(), low_pins=frozenset()):
        self.plans.append((frozenset(pins), frozenset(low_pins)))
        return frozenset(pins), frozenset(low_pins)

    def values(self, plan):
        pins = plan[0] if plan is not None else {"a", "b", "c"}
        x = 1.0
        out = {"x": [np.array([x])]}
        for name in "abc":
            x = 2 * x * (1.0 if name in pins else 1.01)
            out[name] = [np.array([x])]
        return out

    def unit_io(self, key):
        return ["xab"["abc".index(key)]], [key]

    def measure(self, plan, held_out=False):
        fp32, low = self.values(None), self.values(plan)
        return (abs(low["c"][0][0] - fp32["c"][0][0]) / fp32["c"][0][0]
                + sum(e for k, e in self.extra.items() if k in plan[1]))


def test_estimate_is_output_error_less_input_error_and_a_graph_output_keeps_its_own():
    chain = Chain()
    scores = core_budget.estimate_contributions(chain, chain.units())
    # a: 1.01 - 1 = 0.01; b: 1.01² - 1 = 0.0201 less a's 0.01; c writes the graph output:
    # 1.01³ - 1 = 0.030301, nothing deducted
    assert scores["a"] == pytest.approx(0.01)
    assert scores["b"] == pytest.approx(0.0101)
    assert scores["c"] == pytest.approx(0.030301)


def test_a_unit_beyond_the_low_range_in_fp32_is_infinite_and_pinned_for_the_rest():
    chain = Chain(low_max=5.0)  # c is 8 in FP32
    scores = core_budget.estimate_contributions(chain, chain.units())
    assert scores["c"] == math.inf
    assert scores["a"] == pytest.approx(0.01) and scores["b"] == pytest.approx(0.0101)
    assert chain.plans == [(frozenset({"c"}), frozenset())]  # one plan run, c pinned


def test_relaxation_lowers_the_candidates_that_fit_and_keeps_the_rest():
    # the budget 0.1 holds plans to 0.05: the chain's 0.030301 fits; r1 low adds 0.03
    # (0.0603: too much), r2 0.001
    chain = Chain(extra={"r1": 0.03, "r2": 0.001})
    result, units, relaxed = core_budget.plan_within_budget(chain, 0.1, "--max-error 0.1")
    assert result.pins == () and result.reachable
    assert set(relaxed.lowered) == {"r2"}
    assert "the rules kept it fp32: calibration saw r2 large" in relaxed.lowered["r2"]
    assert relaxed.plan == (frozenset(), frozenset({"r2"}))

    outcome = core_budget.BudgetOutcome(result, units, "--max-error 0.1", "data", "held",
                                        "toy", relaxed, 0.02, 0.01, (0.9, 0.8))
    report = outcome.report()
    assert report["achieved"] == pytest.approx(0.0313, abs=1e-6)  # 0.030301 + 0.001
    assert report["evaluations"] == result.evaluations + relaxed.result.evaluations
    assert (report["low_flop_share"], report["measured_by"]) == (0.9, "toy")
    assert outcome.lowered_nodes() == [{"node": "r2", "flops": 2.0}]
    text = outcome.overlay("header")
    assert "[keep_low]" in text and '"r2" = ' in text


def test_no_relaxation_when_the_budget_needed_pins():
    chain = Chain(extra={"r1": 0.001})
    result, _, relaxed = core_budget.plan_within_budget(chain, 0.03, "--max-error 0.03")
    assert result.pins and relaxed is None


def test_low_flop_share():
    assert core_budget.low_flop_share({"a": 3.0, "b": 1.0}, ["a"]) == 0.75
    assert core_budget.low_flop_share({}, []) == 1.0
