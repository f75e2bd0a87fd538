"""Where a training step's time goes on a GPU: host (Python + dispatch) against device kernels.

For each model and variant of ``python -m benchmarks gpu train`` it warms up, then records
``--steps`` training steps under ``torch.profiler`` and reports per step: wall time, the
device's busy time (sum of kernel durations; overlapping streams aside), the number of kernel
launches, and the top kernels and host ops. A step whose wall time is well above its device
time is host-bound (launch and Python overhead), not bandwidth- or compute-bound.

    python -m benchmarks gpu profile [--models bert] [--variants autocast amp_rewrite]
        [--dtype fp16] [--steps 3] [--compile] [--json profile.json]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu_training import DTYPES, MODELS, VARIANTS, build, prepare


def _kernel_events(prof: profile) -> list:
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


# Kernel families by name, first match wins: where a step's device time goes at a glance.
KERNEL_FAMILIES = (
    ("attention", ("sdpa", "flash", "fmha", "attention", "softmax")),
    ("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas", "wgmma")),
    ("conv", ("conv", "implicit", "winograd")),
    ("optimizer", ("multi_tensor", "adam", "optimizer")),
    ("triton", ("triton",)),
    ("copy/cast", ("copy", "cat_", "pad", "fill")),
)


def kernel_family(name: str) -> str:
    low = name.lower()
    return next((fam for fam, keys in KERNEL_FAMILIES if any(k in low for k in keys)), "other")


def profile_variant(name: str, variant: str, dtype: torch.dtype, steps: int,
                    compile_: bool = False) -> dict:
    device = torch.device("cuda")
    work = build(name, False, device)
    prepared = prepare(variant, work, dtype, compile_, device)
    for _ in range(5):
        prepared.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            prepared.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    kernels = _kernel_events(prof)
    busy, launches, families = Counter(), Counter(), Counter()
    for e in kernels:
        busy[e.name[:90]] += e.device_time_total / 1000 / steps
        families[kernel_family(e.name)] += e.device_time_total / 1000 / steps
        launches[e.name[:90]] += 1 / steps
    host = Counter()
    for e in prof.key_averages():
        host[e.key[:90]] += e.self_cpu_time_total / 1000 / steps
    return {"model": name, "variant": variant, "compile": compile_, "wall_ms": 1000 * wall,
            "device_ms_by_family": dict(families.most_common()),
            "device_busy_ms": sum(busy.values()), "kernels_per_step": len(kernels) / steps,
            "top_kernels_ms": busy.most_common(12),
            "kernel_launches": launches.most_common(40), "top_host_self_ms": host.most_common(12)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert"], choices=MODELS)
    parser.add_argument("--variants", nargs="+", default=["autocast", "amp_rewrite"],
                        choices=VARIANTS)
    parser.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile each variant")
    parser.add_argument("--tag", default="", help="label stored with the rows (env settings)")
    parser.add_argument("--json", default="results/profile_gpu_step.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: this profile needs a GPU; nothing was measured.")
        return 0
    out = Path(args.json)
    rows = json.loads(out.read_text()) if out.exists() else []
    for name in args.models:
        for variant in args.variants:
            row = {**profile_variant(name, variant, DTYPES[args.dtype], args.steps,
                                          args.compile),
                   "tag": args.tag}
            rows.append(row)
            out.write_text(json.dumps(rows, indent=1))
            if args.compile:  # every variant's _Logits shares one code object: fresh guards
                torch._dynamo.reset()
            print(f"{name} {variant} {args.tag}: wall {row['wall_ms']:.2f} ms, device busy "
                  f"{row['device_busy_ms']:.2f} ms, {row['kernels_per_step']:.0f} kernels/step"
                  f"{' (compiled)' if args.compile else ''}")
            print("    by family: " + ", ".join(
                f"{fam} {ms:.2f}" for fam, ms in row["device_ms_by_family"].items()))
            for kernel, ms in row["top_kernels_ms"][:6]:
                print(f"    {ms:7.2f} ms  {kernel}")
            for op, ms in row["top_host_self_ms"][:6]:
                print(f"    host {ms:7.2f} ms  {op}")
    return 0
