"""Conversion speed of amp_rewrite and the peer converters on long synthetic chains.

Each model is a chain of blocks ``MatMul(16x16) -> Add -> Relu`` on a [4, 16] float32
activation with FP32 initializers; the ``blocked`` variant appends a ``CumSum`` to every
block: a reduction that amp_rewrite denies and that onnxconverter-common and ORT's
converter keep in FP32 by default, so every block needs casts in and out. The ``residual``
variant is shaped like a transformer: blocks ``MatMul -> Add -> Relu -> Softmax`` whose output
is added back to the block's input (the residual stream), which joins the whole model into
one free region of the min cut; ``residual_deny`` adds a ``CumSum`` on each block's branch
(before the residual Add), so every block has a fixed-HIGH op inside that one region.
Sizes are node counts (1k, 10k, 50k by default).

Every converter runs in a worker process of its own (started and warmed up on a tiny model
before timing), so a run that exceeds ``--timeout`` is killed and reported as ">timeout";
larger models of that variant are then skipped for it. The time is measured inside the
worker around the call that goes from ModelProto to ModelProto (amp_rewrite: ``rewrite_onnx``). Repeats run round-robin over the converters,
so a drift in the machine's speed hits all of them alike. Model build time is reported apart.
Each round starts with a fixed pure-Python loop (``host_probe``), whose times are printed and
saved, so runs on different days (or a slowdown within a run) can be told apart.

    PYTHONPATH=. python tools/bench_onnx_speed.py [--sizes 1000 10000 50000]
        [--converters amp_rewrite onnxconverter_common] [--timeout 300]
        [--out results/bench_onnx_speed.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from tqdm import tqdm

from amp_rewrite.bench import corpus, peers

log = logging.getLogger("bench_onnx_speed")

WIDTH, BATCH = 16, 4
VARIANTS = ("plain", "blocked", "residual", "residual_deny")
BLOCK_OPS = {"plain": ("MatMul", "Add", "Relu"), "blocked": ("MatMul", "Add", "Relu", "CumSum"),
             "residual": ("MatMul", "Add", "Relu", "Softmax", "Add"),
             "residual_deny": ("MatMul", "Add", "Relu", "Softmax", "CumSum", "Add")}
DENY_OP = "CumSum"
BASELINE = "amp_rewrite"
PROBE_ITERATIONS = 10_000_000


def host_probe() -> float:
    """Seconds for a fixed pure-Python loop: the host's speed at this moment (lower is faster).

    The shared host's speed varies up to 2x over minutes; converters are compared within one
    round, and this number says how fast the host was for that round.
    """
    start, total = time.perf_counter(), 0
    for i in range(PROBE_ITERATIONS):
        total += i
    return time.perf_counter() - start


def build_chain(n_nodes: int, variant: str, seed: int = 0) -> onnx.ModelProto:
    """A chain of at least ``n_nodes`` nodes (whole blocks) with FP32 initializers."""
    ops = BLOCK_OPS[variant]
    rng = np.random.default_rng(seed)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    if DENY_OP in ops:
        inits.append(numpy_helper.from_array(np.array(1, np.int64), "axis"))
    x = "x"
    # Weights scaled so activations stay O(1) through thousands of blocks (finite FP32 run).
    scale = 0.5 / np.sqrt(WIDTH)
    for b in range(-(-n_nodes // len(ops))):
        w = rng.uniform(-scale, scale, (WIDTH, WIDTH)).astype(np.float32)
        bias = rng.uniform(-0.1, 0.1, WIDTH).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{b}"), numpy_helper.from_array(bias, f"b{b}")]
        nodes += [helper.make_node("MatMul", [x, f"w{b}"], [f"m{b}"]),
                  helper.make_node("Add", [f"m{b}", f"b{b}"], [f"a{b}"]),
                  helper.make_node("Relu", [f"a{b}"], [f"r{b}"])]
        branch = f"r{b}"
        if "Softmax" in ops:
            nodes.append(helper.make_node("Softmax", [branch], [f"s{b}"], axis=-1))
            branch = f"s{b}"
        if DENY_OP in ops:
            nodes.append(helper.make_node(DENY_OP, [branch, "axis"], [f"c{b}"]))
            branch = f"c{b}"
        if ops[-1] == "Add" and len(ops) > 3:  # the residual stream: x + block(x)
            nodes.append(helper.make_node("Add", [x, branch], [f"h{b}"]))
            branch = f"h{b}"
        x = branch
    nodes[-1].output[0] = "y"
    graph = helper.make_graph(
        nodes, f"chain_{variant}_{n_nodes}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, WIDTH])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _repeats(size: int, table: list[int], sizes: list[int]) -> int:
    return table[min(sizes.index(size), len(table) - 1)]


class Bench:
    """Times converters in their own worker processes; remembers which variants timed out."""

    def __init__(self, names: list[str], dtype: str, timeout: float, tmp: Path) -> None:
        self.dtype, self.timeout, self.tmp = dtype, timeout, tmp
        self.workers = {name: peers.CONVERTERS[name].worker() for name in names}
        self.timed_out: set[tuple[str, str]] = set()
        self.probes: list[dict[str, Any]] = []  # one host_probe per round
        warmup = tmp / "warmup.onnx"
        onnx.save(build_chain(8, "blocked"), warmup)
        for name, worker in self.workers.items():
            worker.start()
            try:
                worker.convert_timed(warmup, dtype, timeout)  # first-call imports are not timed
            except RuntimeError as e:  # the timed runs will report the same error
                log.warning("%s fails on the warm-up model: %s", name, e)

    def run(self, names: list[str], model_path: Path, variant: str,
            repeats: int) -> dict[str, dict[str, Any]]:
        """Time each converter ``repeats`` times, round-robin: the machine's speed drifts over
        minutes (shared host), and interleaving exposes every converter to the same drift."""
        runs = {name: self._first_state(name, variant) for name in names}
        with tqdm(total=repeats * len(names), desc=model_path.stem, leave=False) as bar:
            for _ in range(repeats):
                self.probes.append({"model": model_path.stem, "seconds": host_probe()})
                for name in names:
                    if runs[name]["status"] == "ok":
                        self._time_once(name, model_path, variant, runs[name])
                    bar.update()
        for run in runs.values():
            if run["status"] == "ok":
                run["median"] = statistics.median(run["runs"])
        return runs

    def _first_state(self, name: str, variant: str) -> dict[str, Any]:
        if (name, variant) in self.timed_out:
            return {"status": "skipped", "note": "timed out on a smaller model"}
        return {"status": "ok", "runs": []}

    def _time_once(self, name: str, model_path: Path, variant: str, run: dict[str, Any]) -> None:
        try:
            converted, seconds = self.workers[name].convert_timed(model_path, self.dtype,
                                                                  self.timeout)
        except peers.ConverterTimeoutError:
            self.timed_out.add((name, variant))
            run.update(status="timeout", timeout=self.timeout)
            return
        except RuntimeError as e:  # the converter raised: report it, keep benchmarking
            run.clear()
            run.update(status="error", error=str(e))
            return
        run["runs"].append(seconds)
        run["casts"] = corpus.count_casts(converted)

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()


def _seconds_cell(run: dict[str, Any]) -> str:
    return {"ok": lambda: f"{run['median']:.2f}", "timeout": lambda: f">{run['timeout']:g}",
            "skipped": lambda: "skipped", "error": lambda: "error"}[run["status"]]()


def _ratio_cell(run: dict[str, Any], base: dict[str, Any] | None) -> str:
    if base is None or base["status"] != "ok":
        return "-"
    if run["status"] == "ok":
        return f"{run['median'] / base['median']:.1f}x"
    if run["status"] == "timeout":
        return f">{run['timeout'] / base['median']:.0f}x"
    return "-"


def format_table(rows: list[dict[str, Any]]) -> str:
    base = {(r["size"], r["variant"]): r for r in rows if r["converter"] == BASELINE}
    header = ["nodes", "variant", "converter", "seconds", f"vs {BASELINE}", "casts", "repeats"]
    body = [[str(r["nodes"]), r["variant"], r["converter"], _seconds_cell(r),
             _ratio_cell(r, base.get((r["size"], r["variant"]))),
             str(r.get("casts", "-")), str(len(r.get("runs", [])))] for r in rows]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(x.rjust(w) for x, w in zip(line, widths)) for line in [header, *body]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in rows:
        if r["status"] == "error":
            lines.append(f"{r['converter']} on {r['nodes']} {r['variant']}: {r['error']}")
    return "\n".join(lines)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1000, 10000, 50000])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--converters", nargs="+", default=list(peers.CONVERTERS),
                        choices=list(peers.CONVERTERS))
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--repeats", nargs="+", type=int, default=[5, 3, 1],
                        help="runs per size, in the order of --sizes (the last one repeats)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=Path("results/bench_onnx_speed.json"))
    return parser.parse_args(argv)


def _runnable(args: argparse.Namespace) -> list[str]:
    names = []
    for name, reason in peers.available_peers(args.converters).items():
        if reason:
            print(f"skipped {name}: {reason}")
        elif not peers.CONVERTERS[name].supports(args.dtype):
            print(f"skipped {name}: does not convert to {args.dtype}")
        else:
            names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = _runnable(args)
    rows: list[dict[str, Any]] = []
    models: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_onnx_speed_") as tmp:
        bench = Bench(names, args.dtype, args.timeout, Path(tmp))
        try:
            for size in sorted(args.sizes):
                for variant in args.variants:
                    start = time.perf_counter()
                    model = build_chain(size, variant)
                    build_seconds = time.perf_counter() - start
                    path = Path(tmp) / f"{variant}_{size}.onnx"
                    onnx.save(model, path)
                    nodes = len(model.graph.node)
                    models.append({"size": size, "variant": variant, "nodes": nodes,
                                   "build_seconds": build_seconds})
                    repeats = _repeats(size, args.repeats, sorted(args.sizes))
                    runs = bench.run(names, path, variant, repeats)
                    rows += [{"size": size, "variant": variant, "nodes": nodes,
                              "converter": name, **run} for name, run in runs.items()]
        finally:
            bench.close()
    print(format_table(rows))
    print("model build (not counted): " + ", ".join(
        f"{m['variant']} {m['nodes']}: {m['build_seconds']:.2f} s" for m in models))
    probes = [p["seconds"] for p in bench.probes]
    if probes:
        print(f"host probe ({PROBE_ITERATIONS:,}-step Python loop, per round): "
              f"{min(probes):.3f} to {max(probes):.3f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"dtype": args.dtype, "timeout": args.timeout, "python": sys.version.split()[0],
              "machine": platform.platform(), "processor": platform.processor(),
              "models": models, "runs": rows, "host_probes": bench.probes}
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
