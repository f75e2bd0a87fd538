"""The ONNX pass on the ModelProto itself, for flat models where fusion and padding find nothing.

On such a model the pass only plans precisions, retypes values, converts initializers and
inserts casts: the nodes themselves do not change. Loading the model into onnx_ir and writing
it back cost more than all of that (0.8 + 0.45 s of 3.4 s at 50k nodes, docs/design.md
§9.10), so here the core's view is read straight from the protobuf fields and the plan is
applied to a copy of the proto: the unchanged nodes are copied by protobuf, the casts are
spliced in, the initializers swapped.

This is a second ONNX adapter (DESIGN §1 has one, on onnx_ir), kept small by taking only
what it can do exactly as the onnx_ir adapter would: ``rewrite`` returns None, and the caller
takes the onnx_ir path, for anything else (the ``_why_not_*`` functions name the reason;
each is cheap to see). Its output equals the onnx_ir path's (same plan, nodes, names, initializers, types):
tests/onnx/test_flat.py holds it to that on the ONNX node-test corpus, the zoo and the
benchmark chains. The port groups come from the same cached ``ports.port_groups``, asked
once per signature through a stand-in onnx_ir node.
"""
from __future__ import annotations

import itertools
import logging
import math
import sys
from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from onnx import TensorProto

from amp_rewrite.core import (GroupInfo, LowDtype, PadPolicy, Precision, PrecisionGraph,
                              PrecisionPlan, RuleSet, plan_precision)
from amp_rewrite.core.runtime import Background
from amp_rewrite.onnx import io, versions
from amp_rewrite.onnx.apply import REASON_KEY, _convert, _Namer, joined_converted
from amp_rewrite.onnx.fusion import fusion_steps
from amp_rewrite.onnx.pad import MIN_OPSET
from amp_rewrite.onnx.passes import OnnxOptions, _warn_unmatched_patterns
from amp_rewrite.onnx.ports import (CONTROL_FLOW, INDEPENDENT_TYPE_VARS, PortGroup,
                                    to_ir_dtype)
from amp_rewrite.onnx.view import (_ADDEND_PORTS, _FIXED_GROUPS, INSERTED_TAG,
                                   SMALL_TENSOR_BYTES, SmallFloat32, _fits, _fixed_port_groups,
                                   range_problem)

logger = logging.getLogger(__name__)
LABEL = "<ModelProto>"
_DTYPES = {int(d): d for d in ir.DataType}
_FLOAT = ir.DataType.FLOAT
_GEMMS = ("MatMul", "Gemm", "Conv")
# Ops the onnx_ir path treats apart (casts it may remove, constants it converts in place,
# attributes it retypes, load-time attribute checks): not handled here.
# Default-domain ops with a subgraph attribute are among them (the checker holds every
# default-domain node to its schema's attributes).
_OTHER_PATH_OPS = frozenset({"Constant", "SequenceMap", *INDEPENDENT_TYPE_VARS, *io.DTYPE_OPS,
                             *CONTROL_FLOW})


@dataclass
class _Model:
    """The proto's main graph as plain Python: names, dtypes, producers and readers."""

    proto: onnx.ModelProto
    nodes: list[onnx.NodeProto]
    ops: list[str]
    names: list[str]  # node names
    inputs: list[list[str]]
    outputs: list[list[str]]
    opset: int
    graph_inputs: list[str]
    graph_outputs: list[str]
    initializers: dict[str, TensorProto]
    dtype: dict[str, ir.DataType] = field(default_factory=dict)
    # described values (graph inputs and outputs, value_info, initializers) -> TypeProto or
    # dims; a value absent here has no shape (its size comes from shape inference)
    shape: dict[str, object] = field(default_factory=dict)
    typed_at_load: set[str] = field(default_factory=set)
    producer: dict[str, int] = field(default_factory=dict)
    readers: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    sizes: dict[str, int | None] = field(default_factory=dict)  # inferred fp32 bytes
    small: SmallFloat32 | None = None  # small float32 initializers, joined


def rewrite(source: onnx.ModelProto, options: OnnxOptions,
            rules: RuleSet) -> onnx.ModelProto | None:
    """The rewritten model, or None where the onnx_ir path must do it (logged why)."""
    model, why = None, _why_not_model(source, options)
    if why is None:
        io._check_tensors(source, LABEL, None)  # the same ModelError as the onnx_ir path
        # The checker and shape inference: on the other core while the nodes are read.
        job = (Background(io._checked_and_inferred, source, LABEL, None)
               if len(source.graph.node) >= io.BACKGROUND_NODES else None)
        model, why = _read(source)
        why = why or _why_not_nodes(model, options) or _why_not_constants(model, options)
        if why is None:
            view = _View(model, options.dtype, options.keep_io_types)  # while the job runs
            why = _types(model, *(job.result() if job else
                                  io._checked_and_inferred(source, LABEL, None)))
        elif job is not None:
            job.cancel()
    if why is None:
        view.add_nodes()
        why = "an op does not admit the low dtype at this opset" if view.opset_limited else None
    if why is not None:
        logger.debug("onnx_ir path: %s", why)
        return None
    plan = plan_precision(view.graph, rules, keep_fp32=options.keep_fp32, pins={},
                          savings_weight=options.savings_weight, wide_values={})
    _warn_unmatched_patterns(options.keep_fp32, view)
    return _Applier(model, view, plan).output()


# ----------------------------------------------------------------------------- which models


def _why_not_model(proto: onnx.ModelProto, options: OnnxOptions) -> str | None:
    graph = proto.graph
    opsets = {}
    for o in proto.opset_import:
        if o.domain in opsets or o.domain not in ("",):
            return f"opset import {o.domain!r}"
        opsets[o.domain] = o.version
    if "" not in opsets:
        return "no default-domain opset"
    if options.pinned_values:
        return "calibration"
    if proto.functions or graph.sparse_initializer or not graph.node:
        return "functions, sparse initializers or no nodes"
    if sys.byteorder != "little":
        return "big-endian host"
    total = 0
    for t in graph.initializer:
        if t.data_location == TensorProto.EXTERNAL or (
                t.data_type == TensorProto.FLOAT and not t.HasField("raw_data")
                and math.prod(t.dims)):
            return f"initializer {t.name}: external or not raw data"
        total += len(t.raw_data)
    if total > io.PROTOBUF_LIMIT // 2:
        return "weights too large for one proto"
    return None


def _read(proto: onnx.ModelProto) -> tuple[_Model | None, str | None]:
    graph = proto.graph
    nodes = list(graph.node)
    model = _Model(proto, nodes, [n.op_type for n in nodes], [n.name for n in nodes],
                   [list(n.input) for n in nodes],
                   [list(n.output) for n in nodes], 0, [v.name for v in graph.input],
                   [v.name for v in graph.output], {t.name: t for t in graph.initializer})
    model.opset = next(o.version for o in proto.opset_import if o.domain == "")
    for v in (*graph.input, *graph.output, *graph.value_info):
        why = _describe(model, v)
        if why:
            return None, why
    names = set(model.initializers)
    if len(names) != len(graph.initializer) or names & set(model.graph_inputs):
        return None, "initializer names repeat or are graph inputs"
    for name, t in model.initializers.items():
        dtype = _DTYPES.get(t.data_type)
        if dtype is None or type(name) is not str:
            return None, f"initializer {name!r}"
        model.dtype[name], model.shape[name] = dtype, tuple(t.dims)
    model.typed_at_load = set(model.graph_outputs) | {v.name for v in graph.value_info}
    model.small = _small_float32(model.initializers)
    return model, None


def _describe(model: _Model, v: onnx.ValueInfoProto) -> str | None:
    t = v.type.tensor_type if v.type.HasField("tensor_type") else None
    dtype = _DTYPES.get(t.elem_type) if t is not None else None
    if dtype is None or not dtype or type(v.name) is not str or not v.name:
        return f"value {v.name!r}: not a typed tensor"
    if v.name in model.dtype:
        return f"value {v.name!r} described twice"
    model.dtype[v.name] = dtype
    if t.HasField("shape"):
        model.shape[v.name] = v.type
    return None


def _why_not_nodes(model: _Model, options: OnnxOptions) -> str | None:
    """One walk: names defined before use, no op of the other path's, no node text that is
    not UTF-8; then fusion and padding."""
    defined = set(model.graph_inputs) | set(model.initializers)
    producer, readers = model.producer, model.readers
    for i, node in enumerate(model.nodes):
        if node.domain or model.ops[i] in _OTHER_PATH_OPS:
            return f"node {i} ({node.domain}::{model.ops[i]})"
        if type(model.names[i]) is not str or type(node.doc_string) is not str:
            return f"node {i}: text that is not UTF-8"
        for j, name in enumerate(model.inputs[i]):
            if name:
                if name not in defined:
                    return f"node {i} reads {name!r} before it is defined"
                readers.setdefault(name, []).append((i, j))
        for name in model.outputs[i]:
            if not name or type(name) is not str or name in defined:
                return f"node {i}: output {name!r}"
            defined.add(name)
            producer[name] = i
    outputs = model.graph_outputs
    if len(set(outputs)) != len(outputs) or any(o not in producer for o in outputs):
        return "a graph output is repeated, or not a node's output"
    if any((name not in producer and name not in model.initializers) or name in outputs
           for name in model.typed_at_load - set(outputs)):
        return "value_info describes a graph input or output"
    return ((_fusion_candidates(model, options) if options.fuse else None)
            or (_padding_candidates(model, options) if options.pad else None))


def _fusion_candidates(model: _Model, options: OnnxOptions) -> str | None:
    """Why fusion might rewrite something: a step's anchor op is present (for Softmax, one
    feeding a MatMul, as ``fusion._softmax_feeds_matmul``)."""
    present = set(model.ops)
    for step in fusion_steps(options.target, model.opset):
        found = step.anchors & present
        if found and (found != {"Softmax"} or _softmax_feeds_matmul(model)):
            return f"fusion step {step.name} may apply"
    return None


def _softmax_feeds_matmul(model: _Model) -> bool:
    def readers(name: str) -> list[str]:
        return [model.ops[i] for i, _ in model.readers.get(name, ())]

    for i, op in enumerate(model.ops):
        if op == "Softmax":
            for j, _ in model.readers.get(model.outputs[i][0], ()):
                if model.ops[j] == "MatMul" or (
                        model.ops[j] == "Where" and "MatMul" in readers(model.outputs[j][0])):
                    return True
    return False


def _padding_candidates(model: _Model, options: OnnxOptions) -> str | None:
    """Why padding might pad something (``pad.pad_model``'s first look, taken as if every
    GEMM/conv ran low): a weight with a misaligned dim, a MatMul of two activations, or a
    weight behind a Transpose (``pad.is_constant``)."""
    if model.opset < MIN_OPSET:
        return None
    policy = options.pad_policy or PadPolicy()
    for i, op in enumerate(model.ops):
        if op not in _GEMMS:
            continue
        weights = [n for n in model.inputs[i][:2] if n in model.initializers]
        if op == "MatMul" and not weights and policy.pad_activation_gemms:
            return f"node {i}: a MatMul of two activations"
        for name in model.inputs[i][:2]:
            dims = model.shape.get(name) if name in model.initializers else None
            if dims is not None and len(dims) >= 2 and any(
                    d % policy.multiple for d in (dims[:2] if op == "Conv" else dims[-2:])):
                return f"node {i}: weight {name} has a misaligned dim"
            p = model.producer.get(name)
            if p is not None and model.ops[p] == "Transpose":
                return f"node {i}: weight behind a Transpose"
    return None


def _types(model: _Model, error: str | None, facts: dict | str) -> str | None:
    """Node output dtypes (and sizes) as loading gives them (``io._with_inferred_facts``);
    why not, where the checker refuses the model or a dtype stays unknown."""
    if error is not None:
        return "the checker refuses the model (the onnx_ir path repairs or reports it)"
    outputs = [name for names in model.outputs for name in names]
    if all(name in model.dtype for name in outputs):
        return None  # as loading: inferred sizes are used only where a dtype was missing
    if isinstance(facts, str):
        return "shape inference failed"
    for name in outputs:
        if name in model.shape:
            continue
        fact = facts.get(name)
        if fact is None:
            if name not in model.dtype:
                return f"no dtype for {name!r}"
            continue
        if name not in model.dtype:
            model.dtype[name] = fact[0]
        model.sizes[name] = fact[1]
    return None


def _why_not_constants(model: _Model, options: OnnxOptions) -> str | None:
    """A float32 initializer the low dtype cannot hold (``view._range_problems``): the
    onnx_ir path keeps it and its readers fp32 (or clamps it, on request)."""
    small, low = model.small, options.dtype
    if small.values:
        fits = _fits(np.maximum.reduceat(np.abs(small.data), small.starts[:-1]), low)
        for i in np.flatnonzero(~fits):
            name = small.values[i]
            if range_problem(small.data[small.starts[i]:small.starts[i + 1]], low,
                             addend=_only_summed(model, name)):
                return f"initializer {name} does not fit {low.value}"
    for name, t in model.initializers.items():
        if t.data_type == TensorProto.FLOAT and name not in small.index:
            array = _float32(t)
            if not (array.size and _fits(max(float(array.max()), -float(array.min())), low)) \
                    and range_problem(array, low, addend=_only_summed(model, name)):
                return f"initializer {name} does not fit {low.value}"
    return None


def _only_summed(model: _Model, name: str) -> bool:
    """``view.only_summed`` (an initializer is never a graph output here)."""
    uses = model.readers.get(name, ())
    return bool(uses) and all(j in _ADDEND_PORTS.get(("", model.ops[i]), ()) for i, j in uses)


def _float32(t: TensorProto) -> np.ndarray:
    return np.frombuffer(t.raw_data, "<f4").reshape(tuple(t.dims))


def _small_float32(initializers: dict[str, TensorProto]) -> SmallFloat32:
    """``view._small_float32`` of the proto's initializers, by name."""
    return SmallFloat32.joined([(name, t.raw_data) for name, t in initializers.items()
                                if t.data_type == TensorProto.FLOAT and t.raw_data
                                and len(t.raw_data) <= SMALL_TENSOR_BYTES])


# ----------------------------------------------------------------------------------- view


class _View:
    """The core's graph, built as ``view.build_view`` builds it (same order, same sizes), with
    value names as value keys and ints as group keys (numbered in order; the plan depends on
    the order only, and a tuple key is hashed anew at each of the planner's lookups).

    Built in two steps: the graph inputs and initializers (values and sources) need no node
    output dtype, so they are added while shape inference runs on the other core; then
    ``add_nodes``. The graph keeps values and groups in separate dicts, so each dict gets
    ``build_view``'s order all the same."""

    def __init__(self, model: _Model, low: LowDtype, keep_io: bool) -> None:
        self.model, self.low, self.low_ir = model, low, to_ir_dtype(low)
        self.keep_io = keep_io
        self.graph = PrecisionGraph()
        self.groups: dict[int, tuple[int, PortGroup]] = {}
        self.sources: dict[int, str] = {}
        self.sinks: dict[int, int] = {}
        self.opset_limited = False
        self._keys = itertools.count()
        self._add_values([*model.graph_inputs, *model.initializers])
        self._add_sources(keep_io)

    def add_nodes(self) -> _View:
        """Node outputs, nodes and graph outputs (once every node output has its dtype)."""
        self._add_values([o for outs in self.model.outputs for o in outs])
        self._add_nodes()
        self._add_sinks(self.keep_io)
        return self

    def candidate(self, name: str) -> bool:
        return self.model.dtype.get(name) in (_FLOAT, self.low_ir)

    def _current(self, name: str) -> Precision:
        return Precision.LOW if self.model.dtype[name] == self.low_ir else Precision.HIGH

    def _add_values(self, names: list[str]) -> None:
        graph, candidate = self.graph, {_FLOAT, self.low_ir}
        dtype_of, add_value, has_value = self.model.dtype.get, graph.add_value, graph.has_value
        for name in names:
            if dtype_of(name) in candidate and not has_value(name):
                add_value(name, name=name, nbytes=self._nbytes(name))

    def _nbytes(self, name: str) -> int | None:
        shape = self.model.shape.get(name)
        if shape is None:
            return self.model.sizes.get(name)
        if isinstance(shape, onnx.TypeProto):
            dims = [d.dim_value if d.HasField("dim_value") else io.SYMBOLIC_DIM_EXTENT
                    for d in shape.tensor_type.shape.dim]
        else:
            dims = shape
        return max(4 * math.prod(dims), 4)

    def _add_sources(self, keep_io: bool) -> None:
        m = self.model
        for name in m.graph_inputs:
            if self.candidate(name):
                current = self._current(name)
                fixed = current if keep_io or current is Precision.LOW else None
                self._source(name, fixed, "graph input keeps its dtype (keep_io_types)")
        for name in m.initializers:
            if self.candidate(name):
                low = m.dtype[name] == self.low_ir
                self._source(name, Precision.LOW if low else None,
                             "initializer already low in the model")

    def _source(self, name: str, fixed: Precision | None, reason: str) -> None:
        key = next(self._keys)
        self.sources[key] = name
        self.graph.add_source(key, name, name=name, fixed=fixed, reason=reason if fixed else "")

    def _add_nodes(self) -> None:
        m, low, low_ir = self.model, self.low, self.low_ir
        dtype_of, add_group, groups, keys = m.dtype.get, self.graph.add_group, self.groups, \
            self._keys
        by_ports: dict[tuple, tuple] = {}  # (op, input dtypes, output dtypes) -> fixed groups
        for i, op in enumerate(m.ops):
            ins, outs = m.inputs[i], m.outputs[i]
            ports = (op, tuple(map(dtype_of, ins)), tuple(map(dtype_of, outs)))
            fixed_groups = by_ports.get(ports)
            if fixed_groups is None:
                fixed_groups = by_ports[ports] = self._fixed_groups(*ports)
            name = m.names[i]
            for pg, fixed, reason in fixed_groups:
                key = next(keys)
                groups[key] = (i, pg)
                add_group(GroupInfo(key, i, name, op, fixed, reason, None, pg.saves_traffic,
                                    pg.label),
                          inputs=[ins[j] for j in pg.inputs], outputs=[outs[o] for o in pg.outputs])

    def _fixed_groups(self, op: str, ins: tuple, outs: tuple) -> tuple:
        """``view._fixed_port_groups`` of a node with these port dtypes (shared cache)."""
        if not {_FLOAT, self.low_ir} & {*ins, *outs}:
            return ()
        sig = ("", op, self.model.opset, self.low, ins, outs)
        fixed_groups = _FIXED_GROUPS.get(sig)
        if fixed_groups is None:
            fixed_groups = _fixed_port_groups(_stand_in(sig), self.model.opset, self.low,
                                              self.low_ir)
        self.opset_limited |= any(pg.opset_limited for pg, _, _ in fixed_groups)
        return fixed_groups

    def _add_sinks(self, keep_io: bool) -> None:
        for i, name in enumerate(self.model.graph_outputs):
            if self.candidate(name):
                key = next(self._keys)
                self.sinks[key] = i
                fixed = self._current(name) if keep_io else None
                self.graph.add_sink(key, name, name=f"output:{name}", fixed=fixed,
                                    reason="graph output keeps its dtype" if fixed else "")


def _stand_in(sig: tuple) -> ir.Node:
    """An onnx_ir node with ``sig``'s op and port dtypes, to ask ``ports`` once per
    signature (its answers depend on nothing else)."""
    domain, op, _, _, ins, outs = sig

    def value(k: str, dtype) -> ir.Value | None:
        return None if dtype is None else ir.Value(name=k, type=ir.TensorType(dtype))

    return ir.Node(domain, op, [value(f"i{k}", d) for k, d in enumerate(ins)],
                   outputs=[value(f"o{k}", d) for k, d in enumerate(outs)])


# ---------------------------------------------------------------------------------- apply


@dataclass
class _Cast:
    key: tuple  # ("cast", k): the output's id until names are final
    source: str  # the value cast
    to: ir.DataType
    name: str  # the node's name
    reason: str


class _Applier:
    """``apply.apply_plan`` + ``passes._forget_load_time_types`` on the proto: the same
    names, node order and types. Values are ids (their original name, or a cast's key)
    until the end, because a cast that feeds a graph output takes the output's name."""

    def __init__(self, model: _Model, view: _View, plan: PrecisionPlan) -> None:
        self.model, self.view, self.plan = model, view, plan
        self.low_ir = view.low_ir
        self.dtype = dict(model.dtype)  # after the rewrite
        self.names: dict[Hashable, str] = {}  # id -> final name, where it differs
        self.rewired: dict[int, list] = {}  # node -> its input ids
        self.converted: dict[str, TensorProto] = {}  # initializers converted, by name
        self.copies: list[TensorProto] = []
        self.casts: dict[int, list[_Cast]] = {}  # after node i (-1: first), newest first
        self.outputs: dict[int, Hashable] = {}  # graph output index -> new id
        self.described: dict[Hashable, str] = {}  # new typed values -> shape source
        self.templates: dict[tuple, onnx.NodeProto] = {}  # (to, reason) -> Cast template
        namer_names = [*model.graph_inputs, *model.initializers]
        self.namer = _Namer(namer_names + [o for outs in model.outputs for o in outs if o])

    def output(self) -> onnx.ModelProto:
        low = self.low_ir
        with np.errstate(over="ignore"):
            self._retype()
            self._convert_sources()
            for k, cast in enumerate(self.plan.casts):
                self._insert(k, cast.value, low if cast.to is Precision.LOW else _FLOAT, cast)
        return self._proto()

    # -- plan -> ids ----------------------------------------------------------------------
    def _retype(self) -> None:
        decisions, low, dtype, outputs = self.plan.decisions, self.low_ir, self.dtype, \
            self.model.outputs
        for key, (i, pg) in self.view.groups.items():
            target = low if decisions[key].precision is Precision.LOW else _FLOAT
            for o in pg.outputs:
                dtype[outputs[i][o]] = target

    def _convert_sources(self) -> None:
        decisions, low, initializers = self.plan.decisions, self.low_ir, self.model.initializers
        picked = [name for key, name in self.view.sources.items()
                  if decisions[key].precision is Precision.LOW and self.dtype[name] != low]
        self.converted = self._small_converted([n for n in picked if n in initializers])
        for name in picked:
            if name in initializers and name not in self.converted:
                self.converted[name] = _tensor(name, _convert(self._array(name), low)[0])
            self.dtype[name] = low

    def _small_converted(self, names: list[str]) -> dict[str, TensorProto]:
        small, initializers = self.model.small, self.model.initializers
        return joined_converted(small, [(name, small.index[name], initializers[name].dims)
                                        for name in names if name in small.index], self.low_ir)

    def _array(self, name: str) -> np.ndarray:
        """An initializer's current data (converted, once it is)."""
        t = self.converted[name] if name in self.converted else self.model.initializers[name]
        if t.data_type == TensorProto.FLOAT and t.raw_data:
            return _float32(t)
        return onnx.numpy_helper.to_array(t)

    def _insert(self, k: int, value: str, target: ir.DataType, cast) -> None:
        suffix = "f32" if target == _FLOAT else target.name.lower()
        name = self.namer(f"{value}_{suffix}")
        if value in self.model.initializers:  # a converted copy, as apply._constant_copy
            array = _convert(self._array(value), target)[0]
            self.copies.append(_tensor(name, array))
            new: Hashable = name
        else:
            new = ("cast", k)
            self.names[new] = name
            producer = self.model.producer.get(value, -1)
            reason = (f"{len(cast.consumers)} consumer(s) need {cast.to.value} precision "
                      "(exact min-cut placement)")
            self.casts.setdefault(producer, []).insert(0, _Cast(new, value, target,
                                                                f"amp_cast_{name}", reason))
            if value in self.model.typed_at_load or value in self.model.graph_inputs:
                self.described[new] = value
        self.dtype[new] = target
        for key in cast.consumers:
            self._rewire(key, value, new)

    def _rewire(self, key, old: str, new: Hashable) -> None:
        if key in self.view.sinks:
            index = self.view.sinks[key]
            outer = self.name(old)
            self.names[old] = self.namer(f"{outer}_{self.dtype[old].name.lower()}")
            self.names[new] = outer
            self.described[old] = old  # typed at load: keeps its type, now as value_info
            self.outputs[index] = new
            return
        i, pg = self.view.groups[key]
        inputs = self.rewired.setdefault(i, list(self.model.inputs[i]))
        for j in pg.inputs:
            if inputs[j] == old:
                inputs[j] = new

    def name(self, value: Hashable) -> str:
        return self.names.get(value, value)

    # -- ids -> proto ---------------------------------------------------------------------
    def _proto(self) -> onnx.ModelProto:
        source = self.model.proto
        out = onnx.ModelProto()
        out.CopyFrom(source)
        graph = out.graph
        del graph.node[:]
        self._write_nodes(graph.node)
        converted = self.converted
        if converted or self.copies:
            del graph.initializer[:]
            graph.initializer.extend([converted.get(t.name, t) for t in source.graph.initializer]
                                     + self.copies)
        self._types(graph)
        out.ir_version = versions.lowest_ir_version_for(
            source.ir_version, {o.domain: o.version for o in source.opset_import}, self._dtypes)
        return out

    def _write_nodes(self, out: RepeatedCompositeFieldContainer) -> None:
        """The nodes in order, casts spliced in; untouched ones copied in runs (one call)."""
        touched = set(self.rewired)
        for v in self.names:
            if isinstance(v, str):  # an original value renamed: its producer and readers
                touched.add(self.model.producer[v])
                touched.update(i for i, _ in self.model.readers.get(v, ()))
        run: list[onnx.NodeProto] = []
        for cast in self.casts.get(-1, ()):
            self._add_cast(out, cast)
        for i, node in enumerate(self.model.nodes):
            casts = self.casts.get(i)
            if i not in touched and not casts:
                run.append(node)
                continue
            out.extend(run)
            run.clear()
            if i in touched:
                self._add_renamed(out, i, node)
            else:
                out.append(node)
            for cast in casts or ():
                self._add_cast(out, cast)
        out.extend(run)

    def _add_renamed(self, out: RepeatedCompositeFieldContainer, i: int,
                     node: onnx.NodeProto) -> None:
        copy = out.add()
        copy.CopyFrom(node)
        inputs = self.rewired.get(i, self.model.inputs[i])
        for j, v in enumerate(inputs):
            copy.input[j] = self.name(v) if v else v
        for j, v in enumerate(self.model.outputs[i]):
            copy.output[j] = self.name(v)

    def _add_cast(self, out: RepeatedCompositeFieldContainer, cast: _Cast) -> None:
        node = out.add()
        node.CopyFrom(self._cast_template(cast.to, cast.reason))
        node.input.append(self.name(cast.source))
        node.output.append(self.name(cast.key))
        node.name = cast.name

    def _cast_template(self, to: ir.DataType, reason: str) -> onnx.NodeProto:
        """A Cast with its attribute and metadata (``apply._cast_node``'s), no names:
        copying it is cheaper than building each cast's fields anew."""
        node = self.templates.get((to, reason))
        if node is None:
            node = self.templates[to, reason] = onnx.helper.make_node("Cast", [], [], to=int(to))
            for key, value in ((INSERTED_TAG, "cast"), (REASON_KEY, reason)):
                node.metadata_props.add(key=key, value=value)
        return node

    def _types(self, graph: onnx.GraphProto) -> None:
        """Graph inputs, outputs and value_info with the dtypes after the rewrite; a value
        typed at load keeps a description, so do its casts (``passes._forget_load_time_types``
        drops the others)."""
        dtype = self.dtype
        for v in graph.input:
            v.type.tensor_type.elem_type = int(dtype[v.name])
        for v in graph.value_info:
            v.type.tensor_type.elem_type = int(dtype[v.name])
            v.name = self.name(v.name)
        for index, v in enumerate(graph.output):
            new = self.outputs.get(index, v.name)
            v.type.tensor_type.elem_type = int(dtype[new])
        outputs = {v.name: v for v in self.model.proto.graph.output}
        now_outputs = set(self.outputs.values())
        for new, source in self.described.items():
            if new in now_outputs:
                continue
            info = graph.value_info.add(name=self.name(new))
            shape = self.model.shape.get(source)
            if isinstance(shape, onnx.TypeProto):
                info.type.CopyFrom(shape)
            elif source in outputs:
                info.type.CopyFrom(outputs[source].type)
            info.type.tensor_type.elem_type = int(dtype[new])

    def _dtypes(self) -> set[ir.DataType]:
        """The element types the output uses (``versions._model_dtypes``)."""
        typed = set(self.model.graph_inputs) | set(self.model.initializers)
        typed |= self.model.typed_at_load
        return ({self.dtype[v] for v in typed} | {c.to for cs in self.casts.values() for c in cs}
                | {_DTYPES[t.data_type] for t in self.copies})


def _tensor(name: str, array: np.ndarray) -> TensorProto:
    """As ``apply._stored_tensor`` stores it (raw little-endian data)."""
    return TensorProto(name=name, dims=array.shape, raw_data=array.tobytes(),
                       data_type=int(ir.DataType.from_numpy(array.dtype)))
