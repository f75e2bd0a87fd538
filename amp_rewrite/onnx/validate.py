"""Run FP32 and rewritten models side by side; calibration maxima; runtime selection.

Errors are measured per output as max|a−b| and max|a−b| / max|a_fp32| (``core.metric``:
relative to the output's scale, so values near zero do not blow the ratio up).
``validate_rewrite`` (what ``--validate`` runs) also runs the rewritten model per op, as a
GPU rounds it, and finds the low-precision nodes that overflow (``Overflow``).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import re
import os
import shlex
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import onnx

from amp_rewrite.core import LowDtype
from amp_rewrite.core.metric import difference
from amp_rewrite.errors import ModelError, UsageError, ValidationError, first_line
from amp_rewrite.onnx.load import text as _text

logger = logging.getLogger(__name__)
REL_TOLERANCE = {LowDtype.FLOAT16: 1e-2, LowDtype.BFLOAT16: 5e-2}
# Size of a symbolic dim in random validation inputs: small keeps both runs fast, and > 1
# so that broadcasting and reductions over the dim are exercised. (Sizes assumed for cost
# estimates are ``load.SYMBOLIC_DIM_EXTENT`` and ``PadPolicy.symbolic_dim_size``.)
RANDOM_FEED_SYMBOLIC_DIM = 4
# Random validation inputs above this many bytes in all are refused, not allocated: a model
# declaring [100000, 100000, 8] would otherwise ask for 596 GiB.
MAX_RANDOM_FEED_BYTES = 1 << 30
CALIBRATE_HINT = "pass real inputs with --calibrate DATA.npz (calibration_data= in Python)"


@functools.cache
def cuda_available() -> bool:
    """True only when a CUDA driver and a device really exist (no ORT error spam on CPU)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def providers() -> list[str]:
    import onnxruntime as ort

    wanted = ["CUDAExecutionProvider"] if cuda_available() else []
    return [p for p in wanted if p in ort.get_available_providers()] + ["CPUExecutionProvider"]


def session(model: onnx.ModelProto):
    import onnxruntime as ort

    from amp_rewrite.onnx.versions import loadable

    opts = ort.SessionOptions()
    opts.log_severity_level = 4  # fatal only: its errors reach the user in ours, in one line
    # An FP32 baseline saved by onnx 1.23 says IR 14, which onnxruntime 1.31 cannot load.
    return ort.InferenceSession(loadable(model).SerializeToString(), opts,
                                providers=providers())


def load_feeds(data: Mapping[str, np.ndarray] | str | os.PathLike) -> dict[str, np.ndarray]:
    if isinstance(data, Mapping):
        return {k: _as_array(k, v) for k, v in data.items()}
    try:
        with np.load(data, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, BadZipFile, pickled objects
        raise UsageError(f"{data}: cannot read calibration data ({first_line(e)}); pass an "
                         ".npz whose keys are the model's input names") from None


def _as_array(name: str, value) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object:
        raise UsageError(f"input data {name!r}: not a numeric array ({type(value).__name__})")
    return array


def check_feeds(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Names (``check_feed_names``), then each array's dtype, rank and fixed dims against the
    input it feeds: a mismatch is a usage error naming the input, not an onnxruntime
    traceback. Floats must have the declared dtype: float64 data would be compared against a
    model that never sees it."""
    check_feed_names(model, feeds)
    for inp in model.graph.input:
        if inp.name not in feeds or not inp.type.HasField("tensor_type"):
            continue
        _check_feed(inp, np.asarray(feeds[inp.name]))


def _check_feed(inp: onnx.ValueInfoProto, array: np.ndarray) -> None:
    t = inp.type.tensor_type
    try:
        want = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    except Exception:  # noqa: BLE001 - a type numpy cannot hold: nothing to compare
        return
    if array.dtype != want:
        raise UsageError(f"input data {inp.name!r} is {array.dtype}, the model's input is "
                         f"{want}; convert it (array.astype(np.{want}))")
    if not t.HasField("shape"):
        return
    # symbolic, unset and negative (-1: "any", as some exporters write) dims take any size
    dims = [d.dim_value if d.HasField("dim_value") and d.dim_value >= 0 else None
            for d in t.shape.dim]
    if array.ndim != len(dims) or any(d is not None and d != n for d, n in zip(dims, array.shape)):
        shown = ["?" if d is None else d for d in dims]
        raise UsageError(f"input data {inp.name!r} has shape {list(array.shape)}, the model's "
                         f"input is {shown} (rank {len(dims)})")


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: normal floats, small non-negative ints (valid ids and 0/1 masks).

    Inputs that cannot be made (not tensors, unknown dtypes, negative or huge dims) raise a
    ValidationError suggesting real inputs instead; nothing large is allocated first.
    """
    rng = np.random.default_rng(seed)
    init_names = {t.name for t in model.graph.initializer}
    specs = [(inp.name, *_random_spec(inp)) for inp in model.graph.input
             if inp.name not in init_names]
    total = sum(math.prod(shape) * np.dtype(dtype).itemsize for _, shape, dtype in specs)
    if total > MAX_RANDOM_FEED_BYTES:
        raise ValidationError(f"cannot validate on random inputs: the declared input shapes "
                              f"need {total / 2**30:.3g} GiB ({_shapes(specs)}); {CALIBRATE_HINT}")
    return {name: _random_array(rng, shape, dtype) for name, shape, dtype in specs}


def _random_spec(inp: onnx.ValueInfoProto) -> tuple[list[int], np.dtype]:
    t = inp.type.tensor_type if inp.type.HasField("tensor_type") else None
    try:
        if t is None:
            raise ValueError("not a tensor")
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))
    except Exception as e:  # noqa: BLE001 - sequences, optionals, unknown elem types
        raise ValidationError(f"cannot make a random value for input {inp.name!r} ({e}); "
                              f"{CALIBRATE_HINT}") from None
    shape = [d.dim_value if d.HasField("dim_value") else RANDOM_FEED_SYMBOLIC_DIM
             for d in t.shape.dim]
    if any(d < 0 for d in shape):
        raise ValidationError(f"input {inp.name!r} declares a negative dim {shape}; "
                              f"{CALIBRATE_HINT}")
    return shape, dtype


def _random_array(rng: np.random.Generator, shape: list[int], dtype: np.dtype) -> np.ndarray:
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape, dtype=np.float32).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape, dtype=np.float32) < 0.5
    if np.issubdtype(dtype, np.integer):
        return rng.integers(0, 2, shape).astype(dtype)
    return np.zeros(shape, dtype)  # strings, complex: a defined value of the right type


def _shapes(specs) -> str:
    return ", ".join(f"{name} {shape}" for name, shape, _ in specs[:4])


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs: float
    max_rel: float
    new_nonfinite: bool  # NaN/Inf where the FP32 run had none

    def ok(self, tolerance: float) -> bool:
        return not self.new_nonfinite and self.max_rel <= tolerance


def compare(reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> list[OutputError]:
    """Per output of ``reference``, ``got``'s output of that name against it (the metric:
    ``core.metric``)."""
    errors = []
    for name, ref in reference.items():
        d = difference(ref, got[name])
        errors.append(OutputError(name, d.max_abs, d.max_rel, d.new_nonfinite))
    return errors


def check_feed_names(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> None:
    """Feeds must name every required input (initializers are optional) and nothing else."""
    defaults = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input]
    missing = [n for n in inputs if n not in feeds and n not in defaults]
    unknown = [n for n in feeds if n not in inputs]
    if missing or unknown:
        raise UsageError(f"input data does not match the model: missing {missing}, unknown "
                         f"{unknown}; the model's inputs are {inputs}")


def as_declared(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float feeds in the dtype each input declares: a model rewritten without
    keep_io_types takes fp16/bf16 inputs, and is compared on the same data."""
    check_feed_names(model, feeds)
    declared = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
    out = {}
    for name, array in feeds.items():
        array = np.asarray(array)
        elem = declared.get(name, 0)
        if elem and np.issubdtype(array.dtype, np.floating):
            array = array.astype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        out[name] = array
    return out


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
        reference_outputs: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Outputs by name from onnxruntime, or the reference evaluator where ORT has no kernel
    (ORT-CPU implements almost nothing in bfloat16): ``reference_outputs`` when the caller
    has run it already. Feeds follow ``as_declared``."""
    feeds = as_declared(model, feeds)
    names = [_text(o.name) for o in model.graph.output]
    try:
        sess = session(model)
    except Exception as e:
        if "NOT_IMPLEMENTED" not in str(e):
            raise ModelError(f"onnxruntime cannot load the model: {first_line(e)}") from e
        logger.info("onnxruntime lacks a kernel (%s); using onnx.reference", str(e)[:120])
        if reference_outputs is not None:
            return dict(reference_outputs)
        return reference_run(model, feeds)
    return dict(zip(names, sess.run(None, dict(feeds))))


def runtime_note(model: onnx.ModelProto, dtype: LowDtype | str) -> str | None:
    """Where a bf16 (or mixed) output runs, when the installed onnxruntime cannot load it
    (its CPU provider has no bf16 kernel for most ops: Gemm, Where, Add, Expand, ...); else
    None."""
    if dtype is LowDtype.FLOAT16:
        return None
    import onnxruntime as ort

    try:
        session(model)
    except Exception as e:  # noqa: BLE001 - onnxruntime's errors have no common base
        if "NOT_IMPLEMENTED" not in str(e):
            return None  # another failure: --validate reports it as such
        missing = re.search(r"implementation for (\w+\(\d+\))", str(e))
        op = f" ({missing.group(1)} has none)" if missing else ""
        return (f"bfloat16 targets GPU providers (CUDA, TensorRT): onnxruntime "
                f"{ort.__version__} here ({', '.join(providers())}) lacks bf16 kernels{op}; "
                "--validate runs the output in onnx.reference")
    return None


def _with_text_io_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with graph input/output names that are not valid UTF-8 escaped, as the
    rewrite escapes them: onnxruntime's Python binding cannot decode them. Usually the model
    itself (nothing to fix)."""
    io_names = [v.name for v in (*model.graph.input, *model.graph.output)]
    if not any(isinstance(n, bytes) for n in io_names):
        return model
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    g = fixed.graph
    for v in (*g.input, *g.output, *g.value_info):
        v.name = _text(v.name)
    for t in g.initializer:
        t.name = _text(t.name)
    for n in g.node:
        n.input[:] = [_text(i) for i in n.input]
        n.output[:] = [_text(o) for o in n.output]
    return fixed


def reference_run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnx.reference computes every op in its declared dtype: fp16 overflow shows here."""
    names = [_text(o.name) for o in model.graph.output]
    return dict(zip(names, reference_evaluator(model).run(None, dict(feeds))))


def reference_evaluator(model: onnx.ModelProto, custom_ops: tuple[type, ...] = ()):
    """An ``onnx.reference.ReferenceEvaluator`` that also runs the contrib ops the fusion
    step emits, with GatherElements fixed (``_reference_fixes``), and ``custom_ops``
    (``OpRun`` classes of the model's own custom-domain ops)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model, new_ops=[*_reference_fixes(), *custom_ops])


def _pool_axis(size: int, kernel: int, stride: int, dilation: int, head: int, tail: int,
               ceil_mode: bool, same: str | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One spatial axis of an AveragePool as onnxruntime (and torch) compute it: the 0/1
    matrix (out, size) of the taps each output sums, the number of its taps inside the
    input, and the number inside the input or its padding (``count_include_pad``).

    Under ``ceil_mode`` a window may run past the padding: those taps count for neither, and
    the last window must start inside the input or the head padding. ``same``
    (``SAME_UPPER``/``SAME_LOWER``) chooses the pads (as onnxruntime does, ignoring the
    dilation)."""
    span = dilation * (kernel - 1) + 1
    if same:  # onnxruntime sizes SAME pads without the dilation
        total = max((-(-size // stride) - 1) * stride + kernel - size, 0)
        head = total // 2 if same == "SAME_UPPER" else total - total // 2
        tail = total - head
    room = size + head + tail - span
    if ceil_mode:
        out = -(-room // stride) + 1
        if (out - 1) * stride >= size + head:
            out -= 1
    else:  # C integer division, truncating toward zero as onnxruntime does
        out = (abs(room) // stride) * (1 if room >= 0 else -1) + 1
    out = max(out, 0)
    taps = (np.arange(out)[:, None] * stride - head
            + np.arange(kernel)[None, :] * dilation)  # (out, kernel) input positions
    inside = (taps >= 0) & (taps < size)
    matrix = np.zeros((out, size), np.float32)
    rows = np.broadcast_to(np.arange(out)[:, None], taps.shape)
    matrix[rows[inside], taps[inside]] = 1.0
    return matrix, inside.sum(1), (taps < size + tail).sum(1)


def average_pool(x: np.ndarray, kernel_shape, strides=None, pads=None, dilations=None,
                 ceil_mode: int = 0, count_include_pad: int = 0,
                 auto_pad: str = "NOTSET") -> np.ndarray:
    """AveragePool summed in float32 and rounded once to ``x.dtype``, with onnxruntime's
    window arithmetic. onnx.reference returns 0 where a kernel exceeds the input under
    ``ceil_mode`` (EfficientNet's ``AvgPool2d(1280, ceil_mode=True)`` head), so such a model
    validated there (bf16) failed against its FP32 run in onnxruntime."""
    n = len(kernel_shape)
    strides = list(strides or [1] * n)
    dilations = list(dilations or [1] * n)
    pads = list(pads or [0] * (2 * n)) if auto_pad in ("NOTSET", "", None) else [0] * (2 * n)
    same = auto_pad if auto_pad in ("SAME_UPPER", "SAME_LOWER") else None
    y = np.asarray(x, np.float32)
    divisor = np.ones((), np.float32)
    for axis in range(n):
        matrix, valid, padded = _pool_axis(x.shape[2 + axis], int(kernel_shape[axis]),
                                           int(strides[axis]), int(dilations[axis]),
                                           int(pads[axis]), int(pads[n + axis]),
                                           bool(ceil_mode), same)
        y = np.moveaxis(np.tensordot(y, matrix, axes=([2 + axis], [1])), -1, 2 + axis)
        count = padded if count_include_pad else valid
        divisor = np.multiply.outer(divisor, count.astype(np.float32))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (y / divisor).astype(x.dtype)


@functools.cache
def _reference_fixes() -> list[type]:
    """onnx.reference's GatherElements breaks when indices are smaller than the data in a
    non-gathered axis (BERT's token_type_ids); this follows the spec with take_along_axis.
    Its AveragePool returns 0 for a kernel larger than the input under ``ceil_mode``
    (``average_pool`` follows onnxruntime)."""
    from onnx.reference.op_run import OpRun

    class AveragePool(OpRun):
        op_domain = ""

        def _run(self, x, auto_pad=None, ceil_mode=None, count_include_pad=None,
                 dilations=None, kernel_shape=None, pads=None, strides=None):
            return (average_pool(x, kernel_shape, strides, pads, dilations, ceil_mode or 0,
                                 count_include_pad or 0, auto_pad or "NOTSET"),)

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=None):
            axis = (axis or 0) % data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices)
            window = tuple(slice(None) if d == axis else slice(0, n)
                           for d, n in enumerate(indices.shape))
            return (np.take_along_axis(data[window], indices, axis=axis),)

    from amp_rewrite.onnx.reference_ops import CONTRIB_OPS, FLOAT32_KERNELS

    # contrib ops: the fused ops of amp_rewrite.onnx.fusion
    return [GatherElements, AveragePool, _stacking_loop(), *FLOAT32_KERNELS, *CONTRIB_OPS]


def _stacking_loop() -> type:
    """onnx.reference's Loop joins its scan outputs with ``np.vstack``: per-step values of
    shape [2, 8] come out [6, 8] after three steps, not [3, 2, 8] as the spec (and
    onnxruntime) stack them. This Loop runs the same body and stacks them on a new axis."""
    from onnx.reference.ops.op_loop import Loop as ReferenceLoop

    class Loop(ReferenceLoop):
        op_domain = ""

        def _run(self, *args, **kwargs):
            scans, steps, run_body = self.K, [], self._run_body

            def recording(*a, **kw):
                outputs = run_body(*a, **kw)
                steps.append(outputs[len(outputs) - scans:])
                return outputs

            self._run_body, self.K = recording, 0  # the base class collects no scan output
            try:
                carried = super()._run(*args, **kwargs)[:self.N]
            finally:
                del self._run_body
                self.K = scans
            stacked = [np.stack([step[k] for step in steps]) if steps
                       else self._no_steps(self.N + 1 + k) for k in range(scans)]
            return self._check_and_fix_outputs((*carried, *stacked))

        def _no_steps(self, index: int) -> np.ndarray:
            """A scan output after zero steps: no rows of the body output's declared shape
            and type (unknown dims as 0, as onnxruntime gives them)."""
            body = next(a.g for a in self.onnx_node.attribute if a.name == "body")
            t = body.output[index].type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else 0 for d in t.shape.dim]
            return np.empty([0, *shape], onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))

    return Loop


def validate(fp32: onnx.ModelProto, mixed: onnx.ModelProto, dtype: LowDtype,
             feeds: Mapping[str, np.ndarray] | None = None,
             tolerance: float | None = None) -> tuple[list[OutputError], float]:
    """Per-output errors of ``mixed`` against ``fp32`` on ``feeds`` (seeded random inputs by
    default), both run in onnxruntime. Validation that cannot run (no outputs, inputs that
    cannot be made, a runtime failing on them) is a ValidationError saying why, with a fix.
    ``validate_rewrite`` adds the per-op overflow check."""
    fp32, feeds, origin = _validation_inputs(fp32, feeds)
    reference = _run_for_validation(fp32, feeds, "the FP32 model", origin)
    got = _run_for_validation(mixed, feeds, "the rewritten model", origin)
    return _compare_by_position(reference, got), _tolerance(dtype, tolerance)


def _validation_inputs(fp32: onnx.ModelProto, feeds) -> tuple[onnx.ModelProto, dict, str]:
    """(the FP32 model with text I/O names, the feeds, where they came from)"""
    if not fp32.graph.output:
        raise ValidationError("cannot validate: the model has no graph outputs to compare")
    fp32 = _with_text_io_names(fp32)
    if feeds is None:
        return fp32, random_feeds(fp32), "random inputs"
    check_feeds(fp32, feeds)
    return fp32, dict(feeds), "the given inputs"


def default_tolerance(dtype: LowDtype | str) -> float:
    """The relative error ``--validate`` accepts by default: the low dtype's; a mixed plan's
    is bf16's, the coarser dtype it may run."""
    return REL_TOLERANCE.get(dtype, REL_TOLERANCE[LowDtype.BFLOAT16])


def _tolerance(dtype: LowDtype | str, tolerance: float | None) -> float:
    return default_tolerance(dtype) if tolerance is None else tolerance


def _compare_by_position(reference: Mapping[str, np.ndarray],
                         got: Mapping[str, np.ndarray]) -> list[OutputError]:
    # by position: the rewrite keeps the outputs' order, and their names as far as they are
    # valid text (invalid UTF-8 is escaped in the output)
    return compare(reference, dict(zip(reference, got.values())))


def _run_for_validation(model: onnx.ModelProto, feeds, which: str, origin: str,
                        reference_outputs: Mapping[str, np.ndarray] | None = None):
    try:
        return run(model, feeds, reference_outputs)
    except UsageError:
        raise
    except ModelError as e:
        if which == "the FP32 model":
            raise ModelError(f"{e}; onnxruntime cannot validate this model: run without "
                             "--validate") from None
        raise ValidationError(f"{which} does not load in onnxruntime ({e})") from None
    except MemoryError:
        raise ValidationError(f"out of memory running {which} on {origin}; "
                              f"{CALIBRATE_HINT} with smaller shapes") from None
    except Exception as e:  # noqa: BLE001 - onnxruntime's errors have no common base
        hint = f"; {CALIBRATE_HINT}" if origin == "random inputs" else ""
        raise ValidationError(f"onnxruntime failed running {which} on {origin} "
                              f"({first_line(e)[:300]}){hint}") from None


@dataclass(frozen=True)
class Overflow:
    """Where a low-precision overflow starts: a node computing in the low dtype whose output
    is inf/NaN where the FP32 model's value is finite, while its inputs are not. A cast the
    rewrite inserted is such a node when an fp32 value is too large for its low ``readers``:
    they are the nodes to keep fp32 then."""

    node: str
    op_type: str
    value: str  # the FP32 model's name of the value
    fp32_max: float | None  # max finite |x| of that value in the FP32 run (None: no twin)
    readers: tuple[str, ...] = ()  # an inserted cast's readers
    dtype: str = ""  # the dtype it overflows (float16, bfloat16): a mixed plan has both

    @property
    def keep_fp32(self) -> tuple[str, ...]:
        return self.readers or (self.node,)

    def describe(self, dtype: LowDtype | str) -> str:
        peak = "" if self.fp32_max is None else f" (FP32 max |x| {self.fp32_max:.3g})"
        to = self.dtype or getattr(dtype, "value", dtype)
        if self.readers:
            named = ", ".join(repr(r) for r in self.readers if r) or "its readers"
            return f"the cast of {self.value!r}{peak} to {to} for {named}"
        return f"{self.op_type} {self.node or self.value!r}{peak}"


@dataclass(frozen=True)
class Validation:
    """What ``--validate`` found (``validate_rewrite``): onnxruntime's error per output, and
    the overflows of the per-op run that reach a graph output (those outputs are marked
    ``new_nonfinite``)."""

    errors: list[OutputError]
    tolerance: float
    dtype: LowDtype | str  # or "mixed"
    overflows: list[Overflow]
    overflowed_outputs: list[str]
    origin: str  # where the inputs came from
    per_op_skipped: str | None = None  # why the per-op run could not run

    def ok(self) -> bool:
        return not self.overflows and all(e.ok(self.tolerance) for e in self.errors)

    def overflow_summary(self) -> str:
        """One line: the first overflowing nodes and the outputs they reach."""
        dtypes = sorted({o.dtype for o in self.overflows} - {""}) or [self.dtype.value]
        low = "/".join(dtypes)
        shown = "; ".join(o.describe(self.dtype) for o in self.overflows[:3])
        more = f" and {len(self.overflows) - 3} more" if len(self.overflows) > 3 else ""
        outputs = ", ".join(map(repr, self.overflowed_outputs))
        holds = ", ".join(f"{d} holds ±{_low_max(LowDtype(d)):.5g}" for d in dtypes)
        return (f"{low} overflow at {shown}{more}: inf/NaN where the FP32 model is finite "
                f"({holds}), reaching output(s) {outputs} when each op rounds to its dtype "
                f"as a GPU does ({self.origin})")

    def overflow_fix(self) -> str:
        """What to pass instead: real inputs for calibration, or the nodes kept fp32."""
        keep = list(dict.fromkeys(n for o in self.overflows[:3] for n in o.keep_fp32 if n))
        keep_flag = f"--keep-fp32 {shlex.quote(','.join(map(_fnmatch_literal, keep)))}"
        if self.origin == "random inputs":
            calibrate = (f"pass real inputs with --calibrate DATA.npz (nodes they drive "
                         f"beyond the {getattr(self.dtype, 'value', self.dtype)} range "
                         f"stay fp32)")
            return f"{calibrate}, or {keep_flag}" if keep else calibrate
        return f"{keep_flag}, or a lower --threshold" if keep else "a lower --threshold"


def _low_max(dtype: LowDtype) -> float:
    import ml_dtypes

    return float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dtype is LowDtype.BFLOAT16
                                 else np.float16).max)


def _fnmatch_literal(name: str) -> str:
    from amp_rewrite.core.budget import fnmatch_literal

    return fnmatch_literal(name)


def validate_rewrite(fp32: onnx.ModelProto, mixed: onnx.ModelProto, dtype: LowDtype | str,
                     feeds: Mapping[str, np.ndarray] | None = None,
                     tolerance: float | None = None) -> Validation:
    """``validate``, plus the rewritten model run per op in onnx.reference, every op rounding
    its outputs to its declared dtype as a GPU does: onnxruntime's CPU provider runs many
    float16 ops in float32 and folds the cast pairs around them, which hides an overflow.
    A node of the main graph computing in the low dtype whose output turns inf/NaN where the
    FP32 model's value is finite, and from which that reaches a graph output, is an
    ``Overflow``; one the graph absorbs (a masked score the softmax zeroes) is not.

    One reference run serves both checks where onnxruntime lacks kernels (bfloat16, and a
    mixed plan's bf16 nodes: ``dtype`` "mixed", each node rounding to its own dtype), and the
    one FP32 run also fetches the FP32 values of whatever the reference run finds non-finite.
    Where onnx.reference cannot run the model, only ``validate``'s comparison is made (a
    warning says so)."""
    fp32, feeds, origin = _validation_inputs(fp32, feeds)
    low = _per_op_run(mixed, feeds)
    twins = _FP32Twins(mixed.graph, fp32.graph)
    outputs = [_text(o.name) for o in fp32.graph.output]
    wanted = sorted({twins.of(name) for name in low.nonfinite} - {None, *outputs})
    fp32_values = _run_fetching(fp32, feeds, wanted, origin)
    reference = {name: fp32_values[name] for name in outputs}
    got = _run_for_validation(mixed, feeds, "the rewritten model", origin, low.outputs)
    overflows, reached = _overflows(mixed.graph, low, fp32_values, twins)
    errors = [dataclasses.replace(e, new_nonfinite=True) if j in reached else e
              for j, e in enumerate(_compare_by_position(reference, got))]
    if low.skipped:  # said once both runs have made it: a failure of theirs says more
        logger.warning("--validate: %s; low-precision overflow is checked on onnxruntime's "
                       "outputs only", low.skipped)
    return Validation(errors, _tolerance(dtype, tolerance), dtype, overflows,
                      [outputs[j] for j in reached], origin, low.skipped)


@dataclass
class _PerOpRun:
    """The rewritten model under onnx.reference: its outputs, and for every main-graph node
    output holding inf/NaN, where (a mask) and whether its dtype is a low one. Where
    onnx.reference cannot run the model: no outputs, nothing non-finite, and why."""

    outputs: dict[str, np.ndarray] | None = None
    nonfinite: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    low: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> its low dtype
    skipped: str | None = None


def _per_op_run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> _PerOpRun:
    """The per-op run. One onnx.reference cannot make is a second opinion missing, not a
    failure: onnxruntime's comparison still stands (``validate_rewrite`` warns)."""
    from amp_rewrite.onnx.reference_ops import LOW_FLOATS

    try:
        with np.errstate(all="ignore"):  # overflow is what this run looks for
            values = reference_evaluator(model).run(None, as_declared(model, feeds),
                                                    intermediate=True)
    except Exception as e:  # noqa: BLE001 - onnx.reference's kernels raise any type
        return _PerOpRun(skipped=f"onnx.reference cannot run the rewritten model "
                                 f"({first_line(e)[:200]})")
    run_ = _PerOpRun({_text(o.name): values[o.name] for o in model.graph.output})
    for node in model.graph.node:
        for name in node.output:
            value = values.get(name) if name else None
            if not isinstance(value, np.ndarray) or not (value.dtype.kind == "f"
                                                         or value.dtype in LOW_FLOATS):
                continue
            bad = ~np.isfinite(value)
            if bad.any():
                run_.nonfinite[name] = bad
                if value.dtype in LOW_FLOATS:
                    run_.low[name] = value.dtype.name
    return run_


class _FP32Twins:
    """Value of the rewritten main graph -> the FP32 model's value it stands for: the same
    name, or the one across the casts (pads, slices) the rewrite inserted (a graph output
    made low is renamed, and the inserted cast back writes its name)."""

    def __init__(self, mixed: onnx.GraphProto, fp32: onnx.GraphProto) -> None:
        from amp_rewrite.onnx.view import INSERTED_TAG

        names = {*(i.name for i in fp32.input), *(t.name for t in fp32.initializer),
                 *(o for n in fp32.node for o in n.output)}
        linked: dict[str, list[str]] = {}
        for node in mixed.node:
            if node.input and node.output \
                    and any(p.key == INSERTED_TAG for p in node.metadata_props):
                a, b = (linked.get(v, [v]) for v in (node.input[0], node.output[0]))
                if a is not b:
                    for v in a + b:
                        linked[v] = a + b
        self.twins = {v: next((m for m in group if m in names), None)
                      for v, group in linked.items()}
        self.names = names

    def of(self, name: str) -> str | None:
        return self.twins[name] if name in self.twins else (name if name in self.names else None)


def _run_fetching(model: onnx.ModelProto, feeds, extra: list[str], origin: str) -> dict:
    """The FP32 model's outputs and the ``extra`` values, by name, in one run."""
    with _fetching(model, extra):
        return _run_for_validation(model, feeds, "the FP32 model", origin)


@contextlib.contextmanager
def _fetching(model: onnx.ModelProto, names: list[str]) -> Iterator[None]:
    """``model`` with ``names`` as extra graph outputs, for the duration (no copy of the
    weights; onnxruntime types an untyped output itself)."""
    count = len(model.graph.output)
    model.graph.output.extend(onnx.ValueInfoProto(name=n) for n in names)
    try:
        yield
    finally:
        del model.graph.output[count:]


def _overflows(graph: onnx.GraphProto, low: _PerOpRun, fp32: Mapping[str, np.ndarray],
               twins: _FP32Twins) -> tuple[list[Overflow], list[int]]:
    """(the overflows that reach a graph output, in graph order; the positions of those
    outputs). A value is newly non-finite where its FP32 twin is finite; the nodes where
    that starts (no input newly non-finite) are followed down to the outputs."""
    starts: dict[str, frozenset[int]] = {}  # newly non-finite value -> the nodes it starts at
    low_starts: dict[int, str] = {}  # node -> its low-precision output that starts one
    for index, node in enumerate(graph.node):
        inherited = frozenset().union(*(starts[i] for i in node.input if i in starts))
        clean_inputs = not any(i in low.nonfinite for i in node.input)
        for name in node.output:
            twin = twins.of(name)
            if name not in low.nonfinite or not _newly_nonfinite(
                    low.nonfinite[name], fp32.get(twin) if twin else None,
                    bool(inherited) or clean_inputs):
                continue
            starts[name] = inherited or frozenset({index})
            if not inherited and name in low.low:
                low_starts.setdefault(index, name)
    reached = [j for j, o in enumerate(graph.output)
               if starts.get(o.name, frozenset()) & low_starts.keys()]
    first = sorted(frozenset().union(*(starts[graph.output[j].name] for j in reached))
                   & low_starts.keys())
    return [_overflow(graph, graph.node[i], low_starts[i], fp32, twins, low)
            for i in first], reached


def _newly_nonfinite(mask: np.ndarray, fp32_value: np.ndarray | None, default: bool) -> bool:
    """inf/NaN where the FP32 value is finite (elementwise where the shapes agree, else the
    whole FP32 value finite); ``default`` for a value with no FP32 twin (a fused node's)."""
    if fp32_value is None:
        return default
    finite = np.isfinite(fp32_value)
    return bool((mask & finite).any()) if finite.shape == mask.shape else bool(finite.all())


def _overflow(graph: onnx.GraphProto, node: onnx.NodeProto, value: str,
              fp32: Mapping[str, np.ndarray], twins: _FP32Twins, low: _PerOpRun) -> Overflow:
    from amp_rewrite.onnx.view import INSERTED_TAG

    twin = twins.of(value)
    peak = _finite_max(fp32[twin]) if twin in fp32 else None
    inserted = any(p.key == INSERTED_TAG for p in node.metadata_props)
    readers = tuple(n.name for n in graph.node if value in n.input) if inserted else ()
    return Overflow(node.name, node.op_type, twin or value, peak, readers,
                    low.low.get(value, ""))


def _finite_max(a: np.ndarray) -> float | None:
    finite = np.abs(a[np.isfinite(a)]) if a.size else a
    return float(finite.max()) if finite.size else None


def value_maxima(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, float]:
    """max |x| of every float32 value of the main graph in one FP32 run, graph outputs
    included (their producers overflow a low dtype as any other's do). A model whose values
    carry no types (exported without shape inference) is inferred first: an untyped value
    would otherwise go unseen."""
    import onnx_ir as ir

    m = ir.from_proto(model)
    if any(v.name and v.type is None for n in m.graph for v in n.outputs):
        try:
            model = onnx.shape_inference.infer_shapes(model)
            m = ir.from_proto(model)
        except Exception:  # noqa: BLE001 - inference refuses a damaged model: measure what is typed
            logger.info("calibration: shape inference failed; untyped values are not measured")
    originals = [v for v in m.graph.outputs if v.dtype == ir.DataType.FLOAT and v.name]
    existing = {v.name for v in m.graph.outputs}
    extra = [v for n in m.graph for v in n.outputs
             if v.dtype == ir.DataType.FLOAT and v.name and v.name not in existing]
    m.graph.outputs.extend(extra)
    fetched = [*dict.fromkeys(originals), *extra]
    proto = ir.to_proto(m)
    check_feeds(proto, feeds)
    try:
        outputs = session(proto).run([v.name for v in fetched], dict(feeds))
    except Exception as e:  # noqa: BLE001 - onnxruntime's errors have no common base
        raise ModelError(f"calibration: onnxruntime failed running the FP32 model on the "
                         f"calibration data ({first_line(e)[:300]})") from None
    return {v.name: float(np.nanmax(np.abs(o))) if o.size else 0.0
            for v, o in zip(fetched, outputs)}


# -- which providers can run the output ----------------------------------------------------

CUDA = "CUDAExecutionProvider"
# Reads onnxruntime's kernel registry in a child process: listing it constructs every
# provider the wheel ships (onnxruntime-gpu: CUDA's and TensorRT's), which crashes the process
# where one's libraries are missing (a machine without CUDA; TensorRT not installed).
_REGISTRY_SCRIPT = """
import json
from onnxruntime.capi import _pybind_state as C
print(json.dumps([[k.domain, k.op_name, list(k.version_range),
                   sorted({t for ts in k.type_constraints.values() for t in ts})]
                  for k in C.get_all_opkernel_def() if k.provider == %r]))
""" % CUDA
_LOW_TYPES = {"float16", "bfloat16"}
_ALL_OPSETS = 2 ** 31 - 1
# The CUDA registry of one onnxruntime-gpu, packaged (tools/cuda_registry.py writes it): per
# domain and op, each kernel's [since, until (null: open), its float types].
CUDA_SNAPSHOT = "data/cuda_kernels.json"


class CudaRegistry(NamedTuple):
    """CUDA kernels as (domain, op, (since, until), types) and where they were read."""
    kernels: tuple[tuple, ...]
    source: str


def list_cuda_kernels(env: Mapping[str, str] | None = None) -> tuple[tuple, ...] | str:
    """This onnxruntime's CUDA kernels as (domain, op, (since, until), types), listed in a
    child process (``env``: its environment), or why they could not be listed (this
    onnxruntime has no CUDA provider, or its libraries do not load)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _REGISTRY_SCRIPT], capture_output=True,
                              text=True, timeout=120, env=None if env is None else dict(env))
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"listing onnxruntime's kernels failed ({first_line(e)})"
    if done.returncode != 0:
        return (f"onnxruntime's CUDA kernels cannot be listed here (the listing exited with "
                f"{done.returncode}: a provider's libraries, CUDA's or TensorRT's, do not load)")
    import json

    kernels = tuple((d or "", op, tuple(r), frozenset(t)) for d, op, r, t in
                    json.loads(done.stdout.strip().splitlines()[-1]))
    return kernels if kernels else "this onnxruntime has no CUDA provider"


def read_cuda_snapshot() -> dict | str:
    """The packaged CUDA registry (``CUDA_SNAPSHOT``) as its JSON object, or why it cannot be
    read."""
    import importlib.resources
    import json

    try:
        text = (importlib.resources.files("amp_rewrite.onnx") / CUDA_SNAPSHOT).read_text()
        snapshot = json.loads(text)
    except (OSError, ValueError) as e:
        return f"the packaged CUDA registry cannot be read ({first_line(e)})"
    if not (isinstance(snapshot, dict) and isinstance(snapshot.get("kernels"), dict)
            and {"onnxruntime", "read"} <= snapshot.keys()):
        return f"the packaged CUDA registry cannot be read ({CUDA_SNAPSHOT} is not one)"
    return snapshot


def snapshot_kernels(snapshot: Mapping) -> tuple[tuple, ...]:
    """A snapshot's kernels in ``list_cuda_kernels``'s form."""
    return tuple((domain, op, (since, _ALL_OPSETS if until is None else until),
                  frozenset(f"tensor({t})" for t in types))
                 for domain, ops in snapshot["kernels"].items()
                 for op, kernels in ops.items() for since, until, types in kernels)


@functools.cache
def cuda_registry() -> CudaRegistry | str:
    """The CUDA kernels ``cuda_kernels`` checks against: this onnxruntime's, listed, where its
    CUDA provider loads; elsewhere (a machine without CUDA libraries, an onnxruntime without
    a CUDA provider) the packaged registry of one onnxruntime-gpu; or why neither can be
    read. ``source`` says which."""
    from onnxruntime import __version__ as version

    live = list_cuda_kernels()
    if not isinstance(live, str):
        return CudaRegistry(live, f"onnxruntime {version}'s CUDA provider, listed here")
    snapshot = read_cuda_snapshot()
    if isinstance(snapshot, str):
        return f"{live}; {snapshot}"
    # Another onnxruntime's registry still answers: the output runs on a GPU machine, rarely
    # this one, with whatever onnxruntime-gpu is installed there, so the answer for a named
    # version serves better than none; ``source`` names that version, and says this one
    # differs, so that a kernel reported missing can be checked against the user's.
    source = (f"{snapshot.get('package', 'onnxruntime-gpu')} {snapshot['onnxruntime']}'s "
              f"CUDA registry, read {snapshot['read']}")
    if snapshot["onnxruntime"] != version:
        source += f"; this onnxruntime is {version}, whose CUDA kernels may differ"
    return CudaRegistry(snapshot_kernels(snapshot), source)


def cuda_kernels(model, registry: CudaRegistry | tuple[tuple, ...] | str | None = None) -> dict:
    """Whether onnxruntime's CUDA provider has a kernel for every node of ``model`` (an
    onnx_ir Model) that computes in fp16 or bf16, at the node's opset and dtypes:
    ``{"CUDAExecutionProvider": bool, "missing": ["Op(dtype) opset N", ...], "source": ...}``
    (``source``: where the kernels were read, for a ``CudaRegistry``); None for the
    provider, with ``unknown`` saying why, where no registry can be read (``cuda_registry``;
    ``registry``: one given instead)."""
    registry = cuda_registry() if registry is None else registry
    if isinstance(registry, str):
        return {CUDA: None, "missing": [], "unknown": registry}
    source = registry.source if isinstance(registry, CudaRegistry) else None
    listed = registry.kernels if isinstance(registry, CudaRegistry) else registry
    by_op: dict[tuple[str, str], list] = {}
    for domain, op, (since, until), types in listed:
        by_op.setdefault(("" if domain == "ai.onnx" else domain, op), []).append(
            (since, until, types))
    missing = set()
    opsets = dict(model.opset_imports)
    for node, dtypes in _low_nodes(model):
        opset = node.version or opsets.get(node.domain, opsets.get("", 1))
        kernels = by_op.get((node.domain, node.op_type), [])
        # the 16-bit types only: a float32 port is one the schema fixes (Resize's scales)
        # or a second type variable (LayerNorm's U), which kernels list only where typed
        wanted = {f"tensor({d})" for d in dtypes & _LOW_TYPES}
        if not any(since <= opset <= until and wanted <= types
                   for since, until, types in kernels):
            missing.add(f"{node.op_type}({','.join(sorted(dtypes & _LOW_TYPES))}) opset {opset}")
    result = {CUDA: not missing, "missing": sorted(missing)}
    return {**result, "source": source} if source else result


def _low_nodes(model):
    """(node, the float dtypes of its tensor ports) of nodes with an fp16 or bf16 port,
    subgraphs included; the model's own Constant nodes carry data, not a kernel."""
    import onnx_ir as ir

    from amp_rewrite.onnx.load import walk_graphs

    floats = {ir.DataType.FLOAT: "float", ir.DataType.FLOAT16: "float16",
              ir.DataType.BFLOAT16: "bfloat16"}
    for graph in walk_graphs(model.graph):
        for node in graph:
            if node.op_type == "Constant" and node.domain == "":
                continue
            dtypes = {floats[v.dtype] for v in (*node.inputs, *node.outputs)
                      if v is not None and v.dtype in floats}
            if dtypes & _LOW_TYPES:
                yield node, dtypes
