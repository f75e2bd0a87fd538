"""The torch path on real ``transformers`` architectures vs ``torch.autocast`` (CPU).

For every zoo model (tiny configs, random weights, no download) and low dtype: capture with
``torch.export``, rewrite, and run the FP32 model, the rewritten model and the FP32 model under
``torch.autocast(device_type="cpu", dtype=...)`` on the same inputs. Columns:

* nodes: fx nodes of the rewritten graph; casts: casts the pass inserted;
* conversions: dtype conversions executed in one forward (a TorchDispatchMode counting
  ``_to_copy`` / ``convert_element_type`` calls that change the dtype, and ``copy_`` across
  dtypes), ours vs autocast's;
* error: max |out - fp32| / max |fp32| over all floating outputs, ours vs autocast's;
* rewrite: median seconds of the pass over ``--repeat`` runs (capture reported apart).

By default outputs are not converted back to fp32 (``keep_io_types=False``), as autocast does
not convert them either; ``--keep-io-types`` counts our extra output casts too.

    python -m benchmarks fx table [--models bert gpt2] [--dtypes fp16 bf16]
        [--repeat 3] [--keep-io-types] [--json results/fx_models_table.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import statistics
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

from amp_rewrite.core import LowDtype
from amp_rewrite.fx import rewrite_graph
from amp_rewrite.fx.capture import capture
from amp_rewrite.fx.pointwise import BACKEND_ENV
from tests.models import zoo
from tests.models.measure import compare_with_autocast

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def measure(name: str, dtypes: list[str], repeat: int, keep_io_types: bool) -> list[dict]:
    """One row per dtype for zoo model ``name``."""
    model = zoo.build(name)
    start = time.perf_counter()
    captured = capture(model.module, model.args, model.kwargs)
    capture_s = time.perf_counter() - start
    rows = []
    for key in dtypes:
        dtype = DTYPES[key]
        times, gm = [], None
        for _ in range(repeat):
            fresh = copy.deepcopy(captured)
            start = time.perf_counter()
            # the plan's conversions (the CPU GEMM emulation's casts are a kernel choice)
            gm = rewrite_graph(fresh, dtype=dtype, keep_io_types=keep_io_types,
                               emulate_gemms=False)
            times.append(time.perf_counter() - start)
        # fused regions eager: every conversion is then dispatched and counted, as autocast's
        # are (a compiled region hides its casts in its kernels, and its first call would
        # count the compile's tracing)
        with mock.patch.dict(os.environ, {BACKEND_ENV: "eager"}):
            result = compare_with_autocast(model.module, gm, model.args, model.kwargs, dtype)
        rows.append({
            "model": name, "dtype": key, "nodes": len(gm.graph.nodes),
            "casts": gm.amp_report["casts_inserted"],
            "conversions": result.conversions,
            "autocast_conversions": result.autocast_conversions,
            "error": result.error, "autocast_error": result.autocast_error,
            "rewrite_s": statistics.median(times), "capture_s": capture_s,
            "precision_counts": gm.amp_report["precision_counts"],
        })
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':16s} {'dtype':5s} {'nodes':>5s} {'casts':>5s} {'conv ours':>9s} "
              f"{'autocast':>8s} {'err ours':>9s} {'autocast':>9s} {'rewrite s':>9s} "
              f"{'capture s':>9s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        flag = "" if r["conversions"] <= r["autocast_conversions"] else "  (more conversions)"
        print(f"{r['model']:16s} {r['dtype']:5s} {r['nodes']:5d} {r['casts']:5d} "
              f"{r['conversions']:9d} {r['autocast_conversions']:8d} {r['error']:9.2e} "
              f"{r['autocast_error']:9.2e} {r['rewrite_s']:9.3f} {r['capture_s']:9.2f}{flag}")
    fewer = sum(r["conversions"] <= r["autocast_conversions"] for r in rows)
    within = sum(r["error"] <= 1.5 * r["autocast_error"] + 1e-6 for r in rows)
    print(f"\nconversions <= autocast: {fewer}/{len(rows)} rows; "
          f"error <= 1.5x autocast: {within}/{len(rows)} rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(zoo.NAMES), choices=zoo.NAMES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--repeat", type=int, default=3, help="rewrite timings per model")
    parser.add_argument("--keep-io-types", action="store_true",
                        help="convert outputs back to their FP32 dtype (counted)")
    parser.add_argument("--json", default="results/fx_models_table.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    # torch's own deepcopy of export's pytree specs warns about its own deprecated API.
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    rows = []
    for name in args.models:
        rows.extend(measure(name, args.dtypes, args.repeat, args.keep_io_types))
    print_table(rows)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "keep_io_types": args.keep_io_types,
            "low_max_finite": {k: LowDtype.parse(k).max_finite for k in args.dtypes}}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0
