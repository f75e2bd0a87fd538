"""Other FP32 -> FP16/BF16 ONNX converters behind one signature, for comparisons.

Every entry of :data:`PEERS` (and :data:`CONVERTERS`, which adds amp_rewrite itself) is a
callable ``convert(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto`` that keeps graph
input/output types. Imports are lazy: :func:`available_peers` says which ones can run and,
for the others, why not.

* ``onnxconverter_common``: ``onnxconverter_common.float16.convert_float_to_float16``, fp16 only.
* ``ort_transformers``: ``onnxruntime.transformers.float16.convert_float_to_float16``, fp16 only.
* ``modelopt_autocast``: NVIDIA ModelOpt AutoCast ``convert_to_mixed_precision``, fp16 and bf16.
  ModelOpt pins ``onnx~=1.21`` and an older onnxruntime, so it usually lives in a venv of its
  own; it then runs in a persistent worker process of that venv's interpreter
  (``AMP_REWRITE_MODELOPT_PYTHON``, else ``<repo>/../venv-peers/bin/python``).

:class:`Worker` runs any converter in a separate interpreter, so that a benchmark can time
it there and kill it at a timeout.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import importlib
import inspect
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import onnx

from amp_rewrite.errors import AmpRewriteError, UsageError
from tests.models.corpus import canonical_dtype

logger = logging.getLogger(__name__)

ConvertFn = Callable[[onnx.ModelProto, str], onnx.ModelProto]
REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER_TIMEOUT = 600.0  # seconds per conversion in a worker, so a hung peer cannot stall a run


class PeerUnavailableError(AmpRewriteError):
    """A converter's package (or its interpreter) is missing."""


class ConverterTimeoutError(AmpRewriteError):
    """A converter running in a worker process exceeded its time limit (the worker was killed)."""


# ------------------------------------------------------------------ converter bodies
# Each body is self-contained (imports inside): Worker ships its source to another interpreter.


def _onnxconverter_common_body(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    from onnxconverter_common import float16

    return float16.convert_float_to_float16(model, keep_io_types=True)


def _ort_transformers_body(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    from onnxruntime.transformers import float16

    return float16.convert_float_to_float16(model, keep_io_types=True)


def _modelopt_autocast_body(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    import os
    import tempfile

    import onnx
    from modelopt.onnx.autocast import convert_to_mixed_precision

    # Its API reads a file, so the save is part of going from ModelProto to ModelProto.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        onnx.save(model, path)
        low = {"float16": "fp16", "bfloat16": "bf16"}[dtype]
        return convert_to_mixed_precision(path, low_precision_type=low, keep_io_types=True)


def _amp_rewrite_body(model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    import amp_rewrite

    # The harness runs the full checker itself and no peer checks its own output, so the
    # built-in check (about 0.8 s at 50k nodes) is left to the harness here.
    return amp_rewrite.rewrite_onnx(model, dtype=dtype, keep_io_types=True, check=False)


# ------------------------------------------------------------------ worker processes


def _serve(body: ConvertFn, requires: tuple[str, ...]) -> None:
    """Worker main loop; runs in the peer's interpreter with only stdlib and onnx.

    Protocol, one JSON object per line: a ready line ({"ready": true} or an error), then per
    request {"model", "out", "dtype"} a reply {"ok", "seconds"} or {"ok": false, "error"}.
    Only the conversion itself is timed; loading the request and saving the result are not.
    """
    import importlib
    import json
    import sys
    import time

    import onnx

    channel, sys.stdout = sys.stdout, sys.stderr  # library prints must not corrupt replies

    def reply(obj: dict) -> None:
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    def describe(e: BaseException) -> str:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"

    try:
        for module in requires:
            importlib.import_module(module)
    except Exception as e:  # reported to the parent as the reason the peer is unavailable
        reply({"ready": False, "error": describe(e)})
        return
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        try:
            model = onnx.load(request["model"])
            start = time.perf_counter()
            result = body(model, request["dtype"])
            seconds = time.perf_counter() - start
            onnx.save(result, request["out"])
            reply({"ok": True, "seconds": seconds})
        except Exception as e:  # a converter failure is data for the parent
            reply({"ok": False, "error": describe(e)})


def _worker_source(body: ConvertFn, requires: tuple[str, ...]) -> str:
    parts = [
        "from __future__ import annotations",
        inspect.getsource(_serve),
        inspect.getsource(body),
        f"_serve({body.__name__}, {requires!r})",
    ]
    return "\n\n".join(parts)


class Worker:
    """A converter running in a persistent child process of interpreter ``python``."""

    def __init__(self, python: str, body: ConvertFn, requires: tuple[str, ...] = ()) -> None:
        self.python, self.body, self.requires = python, body, requires
        self._proc: subprocess.Popen[str] | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="amp_rewrite_worker_")
        self._log_path = Path(self._tmp.name) / "stderr.log"

    def start(self, timeout: float = 300.0) -> None:
        """Start the child and wait until its imports are done. Raises PeerUnavailableError."""
        if self._proc is not None and self._proc.poll() is None:
            return
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(self._log_path, "a") as log:
            self._proc = subprocess.Popen(
                [self.python, "-u", "-c", _worker_source(self.body, self.requires)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                cwd=self._tmp.name,
            )
        logger.debug("started %s worker in %s", self.body.__name__, self.python)
        ready = self._read_reply(timeout)
        if not ready.get("ready"):
            self.close()
            reason = ready.get("error", "worker did not start")
            raise PeerUnavailableError(f"{self.python}: {reason}")

    def _read_reply(self, timeout: float | None) -> dict:
        assert self._proc is not None and self._proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self._proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                logger.warning("killing %s worker after %g s", self.body.__name__, timeout)
                self.close()
                raise ConverterTimeoutError(f"no answer from the worker within {timeout:g} s")
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            self.close()
            return {"ready": False, "ok": False, "error": f"worker died ({_exit_status(code)})"}
        return json.loads(line)

    def convert_timed(
        self, model: onnx.ModelProto | Path, dtype: str, timeout: float | None = None
    ) -> tuple[onnx.ModelProto, float]:
        """Convert in the worker; returns the model and the worker-measured conversion seconds.

        ``model`` may be a saved file (benchmarks save a large model once). On timeout the
        worker is killed (the next call starts a fresh one) and ConverterTimeoutError raised.
        """
        self.start()
        tmp = Path(self._tmp.name)
        if isinstance(model, onnx.ModelProto):
            onnx.save(model, tmp / "in.onnx")
            model = tmp / "in.onnx"
        request = {"model": str(model), "out": str(tmp / "out.onnx"), "dtype": dtype}
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        reply = self._read_reply(timeout)
        if not reply.get("ok"):
            raise RuntimeError(reply.get("error", "worker failed"))
        return onnx.load(tmp / "out.onnx"), float(reply["seconds"])

    def close(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


_WORKERS: dict[tuple[str, str], Worker] = {}


def _shared_worker(python: str, body: ConvertFn, requires: tuple[str, ...]) -> Worker:
    key = (python, body.__name__)
    if key not in _WORKERS:
        _WORKERS[key] = Worker(python, body, requires)
    return _WORKERS[key]


@atexit.register
def _close_workers() -> None:
    for worker in _WORKERS.values():
        worker.close()


# ------------------------------------------------------------------ the registry


def _this_python() -> str | None:
    return None


@functools.lru_cache(maxsize=1)
def _modelopt_python() -> str | None:
    """None (run in-process) if modelopt imports here, else the interpreter that has it."""
    try:
        importlib.import_module("modelopt.onnx.autocast")
        return None
    except ImportError:
        pass
    configured = os.environ.get("AMP_REWRITE_MODELOPT_PYTHON")
    if configured:
        return configured
    return str(REPO_ROOT.parent / "venv-peers" / "bin" / "python")


@dataclasses.dataclass(frozen=True)
class Peer:
    """A named converter: ``peer(model, dtype)`` converts; it is what the registries hold."""

    name: str
    body: ConvertFn
    dtypes: frozenset[str]
    requires: tuple[str, ...]  # modules that must import
    interpreter: Callable[[], str | None] = _this_python  # None: run in this process
    install_hint: str = ""

    def __call__(self, model: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
        return self.convert_timed(model, dtype)[0]

    def convert_timed(self, model: onnx.ModelProto, dtype: str) -> tuple[onnx.ModelProto, float]:
        """Convert and measure; a worker peer reports its own time (file transfer excluded)."""
        dtype = self.check_dtype(dtype)
        python = self.interpreter()
        if python is not None:
            worker = _shared_worker(python, self.body, self.requires)
            return worker.convert_timed(model, dtype, WORKER_TIMEOUT)
        start = time.perf_counter()
        converted = self.body(model, dtype)
        return converted, time.perf_counter() - start

    def supports(self, dtype: str) -> bool:
        return canonical_dtype(dtype) in self.dtypes

    def check_dtype(self, dtype: str) -> str:
        """The canonical dtype name; UsageError if this converter cannot produce it."""
        if not self.supports(dtype):
            only = sorted(self.dtypes)
            raise UsageError(f"{self.name} does not convert to {dtype} (only {only})")
        return canonical_dtype(dtype)

    def worker(self) -> Worker:
        """A private worker process (for timing with a timeout), even for in-process peers."""
        return Worker(self.interpreter() or sys.executable, self.body, self.requires)

    def unavailable_reason(self) -> str | None:
        """None if the converter can run, else a one-line reason."""
        python = self.interpreter()
        if python is None:
            return self._import_error()
        if not Path(python).exists():
            return f"interpreter {python} not found. {self.install_hint}".strip()
        try:
            _shared_worker(python, self.body, self.requires).start()
        except (PeerUnavailableError, ConverterTimeoutError) as e:
            return f"{e}. {self.install_hint}".strip()
        return None

    def _import_error(self) -> str | None:
        for module in self.requires:
            try:
                importlib.import_module(module)
            except ImportError as e:
                return f"cannot import {module}: {e}. {self.install_hint}".strip()
        return None


PEERS: dict[str, Peer] = {
    "onnxconverter_common": Peer(
        "onnxconverter_common", _onnxconverter_common_body, frozenset({"float16"}),
        ("onnxconverter_common.float16",), install_hint="pip install onnxconverter-common",
    ),
    "ort_transformers": Peer(
        "ort_transformers", _ort_transformers_body, frozenset({"float16"}),
        ("onnxruntime.transformers.float16",), install_hint="it ships with onnxruntime(-gpu)",
    ),
    "modelopt_autocast": Peer(
        "modelopt_autocast", _modelopt_autocast_body, frozenset({"float16", "bfloat16"}),
        ("modelopt.onnx.autocast",), interpreter=_modelopt_python,
        install_hint=(
            "nvidia-modelopt[onnx] pins onnx~=1.21: install it in its own venv and set "
            "AMP_REWRITE_MODELOPT_PYTHON to that venv's python"
        ),
    ),
}


class _AmpRewrite(Peer):
    def _import_error(self) -> str | None:
        try:
            import amp_rewrite

            amp_rewrite.rewrite_onnx  # noqa: B018 - the package loads its API lazily
        except ImportError as e:
            return f"cannot import amp_rewrite's ONNX API: {e}"
        except AttributeError:
            return "amp_rewrite.rewrite_onnx does not exist yet (the ONNX API has not landed)"
        return None


AMP_REWRITE = _AmpRewrite(
    "amp_rewrite", _amp_rewrite_body, frozenset({"float16", "bfloat16"}), ("amp_rewrite",)
)

#: amp_rewrite first, then the peers.
CONVERTERS: dict[str, Peer] = {"amp_rewrite": AMP_REWRITE, **PEERS}


def available_peers(names: list[str] | None = None) -> dict[str, str | None]:
    """name -> None if the converter can run here, else why not (imports happen now)."""
    chosen = names if names is not None else list(CONVERTERS)
    unknown = [n for n in chosen if n not in CONVERTERS]
    if unknown:
        raise UsageError(f"unknown converter(s) {unknown}; known: {sorted(CONVERTERS)}")
    return {name: CONVERTERS[name].unavailable_reason() for name in chosen}



def ort_optimized_graph(model: onnx.ModelProto,
                        feeds: dict | None = None) -> onnx.ModelProto:
    """onnxruntime's own optimised graph of ``model`` (ORT_ENABLE_EXTENDED, CPU provider),
    after one run on ``feeds`` if given; raises whatever onnxruntime raises."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        options.log_severity_level = 4
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=["CPUExecutionProvider"])
        if feeds is not None:
            session.run(None, feeds)
        return onnx.load(options.optimized_model_filepath)


def ort_optimizer_fp16(path: str | os.PathLike, model_type: str) -> onnx.ModelProto:
    """What ORT users run: ``onnxruntime.transformers.optimizer.optimize_model(path,
    model_type)`` then ``.convert_float_to_float16(keep_io_types=True)``; raises whatever it
    raises (its fusions index into graphs they do not expect). It runs in a scratch working
    directory: its shape inference and conversion leave files in the current one."""
    from onnxruntime.transformers import optimizer

    path = os.path.abspath(path)
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            optimized = optimizer.optimize_model(path, model_type=model_type)
            optimized.convert_float_to_float16(keep_io_types=True)
        finally:
            os.chdir(here)
    return optimized.model
