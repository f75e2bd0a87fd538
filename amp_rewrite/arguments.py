"""Argument checks shared by the torch entry points (``rewrite`` and ``AmpOptimizer``): one
place decides the accepted spellings, and a wrong value fails at the call with a one-line
``ArgumentError`` (a ``UsageError`` and a ``ValueError``).
"""
from __future__ import annotations

from typing import Any

import torch

from amp_rewrite.core import LowDtype
from amp_rewrite.core.precision import MIXED
# the framework-free checks, shared with the ONNX path
from amp_rewrite.core.options import (ArgumentError, file_path, flag, max_error,  # noqa: F401
                                      max_evaluations, patterns)
from amp_rewrite.errors import UsageError

LOW_DTYPES = {LowDtype.FLOAT16: torch.float16, LowDtype.BFLOAT16: torch.bfloat16}
DTYPE_SPELLINGS = "torch.float16, torch.bfloat16, 'fp16', 'bf16', 'float16', 'bfloat16', 'half'"
# Device types the rewrite has kernel facts for (rules/torch.toml: CUDA; torch_cpu.toml: CPU).
DEVICE_TYPES = ("cuda", "cpu")
MODES = ("train", "eval", "both")


def low_dtype(value: object, *, name: str = "dtype") -> torch.dtype:
    """The torch low-precision dtype for any accepted spelling; float32 and others refused."""
    if isinstance(value, torch.dtype) and value not in LOW_DTYPES.values():
        raise ArgumentError(f"{name}={value}: expected a low-precision dtype "
                            f"({DTYPE_SPELLINGS})")
    try:
        return LOW_DTYPES[LowDtype.parse(value)]
    except UsageError:
        raise ArgumentError(f"{name}={value!r}: expected one of {DTYPE_SPELLINGS}") from None


def plan_dtype(value: object, *, name: str = "dtype") -> torch.dtype | str:
    """``low_dtype``, or ``"mixed"``: fp16, bf16 or fp32 per node from one exact plan
    (``core/multilabel.plan_mixed``)."""
    if isinstance(value, str) and value.lower() == MIXED:
        return MIXED
    try:
        return low_dtype(value, name=name)
    except ArgumentError as e:
        raise ArgumentError(f"{e} or 'mixed'") from None


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
