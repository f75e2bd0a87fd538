"""``python -m benchmarks gpu``: training steps, GEMMs, step profiles and ONNX latency
on a GPU.

``tools/gpu_session.sh`` runs them in one device call (its sections have time limits).

    python -m benchmarks gpu {train,gemm,profile,ort} ...
"""
from __future__ import annotations

from benchmarks import cli

MODES = {
    "train": ("benchmarks.gpu_training", "training-step and forward time per variant"),
    "gemm": ("benchmarks.gpu_gemm", "misaligned GEMMs against their padded shapes"),
    "profile": ("benchmarks.gpu_profile", "where a step's time goes, by kernel family"),
    "ort": ("benchmarks.ort_latency", "ONNX latency on onnxruntime's CUDA provider: ours vs "
            "FP32 and peers"),
}


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("gpu", MODES, list(argv or []))
