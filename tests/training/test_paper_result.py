"""The paper's loss-scaling result, reproduced with real fp16 arithmetic on the CPU
(``python -m benchmarks paper`` at a reduced step count)."""
from __future__ import annotations

import importlib
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow  # training to the paper's loss


def _load_tool() -> ModuleType:
    return importlib.import_module("benchmarks.paper")


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    return _load_tool()


@pytest.fixture(scope="module")
def summary(tool: ModuleType) -> dict:
    _, result = tool.compare(tool.Config(steps=150))
    return result


def test_most_fp32_activation_gradients_are_below_the_fp16_subnormal_range(summary: dict) -> None:
    assert summary["fp32_activation_grads_below_2^-24"] > 0.9


def test_fp16_without_scaling_flushes_gradients_and_fails_to_learn(summary: dict) -> None:
    assert summary["activation_grad_zero_fraction"]["fp32"] == 0.0  # no structural zeros
    assert summary["activation_grad_zero_fraction"]["fp16"] > 0.9
    assert summary["weight_grad_zero_fraction"]["fp16"] > 0.9
    assert summary["fp16_unscaled_progress_vs_fp32"] < 0.1
    losses = summary["final_eval_loss"]
    assert losses["fp32"] < 0.2 * summary["initial_eval_loss"]  # the task is learnable
    assert losses["fp16"] > 0.8 * summary["initial_eval_loss"]


def test_dynamic_scaling_reaches_the_fp32_loss_within_2_percent(summary: dict) -> None:
    assert summary["activation_grad_zero_fraction"]["fp16_scaled"] < 0.01
    assert summary["fp16_scaled_vs_fp32_relative_gap"] <= 0.02


def test_cli_writes_json_and_png(tool: ModuleType, tmp_path: Path) -> None:
    out, png = tmp_path / "r.json", tmp_path / "h.png"
    assert tool.main(["--steps", "2", "--json", str(out), "--png", str(png)]) == 0
    data = json.loads(out.read_text())
    assert set(data["summary"]["final_eval_loss"]) == {"fp32", "fp16", "fp16_scaled"}
    if importlib.util.find_spec("matplotlib") is not None:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
