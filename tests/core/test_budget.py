"""The accuracy-budget search (core/budget.py) against brute force over every pin set."""
from __future__ import annotations

import itertools
import math
import random

import pytest

from amp_rewrite.core.budget import Unit, fnmatch_literal, search


def _instance(seed: int, n: int):
    """Units with random weights and an error model that is not additive: each low unit
    adds its own error, amplified when its neighbour in a chain is low too, and one unit
    may overflow (infinite error) unless pinned."""
    rng = random.Random(seed)
    weights = [rng.choice([1, 2, 5, 40, 100]) * rng.uniform(0.5, 1.5) for _ in range(n)]
    errs = [rng.choice([1e-4, 3e-4, 1e-3, 4e-3]) * rng.uniform(0.5, 2) for _ in range(n)]
    hot = rng.randrange(n) if seed % 3 == 0 else None

    def error(pins: frozenset) -> float:
        low = [i not in pins for i in range(n)]
        if hot is not None and low[hot]:
            return math.inf
        total = 0.0
        for i in range(n):
            if low[i]:
                total += errs[i] * (1.5 if i and low[i - 1] else 1.0)
        return total

    units = [Unit(i, w) for i, w in enumerate(weights)]
    return units, error


def _best_share(units, error, budget):
    total = sum(u.weight for u in units)
    best = None
    for r in range(len(units) + 1):
        for pins in itertools.combinations(range(len(units)), r):
            if error(frozenset(pins)) <= budget:
                share = 1 - sum(units[i].weight for i in pins) / total
                best = share if best is None else max(best, share)
    return best


@pytest.mark.parametrize("seed", range(24))
def test_search_is_near_the_brute_force_optimum(seed):
    n = 6 + seed % 7  # 6..12 units
    units, error = _instance(seed, n)
    budget = [2e-3, 5e-3, 1e-2][seed % 3]
    calls = []
    result = search(units, lambda p: calls.append(p) or error(p), budget, margin=1.0)
    best = _best_share(units, error, budget)
    assert len(set(calls)) == result.evaluations <= 25
    assert best is not None and result.reachable
    assert result.error <= budget and error(frozenset(result.pins)) == result.error
    assert result.low_share(units) >= best - 0.10, (result.low_share(units), best)


def test_plans_are_held_to_the_margin_below_the_budget():
    units, error = _instance(4, 10)
    result = search(units, error, 5e-3, margin=0.5)
    assert result.budget == 5e-3 and result.error <= 2.5e-3


def test_loose_budget_keeps_the_default_plan_in_one_evaluation():
    units, error = _instance(1, 8)
    result = search(units, error, budget=1.0)
    assert result.pins == () and result.evaluations == 1 and result.reachable
    assert result.error == error(frozenset())


def test_zero_budget_pins_every_unit_that_rounds():
    units, error = _instance(2, 8)
    result = search(units, error, budget=0.0)
    assert result.reachable and result.error == 0.0
    assert set(result.pins) == {u.key for u in units}  # every unit adds some error here


def test_unreachable_budget_says_so_and_returns_the_all_pinned_plan():
    units = [Unit(i, 1.0) for i in range(4)]
    result = search(units, lambda pins: 1e-3 + 1e-3 * (4 - len(pins)), budget=1e-4)
    assert not result.reachable and set(result.pins) == {0, 1, 2, 3}
    assert result.error == result.floor_error == pytest.approx(1e-3)


def test_many_units_use_the_adapters_scores_within_the_evaluation_cap():
    # 300 units, 3 of them responsible for almost all the error: the scores find them
    n = 300
    culprits = {7, 150, 299}

    def error(pins):
        return sum(1e-2 if i in culprits else 1e-6 for i in range(n) if i not in pins)

    units = [Unit(i, 10.0, score=1e-2 if i in culprits else 1e-6) for i in range(n)]
    result = search(units, error, budget=1e-3, max_evaluations=25)
    assert result.evaluations <= 25 and not result.measured
    assert result.error <= 1e-3 and set(result.pins) == culprits


def test_nan_counts_as_infinite_and_an_overflowing_unit_is_pinned():
    units = [Unit(i, 1.0) for i in range(5)]
    result = search(units, lambda pins: float("nan") if 3 not in pins else 1e-4, budget=1e-3)
    assert result.pins == (3,) and result.error == 1e-4


def test_fnmatch_literal_matches_only_the_name():
    import fnmatch

    name = "/layer[0]/attn*?/MatMul"
    pattern = fnmatch_literal(name)
    assert fnmatch.fnmatchcase(name, pattern)
    assert not fnmatch.fnmatchcase("/layer0/attnX/MatMul", pattern)
