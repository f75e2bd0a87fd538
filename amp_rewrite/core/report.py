"""The one report schema of both adapters, and the one ``explain`` over it.

``Report.to_json()`` gives the documented JSON (docs/cli.md: ``--report`` keys,
``gm.amp_report``): the shared keys, then the path's own keys from ``details``, a dataclass
each adapter declares (``onnx/passes.OnnxDetails``: ``opset_conversion``, ``low_io``, ...;
``fx/pipeline.TorchDetails``: ``emulated_gemms``, ``device``, ...), then the pipeline's
``steps``, ``seconds`` and, with an accuracy budget, its sections. ``Report.why`` maps node
names to the reasons ``explain`` prints; it is not serialised.
"""
from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from amp_rewrite.core.graph import SINK_OP, SOURCE_OP, PrecisionGraph
from amp_rewrite.core.plan import PrecisionPlan, explain_chain
from amp_rewrite.core.precision import Label, Precision
from amp_rewrite.core.rules import close_match
from amp_rewrite.errors import UsageError


@dataclass
class Report:
    """What a rewrite decided and did; ``details``: the keys only one path has (a dataclass,
    serialised flat)."""

    dtype: str
    nodes: list[dict]
    casts_inserted: int
    cast_bytes_planned: int
    nodes_retyped: int
    modified: bool
    padding: dict = field(default_factory=lambda: {"enabled": False})
    fused: dict = field(default_factory=dict)
    details: Any = None
    mixed: dict | None = None  # a mixed plan's section (``mixed_summary``)
    steps: list[dict] = field(default_factory=list)  # core/pipeline.Record: what each pass did
    seconds: float | None = None
    budget: dict | None = None  # the accuracy budget's section (core/budget.py)
    pinned_by_budget: list[dict] | None = None
    lowered_by_budget: list[dict] | None = None
    why: Mapping[str, list[str]] = field(default_factory=dict, repr=False, compare=False)

    @property
    def precision_counts(self) -> dict[str, int]:
        counts = Counter(r["precision"] for r in self.nodes)
        return {p.value: counts.get(p.value, 0) for p in Precision}

    @property
    def dtype_counts(self) -> dict[str, int] | None:
        """Nodes per dtype in a mixed plan (None otherwise)."""
        if not any("dtype" in r for r in self.nodes):
            return None
        counts = Counter(r.get("dtype", "float32") for r in self.nodes)
        return {label.value: counts.get(label.value, 0) for label in Label}

    @property
    def unlisted_ops(self) -> list[str]:
        return sorted({r["op_type"] for r in self.nodes if r["class"] == "unlisted"})

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "nodes": self.nodes, "casts_inserted": self.casts_inserted,
                "cast_bytes_planned": self.cast_bytes_planned,
                "precision_counts": self.precision_counts,
                **({} if self.dtype_counts is None else {"dtype_counts": self.dtype_counts}),
                "nodes_retyped": self.nodes_retyped,
                "unlisted_ops": self.unlisted_ops, "padding": self.padding, "fused": self.fused,
                "modified": self.modified, **_flat(self.details),
                **({} if self.mixed is None else {"mixed": self.mixed}), "steps": self.steps,
                **({} if self.seconds is None else {"seconds": self.seconds}),
                **({} if self.budget is None else {
                    "budget": self.budget, "pinned_by_budget": self.pinned_by_budget,
                    **({} if self.lowered_by_budget is None
                       else {"lowered_by_budget": self.lowered_by_budget})})}


def mixed_summary(plan: PrecisionPlan, graph: PrecisionGraph,
                  flops: Mapping[Hashable, float] | None = None) -> dict:
    """A mixed plan's report section: groups and (given ``flops`` per group) FLOP shares per
    dtype, cast bytes per (from, to) dtype pair, fp16↔bf16 included, and the solver's
    status and gap (docs/design.md §3)."""
    labels = {k: d.label or Label.FP32 for k, d in plan.decisions.items()}
    pairs: Counter = Counter()
    for cast in plan.casts:
        producer = graph.producer(cast.value)
        have = labels[producer] if producer is not None else Label.FP32
        to = cast.label or (Label.FP32 if cast.to is Precision.HIGH else Label.FP16)
        pairs[f"{have.value}->{to.value}"] += graph.cost_units(cast.value)
    section = {"solver": dict(plan.solver or {}), "cast_bytes": dict(sorted(pairs.items()))}
    if flops:
        total = sum(flops.values()) or 1.0
        per = Counter()
        for key, f in flops.items():
            per[labels[key].value] += f
        section["flop_share"] = {label.value: round(per[label.value] / total, 6)
                                 for label in Label}
    return section


def _flat(details: Any) -> dict:
    """A details dataclass as JSON keys (its fields, values as they are)."""
    if details is None:
        return {}
    return {f.name: getattr(details, f.name) for f in dataclasses.fields(details)}


def node_records(plan: PrecisionPlan, graph: PrecisionGraph) -> list[dict]:
    """One record per op node: name, op_type, precision, class, reason (+ other port groups).

    A node with several port groups reports its first free group (else its first group) and
    lists the others under ``ports``.
    """
    by_node: dict[Hashable, list] = {}
    for group in graph.groups():
        if group.op_key not in (SOURCE_OP, SINK_OP):
            by_node.setdefault(group.node, []).append(group)
    return [_record(plan, groups) for groups in by_node.values()]


def _record(plan: PrecisionPlan, groups: list) -> dict:
    main = next((g for g in groups if not plan.decisions[g.key].fixed), groups[0])
    d = plan.decisions[main.key]
    record = {"name": main.name, "op_type": main.op_key, "precision": d.precision.value,
              "class": d.op_class.value, "reason": d.reason}
    if d.label is not None:  # a mixed plan: which low dtype, or float32
        record["dtype"] = d.label.value
    others = [g for g in groups if g is not main]
    if others:
        record["ports"] = [{"type_vars": g.tvar, "precision": plan.decisions[g.key].precision.value,
                            "reason": plan.decisions[g.key].reason} for g in others]
    return record


class Reasons(Mapping):
    """Node name → the reasons behind each of its groups' precision, built on lookup.
    ``prefix(name, keys)`` gives lines to put first (what created the node)."""

    def __init__(self, plan: PrecisionPlan, graph: PrecisionGraph,
                 prefix: Callable[[str, list], list[str]] | None = None) -> None:
        self.plan, self.graph, self.prefix = plan, graph, prefix
        self._keys: dict[str, list] = {}
        for g in graph.groups():
            if g.name:
                self._keys.setdefault(g.name, []).append(g.key)

    def __getitem__(self, name: str) -> list[str]:
        keys = self._keys[name]
        lines = [line for k in keys for line in labelled_chain(self.plan, self.graph, k)]
        return [*(self.prefix(name, keys) if self.prefix else ()), *lines]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def labelled_chain(plan: PrecisionPlan, graph: PrecisionGraph, group: Hashable) -> list[str]:
    """``explain_chain``, each line of a mixed plan naming its group's dtype after the
    precision (``low (bfloat16) — ...``)."""
    lines = explain_chain(plan, graph, group)
    keys, seen = [], set()
    while group is not None and group not in seen:  # the groups explain_chain follows
        seen.add(group)
        keys.append(group)
        group = plan.decisions[group].cause
    out = []
    for key, line in zip(keys, lines):
        d = plan.decisions[key]
        if d.label is not None:
            line = line.replace(f": {d.precision.value} — ",
                                f": {d.precision.value} ({d.label.value}) — ", 1)
        out.append(line)
    return out


class UnknownNodeError(UsageError):
    """``explain`` of a name no node with floating-point ports has; ``near`` is the hint."""

    def __init__(self, name: str, near: str) -> None:
        super().__init__(f"no node named {name!r} with floating-point ports in this graph{near}")
        self.near = near


def explain(report: Report, name: str) -> list[str]:
    """Why node ``name`` runs low or high: the chain of reasons back to its origin.

    An unknown name raises ``UnknownNodeError`` naming the nearest node, or the fused nodes
    that replaced an op of that name (``softmax`` inside attention)."""
    lines = report.why.get(name)
    if not lines:
        raise UnknownNodeError(name, _near_names(report.why, name))
    return list(lines)


def _near_names(why: Mapping[str, list[str]], wanted: str) -> str:
    """" (did you mean X?)", or the fused nodes that replaced an op called ``wanted``."""
    pattern = re.compile(rf"\(replaced [^)]*\b{re.escape(wanted)}\b")
    heads = why.items() if isinstance(why, dict) else ()  # lazy Reasons: no fused heads
    fused_into = [name for name, lines in heads if lines and pattern.search(lines[0])]
    if fused_into:
        return (f"; {wanted} was fused into {', '.join(fused_into[:3])}"
                f"{' ...' if len(fused_into) > 3 else ''}: explain that node")
    prefixed = sorted((n for n in why if n.startswith(wanted)), key=len)
    if prefixed:
        return f" (did you mean {prefixed[0]}?)"
    return close_match(wanted, why)
