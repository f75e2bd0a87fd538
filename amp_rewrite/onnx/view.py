"""Build the core's PrecisionGraph from an onnx_ir model (main graph and all subgraphs).

Every candidate value (float32 or target-dtype tensor) becomes a graph value; every node's
port groups become groups; graph inputs, initializers and Constant nodes become sources; graph
outputs become sinks. Subgraph inputs and outputs keep their dtypes; nodes inside a body read
values captured from outer graphs like any other value, so the casts for them are planned
once, in the outer graph, next to the producer.
"""
from __future__ import annotations

import fnmatch
import math
import sys
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from amp_rewrite.core import GroupInfo, LowDtype, OpClass, Precision, PrecisionGraph
from amp_rewrite.core.precision import einsum_sums_over_nothing, integer_conversion_reason
from amp_rewrite.onnx.kernels import lacks_bf16_kernel, no_bf16_kernel_reason
from amp_rewrite.onnx.load import SYMBOLIC_DIM_EXTENT, walk_graphs
from amp_rewrite.onnx.ports import (CONTROL_FLOW, PortGroup, Tie, body_graphs, control_flow_ties,
                                    is_candidate, node_opset, port_groups, signature,
                                    to_ir_dtype)

INSERTED_TAG = "amp_rewrite.inserted"
CAST_OPS = ("Cast", "CastLike")


@dataclass
class OnnxView:
    """The precision graph plus what the adapter needs to map decisions back."""

    graph: PrecisionGraph
    low: LowDtype
    graphs: list[ir.Graph] = field(default_factory=list)  # main graph first, then subgraphs
    groups: dict[tuple, tuple[ir.Node, PortGroup]] = field(default_factory=dict)
    sources: dict[tuple, tuple[ir.Graph, ir.Value, ir.Node | None]] = field(default_factory=dict)
    sinks: dict[tuple, tuple[ir.Graph, int]] = field(default_factory=dict)
    # the model's own Cast/CastLike nodes -> (input, output) dtypes before the rewrite
    model_casts: list[tuple[ir.Node, tuple]] = field(default_factory=list)
    # control-flow ties and the bodies whose boundary they carry (no sources or sinks there)
    ties: dict[tuple, tuple[ir.Node, Tie]] = field(default_factory=dict)
    tied_bodies: set[int] = field(default_factory=set)  # id() of ir.Graph
    # Constants the low dtype cannot hold -> why (their readers run high; no clamp).
    wide_values: dict[ir.Value, str] = field(default_factory=dict)
    clamp_constants: bool = False
    range_problems: dict[ir.Value, str] = field(default_factory=dict)  # see _range_problems
    # large float32 constants seen within the low dtype's range: no ±inf check when streamed
    in_range: set[ir.Value] = field(default_factory=set)
    small: SmallFloat32 | None = None  # small raw float32 constants, joined (_small_float32)
    opsets: dict[str, int] = field(default_factory=dict)  # the model's opset imports
    # a mixed plan (core/multilabel.py): constants fp16 cannot hold stay free, for the plan
    # to store them bf16 where its readers run bf16 (``wide_values`` still lists them)
    mixed: bool = False
    # bf16 only where onnxruntime's CUDA provider has the kernel (``target="ort"``; kernels.py)
    cuda_bf16_only: bool = False


def value_nbytes(value: ir.Value, inferred: dict[str, int | None]) -> int | None:
    """fp32 bytes of a value from its shape, else from load-time shape inference."""
    shape = value.shape
    if shape is None:
        return inferred.get(value.name)
    extent = 4
    for d in shape.dims:
        extent *= d if isinstance(d, int) else SYMBOLIC_DIM_EXTENT
    return max(extent, 4)


def build_view(model: ir.Model, low: LowDtype, *, keep_io_types: bool = True,
               graphs: list[ir.Graph] | None = None, clamp_constants: bool = False,
               low_io: tuple[str, ...] = (),
               inferred_sizes: Mapping[str, int | None] | None = None,
               mixed: bool = False, cuda_bf16_only: bool = False) -> OnnxView:
    """The precision view of ``model``; ``graphs``: ``walk_graphs(model.graph)`` if given.

    ``clamp_constants``: constants beyond the low dtype's range may be stored clamped; by
    default they stay fp32 and so do their readers (decision 0010).
    ``low_io``: name patterns (fnmatch) of main-graph inputs/outputs fixed low (a KV cache).
    ``inferred_sizes``: fp32 bytes of values without a shape (``LoadInfo.inferred_sizes``).
    ``mixed``: the view of a mixed plan (``low`` fp16; ``OnnxView.mixed``).
    ``cuda_bf16_only``: bf16 only for nodes onnxruntime's CUDA provider has a bf16 kernel
    for (``kernels.py``); the others are fixed fp32 in a bf16 view (a mixed plan leaves them
    fp16 or fp32: ``mixed.admissible``).
    """
    graphs = list(walk_graphs(model.graph)) if graphs is None else graphs
    view = OnnxView(PrecisionGraph(), low, graphs, clamp_constants=clamp_constants,
                    mixed=mixed, cuda_bf16_only=cuda_bf16_only)
    view.small, others = _small_float32(graphs)
    if not clamp_constants:
        view.range_problems = _range_problems(view.small, others, low, view.in_range)
    low_ir = to_ir_dtype(low)
    opsets = view.opsets = dict(model.opset_imports)
    inferred = inferred_sizes or {}
    sizes = _if_output_sizes(graphs, inferred)
    for g in graphs:
        _add_values(view, g, low_ir, inferred, sizes)
    for g in graphs:
        is_main = g is model.graph
        _add_sources(view, g, low_ir, is_main, keep_io_types, low_io)
        for node in g:
            _add_node(view, node, node_opset(node, opsets), low_ir)
        _add_sinks(view, g, low_ir, is_main, keep_io_types, low_io)
    return view


def _low_io_pattern(v: ir.Value, patterns: tuple[str, ...]) -> str | None:
    """The first of ``patterns`` (fnmatch) that a main-graph input/output's name matches."""
    return next((p for p in patterns if v.name and fnmatch.fnmatchcase(v.name, p)), None)


def _add_values(view: OnnxView, g: ir.Graph, low_ir: ir.DataType,
                inferred: dict[str, int | None], sizes: dict[ir.Value, int]) -> None:
    values = [*g.inputs, *g.initializers.values()]
    values += [v for node in g for v in node.outputs]
    for v in values:
        if is_candidate(v, low_ir) and not view.graph.has_value(v):
            nbytes = value_nbytes(v, inferred)
            if nbytes is None:
                nbytes = sizes.get(v) or _moved_size(view.graph, v)
            view.graph.add_value(v, name=v.name or "", nbytes=nbytes)


# Ops whose output holds exactly the elements of their first input: an output without a shape
# (fusions create such values) costs what the input costs, not one unit.
_SAME_SIZE_OPS = frozenset({"Transpose", "Reshape", "Identity", "Squeeze", "Unsqueeze",
                            "Flatten"})


def _moved_size(graph: PrecisionGraph, v: ir.Value) -> int | None:
    node = v.producer()
    if node is None or node.domain != "" or node.op_type not in _SAME_SIZE_OPS:
        return None
    src = node.inputs[0] if node.inputs else None
    return graph.value(src).nbytes if src is not None and graph.has_value(src) else None


def _if_output_sizes(graphs: list[ir.Graph], inferred) -> dict[ir.Value, int]:
    """Sizes for If outputs and branch outputs that shape inference left unknown, from the
    other side of the If (they are one tensor), so the cut does not cast inside branches."""
    sizes: dict[ir.Value, int] = {}
    if len(graphs) == 1:
        return sizes  # an If always brings its branches along
    for g in graphs:
        for node in g:
            if node.op_type != "If" or node.domain != "":
                continue
            branches = body_graphs(node)
            for i, out in enumerate(node.outputs):
                members = [out, *(b.outputs[i] for b in branches if i < len(b.outputs))]
                known = [n for n in (value_nbytes(v, inferred) for v in members) if n]
                if known:
                    sizes.update({v: max(known) for v in members})
    return sizes


def _current(value: ir.Value, low_ir: ir.DataType) -> Precision:
    return Precision.LOW if value.dtype == low_ir else Precision.HIGH


def _add_sources(view: OnnxView, g: ir.Graph, low_ir: ir.DataType, is_main: bool,
                 keep_io: bool, low_io: tuple[str, ...] = ()) -> None:
    tied = id(g) in view.tied_bodies
    for v in g.inputs if not tied else ():
        if is_candidate(v, low_ir):
            if is_main and (pattern := _low_io_pattern(v, low_io)):
                _source(view, g, v, None, Precision.LOW, f"graph input low by low_io {pattern!r}")
                continue
            keep = not is_main or keep_io or v.dtype == low_ir
            reason = ("graph input keeps its dtype (keep_io_types)" if is_main
                      else "subgraph input keeps its dtype")
            _source(view, g, v, None, _current(v, low_ir) if keep else None, reason)
    inputs = set(g.inputs)  # ``in g.inputs`` scans the list: slow for many inputs
    for v in g.initializers.values():
        if is_candidate(v, low_ir) and v not in inputs:
            if v.dtype == low_ir:
                _source(view, g, v, None, Precision.LOW, "initializer already low in the model")
                continue
            wide = _wide(view, v, v.const_value)
            _source(view, g, v, None, Precision.HIGH if wide else None, wide or "")


def _source(view, g, v, node, fixed, reason, name: str = "") -> None:
    key = ("source", v)
    view.sources[key] = (g, v, node)
    view.graph.add_source(key, v, name=name or v.name or "", fixed=fixed,
                          reason=reason if fixed else "")


def _add_sinks(view: OnnxView, g: ir.Graph, low_ir: ir.DataType, is_main: bool,
               keep_io: bool, low_io: tuple[str, ...] = ()) -> None:
    if id(g) in view.tied_bodies:
        return
    for i, v in enumerate(g.outputs):
        if not is_candidate(v, low_ir):
            continue
        key = ("sink", g, i)
        view.sinks[key] = (g, i)
        fixed = _current(v, low_ir) if keep_io or not is_main else None
        reason = "graph output keeps its dtype" if fixed else ""
        if is_main and (pattern := _low_io_pattern(v, low_io)):
            fixed, reason = Precision.LOW, f"graph output low by low_io {pattern!r}"
        view.graph.add_sink(key, v, name=f"output:{v.name}", fixed=fixed, reason=reason)


def _add_node(view: OnnxView, node: ir.Node, opset: int, low_ir: ir.DataType) -> None:
    domain, op_type = node.domain, node.op_type
    if op_type == "Constant" and domain == "":
        _add_constant(view, node, low_ir)
        return
    if op_type in CONTROL_FLOW and domain == "" and _add_ties(view, node, opset, low_ir):
        return
    groups = _fixed_port_groups(node, opset, view.low, low_ir)
    if not groups:
        return
    if (view.cuda_bf16_only and view.low is LowDtype.BFLOAT16
            and lacks_bf16_kernel(domain, op_type, opset)):
        why = no_bf16_kernel_reason(op_type, opset)
        groups = tuple((pg, Precision.HIGH, why) if fixed is None else (pg, fixed, reason)
                       for pg, fixed, reason in groups)
    if op_type in CAST_OPS and domain == "":
        if op_type == "Cast" and INSERTED_TAG in node.metadata_props:
            groups = _tagged(node, groups, low_ir)
        else:
            view.model_casts.append((node, cast_dtypes(node)))
    op_key = op_type if domain == "" else f"{domain}::{op_type}"
    # An outer product (a GEMM summing over nothing) is a broadcast multiply, memory-bound
    # like one, and its operands are often positions (RoPE's t ⊗ inv_freq): gray, as Mul.
    op_class = OpClass.GRAY if domain == "" and _is_outer_product(node) else None
    if op_type == "Cast" and domain == "" and (source := _wide_integer_source(node)):
        # Positions and timesteps: rounded here, the angles read from them would be wrong; a
        # deny source, so the gray math up to Cos/Sin stays fp32 too (decision 0032).
        op_class = OpClass.DENY
        groups = tuple((pg, Precision.HIGH, integer_conversion_reason("Cast", source))
                       if pg.outputs else (pg, fixed, reason) for pg, fixed, reason in groups)
    inputs, outputs, name = node.inputs, node.outputs, node.name or ""
    add_group, view_groups = view.graph.add_group, view.groups
    for index, (pg, fixed, reason) in enumerate(groups):
        key = ("node", node, index)
        view_groups[key] = (node, pg)
        add_group(GroupInfo(key, node, name, op_key, fixed, reason, op_class, pg.saves_traffic,
                            pg.label),
                  inputs=[inputs[i] for i in pg.inputs], outputs=[outputs[o] for o in pg.outputs])


_WIDE_INTEGERS = {ir.DataType.INT16, ir.DataType.INT32, ir.DataType.INT64, ir.DataType.UINT16,
                  ir.DataType.UINT32, ir.DataType.UINT64}


def _wide_integer_source(cast: ir.Node) -> str | None:
    """The name of a float32 Cast's integer input type wider than 8 bits (8-bit integers are
    exact in fp16 and bf16), else None."""
    source, target = cast_dtypes(cast)
    if source in _WIDE_INTEGERS and target == ir.DataType.FLOAT:
        return source.name.lower()
    return None


def _is_outer_product(node: ir.Node) -> bool:
    """A MatMul or Gemm whose summed dimension is 1, or an Einsum that sums over no index."""
    if node.op_type == "Einsum":
        attr = node.attributes.get("equation")
        return attr is not None and einsum_sums_over_nothing(attr.as_string())
    if node.op_type not in ("MatMul", "Gemm") or len(node.inputs) < 2:
        return False
    # the summed dimension, from whichever operand's shape is known
    trans_a, trans_b = (int(node.attributes[name].as_int()) if name in node.attributes else 0
                        for name in ("transA", "transB"))  # Gemm's; MatMul has none
    return any(_dim(value, axis) == 1 for value, axis in (
        (node.inputs[0], 0 if trans_a else -1), (node.inputs[1], -1 if trans_b else -2)))


def _dim(value: ir.Value | None, axis: int) -> int | None:
    shape = value.shape if value is not None else None
    if shape is None or len(shape) < (axis + 1 if axis >= 0 else -axis):
        return None
    return shape[axis] if isinstance(shape[axis], int) else None


# ports.signature -> ((port group, fixed, reason), ...)
_FIXED_GROUPS: dict[tuple, tuple[tuple[PortGroup, Precision | None, str], ...]] = {}


def _fixed_port_groups(node: ir.Node, opset: int, low: LowDtype, low_ir: ir.DataType
                       ) -> tuple[tuple[PortGroup, Precision | None, str], ...]:
    key = signature(node, opset, low)
    cached = _FIXED_GROUPS.get(key)
    if cached is None:
        cached = _FIXED_GROUPS[key] = tuple(
            (pg, *_group_fix(pg, _ports(node, pg), low_ir))
            for pg in port_groups(node, opset, low))
    return cached


def _tagged(node: ir.Node, groups, low_ir: ir.DataType):
    """A cast amp_rewrite inserted keeps its types: its groups fixed as they are."""
    return tuple((pg, _current(_ports(node, pg)[0], low_ir),
                  "a cast inserted by amp_rewrite keeps its types") for pg, _, _ in groups)


def _ports(node: ir.Node, pg: PortGroup) -> list[ir.Value]:
    return [*(node.inputs[i] for i in pg.inputs), *(node.outputs[o] for o in pg.outputs)]


def _add_ties(view: OnnxView, node: ir.Node, opset: int, low_ir: ir.DataType) -> bool:
    """The node's ties as groups (see ``ports.Tie``); False where they cannot be formed."""
    ties = control_flow_ties(node, opset, view.low)
    if ties is None:
        return False
    view.tied_bodies.update(id(b) for b in body_graphs(node))
    for index, tie in enumerate(ties):
        reads, writes = tie.reads(node), tie.writes(node)
        if tie.fixed_reason:
            fixed, reason = _current(writes[0], low_ir), tie.fixed_reason
        elif {v.dtype for v in reads + writes} == {low_ir}:
            fixed, reason = Precision.LOW, f"already {low_ir.name.lower()} in the model"
        else:
            fixed, reason = None, ""
        key = ("tie", node, index)
        view.ties[key] = (node, tie)
        view.graph.add_group(GroupInfo(key, node, node.name or "", node.op_type, fixed, reason,
                                       savings=False, tvar="V"), inputs=reads, outputs=writes)
    return True


def cast_dtypes(cast: ir.Node) -> tuple[ir.DataType | None, ir.DataType | None]:
    """(input dtype, output dtype) of a Cast or CastLike."""
    return cast.inputs[0].dtype, cast.outputs[0].dtype


def _group_fix(pg: PortGroup, values, low_ir) -> tuple[Precision | None, str]:
    dtypes = {v.dtype for v in values}
    if pg.fixed_reason:
        return Precision.HIGH if ir.DataType.FLOAT in dtypes else Precision.LOW, pg.fixed_reason
    if dtypes == {low_ir}:
        return Precision.LOW, f"already {low_ir.name.lower()} in the model"
    return None, ""


def _add_constant(view: OnnxView, node: ir.Node, low_ir: ir.DataType) -> None:
    out = node.outputs[0]
    if not is_candidate(out, low_ir):
        return
    convertible = "value" in node.attributes and out.dtype == ir.DataType.FLOAT
    fixed = None if convertible else _current(out, low_ir)
    reason = "" if convertible else "Constant form kept as is"
    wide = _wide(view, out, node.attributes["value"].value) if convertible else None
    if wide:
        fixed, reason = Precision.HIGH, wide
    _source(view, node.graph, out, node, fixed, reason, name=node.name)


def _wide(view: OnnxView, value: ir.Value, tensor) -> str | None:
    """Why the low dtype cannot hold this float32 constant (recorded), or None; None too
    in a mixed view, whose plan decides where such a constant is stored (bf16 or fp32)."""
    problem = view.range_problems.get(value)
    if problem is None:
        return None
    view.wide_values[value] = f"{value.name or 'a constant'} ({problem})"
    if view.mixed:
        return None
    return f"{problem}: kept fp32 with its readers (no clamp)"


@dataclass
class SmallFloat32:
    """Small float32 constants stored as raw bytes, joined end to end, so the range check
    and the conversion (``apply``) each run once over all of them."""

    values: list[ir.Value]
    data: np.ndarray  # float32
    starts: np.ndarray  # int64: tensor i is data[starts[i]:starts[i + 1]]
    index: dict[ir.Value, int]  # value -> i

    @classmethod
    def joined(cls, small: list[tuple[Hashable, bytes]]) -> SmallFloat32:
        """(key, raw float32 bytes) pairs joined end to end, in order."""
        sizes = np.fromiter((len(raw) // 4 for _, raw in small), np.int64, len(small))
        return cls([key for key, _ in small],
                   np.frombuffer(b"".join(raw for _, raw in small), "<f4"),
                   np.concatenate(([0], np.cumsum(sizes))),
                   {key: i for i, (key, _) in enumerate(small)})


def constant_range_problems(graphs: list[ir.Graph], low: LowDtype) -> dict[ir.Value, str]:
    """``range_problem`` of every float32 initializer and ``Constant(value=...)`` of
    ``graphs`` against ``low``: the screen ``build_view`` runs, for a caller with no view."""
    small, others = _small_float32(graphs)
    return _range_problems(small, others, low, set())


def _small_float32(graphs: list[ir.Graph]) -> tuple[SmallFloat32, list[tuple[ir.Value, object]]]:
    """The float32 initializers and ``Constant(value=...)`` tensors: the small raw ones
    joined, and the others (value, tensor)."""
    small: list[tuple[ir.Value, bytes]] = []
    others = []
    for value, tensor in _float_constants(graphs):
        raw = small_float32_bytes(tensor)
        if raw is None:
            others.append((value, tensor))
        else:
            small.append((value, raw))
    return SmallFloat32.joined(small), others


def _range_problems(small: SmallFloat32, others: list[tuple[ir.Value, object]], low: LowDtype,
                    in_range: set[ir.Value]) -> dict[ir.Value, str]:
    """``range_problem`` of every float32 initializer and ``Constant(value=...)``; large
    ones that fit go to ``in_range``. Small ones are screened together (one max|x| each)."""
    problems: dict[ir.Value, str] = {}
    for value, tensor in others:
        try:
            array = tensor.numpy()
        except Exception:  # malformed data: left to the conversion to report, as before
            continue
        if array.dtype == np.float32 and array.size and _fits(
                max(float(array.max()), -float(array.min())), low):
            in_range.add(value)
        else:
            problem = range_problem(array, low, addend=only_summed(value))
            if problem:
                problems[value] = problem
        if isinstance(tensor, ir.ExternalTensor):  # unmap: its pages count in our RSS
            del array
            tensor.release()
    if small.values:
        fits = _fits(np.maximum.reduceat(np.abs(small.data), small.starts[:-1]), low)
        for i in np.flatnonzero(~fits):
            value = small.values[i]
            problem = range_problem(small.data[small.starts[i]:small.starts[i + 1]], low,
                                    addend=only_summed(value))
            if problem:
                problems[value] = problem
    return problems


# Inputs whose value is only added to the op's result (a bias): (domain, op) -> ports.
_ADDEND_PORTS = {("", "Add"): {0, 1}, ("", "Sub"): {0, 1}, ("", "Conv"): {2},
                 ("", "ConvTranspose"): {2}, ("com.microsoft", "BiasGelu"): {1},
                 ("com.microsoft", "FusedConv"): {2, 3},
                 ("com.microsoft", "SkipLayerNormalization"): {3},
                 ("com.microsoft", "SkipSimplifiedLayerNormalization"): {3}}


def only_summed(value: ir.Value) -> bool:
    """Whether every reader adds ``value`` into a sum (a bias), and it is no graph output:
    flushing a subnormal addend moves the sum no more than the low sum's own rounding
    (decision 0018). Gemm's C is left out: its beta scales it."""
    uses = list(value.uses())
    if not uses or value.is_graph_output():
        return False
    return all(idx in _ADDEND_PORTS.get((node.domain or "", node.op_type), ())
               for node, idx in uses)


def _fits(top, low: LowDtype):
    """Whether tensors whose largest magnitude is ``top`` (a float or an array of them)
    surely fit the low dtype: finite, within its range, and not so small that significant
    values could fall deep into its subnormals. NaN fits nothing."""
    limit, tiny = _LIMITS[low]
    return (top <= limit) & ((top == 0) | (top * _SIGNIFICANT >= 4 * tiny))


def _float_constants(graphs: list[ir.Graph]):
    for g in graphs:
        for v in g.initializers.values():
            if v.dtype == ir.DataType.FLOAT and v.const_value is not None:
                yield v, v.const_value
        for node in g:
            if node.op_type == "Constant" and node.domain == "" and "value" in node.attributes:
                out = node.outputs[0]
                if out.dtype == ir.DataType.FLOAT:
                    yield out, node.attributes["value"].value


SMALL_TENSOR_BYTES = 1 << 16  # see apply._stored_tensor


def small_float32_bytes(tensor) -> bytes | None:
    """The raw little-endian bytes of a small float32 tensor stored as a TensorProto, or
    None (the element count from the proto's dims: onnx_ir's shape is slow)."""
    if not isinstance(tensor, ir.serde.TensorProtoTensor) or sys.byteorder != "little":
        return None
    proto = tensor.raw
    if (proto.data_type != onnx.TensorProto.FLOAT or not proto.raw_data
            or proto.data_location == onnx.TensorProto.EXTERNAL):
        return None
    raw = proto.raw_data
    return raw if len(raw) <= SMALL_TENSOR_BYTES and len(raw) == 4 * math.prod(proto.dims) \
        else None


# A value this far below the tensor's largest is under its rounding error in any sum or
# product with it (about fp16's mantissa): flushing it changes nothing that matters.
_SIGNIFICANT = 2.0 ** -10
_MAX_UNDERFLOW_ERROR = 0.125  # relative error of a deep subnormal that counts as lost
_LIMITS = {low: (float(info.max), float(info.smallest_subnormal)) for low, info in (
    (LowDtype.FLOAT16, ml_dtypes.finfo(np.float16)),
    (LowDtype.BFLOAT16, ml_dtypes.finfo(ml_dtypes.bfloat16)))}


# float32's extremes, what exporters write for -inf in attention masks: stored as the low
# dtype's extreme they keep their meaning (exp(-65504 - s) is 0 too).
FLOAT32_SENTINEL = float(np.finfo(np.float32).max)


def only_sentinels_beyond(array: np.ndarray, limit: float) -> bool:
    """Whether every finite value of ``array`` beyond ``limit`` is ±float32's extreme."""
    magnitude = np.abs(array)
    beyond = magnitude[np.isfinite(magnitude) & (magnitude > limit)]
    return bool(beyond.size) and bool((beyond == FLOAT32_SENTINEL).all())


def range_problem(array: np.ndarray, low: LowDtype, *, addend: bool = False) -> str | None:
    """Why ``array`` (float32) does not fit the low dtype, or None: a finite value beyond
    its range (unless all such are ±float32's extreme, mask sentinels), or values within
    2**-10 of its largest so deep in the subnormals that converting loses more than 1/8 of
    them. An ``addend`` (``only_summed``) is judged on its range alone.
    """
    if array.dtype != np.float32 or array.size == 0:
        return None
    limit, tiny = _LIMITS[low]
    top = max(float(array.max()), -float(array.min()))  # no |x| copy: 25k weights add up
    if not np.isfinite(top):  # Inf or NaN somewhere: the largest finite magnitude
        magnitude = np.abs(array)
        finite = magnitude[np.isfinite(magnitude)]
        top = float(finite.max()) if finite.size else 0.0
    if top > limit and not only_sentinels_beyond(array, limit):
        return f"values up to {top:.3g}, beyond {low.value}'s ±{limit:.6g}"
    if top > limit:
        return None  # the sentinels map to the low dtype's extremes (apply._convert)
    if addend or top == 0.0 or top * _SIGNIFICANT >= 4 * tiny:
        return None  # every significant value converts within 1/8 of itself
    info = ml_dtypes.finfo(np.float16 if low is LowDtype.FLOAT16 else ml_dtypes.bfloat16)
    magnitude = np.abs(array)
    floor = top * _SIGNIFICANT
    significant = array[(magnitude >= floor) & (magnitude > 0)]
    back = significant.astype(info.dtype).astype(np.float32)
    lost = np.abs(back - significant) > _MAX_UNDERFLOW_ERROR * np.abs(significant)
    if not lost.any():
        return None
    return (f"{int(lost.sum())} significant values as small as "
            f"{float(np.abs(significant[lost]).min()):.3g} underflow {low.value}")
