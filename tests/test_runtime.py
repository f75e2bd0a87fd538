"""``runtime.Background``: a forked child computes what the caller would, or the caller does."""
from __future__ import annotations

import os
import signal

import pytest

from amp_rewrite import runtime
from amp_rewrite.runtime import Background



@pytest.fixture
def _fork_allowed(monkeypatch):
    # fork_allowed() also requires a single thread, which tests that ran earlier in this
    # process (torch's pools) may have broken; these children only call plain functions,
    # so the fork path is exercised as if the process had one thread.
    monkeypatch.setattr(runtime.threading, "active_count", lambda: 1)
    if not runtime.fork_allowed():
        pytest.skip("forking is not allowed here (Linux, 2+ CPUs)")


needs_fork = pytest.mark.usefixtures("_fork_allowed")


def _child_pid() -> int:
    return os.getpid()


def _fails(message: str) -> None:
    raise ValueError(message)


def _dies() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@needs_fork
def test_result_is_computed_in_another_process():
    job = Background(_child_pid)
    assert job.result() not in (None, os.getpid())
    assert job.result() == job.result()  # answered once, kept


@needs_fork
def test_the_childs_exception_is_raised_in_the_caller():
    job = Background(_fails, "bad input")
    with pytest.raises(ValueError, match="bad input"):
        job.result()


@needs_fork
def test_a_child_that_dies_is_replaced_by_computing_in_process(monkeypatch):
    job = Background(_dies)
    monkeypatch.setattr(job, "_fn", _child_pid)  # what the fallback computes, in-process
    assert job.result() == os.getpid()


@needs_fork
def test_cancel_kills_and_reaps_the_child():
    job = Background(sum, range(10**9))  # seconds of work: still running when cancelled
    pid = job._pid
    job.cancel()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped: no zombie left behind
    assert job._pid is None


def test_without_fork_it_computes_in_process(monkeypatch):
    monkeypatch.setenv("AMP_REWRITE_FORK", "0")
    job = Background(_child_pid)
    assert job._pid is None
    assert job.result() == os.getpid()
