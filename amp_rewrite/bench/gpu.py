"""``python -m amp_rewrite.bench gpu``: training steps, GEMMs, step profiles and ONNX latency
on a GPU.

``tools/gpu_session.sh`` runs them in one device call (its sections have time limits).

    python -m amp_rewrite.bench gpu {train,gemm,profile,ort} ...
"""
from __future__ import annotations

from amp_rewrite.bench import cli

MODES = {
    "train": ("amp_rewrite.bench.gpu_training", "training-step and forward time per variant"),
    "gemm": ("amp_rewrite.bench.gpu_gemm", "misaligned GEMMs against their padded shapes"),
    "profile": ("amp_rewrite.bench.gpu_profile", "where a step's time goes, by kernel family"),
    "ort": ("amp_rewrite.bench.ort_latency", "ONNX latency on onnxruntime's CUDA provider: ours vs "
            "FP32 and peers"),
}


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("gpu", MODES, list(argv or []))
