"""Where onnxruntime's CUDA provider has bf16 kernels, as a plan for onnxruntime must know.

A node given bf16 that the CUDA provider has no bf16 kernel for does not run at all: the CPU
provider, where onnxruntime places a node the GPU cannot take, has almost no bf16 kernels
either, so the session fails to load. A plan for onnxruntime (``target="ort"``, the default)
therefore gives bf16 only to nodes the packaged CUDA registry (``validate.read_cuda_snapshot``,
one onnxruntime-gpu's kernel list) has a bf16 kernel for at the node's opset; the others run
fp32 (two-label plans) or fp16/fp32 (mixed plans) and say why. ``target="onnx"`` (TensorRT and
other runtimes) plans by the ONNX schema alone.

The packaged registry and not the installed onnxruntime's: listing that one starts a process
and loads the CUDA libraries, seconds per rewrite, and fails on most machines that rewrite
models. ``--validate``'s ``runs_on`` checks the output against the installed one where it
loads. fp16 is not restricted: the CPU provider falls back for the few ops CUDA lacks in fp16.
"""
from __future__ import annotations

import functools

import onnx

_DOMAINS = {"ai.onnx": ""}


@functools.cache
def _bf16_opsets() -> dict[tuple[str, str], tuple[tuple[int, int], ...]] | None:
    """(domain, op) → the opset ranges of its bf16 kernels; None where no registry is
    packaged (then nothing is restricted)."""
    from amp_rewrite.onnx.validate import read_cuda_snapshot, snapshot_kernels

    snapshot = read_cuda_snapshot()
    if isinstance(snapshot, str):
        return None
    table: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for domain, op, (since, until), types in snapshot_kernels(snapshot):
        entry = table.setdefault((domain, op), [])
        if "tensor(bfloat16)" in types:
            entry.append((since, until))
    return {key: tuple(ranges) for key, ranges in table.items()}


@functools.lru_cache(maxsize=4096)
def lacks_bf16_kernel(domain: str, op_type: str, opset: int) -> bool:
    """True when onnxruntime's CUDA provider has no bf16 kernel for the op at ``opset``.
    False for what the registry cannot speak for: no registry packaged, a domain it does not
    cover (custom ops: the rules decide), and ONNX function ops it has no kernel for
    (onnxruntime expands those into ops that may have one)."""
    table = _bf16_opsets()
    domain = _DOMAINS.get(domain, domain)
    if table is None or domain not in {d for d, _ in table}:
        return False
    ranges = table.get((domain, op_type))
    if ranges is None:
        return not _is_function(domain, op_type, opset)
    return not any(since <= opset <= until for since, until in ranges)


def _is_function(domain: str, op_type: str, opset: int) -> bool:
    try:
        schema = onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return False
    return bool(schema.has_function or schema.has_context_dependent_function)


def no_bf16_kernel_reason(op_type: str, opset: int) -> str:
    return (f"onnxruntime's CUDA provider has no bfloat16 {op_type} kernel at opset {opset} "
            "(--target onnx plans by the schema alone)")
