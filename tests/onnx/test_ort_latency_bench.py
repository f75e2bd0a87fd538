"""The onnxruntime latency benchmark (``benchmarks/ort_latency.py``) end to end on the CPU
provider with tiny models: the rows' schema, FP32 and ours measured, ours_fp16 close to FP32
(oracle: the FP32 session's outputs on the same inputs), failures reported as rows; and its
pieces the GPU run relies on (bf16 inputs and outputs through IO binding, the profile summary,
the table) against hand-derived expectations.
"""
from __future__ import annotations

import json
import shutil

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as h

from benchmarks import ort_latency

MODELS = ["bert_base_1x128", "llama_decode_past1024"]
REQUIRED = {"model", "variant", "median_ms", "provider", "device"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """(exit status, rows, work dir) of one run, every variant in its own process."""
    tmp = tmp_path_factory.mktemp("ort_latency")
    out = tmp / "rows.json"
    status = ort_latency.main([
        "--provider", "cpu", "--tiny", "--runs", "3", "--warmup", "1", "--profile",
        "--models", *MODELS, "--work-dir", str(tmp / "work"), "--json", str(out)])
    return status, json.loads(out.read_text()), tmp / "work"


def _row(rows: list[dict], model: str, variant: str) -> dict:
    (row,) = [r for r in rows if r["model"] == model and r["variant"] == variant]
    return row


def test_every_model_and_variant_has_a_row_in_the_schema(bench):
    status, rows, _ = bench
    assert status == 0
    assert isinstance(rows, list)
    assert [(r["model"], r["variant"]) for r in rows] == [
        (m, v) for m in MODELS for v in ort_latency.VARIANTS]
    for row in rows:
        assert REQUIRED <= set(row)
        assert row["provider"] == "cpu" and isinstance(row["device"], str) and row["device"]
        if row["median_ms"] is None:
            assert isinstance(row["error"], str) and "\n" not in row["error"]
        else:
            assert row["median_ms"] > 0 and "error" not in row


@pytest.mark.parametrize("model", MODELS)
def test_fp32_and_ours_are_measured(bench, model):
    _, rows, _ = bench
    assert _row(rows, model, "fp32")["median_ms"] > 0
    assert _row(rows, model, "ours_fp16")["median_ms"] > 0
    bf16 = _row(rows, model, "ours_bf16")
    # onnxruntime's CPU provider has almost no bfloat16 kernels: only that may stop it here
    assert bf16["median_ms"] or "NOT_IMPLEMENTED" in bf16["error"]


@pytest.mark.parametrize("model", MODELS)
def test_ours_fp16_is_close_to_fp32(bench, model):
    _, rows, _ = bench
    row = _row(rows, model, "ours_fp16")
    # above zero: the outputs really went through fp16; 1% of the outputs' scale at most
    assert 0 < row["max_abs_error_vs_fp32"] <= 1e-2 * row["fp32_max_abs"]


@pytest.mark.parametrize("model", MODELS)
def test_profile_counts_our_casts_and_nothing_on_another_provider(bench, model):
    _, rows, _ = bench
    row = _row(rows, model, "ours_fp16")
    assert 0 < row["cast_share"] < 1
    assert row["memcpy_nodes"] == [] and row["cpu_nodes"] == []
    assert _row(rows, model, "fp32")["cast_share"] < row["cast_share"]


def test_the_ort_optimizer_row_names_the_model_type_it_ran_with(bench):
    _, rows, _ = bench
    assert _row(rows, "bert_base_1x128", "ort_opt_fp16")["ort_model_type"] == "bert"
    # the decoders' type for Llama, or the generic one where its fusions raise
    assert _row(rows, "llama_decode_past1024", "ort_opt_fp16")["ort_model_type"] in {
        "gpt2", "bert"}


def test_a_failing_conversion_is_a_row_with_its_error(bench, monkeypatch, tmp_path):
    _, _, work = bench
    case = ort_latency.CASES[MODELS[0]]
    export = ort_latency.exported(case.family, True, work)
    (tmp_path / "work").mkdir()
    shutil.copy(export, tmp_path / "work" / export.name)  # the export, not its conversions

    def broken(path, case):
        raise RuntimeError("converter broke\nsecond line of its message")

    monkeypatch.setitem(ort_latency.CONVERTERS, "ours_fp16", broken)
    out = tmp_path / "rows.json"
    status = ort_latency.main([
        "--provider", "cpu", "--tiny", "--runs", "2", "--warmup", "0", "--same-process",
        "--models", case.name, "--variants", "ours_fp16", "--work-dir", str(tmp_path / "work"),
        "--json", str(out)])
    assert status == 1  # nothing was measured
    (row,) = json.loads(out.read_text())
    assert row["median_ms"] is None
    assert row["error"] == "RuntimeError: converter broke"


def test_a_variant_past_its_time_limit_is_a_row(bench):
    _, _, work = bench
    args = ort_latency.parse_args(["--provider", "cpu", "--tiny", "--work-dir", str(work),
                                   "--variant-timeout", "0.01"])
    row = ort_latency.row_in_fresh_process(ort_latency.CASES[MODELS[0]], "fp32", args)
    assert row["median_ms"] is None and row["error"] == "killed after 0.01 s"


def test_bf16_inputs_and_outputs_pass_through_io_binding(tmp_path):
    """A bf16 Identity: numpy has no bfloat16, so both directions go through raw bits."""
    graph = h.make_graph([h.make_node("Identity", ["x"], ["y"])], "g",
                         [h.make_tensor_value_info("x", TensorProto.BFLOAT16, ["n"])],
                         [h.make_tensor_value_info("y", TensorProto.BFLOAT16, ["n"])])
    path = tmp_path / "identity.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 18)], ir_version=9),
              str(path))
    x = np.array([1.0, 1.00390625, -3.14159], np.float32)  # 1 + 2^-8 is not a bf16
    session = ort_latency.new_session(path, "cpu")
    binding = ort_latency.bind(session, {"x": x}, "cpu")
    session.run_with_iobinding(binding)
    (y,) = ort_latency.read_outputs(session, binding)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x.astype(ml_dtypes.bfloat16).astype(np.float32))


def _node(name: str, op: str, provider: str, dur: int) -> dict:
    return {"cat": "Node", "name": f"{name}_kernel_time", "dur": dur,
            "args": {"op_name": op, "provider": provider}}


def test_profile_summary_from_trace_events():
    events = [
        {"cat": "Session", "name": "model_run", "dur": 1000, "args": {}},
        _node("matmul", "MatMul", "CUDAExecutionProvider", 60),
        _node("cast_in", "Cast", "CUDAExecutionProvider", 15),
        _node("cast_in", "Cast", "CUDAExecutionProvider", 5),  # a second run of the node
        _node("shape", "Shape", "CPUExecutionProvider", 10),
        _node("Memcpy_token_1", "MemcpyToHost", "CUDAExecutionProvider", 10),
        {"cat": "Node", "name": "matmul_fence_before", "dur": 7, "args": {"op_name": "MatMul"}},
    ]
    summary = ort_latency.profile_summary(events, "cuda")
    assert summary == {"cast_share": 0.2, "memcpy_nodes": ["Memcpy_token_1"],
                       "cpu_nodes": ["shape"]}
    # on the CPU provider every node is a CPU node: none is reported as left behind
    assert ort_latency.profile_summary(events, "cpu")["cpu_nodes"] == []


def test_table_speedups_use_ours_fp16_and_the_fastest_peer():
    def row(model, variant, ms, **extra):
        return {"model": model, "variant": variant, "median_ms": ms, "provider": "cuda",
                "device": "GPU", **extra}

    decode, lowio = "llama_decode_past1024", "llama_decode_past1024_lowio"
    rows = [row(decode, "fp32", 4.0), row(decode, "ours_fp16", 2.0),
            row(decode, "ours_bf16", 2.5), row(decode, "ort_opt_fp16", 3.0),
            row(decode, "modelopt_fp16", None, error="not installed"),
            row(lowio, "fp32", 4.0), row(lowio, "ours_fp16", 1.5)]
    lines = ort_latency.format_table(rows).splitlines()
    assert lines[2].split(" | ") == [decode, "4.000", "2.000", "2.500", "3.000", "failed",
                                     "2.00x", "1.50x"]
    # the low-io row has no peers of its own: it is compared with the plain decode's
    assert lines[3].split(" | ") == [lowio, "4.000", "1.500", "-", "-", "-", "2.67x", "2.00x"]
    assert lines[-1] == f"  {decode} modelopt_fp16: not installed"


def test_json_is_replaced_whole(tmp_path):
    path = tmp_path / "rows.json"
    ort_latency.write_rows(path, [{"model": "a"}])
    ort_latency.write_rows(path, [{"model": "a"}, {"model": "b"}])
    assert json.loads(path.read_text()) == [{"model": "a"}, {"model": "b"}]
    assert [p.name for p in tmp_path.iterdir()] == ["rows.json"]


def test_every_case_has_tiny_inputs_of_its_family():
    for case in ort_latency.CASES.values():
        assert set(case.full) == set(case.tiny), case.name
        assert case.peers_of is None or case.peers_of in ort_latency.CASES
        feeds = case.feeds(tiny=True)
        assert feeds and all(isinstance(a, np.ndarray) for a in feeds.values())
