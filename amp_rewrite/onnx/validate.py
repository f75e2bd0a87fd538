"""Run FP32 and rewritten models side by side; calibration maxima; runtime selection.

Errors are measured per output as max|a−b| and max|a−b| / max|a_fp32| (relative to the
output's scale, so values near zero do not blow the ratio up).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx

from amp_rewrite.core import LowDtype
from amp_rewrite.errors import ModelError, UsageError

logger = logging.getLogger(__name__)
REL_TOLERANCE = {LowDtype.FLOAT16: 1e-2, LowDtype.BFLOAT16: 5e-2}
SYMBOLIC_DIM = 4


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

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=providers())


def load_feeds(data: Mapping[str, np.ndarray] | str | os.PathLike) -> dict[str, np.ndarray]:
    if isinstance(data, Mapping):
        return dict(data)
    try:
        with np.load(data) as npz:
            return {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as e:
        raise UsageError(f"{data}: cannot read calibration data ({e}); pass an .npz whose "
                         "keys are the model's input names") from None


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs: normal floats, small non-negative ints (valid ids and 0/1 masks)."""
    rng = np.random.default_rng(seed)
    init_names = {t.name for t in model.graph.initializer}
    feeds = {}
    for inp in model.graph.input:
        if inp.name in init_names:
            continue
        t = inp.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else SYMBOLIC_DIM for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.floating):
            feeds[inp.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[inp.name] = rng.random(shape) < 0.5
        else:
            feeds[inp.name] = rng.integers(0, 2, shape).astype(dtype)
    return feeds


@dataclass(frozen=True)
class OutputError:
    name: str
    max_abs: float
    max_rel: float
    new_nonfinite: bool  # NaN/Inf where the FP32 run had none

    def ok(self, tolerance: float) -> bool:
        return not self.new_nonfinite and self.max_rel <= tolerance


def compare(reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> list[OutputError]:
    errors = []
    for name, ref in reference.items():
        out = np.asarray(got[name])
        if not np.issubdtype(ref.dtype, np.floating):
            same = np.array_equal(ref, out)
            errors.append(OutputError(name, 0.0 if same else np.inf, 0.0 if same else np.inf, False))
            continue
        ref64, out64 = ref.astype(np.float64), out.astype(np.float64)
        finite = np.isfinite(ref64)
        new_bad = bool((finite & ~np.isfinite(out64)).any())
        diff = np.abs(ref64 - out64)[finite & np.isfinite(out64)]
        max_abs = float(diff.max()) if diff.size else 0.0
        scale = float(np.abs(ref64[finite]).max()) if finite.any() else 0.0
        errors.append(OutputError(name, max_abs, max_abs / max(scale, 1e-30), new_bad))
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


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs by name from onnxruntime, or the reference evaluator where ORT has no kernel
    (ORT-CPU implements almost nothing in bfloat16). Feeds follow ``as_declared``."""
    feeds = as_declared(model, feeds)
    names = [o.name for o in model.graph.output]
    try:
        sess = session(model)
    except Exception as e:
        if "NOT_IMPLEMENTED" not in str(e):
            raise ModelError(f"onnxruntime cannot load the model: {str(e).splitlines()[0]}") from e
        logger.info("onnxruntime lacks a kernel (%s); using onnx.reference", str(e)[:120])
        return reference_run(model, feeds)
    return dict(zip(names, sess.run(names, dict(feeds))))


def reference_run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnx.reference computes every op in its declared dtype: fp16 overflow shows here."""
    from onnx.reference import ReferenceEvaluator

    names = [o.name for o in model.graph.output]
    evaluator = ReferenceEvaluator(model, new_ops=_reference_fixes())
    return dict(zip(names, evaluator.run(None, dict(feeds))))


@functools.cache
def _reference_fixes() -> list[type]:
    """onnx.reference's GatherElements breaks when indices are smaller than the data in a
    non-gathered axis (BERT's token_type_ids); this follows the spec with take_along_axis."""
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=None):
            axis = (axis or 0) % data.ndim
            indices = np.where(indices < 0, indices + data.shape[axis], indices)
            window = tuple(slice(None) if d == axis else slice(0, n)
                           for d, n in enumerate(indices.shape))
            return (np.take_along_axis(data[window], indices, axis=axis),)

    from amp_rewrite.onnx.reference_ops import CONTRIB_OPS

    return [GatherElements, *CONTRIB_OPS]  # contrib ops: the fused ops of amp_rewrite.onnx.fusion


def validate(fp32: onnx.ModelProto, mixed: onnx.ModelProto, dtype: LowDtype,
             feeds: Mapping[str, np.ndarray] | None = None,
             tolerance: float | None = None) -> tuple[list[OutputError], float]:
    feeds = feeds if feeds is not None else random_feeds(fp32)
    tolerance = REL_TOLERANCE[dtype] if tolerance is None else tolerance
    return compare(run(fp32, feeds), run(mixed, feeds)), tolerance


def value_maxima(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, float]:
    """max |x| of every float32 value of the main graph in one FP32 run."""
    import onnx_ir as ir

    m = ir.from_proto(model)
    existing = {v.name for v in m.graph.outputs}
    extra = [v for n in m.graph for v in n.outputs
             if v.dtype == ir.DataType.FLOAT and v.name and v.name not in existing]
    m.graph.outputs.extend(extra)
    proto = ir.to_proto(m)
    check_feed_names(proto, feeds)
    outputs = session(proto).run([v.name for v in extra], dict(feeds))
    return {v.name: float(np.nanmax(np.abs(o))) if o.size else 0.0
            for v, o in zip(extra, outputs)}
