"""Training step on this CPU: amp_rewrite against torch.autocast, eager and compiled.

Two comparisons per model, bf16 by default (``--dtype mixed``: amp_rewrite's ``dtype="mixed"``
against autocast bf16, see benchmarks/gpu_training.py):
* ``export``: the rewritten graph (``amp_rewrite.rewrite`` + ``AmpOptimizer``) against
  ``torch.autocast`` eager;
* ``backend``: ``amp_rewrite.compile`` against ``torch.compile`` under autocast.

Each variant runs in a fresh interpreter (``gpu train --same-process``: no variant inherits
another's caches or threads). A round runs every variant of every model once; the order of
the variants alternates from round to round, so a drift in the host's speed (a shared host
swings by 2x over minutes) favours neither side. The speed-up of a round is peer ms / ours ms
of that round's pair, measured back to back; the table gives the median over rounds and its
spread (min to max), with the median step times.

With ``--dtype mixed``, autocast fp16 + GradScaler (``autocast_fp16``) also runs once per model
after the rounds, eager: on a hot model it skips its steps (its time is no comparison), and
the table gives how many of its steps GradScaler skipped (``fp16_skipped``), beside ours.

    python -m benchmarks fx step [--models bert_4l_h256 ...] [--compare export backend]
        [--dtype bf16|fp16|mixed] [--rounds 3] [--steps 6] [--warmup 2]
        [--json results/bench_cpu_step.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

from amp_rewrite.fx.kernel_timing import cpu_model
from benchmarks.gpu_training import CPU_MODELS, DTYPES, MODELS, cpu_flags
from benchmarks.timing import machine, rows_in_fresh_process

# comparison -> (ours, peer), each (variant, compiled)
COMPARISONS = {"export": (("amp_rewrite", False), ("autocast", False)),
               "backend": (("backend", True), ("autocast", True))}
# --dtype mixed: the fp16 peer, run once for its skipped steps (autocast fp16 overflows)
FP16_PEER = ("autocast_fp16", False)


def run_variant(args: argparse.Namespace, model: str, variant: str, compiled: bool) -> dict:
    argv = ["gpu", "train", "--same-process", "--device", "cpu", "--models", model,
            "--variants", variant, "--compile", "on" if compiled else "off",
            "--dtype", args.dtype, "--steps", str(args.steps), "--warmup", str(args.warmup),
            *(["--tiny"] if args.tiny else [])]
    head = {"model": model, "variant": variant, "compile": compiled, "dtype": args.dtype}
    rows = rows_in_fresh_process(argv, head)
    return rows[0] if rows else {**head, "error": "no row"}


def summarise(rows: list[dict], models: list[str], comparisons: list[str]) -> list[dict]:
    """Per model and comparison: median ms of each side, and the per-round speed-ups."""
    table = []
    for model in models:
        for name in comparisons:
            ours, peer = COMPARISONS[name]
            pairs = []
            for r in sorted({row["round"] for row in rows}):
                mine = _ms(rows, model, ours, r)
                theirs = _ms(rows, model, peer, r)
                if mine and theirs:
                    pairs.append((mine, theirs))
            if not pairs:
                table.append({"model": model, "comparison": name, "error": _error(rows, model)})
                continue
            speedups = [theirs / mine for mine, theirs in pairs]
            table.append({
                "model": model, "comparison": name, "rounds": len(pairs),
                "ours_ms": round(statistics.median(p[0] for p in pairs), 1),
                "peer_ms": round(statistics.median(p[1] for p in pairs), 1),
                "speedup": round(statistics.median(speedups), 3),
                "speedup_min": round(min(speedups), 3), "speedup_max": round(max(speedups), 3),
                **_skips(rows, model, ours, "ours"), **_skips(rows, model, FP16_PEER, "fp16")})
    return table


def _skips(rows: list[dict], model: str, side: tuple[str, bool], key: str) -> dict:
    """``{key}_skipped``: steps skipped for Inf/NaN over ``{key}_updates`` optimizer updates
    (the last row of that side that counted them; a run without scaling counts none)."""
    variant, compiled = side
    counted = [row for row in rows if (row["model"], row["variant"], row["compile"]) == (
        model, variant, compiled) and "skipped" in row]
    if not counted:
        return {}
    return {f"{key}_skipped": counted[-1]["skipped"], f"{key}_updates": counted[-1]["updates"]}


def _ms(rows: list[dict], model: str, side: tuple[str, bool], round_: int) -> float | None:
    variant, compiled = side
    for row in rows:
        if (row["model"], row["variant"], row["compile"], row["round"]) == (
                model, variant, compiled, round_) and "ms" in row:
            return row["ms"]
    return None


def _error(rows: list[dict], model: str) -> str:
    return next((row["error"] for row in rows if row["model"] == model and "error" in row),
                "no measurement")


def print_table(table: list[dict]) -> None:
    print(f"\n{'model':15s} {'comparison':10s} {'ours ms':>9s} {'peer ms':>9s} "
          f"{'speed-up':>9s} {'spread':>13s} rounds")
    for t in table:
        if "error" in t:
            print(f"{t['model']:15s} {t['comparison']:10s} {t['error']}")
            continue
        print(f"{t['model']:15s} {t['comparison']:10s} {t['ours_ms']:9.1f} {t['peer_ms']:9.1f} "
              f"{t['speedup']:8.2f}x {t['speedup_min']:5.2f}-{t['speedup_max']:.2f}x "
              f"{t['rounds']:6d}")
    for t in table:
        for key, who in (("ours", "ours"), ("fp16", "autocast fp16 + GradScaler")):
            if f"{key}_skipped" in t:
                print(f"{t['model']:15s} {t['comparison']:10s} {who}: skipped "
                      f"{t[f'{key}_skipped']} of {t[f'{key}_updates']} steps (Inf/NaN)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(CPU_MODELS), choices=MODELS)
    parser.add_argument("--compare", nargs="+", default=list(COMPARISONS),
                        choices=list(COMPARISONS))
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="tiny configs (smoke test)")
    parser.add_argument("--json", default="results/bench_cpu_step.json")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[3:])
    print(f"CPU: {cpu_model()} (bf16 flags: {' '.join(cpu_flags()) or 'none'})")
    variants = list(dict.fromkeys(side for name in args.compare for side in COMPARISONS[name]))
    rows: list[dict] = []
    for round_ in range(args.rounds):
        order = variants if round_ % 2 == 0 else variants[::-1]
        for model in args.models:
            for variant, compiled in order:
                rows.append(_run_and_print(args, model, variant, compiled, round_))
                _save(args, rows, summarise(rows, args.models, args.compare))
    if args.dtype == "mixed":  # after the rounds: it never takes a round's place
        for model in args.models:
            rows.append(_run_and_print(args, model, *FP16_PEER, args.rounds))
            _save(args, rows, summarise(rows, args.models, args.compare))
    table = summarise(rows, args.models, args.compare)
    print_table(table)
    _save(args, rows, table)
    print(f"wrote {args.json}")
    return 0


def _run_and_print(args: argparse.Namespace, model: str, variant: str, compiled: bool,
                   round_: int) -> dict:
    row = {**run_variant(args, model, variant, compiled), "round": round_}
    mode = "compiled" if compiled else "eager"
    skipped = f"  skipped {row['skipped']}/{row['updates']}" if "skipped" in row else ""
    print(f"round {round_} {model:15s} {variant:13s} {mode:8s} "
          + (f"{row['ms']:9.1f} ms{skipped}" if "ms" in row else row.get("error", "?")),
          flush=True)
    return row


def _save(args: argparse.Namespace, rows: list[dict], table: list[dict]) -> None:
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"cpu": cpu_model(), "cpu_flags": cpu_flags(), **machine(),
            "date": datetime.date.today().isoformat(),
            "command": " ".join(["python -m benchmarks fx step", *args.argv]),
            "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
            "rounds": args.rounds, "tiny": args.tiny}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "table": table, "rows": rows}, indent=1))
    tmp.replace(out)
