"""amp_rewrite: a mixed-precision compiler pass for PyTorch (torch.fx) and ONNX.

Public API (imported lazily so ``import amp_rewrite`` stays cheap):
``rewrite_onnx``, ``rewrite``, ``explain``, ``compile`` and ``report`` (torch), ``LossScaler``, ``AmpOptimizer``.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"
_LAZY = {
    "rewrite_onnx": "amp_rewrite.onnx.api",
    "rewrite_onnx_model": "amp_rewrite.onnx.api",
    "rewrite": "amp_rewrite.fx",
    "explain": "amp_rewrite.fx.backend",  # GraphModules as amp_rewrite.fx.explain
    "compile": "amp_rewrite.fx.backend",
    "report": "amp_rewrite.fx.backend",
    "LossScaler": "amp_rewrite.training",
    "AmpOptimizer": "amp_rewrite.training",
}
__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'amp_rewrite' has no attribute {name!r}")
