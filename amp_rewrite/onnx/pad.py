"""Pad low-precision GEMM/conv dims to multiples of 8 in an onnx_ir model (docs/design.md §8), in place.

Runs after ``apply``: builds the core's pad graph from the main graph, plans
(``core.padding``), then gives every read the layout the plan asks for:

* a weight initializer is padded once, in place when every other reader is a ``Gather`` of
  the padded axis (tied embeddings), else as a padded copy;
* an activation read padded but produced unpadded: one ``Pad`` per (value, layout);
* a value produced padded but read unpadded: one ``Slice``; graph outputs keep their shapes.

A symbolic dim named by a graph input is padded by a runtime amount (Shape/Gather/Mod/Sub);
other symbolic dims are not padded, nor are subgraphs. A second run changes nothing.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from amp_rewrite.core.padding import (AxisPad, PadGraph, PadInput, PadKind, PadOp,
                                      PaddingPlan, PadPolicy, PadValue, is_aligned,
                                      padding_report, plan_padding)
from amp_rewrite.onnx.apply import REASON_KEY, _Namer, insert_after_producer
from amp_rewrite.onnx.view import INSERTED_TAG

logger = logging.getLogger(__name__)

_LOW = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
MIN_OPSET = 13  # Pad/Slice with tensor inputs and bfloat16 support

# op type -> per-input (fill, may_vary); None: every input (0.0, True)
_POINTWISE: dict[str, tuple[tuple[float, bool], ...] | None] = {
    op: None for op in ("Relu", "LeakyRelu", "Gelu", "Tanh", "Sigmoid", "Erf", "Add", "Sub",
                        "Mul", "Neg", "Abs", "Cast", "Identity", "HardSigmoid", "HardSwish",
                        "Elu", "Selu", "Celu", "Softsign", "PRelu", "Clip")
}
_POINTWISE["Div"] = ((0.0, True), (1.0, False))  # never divide by a padded value
_CONTRIB = {"FastGelu", "BiasGelu", "QuickGelu", "Gelu"}  # com.microsoft, finite-safe


@dataclass
class PadStats:
    """What the pad step changed; ``modified`` is derived from it."""

    weights_padded: int = 0
    weights_padded_in_place: int = 0
    pads_inserted: int = 0
    slices_inserted: int = 0
    plan: PaddingPlan | None = None

    @property
    def modified(self) -> bool:
        return bool(self.weights_padded or self.pads_inserted or self.slices_inserted)


def pad_model(model: ir.Model, policy: PadPolicy | None = None,
              low: tuple[ir.DataType, ...] = _LOW,
              concat_dtypes: tuple[ir.DataType, ...] = ()) -> PadStats:
    """Plan and apply padding to ``model``'s main graph; ``low``: output dtypes that make a
    GEMM/conv eligible; ``concat_dtypes``: activations of these dtypes are padded by Concat
    with a filled block instead of ``Pad`` (a runtime without their Pad kernel)."""
    stats = PadStats(plan=PaddingPlan.empty(policy))
    if model.opset_imports.get("", 0) < MIN_OPSET:
        logger.info("padding skipped: opset < %d", MIN_OPSET)
        return stats
    graph = model.graph
    policy = policy or PadPolicy()
    gemms = _low_gemms(graph, low)  # one walk for both looks below
    if not _misaligned_weights(gemms, policy.multiple) and not (
            policy.pad_activation_gemms and _activation_gemms(gemms)):
        return stats  # nothing a plan could pad: skip the shape inference below
    if _needs_shapes(gemms):
        # Loading keeps inferred dtypes and sizes, not shapes (load._add_inferred_facts); the
        # plan needs the shapes around GEMMs/convs, so infer them once more, only here.
        ir.passes.common.ShapeInferencePass(strict_mode=False)(model)
    stats.plan = plan_padding(build_pad_graph(graph, low), policy, runtime_pads=True)
    if not stats.plan.is_empty():
        _Applier(graph, stats.plan, stats, concat_dtypes).run()
    return stats


# ----------------------------------------------------------------------------- view

_GEMMS = ("MatMul", "Gemm", "Conv")
_GRAPH_OUTPUTS = "amp_rewrite.graph_outputs"  # key of the pad graph's output reader


def _low_gemms(graph: ir.Graph, low: tuple[ir.DataType, ...]) -> list[ir.Node]:
    """The graph's GEMMs/convs that compute in a low dtype."""
    return [n for n in graph if n.op_type in _GEMMS and n.domain == ""
            and n.outputs[0].dtype in low]


def _misaligned_weights(gemms: list[ir.Node], multiple: int) -> bool:
    """Whether some low GEMM/conv has a weight with a misaligned static K/N/channel dim: a
    cheap look that decides, without ``pad_activation_gemms``, whether planning can pad."""
    for n in gemms:
        for w in n.inputs[:2]:
            if w is not None and w.shape is not None and is_constant(w) and len(w.shape) >= 2:
                dims = w.shape[:2] if n.op_type == "Conv" else w.shape[-2:]
                if any(isinstance(d, int) and d % multiple for d in dims):
                    return True
    return False


def _activation_gemms(gemms: list[ir.Node]) -> bool:
    """Whether some low MatMul multiplies two activations (attention): its token dims are
    only known after shape inference."""
    return any(n.op_type == "MatMul" and not any(v is not None and is_constant(v)
                                                 for v in n.inputs)
               for n in gemms)


def _needs_shapes(gemms: list[ir.Node]) -> bool:
    return any(v is not None and v.shape is None
               for n in gemms for v in (*n.inputs, *n.outputs))


def _shape(value: ir.Value, symbols: dict[str, tuple[ir.Value, int]]) -> tuple | None:
    """Static dims as ints, symbols a graph input names (or already rounded up) as str,
    any other dim None (unknown: no runtime size to pad it by)."""
    if value.shape is None:
        return None
    return tuple(d if isinstance(d, int) else
                 d.value if d.value in symbols or is_aligned(d.value, 8) else None
                 for d in value.shape)


def input_symbols(graph: ir.Graph) -> dict[str, tuple[ir.Value, int]]:
    """Symbolic dim name -> (graph input, axis) that carries its runtime size."""
    symbols: dict[str, tuple[ir.Value, int]] = {}
    for value in graph.inputs:
        for axis, d in enumerate(value.shape or ()):
            if not isinstance(d, int) and d.value is not None:
                symbols.setdefault(d.value, (value, axis))
    return symbols


def _add_value(g: PadGraph, value: ir.Value, symbols: dict) -> None:
    if value in g.values:
        return
    g.add_value(PadValue(value, value.name or "", _shape(value, symbols), is_constant(value),
                         _element_bytes(value.dtype)))


def _element_bytes(dtype: ir.DataType | None) -> int:
    """Bytes per element; 4 (as fp32) for a type of no fixed size (strings) or none at all
    (a graph output declared UNDEFINED, which the rewrite types from inference)."""
    try:
        return int(dtype.itemsize) if dtype is not None else 4
    except TypeError:  # onnx_ir: "Bitwidth not available"
        return 4


def build_pad_graph(graph: ir.Graph, low: tuple[ir.DataType, ...] = _LOW) -> PadGraph:
    """The core's pad graph of ``graph`` (main graph only)."""
    g = PadGraph()
    symbols = input_symbols(graph)
    for node in graph:
        for v in (*node.inputs, *node.outputs):
            if v is not None:
                _add_value(g, v, symbols)
        g.add_op(_pad_op(node, low))
    # the graph outputs as one opaque reader: a padded output needs its Slice (cost model)
    outputs = tuple(v for v in graph.outputs if v in g.values)
    g.add_op(PadOp(_GRAPH_OUTPUTS, "graph outputs", PadKind.OPAQUE, outputs, ()))
    return g


def _pad_op(node: ir.Node, low_dtypes: tuple[ir.DataType, ...]) -> PadOp:
    inputs = tuple(v for v in node.inputs if v is not None)
    outputs = tuple(node.outputs)
    base = PadOp(node, node.name or node.op_type, PadKind.OPAQUE, inputs, outputs)
    out = node.outputs[0] if node.outputs else None
    if out is None or (node.domain not in ("", "com.microsoft")):
        return base
    low = out.dtype in low_dtypes
    op_type = node.op_type
    if node.domain == "" and op_type == "MatMul":
        return _matmul(base, node, low)
    if node.domain == "" and op_type == "Gemm":
        return _gemm(base, node, low)
    if node.domain == "" and op_type == "Conv":
        return _conv(base, node, low)
    if node.domain == "" and op_type == "BatchNormalization" and len(node.outputs) == 1:
        return _pointwise(base, node, ((0.0, True),) + ((0.0, True),) * 3 + ((1.0, True),),
                          offsets=(0, 1, 1, 1, 1))
    if node.domain == "" and op_type == "Pow" and _non_negative_constant(node.inputs[1]):
        return _pointwise(base, node, ((0.0, True), (1.0, False)))
    if (node.domain == "" and op_type in _POINTWISE) or (
            node.domain == "com.microsoft" and op_type in _CONTRIB):
        return _pointwise(base, node, _POINTWISE.get(op_type))
    return base


def _non_negative_constant(value: ir.Value | None) -> bool:
    """Pow's exponent: x**c with constant c >= 0 maps 0 and other finite values to finite
    ones (GPT-2's spelled-out tanh GELU has x**3)."""
    if value is None or not is_constant(value):
        return False
    return bool((_constant_array(value).astype(np.float64) >= 0).all())


def _rank(value: ir.Value | None) -> int | None:
    return len(value.shape) if value is not None and value.shape is not None else None


def _matmul(base: PadOp, node: ir.Node, low: bool) -> PadOp:
    a, b = node.inputs[0], node.inputs[1]
    if (_rank(a) or 0) < 2 or (_rank(b) or 0) < 2:
        return base  # 1-D operands have no K/N layout to pad
    y = node.outputs[0]
    return base._replace(kind=PadKind.GEMM, low=low, k_axes=((a, -1), (b, -2)),
                         n_axes=((b, -1), (y, -1)))


def _gemm(base: PadOp, node: ir.Node, low: bool) -> PadOp:
    a, b = node.inputs[0], node.inputs[1]
    c = node.inputs[2] if len(node.inputs) > 2 else None
    trans_a = node.attributes.get_int("transA", 0)
    trans_b = node.attributes.get_int("transB", 0)
    y = node.outputs[0]
    n_axes = ((b, 0 if trans_b else 1), (y, 1))
    if c is not None and c.shape is not None and len(c.shape) and c.shape[-1] != 1:
        n_axes += ((c, -1),)  # a bias of 1 along N broadcasts: nothing to pad
    return base._replace(kind=PadKind.GEMM, low=low, k_axes=((a, 0 if trans_a else 1),
                                                             (b, 1 if trans_b else 0)),
                         n_axes=n_axes)


def _conv(base: PadOp, node: ir.Node, low: bool) -> PadOp:
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else None
    y = node.outputs[0]
    n_axes = ((w, 0), (y, 1)) + (((bias, 0),) if bias is not None else ())
    return base._replace(kind=PadKind.CONV, low=low, k_axes=((x, 1), (w, 1)), n_axes=n_axes,
                         groups=node.attributes.get_int("group", 1))


def _pointwise(base: PadOp, node: ir.Node, specs, offsets=None) -> PadOp:
    out_rank = _rank(node.outputs[0])
    if out_rank is None or len(node.outputs) != 1:
        return base
    inputs = []
    for i, v in enumerate(node.inputs):
        if v is None:
            continue
        rank = _rank(v)
        if rank is None:
            return base
        fill, may_vary = specs[i] if specs is not None and i < len(specs) else (0.0, True)
        offset = offsets[i] if offsets is not None else out_rank - rank
        inputs.append(PadInput(v, offset, fill, may_vary))
    return base._replace(kind=PadKind.POINTWISE, pointwise=tuple(inputs), finite_safe=True)


# ----------------------------------------------------------------------------- apply


class _Applier:
    """Gives each read the layout the plan asks for (module docstring)."""

    def __init__(self, graph: ir.Graph, plan: PaddingPlan, stats: PadStats,
                 concat_dtypes: tuple[ir.DataType, ...] = ()) -> None:
        self.graph, self.plan, self.stats = graph, plan, stats
        self.concat_dtypes = concat_dtypes  # padded by Concat, not Pad (``_concat_zeros``)
        self.namer = _Namer.of_graphs([graph])
        self.versions: dict[tuple[ir.Value, tuple[AxisPad, ...]], ir.Value] = {}
        self.symbols = input_symbols(graph)
        self.symbol_sizes: dict[str, ir.Value] = {}

    def run(self) -> None:
        reads = self._reads_to_change()
        outputs = [i for i, v in enumerate(self.graph.outputs) if v in self.plan.produced]
        self._retype_produced()
        for node, index, value, pads in reads:
            node.replace_input_with(index, self._version(value, pads))
        for i in outputs:
            self._slice_graph_output(i)

    def _reads_to_change(self) -> list[tuple[ir.Node, int, ir.Value, tuple[AxisPad, ...]]]:
        """Every (node, input index) whose wanted layout differs from the produced one."""
        todo = []
        candidates = {v for _, v in self.plan.reads} | set(self.plan.produced)
        for value in candidates:
            have = self._have(value)
            for use in list(value.uses()):
                want = self.plan.reads.get((use.node, value), ())
                if want != have:
                    todo.append((use.node, use.idx, value, want))
        return todo

    def _have(self, value: ir.Value) -> tuple[AxisPad, ...]:
        pad = self.plan.produced.get(value)
        return (pad,) if pad is not None else ()

    def _retype_produced(self) -> None:
        for value, pad in self.plan.produced.items():
            value.shape = _padded_shape(value.shape, (pad,))

    def _version(self, value: ir.Value, pads: tuple[AxisPad, ...]) -> ir.Value:
        key = (value, pads)
        if key not in self.versions:
            base = self._unpadded(value)
            if not pads:
                self.versions[key] = base
            elif is_constant(value):
                self.versions[key] = self._padded_weight(value, pads)
            else:
                self.versions[key] = self._pad_node(base, pads)
        return self.versions[key]

    def _unpadded(self, value: ir.Value) -> ir.Value:
        have = self._have(value)
        if not have:
            return value
        key = (value, ())
        if key not in self.versions:
            self.versions[key] = self._slice_node(value, have[0])
        return self.versions[key]

    # -- weights ---------------------------------------------------------------------------
    def _padded_weight(self, value: ir.Value, pads: tuple[AxisPad, ...]) -> ir.Value:
        """A weight (or a Transpose/Cast of one) padded once: in place when its other
        readers allow (tied embeddings), else as a folded, padded initializer copy."""
        self.stats.weights_padded += 1
        if self._pads_in_place(value, pads):
            self._pad_in_place(value, pads)
            self.stats.weights_padded_in_place += 1
            return value
        return self._initializer(f"{value.name}_pad{self.plan.policy.multiple}",
                                 _padded_array(_constant_array(value), pads))

    def _pads_in_place(self, value: ir.Value, pads: tuple[AxisPad, ...]) -> bool:
        """Every reader wants these pads, gathers rows along the only padded axis, or is a
        Transpose/Cast whose output may itself be padded in place."""
        if value.is_graph_input() or value.is_graph_output():
            return False
        axes = {p.axis for p in pads}
        for use in value.uses():
            node = use.node
            if self.plan.reads.get((node, value), ()) == pads:
                continue
            if node.op_type == "Gather" and node.domain == "" and use.idx == 0:
                if axes == {node.attributes.get_int("axis", 0) % len(value.shape)}:
                    continue
                return False
            if _chain_step(node) is None or node.graph is not self.graph:
                return False
            if not self._pads_in_place(node.outputs[0], _through(node, pads)):
                return False
        return True

    def _pad_in_place(self, value: ir.Value, pads: tuple[AxisPad, ...]) -> None:
        """Pad the initializer at the root of ``value``'s chain; retype the chain."""
        producer = value.producer()
        if producer is not None:
            self._pad_in_place(producer.inputs[0], _through(producer, pads, back=True))
        else:
            array = _padded_array(value.const_value.numpy(), pads)
            value.const_value = ir.Tensor(array, name=value.name)
        value.shape = _padded_shape(value.shape, pads)

    # -- runtime nodes ---------------------------------------------------------------------
    def _initializer(self, base: str, array: np.ndarray) -> ir.Value:
        name = self.namer(base)
        value = ir.val(name, const_value=ir.Tensor(array, name=name))
        self.graph.register_initializer(value)
        return value

    def _int64(self, base: str, values: list[int]) -> ir.Value:
        return self._initializer(base, np.array(values, dtype=np.int64))

    def _pad_node(self, value: ir.Value, pads: tuple[AxisPad, ...]) -> ir.Value:
        rank = len(value.shape)
        widths = [0] * (2 * rank)
        for p in pads:
            if isinstance(p.size, int):
                widths[rank + p.axis] = p.padded - p.size
        nodes: list[ir.Node] = []
        amounts = self._pad_amounts(nodes, value, widths,
                                    [p for p in pads if isinstance(p.size, str)])
        out = ir.Value(name=self.namer(f"{value.name}_padded"), type=value.type,
                       shape=_padded_shape(value.shape, pads))
        tags = {INSERTED_TAG: "pad", REASON_KEY: _why(pads)}
        if self.concat_dtypes and value.dtype in self.concat_dtypes:
            self._concat_zeros(nodes, value, pads, amounts, out, tags)
        else:
            fill = self._initializer(f"{value.name}_padfill",
                                     np.array(pads[0].fill, dtype=value.dtype.numpy()))
            nodes.append(ir.Node("", "Pad", [value, amounts, fill], outputs=[out],
                                 name=f"amp_pad_{out.name}", metadata_props=tags))
        self._insert_after(value, nodes)
        self.stats.pads_inserted += 1
        return out

    def _concat_zeros(self, nodes: list[ir.Node], value: ir.Value, pads: tuple[AxisPad, ...],
                      amounts: ir.Value, out: ir.Value, tags: dict[str, str]) -> None:
        """``Pad`` written as a Concat of ``value`` and a filled block per padded axis, for
        dtypes whose Pad kernel a runtime lacks (onnxruntime's CUDA provider has no bf16 Pad;
        Shape, ScatterElements, Expand and Concat it has, and their schemas admit bf16 from
        opset 13, as Pad's does). The block is the fill expanded to ``value``'s shape at run
        time with the axis set to its pad amount (``amounts[rank + axis]``)."""
        rank = len(value.shape)
        current = value
        for i, p in enumerate(sorted(pads, key=lambda p: p.axis)):
            at = rank + p.axis
            width = self._node(nodes, "Slice", [amounts, self._int64("amp_axis", [at]),
                                                self._int64("amp_axis_end", [at + 1])])
            block_shape = self._node(nodes, "ScatterElements", [
                self._node(nodes, "Shape", [current]), self._int64("amp_axis", [p.axis]), width])
            fill = self._initializer(f"{value.name}_padfill",
                                     np.array([p.fill], dtype=value.dtype.numpy()))
            block = ir.Value(name=self.namer(f"{value.name}_padblock"), type=value.type)
            nodes.append(ir.Node("", "Expand", [fill, block_shape], outputs=[block],
                                 name=f"amp_padblock_{block.name}", metadata_props=dict(tags)))
            last = i == len(pads) - 1
            joined = out if last else ir.Value(name=self.namer(f"{value.name}_padpart"),
                                               type=value.type)
            nodes.append(ir.Node("", "Concat", [current, block], outputs=[joined],
                                 attributes=[ir.AttrInt64("axis", p.axis)],
                                 name=f"amp_pad_{joined.name}", metadata_props=dict(tags)))
            current = joined

    def _pad_amounts(self, nodes: list[ir.Node], value: ir.Value, widths: list[int],
                     symbolic: list[AxisPad]) -> ir.Value:
        """Pad's ``pads`` input: a constant, or with symbolic dims a Concat of the constant
        parts and ``(m − d % m) % m`` of each runtime size ``d`` (read from ``value``)."""
        if not symbolic:
            return self._int64(f"{value.name}_pads", widths)
        rank = len(value.shape)
        multiple = self._int64("amp_pad_multiple", [self.plan.policy.multiple])
        parts, start = [], 0
        for p in sorted(symbolic, key=lambda p: p.axis):
            at = rank + p.axis
            if at > start:
                parts.append(self._int64(f"{value.name}_pads", widths[start:at]))
            size = self._runtime_dim(nodes, value, p.axis)
            rest = self._node(nodes, "Sub", [multiple, self._node(nodes, "Mod",
                                                                  [size, multiple])])
            parts.append(self._node(nodes, "Mod", [rest, multiple]))
            start = at + 1
        if start < 2 * rank:
            parts.append(self._int64(f"{value.name}_pads", widths[start:]))
        return self._node(nodes, "Concat", parts, axis=0)

    def _node(self, nodes: list[ir.Node], op_type: str, inputs: list[ir.Value],
              **attributes: int) -> ir.Value:
        """A runtime shape-arithmetic node (int64), appended to ``nodes`` in order."""
        out = ir.Value(name=self.namer(f"amp_pad_{op_type.lower()}"),
                       type=ir.TensorType(ir.DataType.INT64))
        node = ir.Node("", op_type, inputs, outputs=[out], name=f"amp_{out.name}",
                       attributes=[ir.AttrInt64(k, v) for k, v in attributes.items()],
                       metadata_props={INSERTED_TAG: "pad",
                                       REASON_KEY: "runtime pad amount of a symbolic dim"})
        nodes.append(node)
        return out

    def _runtime_dim(self, nodes: list[ir.Node], value: ir.Value, axis: int) -> ir.Value:
        """``value``'s runtime size along ``axis`` (1-D): Gather(Shape(value), [axis])."""
        return self._node(nodes, "Gather", [self._node(nodes, "Shape", [value]),
                                            self._int64("amp_axis", [axis])])

    def _symbol_size(self, symbol: str) -> ir.Value:
        """The runtime size of ``symbol`` (1-D), from the graph input that names it."""
        if symbol not in self.symbol_sizes:
            source, axis = self.symbols[symbol]
            nodes: list[ir.Node] = []
            self.symbol_sizes[symbol] = self._runtime_dim(nodes, source, axis)
            self._insert_after(source, nodes)
        return self.symbol_sizes[symbol]

    def _slice_node(self, value: ir.Value, pad: AxisPad) -> ir.Value:
        shape = list(value.shape) if value.shape is not None else None
        if shape is not None:
            shape[pad.axis] = pad.size
        out = ir.Value(name=self.namer(f"{value.name}_unpadded"), type=value.type,
                       shape=ir.Shape(shape) if shape is not None else None)
        end = (self._int64(f"{value.name}_end", [pad.size]) if isinstance(pad.size, int)
               else self._symbol_size(pad.size))
        inputs = [value, self._int64(f"{value.name}_start", [0]), end,
                  self._int64(f"{value.name}_axis", [pad.axis])]
        node = ir.Node("", "Slice", inputs, outputs=[out], name=f"amp_slice_{out.name}",
                       metadata_props={INSERTED_TAG: "slice",
                                       REASON_KEY: "the padded layout ends here"})
        self._insert_after(value, [node])
        self.stats.slices_inserted += 1
        return out

    def _insert_after(self, value: ir.Value, nodes: list[ir.Node]) -> None:
        for node in reversed(nodes):  # each goes right after the producer: reverse order
            insert_after_producer(node, value, self.graph)

    def _slice_graph_output(self, index: int) -> None:
        """The graph output keeps its name and shape: its Slice takes both."""
        value = self.graph.outputs[index]
        sliced = self._unpadded(value)
        name = value.name
        value.name = self.namer(f"{name}_padded")
        sliced.name = name
        self.graph.outputs[index] = sliced


def _chain_step(node: ir.Node) -> str | None:
    """'Transpose' / 'Cast' when ``node`` maps a constant to a constant axis by axis."""
    if node.domain == "" and node.op_type in ("Transpose", "Cast") and len(node.outputs) == 1:
        return node.op_type
    return None


def _perm(node: ir.Node) -> list[int]:
    rank = len(node.inputs[0].shape)
    perm = node.attributes.get_ints("perm", None)
    return list(perm) if perm is not None else list(reversed(range(rank)))


def _through(node: ir.Node, pads: tuple[AxisPad, ...], back: bool = False
             ) -> tuple[AxisPad, ...]:
    """Input pads → output pads of a chain step (``back``: output pads → input pads)."""
    if _chain_step(node) == "Cast":
        return pads
    perm = _perm(node)
    return tuple(p._replace(axis=perm[p.axis] if back else perm.index(p.axis)) for p in pads)


def is_constant(value: ir.Value) -> bool:
    """An initializer, or a Transpose/Cast chain of one (the exporter's tied lm_head)."""
    if value.is_initializer() and value.const_value is not None:
        return not value.is_graph_input()
    node = value.producer()
    return node is not None and _chain_step(node) is not None and is_constant(node.inputs[0])


def _constant_array(value: ir.Value) -> np.ndarray:
    node = value.producer()
    if node is None:
        return value.const_value.numpy()
    source = _constant_array(node.inputs[0])
    if _chain_step(node) == "Cast":
        return source.astype(ir.DataType(node.attributes.get_int("to")).numpy())
    return source.transpose(_perm(node))


def _why(pads: tuple[AxisPad, ...]) -> str:
    return ", ".join(f"axis {p.axis}: {p.size}→{p.padded}" for p in pads)


def _padded_shape(shape: ir.Shape | None, pads: tuple[AxisPad, ...]) -> ir.Shape | None:
    if shape is None:
        return None
    dims = list(shape)
    for p in pads:
        dims[p.axis] = p.padded
    return ir.Shape(dims)


def _padded_array(array: np.ndarray, pads: tuple[AxisPad, ...]) -> np.ndarray:
    for p in pads:
        widths = [(0, 0)] * array.ndim
        widths[p.axis] = (0, p.padded - p.size)
        array = np.pad(array, widths, constant_values=np.array(p.fill, dtype=array.dtype))
    return array


def pad_report(stats: PadStats) -> dict:
    """The report's ``padding`` section (core report plus what the adapter inserted)."""
    return {**padding_report(stats.plan), "weights_padded": stats.weights_padded,
            "weights_padded_in_place": stats.weights_padded_in_place,
            "pads_inserted": stats.pads_inserted, "slices_inserted": stats.slices_inserted}

