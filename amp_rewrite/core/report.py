"""Per-node decision records and summaries, shared by the ONNX and fx adapters."""
from __future__ import annotations

from collections import Counter
from collections.abc import Hashable

from amp_rewrite.core.graph import SINK_OP, SOURCE_OP, PrecisionGraph
from amp_rewrite.core.plan import PrecisionPlan
from amp_rewrite.core.precision import Precision


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
    others = [g for g in groups if g is not main]
    if others:
        record["ports"] = [{"type_vars": g.tvar, "precision": plan.decisions[g.key].precision.value,
                            "reason": plan.decisions[g.key].reason} for g in others]
    return record


def precision_counts(records: list[dict]) -> dict[str, int]:
    counts = Counter(r["precision"] for r in records)
    return {p.value: counts.get(p.value, 0) for p in Precision}


def unlisted_ops(records: list[dict]) -> list[str]:
    return sorted({r["op_type"] for r in records if r["class"] == "unlisted"})
