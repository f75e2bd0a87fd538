"""``python -m benchmarks compare``: amp_rewrite's ONNX output against the peer converters.

    python -m benchmarks compare {corpus,share,real,fusion,kernels,hot,control-flow} ...
"""
from __future__ import annotations

from benchmarks import cli

MODES = {
    "corpus": ("benchmarks.node_corpus", "ONNX's operator tests: validity, casts, error"),
    "share": ("benchmarks.share_vs_casts", "low-precision share vs casts, paired per peer"),
    "real": ("benchmarks.real_models", "the corpus judgement on the zoo's exports"),
    "fusion": ("benchmarks.fusion_compare", "fuse-then-plan vs ORT optimizer, ModelOpt"),
    "kernels": ("benchmarks.ort_kernels", "which ops ORT-CPU really runs in fp16"),
    "hot": ("benchmarks.hot_compare", "T5/Llama variants with hot FFN activations"),
    "control-flow": ("benchmarks.control_flow_compare", "an If-heavy VAD-like model"),
}


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("compare", MODES, list(argv or []))
