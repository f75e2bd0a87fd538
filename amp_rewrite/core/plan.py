"""Precision planning: constraints, then exact min-cut placement, then the cast plan.

``plan_precision`` is pure: it reads a PrecisionGraph and returns an immutable PrecisionPlan in
which every group has a precision and a reason, and every value that some consumer needs in the
other precision has exactly one CastPlan per target precision. A HIGH promoting consumer reading
a value for free (``placement.free_reads``) needs no cast of it. Where that depends on an anchor
the cut itself decides, ``_with_free_anchors`` keeps a consistent optimistic answer only if its
true cast bytes are lower, so the plan is exact with fixed anchors and never worse otherwise.
"""
from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from amp_rewrite.core import constraints, placement
from amp_rewrite.core.graph import PrecisionGraph
from amp_rewrite.core.precision import Label, OpClass, Precision
from amp_rewrite.core.rules import RuleSet


class Decision(NamedTuple):  # a NamedTuple for speed, as graph.GroupInfo
    """The precision of one group and why."""

    precision: Precision
    op_class: OpClass
    reason: str
    fixed: bool
    cause: Hashable | None = None  # the group whose decision forced this one
    label: Label | None = None  # mixed plans: the dtype (fp16/bf16 both LOW); else None


class CastPlan(NamedTuple):
    """One Cast of ``value`` to ``to``, shared by ``consumers``."""

    value: Hashable
    to: Precision
    consumers: tuple[Hashable, ...]
    label: Label | None = None  # mixed plans: the dtype cast to (fp16↔bf16 casts are LOW)


@dataclass(frozen=True)
class PrecisionPlan:
    decisions: Mapping[Hashable, Decision]
    casts: tuple[CastPlan, ...]
    cast_units: int  # Σ bytes of cast values (unknown sizes count one)
    # mixed plans: the solver's status, gap and seconds (core/multilabel.py); else None
    solver: Mapping | None = None

    def precision(self, group: Hashable) -> Precision:
        return self.decisions[group].precision

    def label(self, group: Hashable, low: Label) -> Label:
        """The dtype ``group`` runs in; ``low``: the plan's low dtype where it has one."""
        d = self.decisions[group]
        if d.label is not None:
            return d.label
        return low if d.precision is Precision.LOW else Label.FP32

    def cast_label(self, cast: CastPlan, low: Label) -> Label:
        """The dtype ``cast`` converts to (``low`` as in ``label``)."""
        if cast.label is not None:
            return cast.label
        return low if cast.to is Precision.LOW else Label.FP32


def plan_precision(graph: PrecisionGraph, rules: RuleSet, *, keep_fp32: Iterable[str] = (),
                   pins: Mapping[Hashable, str] | None = None,
                   low_pins: Mapping[Hashable, str] | None = None,
                   savings_weight: float = 0.0,
                   wide_values: Mapping[Hashable, str] | None = None) -> PrecisionPlan:
    """Decide every group's precision and the minimal casts (see module docstring).

    ``keep_fp32``: fnmatch patterns on group names; ``pins``: group key → reason, both fixed
    high (e.g. from calibration data); ``low_pins``: group key → reason, fixed low over pins
    and rule classes, not over the adapter's or range fixes (the accuracy budget lowering
    what it measured safe); ``savings_weight``: see ``placement.place``;
    ``wide_values``: value → why the low dtype cannot hold it (``constraints.range_fixes``).
    """
    classes = constraints.classify_groups(graph, rules)
    fixes = constraints.direct_fixes(graph, rules, classes, keep_fp32, pins, low_pins,
                                     wide_values)
    bounded = constraints.bounded_groups(graph, rules)
    fixes.update(constraints.deny_propagation(graph, classes, fixes, bounded))
    fixed = {k: f.precision for k, f in fixes.items()}
    candidates = placement.promotion_candidates(graph)
    free = placement.free_reads(graph, fixed, candidates)
    labels = placement.place(graph, fixed, savings_weight, free)
    if candidates:
        labels = _with_free_anchors(graph, fixed, savings_weight, labels, candidates)
        free = placement.justified_reads(graph, labels, candidates)
    casts = plan_casts(graph, labels, free)
    decisions = {key: _decision(labels[key], classes[key], fixes.get(key))
                 for key in graph._groups}
    return PrecisionPlan(MappingProxyType(decisions), casts, _cast_units(graph, casts))


_PROMOTION_ROUNDS = 8


def _cast_units(graph: PrecisionGraph, casts: Iterable[CastPlan]) -> int:
    return sum(graph.cost_units(c.value) for c in casts)


def _true_units(graph: PrecisionGraph, labels: dict[Hashable, Precision],
                candidates: placement.FreeReads) -> int:
    """Cast bytes of a labelling, every read its labels anchor being free."""
    free = placement.justified_reads(graph, labels, candidates)
    return _cast_units(graph, plan_casts(graph, labels, free))


def _with_free_anchors(graph: PrecisionGraph, fixed: dict[Hashable, Precision],
                       savings_weight: float, exact: dict[Hashable, Precision],
                       candidates: placement.FreeReads) -> dict[Hashable, Precision]:
    """``exact``, or a labelling with fewer cast bytes once free (unfixed) anchors count.

    Solve as if every promoting read were free, withdraw the reads the answer does not
    anchor, and repeat until it is consistent (placement module docstring).
    """
    assumed = candidates
    for _ in range(_PROMOTION_ROUNDS):
        labels = placement.place(graph, fixed, savings_weight, assumed)
        justified = placement.justified_reads(graph, labels, assumed)
        used = {(v, g) for v, g in assumed if labels[g] is Precision.HIGH
                and labels.get(graph.producer(v)) is Precision.LOW}
        if used <= justified:
            better = (_true_units(graph, labels, candidates)
                      < _true_units(graph, exact, candidates))
            return labels if better else exact
        assumed = assumed - (used - justified)
    return exact


def _decision(precision: Precision, op_class: OpClass, fix: constraints.Fix | None) -> Decision:
    if fix is not None:
        return Decision(precision, op_class, fix.reason, True, fix.cause)
    return _free_decision(precision, op_class)


@functools.cache
def _free_decision(precision: Precision, op_class: OpClass) -> Decision:
    side = "low" if precision is Precision.LOW else "high"
    return Decision(precision, op_class,
                    f"{op_class.value}: runs {side} because that needs the fewest cast bytes "
                    "with its neighbours (exact min-cut)", False)


def plan_casts(graph: PrecisionGraph, labels: Mapping[Hashable, Precision],
               free: placement.FreeReads = frozenset()) -> tuple[CastPlan, ...]:
    """One cast per (value, target precision), shared by the consumers that need it.

    A HIGH consumer with a free read (``placement.free_reads``) promotes the value itself.
    """
    return tuple(CastPlan(value, to, readers)
                 for value, to, readers in cast_needs(graph, labels, free, Precision.HIGH))


def cast_needs(graph: PrecisionGraph, labels: Mapping[Hashable, Hashable],
               free: placement.FreeReads, high: Hashable
               ) -> Iterator[tuple[Hashable, Hashable, tuple[Hashable, ...]]]:
    """(value, label wanted, readers wanting it) for every value some reader needs in another
    label than its producer's (a graph input is made ``high``); a ``high`` reader with a free
    read needs none. Two labels (``Precision``) and three (``Label``) alike."""
    for value, consumers in graph._consumers.items():  # the hot loop: no accessor calls
        producer = graph._producer.get(value)
        have = labels[producer] if producer is not None else high
        wanting: dict[Hashable, list[Hashable]] = {}
        for c in consumers:
            label = labels[c]
            if label is not have and not (label is high and (value, c) in free):
                wanting.setdefault(label, []).append(c)
        for to, readers in wanting.items():
            yield value, to, tuple(readers)


def explain_chain(plan: PrecisionPlan, graph: PrecisionGraph, group: Hashable) -> list[str]:
    """The reasons behind one group's precision, following causes back to their origin."""
    lines, seen = [], set()
    while group is not None and group not in seen:
        seen.add(group)
        info, d = graph.group(group), plan.decisions[group]
        lines.append(f"{info.name} ({info.op_key}{'/' + info.tvar if info.tvar else ''}): "
                     f"{d.precision.value} — {d.reason}")
        group = d.cause
    return lines
