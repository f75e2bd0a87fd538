"""Rewrite a > 2 GB external-data model with the CLI and report time and peak memory.

Builds a chain of MatMuls whose fp32 weights total --gib GiB (stored as external data,
written layer by layer), runs ``amp-rewrite`` on it in a subprocess, and reports the child's
peak RSS next to the weight size (holding every weight twice would need ≥ 2× the fp32 bytes;
the streamed conversion needs two 16 MB buffers). The same files are copied with ``cp`` on
the same disk in the same rounds, and the rewrite's throughput (input bytes per second) is
reported against the copy's.

Each round times ``cp`` and the rewrite in turn (the order alternates between rounds), each
started after a ``sync`` so that neither pays for the other's dirty pages. Two page-cache
states: ``warm`` (the input read once before the step) and ``cold`` (the input's pages
dropped from the cache with ``posix_fadvise(DONTNEED)`` before the step: read from disk).
Times are to the end of the process (writes in the page cache, as ``cp`` leaves them); the
``fsync`` of what each wrote is timed apart and reported too (``*_synced``). A fixed Python
loop (:func:`~benchmarks.timing.host_probe`) is timed before each step. Medians over the
rounds. Outputs are deleted after each step; the input is deleted at the end unless --keep
(a kept input in --dir is reused by the next run instead of being built again).

    python -m benchmarks speed large [--gib 4] [--rounds 2] [--states warm cold]
        [--dir /tmp/amp_large] [--keep] [--json FILE]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from benchmarks import cli
from benchmarks.timing import host_probe


def build(path: Path, gib: float, width: int = 8192) -> int:
    """The model, its weights appended to the data file one layer at a time (bounded memory)."""
    layer_bytes = width * width * 4
    layers = max(1, int(gib * 2**30 // layer_bytes) + 1)
    rng = np.random.default_rng(0)
    data_name = path.name + ".data"
    inits, nodes, prev = [], [], "x"
    with open(path.with_name(data_name), "wb") as data:
        for i in range(layers):
            w = rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))
            tensor = TensorProto(name=f"w{i}", data_type=TensorProto.FLOAT, dims=w.shape)
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", data.tell()),
                               ("length", w.nbytes)):
                tensor.external_data.add(key=key, value=str(value))
            data.write(w.tobytes())
            inits.append(tensor)
            nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"]))
            prev = f"h{i}"
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, width])], [helper.make_tensor_value_info(
            prev, TensorProto.FLOAT, [4, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, path)
    return layers * layer_bytes


def _files(model: Path) -> list[Path]:
    """The model and the data files beside it that belong to it (``OUT.data``,
    ``OUT.<8 hex>.data``)."""
    return [model, *sorted(model.parent.glob(model.name + "*.data"))]


def _sync_files(paths: list[Path]) -> float:
    """Seconds to fsync ``paths`` (what a step wrote) to the disk."""
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def _set_cache(paths: list[Path], state: str) -> None:
    """``warm``: every page of ``paths`` read into the page cache; ``cold``: dropped from it
    (clean pages only: call after a sync)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            if state == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 64 << 20):
                    pass
        finally:
            os.close(fd)


def timed_copy(src: Path, dst_dir: Path) -> dict:
    """``cp`` of the model and its data file: seconds, and seconds to fsync the copies."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    subprocess.run(["cp", *map(str, _files(src)), str(dst_dir)], check=True)
    seconds = time.perf_counter() - start
    sync_s = _sync_files(sorted(dst_dir.iterdir()))
    shutil.rmtree(dst_dir)
    return {"seconds": seconds, "sync_seconds": sync_s}


def run_rewrite(src: Path, dst: Path) -> dict:
    """The CLI in a child process: seconds, fsync seconds of its output, peak RSS, exit code,
    stderr, output data bytes. The output is deleted."""
    exe = Path(sys.executable).with_name("amp-rewrite")
    start = time.perf_counter()
    proc = subprocess.Popen([str(exe), str(src), "-o", str(dst), "-q"],
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
    seconds = time.perf_counter() - start
    written = _files(dst) if dst.exists() else []
    row = {"seconds": seconds, "sync_seconds": _sync_files(written),
           "peak_rss": usage.ru_maxrss * 1024, "exit_code": os.waitstatus_to_exitcode(status),
           "stderr": proc.stderr.read().strip(),
           "output_data_bytes": sum(p.stat().st_size for p in written[1:])}
    for path in written:
        path.unlink()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--states", nargs="+", choices=("warm", "cold"), default=["warm", "cold"])
    p.add_argument("--dir", type=Path, default=Path("/tmp/amp_large"))
    cli.add_json_argument(p)
    p.add_argument("--keep", action="store_true", help="keep the input model files")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cli.setup_logging()
    args.dir.mkdir(parents=True, exist_ok=True)
    src, dst = args.dir / "large.onnx", args.dir / "large.amp.onnx"
    if args.build_only:
        build(src, args.gib)
        return 0
    free = shutil.disk_usage(args.dir).free
    if free < 3 * args.gib * 2**30:  # input, output (half), one copy
        print(f"not enough space in {args.dir}: {free / 2**30:.1f} GiB free, "
              f"{3 * args.gib:.1f} GiB needed", file=sys.stderr)
        return 2
    try:
        return measure(args, src, dst)
    finally:
        shutil.rmtree(args.dir / "copy", ignore_errors=True)
        for path in [*(_files(dst) if dst.exists() else []),
                     *([] if args.keep else _files(src))]:
            path.unlink(missing_ok=True)


def measure(args: argparse.Namespace, src: Path, dst: Path) -> int:
    if not src.exists():  # built in a child of its own: a fork's RSS would include ours
        subprocess.run([sys.executable, "-m", "benchmarks", "speed", "large",
                        "--build-only", "--gib", str(args.gib),
                        "--dir", str(args.dir)], check=True, env=cli.child_env())
    weight_bytes = sum(t.dims[0] * t.dims[1] * 4 for t in onnx.load(
        src, load_external_data=False).graph.initializer)
    inputs = _files(src)
    input_bytes = sum(p.stat().st_size for p in inputs)
    rows = []
    for state in args.states:
        runs: dict[str, list[dict]] = {"cp": [], "rewrite": []}
        for r in range(args.rounds):
            order = ["cp", "rewrite"] if r % 2 == 0 else ["rewrite", "cp"]
            for step in order:
                os.sync()
                _set_cache(inputs, state)
                probe = host_probe()
                result = timed_copy(src, args.dir / "copy") if step == "cp" \
                    else run_rewrite(src, dst)
                result["host_probe_s"] = probe
                runs[step].append(result)
                if result.get("exit_code"):
                    print(result["stderr"], file=sys.stderr)
                    return result["exit_code"]
        rows.append(_row(state, runs, input_bytes, weight_bytes))
    report = {"fp32_weight_gib": round(weight_bytes / 2**30, 2),
              "input_gib": round(input_bytes / 2**30, 2), "rounds": args.rounds, "rows": rows}
    _print(report)
    cli.write_json(args.json, report)
    return 0


def _row(state: str, runs: dict[str, list[dict]], input_bytes: int, weight_bytes: int) -> dict:
    cp = statistics.median(r["seconds"] for r in runs["cp"])
    cp_synced = statistics.median(r["seconds"] + r["sync_seconds"] for r in runs["cp"])
    rw = statistics.median(r["seconds"] for r in runs["rewrite"])
    rw_synced = statistics.median(r["seconds"] + r["sync_seconds"] for r in runs["rewrite"])
    peak = max(r["peak_rss"] for r in runs["rewrite"])
    return {"cache": state,
            "rewrite_s": [round(r["seconds"], 2) for r in runs["rewrite"]],
            "cp_s": [round(r["seconds"], 2) for r in runs["cp"]],
            "rewrite_sync_s": [round(r["sync_seconds"], 2) for r in runs["rewrite"]],
            "cp_sync_s": [round(r["sync_seconds"], 2) for r in runs["cp"]],
            "rewrite_gib_per_s": round(input_bytes / rw / 2**30, 2),
            "cp_gib_per_s": round(input_bytes / cp / 2**30, 2),
            "throughput_vs_cp": round(cp / rw, 2),
            "throughput_vs_cp_synced": round(cp_synced / rw_synced, 2),
            "peak_rss_gib": round(peak / 2**30, 3),
            "peak_rss_over_weights": round(peak / weight_bytes, 3),
            "output_data_gib": round(runs["rewrite"][0]["output_data_bytes"] / 2**30, 2),
            "host_probe_s": [round(r["host_probe_s"], 3)
                             for step in ("cp", "rewrite") for r in runs[step]]}


def _print(report: dict) -> None:
    print(f"fp32 weights {report['fp32_weight_gib']} GiB, input files {report['input_gib']} "
          f"GiB, medians of {report['rounds']} rounds")
    for row in report["rows"]:
        print(f"-- page cache {row['cache']}")
        for k, v in row.items():
            if k != "cache":
                print(f"  {k:24} {v}")
