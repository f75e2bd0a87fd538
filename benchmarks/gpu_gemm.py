"""Dense GEMM peak and the misaligned GEMM/conv shapes of the padding workloads, on a GPU.

For each dtype it measures the device's dense peak (an 8192 x 8192 x 8192 ``torch.mm``), then
for each misaligned problem of the ``gpu train`` workloads (the odd MLP, GPT-2's
50257-word LM head in forward and both backward GEMMs, ResNet-50's 3-channel 7x7 stem conv):

* ``unpadded``: the product as given;
* ``padded``: the same product with K and N (conv: input channels) zero-padded to multiples of
  8, operands padded once ahead of time (the kernel alone);
* ``padded+copies``: the padding of the operands done in the timed call (``F.pad`` of both
  operands and the slice of the result): what a graph that pads at run time pays.

Rates are *useful* TFLOP/s (the unpadded problem's 2·M·N·K) so the columns compare time;
``of peak`` is the padded kernel's own FLOPs over the measured peak (padded GEMMs
at >= 70% of the device's dense peak). Times are medians of ``--repeat`` CUDA-event timings
after warm-up. Without CUDA it says so and exits 0.

    python -m benchmarks gpu gemm [--dtypes fp16 bf16] [--repeat 50] [--json gemm.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
# (name, M, K, N): forward y = x @ W^T has M tokens, K input and N output features; the
# backward GEMMs of the same layer are (M, N, K) for dX and (N, M, K) for dW.
GEMMS = [("mlp_odd up", 8192, 4095, 11007), ("mlp_odd down", 8192, 11007, 4095),
         ("gpt2 lm_head fwd", 4096, 768, 50257), ("gpt2 lm_head dX", 4096, 50257, 768),
         ("gpt2 lm_head dW", 50257, 4096, 768)]
STEM = (64, 3, 224, 64, 7, 2, 3)  # batch, C_in, size, C_out, kernel, stride, padding


def _up8(n: int) -> int:
    return -(-n // 8) * 8


def timed(call: Callable[[], object], repeat: int) -> float:
    """Median milliseconds of ``call`` (CUDA events), after a warm-up."""
    for _ in range(5):
        call()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_tflops(dtype: torch.dtype, repeat: int) -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
    return 2 * 8192**3 / timed(lambda: a @ b, repeat) / 1e9


def gemm_row(name: str, m: int, k: int, n: int, dtype: torch.dtype, repeat: int,
             peak: float) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(k, n, device="cuda", dtype=dtype)
    kp, np_ = _up8(k), _up8(n)
    xp, wp = F.pad(x, (0, kp - k)), F.pad(w, (0, np_ - n, 0, kp - k))
    # zeros add nothing; kernels for other shapes may sum in another order, hence not equal()
    diff = ((xp @ wp)[:, :n] - x @ w).abs().max() / (x @ w).abs().max()
    assert diff < 1e-2, f"{name}: padded product differs by {diff:.2e}"
    flops = 2 * m * k * n
    ms = {"unpadded": timed(lambda: x @ w, repeat), "padded": timed(lambda: xp @ wp, repeat),
          "padded+copies": timed(lambda: (F.pad(x, (0, kp - k)) @ F.pad(
              w, (0, np_ - n, 0, kp - k)))[:, :n], repeat)}
    return _row(name, (m, k, n), flops, 2 * m * kp * np_, ms, peak)


def stem_row(dtype: torch.dtype, repeat: int, peak: float) -> dict:
    batch, cin, size, cout, kernel, stride, pad = STEM
    x = torch.randn(batch, cin, size, size, device="cuda", dtype=dtype)
    w = torch.randn(cout, cin, kernel, kernel, device="cuda", dtype=dtype)
    xp, wp = F.pad(x, (0, 0, 0, 0, 0, 8 - cin)), F.pad(w, (0, 0, 0, 0, 0, 8 - cin))
    out = (size + 2 * pad - kernel) // stride + 1
    flops = 2 * batch * cout * out * out * cin * kernel * kernel
    conv = lambda a, b: F.conv2d(a, b, stride=stride, padding=pad)  # noqa: E731
    ms = {"unpadded": timed(lambda: conv(x, w), repeat),
          "padded": timed(lambda: conv(xp, wp), repeat),
          "padded+copies": timed(lambda: conv(F.pad(x, (0, 0, 0, 0, 0, 8 - cin)),
                                              F.pad(w, (0, 0, 0, 0, 0, 8 - cin))), repeat)}
    return _row("resnet50 stem conv", STEM, flops, flops * 8 // cin, ms, peak)


def _row(name: str, shape: tuple, flops: int, padded_flops: int, ms: dict, peak: float
         ) -> dict:
    return {"name": name, "shape": list(shape), "ms": ms,
            "useful_tflops": {k: flops / v / 1e9 for k, v in ms.items()},
            "padded_of_peak": padded_flops / ms["padded"] / 1e9 / peak,
            "speedup_padded": ms["unpadded"] / ms["padded"],
            "speedup_padded_with_copies": ms["unpadded"] / ms["padded+copies"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--json", default="results/bench_gpu_gemm.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("CUDA is not available: this benchmark needs a GPU; nothing was measured.")
        return 0
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtypes": {}}
    for name in args.dtypes:
        dtype = DTYPES[name]
        peak = peak_tflops(dtype, args.repeat)
        rows = [gemm_row(*g, dtype, args.repeat, peak) for g in GEMMS]
        rows.append(stem_row(dtype, args.repeat, peak))
        result["dtypes"][name] = {"peak_tflops": peak, "rows": rows}
        print(f"{name}: dense peak {peak:.0f} TFLOP/s (8192^3 mm)")
        print(f"  {'problem':20s} {'unpadded':>9s} {'padded':>9s} {'+copies':>9s}"
              f" {'of peak':>8s} {'speedup':>8s} {'w/ copies':>9s}   (useful TFLOP/s)")
        for r in rows:
            t = r["useful_tflops"]
            print(f"  {r['name']:20s} {t['unpadded']:9.0f} {t['padded']:9.0f}"
                  f" {t['padded+copies']:9.0f} {r['padded_of_peak']:8.0%}"
                  f" {r['speedup_padded']:7.2f}x {r['speedup_padded_with_copies']:8.2f}x")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return 0
