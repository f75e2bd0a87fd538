"""The fx tools run end to end (small settings); their numbers are checked in other tests."""
from __future__ import annotations

import importlib
import json
from types import ModuleType

import pytest


def _load(name: str) -> ModuleType:
    return importlib.import_module(f"benchmarks.{name}")


@pytest.mark.slow
def test_models_table_writes_a_row_per_model_and_dtype(tmp_path, capsys):
    out = tmp_path / "table.json"
    assert _load("fx_table").main(
        ["--models", "resnet", "--dtypes", "fp16", "bf16", "--repeat", "1", "--json", str(out)]
    ) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["dtype"]) for r in rows] == [("resnet", "fp16"), ("resnet", "bf16")]
    assert all(r["conversions"] <= r["autocast_conversions"] for r in rows)
    assert "conv ours" in capsys.readouterr().out


def test_gpu_benchmark_without_cuda_says_so_and_exits_0(capsys):
    tool = _load("gpu_training")
    if tool.torch.cuda.is_available():
        pytest.skip("CUDA present: the message is for machines without it")
    assert tool.main([]) == 0
    assert "needs a GPU" in capsys.readouterr().out


def test_gpu_benchmark_code_runs_on_cpu_with_tiny_configs(tmp_path):
    out = tmp_path / "bench.json"
    tool = _load("gpu_training")
    assert tool.main(["--device", "cpu", "--tiny", "--compile", "off", "--models", "mlp_odd",
                      "--phases", "train", "forward", "--steps", "1", "--warmup", "1",
                      "--same-process", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    # the default variants; the backend ones are compiled only
    eager = [v for v in tool.DEFAULT_VARIANTS if v not in tool.BACKEND_OPTIONS]
    assert [(r["variant"], r["phase"]) for r in rows] == [
        (v, p) for v in eager for p in ("train", "forward")]
    assert all(r["ms"] > 0 and "error" not in r for r in rows)
    # same weights, same data, no dropout: every variant starts from FP32's loss
    losses = [r["loss0"] for r in rows if r["phase"] == "train"]
    assert max(abs(loss - losses[0]) for loss in losses) <= 1e-2 * abs(losses[0])


def test_inductor_traffic_counts_at_least_what_a_linear_layer_must_move():
    tool = _load("gpu_training")
    torch = tool.torch
    linear = torch.nn.Linear(256, 512)
    x = torch.randn(64, 256, requires_grad=True)
    row = {}
    with tool.inductor_traffic(row):
        torch.compile(linear)(x).sum().backward()
    torch._dynamo.reset()
    # forward reads x and W and writes y; backward reads x, W and dy, writes dx and dW:
    # float32 bytes no kernel schedule can avoid, counted by hand
    x_b, w_b, y_b = 64 * 256 * 4, 512 * 256 * 4, 64 * 512 * 4
    least = (x_b + w_b + y_b) + (x_b + w_b + y_b + x_b + w_b)
    assert least / 1e6 <= row["inductor_mb"] <= 4 * least / 1e6


@pytest.mark.slow
def test_gpu_benchmark_measures_each_variant_in_a_fresh_process(tmp_path, capsys):
    out = tmp_path / "bench.json"
    tool = _load("gpu_training")
    assert tool.main(["--device", "cpu", "--tiny", "--compile", "off", "--models", "mlp_odd",
                      "--variants", "fp32", "amp_rewrite", "--steps", "1", "--warmup", "1",
                      "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["fp32", "amp_rewrite"]
    assert all(r["ms"] > 0 and "error" not in r for r in rows)
    assert abs(rows[1]["loss0"] - rows[0]["loss0"]) <= 1e-2 * abs(rows[0]["loss0"])
    printed = capsys.readouterr().out
    assert "mlp_odd   fp32" in printed and "mlp_odd   amp_rewrite" in printed


@pytest.mark.slow
def test_mixed_step_benchmark_counts_the_steps_gradscaler_skips(tmp_path):
    """``--dtype mixed`` on the hot-FFN T5: our mixed rewrite against autocast fp16 +
    GradScaler, whose fp16 FFN activations (3e5) overflow at every step; ours skips only the
    first few while its loss scale backs off (4 or 5 in 211 steps)."""
    out = tmp_path / "mixed.json"
    tool = _load("gpu_training")
    assert tool.main(["--device", "cpu", "--tiny", "--compile", "off", "--models", "t5_hot",
                      "--dtype", "mixed", "--variants", "amp_rewrite", "autocast_fp16",
                      "--phases", "train", "--steps", "10", "--warmup", "1",
                      "--same-process", "--json", str(out)]) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert "error" not in rows["amp_rewrite"] and "error" not in rows["autocast_fp16"]
    fp16 = rows["autocast_fp16"]
    assert fp16["skipped"] == fp16["updates"] > 0, fp16
    assert rows["amp_rewrite"]["skipped"] < rows["amp_rewrite"]["updates"]
