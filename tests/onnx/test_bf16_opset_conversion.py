"""bf16 on opsets that do not admit it: the model is converted to opset 22 and says so.

An explicit old opset keeps the ops that admit no bfloat16 there fp32 (with the advice), and
``keep_opset`` refuses. Oracle: the FP32 model under onnxruntime, the rewrite under
onnx.reference.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.errors import ModelError
from amp_rewrite.onnx import rewrite_onnx_model

from .conftest import parse
from ._helpers import conv_bn_model, ort_run, rel_error, with_weights


CONV_18 = """
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[1, 2, 4, 4] x) => (float[1, 2, 4, 4] y) <float[2, 2, 1, 1] w> { y = Conv(x, w) }"""


def test_bf16_converts_an_opset_that_does_not_admit_it(rng):
    """Conv admits bfloat16 from opset 22: asked for bf16, an opset-18 model is converted
    (and says so); fp16 needs no conversion."""
    fp16 = rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="fp16")
    assert fp16.report["nodes"][0]["precision"] == "low"
    assert fp16.report["opset_conversion"] is None
    bf16 = rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="bf16")
    assert bf16.report["nodes"][0]["precision"] == "low"
    assert "18 -> 22" in bf16.report["opset_conversion"]
    assert bf16.proto().opset_import[0].version == 22
    onnx.checker.check_model(bf16.proto(), full_check=True)


def test_bf16_at_an_explicit_old_opset_keeps_conv_fp32_and_keep_opset_refuses(rng):
    pinned = rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="bf16", opset=18)
    conv = pinned.report["nodes"][0]
    assert conv["precision"] == "high"
    assert "does not admit bfloat16" in conv["reason"]
    with pytest.raises(ModelError, match="keep-opset"):
        rewrite_onnx_model(with_weights(parse(CONV_18), rng), dtype="bf16", keep_opset=True)


def test_bf16_on_opset13_converts_to_opset22_by_default(rng, tmp_path, capsys):
    """Asked for bf16, a Conv+BatchNorm model at opset 13 (no bf16 kernels there) is converted
    to opset 22 and the summary says so; ``--keep-opset`` refuses; an explicit old opset
    leaves the model fp32 with the advice."""
    from amp_rewrite.cli import main
    from amp_rewrite.onnx import rewrite_onnx_model

    fp32 = conv_bn_model(rng.uniform(0.5, 2, 8), rng, opset=13)
    for init in fp32.graph.initializer:  # ordinary magnitudes: bf16 is the only question
        a = onnx.numpy_helper.to_array(init)
        init.CopyFrom(onnx.numpy_helper.from_array(a / np.abs(a).max(), init.name))
    feeds = {"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)}
    (expected,) = ort_run(fp32, feeds)
    pinned = rewrite_onnx_model(fp32, dtype="bf16", opset=13)
    assert pinned.report["modified"] is False  # Conv and BatchNorm admit no bf16 at 13
    assert "re-run with --opset 22" in pinned.report["opset_advice"]
    src = tmp_path / "m.onnx"
    onnx.save(fp32, src)
    assert main([str(src), "--dtype", "bf16", "-o", str(tmp_path / "out.onnx")]) == 0
    assert "converted opset 13 -> 22" in capsys.readouterr().out  # the summary says so
    assert main([str(src), "--dtype", "bf16", "--keep-opset",
                 "-o", str(tmp_path / "kept.onnx")]) == 3
    assert not (tmp_path / "kept.onnx").exists()
    converted = rewrite_onnx_model(fp32, dtype="bf16")
    mixed = converted.proto()
    assert converted.report["opset_advice"] is None
    assert "13 -> 22" in converted.report["opset_conversion"]
    assert mixed.opset_import[0].version == 22 and mixed.ir_version == 10
    assert {n.op_type for n in mixed.graph.node} >= {"Conv", "BatchNormalization", "Cast"}
    # onnxruntime's CUDA provider has no bf16 BatchNormalization kernel (its registry, packaged):
    # for onnxruntime, the default target, BatchNorm stays fp32 between bf16 Convs; for
    # other runtimes (target onnx) the schema alone decides and it runs bf16 too
    stored = {i.name: i.data_type for i in mixed.graph.initializer}
    bf16, fp32_type = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT
    assert stored == {"w1": bf16, "w2": bf16, "scale": fp32_type, "bias": fp32_type,
                      "mean": fp32_type, "var": fp32_type}
    bn = next(r for r in converted.report["nodes"] if r["op_type"] == "BatchNormalization")
    assert bn["precision"] == "high" and "no bfloat16 BatchNormalization kernel" in bn["reason"]
    schema_only = rewrite_onnx_model(fp32, dtype="bf16", target="onnx").proto()
    assert all(i.data_type == bf16 for i in schema_only.graph.initializer)
    for model in (mixed, schema_only):
        assert rel_error(expected, ReferenceEvaluator(model).run(None, feeds)[0]) < 5e-2
