"""Process helpers shared by the adapters, not planning: GC pausing, option normalising,
forked background work."""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic collector for the duration of a pass: a model's IR is millions
    of objects with nothing cyclic to free (decision 0003)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def listed(items: Iterable | str | os.PathLike) -> tuple:
    """Options that take several paths or patterns also take one: a bare string is one item,
    not a list of characters (``keep_fp32="*"`` would otherwise pin every node)."""
    return (items,) if isinstance(items, (str, os.PathLike)) else tuple(items)


class Background:
    """``fn(*args)`` computed in a forked child on another core while the caller goes on;
    ``result()`` waits for it. Where forking is unsafe or would not pay, ``fn`` runs inside
    ``result()`` instead, so callers have one code path.

    A fork, because the work (ONNX shape inference) is C++ holding the GIL and a fork shares
    the model copy-on-write. Only on Linux, with two or more usable CPUs, and when no other
    Python thread runs (it could hold a lock); ``AMP_REWRITE_FORK=0`` turns it off. The child
    sends back a pickle and leaves with ``os._exit``; one never asked is killed in ``cancel``.
    """

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._fn, self._args = fn, args
        self._pid: int | None = None
        self._read_end: int | None = None
        self._answer: tuple[bool, Any] | None = None
        if fork_allowed():
            self._start()

    def _start(self) -> None:
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():  # 3.12+ warns of native threads; see the docstring
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child
            os.close(read_end)
            _child_main(write_end, self._fn, self._args)
        os.close(write_end)
        self._pid, self._read_end = pid, read_end

    def result(self) -> Any:
        """``fn(*args)`` (computed once; its exception is raised here)."""
        if self._answer is None:
            self._answer = self._child_answer() if self._pid is not None else None
        if self._answer is None:  # no child, or it died before answering (killed, OOM)
            self._answer = _answer(self._fn, self._args)
        ok, value = self._answer
        if not ok:
            raise value
        return value

    def _child_answer(self) -> tuple[bool, Any] | None:
        with os.fdopen(self._read_end, "rb") as pipe:
            data = pipe.read()
        self._reap()
        try:
            return pickle.loads(data)
        except Exception:
            logger.debug("background child gave no answer; computing in-process")
            return None

    def cancel(self) -> None:
        """Stop a child whose result is not wanted (no-op once ``result`` returned)."""
        if self._pid is None:
            return
        os.kill(self._pid, signal.SIGKILL)
        os.close(self._read_end)
        self._reap()

    def _reap(self) -> None:
        os.waitpid(self._pid, 0)
        self._pid = None


def fork_allowed() -> bool:
    return (sys.platform.startswith("linux") and os.environ.get("AMP_REWRITE_FORK") != "0"
            and len(os.sched_getaffinity(0)) >= 2 and threading.active_count() == 1)


def _child_main(write_end: int, fn: Callable[..., Any], args: tuple) -> None:
    status = 0
    try:
        answer = _answer(fn, args)
        try:
            data = pickle.dumps(answer)
        except Exception as e:  # an unpicklable value or error
            data = pickle.dumps((False, RuntimeError(f"background result: {e!r}")))
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(data)
    except BaseException:  # noqa: BLE001 - nothing may escape into the parent's stack
        status = 1
    finally:
        os._exit(status)


def _answer(fn: Callable[..., Any], args: tuple) -> tuple[bool, Any]:
    try:
        return True, fn(*args)
    except Exception as e:  # raised by ``result`` in the caller's stack
        return False, e
