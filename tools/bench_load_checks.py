"""Cost of the load-time safety checks (issue 17) within a whole rewrite.

On the synthetic chains of ``bench_onnx_speed.py`` (MatMul -> Add -> Relu blocks), times
``rewrite_onnx`` (ModelProto to ModelProto) and, on the same model, the two checks that
``load_model`` adds: ``_check_tensors`` (one pass over the initializers: raw_data sizes,
external extents) and ``_scan_nodes`` (one walk over the nodes: text repair, dtype
attributes, Constant sizes). Medians of ``--repeats`` runs, interleaved.

    .venv/bin/python tools/bench_load_checks.py [--sizes 1000 10000] [--repeats 5]
        [--out results/bench_load_checks.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_onnx_speed import build_chain  # noqa: E402

from amp_rewrite.onnx import io  # noqa: E402
from amp_rewrite.onnx.api import rewrite_onnx  # noqa: E402


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(n_nodes: int, repeats: int) -> dict:
    proto = build_chain(n_nodes, "plain")
    model = io.load_model(proto)
    rewrite_onnx(proto)  # warm-up: first-call imports are not timed
    whole, checks = [], []
    for _ in range(repeats):
        whole.append(_timed(lambda: rewrite_onnx(proto)))
        checks.append(_timed(lambda: (io._check_tensors(proto, "bench", None),
                                      io._scan_nodes(model, "bench",
                                                     list(io.walk_graphs(model.graph))))))
    rewrite_s, checks_s = statistics.median(whole), statistics.median(checks)
    return {"nodes": n_nodes, "rewrite_s": round(rewrite_s, 4), "checks_s": round(checks_s, 4),
            "share": round(checks_s / rewrite_s, 4)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("results/bench_load_checks.json"))
    args = ap.parse_args()
    rows = [measure(n, args.repeats) for n in args.sizes]
    print(f"{'nodes':>7} {'rewrite s':>10} {'checks s':>9} {'share':>7}")
    for r in rows:
        print(f"{r['nodes']:>7} {r['rewrite_s']:>10.3f} {r['checks_s']:>9.4f} {r['share']:>7.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
