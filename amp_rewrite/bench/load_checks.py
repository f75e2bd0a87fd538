"""Cost of the load-time safety checks within a whole rewrite.

On the ``plain`` chains of :mod:`amp_rewrite.bench.chains`, times ``rewrite_onnx``
(ModelProto to ModelProto) and, on the same model, the two checks that ``load_model`` adds:
``_check_tensors`` (one pass over the initializers: raw_data sizes, external extents) and
``_scan_nodes`` (one walk over the nodes: text repair, dtype attributes, Constant sizes).
Medians of ``--repeats`` runs, interleaved.

    python -m amp_rewrite.bench speed checks [--sizes 1000 10000] [--repeats 5] [--json FILE]
"""
from __future__ import annotations

import argparse
import statistics

from amp_rewrite.bench import cli
from amp_rewrite.bench.chains import build_chain
from amp_rewrite.bench.timing import round_robin
from amp_rewrite.onnx import load as io
from amp_rewrite.onnx.api import rewrite_onnx


def measure(n_nodes: int, repeats: int) -> dict:
    proto = build_chain(n_nodes, "plain")
    model = io.load_model(proto).model
    rewrite_onnx(proto)  # warm-up: first-call imports are not timed

    def checks() -> None:
        io._check_tensors(proto, "bench", None)
        io._scan_nodes(model, "bench", list(io.walk_graphs(model.graph)))

    runs, _, probes = round_robin({"rewrite": lambda: rewrite_onnx(proto), "checks": checks},
                                  repeats)
    rewrite_s, checks_s = statistics.median(runs["rewrite"]), statistics.median(runs["checks"])
    return {"nodes": n_nodes, "rewrite_s": round(rewrite_s, 4), "checks_s": round(checks_s, 4),
            "share": round(checks_s / rewrite_s, 4), "host_probes_s": probes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--repeats", type=int, default=5)
    cli.add_json_argument(ap)
    args = ap.parse_args(argv)
    cli.setup_logging()
    rows = [measure(n, args.repeats) for n in args.sizes]
    print(f"{'nodes':>7} {'rewrite s':>10} {'checks s':>9} {'share':>7}")
    for r in rows:
        print(f"{r['nodes']:>7} {r['rewrite_s']:>10.3f} {r['checks_s']:>9.4f} {r['share']:>7.1%}")
    cli.write_json(args.json, rows)
    return 0
