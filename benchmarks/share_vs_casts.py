"""Low-precision share against Cast count on ONNX's operator tests, paired with each peer.

``python -m benchmarks compare corpus`` sums every converter over the cases it
converted, so a peer that fails a case drops it from its totals. This compares on equal
terms: for each peer, only
the cases that peer converts to a *valid* model, and it splits them by whether the case holds
an op the rules deny (Exp, Pow, ReduceSum, ...), which amp_rewrite never runs low. amp_rewrite
runs at each ``--savings-weight`` (β) given: 0 (the default) spends no cast that saves no
traffic; 1 also runs an op low when the traffic it saves pays for its casts.

    python -m benchmarks compare share [--betas 0 1] [--peers modelopt_autocast]
        [--json results/share_vs_casts.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from tqdm import tqdm

import amp_rewrite
from amp_rewrite.core import load_rules
from amp_rewrite.core.precision import OpClass
from benchmarks import peers
from tests.models import corpus

FP32_CLASSES = {OpClass.DENY, OpClass.UNLISTED}


def holds_fp32_op(case: corpus.Case, rules) -> bool:
    """Whether the case has an op the rules keep fp32 (deny, or in no list)."""
    keys = (n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
            for g in corpus.iter_graphs(case.model.graph) for n in g.node)
    return any(rules.class_of(k) in FP32_CLASSES for k in keys)


def amp_rewrite_at(beta: float):
    def convert(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
        return amp_rewrite.rewrite_onnx(model, dtype=dtype, savings_weight=beta, check=False)
    return convert


def run(name: str, convert, cases: list[corpus.Case]) -> dict[str, dict[str, Any]]:
    results = (corpus.run_converter(c, convert, "float16") for c in cases)
    return {r["case"]: r for r in tqdm(results, total=len(cases), desc=name, leave=False)}


def totals(results: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    rows = [results[n] for n in names]
    shares = [r["low_share_count"] for r in rows if r.get("low_share_count") is not None]
    return {"cases": len(rows), "valid": sum(r["valid"] for r in rows),
            "casts": sum(r.get("casts", 0) for r in rows),
            "low_share": round(float(np.mean(shares)), 3) if shares else None}


def paired_rows(runs: dict[str, dict], peer: str, fp32_cases: set[str]) -> list[dict[str, Any]]:
    valid = [c for c, r in runs[peer].items() if r["valid"]]
    subsets = {"all": valid, "no deny op": [c for c in valid if c not in fp32_cases],
               "deny op": [c for c in valid if c in fp32_cases]}
    return [{"paired with": peer, "subset": label, "converter": name, **totals(results, names)}
            for label, names in subsets.items() for name, results in runs.items()
            if name == peer or name.startswith("amp_rewrite")]


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r[c]).ljust(widths[c]) for c in columns))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--betas", nargs="+", type=float, default=[0.0, 1.0])
    p.add_argument("--peers", nargs="*", default=list(peers.PEERS), choices=list(peers.PEERS))
    p.add_argument("--json", type=Path, default=Path("results/share_vs_casts.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.simplefilter("ignore")
    cases = corpus.collect_float_cases()
    rules = load_rules("onnx")
    fp32_cases = {c.name for c in cases if holds_fp32_op(c, rules)}
    runs = {f"amp_rewrite β={b:g}": run(f"amp_rewrite β={b:g}", amp_rewrite_at(b), cases)
            for b in args.betas}
    for name in args.peers:
        why = peers.PEERS[name].unavailable_reason()
        if why:
            print(f"skipped {name}: {why}")
            continue
        runs[name] = run(name, peers.PEERS[name], cases)
    overall = [{"converter": n, **totals(r, list(r))} for n, r in runs.items()]
    paired = [row for peer in runs if peer in peers.PEERS
              for row in paired_rows(runs, peer, fp32_cases)]
    print(f"{len(cases)} cases, {len(fp32_cases)} hold a deny op (fp16)")
    print_table(overall)
    if paired:
        print()
        print_table(paired)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"overall": overall, "paired": paired,
                                    "results": runs}, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0
