"""Mutation fuzz campaign of the amp-rewrite CLI: N seeded mutated models, each
run in-process through ``cli.main``; counts exit codes and lists every internal error (exit 1)
or traceback, with the seed that reproduces it.

    python -m benchmarks fuzz --runs 2000 [--first-seed 0] [--zoo]
        [--dtypes fp16,bf16] [--model examples/transformer_block.onnx ...]
        [--json results/fuzz_cli.json]

Base models: the small ones of ``tests.models.fuzz.seed_models`` plus each
``--model`` (default: the example transformer block), and with ``--zoo`` the zoo's families
(``fuzz.ZOO_SEEDS``). ``--dtypes``: run each case once per dtype listed, overriding the dtype
the case drew (``--runs`` counts CLI runs). Besides exit 1 and tracebacks, a run is bad when
it changed its input file or wrote an output failing the full ONNX check its input passes.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import tempfile
import time
from pathlib import Path

import onnx

from tests.models import fuzz

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "transformer_block.onnx"
INTERRUPTED = (130, 143)  # the CLI's exit codes for SIGINT and SIGTERM


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--model", type=Path, action="append",
                    default=None, help="extra base model (repeatable)")
    ap.add_argument("--zoo", action="store_true", help="add the zoo families as base models")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=None,
                    help="comma-separated --dtype values each case runs with (default: the "
                    "case's own draw)")
    ap.add_argument("--json", type=Path, default=Path("results/fuzz_cli.json"))
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # the runs' warnings are expected; exit codes matter
    models = fuzz.seed_models()
    for path in args.model if args.model is not None else [EXAMPLE]:
        models[path.stem] = onnx.load(path)
    if args.zoo:
        models.update(fuzz.zoo_seed_models())
    runs = list(_runs(args.first_seed, args.runs, args.dtypes))
    codes: collections.Counter[int] = collections.Counter()
    by_mutation: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    by_base: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    bad = []
    start, interrupted = time.perf_counter(), 0
    with tempfile.TemporaryDirectory() as work:
        for seed, dtype in runs:
            outcome = fuzz.run_case(fuzz.with_dtype(fuzz.make_case(seed, models), dtype),
                                    Path(work))
            if outcome.exit_code in INTERRUPTED:
                # the CLI turns SIGINT/SIGTERM into its exit code: the campaign stops too
                print(f"interrupted at seed {seed}; the counts cover the runs before it")
                interrupted = outcome.exit_code
                break
            codes[outcome.exit_code] += 1
            by_base[outcome.case.base][outcome.exit_code] += 1
            labels = list(outcome.case.mutations)
            if outcome.case.external is not None:
                labels.append("external" + (f"-{outcome.case.external}"
                                            if outcome.case.external else ""))
            for m in labels:
                by_mutation[m][outcome.exit_code] += 1
            if outcome.bad:
                bad.append({"seed": seed, "base": outcome.case.base,
                            "mutations": outcome.case.mutations, "flags": outcome.case.flags,
                            "external": outcome.case.external,
                            "exit_code": outcome.exit_code, "stderr": outcome.stderr[-500:],
                            "input_changed": outcome.input_changed,
                            "output_check_error": outcome.output_check_error})
    seconds = time.perf_counter() - start
    result = {"runs": sum(codes.values()), "first_seed": args.first_seed, "dtypes": args.dtypes,
              "seconds": round(seconds, 1),
              "base_models": sorted(models),
              "exit_codes": dict(sorted(codes.items())), "internal_errors": len(bad),
              "bad_by_kind": _bad_by_kind(bad),
              "by_mutation": {m: dict(sorted(c.items())) for m, c in sorted(by_mutation.items())},
              "by_base": {m: dict(sorted(c.items())) for m, c in sorted(by_base.items())},
              "bad": bad}
    print(f"{sum(codes.values())} runs in {seconds:.1f} s; exit codes {dict(sorted(codes.items()))}; "
          f"bad runs: {len(bad)} {_bad_by_kind(bad)}")
    print(f"{'mutation':<14} " + " ".join(f"{'exit ' + str(c):>7}" for c in (0, 2, 3, 4)))
    for m, c in [*sorted(by_mutation.items()), *sorted(by_base.items())]:
        print(f"{m:<14} " + " ".join(f"{c.get(k, 0):>7}" for k in (0, 2, 3, 4)))
    for b in bad[:20]:
        print(f"seed {b['seed']}: {b['base']} {b['mutations']} {b['flags']} -> {b['exit_code']}: "
              f"{b['stderr'].strip()[-200:]} {b['output_check_error'] or ''}"
              f"{' (input changed)' if b['input_changed'] else ''}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    return interrupted or (1 if bad else 0)


def _runs(first_seed: int, runs: int, dtypes: list[str] | None):
    """(seed, dtype) pairs, ``runs`` of them: each seed once per dtype (None: as drawn)."""
    per_seed = dtypes or [None]
    for i in range(runs):
        yield first_seed + i // len(per_seed), per_seed[i % len(per_seed)]


def _bad_by_kind(bad: list[dict]) -> dict[str, int]:
    return {"exit 1": sum(b["exit_code"] == 1 for b in bad),
            "traceback": sum("Traceback" in b["stderr"] for b in bad),
            "internal error message": sum("internal error" in b["stderr"] for b in bad),
            "input changed": sum(b["input_changed"] for b in bad),
            "output fails the check its input passes": sum(
                b["output_check_error"] is not None for b in bad)}
