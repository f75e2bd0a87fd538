"""Rewrite a > 2 GB external-data model with the CLI and report time and peak memory.

Builds a chain of MatMuls whose fp32 weights total --gib GiB (stored as external data,
written layer by layer), runs ``amp-rewrite`` on it in a subprocess, and reports the child's
peak RSS next to the weight size: holding every weight twice would need ≥ 2× the fp32 bytes;
converted fp16 copies plus memory-mapped originals need about 0.5×. The same files are also
copied with ``cp`` on the same disk, before and after the rewrite (the page cache then holds
the input for both alike), and the rewrite's throughput (input bytes per second) is reported
against the faster copy. A fixed Python loop (the host probe of ``bench_onnx_speed.py``) is
timed before each step. The files are deleted at the end unless --keep.

    python tools/check_large_model.py [--gib 4] [--dir /tmp/amp_large] [--keep]
        [--out results/large_model.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from bench_onnx_speed import host_probe  # tools/ is on sys.path as a script


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


def timed_copy(src: Path, dst_dir: Path) -> float:
    """Seconds for ``cp`` of the model and its data file, synced to disk as the rewrite is
    not: the sync is left out of the time, as the rewrite's own writes stay in the cache."""
    dst_dir.mkdir(parents=True, exist_ok=True)
    files = [str(src), str(src.with_name(src.name + ".data"))]
    start = time.perf_counter()
    subprocess.run(["cp", *files, str(dst_dir)], check=True)
    seconds = time.perf_counter() - start
    shutil.rmtree(dst_dir)
    return seconds


def run_rewrite(src: Path, dst: Path) -> tuple[float, int, int, str]:
    """(seconds, peak RSS bytes, exit code, stderr) of the CLI in a child process."""
    exe = Path(sys.executable).with_name("amp-rewrite")
    start = time.perf_counter()
    proc = subprocess.Popen([str(exe), str(src), "-o", str(dst), "-q"],
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
    seconds = time.perf_counter() - start
    return seconds, usage.ru_maxrss * 1024, os.waitstatus_to_exitcode(status), \
        proc.stderr.read().strip()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--dir", type=Path, default=Path("/tmp/amp_large"))
    p.add_argument("--out", type=Path, default=Path("results/large_model.json"))
    p.add_argument("--keep", action="store_true", help="keep the model files")
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
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
        if not args.keep:
            for f in (src, dst):
                for path in (f, f.with_name(f.name + ".data")):
                    path.unlink(missing_ok=True)


def measure(args: argparse.Namespace, src: Path, dst: Path) -> int:
    # Build in a child of its own: a forked child's peak RSS would include this process's.
    subprocess.run([sys.executable, __file__, "--build-only", "--gib", str(args.gib),
                    "--dir", str(args.dir)], check=True)
    weight_bytes = sum(t.dims[0] * t.dims[1] * 4 for t in onnx.load(
        src, load_external_data=False).graph.initializer)
    input_bytes = src.stat().st_size + src.with_name(src.name + ".data").stat().st_size
    probes = [host_probe()]
    copy_before = timed_copy(src, args.dir / "copy")
    probes.append(host_probe())
    seconds, peak, code, stderr = run_rewrite(src, dst)
    probes.append(host_probe())
    copy_after = timed_copy(src, args.dir / "copy")
    copy_s = min(copy_before, copy_after)
    # the data file's name is unique to each write: OUTPUT.<token>.data
    out_data = next(iter(sorted(dst.parent.glob(dst.name + ".*.data"))), dst.with_name("none"))
    row = {"fp32_weight_gib": round(weight_bytes / 2**30, 2), "exit_code": code,
           "stderr": stderr, "seconds": round(seconds, 2),
           "cp_seconds_before_after": [round(copy_before, 2), round(copy_after, 2)],
           "rewrite_gib_per_s": round(input_bytes / seconds / 2**30, 2),
           "cp_gib_per_s": round(input_bytes / copy_s / 2**30, 2),
           "throughput_vs_cp": round(copy_s / seconds, 2),
           "peak_rss_gib": round(peak / 2**30, 2),
           "peak_rss_over_weights": round(peak / weight_bytes, 2),
           "output_data_gib": round(out_data.stat().st_size / 2**30, 2) if out_data.exists()
           else None,
           "host_probe_s": [round(x, 3) for x in probes]}
    for k, v in row.items():
        print(f"{k:24} {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
