"""No data loss: a path the CLI or the Python API writes is never one it reads.

Every written path (``-o``, ``--report``) is tried against every read path (the model, its
weights, calibration data, rule files) and their aliases. A conflict gives exit 2 and one
stderr line before any work, writes nothing, and leaves every input byte-identical.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewrite.errors import UsageError
from amp_rewrite.onnx import load as loading
from amp_rewrite.onnx import save as saving
from amp_rewrite.onnx.api import rewrite_onnx_model

from .test_cli import EXAMPLE, EXAMPLE_INPUTS, assert_clean_failure, digest, run_cli
from ._helpers import save, small_model


@pytest.mark.parametrize("case", ["report_is_input", "report_is_input_weights",
                                  "report_is_output", "report_is_calibration",
                                  "calibration_is_output", "output_is_input_weights",
                                  "report_is_rules_file", "output_is_symlink_to_input",
                                  "output_is_relative_path_to_input"])
def test_written_path_that_is_read_is_refused_before_any_write(ext_model, tmp_path, capsys,
                                                               monkeypatch, case):
    calib = tmp_path / "in.npz"
    shutil.copy(EXAMPLE_INPUTS, calib)
    rules = tmp_path / "r.toml"
    rules.write_text('schema = 1\n[deny]\nSoftmax = "mine"\n')
    link = tmp_path / "link.onnx"
    link.symlink_to(ext_model)
    out = tmp_path / "out.onnx"
    monkeypatch.chdir(tmp_path)
    flags = {"report_is_input": ["-o", out, "--report", ext_model],
             "report_is_input_weights": ["-o", out, "--report", tmp_path / "a.onnx.data"],
             "report_is_output": ["-o", out, "--report", out],
             "report_is_calibration": ["-o", out, "--calibrate", calib, "--report", calib],
             "calibration_is_output": ["-o", calib, "--calibrate", calib],
             "output_is_input_weights": ["-o", tmp_path / "a.onnx.data"],
             "report_is_rules_file": ["-o", out, "--rules", rules, "--report", rules],
             "output_is_symlink_to_input": ["-o", link],
             "output_is_relative_path_to_input": ["-o", "sub/../a.onnx"]}[case]
    (tmp_path / "sub").mkdir()
    before = {p: digest(p) for p in (ext_model, tmp_path / "a.onnx.data", calib, rules)}
    code, _, err = run_cli([ext_model, *flags], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "", before)
    assert not out.exists()


def test_output_beside_input_weights_named_like_its_data_file_keeps_them(ext_model, tmp_path,
                                                                        capsys):
    """-o b.onnx where the input's weights live in b.onnx.data: the input keeps its weights."""
    model = tmp_path / "src.onnx"
    onnx.save(onnx.load(EXAMPLE), model, save_as_external_data=True, location="b.onnx.data",
              size_threshold=0)
    before = digest(tmp_path / "b.onnx.data")
    code, _, err = run_cli([model, "-o", tmp_path / "b.onnx", "-q"], capsys)
    assert code == 0, err
    assert digest(tmp_path / "b.onnx.data") == before
    feeds = dict(np.load(EXAMPLE_INPUTS))
    from amp_rewrite.onnx.validate import session

    fp32 = session(onnx.load(model)).run(None, feeds)[0]
    np.testing.assert_allclose(session(onnx.load(EXAMPLE)).run(None, feeds)[0], fp32)
    onnx.checker.check_model(str(tmp_path / "b.onnx"), full_check=True)


def test_report_and_output_at_the_same_path_are_refused(tmp_path, capsys):
    src = save(tmp_path, small_model())
    code, _, err = run_cli([src, "-o", tmp_path / "x.json", "--report", tmp_path / "x.json"],
                           capsys)
    assert_clean_failure(tmp_path, code, err, 2, "give each output its own file",
                         {src: digest(src)})


def test_report_pointing_at_a_directory_is_refused_before_the_model_is_written(tmp_path, capsys):
    src = save(tmp_path, small_model())
    (tmp_path / "rep").mkdir()
    code, _, err = run_cli([src, "--report", tmp_path / "rep"], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "is a directory", {src: digest(src)})
    assert not list(tmp_path.glob("*.tmp"))


def test_output_with_trailing_slash_for_missing_directory(tmp_path, capsys):
    src = save(tmp_path, small_model())
    code, _, err = run_cli([src, "-o", f"{tmp_path}/nonexistent/"], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "directory does not exist", {src: digest(src)})
    assert not (tmp_path / "nonexistent").exists()


def test_output_in_missing_directory_fails_before_any_work(tmp_path, capsys, monkeypatch):
    src = save(tmp_path, small_model())
    monkeypatch.setattr(loading, "load_model", lambda *a: pytest.fail("loaded before the check"))
    code, _, err = run_cli([src, "-o", tmp_path / "no" / "out.onnx"], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "does not exist", {src: digest(src)})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_output_directory_fails_before_any_work(tmp_path, capsys):
    src = save(tmp_path, small_model())
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        code, _, err = run_cli([src, "-o", ro / "out.onnx"], capsys)
    finally:
        ro.chmod(0o700)
    assert_clean_failure(tmp_path, code, err, 2, "not writable", {src: digest(src)})


def test_read_only_output_directory_is_found_by_the_access_check(tmp_path, monkeypatch):
    """The same check without root's bypass: os.access answers for the directory."""
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(UsageError, match="not writable"):
        saving.check_output_path(None, tmp_path / "out.onnx")


@pytest.mark.parametrize("target", ["a.onnx", "a.onnx.data", "link.onnx"])
def test_python_api_save_never_overwrites_the_input_or_its_weights(ext_model, tmp_path, target):
    (tmp_path / "link.onnx").symlink_to(ext_model)
    before = {p: digest(p) for p in (ext_model, tmp_path / "a.onnx.data")}
    result = rewrite_onnx_model(str(ext_model))
    with pytest.raises(UsageError):
        result.save(tmp_path / target)
    assert {p: digest(p) for p in before} == before
    assert result.save(tmp_path / "ok.onnx") == tmp_path / "ok.onnx"
    onnx.checker.check_model(str(tmp_path / "ok.onnx"), full_check=True)


def test_every_pairing_of_output_and_report_paths_keeps_the_inputs(ext_model, tmp_path, capsys,
                                                                   monkeypatch):
    """-o and --report each drawn from the inputs, aliases of them, directories and fresh
    names: the run either writes two distinct new files (exit 0) or nothing (exit 2), and the
    inputs stay byte-identical."""
    calib = tmp_path / "in.npz"
    shutil.copy(EXAMPLE_INPUTS, calib)
    rules = tmp_path / "r.toml"
    rules.write_text('schema = 1\n[deny]\nSoftmax = "mine"\n')
    (tmp_path / "alias.onnx").symlink_to(ext_model)
    (tmp_path / "hard.npz").hardlink_to(calib)
    (tmp_path / "d").mkdir()
    monkeypatch.chdir(tmp_path)
    inputs = [ext_model, tmp_path / "a.onnx.data", calib, rules]
    candidates = ["a.onnx", "./a.onnx.data", "in.npz", "r.toml", "alias.onnx", "hard.npz",
                  "d", "d/", "missing/", "new.onnx", "new.json"]
    for out in candidates:
        for report in candidates:
            before = {p: digest(p) for p in inputs}
            listing = set(tmp_path.rglob("*"))
            code, _, err = run_cli([ext_model, "-o", out, "--report", report, "-q",
                                    "--calibrate", calib, "--rules", rules], capsys)
            assert code in (0, 2), (out, report, err)
            assert {p: digest(p) for p in inputs} == before, (out, report)
            created = set(tmp_path.rglob("*")) - listing
            if code == 2:
                assert not created, (out, report, created)
                continue
            report_file = (tmp_path / report).resolve()
            models = [p for p in created if p.resolve() != report_file
                      and not p.name.endswith(".data")]
            assert len(models) == 1 and report_file.is_file(), (out, report, created)
            onnx.checker.check_model(str(models[0]), full_check=True)
            assert json.loads(report_file.read_text())["output"] == str(models[0].relative_to(
                tmp_path)) or Path(json.loads(report_file.read_text())["output"]).resolve() \
                == models[0].resolve()
            for p in created:  # start the next pairing from the same directory
                p.unlink()


def test_output_named_json_is_still_binary_onnx(ext_model, tmp_path, capsys):
    """onnx_ir picks the format from the extension; the output is always protobuf."""
    code, _, err = run_cli([ext_model, "-o", tmp_path / "model.json", "-q"], capsys)
    assert code == 0, err
    proto = onnx.ModelProto()
    proto.ParseFromString((tmp_path / "model.json").read_bytes())
    assert proto.graph.node
