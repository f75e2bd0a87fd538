"""amp-rewrite --max-error on the command line: the budget met on inputs it did not search
(checked here against an FP32 run in onnxruntime), the overlay round trip, explain, errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewrite.cli import main
from amp_rewrite.core import LowDtype
from amp_rewrite.onnx import validate

from .conftest import EXAMPLE, EXAMPLE_INPUTS


@pytest.fixture
def model_path(tmp_path) -> Path:
    path = tmp_path / "block.onnx"
    shutil.copy(EXAMPLE, path)
    return path


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _fresh_error(fp32: Path, mixed: Path, seed: int) -> float:
    """The relative output error on seeded inputs neither the search nor its held-out
    check drew (seeds 0 and 1), against the FP32 model in onnxruntime."""
    proto = onnx.load(str(fp32))
    feeds = validate.random_feeds(proto, seed=seed)
    errors, _ = validate.validate(proto, onnx.load(str(mixed)), LowDtype.FLOAT16, feeds)
    return max(np.inf if e.new_nonfinite else e.max_rel for e in errors)


@pytest.mark.parametrize("budget", [1e-3, 2e-4])
def test_budget_holds_on_fresh_inputs_and_the_overlay_reproduces_the_plan(
        model_path, tmp_path, capsys, budget):
    out, report, overlay = tmp_path / "o.onnx", tmp_path / "r.json", tmp_path / "pins.toml"
    code, stdout, _ = run_cli([model_path, "-o", out, "--max-error", budget, "--report", report,
                               "--emit-rules", overlay], capsys)
    assert code == 0 and "accuracy budget" in stdout and "pinned by budget" in stdout
    r = json.loads(report.read_text())
    b = r["budget"]
    assert b["reachable"] and b["held_out"] <= budget and b["evaluations"] <= 25
    assert b["held_out_onnxruntime"] <= budget
    assert _fresh_error(model_path, out, seed=7) <= budget
    assert len(r["pinned_by_budget"]) == sum("accuracy budget" in n["reason"] for n in r["nodes"])
    # the overlay, without the budget, gives the same precision node for node
    again, report2 = tmp_path / "again.onnx", tmp_path / "r2.json"
    assert run_cli([model_path, "-o", again, "--rules", overlay, "--report", report2],
                   capsys)[0] == 0
    r2 = json.loads(report2.read_text())
    assert [(n["name"], n["precision"]) for n in r2["nodes"]] == \
           [(n["name"], n["precision"]) for n in r["nodes"]]


def test_a_tight_budget_pins_nodes_and_explain_names_the_budget(model_path, tmp_path, capsys):
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    assert run_cli([model_path, "-o", out, "--max-error", 1e-4, "--report", report,
                    "--calibrate", EXAMPLE_INPUTS], capsys)[0] == 0
    r = json.loads(report.read_text())
    assert r["budget"]["default_plan_error"] > 1e-4 and r["pinned_by_budget"]
    node = r["pinned_by_budget"][0]["node"]
    code, stdout, _ = run_cli([model_path, "-o", tmp_path / "x.onnx", "--max-error", 1e-4,
                               "--calibrate", EXAMPLE_INPUTS, "-q", "--explain", node], capsys)
    assert code == 0 and "accuracy budget --max-error 0.0001" in stdout


def test_loose_budget_is_the_default_plan(model_path, tmp_path, capsys):
    out, report, plain = tmp_path / "o.onnx", tmp_path / "r.json", tmp_path / "p.json"
    assert run_cli([model_path, "-o", out, "--max-error", 1.0, "--report", report], capsys)[0] == 0
    assert run_cli([model_path, "-o", tmp_path / "p.onnx", "--report", plain], capsys)[0] == 0
    r, p = json.loads(report.read_text()), json.loads(plain.read_text())
    assert r["budget"]["evaluations"] == 1 and r["pinned_by_budget"] == []
    assert [n["precision"] for n in r["nodes"]] == [n["precision"] for n in p["nodes"]]


def test_free_graph_io_is_measured_low_where_the_plan_makes_it_low(model_path, tmp_path,
                                                                   capsys):
    # without keep_io_types the cut runs the input and output fp16: the emulation must
    # round them, and its measured error agree with onnxruntime on the rewritten model
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    assert run_cli([model_path, "-o", out, "--max-error", 1.0, "--no-keep-io-types",
                    "--report", report], capsys)[0] == 0
    b = json.loads(report.read_text())["budget"]
    assert b["held_out"] == pytest.approx(b["held_out_onnxruntime"], rel=0.5)


def test_budget_zero_is_fp32_equivalent(model_path, tmp_path, capsys):
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    assert run_cli([model_path, "-o", out, "--max-error", 0, "--report", report], capsys)[0] == 0
    r = json.loads(report.read_text())
    assert r["budget"]["achieved"] == 0 and r["budget"]["held_out"] == 0
    assert _fresh_error(model_path, out, seed=9) < 1e-6


def test_unreachable_budget_says_so(model_path, tmp_path, capsys):
    # graph inputs and outputs fixed fp16 (--low-io): even every node fp32 rounds them
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    code, stdout, _ = run_cli([model_path, "-o", out, "--max-error", 0, "--low-io", "*",
                               "--report", report], capsys)
    assert code == 0 and "unreachable" in stdout
    b = json.loads(report.read_text())["budget"]
    assert not b["reachable"] and b["all_pinned_error"] > 0


@pytest.mark.parametrize("args, message", [
    (["--emit-rules", "pins.toml"], "add --max-error"),
    (["--max-error", "-1"], "--max-error=-1.0: expected a finite number >= 0"),
    (["--max-error", "nan"], "--max-error=nan: expected a finite number >= 0"),
    (["--max-error", "1e-3", "--max-evaluations", "1"], "--max-evaluations=1: expected an int >= 2"),
])
def test_bad_budget_arguments_exit_2_before_any_work(model_path, tmp_path, capsys, args,
                                                     message):
    out = tmp_path / "o.onnx"
    code, _, err = run_cli([model_path, "-o", out, *args], capsys)
    assert code == 2 and message in err and not out.exists()


def test_emit_rules_never_overwrites_an_input(model_path, tmp_path, capsys):
    before = model_path.read_bytes()
    code, _, err = run_cli([model_path, "-o", tmp_path / "o.onnx", "--max-error", 1e-3,
                            "--emit-rules", model_path], capsys)
    assert code == 2 and "would destroy an input" in err and model_path.read_bytes() == before


def test_slack_in_the_budget_lowers_what_a_tight_threshold_kept_fp32(model_path, tmp_path,
                                                                     capsys):
    # --threshold 1 pins almost every node by calibration; within 1e-2 the budget measures
    # which of them may run low after all, and the overlay ([keep_low]) reproduces that
    out, report, overlay = tmp_path / "o.onnx", tmp_path / "r.json", tmp_path / "pins.toml"
    assert run_cli([model_path, "-o", out, "--calibrate", EXAMPLE_INPUTS, "--threshold", 1,
                    "--max-error", 1e-2, "--report", report, "--emit-rules", overlay],
                   capsys)[0] == 0
    r = json.loads(report.read_text())
    b = r["budget"]
    assert r["lowered_by_budget"] and b["low_flop_share"] > b["default_low_flop_share"]
    assert b["held_out"] <= 1e-2 and b["held_out_onnxruntime"] <= 1e-2
    assert _fresh_error(model_path, out, seed=11) <= 1e-2
    lowered = {n["node"] for n in r["lowered_by_budget"]}
    assert all(n["precision"] == "low" for n in r["nodes"] if n["name"] in lowered)
    assert "[keep_low]" in overlay.read_text()
    again = tmp_path / "r2.json"
    assert run_cli([model_path, "-o", tmp_path / "a.onnx", "--rules", overlay, "--report", again],
                   capsys)[0] == 0
    assert [(n["name"], n["precision"]) for n in json.loads(again.read_text())["nodes"]] == \
           [(n["name"], n["precision"]) for n in r["nodes"]]


def test_low_nodes_inside_control_flow_bodies_are_named_as_unmeasured(caplog):
    from tests.models.control_flow import vad_feeds, vad_like_model
    from amp_rewrite.onnx import rewrite_onnx_model

    with caplog.at_level("WARNING"):
        result = rewrite_onnx_model(vad_like_model(), max_error=1e-3,
                                    calibration_data=vad_feeds(16000))
    assert "inside If/Loop/Scan bodies" in caplog.text
    # the rewritten model's own check (onnxruntime, fp16) measures what the emulation cannot
    assert 0 < result.report["budget"]["held_out_onnxruntime"] <= 1e-3
