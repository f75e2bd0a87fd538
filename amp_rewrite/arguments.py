"""Argument checks shared by the torch entry points (``rewrite`` and ``AmpOptimizer``): one
place decides the accepted spellings, and a wrong value fails at the call with a one-line
``ArgumentError`` (a ``UsageError`` and a ``ValueError``).
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch

from amp_rewrite.core import LowDtype
from amp_rewrite.errors import UsageError

LOW_DTYPES = {LowDtype.FLOAT16: torch.float16, LowDtype.BFLOAT16: torch.bfloat16}
DTYPE_SPELLINGS = "torch.float16, torch.bfloat16, 'fp16', 'bf16', 'float16', 'bfloat16', 'half'"
# Device types the rewrite has kernel facts for (rules/torch.toml: CUDA; torch_cpu.toml: CPU).
DEVICE_TYPES = ("cuda", "cpu")
MODES = ("train", "eval", "both")


class ArgumentError(UsageError, ValueError):
    """A public function got an argument of the wrong type or value."""


def low_dtype(value: object, *, name: str = "dtype") -> torch.dtype:
    """The torch low-precision dtype for any accepted spelling; float32 and others refused."""
    if isinstance(value, torch.dtype) and value not in LOW_DTYPES.values():
        raise ArgumentError(f"{name}={value}: expected a low-precision dtype "
                            f"({DTYPE_SPELLINGS})")
    try:
        return LOW_DTYPES[LowDtype.parse(value)]
    except UsageError:
        raise ArgumentError(f"{name}={value!r}: expected one of {DTYPE_SPELLINGS}") from None


def flag(value: object, *, name: str) -> bool:
    """A real bool: ``keep_io_types="no"`` is truthy and would silently mean True."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name}={value!r}: expected True or False")
    return value


def patterns(value: object, *, name: str) -> list[str]:
    """A list of glob strings from a string or an iterable of strings."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Iterable):
        raise ArgumentError(f"{name}={value!r}: expected a string or a list of strings")
    items = list(value)
    bad = [item for item in items if not isinstance(item, str)]
    if bad:
        raise ArgumentError(f"{name} holds {bad[0]!r} ({type(bad[0]).__name__}): expected "
                            "strings")
    return items


def device_type(value: object, *, name: str = "device") -> str | None:
    """'cuda' or 'cpu' from a string or ``torch.device`` ('cuda:1' → 'cuda'); None passes."""
    if value is None:
        return None
    if isinstance(value, torch.device):
        kind = value.type
    elif isinstance(value, str):
        kind = value.split(":", 1)[0].lower()
    else:
        raise ArgumentError(f"{name}={value!r}: expected a device string such as 'cuda' or "
                            "'cpu'")
    if kind not in DEVICE_TYPES:
        raise ArgumentError(f"{name}={value!r}: amp_rewrite has kernel facts for "
                            f"{', '.join(DEVICE_TYPES)} only")
    return kind


def choice(value: Any, options: tuple[str, ...], *, name: str) -> str:
    if value not in options:
        raise ArgumentError(f"{name}={value!r}: expected one of {', '.join(map(repr, options))}")
    return value


def max_error(value: object, *, name: str = "max_error") -> float:
    """A finite number >= 0: the accuracy budget (relative output error)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ArgumentError(f"{name}={value!r}: expected a finite number >= 0 (a relative "
                            "output error such as 1e-2)")
    return float(value)


def max_evaluations(value: object, *, name: str = "max_evaluations") -> int:
    """An int >= 2: the default plan and the all-pinned plan are always measured."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:
        raise ArgumentError(f"{name}={value!r}: expected an int >= 2 (the default plan and "
                            "the all-fp32 plan are measured first)")
    return value


def batches(value: object, *, name: str = "calibration_data") -> list[tuple]:
    """A non-empty list of batches, each a tensor or a tuple of the forward's arguments
    (tensors); a lone tuple would be ambiguous (one batch, or batches of one tensor)."""
    if not isinstance(value, list) or not value:
        raise ArgumentError(f"{name}: expected a non-empty list of batches (each a tensor or "
                            f"a tuple of tensors), got {type(value).__name__}")
    out = []
    for i, batch in enumerate(value):
        args = (batch,) if isinstance(batch, torch.Tensor) else batch
        if not isinstance(args, (tuple, list)) or not all(
                isinstance(a, torch.Tensor) for a in args):
            raise ArgumentError(f"{name}[{i}]: expected a tensor or a tuple of tensors, got "
                                f"{type(batch).__name__}")
        out.append(tuple(args))
    return out


def file_path(value: object, *, name: str) -> str | os.PathLike | None:
    """A path (str or os.PathLike); None passes."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ArgumentError(f"{name}={value!r}: expected a file path")
    return value
