"""The torch path's accuracy budget on zoo models, next to the default plan and autocast (CPU).

For each zoo model (tiny configs, random weights), low dtype and budget E: capture once,
draw calibration batches from the zoo's input generator (seeds 1..2n: the first n searched,
the last n held out), ``rewrite_graph(max_error=E, calibration_data=...)``. Columns, all on
the held-out batches against the FP32 model:

* default: the default plan's error (no budget); autocast: the FP32 model under
  ``torch.autocast("cpu", dtype=...)``; ours: the budgeted module's error;
* evals, seconds: measured plans and the search's time; low share: the FLOP-weighted share
  of the planned nodes run low, by the default plan and by ours; reachable: whether E was
  reached at all.

    python -m benchmarks fx budget [--models bert gpt2 llama vit t5] [--dtypes fp16 bf16]
        [--errors 1e-2 1e-3] [--batches 3] [--json results/fx_budget.json]
"""
from __future__ import annotations

import argparse
import copy
import logging
import warnings

import torch

from amp_rewrite.fx import rewrite_graph
from amp_rewrite.fx.budget import float_outputs, relative_error
from amp_rewrite.fx.capture import capture
from benchmarks import cli
from tests.models import zoo

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODELS = ("bert", "gpt2", "llama", "vit", "t5")


def calibration_batches(name: str, count: int, batch: int = 2) -> list[tuple]:
    """``count`` batches from the zoo's input generator, seeds 1..count (the model's own
    example inputs are seed 0)."""
    return zoo.input_batches(name, range(1, count + 1), batch)


def _autocast_error(module: torch.nn.Module, dtype: torch.dtype, data: list[tuple]) -> float:
    worst = 0.0
    with torch.no_grad():
        for batch in data:
            ref = float_outputs(module(*batch))
            with torch.autocast("cpu", dtype=dtype):
                got = float_outputs(module(*batch))
            worst = max(worst, relative_error(ref, got))
    return worst


def measure(name: str, dtypes: list[str], errors: list[float], batches: int) -> list[dict]:
    """One row per (dtype, E) for zoo model ``name``."""
    model = zoo.build(name)
    captured = capture(model.module, model.args, model.kwargs)
    data = calibration_batches(name, 2 * batches)
    rows = []
    for key in dtypes:
        autocast = _autocast_error(model.module, DTYPES[key], data[batches:])
        for max_error in errors:
            gm = rewrite_graph(copy.deepcopy(captured), dtype=DTYPES[key], max_error=max_error,
                               calibration_data=data)
            b = gm.amp_report["budget"]
            rows.append({"model": name, "dtype": key, "max_error": max_error,
                         "default": b["default_plan_held_out"],
                         "autocast": float(f"{autocast:.4g}"),
                         "ours": b["held_out"], "search_error": b["achieved"],
                         "evaluations": b["evaluations"], "seconds": b["seconds"],
                         "low_flop_share": b["low_flop_share"],
                         "default_low_flop_share": b["default_low_flop_share"],
                         "reachable": b["reachable"],
                         "pinned": len(gm.amp_report["pinned_by_budget"])})
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':6} {'dtype':5} {'E':>6} {'default':>9} {'autocast':>9} {'ours':>9} "
              f"{'evals':>5} {'seconds':>7} {'share def.':>10} {'share ours':>10} "
              f"{'reachable':>9}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['model']:6} {r['dtype']:5} {r['max_error']:6.0e} {_num(r['default']):>9} "
              f"{_num(r['autocast']):>9} {_num(r['ours']):>9} {r['evaluations']:5d} "
              f"{r['seconds']:7.2f} {r['default_low_flop_share']:10.3f} "
              f"{r['low_flop_share']:10.3f} {str(r['reachable']):>9}")


def _num(x: float | str | None) -> str:
    return "-" if x is None else str(x) if isinstance(x, str) else f"{x:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"])
    parser.add_argument("--errors", nargs="+", type=float, default=[1e-2, 1e-3])
    parser.add_argument("--batches", type=int, default=3,
                        help="batches searched; as many more are held out")
    cli.add_json_argument(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = [r for name in args.models for r in measure(name, args.dtypes, args.errors,
                                                          args.batches)]
    print_table(rows)
    cli.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
