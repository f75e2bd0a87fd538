"""Attention masks that mask nothing are dropped from ``scaled_dot_product_attention``.

A traced ``transformers`` model builds its "no padding" mask as a boolean tensor where eager
code passes none, and with a mask PyTorch picks the float32 math kernel (decision 0023). A
mask is proved all-True (or all-zero, additive) for *every* input shape by interval evaluation
of the shape-only ops it is built from, never from example values; anything else is kept.
"""
from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

aten = torch.ops.aten
Bounds = tuple[float, float]  # inclusive value range of every element
_UNKNOWN: Bounds = (-math.inf, math.inf)
_SDPA = aten.scaled_dot_product_attention.default
_SAME_VALUES = {aten.unsqueeze.default, aten.expand.default, aten.view.default,
                aten.reshape.default, aten.slice.Tensor, aten.clone.default,
                aten.contiguous.default, aten.squeeze.dim, aten.permute.default,
                aten.transpose.int, aten.alias.default}
_COMPARE = {aten.ge.Scalar: operator.ge, aten.gt.Scalar: operator.gt,
            aten.le.Scalar: operator.le, aten.lt.Scalar: operator.lt}
_AND = {aten.bitwise_and.Tensor, aten.logical_and.default, aten.mul.Tensor}
_OR = {aten.bitwise_or.Tensor, aten.logical_or.default}
_ADD = {aten.add.Tensor, aten.add.Scalar}
_SUB = {aten.sub.Tensor, aten.sub.Scalar}
_ARANGE = {aten.arange.default, aten.arange.start}
# what a mask is built from: the only nodes the pass erases once unused
_SHAPE_ONLY = (_SAME_VALUES | set(_COMPARE) | _AND | _OR | _ADD | _SUB | _ARANGE
               | {aten.sym_size.int})


def bounds(arg: object) -> Bounds:
    """Range of the values ``arg`` can hold, whatever the input shapes are."""
    if isinstance(arg, (bool, int, float)):
        return float(arg), float(arg)
    if not isinstance(arg, Node) or arg.op != "call_function":
        return _UNKNOWN
    target, args = arg.target, arg.args
    if arg.kwargs.get("alpha", 1) != 1:  # a + alpha·b: not modelled
        return _UNKNOWN
    if target in _SAME_VALUES:
        return bounds(args[0])
    if target is aten.arange.default:  # 0 .. end-1; an empty range has no values to break it
        return 0.0, math.inf
    if target is aten.arange.start:
        return bounds(args[0])[0], math.inf
    if target in _ADD:
        (lo_a, hi_a), (lo_b, hi_b) = bounds(args[0]), bounds(args[1])
        return lo_a + lo_b, hi_a + hi_b
    if target in _SUB:
        (lo_a, hi_a), (lo_b, hi_b) = bounds(args[0]), bounds(args[1])
        return lo_a - hi_b, hi_a - lo_b
    if target in _COMPARE:  # true at both ends: true for every value between
        (lo, hi), compare, scalar = bounds(args[0]), _COMPARE[target], float(args[1])
        return (1.0, 1.0) if compare(lo, scalar) and compare(hi, scalar) else (0.0, 1.0)
    if target in _AND:
        (lo_a, hi_a), (lo_b, hi_b) = bounds(args[0]), bounds(args[1])
        return (1.0, 1.0) if min(lo_a, lo_b) >= 1 and max(hi_a, hi_b) <= 1 else (0.0, 1.0)
    if target in _OR:
        return (1.0, 1.0) if max(bounds(args[0])[0], bounds(args[1])[0]) >= 1 else (0.0, 1.0)
    return _UNKNOWN


def masks_nothing(mask: Node) -> bool:
    """An all-True boolean mask, or an all-zero additive one, for every input shape."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    expected = (1.0, 1.0) if val.dtype == torch.bool else (0.0, 0.0)
    return bounds(mask) == expected


class DropTrivialAttentionMasks(PassBase):
    """``scaled_dot_product_attention(..., attn_mask=M)`` → no mask, where ``masks_nothing(M)``."""

    def __init__(self) -> None:
        self.dropped = 0

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        for node in graph_module.graph.find_nodes(op="call_function", target=_SDPA):
            positional = len(node.args) > 3
            mask = node.args[3] if positional else node.kwargs.get("attn_mask")
            if isinstance(mask, Node) and masks_nothing(mask):
                if positional:
                    node.update_arg(3, None)
                else:
                    node.update_kwarg("attn_mask", None)
                self.dropped += 1
        if not self.dropped:
            return PassResult(graph_module, False)
        for node in reversed(list(graph_module.graph.nodes)):  # the masks' own dead chains
            if node.op == "call_function" and not node.users and node.target in _SHAPE_ONLY:
                graph_module.graph.erase_node(node)
        graph_module.recompile()
        return PassResult(graph_module, True)
