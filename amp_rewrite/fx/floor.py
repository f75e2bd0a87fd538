"""The autocast floor: never run an op in lower precision than ``torch.autocast`` would.

Under autocast an op outside its cast lists runs in the dtype type promotion gives its inputs,
so an op reading an fp32 parameter, mask or residual stream runs fp32 for free; a
cast-minimising plan could instead run it low at twice the output error (decision 0005).
``autocast_pins`` replays autocast's dispatch over the PrecisionGraph in topological order
(allow → low, deny → high, others high iff an anchoring input is high) and pins the groups
that come out high; the min cut still chooses the rest. The model's own fp32 conversions
whose dtype the trace may have frozen (``opkeys.RETYPABLE``) are replayed as low.
"""
from __future__ import annotations

from collections.abc import Hashable

from amp_rewrite.core import OpClass, Precision, PrecisionGraph, RuleSet
from amp_rewrite.core.constraints import classify_groups
from amp_rewrite.fx import opkeys

_LOW_CLASSES = {OpClass.ALLOW}
_HIGH_CLASSES = {OpClass.DENY}


def autocast_pins(graph: PrecisionGraph, rules: RuleSet, *,
                  range_low: bool = False) -> dict[Hashable, str]:
    """Group key → reason, for the free groups autocast would run in fp32.

    ``range_low`` (mixed plans): the ops of the rules' ``[range]`` table are replayed low, as
    the plan runs them bf16 where autocast runs them fp32 (rules/torch.toml says why), so
    their readers are not pinned fp32 on their account."""
    classes = classify_groups(graph, rules)
    if range_low:
        classes.update({g.key: OpClass.ALLOW for g in graph.groups()
                        if g.fixed is None and rules.needs_range(g.op_key)})
    replayed: dict[Hashable, Precision] = {}
    pins: dict[Hashable, str] = {}
    for group in graph.groups():  # insertion order is the fx graph's topological order
        precision, reason = _replay(graph, group, classes[group.key], replayed)
        replayed[group.key] = precision
        if reason and group.fixed is None and graph.outputs(group.key):
            pins[group.key] = reason
    return pins


def _replay(graph: PrecisionGraph, group, op_class: OpClass,
            replayed: dict[Hashable, Precision]) -> tuple[Precision, str]:
    if group.fixed is not None:
        return group.fixed, ""
    if op_class in _HIGH_CLASSES:
        return Precision.HIGH, ""
    if op_class in _LOW_CLASSES or (group.tvar == "out" and group.op_key in opkeys.RETYPABLE):
        return Precision.LOW, ""
    high = _promoting_high_input(graph, group.key, replayed)
    if high is None:
        return Precision.LOW, ""
    return Precision.HIGH, (f"torch.autocast runs it in fp32: its input {high} is fp32 and "
                            "type promotion keeps it so (autocast floor)")


def _promoting_high_input(graph: PrecisionGraph, key: Hashable,
                          replayed: dict[Hashable, Precision]) -> str | None:
    """Name of an fp32 input that decides the op's dtype under type promotion, if any."""
    inputs = graph.inputs(key)
    anchoring = [v for v in inputs if graph.value(v).anchors] or inputs
    for v in anchoring:
        producer = graph.producer(v)
        if producer is not None and replayed.get(producer) is Precision.HIGH:
            return graph.value(v).name
    return None
