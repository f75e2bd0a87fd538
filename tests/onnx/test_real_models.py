"""Real transformers architectures (random weights) exported with torch.onnx dynamo=True:
rewrite to fp16 and bf16, check, run, and compare with the FP32 model.

fp16 runs in onnxruntime and in onnx.reference (which rounds every op to fp16, as a GPU kernel
without fp32 internals would); ORT-CPU has no bf16 kernels for MatMul/Add, so bf16 models are
evaluated by onnx.reference only.
"""
from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

from amp_rewrite.onnx import rewrite_onnx_model, validate
from tests.models import zoo

pytestmark = pytest.mark.slow  # exports and runs the zoo models

MODELS = ["bert", "gpt2", "t5", "bart", "vit", "swin", "resnet", "convnext", "llama",
          "whisper_encoder", "wav2vec2", "clip_vision", "segformer", "distilbert"]
TOLERANCE = {"fp16": 1e-2, "bf16": 5e-2}
GEMMS = {"MatMul", "Gemm", "Conv"}


@pytest.fixture(scope="module")
def fp32_runs():
    cache = {}

    def get(name):
        if name not in cache:
            path = zoo.cached_onnx(name)
            feeds = zoo.onnx_inputs(zoo.build(name), path)
            cache[name] = (path, feeds, validate.run(onnx.load(path), feeds))
        return cache[name]

    return get


def assert_close(reference, got, tolerance):
    for e in validate.compare(reference, got):
        assert not e.new_nonfinite, f"{e.name}: NaN/Inf where FP32 had none"
        assert e.max_rel <= tolerance, f"{e.name}: max rel error {e.max_rel:.3g}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_real_model(name, dtype, fp32_runs):
    path, feeds, reference = fp32_runs(name)
    result = rewrite_onnx_model(path, dtype=dtype)  # includes the full checker
    mixed = ir.to_proto(result.model)
    if dtype == "fp16":
        assert_close(reference, validate.run(mixed, feeds), TOLERANCE[dtype])
    assert_close(reference, validate.reference_run(mixed, feeds), TOLERANCE[dtype])
    for record in result.report["nodes"]:
        if record["op_type"] in GEMMS and record["precision"] == "high":
            # Only a schema that does not admit the dtype may keep a GEMM in fp32.
            assert dtype == "bf16" and "does not admit" in record["reason"], record
    again = rewrite_onnx_model(mixed, dtype=dtype)
    assert again.report["modified"] is False


def test_calibration_pins_large_values(fp32_runs):
    path, feeds, reference = fp32_runs("gpt2")
    result = rewrite_onnx_model(path, calibration_data=feeds, calibration_threshold=10.0)
    pinned = result.report["pinned_by_calibration"]
    assert pinned
    maxima = validate.value_maxima(onnx.load(path), feeds)
    assert all(maxima[name] > 10.0 for name in pinned)
    records = [r for r in result.report["nodes"] if "calibration saw" in r["reason"]]
    assert records and all(r["precision"] == "high" for r in records)
    assert_close(reference, validate.run(ir.to_proto(result.model), feeds), TOLERANCE["fp16"])
