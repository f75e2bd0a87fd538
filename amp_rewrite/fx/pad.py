"""Pad low-precision GEMM/conv dims to multiples of 8 inside an fx graph (docs/design.md §8).

``PadGemms`` runs after ``MixedPrecisionPass``, builds the core's pad graph, plans
(``core.padding``, slices being views here) and gives every read the layout the plan asks for:

* a weight: ``constant_pad_nd`` of the FP32 parameter directly followed by its cast, so
  ``state_dict`` keeps its shapes and the parameters receive the unpadded model's gradients;
* an activation read padded but produced unpadded: one ``constant_pad_nd`` per layout;
* a value produced padded but read unpadded: one ``aten.slice`` (outputs keep their shapes).

Symbolic dims are not padded: ``torch.export`` of the result would specialise the dim on the
pad amount (decision 0019). A second run finds every padded dim aligned and changes nothing.
"""
from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from amp_rewrite.core.padding import (AxisPad, PadGraph, PadInput, PadKind, PadOp,
                                      PaddingPlan, PadPolicy, PadValue, padding_report,
                                      plan_padding)
from amp_rewrite.fx.apply import after_producer, insert_cast, source_meta
from amp_rewrite.fx.opkeys import tensor_val
from amp_rewrite.fx.view import finished, is_cast

aten = torch.ops.aten
_LOW = (torch.float16, torch.bfloat16)

# overload packet -> per-input (fill, may_vary) of its tensor arguments; None: (0.0, True)
_POINTWISE: dict[object, tuple[tuple[float, bool], ...] | None] = {
    op: None for op in (aten.relu, aten.gelu, aten.tanh, aten.sigmoid, aten.silu, aten.add,
                        aten.sub, aten.mul, aten.neg, aten.abs, aten._to_copy, aten.hardtanh,
                        aten.leaky_relu, aten.clamp, aten.hardswish, aten.hardsigmoid,
                        aten.elu, aten.erf, aten.relu6, aten.clone)
}
_POINTWISE[aten.div] = ((0.0, True), (1.0, False))  # never divide by a padded value
_CONVS = (aten.conv1d, aten.conv2d, aten.conv3d)
_CONSTANT_STEPS = (aten._to_copy, aten.t, aten.permute, aten.transpose, aten.clone)


def _packet(node: Node) -> object | None:
    target = node.target
    return getattr(target, "overloadpacket", None) if node.op == "call_function" else None


def _shape(node: Node) -> tuple | None:
    val = tensor_val(node)
    return None if val is None else tuple(_static(d) for d in val.shape)


def _static(dim: int | torch.SymInt) -> int | str:
    """An int, a SymInt the shape environment fixed to an int, else the symbol's name."""
    if isinstance(dim, int):
        return int(dim)
    value = dim.node.maybe_as_int()
    return int(value) if value is not None else str(dim)


def _hint(node: Node) -> tuple[int | None, ...] | None:
    """Example sizes of symbolic dims (the capture's example inputs), for cost estimates."""
    val = tensor_val(node)
    if val is None or all(isinstance(d, int) for d in val.shape):
        return None
    return tuple(int(d) if isinstance(d, int) else _size_hint(d) for d in val.shape)


def _size_hint(dim: torch.SymInt) -> int | None:
    hint = getattr(dim.node, "hint", None)
    return int(hint) if isinstance(hint, int) else None


def _is_constant(node: Node) -> bool:
    """A parameter/buffer, or a cast/transpose of one (the weight the GEMM reads)."""
    if node.op == "get_attr":
        return True
    return (_packet(node) in _CONSTANT_STEPS and isinstance(node.args[0], Node)
            and _is_constant(node.args[0]))


class PadGemms(PassBase):
    """Pad low GEMM/conv dims to multiples of 8 in place (module docstring)."""

    def __init__(self, policy: PadPolicy | None = None,
                 low: tuple[torch.dtype, ...] = _LOW) -> None:
        super().__init__()
        self.policy, self.low = policy, low
        self.plan: PaddingPlan | None = None
        self.pads_inserted = self.slices_inserted = self.weights_padded = 0

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        # aten.slice is a view: a padded output read unpadded costs no copy
        self.plan = plan_padding(self.build(graph_module.graph), self.policy,
                                 slice_is_view=True)
        if self.plan.is_empty():
            return PassResult(graph_module, False)
        _Applier(graph_module.graph, self.plan, self).run()
        return finished(graph_module, True)

    def report(self) -> dict:
        return {**padding_report(self.plan or PaddingPlan.empty(self.policy)), "weights_padded": self.weights_padded,
                "pads_inserted": self.pads_inserted, "slices_inserted": self.slices_inserted}

    # -- view --------------------------------------------------------------------------------
    def build(self, graph: torch.fx.Graph) -> PadGraph:
        g = PadGraph()
        for node in graph.nodes:
            if tensor_val(node) is not None:
                val = tensor_val(node)
                g.add_value(PadValue(node, node.name, _shape(node), _is_constant(node),
                                     val.element_size(), _hint(node)))
        for node in graph.nodes:
            if node.op in ("call_function", "output"):
                g.add_op(self._op(node, g))
        return g

    def _op(self, node: Node, g: PadGraph) -> PadOp:
        args: list[Node] = []
        torch.fx.node.map_arg((node.args, node.kwargs), args.append)  # duplicates kept
        inputs = tuple(a for a in args if a in g.values)
        outputs = (node,) if node in g.values else ()
        base = PadOp(node, node.name, PadKind.OPAQUE, inputs, outputs)
        val = tensor_val(node)
        if val is None or node.op != "call_function":
            return base
        low = val.dtype in self.low
        packet = _packet(node)
        if packet in (aten.linear, aten.mm, aten.addmm, aten.matmul, aten.bmm):
            return _gemm(base, node, packet, low)
        if packet in _CONVS or (packet is aten.convolution and not node.args[6]):
            return _conv(base, node, packet, low)
        if packet is aten.batch_norm and not node.args[5]:
            return _batch_norm(base, node)
        if packet is aten.pow and isinstance(node.args[1], (int, float)) and node.args[1] >= 0:
            return _pointwise(base, node, None)  # x**c, c >= 0: finite stays finite
        if packet in _POINTWISE and (packet is not aten._to_copy or _dtype_only(node)):
            return _pointwise(base, node, _POINTWISE[packet])
        return base


def _dtype_only(node: Node) -> bool:
    return set(node.kwargs) <= {"dtype"}


def _rank(node: object) -> int:
    val = tensor_val(node)
    return val.dim() if val is not None else -1


def _gemm(base: PadOp, node: Node, packet, low: bool) -> PadOp:
    if packet is aten.linear:
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else None
        if _rank(w) != 2 or _rank(x) < 1:
            return base
        n = ((w, 0), (node, -1)) + (((b, 0),) if isinstance(b, Node) and _rank(b) == 1 else ())
        return base._replace(kind=PadKind.GEMM, low=low, k_axes=((x, -1), (w, 1)), n_axes=n)
    bias = node.args[0] if packet is aten.addmm else None
    a, b = node.args[1:3] if packet is aten.addmm else node.args[:2]
    if _rank(a) < 2 or _rank(b) < 2 or node.kwargs:
        return base
    n = ((b, -1), (node, -1))
    if isinstance(bias, Node) and _rank(bias) >= 1 and _shape(bias)[-1] != 1:
        n += ((bias, -1),)
    return base._replace(kind=PadKind.GEMM, low=low, k_axes=((a, -1), (b, -2)), n_axes=n)


def _conv(base: PadOp, node: Node, packet, low: bool) -> PadOp:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    groups = node.args[8] if packet is aten.convolution else (
        node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1))
    n = ((w, 0), (node, 1)) + (((b, 0),) if isinstance(b, Node) else ())
    return base._replace(kind=PadKind.CONV, low=low, k_axes=((x, 1), (w, 1)), n_axes=n,
                         groups=groups)


def _batch_norm(base: PadOp, node: Node) -> PadOp:
    """Eval BatchNorm: x on the channel axis, 1-D weight/bias/mean/var (var padded with 1)."""
    specs = [PadInput(node.args[0])]
    for i, fill in zip(range(1, 5), (0.0, 0.0, 0.0, 1.0)):
        arg = node.args[i]
        if isinstance(arg, Node):
            specs.append(PadInput(arg, 1, fill))
    return base._replace(kind=PadKind.POINTWISE, pointwise=tuple(specs), finite_safe=True)


def _pointwise(base: PadOp, node: Node, specs) -> PadOp:
    out_rank = _rank(node)
    inputs = []
    for i, arg in enumerate(node.args):
        if isinstance(arg, Node):
            if _rank(arg) < 0:
                return base
            fill, may_vary = specs[i] if specs is not None and i < len(specs) else (0.0, True)
            inputs.append(PadInput(arg, out_rank - _rank(arg), fill, may_vary))
    if any(isinstance(v, Node) for v in node.kwargs.values()):
        return base
    return base._replace(kind=PadKind.POINTWISE, pointwise=tuple(inputs), finite_safe=True)


class _Applier:
    """Gives each read the layout the plan asks for (module docstring)."""

    def __init__(self, graph: torch.fx.Graph, plan: PaddingPlan, owner: PadGemms) -> None:
        self.graph, self.plan, self.owner = graph, plan, owner
        self.versions: dict[tuple[Node, tuple[AxisPad, ...]], Node] = {}

    def run(self) -> None:
        todo = []
        for value in {v for _, v in self.plan.reads} | set(self.plan.produced):
            have = self._have(value)
            for user in list(value.users):
                want = self.plan.reads.get((user, value), ())
                if want != have:
                    todo.append((user, value, want))
        for user, value, want in todo:
            user.replace_input_with(value, self._version(value, want))
        for value, _ in self.versions:  # a cast whose readers all read its padded copy
            if is_cast(value) and not value.users:
                self.graph.erase_node(value)

    def _have(self, value: Node) -> tuple[AxisPad, ...]:
        pad = self.plan.produced.get(value)
        return (pad,) if pad is not None else ()

    def _version(self, value: Node, pads: tuple[AxisPad, ...]) -> Node:
        key = (value, pads)
        if key not in self.versions:
            base = self._unpadded(value)
            self.versions[key] = self._pad(base, value, pads) if pads else base
        return self.versions[key]

    def _unpadded(self, value: Node) -> Node:
        have = self._have(value)
        if not have:
            return value
        key = (value, ())
        if key not in self.versions:
            pad = have[0]
            with self.graph.inserting_after(value):
                node = self.graph.call_function(aten.slice.Tensor,
                                                (value, pad.axis, 0, pad.size))
            node.meta.update(source_meta(value))
            self.owner.slices_inserted += 1
            self.versions[key] = node
        return self.versions[key]

    def _pad(self, base: Node, value: Node, pads: tuple[AxisPad, ...]) -> Node:
        """``constant_pad_nd`` of ``base``; a cast this package inserted gets the pad in front,
        adjacent, as a second run would place them (the output is a fixed point)."""
        if is_cast(base) and set(base.kwargs) == {"dtype"}:
            padded = self._pad(base.args[0], value, pads)
            return insert_cast(self.graph, padded, base.kwargs["dtype"])
        node = after_producer(self.graph, base)
        for fill, group in _by_fill(pads):
            rank = _rank(value)
            widths = [0] * (2 * (rank - min(p.axis for p in group)))
            for p in group:
                widths[2 * (rank - 1 - p.axis) + 1] = p.padded - p.size
            with self.graph.inserting_after(node):
                node = self.graph.call_function(aten.constant_pad_nd.default,
                                                (base, widths, fill))
            node.meta.update(source_meta(value))
            base = node
        if _is_constant(value):
            self.owner.weights_padded += 1
        else:
            self.owner.pads_inserted += 1
        return node


def _by_fill(pads: tuple[AxisPad, ...]) -> list[tuple[float, list[AxisPad]]]:
    groups: dict[float, list[AxisPad]] = {}
    for p in pads:
        groups.setdefault(p.fill, []).append(p)
    return list(groups.items())
