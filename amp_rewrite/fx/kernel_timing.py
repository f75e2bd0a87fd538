"""Kernel choices by measurement on the machine at hand.

Which of two kernels for the same op is faster depends on the CPU (native bf16/fp16 GEMM
units or not, oneDNN's and Inductor's code paths for it) and on the shape: a rule taken from
CPU flags, or from timings on another CPU, chooses wrongly somewhere
(docs/decisions/0021-cpu-kernel-choice.md). So each choice is timed here: once per process and
per (kind, shape class), the candidates interleaved round by round so that a drift in the
host's speed hits them alike, by the median of the rounds. A candidate other than the default
must win by ``MARGIN``, so near ties keep the default rather than flip from run to run.

The choices made so far are process-wide (``choices()``); reports list them with the CPU.
"""
from __future__ import annotations

import logging
import platform
import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

MARGIN = 1.2  # a non-default candidate must be this much faster
MIN_ROUNDS = 5
MIN_SECONDS = 0.03  # per candidate, unless MAX_ROUNDS comes first: short kernels get more rounds
MAX_ROUNDS = 100
DECISIVE = 3.0  # after one timed round, a ratio this large decides (e.g. a bf16 GEMM
# without bf16 units, ~100x slower): no need to pay more rounds of the slow candidate


@dataclass(frozen=True)
class Choice:
    """One measured choice: ``ms`` is each candidate's median in milliseconds (NaN: it failed)."""

    kind: str
    shape_class: str
    chosen: str
    default: str
    ms: dict[str, float]
    rounds: int

    def as_dict(self) -> dict:
        return {**asdict(self), "cpu": cpu_model()}


_CHOICES: dict[tuple[str, Hashable], Choice] = {}


@cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def choose(kind: str, shape_class: Hashable, candidates: Mapping[str, Callable[[], object]],
           default: str) -> Choice:
    """The faster of ``candidates`` for this ``kind`` and ``shape_class``, timed on the first
    call and remembered for the process. A candidate that raises is never chosen; if the
    default raises, the default is still returned (the caller keeps what the plan said)."""
    key = (kind, shape_class)
    if key not in _CHOICES:
        _CHOICES[key] = _measure(kind, str(shape_class), candidates, default)
        logger.debug("kernel choice %s", _CHOICES[key])
    return _CHOICES[key]


def choices(kind: str | None = None) -> list[dict]:
    """The choices made in this process (of one ``kind``), as report rows."""
    return [c.as_dict() for (k, _), c in _CHOICES.items() if kind in (None, k)]


def forget() -> None:
    """Drop every remembered choice (tests; a process that moved to other hardware)."""
    _CHOICES.clear()


def _measure(kind: str, shape_class: str, candidates: Mapping[str, Callable[[], object]],
             default: str) -> Choice:
    runnable = {}
    for name, fn in candidates.items():
        try:
            fn()  # warm-up: first calls pay allocation, primitive creation, compilation
            runnable[name] = fn
        except Exception as e:  # noqa: BLE001 - a candidate this call cannot run loses
            logger.debug("%s candidate %s failed on %s: %s", kind, name, shape_class, e)
    times: dict[str, list[float]] = {name: [] for name in runnable}
    rounds = 0
    while runnable and _more_rounds(times, rounds):
        names = list(runnable) if rounds % 2 == 0 else list(reversed(runnable))  # ABBA order
        for name in names:
            start = time.perf_counter()
            runnable[name]()
            times[name].append(time.perf_counter() - start)
        rounds += 1
    ms = {name: round(1e3 * statistics.median(times[name]), 4) if times.get(name)
          else float("nan") for name in candidates}
    chosen = default
    if runnable:
        fastest = min(runnable, key=ms.__getitem__)
        if default not in runnable or ms[fastest] * MARGIN < ms[default]:
            chosen = fastest
    return Choice(kind, shape_class, chosen, default, ms, rounds)


def _more_rounds(times: dict[str, list[float]], rounds: int) -> bool:
    if rounds == 1 and len(times) > 1:
        firsts = sorted(t[0] for t in times.values())
        if firsts[-1] > DECISIVE * firsts[0]:
            return False
    if rounds < MIN_ROUNDS:
        return True
    return rounds < MAX_ROUNDS and min(sum(t) for t in times.values()) < MIN_SECONDS
