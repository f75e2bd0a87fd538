"""Hard constraints (docs/design.md §3): which groups are fixed before the min-cut, and why.

Order of precedence: the adapter's own fixes (kept I/O types, ports the schema does not admit
low, dtypes already low in the model), then user pins (``keep_fp32`` patterns), then the rule
classes (allow ⇒ low; deny and unlisted ⇒ high), then TF AMP's deny propagation: a gray or clear
group on a path from a deny group to a gray or deny group through gray/clear groups runs high,
so a value that came out of ``exp`` is not squeezed into fp16 by a following ``add``. A deny
group whose op has a bounded output (the rules' ``[bounded_output]``: ``Cos``, ``Sin``) needs
fp32 for its input only: it runs high but starts no propagation, so the min cut decides where
its output is cast. It still ends a path (the ops feeding it from another deny op run high).
"""
from __future__ import annotations

import fnmatch
from collections import deque
from collections.abc import Collection, Hashable, Iterable, Mapping
from typing import NamedTuple

from amp_rewrite.core.graph import PrecisionGraph
from amp_rewrite.core.precision import OpClass, Precision
from amp_rewrite.core.rules import RuleSet


class Fix(NamedTuple):  # a NamedTuple for speed, as graph.GroupInfo
    """A fixed precision with its reason; ``cause`` is the group that forced it, if any."""

    precision: Precision
    reason: str
    cause: Hashable | None = None


def classify_groups(graph: PrecisionGraph, rules: RuleSet) -> dict[Hashable, OpClass]:
    """Op class per group: the adapter's override, else the rule file's class."""
    return {g.key: g.op_class or rules.class_of(g.op_key) for g in graph.groups()}


def rule_fixes(graph: PrecisionGraph, rules: RuleSet, classes: dict[Hashable, OpClass],
               keep_fp32: Iterable[str] = ()) -> dict[Hashable, Fix]:
    """Fixes from the adapter, user pins (``keep_fp32`` and the rules' ``[keep_fp32]``)
    and allow/deny classes."""
    patterns = [(p, f"pinned to fp32 by keep_fp32 pattern {p!r}") for p in keep_fp32]
    patterns += [(e.pattern, f"{e.reason} [{e.source}]") for e in rules.pins if not e.low]
    fixes: dict[Hashable, Fix] = {}
    by_op: dict[tuple, Fix | None] = {}  # class fixes depend on the op only: share them
    for group in graph.groups():
        fix = _adapter_or_pin_fix(group, patterns) if group.fixed or patterns else None
        if fix is None:
            op = (group.op_key, classes[group.key])
            if op not in by_op:
                by_op[op] = _class_fix(group, rules, op[1])
            fix = by_op[op]
        if fix is not None:
            fixes[group.key] = fix
    return fixes


def direct_fixes(graph: PrecisionGraph, rules: RuleSet, classes: dict[Hashable, OpClass],
                 keep_fp32: Iterable[str] = (), pins: Mapping[Hashable, str] | None = None,
                 low_pins: Mapping[Hashable, str] | None = None,
                 wide_values: Mapping[Hashable, str] | None = None) -> dict[Hashable, Fix]:
    """Every fix but deny propagation's, later ones winning: the adapter's, patterns and
    rule classes (``rule_fixes``), ``pins`` (high), ``low_pins`` and the rules' ``[keep_low]``
    (low, not over the adapter), then readers of ``wide_values`` (high: no rule makes a
    clamp harmless). The plans of two and three labels both start here."""
    fixes = rule_fixes(graph, rules, classes, keep_fp32)
    fixes.update({k: Fix(Precision.HIGH, why) for k, why in (pins or {}).items()})
    low = {**low_pattern_pins(graph, rules), **(low_pins or {})}
    fixes.update({k: Fix(Precision.LOW, why) for k, why in low.items()
                  if graph.group(k).fixed is None})
    if wide_values:
        fixes.update(range_fixes(graph, classes, wide_values))
    return fixes


def low_pattern_pins(graph: PrecisionGraph, rules: RuleSet) -> dict[Hashable, str]:
    """Groups the rules' ``[keep_low]`` patterns name, with the entry's reason."""
    entries = [e for e in rules.pins if e.low]
    if not entries:
        return {}
    return {g.key: f"{e.reason} [{e.source}]" for g in graph.groups() for e in entries
            if fnmatch.fnmatchcase(g.name, e.pattern)}


def _adapter_or_pin_fix(group, patterns: list[tuple[str, str]]) -> Fix | None:
    if group.fixed is not None:
        return Fix(group.fixed, group.reason or "fixed by the adapter")
    for pattern, reason in patterns:
        if fnmatch.fnmatchcase(group.name, pattern):
            return Fix(Precision.HIGH, reason)
    return None


def _class_fix(group, rules: RuleSet, op_class: OpClass) -> Fix | None:
    entry = rules.classify(group.op_key)
    why = f"{entry.reason} [{entry.source}]" if entry else ""
    if op_class is OpClass.ALLOW:
        return Fix(Precision.LOW, f"allow: {why}" if why else "allow")
    if op_class is OpClass.DENY:
        return Fix(Precision.HIGH, f"deny: {why}" if why else "deny")
    if op_class is OpClass.UNLISTED:
        return Fix(Precision.HIGH, f"{group.op_key} is in no rule list: kept fp32 (safe default)")
    return None


def bounded_groups(graph: PrecisionGraph, rules: RuleSet) -> set[Hashable]:
    """Groups whose op's output is bounded (``RuleSet.has_bounded_output``)."""
    return {g.key for g in graph.groups() if rules.has_bounded_output(g.op_key)}


def deny_propagation(graph: PrecisionGraph, classes: dict[Hashable, OpClass],
                     fixes: dict[Hashable, Fix],
                     bounded: Collection[Hashable] = ()) -> dict[Hashable, Fix]:
    """Free gray/clear groups on a deny → (gray|clear)* → (gray|deny) path, fixed high.

    ``bounded``: groups whose output is bounded; as deny they end paths but start none.
    """
    is_deny = {k for k, f in fixes.items()
               if f.precision is Precision.HIGH and classes[k] in (OpClass.DENY, OpClass.UNLISTED)}
    passable = {OpClass.GRAY, OpClass.CLEAR}
    # Forward: free gray/clear groups reachable from a deny group, with the first cause seen.
    reached: dict[Hashable, tuple[Hashable, Hashable]] = {}  # group -> (cause, deny origin)
    queue = deque((k, k) for k in is_deny if k not in bounded)
    while queue:
        key, origin = queue.popleft()
        for nxt in graph.successor_groups(key):
            if nxt in reached or nxt in fixes or classes[nxt] not in passable:
                continue
            reached[nxt] = (key, origin)
            queue.append((nxt, origin))
    # Backward inside the reached set: keep those that lead on to a gray or deny group.
    ends = {k for k in reached if classes[k] is OpClass.GRAY}
    ends |= {k for k in reached if any(s in is_deny for s in graph.successor_groups(k))}
    forced = set(ends)
    queue = deque(ends)
    while queue:
        key = queue.popleft()
        for prev in graph.predecessor_groups(key):
            if prev in reached and prev not in forced:
                forced.add(prev)
                queue.append(prev)
    return {k: _propagated_fix(graph, *reached[k]) for k in forced}


def _propagated_fix(graph: PrecisionGraph, cause: Hashable, origin: Hashable) -> Fix:
    src = graph.group(origin)
    return Fix(Precision.HIGH,
               f"downstream of deny op {src.name} ({src.op_key}) through gray/clear ops: "
               "its output stays fp32 until an allow op", cause)


def range_fixes(graph: PrecisionGraph, classes: dict[Hashable, OpClass],
                wide_values: Mapping[Hashable, str],
                outcome: str = "runs fp32 rather than clamp") -> dict[Hashable, Fix]:
    """Readers of values the low dtype cannot hold (beyond its range, or significant values
    that underflow it) run high, instead of reading them clamped or flushed to zero.

    A clear reader (reshape, transpose, ...) passes the values on unchanged, so its readers
    run high too. Groups the adapter fixed (I/O kept, dtype already in the model) keep
    their fix; rule classes and user pins give way: no rule makes a clamp harmless.
    ``outcome`` ends each reason (a mixed plan says what it does instead: bf16 or fp32).
    """
    fixes: dict[Hashable, Fix] = {}
    queue = deque((v, why, graph.producer(v)) for v, why in wide_values.items())
    seen = set(wide_values)
    while queue:
        value, why, cause = queue.popleft()
        for reader in graph.consumers(value):
            if reader in fixes or graph.group(reader).fixed is not None:
                continue
            fixes[reader] = Fix(Precision.HIGH, f"reads {why}: {outcome}", cause)
            if classes[reader] is OpClass.CLEAR:
                for out in graph.outputs(reader):
                    if out not in seen:
                        seen.add(out)
                        queue.append((out, why, reader))
    return fixes
