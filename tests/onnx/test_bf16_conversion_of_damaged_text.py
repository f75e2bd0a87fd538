"""bf16's opset conversion on models whose text the file stored as invalid UTF-8.

The converter reads a ModelProto, so the IR is serialised first; names and tensor metadata
that are not valid UTF-8 are escaped there as at save. A model that still cannot be
serialised keeps its opset and says so. Oracle: the FP32 model under onnxruntime against the
rewrite under onnx.reference (no bf16 Conv kernel on onnxruntime's CPU provider).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest
from onnx.reference import ReferenceEvaluator

from amp_rewrite.cli import main
from amp_rewrite.onnx import rewrite_onnx_model, save

from ._helpers import ort_run, rel_error

T = onnx.TensorProto
MARKER = "DAMAGEDTEXTMARKER"
# the marker's bytes, same length (protobuf framing intact), with a byte UTF-8 forbids
DAMAGED = b"bad\xff".ljust(len(MARKER), b"x")


def conv_model(value_name: str = "c", weight_metadata: dict | None = None) -> onnx.ModelProto:
    """Conv -> Relu at opset 18, where Conv admits no bfloat16 (22 does)."""
    rng = np.random.default_rng(0)
    k = onh.from_array((rng.standard_normal((4, 3, 3, 3)) / 4).astype(np.float32), "k")
    for key, value in (weight_metadata or {}).items():
        k.metadata_props.add(key=key, value=value)
    graph = oh.make_graph(
        [oh.make_node("Conv", ["x", "k"], [value_name], name="conv", pads=[1, 1, 1, 1]),
         oh.make_node("Relu", [value_name], ["y"], name="relu")],
        "g", [oh.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
        [oh.make_tensor_value_info("y", T.FLOAT, [1, 4, 8, 8])], [k])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def damaged(model: onnx.ModelProto) -> bytes:
    data = model.SerializeToString()
    assert MARKER.encode() in data
    return data.replace(MARKER.encode(), DAMAGED)


@pytest.mark.parametrize("model", [conv_model(value_name=MARKER),
                                   conv_model(weight_metadata={"source": MARKER})],
                         ids=["value_name", "initializer_metadata"])
def test_bf16_converts_a_model_with_invalid_utf8_text(model, tmp_path, capsys):
    src = tmp_path / "m.onnx"
    src.write_bytes(damaged(model))
    out = tmp_path / "m.amp.onnx"
    assert main([str(src), "--dtype", "bf16", "-o", str(out)]) == 0
    assert "converted opset 18 -> 22" in capsys.readouterr().out
    rewritten = onnx.load(str(out))
    assert rewritten.opset_import[0].version == 22
    onnx.checker.check_model(rewritten, full_check=True)
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    (expected,) = ort_run(model, {"x": x})
    (got,) = ReferenceEvaluator(rewritten).run(None, {"x": x})
    assert rel_error(expected, got) <= 3e-2


def test_a_model_the_conversion_cannot_serialise_keeps_its_opset_with_a_note(monkeypatch):
    """Anything else serialising refuses: the opset is kept as with ``keep_opset``, the
    note says why, and Conv stays fp32 (the rewrite's own output serialises)."""
    real, calls = save.serialised, []

    def refuses_the_first_time(model):
        calls.append(model)
        if len(calls) == 1:  # the conversion's serialisation, the first of the rewrite
            raise ValueError("damaged tensor")
        return real(model)

    monkeypatch.setattr(save, "serialised", refuses_the_first_time)
    result = rewrite_onnx_model(conv_model(), dtype="bf16")
    note = result.report["opset_conversion"]
    assert note.startswith("kept opset 18") and "damaged tensor" in note and "Conv" in note
    assert result.proto().opset_import[0].version == 18
    precision = {n["name"]: n["precision"] for n in result.report["nodes"]}
    assert precision["conv"] == "high"
