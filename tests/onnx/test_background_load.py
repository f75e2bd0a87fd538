"""Loading a large model checks and infers it in a forked child (``load._loaded``): the rewrite
and every error must be those of the serial path, which ``AMP_REWRITE_FORK=0`` selects."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from amp_rewrite import runtime
from amp_rewrite.errors import ModelError
from amp_rewrite.onnx import load
from amp_rewrite.onnx.api import rewrite_onnx

T = onnx.TensorProto
pytestmark = pytest.mark.skipif(not runtime.fork_allowed(),
                                reason="forking is not allowed on this host (Linux, 2+ CPUs)")


def chain(blocks: int, output_type: bool = True) -> onnx.ModelProto:
    """MatMul -> Add -> Relu blocks on a [4, 16] activation, intermediates undescribed."""
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(blocks):
        w, b = f"w{i}", f"b{i}"
        inits += [onh.from_array((rng.standard_normal((16, 16)) * 0.1).astype(np.float32), w),
                  onh.from_array(np.zeros(16, np.float32), b)]
        nodes += [oh.make_node("MatMul", [x, w], [f"m{i}"]),
                  oh.make_node("Add", [f"m{i}", b], [f"a{i}"]),
                  oh.make_node("Relu", [f"a{i}"], [f"r{i}"])]
        x = f"r{i}"
    out = (oh.make_tensor_value_info(x, T.FLOAT, [4, 16]) if output_type
           else onnx.ValueInfoProto(name=x))
    graph = oh.make_graph(nodes, "chain", [oh.make_tensor_value_info("x", T.FLOAT, [4, 16])],
                          [out], inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])


@pytest.fixture(autouse=True)
def no_tqdm_monitor(monkeypatch) -> None:
    """Stop tqdm's monitor thread, which earlier tests' progress bars leave running: with
    another thread alive forking is unsafe (``runtime.fork_allowed``), and loading would
    take the serial path these tests compare with."""
    from tqdm import tqdm

    monkeypatch.setattr(tqdm, "monitor_interval", 0)  # no new monitor during the test
    if tqdm.monitor is not None:
        tqdm.monitor.exit()
        tqdm.monitor = None


_FRESH = "AMP_REWRITE_TEST_FRESH_PROCESS"


def ran_in_a_fresh_process(request: pytest.FixtureRequest) -> bool:
    """Forking needs a process with one thread (``runtime.fork_allowed``). Threads that earlier
    tests of a full run leave behind (Inductor's compile-worker readers, say) rightly forbid
    it, so the test then runs alone in a fresh interpreter and passes or fails with it."""
    if threading.active_count() == 1 or os.environ.get(_FRESH):
        return False
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           request.node.nodeid], cwd=request.config.rootpath, timeout=600,
                          capture_output=True, text=True, env={**os.environ, _FRESH: "1"})
    assert done.returncode == 0, done.stdout[-4000:]
    return True


@pytest.fixture
def forks(monkeypatch) -> list[runtime.Background]:
    """The Background jobs loading starts (forking from the first node on)."""
    started = []

    class Recorded(runtime.Background):
        def _start(self) -> None:
            super()._start()
            started.append(self)

    monkeypatch.setattr(load, "Background", Recorded)
    monkeypatch.setattr(load, "BACKGROUND_NODES", 1)
    return started


def serial(model: onnx.ModelProto, monkeypatch, **options):
    with monkeypatch.context() as m:
        m.setenv("AMP_REWRITE_FORK", "0")
        return rewrite_onnx(model, **options)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_large_model_rewrites_as_on_the_serial_path(monkeypatch, dtype, request):
    if ran_in_a_fresh_process(request):
        return
    model = chain(1400)  # 4200 nodes: above the real threshold
    expected = serial(model, monkeypatch, dtype=dtype).SerializeToString()
    started = []
    monkeypatch.setattr(runtime.Background, "_start",
                        lambda self, start=runtime.Background._start: (start(self),
                                                                        started.append(self)))
    assert rewrite_onnx(model, dtype=dtype).SerializeToString() == expected
    assert len(started) == 1


def test_the_checkers_error_is_the_serial_paths(monkeypatch, forks, request):
    if ran_in_a_fresh_process(request):
        return
    model = chain(3)
    model.graph.node[1].input[0] = "nowhere"  # a name no node or input defines
    with pytest.raises(ModelError) as serial_error:
        serial(model, monkeypatch)
    with pytest.raises(ModelError) as error:
        rewrite_onnx(model)
    assert str(error.value) == str(serial_error.value)
    assert "invalid ONNX model" in str(error.value) and forks


def test_a_model_the_checker_refuses_is_repaired_as_on_the_serial_path(monkeypatch, forks,
                                                                        request):
    if ran_in_a_fresh_process(request):
        return
    model = chain(3, output_type=False)  # untyped graph output: ORT runs it, the checker not
    expected = serial(model, monkeypatch).SerializeToString()
    assert rewrite_onnx(model).SerializeToString() == expected
    # its repair needs the serial path, so loading takes it at once: no fork to discard
    assert not forks


def test_a_model_with_functions_to_inline_loads_serially(forks):
    model = chain(2)
    body = oh.make_function("local", "Twice", ["a"], ["b"], [oh.make_node("Add", ["a", "a"],
                                                                          ["b"])],
                            [oh.make_opsetid("", 18)])
    model.functions.append(body)
    model.opset_import.append(oh.make_opsetid("local", 1))
    model.graph.node.append(oh.make_node("Twice", ["r1"], ["t"], domain="local"))
    model.graph.output[0].name = "t"
    rewritten = rewrite_onnx(model)
    assert not forks and not rewritten.functions
