"""Casts on an If-heavy model: the Silero-VAD-shaped model of
``tests.models.control_flow``, converted to fp16 by amp_rewrite and its peers.

For each converter: Casts in the whole model (subgraphs included), nodes kept fp32 (from
amp_rewrite's report), and the max relative error of each output against the FP32 model
under onnxruntime and onnx.reference, for both sample rates (both top-level branches).

    python -m benchmarks compare control-flow [--json results/control_flow_casts.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path

import onnx

from amp_rewrite.onnx import rewrite_onnx, validate
from benchmarks import peers
from tests.models.control_flow import vad_feeds, vad_like_model

RATES = (16000, 8000)


def count_casts(graph: onnx.GraphProto) -> int:
    return sum(n.op_type == "Cast" for n in graph.node) + sum(
        count_casts(a.g) for n in graph.node for a in n.attribute if a.HasField("g"))


def _errors(fp32: onnx.ModelProto, mixed: onnx.ModelProto) -> dict[str, str]:
    cells = {}
    for sr in RATES:
        feeds = vad_feeds(sr)
        expected = validate.run(fp32, feeds)
        for label, run in (("ort", validate.run), ("ref", validate.reference_run)):
            try:
                errors = validate.compare(expected, run(mixed, feeds))
            except Exception as e:  # a peer's output the evaluator cannot run
                cells[f"{label}@{sr // 1000}k"] = f"fails ({str(e).splitlines()[0][:40]})"
                continue
            bad = any(e.new_nonfinite for e in errors)
            cells[f"{label}@{sr // 1000}k"] = "NaN/Inf" if bad else (
                f"{max(e.max_rel for e in errors):.2g}")
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="results/control_flow_casts.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    fp32 = vad_like_model()
    converters = {"amp_rewrite": lambda m: rewrite_onnx(m)}
    for name in ("ort_transformers", "onnxconverter_common"):
        if peers.PEERS[name].unavailable_reason() is None:
            converters[name] = lambda m, peer=peers.PEERS[name]: peer(m, "float16")
    rows = []
    for name, convert in converters.items():
        mixed = convert(fp32)
        rows.append({"converter": name, "casts": count_casts(mixed.graph), **_errors(fp32, mixed)})
    columns = list(rows[0])
    print("  ".join(f"{c:<18}" for c in columns))
    for r in rows:
        print("  ".join(f"{str(r.get(c, '')):<18}" for c in columns))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    return 0
