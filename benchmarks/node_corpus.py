"""Run FP32 -> FP16/BF16 converters over ONNX's operator tests and compare them.

The corpus is every ``onnx.backend.test`` node test that holds a float32 tensor and whose
FP32 model onnxruntime (CPU) reproduces (see ``tests.models.corpus``). Each converter
(amp_rewrite and the peers of ``benchmarks.peers``) converts every case to each
dtype it supports; the converted model must pass ``onnx.checker`` (full check), and match
the expected outputs under onnxruntime and under ``onnx.reference.ReferenceEvaluator``
(per-dtype tolerances; NaN/Inf where FP32 had none fails). Prints one table row per
converter and dtype, writes every case's result as JSON and the failures as text.

    python -m benchmarks compare corpus [--converters amp_rewrite onnxconverter_common]
        [--dtypes float16 bfloat16] [--jobs 2] [--json results/onnx_node_corpus.json]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import math
import multiprocessing
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import peers
from tests.models import corpus

COLUMNS = [  # (header, summary key, format)
    ("converter", "converter", "{}"),
    ("dtype", "dtype", "{}"),
    ("cases", "cases", "{}"),
    ("conv%", "converted", "pct"),
    ("checker%", "checker_valid", "pct"),
    ("ort%", "ort_valid", "pct"),
    ("ref%", "reference_valid", "pct"),
    ("ref n/a", "reference_not_applicable", "{}"),
    ("valid%", "valid", "pct"),
    ("med rel err", "median_rel_err", "{:.2e}"),
    ("max rel err", "max_rel_err", "{:.2e}"),
    ("casts", "casts", "{}"),
    ("low share", "mean_low_share", "{:.2f}"),
    ("low elems", "mean_low_share_elems", "{:.2f}"),
    ("time s", "seconds", "{:.1f}"),
]


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "pct":
        return f"{100 * value:.1f}"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return fmt.format(value)


def format_table(rows: list[dict[str, Any]]) -> str:
    header = [h for h, _, _ in COLUMNS]
    body = [[_cell(row.get(key), fmt) for _, key, fmt in COLUMNS] for row in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _run_one(task: tuple[str, str, corpus.Case]) -> dict[str, Any]:
    name, dtype, case = task
    return corpus.run_converter(case, peers.CONVERTERS[name], dtype)


def _results(
    name: str, dtype: str, cases: list[corpus.Case], pool: concurrent.futures.Executor | None
) -> Iterator[dict[str, Any]]:
    tasks = [(name, dtype, case) for case in cases]
    if pool is None:
        return map(_run_one, tasks)
    return pool.map(_run_one, tasks, chunksize=8)


def run_converter(
    name: str, dtype: str, cases: list[corpus.Case], pool: concurrent.futures.Executor | None
) -> list[dict[str, Any]]:
    progress = tqdm(_results(name, dtype, cases, pool), total=len(cases), desc=f"{name} {dtype}",
                    unit="case", leave=False)
    return list(progress)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--converters", nargs="+", default=list(peers.CONVERTERS),
                        choices=list(peers.CONVERTERS))
    parser.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"],
                        choices=["float16", "bfloat16"])
    parser.add_argument("--filter", default="", help="only cases whose name contains this")
    parser.add_argument("--limit", type=int, default=0, help="only the first N cases (0: all)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="worker processes (spawned: ORT is not fork-safe); 1 runs inline")
    parser.add_argument("--json", type=Path, default=Path("results/onnx_node_corpus.json"))
    parser.add_argument("--failures", type=Path, default=None,
                        help="failure list (default: OUT with suffix _failures.txt)")
    return parser.parse_args(argv)


def _select_cases(args: argparse.Namespace) -> list[corpus.Case]:
    cases = [c for c in corpus.collect_float_cases() if args.filter in c.name]
    return cases[: args.limit] if args.limit else cases


def jsonable(value: Any) -> Any:
    """Strict JSON: non-finite floats become the strings "inf", "-inf", "nan"."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def _write_failures(path: Path, runs: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    lines = []
    for (name, dtype), results in runs.items():
        failed = corpus.failures(results)
        lines.append(f"== {name} {dtype}: {len(failed)} of {len(results)} cases fail")
        lines += [f"{case}: {reason}" for case, reason in failed]
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    start = time.perf_counter()
    built = corpus.build_corpus()
    cases = _select_cases(args)
    print(f"corpus: {built.total} node tests, {built.float_cases} with float32, "
          f"{len(built.cases)} in the FP32 baseline (ORT reproduces them), "
          f"{sum(c.reference_runs for c in built.cases)} also under ReferenceEvaluator; "
          f"running {len(cases)} ({time.perf_counter() - start:.1f} s to build)")
    availability = peers.available_peers(args.converters)
    for name, reason in availability.items():
        if reason:
            print(f"skipped {name}: {reason}")
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    pool = None
    if args.jobs > 1:
        pool = concurrent.futures.ProcessPoolExecutor(
            args.jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        for name in args.converters:
            if availability[name]:
                continue
            for dtype in args.dtypes:
                if peers.CONVERTERS[name].supports(dtype):
                    runs[(name, dtype)] = run_converter(name, dtype, cases, pool)
    finally:
        if pool is not None:
            pool.shutdown()
    rows = [{"converter": n, "dtype": d, **corpus.summarize(r)} for (n, d), r in runs.items()]
    print(format_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    failures_path = args.failures or args.json.with_name(args.json.stem + "_failures.txt")
    _write_failures(failures_path, runs)
    report = {
        "corpus": {"total": built.total, "float_cases": built.float_cases,
                   "baseline": len(built.cases),
                   "reference_runs": sum(c.reference_runs for c in built.cases),
                   "run": len(cases), "excluded": built.excluded},
        "tolerances": {k: vars(v) for k, v in corpus.TOLERANCES.items()},
        "unavailable": {n: r for n, r in availability.items() if r},
        "summary": rows,
        "results": {f"{n}/{d}": r for (n, d), r in runs.items()},
    }
    args.json.write_text(json.dumps(jsonable(report), indent=1, default=str))
    print(f"wrote {args.json} and {failures_path} ({time.perf_counter() - start:.0f} s)")
    return 0
