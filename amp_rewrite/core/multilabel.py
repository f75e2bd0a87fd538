"""Three-label placement: fp16 where it fits, bf16 where it must, fp32 only where neither will
do (decision 0037). Framework-neutral, like the rest of the core (docs/design.md §2).

The two-label placement (``core/placement.py``) chooses fp32 or one low dtype per group by an
exact minimum cut. Here every group gets one of three labels from the set the constraints
allow it (``allowed_labels``), minimising lexicographically

1. ``CAST_WEIGHT`` · Σ_values bytes(v) · |{labels v's readers want} − {label v is made in}|
   + ``placement.traffic_weight(β)`` · Σ_{groups left fp32} traffic  (the primary objective,
   exactly ``core/placement.py``'s, with fp16 and bf16 both "low": both halve traffic);
2. Σ_groups rank(label) with rank fp16 = 0, bf16 = 1, fp32 = 2: among plans equal in 1, fp16's
   mantissa is preferred. Never traded against 1: it is a second tier, not a small weight.

A cast of a value to a dtype is shared by all readers wanting that dtype, so a value costs its
bytes once per *other* dtype wanted; an fp16↔bf16 cast costs like any other. With shared casts
and three labels this is a multiway-cut-like problem (NP-hard in general, decision 0037), so it
is solved exactly as an integer program on OR-Tools CP-SAT, after the same decomposition as
``core/placement.py``: groups with one allowed label are terminals, the free groups split into
independent regions, and a region is answered without a solver when every group's preferred
label costs nothing, by enumeration when it is small, once per canonical form (repeated
layers), and by CP-SAT otherwise.

*Free reads* (PyTorch type promotion): a promoting reader running fp32 next to an anchoring
input fixed fp32 reads a low value without a cast, as in ``placement.free_reads``; the caller
computes them with the fp32-fixed groups as ``fixed``.
"""
from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from amp_rewrite.core import constraints, maxflow, placement
from amp_rewrite.core.graph import PrecisionGraph
from amp_rewrite.core.plan import CastPlan, Decision, PrecisionPlan, cast_needs
from amp_rewrite.core.precision import Label, OpClass, Precision
from amp_rewrite.core.rules import RuleSet

CAST_WEIGHT = placement.CAST_WEIGHT
ENUMERATE_UP_TO = 243  # labellings (3**5): cheaper to enumerate than to build a CP-SAT model
MIN_SOLVE_SECONDS = 0.1  # a region reached after the deadline still gets this long
# CP-SAT puts every constraint into its LP relaxation at level 2: at level 1 an 800-group
# region stayed unproven after 60 s, at level 2 it took 4.4 s (decision 0037).
LINEARIZATION = 2
_INT64_SAFE = 1 << 62  # objective sums below this are safe for CP-SAT's int64 arithmetic


PREFERENCE = (Label.FP16, Label.BF16, Label.FP32)  # most preferred first
RANK = MappingProxyType({label: i for i, label in enumerate(PREFERENCE)})
ALL_LABELS = frozenset(Label)
LOW_LABELS = frozenset({Label.FP16, Label.BF16})


class Why(enum.Enum):
    """The kind of reason behind a group's label."""

    FIXED = "fixed"  # the adapter fixed the dtype (graph I/O kept, dtype already in the model)
    RULE = "rule"  # a constraint: allow/deny class, pin, deny propagation, beyond bf16's range
    RANGE = "range"  # its values exceed fp16's range: bf16, or fp32 where that casts less
    PRECISION = "precision"  # free, fp16: the most mantissa among the cheapest plans
    CASTS = "casts"  # free, bf16 or fp32: fp16 would need more cast bytes (or traffic)


class Allowed(NamedTuple):
    """The labels a group may take, and why it is restricted to them."""

    labels: frozenset[Label]
    why: Why | None  # None: free, the solver decides (Why.PRECISION or Why.CASTS)
    reason: str = ""
    cause: Hashable | None = None  # the group whose decision forced this one


FREE = Allowed(ALL_LABELS, None)


def allowed_labels(fix: constraints.Fix | None = None, *, needs_range: bool = False,
                   range_reason: str = "", adapter_dtype: Label | None = None) -> Allowed:
    """The labels one group may take, from what ``core/constraints.py`` decided for it.

    - ``adapter_dtype`` (the adapter fixed the group: kept graph I/O, a dtype already in the
      model): that dtype only. It wins over everything, as adapter fixes do in two labels.
    - ``fix`` HIGH (deny, unlisted, deny propagation, pins, values beyond bf16's range):
      fp32 only. fp32 holds any range, so ``needs_range`` changes nothing.
    - ``fix`` LOW (allow class, low pins): fp16, or bf16 when the group ``needs_range``
      (its values exceed fp16's range, ``range_needs``): a rule never makes a clamp harmless.
    - no fix: any label; without fp16 when the group ``needs_range``.
    """
    if adapter_dtype is not None:
        return Allowed(frozenset({adapter_dtype}), Why.FIXED,
                       fix.reason if fix else "fixed by the adapter")
    cause = fix.cause if fix else None
    if fix is not None and fix.precision is Precision.HIGH:
        return Allowed(frozenset({Label.FP32}), Why.RULE, fix.reason, cause)
    if fix is not None:  # LOW
        if needs_range:
            why = range_reason or "beyond fp16 range"
            # a [range] rule's own fix already is the range reason: said once
            reason = fix.reason if why == fix.reason else f"{fix.reason}; {why}"
            return Allowed(frozenset({Label.BF16}), Why.RANGE, reason, cause)
        return Allowed(frozenset({Label.FP16}), Why.RULE, fix.reason, cause)
    if needs_range:
        return Allowed(frozenset({Label.BF16, Label.FP32}), Why.RANGE,
                       range_reason or "beyond fp16 range")
    return FREE


def range_needs(graph: PrecisionGraph, rules: RuleSet,
                fp16_wide_values: Mapping[Hashable, str]) -> dict[Hashable, constraints.Fix]:
    """Groups that need more range than fp16 has: the readers ``constraints.range_fixes``
    would fix for values fp16 cannot hold (clear readers pass the need on), with reasons."""
    classes = constraints.classify_groups(graph, rules)
    return constraints.range_fixes(graph, classes, fp16_wide_values, _FP16_RANGE)


def label_sets(graph: PrecisionGraph, rules: RuleSet, *,
               adapter_dtypes: Mapping[Hashable, Label] | None = None,
               keep_fp32=(), pins: Mapping[Hashable, str] | None = None,
               low_pins: Mapping[Hashable, str] | None = None,
               fp16_wide_values: Mapping[Hashable, str] | None = None,
               wide_values: Mapping[Hashable, str] | None = None,
               range_groups: Mapping[Hashable, str] | None = None
               ) -> dict[Hashable, Allowed]:
    """``allowed_labels`` of every group, from the constraints ``plan.plan_precision`` applies.

    ``adapter_dtypes``: the dtype of each group the adapter fixed (missing: fp32 for HIGH,
    fp16 for LOW); ``fp16_wide_values``: values fp16 cannot hold (their readers need range);
    ``wide_values``: values bf16 cannot hold either (their readers run fp32);
    ``range_groups``: group → why it needs range itself (a value calibration saw beyond
    fp16 is written or read by it: producers too, which ``fp16_wide_values`` leaves out).
    The other arguments are ``plan_precision``'s.
    """
    adapter_dtypes = adapter_dtypes or {}
    classes = constraints.classify_groups(graph, rules)
    # ops the rules' [range] table names run bf16 whatever their class: as allow ops that
    # need range, so they start no deny propagation (core/rules.py)
    by_rule = {g.key: rules.range_entry(g.op_key) for g in graph.groups()
               if g.fixed is None and rules.needs_range(g.op_key)}
    classes.update({k: OpClass.ALLOW for k in by_rule})
    fixes = constraints.direct_fixes(graph, rules, classes, keep_fp32, pins, low_pins,
                                     wide_values)
    needs = (constraints.range_fixes(graph, classes, fp16_wide_values, _FP16_RANGE)
             if fp16_wide_values else {})
    for key, why in (range_groups or {}).items():
        if graph.group(key).fixed is None and key not in needs:
            needs[key] = constraints.Fix(Precision.HIGH, why)
    for key, entry in by_rule.items():
        if fixes.get(key) is not None and fixes[key].reason.startswith("allow"):
            why = f"range: {entry.reason} [{entry.source}]"
            fixes[key] = needs[key] = constraints.Fix(Precision.LOW, why)
    # A group that needs range blocks deny propagation as its range fix does in two labels.
    propagated = constraints.deny_propagation(graph, classes, {**needs, **fixes},
                                              constraints.bounded_groups(graph, rules))
    fixes.update(propagated)
    sets = {}
    for group in graph.groups():
        key, adapter = group.key, None
        if group.fixed is not None:
            adapter = adapter_dtypes.get(key) or (
                Label.FP32 if group.fixed is Precision.HIGH else Label.FP16)
        need = needs.get(key)
        sets[key] = allowed_labels(fixes.get(key), needs_range=need is not None,
                                   range_reason=need.reason if need else "",
                                   adapter_dtype=adapter)
    return sets


# -- the plan --------------------------------------------------------------------------------

class LabelDecision(NamedTuple):
    label: Label
    why: Why
    reason: str
    cause: Hashable | None = None


class LabelCast(NamedTuple):
    """One cast of ``value`` to ``to``, shared by ``consumers``; ``nbytes``: its cost."""

    value: Hashable
    to: Label
    consumers: tuple[Hashable, ...]
    nbytes: int


@dataclass(frozen=True)
class LabelPlan:
    decisions: Mapping[Hashable, LabelDecision]
    casts: tuple[LabelCast, ...]
    cast_bytes: int  # Σ bytes of cast values (unknown sizes count one), fixed-to-fixed included
    counts: Mapping[Label, int]  # groups per label, sources and sinks included
    status: str  # "OPTIMAL": every region proven optimal; "FEASIBLE"; "TWO_STEP": the baseline
    objective: int  # the primary objective (module docstring, 1.) of the whole graph
    bound: int  # a proven lower bound on it under the allowed sets (= objective when OPTIMAL)
    solved_by: Mapping[str, int] = field(default_factory=dict)  # regions per way solved
    seconds: float = 0.0

    def label(self, group: Hashable) -> Label:
        return self.decisions[group].label

    @property
    def gap(self) -> float:
        """(objective − bound) / objective: 0 when optimal."""
        return (self.objective - self.bound) / self.objective if self.objective else 0.0


def plan_labels(graph: PrecisionGraph, allowed: Mapping[Hashable, Allowed | frozenset[Label]],
                *, savings_weight: float = 0.0, free: placement.FreeReads = frozenset(),
                time_limit_s: float = 10.0, workers: int = 1) -> LabelPlan:
    """The exact three-label plan (module docstring).

    ``allowed``: per group an ``Allowed`` (``allowed_labels``, ``label_sets``) or a bare set;
    missing groups are free unless the adapter fixed them (then fp32 for HIGH, fp16 for LOW).
    ``savings_weight``: β of ``placement.place``. ``free``: free reads (module docstring).
    ``time_limit_s``: for all CP-SAT solves together (each gets at least
    ``MIN_SOLVE_SECONDS``); ``workers``: CP-SAT search workers (1: plans are reproducible).
    """
    start = time.perf_counter()
    sets = normalised_sets(graph, allowed)
    labels = {k: next(iter(a.labels)) for k, a in sets.items() if len(a.labels) == 1}
    per_byte = placement.traffic_weight(savings_weight)
    deadline = start + time_limit_s
    solved: dict[tuple, _RegionAnswer] = {}
    ways: dict[str, int] = {}
    slack = 0  # Σ over regions of (objective − proven bound)
    optimal = True
    for region in free_regions(graph, labels):
        key = canonical(graph, region, labels, sets, per_byte, free)
        answer = solved.get(key)
        way = "cached"
        if answer is None:
            answer = solved[key] = solve_region(*key, deadline=deadline, workers=workers)
            way = answer.way
        ways[way] = ways.get(way, 0) + 1
        labels.update(zip(region, answer.labels))
        slack += answer.objective - answer.bound
        optimal = optimal and answer.optimal
    return _plan(graph, sets, labels, free, per_byte, "OPTIMAL" if optimal else "FEASIBLE",
                 slack, ways, start)


def normalised_sets(graph: PrecisionGraph,
                    allowed: Mapping[Hashable, Allowed | frozenset[Label]]
                    ) -> dict[Hashable, Allowed]:
    sets = {}
    for group in graph.groups():
        given = allowed.get(group.key)
        if given is None:
            given = _adapter_default(group)
        elif not isinstance(given, Allowed):
            given = frozenset(given)
            why = None if len(given) > 1 else Why.RULE
            given = Allowed(given, why, "fixed by the caller" if why else "")
        if not given.labels:
            raise ValueError(f"group {group.key!r} has no allowed label")
        sets[group.key] = given
    return sets


def _adapter_default(group) -> Allowed:
    if group.fixed is None:
        return FREE
    label = Label.FP32 if group.fixed is Precision.HIGH else Label.FP16
    return Allowed(frozenset({label}), Why.FIXED, group.reason or "fixed by the adapter")


# -- regions ---------------------------------------------------------------------------------

def free_regions(graph: PrecisionGraph,
                 labels: Mapping[Hashable, Label]) -> list[tuple[Hashable, ...]]:
    """Components of the groups not in ``labels``, joined through the values they share
    (a value joins its producer and all its readers); groups in graph order."""
    producer, consumers = graph._producer, graph._consumers
    inputs, outputs = graph._inputs, graph._outputs
    assigned: set[Hashable] = set()
    regions = []
    for start in graph._groups:
        if start in labels or start in assigned:
            continue
        assigned.add(start)
        members, seen = [start], set()
        for group in members:  # grows while it is walked
            for value in itertools.chain(inputs[group], outputs[group]):
                if value in seen:
                    continue
                seen.add(value)
                p = producer.get(value)
                for other in consumers[value] if p is None else (p, *consumers[value]):
                    if other not in labels and other not in assigned:
                        assigned.add(other)
                        members.append(other)
        regions.append(members)
    order = {g: i for i, g in enumerate(graph._groups)}
    return [tuple(sorted(r, key=order.__getitem__)) for r in regions]


# A region in canonical form: free groups numbered 0..n-1, terminals as their Label, so
# repeated layers share one answer. Term: (bytes, producer, readers that want their label,
# readers that read the value for free when fp32 and so want it only when low).
Ref = int | Label
Term = tuple[int, Ref, tuple[Ref, ...], tuple[int, ...]]
Canonical = tuple[tuple[Term, ...], tuple[frozenset[Label], ...], tuple[int, ...]]


def canonical(graph: PrecisionGraph, region: tuple[Hashable, ...],
              labels: Mapping[Hashable, Label], sets: Mapping[Hashable, Allowed],
              per_traffic_byte: int = 1, free: placement.FreeReads = frozenset()
              ) -> Canonical:
    """(terms, allowed labels, weighted traffic) of a region's groups, numbered in order."""
    index = {g: i for i, g in enumerate(region)}
    producer, consumers = graph._producer, graph._consumers
    inputs, outputs = graph._inputs, graph._outputs
    fp32 = Label.FP32

    def ref(g: Hashable | None) -> Ref:
        if g is None:  # a value without a producer comes in fp32, as plan.plan_casts has it
            return fp32
        i = index.get(g)
        return labels[g] if i is None else i

    values = dict.fromkeys(v for g in region for v in itertools.chain(inputs[g], outputs[g]))
    terms = []
    for v in values:
        if not consumers[v]:
            continue
        paid, low_only = [], []
        for c in consumers[v]:
            r = ref(c)
            if (v, c) not in free:
                paid.append(r)
            elif isinstance(r, int):
                low_only.append(r)
            elif r is not fp32:
                paid.append(r)
            # else: a reader fixed fp32 reading for free never needs a cast of v
        terms.append((graph.cost_units(v), ref(producer.get(v)), tuple(paid), tuple(low_only)))

    return (tuple(terms), tuple(sets[g].labels for g in region),
            tuple(per_traffic_byte * group_traffic(graph, g) for g in region))


# -- solving one region ----------------------------------------------------------------------

class _RegionAnswer(NamedTuple):
    labels: tuple[Label, ...]
    objective: int  # primary objective of ``labels``
    bound: int  # proven lower bound on the primary objective
    optimal: bool  # both tiers proven optimal
    way: str  # "trivial", "enumerated", "cp-sat"


def primary_cost(terms: tuple[Term, ...], traffic: tuple[int, ...],
                 labels: tuple[Label, ...]) -> int:
    """The primary objective of a labelling of a canonical region (module docstring, 1.)."""
    cost = sum(t for t, label in zip(traffic, labels) if label is Label.FP32)
    for units, p, readers, low_only in terms:
        wanted = {labels[c] if isinstance(c, int) else c for c in readers}
        wanted.update(labels[c] for c in low_only if labels[c] is not Label.FP32)
        wanted.discard(labels[p] if isinstance(p, int) else p)
        cost += CAST_WEIGHT * units * len(wanted)
    return cost


def preference(labels: tuple[Label, ...]) -> int:
    return sum(RANK[label] for label in labels)


def preferred(allowed: tuple[frozenset[Label], ...]) -> tuple[Label, ...]:
    """Every group's most preferred allowed label: optimal when it costs nothing."""
    return tuple(min(a, key=RANK.__getitem__) for a in allowed)


def solve_region(terms: tuple[Term, ...], allowed: tuple[frozenset[Label], ...],
                 traffic: tuple[int, ...], *, deadline: float | None = None,
                 workers: int = 1) -> _RegionAnswer:
    """Optimal labels of a canonical region (both tiers of the module docstring)."""
    greedy = preferred(allowed)
    # Nothing costs less than 0 and no labelling ranks better than every group's best.
    if primary_cost(terms, traffic, greedy) == 0:
        return _RegionAnswer(greedy, 0, 0, True, "trivial")
    if math.prod(map(len, allowed)) <= ENUMERATE_UP_TO:
        return _enumerate(terms, allowed, traffic)
    limit = MIN_SOLVE_SECONDS if deadline is None else max(
        deadline - time.perf_counter(), MIN_SOLVE_SECONDS)
    return _cp_sat(terms, allowed, traffic, greedy, limit, workers)


def _enumerate(terms, allowed, traffic) -> _RegionAnswer:
    """Brute force; full ties go to the first labelling in preference order."""
    options = [sorted(a, key=RANK.__getitem__) for a in allowed]
    best, best_labels = None, ()
    for labels in itertools.product(*options):
        score = (primary_cost(terms, traffic, labels), preference(labels))
        if best is None or score < best:
            best, best_labels = score, labels
    return _RegionAnswer(best_labels, best[0], best[0], True, "enumerated")


class _Model(NamedTuple):
    model: object  # cp_model.CpModel
    x: list[dict[Label, object]]  # x[i][label]: group i runs label
    primary: list[tuple[int, object]]  # (coefficient, literal) terms of the primary objective
    offset: int  # casts every labelling pays
    preference: list[tuple[int, object]]
    casts: list[tuple[object, object, tuple]]  # (cast literal, producer has it, wanting)


def _build_model(terms, allowed, traffic) -> _Model:
    """The integer program of decision 0037.

    x[i][l] ∈ {0,1}, Σ_l x[i][l] = 1 over the allowed labels of group i. For each value and
    label l that some reader may want and its producer may not have, a cast literal
    y ⇐ (x[reader][l] ∧ ¬x[producer][l]) for each such reader, paid CAST_WEIGHT·bytes:
    one y per (value, label) is the shared cast.
    """
    from ortools.sat.python import cp_model  # lazy: only regions that need a solver pay it

    model = cp_model.CpModel()
    x = [{label: model.new_bool_var(f"x{i}_{label.name}") for label in sorted(
        a, key=RANK.__getitem__)} for i, a in enumerate(allowed)]
    for choices in x:
        model.add_exactly_one(choices.values())
    primary: list[tuple[int, object]] = []
    casts = []
    offset = 0
    for units, p, readers, low_only in terms:
        weight = CAST_WEIGHT * units
        for label in PREFERENCE:
            has = _has(x, p, label)
            if has is True:
                continue
            if label in readers:  # a reader fixed at ``label``: the cast is wanted anyway
                if has is False:
                    offset += weight
                else:
                    primary.append((weight, has.Not()))
                continue
            wanting = [x[c][label] for c in readers if isinstance(c, int) and label in x[c]]
            if label is not Label.FP32:
                wanting += [x[c][label] for c in low_only if label in x[c]]
            if not wanting:
                continue
            cast = model.new_bool_var("")
            wanting = tuple(dict.fromkeys(wanting))
            casts.append((cast, has, wanting))
            for wants in wanting:
                # Linear, not clauses: CP-SAT's default linearization puts linear
                # constraints into its LP relaxation, and that bound proves the optimum.
                if has is False:
                    model.add(cast >= wants)
                else:
                    model.add(cast + has >= wants)
            primary.append((weight, cast))
    primary += [(t, x[i][Label.FP32]) for i, t in enumerate(traffic)
                if t and Label.FP32 in x[i]]
    prefs = [(RANK[label], lit) for choices in x for label, lit in choices.items()
             if RANK[label]]
    return _Model(model, x, primary, offset, prefs, casts)


def _hint(m: _Model, labels: tuple[Label, ...]) -> None:
    """A complete hint (every variable): CP-SAT then starts from a solution at once, where
    an incomplete one costs it a search to complete (measured in decision 0037)."""
    m.model.clear_hints()
    value = {}
    for choices, label in zip(m.x, labels):
        for l, lit in choices.items():
            value[lit.index] = l is label
            m.model.add_hint(lit, l is label)
    for cast, has, wanting in m.casts:
        made = has is not False and value[has.index]
        m.model.add_hint(cast, not made and any(value[w.index] for w in wanting))


def _has(x, p: Ref, label: Label):
    """Whether the producer makes the value in ``label``: True, False or its literal."""
    if not isinstance(p, int):
        return p is label
    return x[p].get(label, False)


def _cp_sat(terms, allowed, traffic, hint, limit: float, workers: int) -> _RegionAnswer:
    """Solve the region's integer program, both tiers exactly.

    The primary objective is divided by the gcd G of its coefficients, so two labellings
    differ in it by at least 1 and ``primary/G · span + preference`` (span = the preference's
    range + 1) orders them lexicographically in one solve. Where that sum could leave int64
    (large regions of unrelated sizes), the primary is solved alone, then the weighted sum
    with the largest multiplier that fits; its answer is kept when its primary equals the
    proven optimum (then no labelling of that primary ranks better), else the preference is
    minimised with the primary held at its optimum (slow: one dense row).
    """
    from ortools.sat.python import cp_model

    deadline = time.perf_counter() + limit
    m = _build_model(terms, allowed, traffic)
    unit = math.gcd(m.offset, *(c for c, _ in m.primary)) or 1
    worst = (m.offset + sum(c for c, _ in m.primary)) // unit
    span = sum(max(map(RANK.__getitem__, a)) for a in allowed) + 1
    primary = cp_model.LinearExpr.weighted_sum(
        [lit for _, lit in m.primary], [c // unit for c, _ in m.primary]) + m.offset // unit
    prefs = cp_model.LinearExpr.weighted_sum([lit for _, lit in m.preference],
                                             [c for c, _ in m.preference])

    def solve(objective, start: tuple[Label, ...]):
        m.model.minimize(objective)
        _hint(m, start)
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = workers
        solver.parameters.linearization_level = LINEARIZATION
        # A complete hint is a solution at once; following it further with the LP at each
        # decision cost 28 s on a 5000-group region (decision 0037).
        solver.parameters.hint_conflict_limit = 0
        # Repeated layers are symmetric, but breaking that symmetry took 1.4 of the 3.5 s of
        # a 5000-group region and never shortened the search (decision 0037).
        solver.parameters.symmetry_level = 0
        solver.parameters.max_time_in_seconds = max(deadline - time.perf_counter(),
                                                    MIN_SOLVE_SECONDS)
        status = solver.solve(m.model)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return start, None, False
        return _read(solver, m.x), solver.best_objective_bound, status == cp_model.OPTIMAL

    if worst * span < _INT64_SAFE:
        labels, bound, optimal = solve(primary * span + prefs, hint)
        lower = 0 if bound is None else int(bound) // span * unit
        return _answer(terms, traffic, labels, lower, optimal)
    first, bound, first_optimal = solve(primary, hint)
    lower = 0 if bound is None else math.ceil(bound) * unit
    best = primary_cost(terms, traffic, first)
    if not first_optimal:
        return _answer(terms, traffic, first, lower, False)
    weight = max(_INT64_SAFE // max(worst, 1), 1)
    labels, _, optimal = solve(primary * weight + prefs, first)
    if optimal and primary_cost(terms, traffic, labels) == best:
        return _answer(terms, traffic, labels, best, True)
    m.model.add(primary <= best // unit)
    labels, _, optimal = solve(prefs, first)
    return _answer(terms, traffic, labels, best, optimal)


def _read(solver, x) -> tuple[Label, ...]:
    return tuple(next(l for l, lit in choices.items() if solver.boolean_value(lit))
                 for choices in x)


def _answer(terms, traffic, labels, lower: int, optimal: bool) -> _RegionAnswer:
    value = primary_cost(terms, traffic, labels)
    return _RegionAnswer(labels, value, value if optimal else min(lower, value), optimal,
                         "cp-sat")


# -- casts, reasons, the plan ------------------------------------------------------------------

def plan_label_casts(graph: PrecisionGraph, labels: Mapping[Hashable, Label],
                     free: placement.FreeReads = frozenset()) -> tuple[LabelCast, ...]:
    """One cast per (value, target label), shared by the readers that need it; a reader
    running fp32 that reads the value for free needs none."""
    return tuple(LabelCast(value, to, readers, graph.cost_units(value))
                 for value, to, readers in cast_needs(graph, labels, free, Label.FP32))


_FP16_RANGE = "beyond fp16's range"  # how a range need's reason ends (``_decision`` goes on)


def _decision(allowed: Allowed, label: Label) -> LabelDecision:
    if allowed.why in (Why.FIXED, Why.RULE):
        return LabelDecision(label, allowed.why, allowed.reason, allowed.cause)
    if allowed.why is Why.RANGE:
        if label is Label.BF16:
            return LabelDecision(label, Why.RANGE, f"{allowed.reason}: runs bf16, not fp16",
                                 allowed.cause)
        if Label.BF16 not in allowed.labels:  # its kernel or schema takes no bf16
            return LabelDecision(label, Why.RANGE, f"{allowed.reason}: not fp16, and its "
                                 "kernel takes no bf16 here: runs fp32", allowed.cause)
        return LabelDecision(label, Why.RANGE, f"{allowed.reason}: not fp16, and fp32 needs "
                             "fewer cast bytes than bf16 with its neighbours", allowed.cause)
    if label is Label.FP16:
        return LabelDecision(label, Why.PRECISION, "runs fp16: the most mantissa among the "
                             "plans with the fewest cast bytes (exact, three labels)")
    return LabelDecision(label, Why.CASTS, f"runs {label.value}: fp16 would need more cast "
                         "bytes with its neighbours (exact, three labels)")


def group_traffic(graph: PrecisionGraph, group: Hashable) -> int:
    """Bytes a group reads and writes, what running it low halves (0 for sources, sinks)."""
    if not graph._groups[group].savings:
        return 0
    return sum(map(graph.cost_units, (*graph._inputs[group], *graph._outputs[group])))


def _plan(graph, sets, labels, free, per_traffic_byte: int, status: str, slack: int,
          ways: dict[str, int], start: float) -> LabelPlan:
    casts = plan_label_casts(graph, labels, free)
    cast_bytes = sum(c.nbytes for c in casts)
    objective = CAST_WEIGHT * cast_bytes + per_traffic_byte * sum(
        group_traffic(graph, k) for k, label in labels.items() if label is Label.FP32)
    decisions = {k: _decision(sets[k], labels[k]) for k in graph._groups}
    counts = {label: 0 for label in PREFERENCE}
    for label in labels.values():
        counts[label] += 1
    return LabelPlan(MappingProxyType(decisions), casts, cast_bytes, MappingProxyType(counts),
                     status, objective, objective - slack, MappingProxyType(ways),
                     time.perf_counter() - start)


# -- the two-step baseline -------------------------------------------------------------------

def two_step_plan(graph: PrecisionGraph,
                  allowed: Mapping[Hashable, Allowed | frozenset[Label]], *,
                  savings_weight: float = 0.0,
                  free: placement.FreeReads = frozenset()) -> LabelPlan:
    """fp32 or low by the two-label cut (``placement.place``, fp16 and bf16 both "low", so a
    cast between them is invisible to it), then fp16 or bf16 among the low groups by a
    second exact cut. The baseline the three-label plan is measured against (decision 0037):
    each step is optimal, the sequence is not. Status "TWO_STEP"; its bound is no bound
    (set to its objective)."""
    start = time.perf_counter()
    sets = normalised_sets(graph, allowed)
    fixed = {}
    for key, a in sets.items():
        if Label.FP32 not in a.labels:
            fixed[key] = Precision.LOW
        elif len(a.labels) == 1:
            fixed[key] = Precision.HIGH
    sides = placement.place(graph, fixed, savings_weight, free)
    labels = {k: Label.FP32 for k, side in sides.items() if side is Precision.HIGH}
    for key, side in sides.items():
        low = sets[key].labels & LOW_LABELS
        if side is Precision.LOW and len(low) == 1:
            labels[key] = next(iter(low))
    undecided = [k for k, side in sides.items() if k not in labels]
    labels.update(_fp16_or_bf16_cut(graph, labels, undecided, free))
    return _plan(graph, sets, labels, free, placement.traffic_weight(savings_weight),
                 "TWO_STEP", 0, {"two-step": 1}, start)


def _fp16_or_bf16_cut(graph: PrecisionGraph, labels: Mapping[Hashable, Label],
                      undecided: list[Hashable], free: placement.FreeReads
                      ) -> dict[Hashable, Label]:
    """fp16 (source side) or bf16 (sink side) of the ``undecided`` low groups, the others
    labelled, minimising cast bytes: one s–t cut. Ties go fp16 (the smallest sink side).

    Per value of bytes w, with S = fp16 and T = bf16 and ∞ arcs from ``maxflow``:
    made fp16 or bf16 by a node p: w·[p ∈ S, a reader ∈ T] (p→a w, a→reader ∞) and the
    mirror (reader→b ∞, b→p w); made in fp32: w·[a reader ∈ S] (reader→b ∞, b→T w) and
    w·[a reader ∈ T] (S→a w, a→reader ∞). Casts to fp32 readers do not depend on the cut.
    """
    if not undecided:
        return {}
    index = {k: i for i, k in enumerate(undecided)}
    source, sink = len(undecided), len(undecided) + 1
    net = maxflow.FlowNetwork(len(undecided) + 2)
    inf = maxflow.INFINITE
    terminal = {Label.FP16: source, Label.BF16: sink}

    def node(g: Hashable | None) -> int | None:
        """The flow node of a group in fp16/bf16; None for fp32."""
        if g in index:
            return index[g]
        label = labels[g] if g is not None else Label.FP32
        return terminal.get(label)

    for value, consumers in graph._consumers.items():
        readers = {node(c) for c in consumers if not (labels.get(c) is Label.FP32)}
        readers.discard(None)
        if not readers or not (readers - {source, sink} or node(graph._producer.get(value))
                               not in (source, sink)):
            continue  # no node involved: the cost does not depend on the cut
        w = graph.cost_units(value)
        p = node(graph._producer.get(value))
        wants_bf16 = (sink,) if sink in readers else tuple(r for r in readers if r < source)
        wants_fp16 = (source,) if source in readers else tuple(r for r in readers
                                                               if r < source)
        # [made fp16 (p ∈ S or fp32 producer as S→a) and a reader ∈ T]
        if p != sink:
            a = sink if wants_bf16 == (sink,) else net.new_node()
            net.add(source if p is None else p, a, w)
            if a != sink:
                for r in wants_bf16:
                    net.add(a, r, inf)
        # [made bf16 (p ∈ T or fp32 producer as b→T) and a reader ∈ S]
        if p != source:
            b = source if wants_fp16 == (source,) else net.new_node()
            net.add(b, sink if p is None else p, w)
            if b != source:
                for r in wants_fp16:
                    net.add(r, b, inf)
    bf16_side = maxflow.sink_side(net, source, sink)
    return {k: Label.BF16 if bf16_side[i] else Label.FP16 for k, i in index.items()}


# -- the mixed plan the adapters apply -------------------------------------------------------

def plan_mixed(graph: PrecisionGraph, rules: RuleSet, *,
               admissible: Mapping[Hashable, frozenset[Label]] | None = None,
               adapter_dtypes: Mapping[Hashable, Label] | None = None, keep_fp32=(),
               pins: Mapping[Hashable, str] | None = None,
               low_pins: Mapping[Hashable, str] | None = None,
               fp16_wide_values: Mapping[Hashable, str] | None = None,
               wide_values: Mapping[Hashable, str] | None = None, savings_weight: float = 0.0,
               free: placement.FreeReads = frozenset(), time_limit_s: float = 10.0,
               range_groups: Mapping[Hashable, str] | None = None) -> PrecisionPlan:
    """The three-label plan as a ``PrecisionPlan`` the adapters apply: fp16 and bf16 groups
    are LOW with their ``label``, casts carry the dtype they convert to, ``solver`` the
    status and gap. ``admissible``: per group the labels its kernel or schema takes (missing:
    all); the rest as ``label_sets``."""
    sets = label_sets(graph, rules, adapter_dtypes=adapter_dtypes, keep_fp32=keep_fp32,
                      pins=pins, low_pins=low_pins, fp16_wide_values=fp16_wide_values,
                      wide_values=wide_values, range_groups=range_groups)
    if admissible:
        sets = {k: _admitted(a, admissible.get(k)) for k, a in sets.items()}
    plan = plan_labels(graph, sets, savings_weight=savings_weight, free=free,
                       time_limit_s=time_limit_s)
    classes = constraints.classify_groups(graph, rules)
    decisions = {k: Decision(Precision.HIGH if d.label is Label.FP32 else Precision.LOW,
                             classes[k], d.reason, len(sets[k].labels) == 1, d.cause, d.label)
                 for k, d in plan.decisions.items()}
    casts = tuple(CastPlan(c.value, Precision.HIGH if c.to is Label.FP32 else Precision.LOW,
                           c.consumers, c.to) for c in plan.casts)
    # the two-step baseline (fp32 cut, then fp16/bf16) on the same sets: a user sees what
    # the exact three-label plan saves; it costs a fraction of the solve (decision 0037)
    baseline = two_step_plan(graph, sets, savings_weight=savings_weight, free=free)
    solver = {"status": plan.status, "gap": round(plan.gap, 6),
              "seconds": round(plan.seconds, 4), "solved_by": dict(plan.solved_by),
              "counts": {label.value: n for label, n in plan.counts.items()},
              "two_step_cast_bytes": baseline.cast_bytes}
    return PrecisionPlan(MappingProxyType(decisions), casts, plan.cast_bytes,
                         MappingProxyType(solver))


def _admitted(allowed: Allowed, admits: frozenset[Label] | None) -> Allowed:
    """``allowed`` within what the group's kernel or schema takes; fp32 where nothing else is
    left (every op runs fp32)."""
    if admits is None or allowed.labels <= admits:
        return allowed
    kept = allowed.labels & admits
    if kept:
        return allowed._replace(labels=frozenset(kept))
    names = "/".join(sorted(label.value for label in allowed.labels))
    return Allowed(frozenset({Label.FP32}), Why.RULE,
                   f"its kernel takes no {names} here: runs fp32", allowed.cause)
