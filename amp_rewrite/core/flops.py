"""FLOPs of one op from its shapes: the weight of the accuracy budget's units, its low-FLOP
share, and the padding cost model (docs/design.md §5, §8).

Framework-free: an adapter gives the op key (ONNX ``op_type`` or the torch op key, without
namespace or overload), the shapes of its inputs and outputs (tuples of ints; None where
unknown) and, for a convolution, whether it is transposed. A multiply-add counts 2.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

Shape = Sequence[int]

# GEMMs whose reduction length K is the last dim of their first operand ...
_GEMMS = {"MatMul", "FusedMatMul", "Gemm", "linear", "mm", "bmm", "matmul"}
# ... and those whose first operand is the bias they add (K from the second).
_GEMMS_WITH_BIAS_FIRST = {"addmm", "baddbmm"}


def elements(shape: Shape) -> int:
    return math.prod(shape)


def gemm_flops(output: Shape, k: int) -> int:
    """2·(output elements)·K."""
    return 2 * elements(output) * k


def conv_flops(output: Shape, weight: Shape, out_channel_axis: int = 0) -> int:
    """2·(output elements)·(weights each output reads: C_in/groups · kernel), the weight's
    elements over its output channels."""
    return 2 * elements(output) * (elements(weight) // max(weight[out_channel_axis], 1))


def conv_transpose_flops(input_: Shape, weight: Shape) -> int:
    """2·(input elements)·(weights each input writes: C_out/groups · kernel): the weight is
    [C_in, C_out/groups, kernel...] in ONNX and torch."""
    return 2 * elements(input_) * elements(weight[1:])


def attention_flops(query: Shape, key: Shape | None) -> int:
    """4·(query elements)·S_kv: the two GEMMs, Q·Kᵀ and P·V. S_kv is the key's
    second-to-last dim ([B, H, S, D] or [B, S, hidden]); without a key of rank 3 or more
    (self-attention, or com.microsoft::Attention, whose second input is the packed QKV
    weight), the query's."""
    s_kv = key[-2] if key is not None and len(key) >= 3 else query[-2]
    return 4 * elements(query) * s_kv


def op_flops(op: str, inputs: Sequence[Shape | None], outputs: Sequence[Shape | None],
             *, transposed: bool = False) -> float:
    """FLOPs of one op: GEMMs, convolutions and attention by their formulas, any other op
    one per output element (an unknown output shape: 0)."""
    ins = list(inputs)

    def given(i: int) -> Shape | None:
        shape = ins[i] if i < len(ins) else None
        return tuple(shape) if shape is not None and len(shape) else None

    out = tuple(outputs[0]) if outputs and outputs[0] is not None else None
    if out is None:
        return 0.0
    if op in _GEMMS and given(0):
        return float(gemm_flops(out, given(0)[-1]))
    if op in _GEMMS_WITH_BIAS_FIRST and given(1):
        return float(gemm_flops(out, given(1)[-1]))
    if op.lower().startswith("conv") and given(1) and len(given(1)) > 2:
        if transposed or "transpose" in op.lower():
            return float(conv_transpose_flops(given(0) or (), given(1)))
        return float(conv_flops(out, given(1)))
    if "attention" in op.lower() and given(0):
        return float(attention_flops(given(0), given(1)))
    return float(elements(out))
