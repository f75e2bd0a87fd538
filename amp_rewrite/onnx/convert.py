"""Fast float32 → float16 conversion of stored weights, bit-identical to numpy's ``astype``.

numpy converts to float16 one element at a time; onnxruntime's vectorised ``Cast`` has the
same rounding, overflow and NaN handling, and runs on buffers bound to numpy arrays. External
weights are converted as they are written (``Float16Stream``), in bounded chunks, so no whole
copy is ever in memory (decision 0020).
"""
from __future__ import annotations

import functools
import mmap
import os
import sys
from collections.abc import Callable, Iterator

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from amp_rewrite.errors import ModelError

ORT_MIN_ELEMENTS = 1 << 16  # below this numpy is as fast as a session call
CHUNK_ELEMENTS = 1 << 22  # per chunk: call overhead vanishes, buffers stay bounded
STREAM_MIN_BYTES = 16 << 20  # external float32 weights from this size are streamed
# all-ones exponent, zero mantissa: the bits of +inf
_EXPONENT_BITS = {np.dtype(np.float16): np.uint16(0x7C00),
                  np.dtype(ml_dtypes.bfloat16): np.uint16(0x7F80)}


@functools.lru_cache(maxsize=1)
def _cast_session():
    """x (float32) → y = Cast(x) (float16); run with bound buffers (``cast_into``)."""
    import onnxruntime as ort

    graph = helper.make_graph(
        [helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT16)], "to_float16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["n"])])
    # IR 9 / opset 20: accepted by every onnxruntime this package supports.
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=9)
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.enable_cpu_mem_arena = False  # outputs are bound: the session allocates nothing
    # memory-bound: a spinning pool thread would take the core that writes the output
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def cast_into(source: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = source.astype(float16)`` for contiguous 1-D float32 ``source`` and float16
    ``out`` of the same size, by onnxruntime's Cast (in chunks of ``CHUNK_ELEMENTS``)."""
    session = _cast_session()
    binding = session.io_binding()
    for start in range(0, source.size, CHUNK_ELEMENTS):
        src, dst = source[start:start + CHUNK_ELEMENTS], out[start:start + CHUNK_ELEMENTS]
        binding.bind_input("x", "cpu", 0, np.float32, [src.size], src.ctypes.data)
        binding.bind_output("y", "cpu", 0, np.float16, [dst.size], dst.ctypes.data)
        session.run_with_iobinding(binding)


def to_float16(array: np.ndarray) -> tuple[np.ndarray, bool]:
    """``array.astype(np.float16)`` (through onnxruntime for large float32 arrays), and
    whether it holds ±inf."""
    if array.dtype != np.float32 or array.size < ORT_MIN_ELEMENTS:
        converted = array.astype(np.float16)
        return converted, has_inf(converted)
    flat = np.ascontiguousarray(array).reshape(-1)
    converted = np.empty(flat.size, np.float16)
    cast_into(flat, converted)
    return converted.reshape(array.shape), has_inf(converted)


def has_inf(array: np.ndarray) -> bool:
    """Whether a float16 or bfloat16 array holds ±inf, read on its bits (``np.isinf``
    converts every element to float32 first)."""
    exponent = _EXPONENT_BITS.get(array.dtype)
    if exponent is None:
        return bool(np.isinf(array).any())
    return bool(np.any((array.view(np.uint16) & np.uint16(0x7FFF)) == exponent))


def can_stream(tensor: ir.TensorProtocol | None) -> bool:
    """Whether ``Float16Stream`` can write this tensor: float32 external data of at least
    ``STREAM_MIN_BYTES``, little-endian like the host (the stream reads raw bytes)."""
    return (isinstance(tensor, ir.ExternalTensor) and tensor.dtype == ir.DataType.FLOAT
            and tensor.nbytes >= STREAM_MIN_BYTES and sys.byteorder == "little")


class Float16Stream(ir.LazyTensor):
    """A float32 external tensor stored as float16, converted as it is written.

    ``tofile`` (what ``ir.save`` calls) maps, converts and writes one chunk at a time;
    ``numpy()``/``tobytes()`` build the whole array the same way. ``overflow``: how a chunk
    whose conversion produced ±inf is converted instead (the caller's elementwise clamping
    rule). ``check_inf=False``: the source is known within float16's range.
    """

    def __init__(self, source: ir.ExternalTensor, overflow: Callable[[np.ndarray], np.ndarray],
                 *, check_inf: bool = True) -> None:
        super().__init__(self._whole, dtype=ir.DataType.FLOAT16, shape=source.shape,
                         name=source.name)
        self.source = source
        self._overflow = overflow
        self._check_inf = check_inf

    def _whole(self) -> ir.Tensor:
        out = np.empty(self.source.size, np.float16)

        def store(start: int, converted: np.ndarray) -> None:
            out[start:start + converted.size] = converted

        self._convert_chunks(store)
        return ir.Tensor(out.reshape(self.shape.numpy()), name=self.name)

    def tofile(self, file) -> None:
        self._convert_chunks(lambda _, converted: file.write(converted))

    def _convert_chunks(self, emit: Callable[[int, np.ndarray], object]) -> None:
        out = np.empty(min(CHUNK_ELEMENTS, self.source.size), np.float16)

        def convert(start: int, chunk: np.ndarray) -> None:
            converted = out[:chunk.size]
            cast_into(chunk, converted)
            if self._check_inf and has_inf(converted):
                converted = self._overflow(chunk)
            emit(start, converted)

        for_each_chunk(self.source, convert)


def for_each_chunk(tensor: ir.ExternalTensor, visit: Callable[[int, np.ndarray], None]) -> None:
    """``visit(first element, elements)`` over ``tensor``'s float32 data, each chunk of
    ``CHUNK_ELEMENTS`` memory-mapped only while it is visited (``visit`` must not keep it)."""
    begin, total = tensor.offset or 0, tensor.size
    with open(tensor.path, "rb") as f:
        if os.fstat(f.fileno()).st_size < begin + 4 * total:  # mapped past EOF: SIGBUS
            raise ModelError(f"{tensor.path}: shorter than tensor {tensor.name} needs (offset "
                             f"{begin}, {4 * total} bytes); was it changed during the rewrite?")
        for start in range(0, total, CHUNK_ELEMENTS):
            count = min(CHUNK_ELEMENTS, total - start)
            first = begin + 4 * start
            aligned = first - first % mmap.ALLOCATIONGRANULARITY
            with mmap.mmap(f.fileno(), first + 4 * count - aligned, offset=aligned,
                           access=mmap.ACCESS_READ) as mapped:
                chunk = np.frombuffer(mapped, "<f4", count, first - aligned)
                try:
                    visit(start, chunk)
                finally:
                    del chunk  # the mapping cannot close while an array views it
