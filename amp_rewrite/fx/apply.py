"""Apply a PrecisionPlan to a GraphModule (docs/design.md §4).

One ``aten._to_copy(value, dtype=...)`` per (value, target dtype), right after the value's
producer and shared by every consumer that needs it. Parameters are never converted in place:
a ``get_attr`` of an FP32 parameter feeding low ops gets an in-graph cast, executed once per
forward, so gradients flow back to the FP32 master weight. Casts carry a tag; only tagged casts
are ever reused or removed, the model's own conversions are left alone. ``aten.
_assert_tensor_metadata`` checks that export inserted are updated to the rewritten dtypes.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Hashable
from dataclasses import dataclass

import torch
from torch.fx import Node
from torch.fx.node import map_aggregate

from amp_rewrite.core import Precision, PrecisionPlan
from amp_rewrite.errors import AmpRewriteError
from amp_rewrite.fx import opkeys
from amp_rewrite.fx.view import (CAST_TAG, FxView, Port, float_scalars, is_cast, is_sentinel,
                                 resolve)

DTYPE_SUFFIX = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default


@dataclass(frozen=True)
class ApplyResult:
    """What apply changed; ``modified`` is False when the graph already matched the plan."""

    casts_inserted: int
    casts_removed: int
    ports_rewired: int
    asserts_updated: int
    conversions_retyped: int
    upcasts_by_promotion: int  # planned upcasts left to the consumer's type promotion

    @property
    def modified(self) -> bool:
        return any((self.casts_inserted, self.casts_removed, self.ports_rewired,
                    self.asserts_updated, self.conversions_retyped))


def apply_plan(gm: torch.fx.GraphModule, view: FxView, plan: PrecisionPlan) -> ApplyResult:
    """Mutate ``gm`` so every group reads its inputs in its planned precision."""
    graph = gm.graph
    existing = {(n.args[0], n.kwargs["dtype"]): n for n in graph.nodes if is_cast(n)}
    promoted = promoted_reads(view, plan)
    targets, inserted = _cast_targets(graph, view, plan, existing, promoted)
    rewired = sum(_rewire(port, targets.get((group, port.value), port.value))
                  for group, ports in view.ports.items() for port in ports)
    retyped = _retype_conversions(view, plan) + _retarget_sentinels(view, plan)
    updated = _sync_metadata_asserts(graph, view, plan)
    removed = _erase_unused_casts(graph)
    graph.lint()
    gm.recompile()
    return ApplyResult(inserted, removed, rewired, updated, retyped, len(promoted))


def promoted_reads(view: FxView, plan: PrecisionPlan) -> set[tuple[Hashable, Node]]:
    """(group, value) reads of a low value by a high promoting op that needs no upcast: some
    other fp32 input has a dimension, so the kernel upcasts (``placement.free_reads``, here
    also for inputs the min cut placed fp32)."""
    covered: set[tuple[Hashable, Node]] = set()
    for group, ports in view.ports.items():
        info = view.graph.group(group)
        if plan.precision(group) is not Precision.HIGH or info.op_key not in opkeys.PROMOTING:
            continue
        produced = {p.value: plan.precision(view.values[p.value]) for p in ports}
        if any(produced[p.value] is Precision.HIGH and p.value.meta["val"].dim() > 0
               for p in ports):
            covered |= {(group, v) for v, prec in produced.items() if prec is Precision.LOW}
    return covered


def _cast_targets(graph: torch.fx.Graph, view: FxView, plan: PrecisionPlan,
                  existing: dict[tuple[Node, torch.dtype], Node],
                  promoted: set[tuple[Hashable, Node]]
                  ) -> tuple[dict[tuple[Hashable, Node], Node], int]:
    """(consumer group, value) → the cast node it must read; creates the missing casts."""
    targets: dict[tuple[Hashable, Node], Node] = {}
    inserted = 0
    for cast in plan.casts:
        consumers = [g for g in cast.consumers if (g, cast.value) not in promoted]
        if not consumers:
            continue
        dtype = view.cast_dtype(plan, cast)
        node = existing.get((cast.value, dtype))
        if node is None:
            node = insert_cast(graph, cast.value, dtype)
            existing[(cast.value, dtype)] = node
            inserted += 1
        for group in consumers:
            targets[(group, cast.value)] = node
    return targets, inserted


def _retype_conversions(view: FxView, plan: PrecisionPlan) -> int:
    """A free conversion/factory output planned low gets the low dtype as its argument."""
    retyped = 0
    for info in view.graph.groups():
        if info.tvar != "out" or info.op_key not in opkeys.RETYPABLE:
            continue
        want = view.dtype(plan, info.key)
        if opkeys.explicit_dtype(info.node) not in (None, want):
            opkeys.set_explicit_dtype(info.node, want)
            retyped += 1
    return retyped


def _retarget_sentinels(view: FxView, plan: PrecisionPlan) -> int:
    """``±finfo(float32).max`` scalars of ops planned low become ``±finfo(low).max`` of the
    dtype each op runs in."""
    retargeted = 0
    for info in view.graph.groups():
        node = info.node
        if not isinstance(node, Node) or plan.precision(info.key) is not Precision.LOW or not any(
                is_sentinel(x) for x in float_scalars(node)):
            continue
        low_max = torch.finfo(view.dtype(plan, info.key)).max

        def retarget(arg: object, low_max: float = low_max) -> object:
            if isinstance(arg, float) and is_sentinel(arg):
                return math.copysign(low_max, arg)
            return arg

        node.args = map_aggregate(node.args, retarget)
        node.kwargs = map_aggregate(node.kwargs, retarget)
        retargeted += 1
    return retargeted


def after_producer(graph: torch.fx.Graph, value: Node) -> Node:
    """The node a conversion of ``value`` goes after: ``value``, or the last placeholder
    (placeholders stay together at the top)."""
    if value.op != "placeholder":
        return value
    return [n for n in graph.nodes if n.op == "placeholder"][-1]


def conversion(graph: torch.fx.Graph, value: Node, dtype: torch.dtype) -> Node:
    """An untagged ``_to_copy(value, dtype=dtype)`` right after the value's producer, with the
    value's module path and stack."""
    with graph.inserting_after(after_producer(graph, value)):
        node = graph.create_node("call_function", torch.ops.aten._to_copy.default, (value,),
                                 {"dtype": dtype}, name=f"{value.name}_{DTYPE_SUFFIX[dtype]}")
    node.meta.update(source_meta(value))
    return node


def insert_cast(graph: torch.fx.Graph, value: Node, dtype: torch.dtype) -> Node:
    """A plan cast: a ``conversion`` tagged as this package's (``is_cast``)."""
    node = conversion(graph, value, dtype)
    node.meta[CAST_TAG] = True
    return node


def source_meta(value: Node) -> dict:
    """Module path and stack of ``value``, for a node that converts, pads or slices it."""
    return {k: value.meta[k] for k in ("nn_module_stack", "stack_trace") if k in value.meta}


def _rewire(port: Port, target: Node) -> int:
    current = get_arg(port.node, port.path)
    if current is target:
        return 0
    set_arg(port.node, port.path, target)
    return 1


def get_arg(node: Node, path: tuple) -> object:
    arg = node.args[path[1]] if path[0] == "args" else node.kwargs[path[1]]
    for index in path[2:]:
        arg = arg[index]
    return arg


def set_arg(node: Node, path: tuple, new: Node) -> None:
    kind, key, rest = path[0], path[1], path[2:]
    old = node.args[key] if kind == "args" else node.kwargs[key]
    value = _replace_at(old, rest, new)
    if kind == "args":
        node.update_arg(key, value)
    else:
        node.update_kwarg(key, value)


def _replace_at(container: object, rest: tuple, new: Node) -> object:
    if not rest:
        return new
    items = list(container)
    items[rest[0]] = _replace_at(items[rest[0]], rest[1:], new)
    return tuple(items) if isinstance(container, tuple) else items


def _sync_metadata_asserts(graph: torch.fx.Graph, view: FxView, plan: PrecisionPlan) -> int:
    """Export's ``_assert_tensor_metadata(x, dtype=...)`` must name x's rewritten dtype."""
    updated = 0
    for node in graph.nodes:
        if node.target is not _ASSERT_METADATA or not isinstance(node.args[0], Node):
            continue
        producer = view.values.get(resolve(node.args[0]))
        if producer is None or "dtype" not in node.kwargs:
            continue
        dtype = view.dtype(plan, producer)
        if node.kwargs["dtype"] != dtype:
            node.update_kwarg("dtype", dtype)
            updated += 1
    return updated


def _erase_unused_casts(graph: torch.fx.Graph) -> int:
    unused = [n for n in graph.nodes if is_cast(n) and not n.users]
    for node in unused:
        graph.erase_node(node)
    return len(unused)


def retype_values(gm: torch.fx.GraphModule, view: FxView, plan: PrecisionPlan) -> None:
    """Update ``meta['val']`` dtypes to the plan without re-running fake propagation
    (much cheaper; tests check it against a full propagation)."""
    memo: dict = {}
    for node in gm.graph.nodes:
        if is_cast(node):
            _set_val(node, node.args[0].meta.get("val"), node.kwargs["dtype"], memo)
        elif node in view.values:
            _set_val(node, node.meta.get("val"), view.dtype(plan, view.values[node]), memo)
            parent = node.args[0] if node.target is operator.getitem else None
            if parent is not None and isinstance(parent.meta.get("val"), list | tuple):
                vals = list(parent.meta["val"])
                vals[node.args[1]] = node.meta["val"]
                parent.meta["val"] = type(parent.meta["val"])(vals)


def _set_val(node: Node, val: object, dtype: torch.dtype, memo: dict) -> None:
    if isinstance(val, torch.Tensor):
        node.meta["val"] = val if val.dtype == dtype else retyped(val, dtype, memo)


def retyped(val: torch.Tensor, dtype: torch.dtype, memo: dict | None = None) -> torch.Tensor:
    """``val.to(dtype)``, under ``val``'s fake mode if it has one. ``memo`` (one per pass)
    shares one result among fake values of the same layout, as a fake ``.to`` is slow with
    symbolic shapes; safe, as the passes never mutate meta values."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return val.to(dtype)
    key = None
    if memo is not None:
        key = (id(mode), dtype, val.device, val.requires_grad, tuple(map(str, val.shape)),
               tuple(map(str, val.stride())))
        if key in memo:
            return memo[key]
    with mode:
        out = val.to(dtype)
    if key is not None:
        memo[key] = out
    return out


def check_applied(view: FxView, plan: PrecisionPlan) -> None:
    """Postcondition on refreshed ``meta['val']``: every port reads its group's dtype."""
    promoted = promoted_reads(view, plan)
    for group, ports in view.ports.items():
        want = view.dtype(plan, group)
        for port in ports:
            val = get_arg(port.node, port.path).meta.get("val")
            # a promoted read takes the value as made
            want_here = (view.dtype(plan, view.values[port.value])
                         if (group, port.value) in promoted else want)
            if isinstance(val, torch.Tensor) and val.dtype != want_here:
                raise AmpRewriteError(
                    f"internal error: {port.node.name} reads {port.value.name} as {val.dtype} "
                    f"but the plan runs it in {want_here}")
