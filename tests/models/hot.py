"""Zoo models with hot FFN activations, as trained T5 and Llama checkpoints have.

Trained T5 (and some Llama) checkpoints carry FFN intermediates of 1e5 and more, which fp16
cannot hold; random-weight zoo models stay near 1. ``hot_variant`` first gives every Linear
the weight scale of a trained layer (std 1/sqrt(fan_in) instead of HF's 0.02), then scales
each FFN's up-projection by ``s`` and divides its down-projection by ``s``: ReLU and the
SwiGLU product are positively homogeneous in the scaled factor, so the FP32 output is
unchanged while the intermediates (the down-projection's input) reach ``target``.

The factor ``s`` is split between the FFN's input norm weight and the up-projection (sqrt(s)
each, the gate divided by sqrt(s) to compensate), so no weight leaves the fp16 range: the
heat is in the activations, as in the trained models, not in constants (which the rewrite
keeps fp32 on their own account).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from amp_rewrite.errors import UsageError
from tests.models import zoo

if TYPE_CHECKING:
    import torch

# (up-projection, down-projection, gate or None) attribute names per FFN module class
FFN_PROJECTIONS = {
    "T5DenseActDense": ("wi", "wo", None),
    "T5DenseGatedActDense": ("wi_1", "wo", "wi_0"),
    "LlamaMLP": ("up_proj", "down_proj", "gate_proj"),
}
# The norm in front of each FFN: (container class, norm attribute, FFN attribute)
FFN_NORMS = {
    "T5LayerFF": ("layer_norm", "DenseReluDense"),
    "LlamaDecoderLayer": ("post_attention_layernorm", "mlp"),
}
HOT_MODELS = ("t5", "llama")


def _ffns(module: torch.nn.Module) -> list[tuple[torch.nn.Module, str, str, str | None]]:
    return [(m, *FFN_PROJECTIONS[type(m).__name__]) for m in module.modules()
            if type(m).__name__ in FFN_PROJECTIONS]


def _norms(module: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(norm, FFN) pairs: the norm whose output only the FFN reads."""
    pairs = []
    for m in module.modules():
        if type(m).__name__ in FFN_NORMS:
            norm, ffn = FFN_NORMS[type(m).__name__]
            pairs.append((getattr(m, norm), getattr(m, ffn)))
    return pairs


def _trained_scale(module: torch.nn.Module, seed: int) -> None:
    """Linear weights redrawn with std 1/sqrt(fan_in), the scale of trained layers."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.Linear):
                w = torch.randn(m.weight.shape, generator=gen) / m.weight.shape[1] ** 0.5
                m.weight.copy_(w)


def _intermediate_max(model: zoo.ZooModel) -> float:
    """Largest |input of a down-projection| over one forward pass."""
    seen = [0.0]

    def hook(_module, args):
        seen[0] = max(seen[0], float(args[0].abs().max()))

    handles = [getattr(m, down).register_forward_pre_hook(hook)
               for m, _, down, _ in _ffns(model.module)]
    try:
        model.run()
    finally:
        for h in handles:
            h.remove()
    return seen[0]


def hot_variant(name: str, target: float = 3e5, seed: int = 0) -> zoo.ZooModel:
    """Zoo model ``name`` with FFN intermediates scaled to reach ``target`` (same output)."""
    import torch

    model = zoo.build(name, seed=seed)
    ffns, norms = _ffns(model.module), _norms(model.module)
    if not ffns or len(norms) != len(ffns):
        raise UsageError(f"zoo model {name!r} has no FFN of a known shape to heat")
    _trained_scale(model.module, seed)
    scale = target / _intermediate_max(model)
    half = scale ** 0.5
    with torch.no_grad():
        for norm, _ in norms:
            norm.weight.mul_(half)
        for module, up, down, gate in ffns:
            getattr(module, up).weight.mul_(half)
            getattr(module, down).weight.div_(scale)
            if gate is not None:
                getattr(module, gate).weight.div_(half)
    model.name = f"{name}-hot"
    return model


def cached_hot_onnx(name: str, target: float = 3e5, seed: int = 0) -> tuple[Path, dict]:
    """(path, feeds) of the hot variant exported to ONNX, cached beside the zoo exports."""
    model = hot_variant(name, target, seed)
    directory = zoo.default_cache_dir()
    path = directory / f"{name}-hot2-{target:.0e}-seed{seed}-{zoo._cache_tag()}.onnx"
    if not path.is_file():
        zoo.export_model(model, path)
    return path, zoo.onnx_inputs(model, path)
