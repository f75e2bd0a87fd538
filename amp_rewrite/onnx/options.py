"""The ONNX path's options, declared once (``core/options.py``): ``rewrite_onnx_model`` and
``rewrite_onnx`` take them as keywords, the CLI's flags are made from them, and each is
checked here, at the call, in one line."""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from amp_rewrite.core import LowDtype, PadPolicy
from amp_rewrite.core import options as o
from amp_rewrite.core.precision import MIXED
from amp_rewrite.errors import UsageError


def _plan_dtype(value: Any, name: str) -> LowDtype | str:
    """A LowDtype, or ``MIXED`` ('mixed')."""
    try:
        return LowDtype.parse_plan(value)
    except UsageError as e:
        raise o.ArgumentError(f"{name}={value!r}: {e} or mixed") from None


def _calibration_data(value: Any, name: str) -> Mapping | str | os.PathLike | None:
    if value is not None and not isinstance(value, (Mapping, str, os.PathLike)):
        raise o.ArgumentError(f"{name}={value!r}: expected a dict of input name -> array or "
                              "the path of an .npz file")
    return value


def _pad(value: Any, name: str) -> bool | PadPolicy:
    if not isinstance(value, (bool, PadPolicy)):
        raise o.ArgumentError(f"{name}={value!r}: expected True, False or a PadPolicy")
    return value


TARGETS = ("ort", "onnx")


@dataclass(frozen=True)
class RewriteOptions:
    """What a user can ask of the ONNX rewrite (keywords; the CLI's flags in ``cli``)."""

    dtype: LowDtype | str = o.option(
        LowDtype.FLOAT16, check=_plan_dtype,
        help="low precision: fp16, bf16, or mixed (each node fp16, bf16 or fp32 from one "
             "exact plan: fp16 where it fits, bf16 where fp16's range is short, fp32 where "
             "neither will do)",
        cli=o.Cli(choices=("fp16", "bf16", "float16", "bfloat16", MIXED), default="fp16",
                  has_default=True))
    keep_io_types: bool = o.option(
        True, check=o.flag, cli=o.Cli("false"),
        help="graph inputs and outputs keep their dtypes")
    rules: tuple[str, ...] = o.option(
        (), check=o.paths, cli=o.Cli("append", metavar="FILE"),
        help="rule overlay TOML files (later files win)")
    keep_fp32: tuple[str, ...] = o.option(
        (), check=o.patterns, cli=o.Cli("append", metavar="PATTERN"),
        help="node-name globs pinned to fp32")
    low_io: tuple[str, ...] = o.option(
        (), check=o.comma_patterns, cli=o.Cli("append", metavar="PATTERN"),
        help="graph inputs/outputs whose names match (fnmatch, comma-separated; e.g. "
             "'past_key_values.*,present.*') become low precision: a KV cache")
    calibration_data: Any = o.option(
        None, check=_calibration_data, cli=o.Cli(name="--calibrate", metavar="DATA.npz"),
        help="inputs for an FP32 run (dict or .npz); values beyond the threshold stay fp32")
    calibration_threshold: float | None = o.option(
        None, check=o.positive_number, cli=o.Cli(name="--threshold", type=float, metavar="M"),
        help="calibration magnitude limit (default: 4096 for fp16, 1e37 for bf16; mixed: "
             "values above it run bf16, above 1e37 fp32)")
    max_error: float | None = o.option(
        None, check=o.max_error, cli=o.Cli(type=float, metavar="E"),
        help="accuracy budget: the most low-precision compute whose relative output error "
             "(the --validate metric) on the calibration data, or seeded random inputs, "
             "stays within E; the error on held-out inputs is reported too")
    max_evaluations: int = o.option(
        25, check=o.max_evaluations, cli=o.Cli(type=int, metavar="N"),
        help="with max_error: plans measured at most")
    emit_rules: str | os.PathLike | None = o.option(
        None, check=o.file_path, cli=o.Cli(metavar="FILE.toml"),
        help="with max_error: write a rule overlay that reproduces the budgeted plan "
             "without the search or the data")
    savings_weight: float = o.option(
        0.0, check=o.optional_number, cli=o.Cli(type=float, metavar="BETA"),
        help="price of a byte of traffic saved vs a byte cast: 0 gives the fewest cast "
             "bytes; 1 also runs ops low whose savings pay their casts")
    opset: int | None = o.option(
        None, check=o.optional_int, cli=o.Cli(type=int, metavar="N"),
        help="convert to this ai.onnx opset first (bf16 Conv/BatchNorm/LSTM need 22)")
    keep_opset: bool = o.option(
        False, check=o.flag, cli=o.Cli("true"),
        help="with bf16: refuse (exit 3) a model whose opset does not admit bf16 for its "
             "compute ops, instead of converting it to the opset that does; with mixed: "
             "keep the opset, and ops that need range but lack bf16 there run fp32")
    clamp_constants: bool = o.option(
        False, check=o.flag, cli=o.Cli("true"),
        help="store constants beyond the low dtype's range clamped (default: keep them and "
             "their readers fp32)")
    pad: bool | PadPolicy = o.option(
        True, check=_pad, cli=o.Cli("false"),
        help="pad low GEMM K/N and conv channels to multiples of 8 where the padding cost "
             "model says it pays (a PadPolicy in Python pads with that policy)")
    target: str = o.option(
        "ort", check=o.choice(TARGETS), cli=o.Cli(choices=TARGETS),
        help="the runtime: onnxruntime (ort: fused ops may be its contrib ops, and bf16 "
             "only where its CUDA provider has a bf16 kernel) or another (onnx: standard ONNX "
             "ops of the model's opset, bf16 wherever the schema admits it; TensorRT)")
    fuse: bool = o.option(
        True, check=o.flag, cli=o.Cli("false"),
        help="pattern fusion before the plan (LayerNorm, RMSNorm, GELU, attention)")
    check: bool = o.option(
        True, check=o.flag, help="run the full ONNX checker on the output")

    @classmethod
    def of(cls, keywords: Mapping[str, Any], where: str = "rewrite_onnx_model",
           names: Mapping[str, str] | None = None) -> RewriteOptions:
        """Checked options; ``names``: the user's spellings (the CLI's flags)."""
        options = o.checked(cls, keywords, where=where, names=names)
        if options.emit_rules is not None and options.max_error is None:
            names = names or {}
            raise o.ArgumentError(f"{names.get('emit_rules', 'emit_rules')} writes the pins of "
                                  "an accuracy budget: add "
                                  f"{names.get('max_error', 'max_error')} E")
        return options
