"""KV-cache decoders (bench.decoders) through the CLI, and ``low_io`` for their cache.

Every oracle here is PyTorch float32 on the same inputs (``decoders.torch_reference``), which
the ONNX path does not compute; errors are max |got - ref| / max |ref| over all outputs.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from amp_rewrite.bench import decoders, deployed
from amp_rewrite.cli import main
from amp_rewrite.onnx.fusion import schemas  # noqa: F401 - registers ORT's contrib schemas

TOLERANCE = 1e-2
# bf16 keeps 8 mantissa bits (unit roundoff 2^-9): the prefill's logits reach 1.2e-2 with or
# without fusion (docs/decisions/0031b-llm-decoding.md), so bf16 gets its own tolerance.
TOLERANCES = {"fp16": TOLERANCE, "bf16": 2e-2}
LONG_PAST = 1000
NAMES = sorted(decoders.DECODERS)


@pytest.fixture(scope="module", params=NAMES)
def exported(request):
    return request.param, decoders.cached_decoder(request.param)


def _error_vs_torch(model: onnx.ModelProto, name: str, run, past: int) -> float:
    feeds = decoders.inputs(name, past=past)
    return deployed.relative_error(run(model, feeds), decoders.torch_reference(name, feeds))


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_cli_decoder_within_tolerance_of_torch(exported, dtype, tmp_path, capsys):
    name, path = exported
    out = tmp_path / "out.onnx"
    assert main([str(path), "-o", str(out), "--dtype", dtype, "-q"]) == 0, capsys.readouterr()
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)
    pasts = [decoders.PAST, LONG_PAST] if decoders.spec(name).has_past else [0]
    for past in pasts:
        error = _error_vs_torch(model, name, deployed.run_reference, past)
        assert error <= TOLERANCES[dtype], (past, error)
    if dtype == "fp16":  # ORT's CPU provider has almost no bf16 kernels
        assert _error_vs_torch(model, name, deployed.run_ort, pasts[-1]) <= TOLERANCE


def test_low_io_cache_is_fp16_and_32_chained_steps_stay_accurate(tmp_path, capsys):
    name = "llama-decode"
    out = tmp_path / "out.onnx"
    args = [str(decoders.cached_decoder(name)), "-o", str(out),
            "--low-io", "past_key_values.*,present.*"]
    assert main(args) == 0
    summary = capsys.readouterr().out
    assert "low-precision I/O" in summary and "8 values" in summary, summary
    model = onnx.load(str(out))
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*model.graph.input, *model.graph.output]}
    fp16, fp32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert {types[n] for n in types if n.startswith(("past_key_values.", "present."))} == {fp16}
    assert types["logits"] == fp32  # the rest keep their types
    assert deployed.chained_error(model, name, run=deployed.run_ort) <= TOLERANCE


def test_low_io_whisper_cross_cache_also_low(tmp_path):
    from amp_rewrite.onnx.api import rewrite_onnx_model

    path = decoders.cached_decoder("whisper-decode")
    result = rewrite_onnx_model(path, low_io=["past_key_values.*.encoder.*"])
    low = {v.name for v in result.model.graph.inputs if v.dtype is not None
           and v.dtype.name == "FLOAT16"}
    assert low == {f"past_key_values.{i}.encoder.{kv}" for i in range(decoders.LAYERS)
                   for kv in ("key", "value")}
    assert set(result.report["low_io"]["values"]) == low


def test_low_io_report_counts_bytes_saved_by_symbolic_dims():
    from amp_rewrite.onnx.api import rewrite_onnx_model

    model = onnx.parser.parse_model("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (float[b, 4, p, 8] past, float[b, 4] x) => (float[b, 4, p, 8] present, float[b, 4] y) {
        present = Identity(past)
        y = Relu(x)
    }""")
    result = rewrite_onnx_model(model, low_io=["past", "present,nothing*"])
    assert result.report["low_io"] == {"values": ["past", "present"],
                                       "bytes_saved": {"b*p": 2 * 2 * 4 * 8}}
    types = {v.name: v.dtype.name for v in [*result.model.graph.inputs,
                                            *result.model.graph.outputs]}
    assert types == {"past": "FLOAT16", "x": "FLOAT", "present": "FLOAT16", "y": "FLOAT"}


def test_no_low_io_keeps_cache_types():
    from amp_rewrite.onnx.api import rewrite_onnx_model

    result = rewrite_onnx_model(decoders.cached_decoder("llama-decode"))
    assert {v.dtype.name for v in result.model.graph.inputs
            if v.name.startswith("past_key_values.")} == {"FLOAT"}
    assert result.report["low_io"] == {}


def test_decoder_exports_match_torch_in_fp32():
    """The export itself (the harness the other tests trust) against PyTorch."""
    import onnxruntime  # noqa: F401

    path = decoders.cached_decoder("qwen2-decode")
    model = onnx.load(str(path))
    assert [i.name for i in model.graph.input] == decoders.input_names("qwen2-decode")
    assert [o.name for o in model.graph.output] == decoders.output_names("qwen2-decode")
    assert _error_vs_torch(model, "qwen2-decode", deployed.run_ort, LONG_PAST) < 1e-5
    assert np.isfinite(decoders.inputs("qwen2-decode")["past_key_values.0.key"]).all()
