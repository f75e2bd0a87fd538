"""Models trained by someone else (``tests/models/trained.py``: PaddleOCR's PP-OCRv4 detector,
recogniser and angle classifier, Silero VAD, from the PyPI wheels that ship them): rewritten to
fp16, bf16 and mixed, compared with the FP32 model on inputs of the kind each reads.

Errors are the product's metric (max|got − ref| / max|ref|) under per-op rounding
(``validate.reference_run``, as a GPU rounds each op) and, for fp16, under onnxruntime. The
detector's output is a probability map behind a steep sigmoid, where 1e-2 of logit error moves
a pixel by more: its tolerances are wider, as its FP32-vs-fp16 gap is on a GPU. Every output
must load on onnxruntime's CUDA provider (its registry, packaged: ``validate.cuda_kernels``).
"""
from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest

from amp_rewrite.onnx import rewrite_onnx_model, validate
from tests.models import trained

pytestmark = pytest.mark.slow  # downloads two wheels once, runs onnx.reference

CUDA = "CUDAExecutionProvider"
# per model and dtype: the most error allowed, about twice what was measured (2026-11-29)
TOLERANCE = {
    "ppocr_det": {"fp16": 0.2, "bf16": 0.6, "mixed": 0.2},
    "ppocr_cls": {"fp16": 0.03, "bf16": 0.1, "mixed": 0.03},
    "ppocr_rec": {"fp16": 0.06, "bf16": 0.2, "mixed": 0.06},
    "silero_vad": {"fp16": 0.1, "bf16": 0.6, "mixed": 0.1},
}


@functools.cache
def _model(key: str) -> tuple[str, onnx.ModelProto]:
    try:
        path = trained.path(key)
    except trained.Unavailable as e:
        pytest.skip(str(e))
    return str(path), onnx.load(path)


def _error(reference: dict, got: dict) -> float:
    return max(e.max_rel if not e.new_nonfinite else float("inf")
               for e in validate.compare(reference, got))


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "mixed"])
@pytest.mark.parametrize("key", sorted(TOLERANCE))
def test_a_trained_model_stays_close_to_fp32_and_loads_on_cuda(key, dtype):
    path, fp32 = _model(key)
    calibration, held = trained.inputs(key, 2, seed=0), trained.inputs(key, 2, seed=1)
    result = rewrite_onnx_model(path, dtype=dtype, calibration_data=calibration)
    proto = result.proto()
    reference = validate.run(fp32, held)
    error = _error(reference, validate.reference_run(proto, held))
    assert error <= TOLERANCE[key][dtype], f"{key} {dtype}: {error:.3g}"
    if dtype == "fp16":
        assert _error(reference, validate.run(proto, held)) <= TOLERANCE[key][dtype]
    runs_on = validate.cuda_kernels(result.model)
    assert runs_on[CUDA] is True, runs_on


def _gemm_conv_flops(values: dict, model: onnx.ModelProto) -> dict[str, float]:
    """FLOPs of each Conv (2·output elements·C_in/groups·kernel area) and MatMul/Gemm
    (2·output elements·K), by the dtype its output had in the run."""
    flops: dict[str, float] = {}
    for node in model.graph.node:
        if node.op_type == "Conv":
            w, out = values[node.input[1]], values[node.output[0]]
            per_output = int(np.prod(w.shape[1:]))
        elif node.op_type in ("MatMul", "Gemm"):
            out = values[node.output[0]]
            per_output = values[node.input[0]].shape[-1]
        else:
            continue
        flops[out.dtype.name] = flops.get(out.dtype.name, 0.0) + 2.0 * out.size * per_output
    return flops


def test_the_detector_runs_its_convs_low_in_mixed_where_fp16_keeps_some_fp32():
    """PP-OCRv4's head conv writes ~1.7e4 on a page (above fp16's 4096 threshold) and its
    BatchNorm divides by a variance of 9.8e7: the fp16 plan keeps that conv fp32. The mixed
    plan shifts the conv's weights by a power of two and the BatchNorm's statistics alike (exact), runs
    the conv fp16 at the model's opset 12 and leaves the BatchNorm fp32 (its variance is still
    beyond fp16, and onnxruntime's CUDA provider has no bf16 BatchNorm). The issue's bar on
    held-out pages: at least 99% of conv FLOPs low, error at most 1.5× the fp16 plan's and half
    the bf16 plan's."""
    path, fp32 = _model("ppocr_det")
    pages = trained.inputs("ppocr_det", 8, seed=1)
    calibration = {"x": pages["x"][:4]}
    held = {"x": pages["x"][4:]}
    reference = validate.run(fp32, held)
    errors, shares = {}, {}
    for dtype in ("fp16", "bf16", "mixed"):
        result = rewrite_onnx_model(path, dtype=dtype, calibration_data=calibration)
        proto = result.proto()
        errors[dtype] = _error(reference, validate.reference_run(proto, held))
        values = validate.reference_evaluator(proto).run(
            None, validate.as_declared(proto, held), intermediate=True)
        flops = _gemm_conv_flops(values, proto)
        shares[dtype] = 1 - flops.get("float32", 0.0) / sum(flops.values())
        if dtype == "mixed":
            assert [r["down"] for r in result.report["rescaled"]] == [
                "p2o.BatchNormalization.1"]
            assert result.report["opset_conversion"] is None
            assert result.report["mixed"]["solver"]["status"] == "OPTIMAL"
    assert shares["fp16"] < 0.99 and shares["mixed"] >= 0.99, shares
    assert errors["mixed"] <= 1.5 * errors["fp16"], errors
    assert errors["mixed"] <= 0.5 * errors["bf16"], errors
