"""``python -m amp_rewrite.bench gpu``: training steps, GEMMs and step profiles on a GPU.

``tools/gpu_session.sh`` runs them in one device call (its sections have time limits).

    python -m amp_rewrite.bench gpu {train,gemm,profile} ...
"""
from __future__ import annotations

from amp_rewrite.bench import cli

MODES = {
    "train": ("amp_rewrite.bench.gpu_training", "training-step and forward time per variant"),
    "gemm": ("amp_rewrite.bench.gpu_gemm", "misaligned GEMMs against their padded shapes"),
    "profile": ("amp_rewrite.bench.gpu_profile", "where a step's time goes, by kernel family"),
}


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("gpu", MODES, list(argv or []))
