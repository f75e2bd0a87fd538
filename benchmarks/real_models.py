"""amp_rewrite next to its peers on real architectures (the zoo's ONNX exports).

Every converter gets the same FP32 model (torch.onnx dynamo export, random weights) and is
judged as in the node-test corpus (tests.models.corpus.evaluate): checker, onnxruntime and
onnx.reference against the FP32 onnxruntime outputs, Cast count, share of values in low
precision, conversion time. Prints a table per model and totals per converter; writes JSON.

    python -m benchmarks compare real [--names bert gpt2] [--dtype float16]
        [--converters amp_rewrite onnxconverter_common ort_transformers modelopt_autocast]
        [--json results/compare_real_models.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path

import numpy as np
import onnx
from tqdm import tqdm

from amp_rewrite.onnx import validate
from benchmarks import peers
from tests.models import corpus
from tests.models import zoo

log = logging.getLogger("compare_real_models")
COLUMNS = ["model", "converter", "valid", "ort_rel", "ref_rel", "casts", "low_share", "seconds",
           "failure"]


def zoo_case(name: str) -> corpus.Case:
    """A corpus case whose expected outputs are the FP32 model's own onnxruntime outputs."""
    path = zoo.cached_onnx(name)
    model = onnx.load(path)
    feeds = zoo.onnx_inputs(zoo.build(name), path)
    expected = tuple(validate.run(model, feeds).values())
    return corpus.Case(name, model, feeds, expected, reference_runs=True)


def converters(names: list[str]) -> dict[str, peers.Peer]:
    available = {"amp_rewrite": peers.AMP_REWRITE, **peers.PEERS}
    chosen = {}
    for name in names:
        reason = available[name].unavailable_reason()
        if reason:
            log.warning("%s unavailable: %s", name, reason)
        else:
            chosen[name] = available[name]
    return chosen


def row(model: str, converter: str, result: dict) -> dict:
    return {"model": model, "converter": converter, "valid": result["valid"],
            "ort_rel": result.get("ort_max_rel"), "ref_rel": result.get("reference_max_rel"),
            "casts": result.get("casts"), "low_share": result.get("low_share_count"),
            "seconds": result.get("seconds"), "failure": (result.get("failure") or "")[:60]}


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_table(rows: list[dict]) -> None:
    widths = {c: max(len(c), *(len(fmt(r[c])) for r in rows)) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
    for r in rows:
        print("  ".join(fmt(r[c]).ljust(widths[c]) for c in COLUMNS))


def totals(rows: list[dict]) -> list[dict]:
    out = []
    for conv in dict.fromkeys(r["converter"] for r in rows):
        mine = [r for r in rows if r["converter"] == conv]
        rel = [max(x for x in (r["ort_rel"], r["ref_rel"]) if x is not None) for r in mine
               if r["valid"]]
        out.append({"converter": conv, "models": len(mine),
                    "valid": sum(r["valid"] for r in mine),
                    "median_rel": float(np.median(rel)) if rel else None,
                    "max_rel": max(rel) if rel else None,
                    "casts": sum(r["casts"] or 0 for r in mine),
                    "mean_low_share": float(np.mean([r["low_share"] or 0 for r in mine])),
                    "seconds": sum(r["seconds"] or 0 for r in mine)})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", nargs="*", default=list(zoo.NAMES))
    p.add_argument("--dtype", default="float16")
    p.add_argument("--converters", nargs="*", default=["amp_rewrite", *peers.PEERS])
    p.add_argument("--json", type=Path, default=Path("results/compare_real_models.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("ignore")
    chosen = {n: c for n, c in converters(args.converters).items() if c.supports(args.dtype)}
    rows = []
    for name in tqdm(args.names, desc="models"):
        case = zoo_case(name)
        for conv_name, conv in chosen.items():
            rows.append(row(name, conv_name, corpus.run_converter(case, conv, args.dtype)))
    print_table(rows)
    print()
    summary = totals(rows)
    for s in summary:
        print("  ".join(f"{k}={fmt(v)}" for k, v in s.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"dtype": args.dtype, "rows": rows, "totals": summary},
                                   indent=1, default=str))
    return 0
