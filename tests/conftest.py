"""Suite-wide test organisation (docs/testing.md): xdist groups, their scheduler, and the
``slow`` marks by measured duration.

Nothing here changes what a test checks; it decides where and when tests run:

* ``xdist_group`` marks (``GROUPS``), honoured by ``--dist loadgroup`` (pyproject's addopts):
  the tests of one group run one after another on one worker.
* The ``timing`` group is also *exclusive* under ``-n``: while one of its tests runs, the other
  workers start no test (a file lock, ``_ExclusiveLock``), so that a kernel timing or a speed
  comparison is not measured against a neighbour's load.
* ``slow`` marks for the tests listed in ``SLOW`` (measured durations; tests may also carry the
  mark themselves). ``pytest -m "not slow"`` is the fast subset.
* ``tests/test_fast_subset.py`` checks that the fast subset still imports every module of
  ``amp_rewrite/``.
"""
from __future__ import annotations

import fcntl
import os
import tempfile

import pytest

# Under xdist the workers share the cores: one thread each (and in the processes tests start,
# which inherit the environment), not two workers racing two thread pools over two cores.
# Set before torch is imported by any conftest or test module.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

# ---------------------------------------------------------------------------------------------
# Groups. Keys are node-id prefixes: a file ("tests/x/test_y.py") or a test, with or without
# its parameters ("tests/x/test_y.py::test_z").
# ---------------------------------------------------------------------------------------------
GROUPS: dict[str, list[str]] = {
    # Tests whose assertions depend on measured speed: kernel choices by timing and speed
    # comparisons. One worker, and exclusive (EXCLUSIVE_GROUPS): no other test runs meanwhile.
    "timing": [
        "tests/fx/test_kernel_timing.py",
        "tests/fx/test_lowering.py::test_attention_runs_in_fp32_only_where_that_kernel_is_clearly_faster",
        "tests/fx/test_lowering.py::test_gemms_run_in_fp32_where_this_cpu_has_no_low_gemm_units",
    ],
    # Tests that start several busy processes: gloo process groups (DDP, FSDP2; two ranks
    # each, 60 s collective timeouts) and the training recipes and examples run as scripts.
    # Two of these at once oversubscribe two cores (and the distributed ones then risk their
    # timeouts), so they take turns on one worker.
    "processes": [
        "tests/training/test_distributed.py",
        "tests/training/test_fsdp.py",
        "tests/test_recipes.py",
        "tests/test_examples.py",
    ],
    # A module fixture that runs the onnxruntime latency benchmark (~70 s): spread over two
    # workers, each would run it.
    "ort_latency_bench": [
        "tests/onnx/test_ort_latency_bench.py",
    ],
}
EXCLUSIVE_GROUPS = {"timing"}

# ---------------------------------------------------------------------------------------------
# Slow tests by measured duration (docs/testing.md: how the list was made). A test here, or one
# carrying @pytest.mark.slow itself, is left out of `pytest -m "not slow"`. Measured in full
# `-n 2` runs on 2 shared cores (setup + call + teardown); the tests left fast took < 5 s.
# ---------------------------------------------------------------------------------------------
SLOW: list[str] = [
    # 5-9 s: checkpointed models through the backend and export
    "tests/fx/test_more_architectures.py::test_gradient_checkpointing_trains_through_the_backend_like_autocast",
    "tests/fx/test_more_architectures.py::test_rewrite_of_a_checkpointed_model_warns_that_export_drops_recomputation",
    # 12 s: rewrites until reference counting has freed the IR
    "tests/onnx/test_api.py::test_rewrite_frees_its_ir_by_reference_counting",
    # 5-6 s each: a 4200-node model, forked and serial
    "tests/onnx/test_background_load.py::test_a_large_model_rewrites_as_on_the_serial_path",
    # 5-14 s in the second measured run (tests added meanwhile, or near the line before)
    "tests/training/test_mixed_training.py::test_a_hot_t5_trains_in_mixed_like_fp32_where_autocast_fp16_overflows",
    "tests/core/test_multilabel.py::test_twenty_thousand_groups_solve_optimally_in_seconds",
    "tests/fx/test_more_architectures.py::test_falcon_weight_transpose_is_classified_and_close_to_autocast",
    "tests/fx/test_budget.py::test_the_emitted_overlay_reproduces_the_plan_and_explain_names_the_budget",
    "tests/onnx/test_api.py::test_release_unlinks_subgraphs_and_captured_values",
    "tests/fx/test_rewrite.py::test_outputs_match_fp32_within_tolerance[dtype0]",
    # the tests on the module fixture `bench` (the latency benchmark end to end, ~70 s); the
    # file's other tests (tables, traces, io binding, the cases) stay fast
    "tests/onnx/test_ort_latency_bench.py::test_every_model_and_variant_has_a_row_in_the_schema",
    "tests/onnx/test_ort_latency_bench.py::test_fp32_and_ours_are_measured",
    "tests/onnx/test_ort_latency_bench.py::test_ours_fp16_is_close_to_fp32",
    "tests/onnx/test_ort_latency_bench.py::test_profile_counts_our_casts_and_nothing_on_another_provider",
    "tests/onnx/test_ort_latency_bench.py::test_the_ort_optimizer_row_names_the_model_type_it_ran_with",
    "tests/onnx/test_ort_latency_bench.py::test_a_failing_conversion_is_a_row_with_its_error",
    "tests/onnx/test_ort_latency_bench.py::test_a_variant_past_its_time_limit_is_a_row",
]


def _matches(nodeid: str, prefixes) -> bool:
    return any(nodeid == p or nodeid.startswith(p + "::") or nodeid.startswith(p + "[")
               for p in prefixes)


def group_of(nodeid: str) -> str | None:
    for name, prefixes in GROUPS.items():
        if _matches(nodeid, prefixes):
            return name
    return None


@pytest.hookimpl(tryfirst=True)  # before -m deselects and before xdist reads the groups
def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    for item in items:
        name = group_of(item.nodeid)
        if name is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(name))
        if _matches(item.nodeid, SLOW):
            item.add_marker(slow)


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` grouping by ``GROUPS``, decided on the controller from the node ids.

    xdist's own loadgroup appends ``@group`` to the node ids on the workers, which pytest 9.2
    no longer lets it do (pytest-dev/pytest-xdist#1386: the groups are silently ignored). This
    scheduler does not depend on it; a group mark that does reach the node id still counts."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class GroupsScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):
                return nodeid.rsplit("@", 1)[-1]
            return group_of(nodeid) or nodeid

    return GroupsScheduling(config, log)


# ---------------------------------------------------------------------------------------------
# Exclusive groups under xdist: a readers-writer lock over the workers of one run. A test of an
# exclusive group holds it exclusively (from its first test to its group's last on that worker);
# every other test holds it shared while it runs (setup, call, teardown). A second "gate" lock
# gives the exclusive side priority: once it is waiting, no worker starts a new test.
# ---------------------------------------------------------------------------------------------
class _ExclusiveLock:
    def __init__(self, run_id: str) -> None:
        base = os.path.join(tempfile.gettempdir(), f"amp_rewrite-pytest-{run_id}")
        self.paths = [base + ".gate", base + ".lock"]
        self.gate, self.main = (os.open(p, os.O_RDWR | os.O_CREAT, 0o600) for p in self.paths)
        self.exclusive = False

    def before(self, exclusive: bool) -> None:
        if exclusive:
            if not self.exclusive:
                fcntl.flock(self.gate, fcntl.LOCK_EX)
                fcntl.flock(self.main, fcntl.LOCK_EX)
                self.exclusive = True
        else:
            fcntl.flock(self.gate, fcntl.LOCK_SH)
            fcntl.flock(self.main, fcntl.LOCK_SH)
            fcntl.flock(self.gate, fcntl.LOCK_UN)

    def after(self, exclusive: bool, next_exclusive: bool) -> None:
        if not exclusive or not next_exclusive:
            fcntl.flock(self.main, fcntl.LOCK_UN)
            if self.exclusive:
                fcntl.flock(self.gate, fcntl.LOCK_UN)
                self.exclusive = False

    def close(self) -> None:
        for fd in (self.main, self.gate):
            os.close(fd)
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass


_LOCK_KEY = pytest.StashKey[_ExclusiveLock]()


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1 and run_id:
        config.stash[_LOCK_KEY] = _ExclusiveLock(run_id)


def pytest_unconfigure(config):
    lock = config.stash.get(_LOCK_KEY, None)
    if lock is not None:
        lock.close()


def _exclusive(item) -> bool:
    mark = item.get_closest_marker("xdist_group") if item is not None else None
    return mark is not None and mark.args[:1] in ((g,) for g in EXCLUSIVE_GROUPS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    lock = item.config.stash.get(_LOCK_KEY, None)
    if lock is None:
        return (yield)
    exclusive = _exclusive(item)
    lock.before(exclusive)
    try:
        return (yield)
    finally:
        lock.after(exclusive, _exclusive(nextitem))
