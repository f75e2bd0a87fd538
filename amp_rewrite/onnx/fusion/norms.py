"""GroupNorm as torch exports it → the standard ``GroupNormalization`` (opset 21).

torch writes ``group_norm(x, G, gamma, beta, eps)`` over (N, C, *spatial) as::

    g = Reshape(x, [0, G, -1])                       # channels grouped contiguously
    n = InstanceNormalization(g, ones[G], zeros[G], epsilon=eps)
    y = Reshape(n, Shape(x)) * gamma[C, 1, ..] + beta[C, 1, ..]

Once a bf16 rewrite moves the model to opset 22, InstanceNormalization admits bf16 and its
statistics over C/G·H·W elements accumulate in bf16. GroupNormalization-21 keeps
them in ``stash_type`` (float32) by the spec, whatever the input dtype, and takes per-channel
scale and bias ([C]; opset 18 took per-group ones), so the chain maps onto it exactly.

Declines (the chain stays): a channel count that is not static or not a multiple of G, a
reshape that does not group axis 1 contiguously or does not restore x's shape, an
InstanceNormalization scale/bias that is not all ones/zeros, gamma/beta that are not
constants broadcasting per channel.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from amp_rewrite.onnx.fusion.canonical import _ints, shape_expression
from amp_rewrite.onnx.fusion.canonical import constant_array as _const
from amp_rewrite.onnx.fusion.rules import _either, _is_float

GROUP_NORM_OPSET = 21  # per-channel scale/bias and stash_type statistics


def _per_channel(value: ir.Value, rank: int, channels: int) -> np.ndarray | None:
    """A constant that broadcasts against a rank-``rank`` (N, C, ...) tensor as one value per
    channel (shape (C, 1, ..), (1, C, 1, ..) or all ones), as a [C] float32 array; else None."""
    array = _const(value)
    if array is None or array.ndim > rank:
        return None
    dims = (1,) * (rank - array.ndim) + tuple(array.shape)
    if any(d != 1 for i, d in enumerate(dims) if i != 1) or dims[1] not in (1, channels):
        return None
    return np.broadcast_to(array.astype(np.float32).reshape(-1), (channels,)).copy()


def _all_equal(value: ir.Value, expected: float, size: int) -> bool:
    array = _const(value)
    return array is not None and array.size == size \
        and bool(np.all(array.astype(np.float32) == np.float32(expected)))


class GroupNormFusion(pattern.RewriteRuleClassBase):
    """Reshape → InstanceNormalization → Reshape → ·gamma → +beta ⇒ GroupNormalization-21.

    ``swap``: the root Add's operand order (beta first); the Mul's order is a branch.
    """

    def __init__(self, name: str, swap: bool) -> None:
        super().__init__(name)
        self._swap = swap

    def pattern(self, op, x, group_shape, in_scale, in_bias, back_shape, gamma, beta):
        grouped = op.Reshape(x, group_shape, _outputs=["grouped"])
        normed = op.InstanceNormalization(grouped, in_scale, in_bias, _outputs=["normed"])
        scaled = _either(op.Mul, op.Reshape(normed, back_shape), gamma)
        return op.Add(beta, scaled) if self._swap else op.Add(scaled, beta)

    def check(self, context, x, group_shape, in_scale, in_bias, back_shape, gamma, beta,
              grouped, **_):
        result = pattern.MatchResult()
        if not _is_float(x):
            return result.fail("input is not a floating-point tensor", x)
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None or rank < 3:
            return result.fail("input rank is unknown or below 3", x)
        channels = x.shape[1]
        if not isinstance(channels, int):
            return result.fail("channel count is not static", x)
        split = _ints(group_shape)
        if split is None or len(split) != 3:
            return result.fail("group reshape is not a constant 3-D shape", group_shape)
        groups = split[1]
        if groups <= 0 or channels % groups:
            return result.fail(f"{channels} channels do not split into {groups} groups",
                               group_shape)
        allowzero = grouped.producer().attributes.get_int("allowzero", 0)
        batch_ok = split[0] == x.shape[0] or (split[0] == 0 and not allowzero)
        spatial = list(x.shape)[2:]
        per_group = channels // groups * int(np.prod(spatial)) \
            if all(isinstance(d, int) for d in spatial) else None
        if not batch_ok or split[2] not in (-1, per_group):
            return result.fail("group reshape is not (N, G, C/G·spatial)", group_shape)
        back = shape_expression(back_shape)
        if back is None or len(back) != rank or not all(
                b == (x, i) or (isinstance(b, int) and b == x.shape[i] and b > 0)
                for i, b in enumerate(back)):
            return result.fail("second reshape does not restore the input's shape", back_shape)
        if not _all_equal(in_scale, 1.0, groups) or not _all_equal(in_bias, 0.0, groups):
            return result.fail("InstanceNormalization scale/bias are not ones/zeros", in_scale)
        for value in (gamma, beta):
            if value.dtype != x.dtype or _per_channel(value, rank, channels) is None:
                return result.fail("affine parameter is not a per-channel constant", value)
        return result

    def rewrite(self, op, x, group_shape, normed, gamma, beta, **_):
        rank, channels = x.shape.rank(), x.shape[1]
        epsilon = normed.producer().attributes.get_float("epsilon", 1e-5)
        dtype = x.dtype.numpy()
        scale, bias = (op.Constant(value=ir.tensor(
            _per_channel(v, rank, channels).astype(dtype), dtype=x.dtype))
            for v in (gamma, beta))
        return op.GroupNormalization(x, scale, bias, num_groups=_ints(group_shape)[1],
                                     epsilon=epsilon, stash_type=1)


def group_norm_rules() -> pattern.RewriteRuleSet:
    return pattern.RewriteRuleSet([GroupNormFusion.rule("group_norm", swap=swap)
                                   for swap in (False, True)])
