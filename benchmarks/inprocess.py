"""In-process rewrite time of the chains at two sizes, and the growth between them.

``rewrite_onnx(model, check=False)`` on chains of :mod:`benchmarks.chains` built once,
sizes taking turns within each round (:func:`~benchmarks.timing.round_robin`), one
warm-up per size; medians of ``--repeats``. The target is < 3 s at 50k and a growth
10k -> 50k of at most 5.5x.

    python -m benchmarks speed inprocess [--sizes 10000 50000]
        [--variants residual residual_deny] [--repeats 5] [--json FILE]
"""
from __future__ import annotations

import argparse
import statistics

import amp_rewrite
from benchmarks import cli
from benchmarks.chains import VARIANTS, build_chain
from benchmarks.timing import probe_line, round_robin


def measure(variant: str, small: int, large: int, repeats: int) -> tuple[dict, list[float]]:
    models = {n: build_chain(n, variant) for n in (small, large)}
    rewrites = {str(n): (lambda m=m: amp_rewrite.rewrite_onnx(m, check=False))
                for n, m in models.items()}
    round_robin(rewrites, 1)  # warm-up
    runs, _, probes = round_robin(rewrites, repeats)
    medians = {n: statistics.median(r) for n, r in runs.items()}
    return {"variant": variant, "runs": runs, "median_s": medians,
            "growth": medians[str(large)] / medians[str(small)]}, probes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs=2, default=[10000, 50000])
    p.add_argument("--variants", nargs="+", default=["residual", "residual_deny"],
                   choices=VARIANTS)
    p.add_argument("--repeats", type=int, default=5)
    cli.add_json_argument(p)
    args = p.parse_args(argv)
    cli.setup_logging()
    small, large = args.sizes
    rows, probes = [], []
    for variant in args.variants:
        row, row_probes = measure(variant, small, large, args.repeats)
        rows.append(row)
        probes += row_probes
    print(f"{'variant':14} {small:>8} {large:>8}  growth")
    for r in rows:
        m = r["median_s"]
        print(f"{r['variant']:14} {m[str(small)]:7.2f}s {m[str(large)]:7.2f}s  "
              f"{r['growth']:.2f}x")
    print(probe_line(probes))
    cli.write_json(args.json, {"rows": rows, "host_probes_s": probes})
    return 0
