"""The autocast floor: never run an op in lower precision than ``torch.autocast`` would.

``torch.autocast`` casts inputs only for its lower-precision ops (our allow class) and its fp32
ops (deny); every other op runs in the dtype PyTorch's type promotion gives its inputs. So an op
that reads an FP32 parameter, an fp32 mask or an fp32 residual stream runs in fp32 under
autocast, for free: the kernel promotes. A cast-minimising plan may instead cast that stream
down once and run everything after it low (BERT's post-norm residual stream, a final norm that
is the model's output), which costs fewer casts but doubles the output error.

``autocast_pins`` replays autocast's dispatch over the PrecisionGraph, in topological order:
allow → low, deny → high, sources and fixed groups as they are, any other op high iff an input
that anchors promotion (one with a dimension) is high. Groups that come out high and are not
fixed yet become pins for the core: the plan is then at least as precise as autocast
everywhere, and the min cut still chooses the rest. The replay is cheap (one pass), and since
pinned groups are fixed high, their promoting reads of low values are free reads in the core,
exactly as they are free in autocast.

The model's own fp32 conversions whose dtype the trace may have frozen (``x.to(q.dtype)``,
``opkeys.RETYPABLE``) are replayed as low: under autocast ``q`` is usually low there.
"""
from __future__ import annotations

from collections.abc import Hashable

from amp_rewrite.core import OpClass, Precision, PrecisionGraph, RuleSet
from amp_rewrite.core.constraints import classify_groups
from amp_rewrite.fx import opkeys

_LOW_CLASSES = {OpClass.ALLOW}
_HIGH_CLASSES = {OpClass.DENY}


def autocast_pins(graph: PrecisionGraph, rules: RuleSet) -> dict[Hashable, str]:
    """Group key → reason, for the free groups autocast would run in fp32."""
    classes = classify_groups(graph, rules)
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
    if op_class in _LOW_CLASSES:
        return Precision.LOW, ""
    if op_class in _HIGH_CLASSES:
        return Precision.HIGH, ""
    if group.tvar == "out" and group.op_key in opkeys.RETYPABLE:
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
