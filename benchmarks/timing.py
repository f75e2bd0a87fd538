"""Timing shared by the benchmarks: the host probe and round-robin repeats.

Training-step benchmarks run each variant in a fresh interpreter (:func:`rows_in_fresh_process`):
a compiled variant measured after another one in the same process can be much slower
(docs/benchmarks.md §3.2), which would let the order of ``--variants`` decide a comparison.

The shared host's speed varies up to 2x over minutes. Converters are therefore compared
within one round (each round times every candidate once, in turn, so a drift hits all of
them alike), and every round starts with :func:`host_probe`, a fixed pure-Python loop whose
time says how fast the host was for that round.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from benchmarks.cli import child_env

PROBE_ITERATIONS = 10_000_000


def host_probe() -> float:
    """Seconds for a fixed pure-Python loop: the host's speed at this moment (lower is faster)."""
    start, total = time.perf_counter(), 0
    for i in range(PROBE_ITERATIONS):
        total += i
    return time.perf_counter() - start


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of ``fn()``."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def round_robin(candidates: Mapping[str, Callable[[], Any]], repeats: int
                ) -> tuple[dict[str, list[float]], dict[str, Any], list[float]]:
    """Seconds per candidate and round, the last result of each, and one host probe per round."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    results: dict[str, Any] = {}
    probes = []
    for _ in range(repeats):
        probes.append(host_probe())
        for name, fn in candidates.items():
            seconds, results[name] = timed(fn)
            times[name].append(seconds)
    return times, results, probes


def probe_line(probes: list[float], per: str = "round") -> str:
    return (f"host probe ({PROBE_ITERATIONS:,}-step Python loop, per {per}): "
            f"{min(probes):.3f} to {max(probes):.3f} s")


def machine() -> dict[str, str]:
    """What ran the benchmark, for its JSON."""
    return {"python": sys.version.split()[0], "machine": platform.platform(),
            "processor": platform.processor() or platform.machine()}


def rows_in_fresh_process(argv: list[str], head: dict) -> list[dict]:
    """The JSON rows of ``python -m benchmarks *argv --json TMP`` run in a fresh
    interpreter (its printed table is dropped); one row ``{**head, "error": ...}`` naming the
    last line of its stderr if it wrote none."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        done = subprocess.run([sys.executable, "-m", "benchmarks", *argv,
                               "--json", str(out)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, check=False,
                              env=child_env())
        if out.exists():
            return json.loads(out.read_text())["rows"]
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return [{**head, "error": f"the fresh process failed: {last[:300]}"}]


def add_same_process_flag(parser: argparse.ArgumentParser) -> None:
    """``--same-process``: the opt-out of :func:`rows_in_fresh_process` (the fresh process
    itself runs with it)."""
    parser.add_argument("--same-process", action="store_true",
                        help="measure every variant in this process (default: each in a "
                             "fresh one, so that no variant inherits another's state)")
