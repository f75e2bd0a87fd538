"""Hot FFN activations: T5/Llama zoo variants whose FFN intermediates reach ~3e5.

Builds ``tests.models.hot`` variants (FP32 output unchanged), rewrites them to fp16 with
and without ``--calibrate`` (the variant's own inputs as calibration data), and compares each
output with the FP32 model under onnxruntime and under onnx.reference (true fp16 rounding).
``calibrate+clamp`` stores constants clamped as the old default did, so calibration alone has to
keep the model finite; ort_transformers (onnxruntime's float16 converter) runs beside it.

    AMP_REWRITE_CACHE=/work/cache/zoo python -m benchmarks compare hot \
        [--names t5 llama] [--target 3e5] [--json results/hot_activations.json]
"""
from __future__ import annotations

import argparse
import inspect
import json
import logging
import warnings
from pathlib import Path

import onnx

from amp_rewrite.onnx import rewrite_onnx, validate
from benchmarks import peers
from tests.models import hot

COLUMNS = ["model", "converter", "casts", "ort_rel", "ref_rel", "nonfinite"]


def _modes(feeds: dict) -> dict:
    """Converter name -> ModelProto -> ModelProto."""
    clamp = "clamp_constants" in inspect.signature(
        __import__("amp_rewrite.onnx.api", fromlist=["x"]).rewrite_onnx_model).parameters
    modes = {
        "amp_rewrite": lambda m: rewrite_onnx(m),
        "amp_rewrite --calibrate": lambda m: rewrite_onnx(m, calibration_data=feeds),
    }
    if clamp:  # the old default, where clamping was the only behaviour
        modes["amp_rewrite --calibrate --clamp-constants"] = lambda m: rewrite_onnx(
            m, calibration_data=feeds, clamp_constants=True)
    if peers.PEERS["ort_transformers"].unavailable_reason() is None:
        modes["ort_transformers"] = lambda m: peers.PEERS["ort_transformers"](m, "float16")
    return modes


def evaluate(name: str, target: float) -> list[dict]:
    path, feeds = hot.cached_hot_onnx(name, target)
    fp32 = onnx.load(path)
    expected = validate.run(fp32, feeds)
    peak = max(v for v in validate.value_maxima(fp32, feeds).values() if v < 1e38)
    rows = []
    for label, convert in _modes(feeds).items():
        mixed = convert(fp32)
        errors = {run: validate.compare(expected, fn(mixed, feeds))
                  for run, fn in (("ort", validate.run), ("ref", validate.reference_run))}
        rows.append({
            "model": f"{name} (peak {peak:.2g})", "converter": label,
            "casts": sum(n.op_type == "Cast" for n in mixed.graph.node),
            "ort_rel": max(e.max_rel for e in errors["ort"]),
            "ref_rel": max(e.max_rel for e in errors["ref"]),
            "nonfinite": ",".join(run for run, es in errors.items()
                                  if any(e.new_nonfinite for e in es)) or "-",
        })
    return rows


def print_table(rows: list[dict]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
    for r in rows:
        print("  ".join(_fmt(r[c]).ljust(widths[c]) for c in COLUMNS))


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", nargs="+", default=list(hot.HOT_MODELS))
    parser.add_argument("--target", type=float, default=3e5)
    parser.add_argument("--json", default="results/hot_activations.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = [r for name in args.names for r in evaluate(name, args.target)]
    print_table(rows)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return 0
