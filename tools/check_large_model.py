"""Rewrite a > 2 GB external-data model with the CLI and report time and peak memory.

Builds a chain of MatMuls whose fp32 weights total --gib GiB (stored as external data), runs
``amp-rewrite`` on it in a subprocess, and reports the child's peak RSS next to the weight
size: holding every weight twice would need ≥ 2× the fp32 bytes; converted fp16 copies plus
memory-mapped originals need about 0.5×.

    python tools/check_large_model.py [--gib 2.5] [--dir /tmp/amp_large] [--out results/large_model.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(path: Path, gib: float, width: int = 8192) -> int:
    layer_bytes = width * width * 4
    layers = max(1, int(gib * 2**30 // layer_bytes) + 1)
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        w = rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width))
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [4, width])], [helper.make_tensor_value_info(
            prev, TensorProto.FLOAT, [4, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, path, save_as_external_data=True, location=path.name + ".data")
    return layers * layer_bytes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.5)
    p.add_argument("--dir", type=Path, default=Path("/tmp/amp_large"))
    p.add_argument("--out", type=Path, default=Path("results/large_model.json"))
    p.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    src, dst = args.dir / "large.onnx", args.dir / "large.amp.onnx"
    if args.build_only:
        build(src, args.gib)
        return 0
    # Build in a child of its own: a forked child's peak RSS would include this process's.
    subprocess.run([sys.executable, __file__, "--build-only", "--gib", str(args.gib),
                    "--dir", str(args.dir)], check=True)
    weight_bytes = sum(t.dims[0] * t.dims[1] * 4 for t in onnx.load(
        src, load_external_data=False).graph.initializer)
    exe = Path(sys.executable).with_name("amp-rewrite")
    start = time.perf_counter()
    proc = subprocess.Popen([str(exe), str(src), "-o", str(dst), "-q"],
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not all children's
    seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stderr = proc.stderr.read()
    peak = usage.ru_maxrss * 1024
    # the data file's name is unique to each write: OUTPUT.<token>.data
    out_data = next(iter(sorted(dst.parent.glob(dst.name + ".*.data"))), dst.with_name("none"))
    row = {"fp32_weight_gib": weight_bytes / 2**30, "exit_code": proc.returncode,
           "stderr": proc.stderr.strip(), "seconds": round(seconds, 1),
           "peak_rss_gib": round(peak / 2**30, 2),
           "peak_rss_over_weights": round(peak / weight_bytes, 2),
           "output_data_gib": round(out_data.stat().st_size / 2**30, 2) if out_data.exists()
           else None}
    for k, v in row.items():
        print(f"{k:24} {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=1))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
