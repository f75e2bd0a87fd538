"""Synthetic chains for the speed benchmarks: long graphs of small blocks with FP32 weights.

Each model is a chain of blocks on a [4, 16] float32 activation, variants by block:

* ``plain``: ``MatMul(16x16) -> Add -> Relu``;
* ``blocked``: ``plain`` + ``CumSum``, a reduction the rules deny (and onnxconverter-common and
  ORT's converter keep FP32 by default), so every block needs casts in and out;
* ``softmax``: ``plain`` + ``Softmax``, whose output feeds the next block's MatMul;
* ``residual``: ``MatMul -> Add -> Relu -> Softmax`` added back to the block's input (the
  residual stream, which joins the whole model into one free region of the min cut);
* ``residual_deny``: ``residual`` with a ``CumSum`` on each block's branch (before the
  residual Add), so every block has a fixed-HIGH op inside that one region.

Sizes are node counts, rounded up to whole blocks.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WIDTH, BATCH = 16, 4
BLOCK_OPS = {"plain": ("MatMul", "Add", "Relu"),
             "blocked": ("MatMul", "Add", "Relu", "CumSum"),
             "softmax": ("MatMul", "Add", "Relu", "Softmax"),
             "residual": ("MatMul", "Add", "Relu", "Softmax", "Add"),
             "residual_deny": ("MatMul", "Add", "Relu", "Softmax", "CumSum", "Add")}
VARIANTS = tuple(BLOCK_OPS)
DENY_OP = "CumSum"


def _block(b: int, x: str, ops: tuple[str, ...]) -> tuple[list[onnx.NodeProto], str]:
    """The nodes of block ``b`` reading ``x``, and the name of its output."""
    nodes = [helper.make_node("MatMul", [x, f"w{b}"], [f"m{b}"]),
             helper.make_node("Add", [f"m{b}", f"b{b}"], [f"a{b}"]),
             helper.make_node("Relu", [f"a{b}"], [f"r{b}"])]
    branch = f"r{b}"
    if "Softmax" in ops:
        nodes.append(helper.make_node("Softmax", [branch], [f"s{b}"], axis=-1))
        branch = f"s{b}"
    if DENY_OP in ops:
        nodes.append(helper.make_node(DENY_OP, [branch, "axis"], [f"c{b}"]))
        branch = f"c{b}"
    if ops[-1] == "Add" and len(ops) > 3:  # the residual stream: x + block(x)
        nodes.append(helper.make_node("Add", [x, branch], [f"h{b}"]))
        branch = f"h{b}"
    return nodes, branch


def build_chain(n_nodes: int, variant: str, seed: int = 0) -> onnx.ModelProto:
    """A chain of at least ``n_nodes`` nodes (whole blocks) with FP32 initializers."""
    ops = BLOCK_OPS[variant]
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    if DENY_OP in ops:
        inits.append(numpy_helper.from_array(np.array(1, np.int64), "axis"))
    x = "x"
    scale = 0.5 / np.sqrt(WIDTH)  # activations stay O(1) through thousands of blocks
    for b in range(-(-n_nodes // len(ops))):
        w = rng.uniform(-scale, scale, (WIDTH, WIDTH)).astype(np.float32)
        bias = rng.uniform(-0.1, 0.1, WIDTH).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{b}"), numpy_helper.from_array(bias, f"b{b}")]
        block, x = _block(b, x, ops)
        nodes += block
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        nodes, f"chain_{variant}_{n_nodes}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, WIDTH])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
