"""Which ops onnxruntime's CPU provider really runs in float16.

For each op (the fused ops amp_rewrite's fusion step emits, the fusions onnxruntime makes
itself, and a few plain ops for contrast) a one-node fp16 model is given to a CPU session at
ORT_ENABLE_EXTENDED, and its optimised graph is read back:

* ``fp16 kernel``: the node is there and no Cast was inserted around it;
* ``fp32 behind N casts``: the provider has no fp16 kernel; onnxruntime's InsertCastTransformer
  casts the inputs to float32 and the output back (and drops such cast pairs between
  neighbouring fallback nodes, so a chain of them runs wholly in float32);
* ``inlined``: no fp16 kernel, and the op has a function body that replaced it.

This is why errors measured under ORT-CPU depend on which ops a converter leaves: an unfused
fp16 residual ``Add`` runs in float32 on this provider, a ``SkipLayerNormalization`` in fp16.

    python -m benchmarks compare kernels [--json results/ort_fp16_kernels.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as h

from benchmarks.peers import ort_optimized_graph

HIDDEN = 16
SHAPES = {"x": [2, 3, HIDDEN], "x4": [1, HIDDEN, 4, 4], "x2": [3, HIDDEN]}
MS = "com.microsoft"


def _init(name: str, shape: list[int]) -> onnx.TensorProto:
    data = np.random.default_rng(0).standard_normal(shape).astype(np.float16)
    return onnx.numpy_helper.from_array(data, name)


def cases() -> dict[str, tuple[list[onnx.NodeProto], list[onnx.TensorProto]]]:
    gamma, beta, w2 = _init("g", [HIDDEN]), _init("b", [HIDDEN]), _init("w2", [HIDDEN, HIDDEN])
    w4 = _init("w", [HIDDEN, HIDDEN, 1, 1])
    return {
        "Gelu": ([h.make_node("Gelu", ["x"], ["y"], domain=MS)], []),
        "FastGelu": ([h.make_node("FastGelu", ["x"], ["y"], domain=MS)], []),
        "BiasGelu": ([h.make_node("BiasGelu", ["x", "b"], ["y"], domain=MS)], [beta]),
        "QuickGelu": ([h.make_node("QuickGelu", ["x"], ["y"], domain=MS, alpha=1.702)], []),
        "SkipLayerNormalization": ([h.make_node("SkipLayerNormalization", ["x", "x", "g", "b"],
                                                ["y"], domain=MS)], [gamma, beta]),
        "SkipSimplifiedLayerNormalization": (
            [h.make_node("SkipSimplifiedLayerNormalization", ["x", "x", "g"], ["y"], domain=MS)],
            [gamma]),
        "SimplifiedLayerNormalization": (
            [h.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], axis=-1)], [gamma]),
        "LayerNormalization": ([h.make_node("LayerNormalization", ["x", "g", "b"], ["y"],
                                            axis=-1)], [gamma, beta]),
        "MultiHeadAttention": ([h.make_node("MultiHeadAttention", ["x", "x", "x"], ["y"],
                                            domain=MS, num_heads=2)], []),
        "FusedConv": ([h.make_node("FusedConv", ["x4", "w"], ["y4"], domain=MS,
                                   activation="Relu")], [w4]),
        "FusedMatMul": ([h.make_node("FusedMatMul", ["x", "w2"], ["y"], domain=MS, alpha=0.5)],
                        [w2]),
        "FusedGemm": ([h.make_node("FusedGemm", ["x2", "w2"], ["y2"], domain=MS,
                                   activation="Relu")], [w2]),
        "MatMul": ([h.make_node("MatMul", ["x", "w2"], ["y"])], [w2]),
        "Add": ([h.make_node("Add", ["x", "x"], ["y"])], []),
        "Conv": ([h.make_node("Conv", ["x4", "w"], ["y4"])], [w4]),
        "Softmax": ([h.make_node("Softmax", ["x"], ["y"], axis=-1)], []),
    }


def one_node_model(op: str, nodes, initializers) -> tuple[onnx.ModelProto, list[str]]:
    used = sorted({i for n in nodes for i in n.input} & set(SHAPES))
    outputs = sorted({o for n in nodes for o in n.output})
    graph = h.make_graph(
        nodes, op, [h.make_tensor_value_info(n, TensorProto.FLOAT16, SHAPES[n]) for n in used],
        [h.make_tensor_value_info(o, TensorProto.FLOAT16, None) for o in outputs], initializers)
    model = h.make_model(graph, ir_version=10, opset_imports=[
        h.make_opsetid("", 18), h.make_opsetid(MS, 1)])
    return model, used


def verdict(op: str, model: onnx.ModelProto, inputs: list[str]) -> str:
    """How the CPU provider runs ``op`` in fp16 (see the module docstring)."""
    feeds = {n: np.ones(SHAPES[n], np.float16) for n in inputs}
    try:
        optimized = ort_optimized_graph(model, feeds)
    except Exception as e:  # an op the provider cannot run at all is a finding
        return "fails: " + str(e).splitlines()[0][:100]
    kinds = [n.op_type for n in optimized.graph.node]
    if op not in kinds:
        return "inlined (no fp16 kernel): " + ", ".join(sorted(set(kinds)))
    casts = kinds.count("Cast")
    return "fp16 kernel" if casts == 0 else f"fp32 behind {casts} casts ORT inserts"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("results/ort_fp16_kernels.json"))
    args = p.parse_args(argv)
    import onnxruntime as ort

    table = {op: verdict(op, *one_node_model(op, *spec)) for op, spec in cases().items()}
    print(f"onnxruntime {ort.__version__}, CPUExecutionProvider, float16")
    for op, how in table.items():
        print(f"{op:34} {how}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"onnxruntime": ort.__version__, "cpu_fp16": table},
                                   indent=1))
    return 0
