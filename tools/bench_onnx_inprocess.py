"""In-process rewrite time of the residual chains at two sizes, and the growth between them.

``rewrite_onnx(model, check=False)`` on chains of ``tools/bench_onnx_speed.py`` built once,
sizes taking turns within each round (so a drift in the host's speed hits both alike), one
warm-up per size; medians of ``--repeats``. Prints a table with the host probe and writes
JSON. Issue 16 asks for < 3 s at 50k and a growth 10k → 50k of at most 5.5×.

    PYTHONPATH=. python tools/bench_onnx_inprocess.py [--sizes 10000 50000]
        [--variants residual residual_deny] [--repeats 5] [--out results/bench_onnx_inprocess.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import amp_rewrite
from bench_onnx_speed import build_chain, host_probe  # tools/ is on sys.path as a script


def timed_rewrite(model) -> float:
    start = time.perf_counter()
    amp_rewrite.rewrite_onnx(model, check=False)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs=2, default=[10000, 50000])
    p.add_argument("--variants", nargs="+", default=["residual", "residual_deny"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("results/bench_onnx_inprocess.json"))
    args = p.parse_args(argv)
    small, large = args.sizes
    rows, probes = [], []
    for variant in args.variants:
        models = {n: build_chain(n, variant) for n in (small, large)}
        runs: dict[int, list[float]] = {small: [], large: []}
        for model in models.values():
            timed_rewrite(model)  # warm-up
        for _ in range(args.repeats):
            probes.append(host_probe())
            for n, model in models.items():
                runs[n].append(timed_rewrite(model))
        medians = {n: statistics.median(r) for n, r in runs.items()}
        rows.append({"variant": variant, "runs": {str(n): r for n, r in runs.items()},
                     "median_s": {str(n): m for n, m in medians.items()},
                     "growth": medians[large] / medians[small]})
    print(f"{'variant':14} {small:>8} {large:>8}  growth")
    for r in rows:
        m = r["median_s"]
        print(f"{r['variant']:14} {m[str(small)]:7.2f}s {m[str(large)]:7.2f}s  "
              f"{r['growth']:.2f}x")
    print(f"host probe per round: {min(probes):.2f} to {max(probes):.2f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "host_probes_s": probes}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
