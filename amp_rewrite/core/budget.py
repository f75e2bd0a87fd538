"""The accuracy-budget search: the fewest, cheapest fp32 pins that bring the error under E.

Pure: the adapter supplies the candidate units (nodes the default plan runs low, with their
FLOPs as the weight the search tries to keep low) and ``evaluate(pins) -> error``, which
re-plans with ``pins`` fixed HIGH (the exact min cut places the casts anew) and measures the
relative output error under low-precision rounding. The search spends at most
``max_evaluations`` calls:

1. the default plan (no pins): within E, it is the answer;
2. every unit pinned: above E, E is unreachable and that plan is the answer;
3. contributions: when the units are few enough, each unit's error measured with it alone
   low and every other unit pinned (less step 2's error: an overflow elsewhere cannot hide
   it); else the adapter's estimate (``Unit.score``);
4. candidate plans, each by a bounded search on measured errors: the shortest prefix within
   E of the units pinned cheapest first (bisection: rounding errors compound along a chain
   such as a residual stream, where each unit alone is harmless, and the light units cost
   little share); the shortest prefix of the units by the magnitude of their values,
   largest first, when the adapter knows it (a calibration threshold sweep, in log2 n
   plans); and an additive model, error ≈ floor + Σ contributions of the low units, as a
   0/1 knapsack: keep low the most weight whose contributions fit in a capacity that starts
   at E − floor and is searched (doubling, halving, bisection), since real errors compound
   or cancel where the model adds. The lightest plan wins;
5. pruning: runs of the best plan's pins, heaviest first, go back to low while the
   measured error stays within E: half of them at a time, then quarters, down to single
   pins, until the evaluations run out.

Every plan returned was measured within E (or is step 2's).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field

DEFAULT_MAX_EVALUATIONS = 25
# Plans must measure within this fraction of E on the inputs searched: the promise is E on
# inputs the search did not see, and the max-error metric of a plan on the held-out half of
# the same data came out up to 1.64x its searched value (bench budget: GPT-2 bf16, 4 rows).
SEARCH_MARGIN = 0.5


@dataclass(frozen=True)
class Unit:
    """A candidate for pinning: one node the default plan runs low."""

    key: Hashable
    weight: float  # FLOPs (or any cost of running it high): the share the search protects
    score: float | None = None  # the adapter's estimate of its error contribution
    peak: float = 0.0  # the largest |x| it reads or writes in the FP32 run (0: unknown)


@dataclass(frozen=True)
class BudgetResult:
    budget: float  # E (the plans were held to margin · E)
    pins: tuple[Hashable, ...]  # heaviest first
    error: float  # of the returned plan, on the search inputs
    start_error: float  # the default plan's
    floor_error: float | None  # every unit pinned (None: not measured, the default was within)
    evaluations: int
    reachable: bool
    contributions: Mapping[Hashable, float] = field(default_factory=dict)
    measured: bool = False  # contributions measured one unit at a time (else estimated)

    def low_share(self, units: Iterable[Unit]) -> float:
        """Share of the units' weight still low in the returned plan."""
        units = list(units)
        total = sum(u.weight for u in units)
        pinned = set(self.pins)
        return sum(u.weight for u in units if u.key not in pinned) / total if total else 1.0


class _Evaluator:
    """``evaluate`` with a cache and a count; a NaN error counts as infinite."""

    def __init__(self, evaluate: Callable[[frozenset], float], limit: int,
                 progress: Callable[[int, float], None] | None) -> None:
        self._evaluate, self.limit, self._progress = evaluate, limit, progress
        self.cache: dict[frozenset, float] = {}
        self.extra = 0  # evaluations spent outside ``evaluate`` (the adapter's estimate)

    @property
    def count(self) -> int:
        return len(self.cache) + self.extra

    @property
    def left(self) -> int:
        return self.limit - self.count

    def __call__(self, pins: Iterable[Hashable]) -> float:
        pins = frozenset(pins)
        if pins not in self.cache:
            error = float(self._evaluate(pins))
            self.cache[pins] = math.inf if math.isnan(error) else error
            if self._progress:
                self._progress(self.count, self.cache[pins])
        return self.cache[pins]


def search(units: Iterable[Unit], evaluate: Callable[[frozenset], float], budget: float, *,
           max_evaluations: int = DEFAULT_MAX_EVALUATIONS, margin: float = SEARCH_MARGIN,
           estimate: Callable[[], Mapping[Hashable, float]] | None = None,
           progress: Callable[[int, float], None] | None = None) -> BudgetResult:
    """The plan with the most low weight whose measured error is within ``margin · budget``
    (module docstring). ``estimate()``: the adapter's contribution estimates by unit key,
    asked for (and counted as one evaluation) only when the units are too many to measure;
    without it, ``Unit.score``. ``progress(evaluations_done, error)`` follows each one."""
    if max_evaluations < 2:
        raise ValueError("max_evaluations must be at least 2")
    limit = budget * margin
    units = sorted(units, key=lambda u: str(u.key))  # deterministic whatever the caller's order
    ev = _Evaluator(evaluate, max_evaluations, progress)
    start = ev(())
    if start <= limit or not units:
        return BudgetResult(budget, (), start, start, None, ev.count, start <= limit)
    everything = tuple(u.key for u in units)
    floor = ev(everything)
    if floor > limit:
        return BudgetResult(budget, everything, floor, start, floor, ev.count, False)
    contributions, measured = _contributions(units, ev, floor, estimate)
    weight = {u.key: u.weight for u in units}
    orders = [_cheapest_first(units, contributions)]
    if any(u.peak for u in units):
        orders.append(_largest_first(units))
    bisection = math.ceil(math.log2(len(units) + 1))
    candidates = [_shortest_prefix(order, ev, limit, bisection) for order in orders]
    candidates.append(_capacity_search(units, contributions, ev, limit, limit - floor))
    best = min(candidates, key=lambda pins: sum(weight[k] for k in pins))
    pins = _pruned(sorted(best, key=lambda k: (-weight[k], str(k))), ev, limit)
    return BudgetResult(budget, tuple(pins), ev(pins), start, floor, ev.count, True,
                        contributions, measured)


def _pruned(pins: list[Hashable], ev: _Evaluator, budget: float) -> list[Hashable]:
    """``pins`` (heaviest first) less the runs of them that can go low within the budget:
    runs of half the pins first, then halves of those, down to single pins, while
    evaluations remain (most pins a search returns are often removable together)."""
    size = max(len(pins) // 2, 1)
    while ev.left > 0:
        i = 0
        while i < len(pins):
            trial = pins[:i] + pins[i + size:]
            if frozenset(trial) not in ev.cache and ev.left <= 0:
                return pins
            if ev(trial) <= budget:
                pins = trial
            else:
                i += size
        if size == 1:
            break
        size = max(size // 2, 1)
    return pins


_CAPACITY_ROUNDS = 60
_PRUNE_RESERVE = 3  # evaluations the knapsack search leaves to pruning


def _cheapest_first(units: list[Unit], contributions: Mapping[Hashable, float]
                    ) -> list[Hashable]:
    """Units that overflow first, then the lightest (larger contribution first among
    equals). Rounding errors compound through a chain (a residual stream rounded at every
    layer), so units harmless alone can matter together; the light ones (norms, adds,
    softmax) cost little share, the GEMMs much."""
    return [u.key for u in sorted(units, key=lambda u: (
        contributions[u.key] < math.inf, u.weight, -contributions[u.key], str(u.key)))]


def _largest_first(units: list[Unit]) -> list[Hashable]:
    """Units by the largest magnitude they read or write in the FP32 run, largest first: a
    prefix is a calibration threshold's pin set, so the threshold the user would sweep by
    hand is among the candidates (values near the range, or far above the signal they
    carry, as a residual stream with a large offset)."""
    return [u.key for u in sorted(units, key=lambda u: (-u.peak, u.weight, str(u.key)))]


def _shortest_prefix(order: list[Hashable], ev: _Evaluator, budget: float, limit: int
                     ) -> list[Hashable]:
    """The shortest prefix of ``order`` within the budget, by bisection in at most ``limit``
    evaluations (every unit pinned is within it: step 2)."""
    low, high = 0, len(order)  # prefix `low` is above the budget, prefix `high` within it
    spent = ev.count
    while high - low > 1 and ev.left > _PRUNE_RESERVE + 2 and ev.count - spent < limit:
        mid = (low + high) // 2
        if ev(order[:mid]) <= budget:
            high = mid
        else:
            low = mid
    return order[:high]


_KNAPSACK_STEPS = 2000  # capacity resolution: contributions round up to 1/2000 of it


def _capacity_search(units: list[Unit], contributions: Mapping[Hashable, float],
                     ev: _Evaluator, budget: float, capacity: float) -> list[Hashable]:
    """The measured-feasible pin set with the least pinned weight among the knapsack plans
    tried (step 4); every unit pinned if none was feasible."""
    everything = [u.key for u in units]
    weight = {u.key: u.weight for u in units}
    best, best_pinned = everything, sum(weight.values())
    feasible_cap, infeasible_cap = 0.0, math.inf
    capacity = max(capacity, 1e-30)
    for _ in range(_CAPACITY_ROUNDS):  # a plan seen before costs no evaluation
        if ev.left <= 1 + _PRUNE_RESERVE or infeasible_cap / max(feasible_cap, 1e-300) < 1.01:
            break
        pins = frozenset(everything) - _knapsack(units, contributions, capacity)
        if ev(pins) <= budget:
            pinned = sum(weight[k] for k in pins)
            if pinned < best_pinned:
                best, best_pinned = list(pins), pinned
            feasible_cap = capacity
        else:
            infeasible_cap = capacity
        if math.isinf(infeasible_cap):
            capacity *= 2
        elif feasible_cap == 0.0:
            capacity /= 2
        else:
            capacity = math.sqrt(feasible_cap * infeasible_cap)
    return best


def _knapsack(units: list[Unit], contributions: Mapping[Hashable, float],
              capacity: float) -> frozenset:
    """The units kept low: the most weight whose contributions fit in ``capacity``, exact on
    contributions rounded up to ``capacity / _KNAPSACK_STEPS`` (units contributing nothing
    are always kept, infinite ones never)."""
    import numpy as np

    kept = {u.key for u in units if contributions[u.key] <= 0}
    items = [(u.key, u.weight, math.ceil(contributions[u.key] / capacity * _KNAPSACK_STEPS))
             for u in units if 0 < contributions[u.key] < math.inf]
    items = [(k, w, c) for k, w, c in items if c <= _KNAPSACK_STEPS]
    if not items:
        return frozenset(kept)
    best = np.full(_KNAPSACK_STEPS + 1, -np.inf)
    best[0] = 0.0
    take = np.zeros((len(items), _KNAPSACK_STEPS + 1), dtype=bool)
    for i, (_, w, c) in enumerate(items):
        shifted = np.full_like(best, -np.inf)
        shifted[c:] = best[:len(best) - c] + w
        take[i] = shifted > best
        best = np.maximum(best, shifted)
    used = int(np.argmax(best))
    for i in range(len(items) - 1, -1, -1):
        if take[i, used]:
            kept.add(items[i][0])
            used -= items[i][2]
    return frozenset(kept)


def _contributions(units: list[Unit], ev: _Evaluator, floor: float, estimate
                   ) -> tuple[dict[Hashable, float], bool]:
    """Each unit's contribution: measured alone low when the evaluations allow it and still
    leave a bisection and some pruning, else the adapter's estimate (0 where it has none)."""
    n = len(units)
    reserve = math.ceil(math.log2(n + 1)) + 2
    if n + reserve <= ev.left:
        keys = [u.key for u in units]
        return {k: ev([o for o in keys if o != k]) - floor for k in keys}, True
    if estimate is not None:
        ev.extra += 1
        scores = estimate()
        return {u.key: scores.get(u.key, 0.0) for u in units}, False
    return {u.key: u.score or 0.0 for u in units}, False


def rounded(x: float | None) -> float | str | None:
    """A measured error for a report: 4 significant digits, ``"inf"`` for infinity."""
    if x is None:
        return None
    return "inf" if math.isinf(x) else float(f"{x:.4g}")


def pin_reason(result: BudgetResult, key: Hashable, option: str) -> str:
    """Why the budget pinned ``key``, for ``explain`` (``option``: how the user spelled the
    budget, ``--max-error 0.001`` or ``max_error=0.001``)."""
    c = result.contributions.get(key)
    how = "measured alone low" if result.measured else "estimated in the default plan"
    amount = "" if c is None else f"; {how}, it adds {rounded(c)} to the output error"
    return (f"pinned fp32 by the accuracy budget {option} (the plan measures "
            f"{rounded(result.error)}, {rounded(result.start_error)} with this node and the "
            f"budget's other pins low{amount})")


def pinned_records(result: BudgetResult, units: Iterable[Unit]) -> list[dict]:
    """The report's ``pinned_by_budget``: node (the unit key), contribution, FLOPs."""
    weight = {u.key: u.weight for u in units}
    return [{"node": k, "contribution": rounded(result.contributions.get(k)),
             "flops": weight[k]} for k in result.pins]


def pin_entries(result: BudgetResult, units: Iterable[Unit], reasons: Mapping[Hashable, str]
                ) -> list[tuple[str, str, str]]:
    """``rule_overlay`` entries for the pins: exact-name pattern, reason, measured comment."""
    return [(fnmatch_literal(r["node"]), reasons[r["node"]],
             f"contribution {r['contribution']}, {r['flops']:.4g} FLOPs")
            for r in pinned_records(result, units)]


def fnmatch_literal(name: str) -> str:
    """An fnmatch pattern matching exactly ``name`` (``[``, ``*``, ``?`` escaped)."""
    return "".join(f"[{c}]" if c in "[]*?" else c for c in name)


def rule_overlay(pins: Iterable[tuple[str, str, str]], header: Iterable[str] = (),
                 low: Iterable[tuple[str, str, str]] = ()) -> str:
    """A rule file (``core.rules`` format) whose ``[keep_fp32]`` table holds ``pins`` and
    ``[keep_low]`` table ``low``: (node-name pattern, reason, comment line or ""), each
    pattern a TOML basic string."""
    import json

    lines = [f"# {h}" for h in header] + ["schema = 1"]
    for table, entries in (("keep_fp32", pins), ("keep_low", low)):
        entries = list(entries)
        if table == "keep_low" and not entries:
            continue
        lines += ["", f"[{table}]"]
        for pattern, reason, comment in entries:
            if comment:
                lines.append(f"# {comment}")
            lines.append(f"{json.dumps(pattern, ensure_ascii=False)} = "
                         f"{json.dumps(reason, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"
