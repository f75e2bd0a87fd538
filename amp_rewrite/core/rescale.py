"""Exact power-of-two rescaling of hot GEMM chains, so that values beyond fp16's range fit it.

A value ``v = x · W_up`` (+ bias) that data shows beyond fp16's range, read only through ops
that are positively homogeneous of degree one in it (``relu``, a product with another value,
copies and reshapes) by a GEMM ``u · W_down``, keeps the chain's output if ``W_up`` (and the
bias) are multiplied by ``2^-k`` and ``W_down`` by ``2^k``: every value of the chain is
``2^-k`` times the old one, and the down projection undoes it. Multiplying by a power of two
is exact in binary floating point (while nothing underflows or overflows), so the FP32 model
computes the same values, and the chain now fits fp16: it runs fp16 instead of fp32 (an fp16
plan) or bf16 (a mixed plan), with fp16's 10-bit mantissa. This is the inference analogue of
loss scaling (Micikevicius et al., *Mixed Precision Training*): a range problem solved by a
scale, not by a wider type.

Framework-free: the adapters find the chains and apply the shift; this module decides it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from amp_rewrite.core.precision import LowDtype

FP16 = LowDtype.FLOAT16
FP16_SMALLEST_NORMAL = 2.0 ** -14
# entries within 2^-10 of a tensor's largest are its significant ones (the view's range
# screen judges constants the same way, onnx/view.range_problem): after the shift they must
# stay normal fp16 numbers, so W_up's largest entry must stay above 2^-14 · 2^10
SIGNIFICANT = 2.0 ** -10


@dataclass(frozen=True)
class Chain:
    """What deciding a shift needs to know of one chain (magnitudes, all finite)."""

    peak: float  # the largest |value| data showed anywhere along the chain
    up_largest: float  # the largest |entry| of W_up (and its bias)
    down_largest: float  # the largest |entry| of W_down


def shift(chain: Chain, threshold: float = FP16.range_threshold) -> int | None:
    """The smallest ``k`` with ``peak · 2^-k`` within ``threshold``, or None where no shift
    is needed or where the shifted weights would leave fp16 (W_up's significant entries
    below its normal numbers, W_down beyond the threshold): the chain then needs range."""
    if chain.peak <= threshold:
        return None
    k = math.ceil(math.log2(chain.peak / threshold))
    if chain.up_largest * SIGNIFICANT * 2.0 ** -k < FP16_SMALLEST_NORMAL:
        return None
    if chain.down_largest * 2.0 ** k > threshold:
        return None
    return k
