"""``python -m amp_rewrite.bench compare``: amp_rewrite's ONNX output against the peer converters.

    python -m amp_rewrite.bench compare {corpus,share,real,fusion,kernels,hot,control-flow} ...
"""
from __future__ import annotations

from amp_rewrite.bench import cli

MODES = {
    "corpus": ("amp_rewrite.bench.node_corpus", "ONNX's operator tests: validity, casts, error"),
    "share": ("amp_rewrite.bench.share_vs_casts", "low-precision share vs casts, paired per peer"),
    "real": ("amp_rewrite.bench.real_models", "the corpus judgement on the zoo's exports"),
    "fusion": ("amp_rewrite.bench.fusion_compare", "fuse-then-plan vs ORT optimizer, ModelOpt"),
    "kernels": ("amp_rewrite.bench.ort_kernels", "which ops ORT-CPU really runs in fp16"),
    "hot": ("amp_rewrite.bench.hot_compare", "T5/Llama variants with hot FFN activations"),
    "control-flow": ("amp_rewrite.bench.control_flow_compare", "an If-heavy VAD-like model"),
}


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("compare", MODES, list(argv or []))
