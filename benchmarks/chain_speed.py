"""Conversion speed of amp_rewrite and the peer converters on long synthetic chains.

The chains are :mod:`benchmarks.chains`' (1k, 10k, 50k nodes by default). Every
converter runs in a worker process of its own (started and warmed up on a tiny model before
timing), so a run that exceeds ``--timeout`` is killed and reported as ">timeout"; larger
models of that variant are then skipped for it. The time is measured inside the worker around
the call that goes from ModelProto to ModelProto (amp_rewrite: ``rewrite_onnx``). Repeats run
round-robin over the converters, each round after a host probe
(:mod:`benchmarks.timing`). Model build time is reported apart.

    python -m benchmarks speed chains [--sizes 1000 10000 50000]
        [--converters amp_rewrite onnxconverter_common] [--timeout 300] [--json FILE]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import onnx
from tqdm import tqdm

from benchmarks import cli, peers
from benchmarks.chains import VARIANTS, build_chain
from benchmarks.timing import host_probe, machine, probe_line
from tests.models import corpus

log = logging.getLogger(__name__)

BASELINE = "amp_rewrite"


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
    cli.add_json_argument(parser)
    return parser.parse_args(argv)


def _runnable(args: argparse.Namespace) -> list[str]:
    names = []
    for name, reason in peers.available_peers(args.converters).items():
        if reason:
            log.warning("skipped %s: %s", name, reason)
        elif not peers.CONVERTERS[name].supports(args.dtype):
            log.warning("skipped %s: does not convert to %s", name, args.dtype)
        else:
            names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    cli.setup_logging()
    names = _runnable(args)
    rows: list[dict[str, Any]] = []
    models: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="amp_bench_chains_") as tmp:
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
        print(probe_line(probes))
    cli.write_json(args.json, {"dtype": args.dtype, "timeout": args.timeout, **machine(),
                               "models": models, "runs": rows, "host_probes": bench.probes})
    return 0
