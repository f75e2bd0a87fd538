"""Measurements shared by the fx tests and tools: conversions executed, error vs FP32.

``ConversionCounter`` is a ``TorchDispatchMode`` that counts dtype conversions as the kernels
see them: ``aten._to_copy`` / ``prims.convert_element_type`` calls that change the dtype, and
``aten.copy_`` between dtypes. It sits below autocast in the dispatcher, so it sees the casts
``torch.autocast`` inserts as well as the ones in a rewritten graph.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from amp_rewrite.core.metric import worst_relative_error

_CONVERSIONS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}


class ConversionCounter(TorchDispatchMode):
    """Counts executed dtype conversions (``count``) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _changes_dtype(func, args, out):
            self.count += 1
        return out


def _changes_dtype(func: Any, args: tuple, out: Any) -> bool:
    if func in _CONVERSIONS:
        return isinstance(out, torch.Tensor) and out.dtype != args[0].dtype
    if func is torch.ops.aten.copy_.default:
        return args[0].dtype != args[1].dtype
    return False


def count_conversions(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Run ``fn()`` and return (dtype conversions executed, its result)."""
    with ConversionCounter() as counter:
        out = fn()
    return counter.count, out


def float_outputs(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a (nested) model output, in order."""
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def relative_error(out: Any, ref: Any) -> float:
    """The product's metric (``amp_rewrite.core.metric``, what ``max_error=`` measures) of
    ``out``'s floating outputs against ``ref``'s, in order."""
    return worst_relative_error(_arrays(ref), _arrays(out))


def _arrays(out: Any) -> list:
    # float32 holds every fp16/bf16 value exactly; numpy has no bfloat16 of torch's
    return [t.detach().float().cpu().numpy() for t in float_outputs(out)]


@dataclass(frozen=True)
class Comparison:
    """Ours vs ``torch.autocast`` on the same inputs: conversions executed and error vs FP32."""

    conversions: int
    autocast_conversions: int
    error: float
    autocast_error: float


def compare_with_autocast(module: torch.nn.Module, rewritten: torch.nn.Module, args: tuple,
                          kwargs: dict, dtype: torch.dtype) -> Comparison:
    """Forward FP32, autocast (CPU) and rewritten models once each, without autograd."""
    with torch.no_grad():
        ref = module(*args, **kwargs)
        ours_n, ours = count_conversions(lambda: rewritten(*args, **kwargs))
        with torch.autocast(device_type="cpu", dtype=dtype):
            auto_n, auto = count_conversions(lambda: module(*args, **kwargs))
    return Comparison(ours_n, auto_n, relative_error(ours, ref), relative_error(auto, ref))
