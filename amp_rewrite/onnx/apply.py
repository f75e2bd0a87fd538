"""Apply a PrecisionPlan to an onnx_ir model, in place.

Steps: retype the outputs of low groups (and the attributes that set them), convert constants
read only at low precision, insert one Cast per planned (value, dtype), right after the
producer and shared by its consumers, then bypass the model's casts that the retyping turned
into identities. Constants need no runtime Cast: a converted copy is stored instead.

Every dtype is read through ``plan.label`` / ``plan.cast_label``: a two-label plan answers
with the view's low dtype, a mixed plan (core/multilabel.py) with each group's own, fp16 or
bf16, so an fp16→bf16 Cast and a constant stored once per dtype its readers want come from
the same steps. Nodes the
pass creates carry ``amp_rewrite.inserted`` and a reason in metadata_props; retyped nodes carry
nothing (their reasons are in the report, which keeps large files small).
"""
from __future__ import annotations

import logging
import sys
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from amp_rewrite.core import CastPlan, PrecisionPlan
from amp_rewrite.core.precision import Label
from amp_rewrite.onnx import convert
from amp_rewrite.onnx.view import (FLOAT32_SENTINEL, INSERTED_TAG, SMALL_TENSOR_BYTES, OnnxView,
                                   SmallFloat32, cast_dtypes)

logger = logging.getLogger(__name__)
REASON_KEY = "amp_rewrite.reason"


@dataclass
class ApplyStats:
    """What the apply step changed; ``modified`` is derived from it."""

    casts_inserted: int = 0
    identity_casts_removed: int = 0
    nodes_retyped: int = 0
    constants_converted: int = 0
    constant_bytes_converted: int = 0
    constant_copies: int = 0
    values_clamped: int = 0
    clamped_constants: list[str] = field(default_factory=list)
    # one record per inserted Cast or converted constant copy: value, from, to, consumers
    inserted_casts: list[dict] = field(default_factory=list)

    @property
    def modified(self) -> bool:
        return bool(self.casts_inserted or self.nodes_retyped or self.constants_converted
                    or self.constant_copies or self.identity_casts_removed)


class _Namer:
    """Unique value names across the whole model (casts must not shadow outer names)."""

    def __init__(self, taken: Iterable[str]) -> None:
        self.taken = set(taken)

    @classmethod
    def of_graphs(cls, graphs: list[ir.Graph]) -> _Namer:
        namer = cls(v.name for g in graphs for v in (*g.inputs, *g.initializers.values())
                    if v.name)
        namer.taken.update(v.name for g in graphs for n in g for v in n.outputs if v.name)
        return namer

    def __call__(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name


_IR_DTYPES = {Label.FP32: ir.DataType.FLOAT, Label.FP16: ir.DataType.FLOAT16,
              Label.BF16: ir.DataType.BFLOAT16}


class _Dtypes:
    """The onnx dtype of each group and cast of ``plan`` (``plan.label``: the view's low
    dtype answers for a two-label plan)."""

    def __init__(self, plan: PrecisionPlan, view: OnnxView) -> None:
        self.plan, self.low = plan, view.low.label

    def of(self, group: Hashable) -> ir.DataType:
        return _IR_DTYPES[self.plan.label(group, self.low)]

    def of_cast(self, cast: CastPlan) -> ir.DataType:
        return _IR_DTYPES[self.plan.cast_label(cast, self.low)]


def apply_plan(model: ir.Model, view: OnnxView, plan: PrecisionPlan) -> ApplyStats:
    stats = ApplyStats()
    dtypes = _Dtypes(plan, view)
    namer = _Namer.of_graphs(view.graphs)
    # overflow is clamped and counted by ``_convert``, never a warning
    with np.errstate(over="ignore"):
        _retype_groups(view, dtypes, stats)
        _convert_sources(view, dtypes, stats)
        for cast in plan.casts:
            _insert_cast(view, cast, dtypes.of_cast(cast), namer, stats)
    _bypass_identity_casts(view.model_casts, stats)
    return stats


def _bypass_identity_casts(casts: list[tuple[ir.Node, tuple]], stats: ApplyStats) -> None:
    """Remove the model's casts that the rewrite retyped into identities. Casts the rewrite
    left as they were are not touched, so a second run removes nothing; a cast that writes
    a graph output keeps the output."""
    for node, before in casts:
        after = cast_dtypes(node)
        if after[0] != after[1] or after == before or node.outputs[0].is_graph_output():
            continue
        node.outputs[0].replace_all_uses_with(node.inputs[0])
        node.graph.remove(node, safe=True)
        stats.identity_casts_removed += 1


def _retype_groups(view: OnnxView, dtypes: _Dtypes, stats: ApplyStats) -> None:
    for key, (node, pg) in view.groups.items():
        target = dtypes.of(key)
        changed = [node.outputs[o] for o in pg.outputs if node.outputs[o].dtype != target]
        if not changed and not _attribute_differs(node, pg, target):
            continue
        for value in changed:
            value.dtype = target
        if pg.retype_attribute:
            _set_type_attribute(node, pg.retype_attribute, target)
        stats.nodes_retyped += 1
    for key, (node, tie) in view.ties.items():
        target = dtypes.of(key)
        changed = [v for v in tie.writes(node) if v.dtype != target]
        for value in changed:
            value.dtype = target
        stats.nodes_retyped += bool(changed)


def _attribute_differs(node: ir.Node, pg, target: ir.DataType) -> bool:
    if not pg.retype_attribute or not pg.outputs:
        return False
    attr = node.attributes.get(pg.retype_attribute)
    if attr is None:
        return False
    if attr.type == ir.AttributeType.TENSOR:
        return attr.value.dtype != target
    return attr.value != target


def _set_type_attribute(node: ir.Node, name: str, target: ir.DataType) -> None:
    attr = node.attributes.get(name)
    if name == "value":  # ConstantOfShape: the fill value's tensor sets the dtype
        fill = attr.value.numpy() if attr is not None else np.zeros(1, np.float32)
        node.attributes[name] = ir.AttrTensor(name, ir.tensor(_convert(fill, target)[0]))
    else:
        node.attributes[name] = ir.AttrInt64(name, int(target))


def _convert(array: np.ndarray, target: ir.DataType) -> tuple[np.ndarray, int]:
    """Convert to the target dtype, clamping finite values beyond its range; count them."""
    if target == ir.DataType.FLOAT:
        return np.asarray(array, np.float32), 0
    np_dtype = np.float16 if target == ir.DataType.FLOAT16 else ml_dtypes.bfloat16
    array = np.asarray(array)
    if np_dtype == np.float16:  # onnxruntime's vectorised Cast, bit-identical (convert.py)
        converted, overflowed = convert.to_float16(array)
    else:
        converted = array.astype(np_dtype)
        overflowed = convert.has_inf(converted)
    if not overflowed:  # the common case
        return converted, 0
    limit = float(ml_dtypes.finfo(np_dtype).max)
    over = np.isfinite(array) & (np.abs(array) > limit)
    clamped = np.where(over, np.sign(array) * limit, array).astype(np_dtype)
    # ±float32's extreme is a sentinel for ±inf (view.FLOAT32_SENTINEL), not a value clamped
    return clamped, int((over & (np.abs(array) != FLOAT32_SENTINEL)).sum())


def _convert_sources(view: OnnxView, dtypes: _Dtypes, stats: ApplyStats) -> None:
    """Sources (constants, graph inputs) stored in their group's low dtype, one dtype at a
    time (the small ones are converted together per dtype)."""
    by_dtype: dict[ir.DataType, list] = {}
    for key, (g, value, node) in view.sources.items():
        target = dtypes.of(key)
        if target != ir.DataType.FLOAT and value.dtype != target:
            by_dtype.setdefault(target, []).append((value, node))
    for low_ir, low in by_dtype.items():
        _convert_low_sources(view, low, low_ir, stats)


def _convert_low_sources(view: OnnxView, low: list[tuple[ir.Value, ir.Node | None]],
                         low_ir: ir.DataType, stats: ApplyStats) -> None:
    converted, elements = _small_initializers_converted(view, low, low_ir)
    for value, tensor in converted.items():
        value.const_value = tensor
        value.dtype = low_ir
    stats.constants_converted += len(converted)  # none clamped: see the function
    stats.constant_bytes_converted += 4 * elements
    for value, node in low:
        if value in converted:
            continue
        if value.const_value is not None or node is not None:
            _convert_constant_in_place(view, value, node, low_ir, stats)
        else:  # a main-graph input with keep_io_types off
            value.dtype = low_ir


def _small_initializers_converted(view: OnnxView,
                                  sources: list[tuple[ir.Value, ir.Node | None]],
                                  low_ir: ir.DataType
                                  ) -> tuple[dict[ir.Value, ir.TensorProtocol], int]:
    """Small float32 raw initializers (``view.small``) converted in one call over the joined
    array, each as ``_convert`` would alone; empty where any overflows (then each is
    clamped alone). Also returns how many elements were converted."""
    small = view.small
    picked = [(value, i) for value, node in sources
              if node is None and (i := small.index.get(value)) is not None]
    protos = joined_converted(small, [(v, i, v.const_value.raw.dims) for v, i in picked], low_ir)
    starts = small.starts
    elements = int(sum(starts[i + 1] - starts[i] for _, i in picked)) if protos else 0
    return {v: ir.serde.TensorProtoTensor(t) for v, t in protos.items()}, elements


def joined_converted(small: SmallFloat32, picked: list[tuple[Hashable, int, object]],
                     low_ir: ir.DataType) -> dict[Hashable, onnx.TensorProto]:
    """The picked tensors of ``small`` ((key, index, dims): the value's name is the key's, or
    the key itself), converted in one call over the joined array, as TensorProtos; empty where
    one of them overflows (each is then clamped alone, by ``_convert``)."""
    if not picked:
        return {}
    if low_ir == ir.DataType.FLOAT16:
        low, overflowed = convert.to_float16(small.data)
    else:
        low = small.data.astype(ml_dtypes.bfloat16)
        overflowed = convert.has_inf(low)
    starts = small.starts.tolist()  # Python ints: numpy scalars slow the loop below
    if overflowed and any(convert.has_inf(low[starts[i]:starts[i + 1]]) for _, i, _ in picked):
        return {}
    data, dtype = low.tobytes(), int(low_ir)
    return {key: onnx.TensorProto(name=getattr(key, "name", key), dims=dims, data_type=dtype,
                                  raw_data=data[2 * starts[i]:2 * starts[i + 1]])
            for key, i, dims in picked}


def _stored_array(value: ir.Value, node: ir.Node | None) -> bool:
    """An initializer or a ``Constant(value=...)``; other Constant forms, and initializers
    that are graph inputs (a default the caller may override), get a runtime Cast."""
    if node is not None:
        return "value" in node.attributes
    return value.const_value is not None and not value.is_graph_input()


def _constant_array(value: ir.Value, node: ir.Node | None) -> np.ndarray:
    if node is not None:
        return node.attributes["value"].value.numpy()
    return value.const_value.numpy()


def _convert_constant_in_place(view: OnnxView, value: ir.Value, node, low_ir,
                               stats: ApplyStats) -> None:
    tensor = _converted(view, value, node, low_ir, value.name, stats)
    if node is not None:
        node.attributes["value"] = ir.AttrTensor("value", tensor)
    else:
        value.const_value = tensor
    value.dtype = low_ir


def _converted(view: OnnxView, value: ir.Value, node, target: ir.DataType, name: str | None,
               stats: ApplyStats) -> ir.TensorProtocol:
    """The constant's data converted to ``target``, as the tensor to store under ``name``."""
    if _streams(view, value, node, target):
        tensor = convert.Float16Stream(value.const_value, _clamped_float16,
                                       check_inf=value not in view.in_range)
        tensor.name = name
        _count_conversion(value, tensor.size, 0, stats)
        return tensor
    array, clamped = _convert(_constant_array(value, node), target)
    _count_conversion(value, array.size, clamped, stats, array.dtype)
    return _stored_tensor(array, name)


def _streams(view: OnnxView, value: ir.Value, node, target: ir.DataType) -> bool:
    """Whether a float16 copy of this weight is converted as the output is written
    (``convert.Float16Stream``): large float32 external data whose range the view checked."""
    return (node is None and target == ir.DataType.FLOAT16 and not view.clamp_constants
            and value not in view.range_problems and convert.can_stream(value.const_value))


def _clamped_float16(chunk: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _convert(chunk, ir.DataType.FLOAT16)[0]


def _stored_tensor(array: np.ndarray, name: str | None) -> ir.TensorProtocol:
    """The converted array as an onnx_ir tensor: small ones as TensorProtos (serialised by
    one C++ copy), large ones numpy-backed (never copied)."""
    if array.nbytes > SMALL_TENSOR_BYTES or sys.byteorder != "little":  # raw_data is LE
        return ir.Tensor(array, name=name)
    proto = onnx.TensorProto(name=name, dims=array.shape, raw_data=array.tobytes(),
                             data_type=int(ir.DataType.from_numpy(array.dtype)))
    return ir.serde.TensorProtoTensor(proto)


def _count_conversion(value: ir.Value, elements: int, clamped: int, stats, dtype=None) -> None:
    stats.constants_converted += 1
    stats.constant_bytes_converted += elements * 4
    if clamped:
        stats.values_clamped += clamped
        stats.clamped_constants.append(value.name or "")
        logger.warning("clamped %d values of %s to the %s range", clamped, value.name, dtype)


def _insert_cast(view: OnnxView, cast: CastPlan, target: ir.DataType, namer: _Namer,
                 stats: ApplyStats) -> None:
    value = cast.value
    source = view.sources.get(("source", value))
    from_dtype = value.dtype
    suffix = "f32" if target == ir.DataType.FLOAT else ir.DataType(target).name.lower()
    name = namer(f"{value.name}_{suffix}")
    if source is not None and _stored_array(value, source[2]):
        new, kind = _constant_copy(view, source, target, name, stats), "constant copy"
    else:
        new, kind = _cast_node(value, target, name, cast, source), "Cast"
        stats.casts_inserted += 1
    _rewire(view, cast.consumers, value, new, namer)
    # after rewiring: a cast feeding a graph output takes the output's name
    stats.inserted_casts.append(_cast_record(view, cast, value, from_dtype, new, kind))


def _cast_record(view: OnnxView, cast: CastPlan, value: ir.Value, from_dtype, new: ir.Value,
                 kind: str) -> dict:
    """What the report says of one inserted cast; consumers by node (or graph output) name."""
    return {"value": value.name, "from": from_dtype.name.lower() if from_dtype else None,
            "to": new.dtype.name.lower() if new.dtype else None, "kind": kind,
            "cast_value": new.name, "consumers": [_consumer_name(view, k) for k in cast.consumers]}


def _consumer_name(view: OnnxView, key) -> str:
    """A graph output's name; a node group's node name (op type if unnamed); a control-flow
    tie's node and port."""
    if key in view.sinks:
        g, index = view.sinks[key]
        return f"graph output {g.outputs[index].name}"
    if key in view.groups:
        node = view.groups[key][0]
        return node.name or node.op_type
    _, node, index = key  # ("tie", If/Loop/Scan node, boundary index)
    return f"{node.name or node.op_type} (boundary {index})"


def _constant_copy(view: OnnxView, source, target: ir.DataType, name: str,
                   stats) -> ir.Value:
    g, value, node = source
    tensor = _converted(view, value, node, target, name, stats)
    stats.constant_copies += 1
    new = ir.Value(name=name, shape=value.shape, type=ir.TensorType(target),
                   const_value=tensor)
    g.register_initializer(new)
    return new


def _cast_node(value: ir.Value, target: ir.DataType, out_name: str, cast: CastPlan,
               source) -> ir.Value:
    out = ir.Value(name=out_name, type=ir.TensorType(target),
                   shape=value.shape.copy() if value.shape is not None else None)
    node = ir.Node("", "Cast", [value], [ir.AttrInt64("to", target)], outputs=[out],
                   name=f"amp_cast_{out_name}",
                   metadata_props={INSERTED_TAG: "cast", REASON_KEY: _cast_reason(cast)})
    insert_after_producer(node, value, source[0] if source is not None else value.graph)
    return out


def _cast_reason(cast: CastPlan) -> str:
    if cast.label is None:
        return (f"{len(cast.consumers)} consumer(s) need {cast.to.value} precision "
                "(exact min-cut placement)")
    return (f"{len(cast.consumers)} consumer(s) run {cast.label.value} (exact three-label "
            "placement)")


def insert_after_producer(node: ir.Node, value: ir.Value, graph: ir.Graph) -> None:
    """Insert ``node`` right after ``value``'s producer, or first in ``graph`` where ``value``
    has none (a graph input, initializer or a control-flow body's input)."""
    producer = value.producer()
    if producer is not None:
        producer.graph.insert_after(producer, node)
    elif len(graph):
        graph.insert_before(graph[0], node)
    else:
        graph.append(node)


def _rewire(view: OnnxView, consumers: tuple[Hashable, ...], old: ir.Value, new: ir.Value,
            namer: _Namer) -> None:
    for key in consumers:
        if key in view.sinks:
            _rewire_output(view.sinks[key], old, new, namer)
        elif key in view.ties:
            _rewire_tie(*view.ties[key], old, new)
        else:
            node, pg = view.groups[key]
            for i in pg.inputs:
                if node.inputs[i] is old:
                    node.replace_input_with(i, new)


def _rewire_tie(node: ir.Node, tie, old: ir.Value, new: ir.Value) -> None:
    """A control-flow node's input, or a body's output, reads the cast value instead."""
    for i in tie.inputs:
        if node.inputs[i] is old:
            node.replace_input_with(i, new)
    for g, k in tie.body_outputs:
        if g.outputs[k] is old:
            g.outputs[k] = new


def _rewire_output(sink, old: ir.Value, new: ir.Value, namer: _Namer) -> None:
    """Graph outputs keep their names: the cast takes the name, the inner value a new one."""
    g, index = sink
    if not new.is_graph_output():
        outer_name = old.name
        old.name = namer(f"{outer_name}_{old.dtype.name.lower()}")
        new.name = outer_name
    g.outputs[index] = new
