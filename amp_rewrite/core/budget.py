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

Around the search, written once for both paths against ``BudgetAdapter`` (decision 0035):
``plan_within_budget`` (the search, its estimate from recorded values, then ``relax``), and
``BudgetOutcome``: the report section, the pinned and lowered records, the held-out numbers
and the rule overlay.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from amp_rewrite.core.metric import peak_magnitude, worst_relative_error

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


# ----------------------------------------------------------------------------- adapters


class BudgetAdapter(Protocol):
    """What a path gives the budget. Plans are the adapter's own objects (an ONNX
    ``PrecisionPlan``, a lowered torch graph); values are named by the adapter."""

    low_max: float  # the low dtype's largest finite value: a unit beyond it overflows
    # (an adapter whose units run in different low dtypes, a mixed plan's fp16 or bf16, also
    # gives ``unit_low_max(key)``: ``unit_low_max`` below)
    mask_sentinel: float | None  # magnitudes the low plan gives its own extreme (None: none)
    graph_outputs: frozenset[str]  # names of the values the graph outputs

    def units(self) -> list[Unit]:
        """The nodes the default plan runs low by the rules' choice, with FLOPs as weight."""

    def relax_units(self) -> list[Unit]:
        """Nodes the default plan keeps fp32 only for headroom, which the budget may run low
        (``relax``); none where the path has no such pins."""

    def fp32_reason(self, key: Hashable) -> str:
        """Why the default plan keeps a ``relax_units`` node fp32."""

    def plan(self, pins: frozenset = frozenset(), low_pins: frozenset = frozenset()) -> Any:
        """The default plan with the ``pins`` units fixed fp32 and ``low_pins`` low."""

    def measure(self, plan: Any, held_out: bool = False) -> float | None:
        """The metric (``core.metric``) of ``plan`` on the search (or held-out) inputs;
        None without held-out inputs."""

    def values(self, plan: Any | None) -> Mapping[str, Sequence]:
        """Intermediate values by name, each a list of arrays, of one run of ``plan`` on the
        first search inputs (None: the FP32 graph)."""

    def unit_io(self, key: Hashable) -> tuple[Sequence[str], Sequence[str]]:
        """The names of a unit's inputs and outputs, as ``values`` names them."""


def plan_within_budget(adapter: BudgetAdapter, budget: float, option: str, *,
                       max_evaluations: int = DEFAULT_MAX_EVALUATIONS,
                       progress: Callable[[int, float], None] | None = None
                       ) -> tuple[BudgetResult, list[Unit], Relaxed | None]:
    """The search on the adapter's units (its estimate: ``estimate_contributions``), then,
    with slack left, ``relax``: (the search's result, its units, the relaxation)."""
    units = adapter.units()
    result = search(units, lambda pins: adapter.measure(adapter.plan(frozenset(pins))), budget,
                    estimate=lambda: estimate_contributions(adapter, units),
                    max_evaluations=max_evaluations, progress=progress)
    relaxed = relax(adapter, budget, option, max_evaluations - result.evaluations, result,
                    progress)
    return result, units, relaxed


def unit_peak(adapter: BudgetAdapter, key: Hashable, fp32: Mapping[str, Sequence]) -> float:
    """The largest |x| a unit reads or writes in the FP32 run (the mask sentinel aside)."""
    ins, outs = adapter.unit_io(key)
    return peak_magnitude([a for name in (*ins, *outs) for a in fp32.get(name, ())],
                          adapter.mask_sentinel)


def unit_low_max(adapter: BudgetAdapter, key: Hashable) -> float:
    """The largest finite value of the dtype the default plan runs unit ``key`` in: the
    adapter's ``unit_low_max`` where its units differ in dtype (a mixed plan's fp16 or
    bf16), else its one ``low_max``."""
    per_unit = getattr(adapter, "unit_low_max", None)
    return adapter.low_max if per_unit is None else per_unit(key)


def estimate_contributions(adapter: BudgetAdapter, units: list[Unit]
                           ) -> dict[Hashable, float]:
    """Each unit's error contribution without measuring it alone (one plan run): infinite
    for a unit with a value beyond the low dtype's range in the FP32 run — found without a
    run, where one overflow's infinities would hide the next — else the error it injects
    in the default plan with those pinned (``injected_errors``)."""
    fp32 = adapter.values(None)
    overflowing = {u.key for u in units
                   if unit_peak(adapter, u.key, fp32) > unit_low_max(adapter, u.key)}
    low = adapter.values(adapter.plan(frozenset(overflowing)))
    scores = injected_errors(adapter, units, fp32, low)
    scores.update(dict.fromkeys(overflowing, math.inf))
    return scores


def injected_errors(adapter: BudgetAdapter, units: Iterable[Unit],
                    fp32: Mapping[str, Sequence], low: Mapping[str, Sequence]
                    ) -> dict[Hashable, float]:
    """Each unit's output error less its inputs' (both the metric against FP32): infinite
    where it turns finite inputs into Inf or NaN, 0 where its inputs are already infinite
    (nothing is known there). A unit writing a graph output deducts nothing: its own
    rounding reaches the output whole."""
    cache: dict[str, float] = {}

    def error(name: str) -> float:
        if name not in cache:
            cache[name] = (worst_relative_error(fp32[name], low[name])
                           if name in fp32 and name in low else 0.0)
        return cache[name]

    scores = {}
    for unit in units:
        ins, outs = adapter.unit_io(unit.key)
        out_error = max((error(v) for v in outs), default=0.0)
        in_error = 0.0 if adapter.graph_outputs & set(outs) else max(
            (error(v) for v in ins if v), default=0.0)
        if math.isinf(in_error):
            scores[unit.key] = 0.0
        elif math.isinf(out_error):
            scores[unit.key] = math.inf
        else:
            scores[unit.key] = max(out_error - in_error, 0.0)
    return scores


@dataclass
class Relaxed:
    """Nodes the default plan kept fp32 for headroom that the budget runs low."""

    result: BudgetResult  # its pins: the candidates kept fp32
    units: list[Unit]
    lowered: dict[Hashable, str]  # node -> reason
    plan: Any


def relax(adapter: BudgetAdapter, budget: float, option: str, left: int,
          tightened: BudgetResult, progress: Callable[[int, float], None] | None
          ) -> Relaxed | None:
    """With the default plan within the budget, the most FLOPs of ``adapter.relax_units``
    run low instead, measured as the pins are (``search`` with pinned = kept fp32). The
    calibration threshold (4096 for fp16) keeps headroom below the range that a
    measurement can give back (decision 0028 §2)."""
    if tightened.pins or not tightened.reachable or left < 3:
        return None
    units = adapter.relax_units()
    if not units:
        return None
    every = frozenset(u.key for u in units)

    def plan_of(kept: frozenset) -> Any:
        return adapter.plan(low_pins=every - kept)

    shown = None if progress is None else (
        lambda done, error: progress(tightened.evaluations + done, error))
    result = search(units, lambda kept: adapter.measure(plan_of(frozenset(kept))), budget,
                    max_evaluations=left, progress=shown)
    kept = frozenset(result.pins) if result.reachable else every
    lowered = {key: (f"run low by the accuracy budget {option} (the plan measures "
                     f"{rounded(result.error)}; the rules kept it fp32: "
                     f"{adapter.fp32_reason(key)})")
               for key in sorted(every - kept, key=str)}
    return Relaxed(result, units, lowered, plan_of(kept))


def low_flop_share(weights: Mapping[Hashable, float], low: Iterable[Hashable]) -> float:
    """FLOPs of the ``low`` nodes over all of ``weights`` (1 when there are none)."""
    total = sum(weights.values())
    return sum(weights[n] for n in set(low) if n in weights) / total if total else 1.0


# ----------------------------------------------------------------------------- the outcome


@dataclass
class BudgetOutcome:
    """What the search chose and measured, for the final rewrite and its report."""

    result: BudgetResult
    units: list[Unit]
    option: str  # how the user spelled the budget: "--max-error 0.001", "max_error=0.001"
    inputs: str  # where the search inputs came from
    held_out_inputs: str
    measured_by: str  # how a plan's error is measured on this path
    relaxed: Relaxed | None = None
    held_out_error: float | None = None  # the final plan's
    default_held_out_error: float | None = None
    shares: tuple[float, float] = (1.0, 1.0)  # FLOP-weighted low share: (final, default)
    seconds: float = 0.0

    @property
    def pins(self) -> dict[Hashable, str]:
        """Node -> why it is pinned fp32 (the adapter's budget pins option)."""
        return {k: pin_reason(self.result, k, self.option) for k in self.result.pins}

    @property
    def lowered(self) -> dict[Hashable, str]:
        """Node -> why it runs low (the adapter's budget low option)."""
        return self.relaxed.lowered if self.relaxed else {}

    @property
    def error(self) -> float:
        """The final plan's error on the search inputs."""
        return self.relaxed.result.error if self.relaxed else self.result.error

    def report(self) -> dict:
        """The report's ``budget`` section."""
        r, x = self.result, self.relaxed
        return {"max_error": r.budget, "reachable": r.reachable,
                "achieved": rounded(self.error), "held_out": rounded(self.held_out_error),
                "default_plan_error": rounded(r.start_error),
                "default_plan_held_out": rounded(self.default_held_out_error),
                "all_pinned_error": rounded(r.floor_error),
                "evaluations": r.evaluations + (x.result.evaluations if x else 0),
                "seconds": round(self.seconds, 3),
                "contributions": "measured" if r.measured else "estimated",
                "low_flop_share": round(self.shares[0], 4),
                "default_low_flop_share": round(self.shares[1], 4),
                "inputs": self.inputs, "held_out_inputs": self.held_out_inputs,
                "measured_by": self.measured_by}

    def pinned(self) -> list[dict]:
        """The report's ``pinned_by_budget``."""
        return pinned_records(self.result, self.units)

    def lowered_nodes(self) -> list[dict]:
        """The report's ``lowered_by_budget``: node, FLOPs."""
        if not self.relaxed:
            return []
        weight = {u.key: u.weight for u in self.relaxed.units}
        return [{"node": n, "flops": weight[n]} for n in sorted(self.lowered, key=str)]

    def warn_if_held_out_above(self, log, data: str) -> None:
        """A warning when the final plan's held-out error exceeds E (``data``: the option
        that gives more varied inputs)."""
        held, budget = self.held_out_error, self.result.budget
        if held is not None and held > budget:
            log.warning("accuracy budget: the plan's error on the held-out inputs (%s) is "
                        "%.3g, above %s (%.3g on the inputs searched); pass more varied %s",
                        self.held_out_inputs, held, self.option, self.error, data)

    def overlay(self, reproduce: str, fp32: Iterable[tuple[str, str, str]] = ()) -> str:
        """The rule overlay (``rule_overlay``) reproducing the plan without the search or
        the data: the budget's pins, ``fp32`` entries the adapter adds (its other pins),
        the lowered nodes as ``[keep_low]``. ``reproduce``: the first header line."""
        pins = pin_entries(self.result, self.units, self.pins)
        low = [(fnmatch_literal(str(n)), why, "") for n, why in
               sorted(self.lowered.items(), key=lambda item: str(item[0]))]
        header = [reproduce, f"error {rounded(self.error)} on {self.inputs}; "
                             f"{rounded(self.held_out_error)} on {self.held_out_inputs}; "
                             f"{self.result.evaluations} evaluations"]
        return rule_overlay([*pins, *fp32], header, low)
