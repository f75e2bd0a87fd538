"""Canonical forms that let the attention patterns match exports with symbolic shapes.

torchlib spells ``key.transpose(-2, -1)`` in its SDPA decomposition as ``Reshape(key, [-1, S,
D]) -> Transpose(perm=[0, 2, 1]) -> Reshape(key.shape[:-2] + [D, S])``, with ``Shape -> Slice ->
Concat`` shapes when dims are symbolic, which onnxscript's SDPA rule cannot extract. The rule
here proves from the shape expressions that the chain swaps the last two axes of a rank-4 key
and replaces it with ``Transpose(key, perm=[0, 1, 3, 2])``.
"""
from __future__ import annotations

from typing import Union

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

# A dimension in a shape expression: a literal, or (value, axis) — that axis of that value.
_Dim = Union[int, tuple[ir.Value, int]]


def constant_array(value: ir.Value | None) -> np.ndarray | None:
    """A constant's value (initializer or default-domain Constant output), else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None:
        node = value.producer()
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return None
        attr = node.attributes.get("value") or node.attributes.get("value_ints")
        if attr is None:
            return None
        if isinstance(attr.value, (list, tuple)):
            return np.asarray(attr.value, dtype=np.int64)
        tensor = attr.value
    try:
        return np.asarray(tensor.numpy())
    except Exception:  # noqa: BLE001 - an unreadable constant is no proof
        return None


def _ints(value: ir.Value | None) -> list[int] | None:
    """A constant integer tensor's entries, else None."""
    array = constant_array(value)
    if array is None or array.dtype.kind not in "iu":
        return None
    return [int(i) for i in array.ravel()]


def shape_expression(value: ir.Value, depth: int = 8) -> list[_Dim] | None:
    """``value`` (a 1-D int64 shape) as a list of dims, or None where it cannot be read:
    constants, ``Shape`` of a value of known rank, ``Slice`` with constant bounds on axis 0,
    ``Concat`` on axis 0."""
    literal = _ints(value)
    if literal is not None:
        return list(literal)
    node = value.producer()
    if node is None or depth == 0 or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        source = node.inputs[0]
        if source is None or source.shape is None:
            return None
        start = node.attributes.get_int("start", 0)
        end = node.attributes.get_int("end", len(source.shape))
        return [(source, axis) for axis in range(len(source.shape))][start:end]
    if node.op_type == "Concat" and node.attributes.get_int("axis", 0) == 0:
        parts = [shape_expression(v, depth - 1) if v is not None else None for v in node.inputs]
        return None if any(p is None for p in parts) else [d for p in parts for d in p]
    if node.op_type == "Slice":
        return _slice(node, depth)
    return None


def _slice(node: ir.Node, depth: int) -> list[_Dim] | None:
    data, bounds = node.inputs[0], [_ints(v) for v in node.inputs[1:]]
    if data is None or len(bounds) < 2 or any(b is None or len(b) != 1 for b in bounds):
        return None
    dims = shape_expression(data, depth - 1)
    starts, ends, axes, steps = (*[b[0] for b in bounds], 0, 1)[:4]
    if dims is None or axes not in (0, -1) or steps != 1:
        return None
    return dims[starts:ends]  # python slicing clamps INT64_MIN/MAX as ONNX does


def _is_axis(dim: _Dim, key: ir.Value, axis: int) -> bool:
    """Whether ``dim`` is known to equal ``key``'s dimension ``axis``."""
    if isinstance(dim, tuple):
        source, source_axis = dim
        if source is key and source_axis == axis:
            return True
        dim = source.shape[source_axis] if source.shape is not None else None
    known = key.shape[axis]
    if isinstance(known, ir.SymbolicDim):
        return (isinstance(dim, ir.SymbolicDim) and known.value is not None
                and dim.value == known.value)
    return isinstance(dim, int) and dim == known


class KeyTranspose(pattern.RewriteRuleClassBase):
    """``Reshape(key, [-1, S, D]) -> Transpose([0, 2, 1]) -> Reshape([B, H, D, S])`` for a
    rank-4 key ``[B, H, S, D]``: ``Transpose(key, perm=[0, 1, 3, 2])``."""

    def pattern(self, op, key, squeezed_shape, transposed_shape):
        squeezed = op.Reshape(key, squeezed_shape)
        return op.Reshape(op.Transpose(squeezed, perm=[0, 2, 1]), transposed_shape)

    def check(self, context, key, squeezed_shape, transposed_shape, **_):
        result = pattern.MatchResult()
        if key.shape is None or len(key.shape) != 4:
            return result.fail("key is not of known rank 4", key)
        squeezed = shape_expression(squeezed_shape)
        transposed = shape_expression(transposed_shape)
        if squeezed is None or transposed is None:
            return result.fail("reshape targets are not readable shape expressions")
        if not (len(squeezed) == 3 and squeezed[0] == -1 and _is_axis(squeezed[1], key, 2)
                and _is_axis(squeezed[2], key, 3)):
            return result.fail("first reshape does not merge the leading axes", squeezed_shape)
        if not (len(transposed) == 4 and all(
                _is_axis(d, key, axis) for d, axis in zip(transposed, (0, 1, 3, 2)))):
            return result.fail("second reshape does not restore [B, H, D, S]", transposed_shape)
        return result

    def rewrite(self, op, key, **_):
        return op.Transpose(key, perm=[0, 1, 3, 2])


def key_transpose_rules():
    return pattern.RewriteRuleSet([KeyTranspose.rule()])
