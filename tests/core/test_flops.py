"""FLOP counting (core/flops.py) against FLOPs counted by hand: a multiply-add is 2."""
from __future__ import annotations

import pytest

from amp_rewrite.core.flops import op_flops




@pytest.mark.parametrize("op,inputs,output,flops", [
    # [2,3,4] @ [4,5]: 30 outputs, each 4 multiply-adds
    ("MatMul", [(2, 3, 4), (4, 5)], (2, 3, 5), 2 * 30 * 4),
    ("Gemm", [(8, 16), (16, 32), (32,)], (8, 32), 2 * 256 * 16),
    # torch linear: x [8,16], weight [32,16]
    ("linear", [(8, 16), (32, 16), (32,)], (8, 32), 2 * 256 * 16),
    # addmm(bias, mat1, mat2): K from mat1, not from the bias
    ("addmm", [(32,), (8, 16), (16, 32)], (8, 32), 2 * 256 * 16),
    ("baddbmm", [(4, 8, 32), (4, 8, 16), (4, 16, 32)], (4, 8, 32), 2 * 1024 * 16),
])
def test_gemm_flops(op, inputs, output, flops):
    assert op_flops(op, inputs, [output]) == flops


@pytest.mark.parametrize("op,inputs,output,transposed,flops", [
    # 3x3 conv, 3 -> 16 channels, 8x8 -> 6x6: 576 outputs, each 3·3·3 multiply-adds
    ("Conv", [(1, 3, 8, 8), (16, 3, 3, 3)], (1, 16, 6, 6), False, 2 * 576 * 27),
    ("conv2d", [(1, 3, 8, 8), (16, 3, 3, 3), (16,)], (1, 16, 6, 6), False, 2 * 576 * 27),
    # depthwise (groups 16): each output reads one channel's 3·3
    ("Conv", [(1, 16, 8, 8), (16, 1, 3, 3)], (1, 16, 6, 6), False, 2 * 576 * 9),
    # transposed, 4 -> 2 channels: each of the 100 inputs writes 2·3·3 products
    ("ConvTranspose", [(1, 4, 5, 5), (4, 2, 3, 3)], (1, 2, 7, 7), False, 2 * 100 * 18),
    ("convolution", [(1, 4, 5, 5), (4, 2, 3, 3)], (1, 2, 7, 7), True, 2 * 100 * 18),
])
def test_conv_flops(op, inputs, output, transposed, flops):
    assert op_flops(op, inputs, [output], transposed=transposed) == flops


@pytest.mark.parametrize("op,inputs,output,flops", [
    # Q·Kᵀ and P·V over B=2, H=4, Sq=10, Skv=12, D=8: 2 · (2·2·4·10·12·8)
    ("scaled_dot_product_attention", [(2, 4, 10, 8), (2, 4, 12, 8), (2, 4, 12, 8)],
     (2, 4, 10, 8), 2 * 2 * 2 * 4 * 10 * 12 * 8),
    # [B, S, hidden] = [2, 10, 32] against 12 keys
    ("MultiHeadAttention", [(2, 10, 32), (2, 12, 32), (2, 12, 32)], (2, 10, 32),
     2 * 2 * 2 * 10 * 12 * 32),
    # com.microsoft::Attention: the second input is the packed QKV weight; self-attention
    ("Attention", [(2, 10, 32), (32, 96), (96,)], (2, 10, 32), 2 * 2 * 2 * 10 * 10 * 32),
])
def test_attention_flops(op, inputs, output, flops):
    assert op_flops(op, inputs, [output]) == flops


def test_other_ops_count_one_per_output_element_and_unknown_shapes_none():
    assert op_flops("Add", [(3, 4), (4,)], [(3, 4)]) == 12
    assert op_flops("softmax", [(2, 5)], [(2, 5)]) == 10
    assert op_flops("MatMul", [(2, 4), (4, 5)], [None]) == 0
    assert op_flops("MatMul", [None, (4, 5)], [(2, 5)]) == 10  # K unknown: elementwise
