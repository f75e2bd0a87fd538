"""``python -m benchmarks fx``: the torch.fx rewrite on CPU (speed, models, fusion).

    python -m benchmarks fx {table,speed,fusion,autocast,backend,step,budget} ...
"""
from __future__ import annotations

from benchmarks import cli

MODES = {
    "table": ("benchmarks.fx_table", "zoo models: conversions and error vs autocast"),
    "speed": ("benchmarks.fx_speed", "rewrite time on BERT-base or GPT-2 48 layers"),
    "fusion": ("benchmarks.fx_fusion", "fused pointwise chains: accuracy, kernels, step"),
    "autocast": ("benchmarks.autocast_lists", "PyTorch's autocast test lists"),
    "backend": ("benchmarks.fx_backend",
                "the torch.compile backend on the zoo: errors, gradients, recompiles"),
    "step": ("benchmarks.cpu_step",
             "training step on this CPU vs autocast, eager and compiled, in rounds"),
    "budget": ("benchmarks.fx_budget",
               "accuracy budget on 5 zoo models: held-out error, share, vs autocast"),
}


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("fx", MODES, list(argv or []))
