"""Fast float32 → float16 conversion of stored weights, bit-identical to numpy's ``astype``.

numpy converts to float16 one element at a time (~0.9 s per 256 MB here), which made the
conversion 60% of rewriting a 4 GB external-data model. onnxruntime's ``Cast`` kernel (a
dependency of the ONNX adapter already) is vectorised: ~0.23 s for the same array, with the
same rounding (to nearest even), overflow to ±inf and NaN handling. Small arrays stay on numpy,
where a session call would cost more than it saves.
"""
from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

ORT_MIN_ELEMENTS = 1 << 16  # below this numpy is as fast as a session call
# all-ones exponent, zero mantissa: the bits of +inf
_EXPONENT_BITS = {np.dtype(np.float16): np.uint16(0x7C00),
                  np.dtype(ml_dtypes.bfloat16): np.uint16(0x7F80)}


@functools.lru_cache(maxsize=1)
def _cast_session():
    """x (float32) → y = Cast(x) (float16) and the count of ±inf in y, in one call."""
    import onnxruntime as ort

    nodes = [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16),
             helper.make_node("IsInf", ["y"], ["is_inf"]),
             helper.make_node("Cast", ["is_inf"], ["ones"], to=TensorProto.INT64),
             helper.make_node("ReduceSum", ["ones"], ["infs"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "to_float16", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n"]),
         helper.make_tensor_value_info("infs", TensorProto.INT64, [])])
    # IR 9 / opset 20 (IsInf on float16): accepted by every onnxruntime this package supports.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False  # an arena would keep the largest output's buffer
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def to_float16(array: np.ndarray) -> tuple[np.ndarray, bool]:
    """``array.astype(np.float16)`` (through onnxruntime for large float32 arrays), and
    whether it holds ±inf (the IsInf kernel reads it while it is still in cache)."""
    if array.dtype != np.float32 or array.size < ORT_MIN_ELEMENTS:
        converted = array.astype(np.float16)
        return converted, has_inf(converted)
    flat = np.ascontiguousarray(array).reshape(-1)
    converted, infs = _cast_session().run(None, {"x": flat})
    return converted.reshape(array.shape), bool(infs)


def has_inf(array: np.ndarray) -> bool:
    """Whether a float16 or bfloat16 array holds ±inf, read on its bits (``np.isinf``
    converts every element to float32 first)."""
    exponent = _EXPONENT_BITS.get(array.dtype)
    if exponent is None:
        return bool(np.isinf(array).any())
    return bool(np.any((array.view(np.uint16) & np.uint16(0x7FFF)) == exponent))
