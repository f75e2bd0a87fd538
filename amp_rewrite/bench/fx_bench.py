"""``python -m amp_rewrite.bench fx``: the torch.fx rewrite on CPU (speed, models, fusion).

    python -m amp_rewrite.bench fx {table,speed,fusion,autocast,backend,step,budget} ...
"""
from __future__ import annotations

from amp_rewrite.bench import cli

MODES = {
    "table": ("amp_rewrite.bench.fx_table", "zoo models: conversions and error vs autocast"),
    "speed": ("amp_rewrite.bench.fx_speed", "rewrite time on BERT-base or GPT-2 48 layers"),
    "fusion": ("amp_rewrite.bench.fx_fusion", "fused pointwise chains: accuracy, kernels, step"),
    "autocast": ("amp_rewrite.bench.autocast_lists", "PyTorch's autocast test lists"),
    "backend": ("amp_rewrite.bench.fx_backend",
                "the torch.compile backend on the zoo: errors, gradients, recompiles"),
    "step": ("amp_rewrite.bench.cpu_step",
             "training step on this CPU vs autocast, eager and compiled, in rounds"),
    "budget": ("amp_rewrite.bench.fx_budget",
               "accuracy budget on 5 zoo models: held-out error, share, vs autocast"),
}


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("fx", MODES, list(argv or []))
