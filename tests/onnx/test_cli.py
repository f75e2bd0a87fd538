"""amp-rewrite on the command line: the happy path, and each bad input with its exit code.

Bad input must give one line on stderr, its exit code, no traceback, no output file, and leave
the input untouched.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewrite.cli import main

from .conftest import EXAMPLE, EXAMPLE_INPUTS, parse


@pytest.fixture
def model_path(tmp_path) -> Path:
    path = tmp_path / "block.onnx"
    shutil.copy(EXAMPLE, path)
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cli(args, capsys):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def assert_clean_failure(tmp_path, code, err, expected_code, needle, before):
    assert code == expected_code, err
    assert err.count("\n") == 1 and err.startswith("amp-rewrite: error:"), err
    assert needle in err, err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("*.amp.onnx")) and not list(tmp_path.glob(".amp_rewrite_*"))
    for path, d in before.items():
        assert digest(path) == d


def test_rewrite_validate_report_explain(model_path, tmp_path, capsys):
    before = digest(model_path)
    report = tmp_path / "r.json"
    code, out, err = run_cli([model_path, "--validate", "--calibrate", EXAMPLE_INPUTS,
                              "--report", report, "--explain", "node_layer_norm"], capsys)
    assert code == 0, err
    out_path = tmp_path / "block.amp.onnx"
    mixed = onnx.load(out_path)
    onnx.checker.check_model(mixed, full_check=True)
    assert digest(model_path) == before
    data = json.loads(report.read_text())
    assert data["casts_inserted"] == sum(n.op_type == "Cast" for n in mixed.graph.node)
    assert {"name", "op_type", "precision", "class", "reason"} <= set(data["nodes"][0])
    assert "casts inserted" in out and "max rel" in out
    assert "node_layer_norm (LayerNormalization/T): low" in out


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_validate_without_keep_io_types(model_path, capsys, dtype):
    """The low-dtype model takes its inputs in the low dtype; validation feeds it the same
    data converted (an internal error before)."""
    code, out, err = run_cli([model_path, "--no-keep-io-types", "--dtype", dtype,
                              "--validate"], capsys)
    assert code == 0, err
    mixed = onnx.load(model_path.with_suffix(".amp.onnx"))
    low = {"fp16": onnx.TensorProto.FLOAT16, "bf16": onnx.TensorProto.BFLOAT16}[dtype]
    assert {i.type.tensor_type.elem_type for i in mixed.graph.input} == {low}
    assert "max rel" in out and "ok" in out


def test_missing_path(tmp_path, capsys):
    code, _, err = run_cli([tmp_path / "nope.onnx"], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "no such file", {})


def test_directory_as_input(tmp_path, capsys):
    code, _, err = run_cli([tmp_path], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "is a directory", {})


def test_directory_as_output_gets_the_default_name(model_path, tmp_path, capsys):
    target = tmp_path / "out"
    target.mkdir()
    code, _, err = run_cli([model_path, "-o", target, "-q"], capsys)
    assert code == 0, err
    onnx.checker.check_model(onnx.load(target / "block.amp.onnx"), full_check=True)


@pytest.mark.parametrize("flags, needle", [
    (["--report", "missing_dir/r.json"], "missing_dir does not exist"),
    (["--threshold", "-1"], "--threshold=-1.0: expected a magnitude > 0"),
])
def test_bad_side_arguments_fail_before_any_work(model_path, tmp_path, capsys, flags, needle,
                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = {model_path: digest(model_path)}
    code, _, err = run_cli([model_path, *flags], capsys)
    assert_clean_failure(tmp_path, code, err, 2, needle, before)


def test_bytes_that_are_not_onnx(tmp_path, capsys):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x00\xffthis is not a protobuf\x12\x99" * 10)
    code, _, err = run_cli([bad], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "bad.onnx", {bad: digest(bad)})


def test_truncated_file(model_path, tmp_path, capsys):
    data = model_path.read_bytes()
    model_path.write_bytes(data[: len(data) // 2])
    code, _, err = run_cli([model_path], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "block.onnx", {model_path: digest(model_path)})


def test_invalid_graph(tmp_path, capsys):
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "missing"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 2])]))
    path = tmp_path / "invalid.onnx"
    onnx.save(model, path)
    code, _, err = run_cli([path], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "invalid ONNX model", {path: digest(path)})


def test_unknown_custom_op_is_kept_fp32_and_reported(tmp_path, capsys):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18, "acme" : 1]>
    g (float[2, 8] x) => (float[2, 8] y) <float[8, 8] w> {
        h = MatMul(x, w)
        y = acme.Frobnicate(h)
    }""")
    path = tmp_path / "custom.onnx"
    onnx.save(model, path)
    code, out, err = run_cli([path, "--report", tmp_path / "r.json"], capsys)
    assert code == 0, err
    assert "acme::Frobnicate" in out
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["unlisted_ops"] == ["acme::Frobnicate"]


def test_model_without_float_tensors(tmp_path, capsys):
    model = parse("""
    <ir_version: 9, opset_import: ["" : 18]>
    g (int64[4] a, int64[4] b) => (int64[4] c) { c = Add(a, b) }""")
    path = tmp_path / "ints.onnx"
    onnx.save(model, path)
    code, out, err = run_cli([path], capsys)
    assert code == 0 and "nothing to change" in out


def test_already_converted_model_is_a_no_op(model_path, tmp_path, capsys):
    assert run_cli([model_path, "-o", tmp_path / "once.onnx"], capsys)[0] == 0
    code, out, _ = run_cli([tmp_path / "once.onnx", "-o", tmp_path / "twice.onnx"], capsys)
    assert code == 0 and "nothing to change" in out
    once, twice = onnx.load(tmp_path / "once.onnx"), onnx.load(tmp_path / "twice.onnx")
    assert [n.op_type for n in once.graph.node] == [n.op_type for n in twice.graph.node]


def test_output_equal_to_input(model_path, tmp_path, capsys):
    before = {model_path: digest(model_path)}
    code, _, err = run_cli([model_path, "-o", model_path], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "overwrite the input", before)


def test_malformed_rule_file(model_path, tmp_path, capsys):
    rules = tmp_path / "bad.toml"
    rules.write_text('schema = 1\n[allow]\nMatMul = "a"\n[deny]\nMatMul = "b"\n')
    before = {model_path: digest(model_path)}
    code, _, err = run_cli([model_path, "--rules", rules], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "bad.toml", before)


def test_unknown_flag(model_path, tmp_path, capsys):
    code, _, err = run_cli([model_path, "--frobnicate"], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "--frobnicate", {model_path: digest(model_path)})


def test_validation_failure_writes_nothing(model_path, tmp_path, capsys):
    code, out, err = run_cli([model_path, "--validate", "--tolerance", "1e-9"], capsys)
    assert_clean_failure(tmp_path, code, err, 4, "beyond tolerance", {})
    assert "FAIL" in out


def test_validation_failure_still_writes_the_report_and_prints_the_summary(model_path, tmp_path,
                                                                           capsys):
    report = tmp_path / "r.json"
    code, out, err = run_cli([model_path, "--validate", "--tolerance", "1e-9", "--report",
                              report], capsys)
    assert code == 4, err
    data = json.loads(report.read_text())
    assert data["output"] is None and any(not e["max_rel"] <= 1e-9 for e in data["validation"])
    assert "not written (validation failed)" in out and "casts inserted" in out
    assert not (tmp_path / "block.amp.onnx").exists()


def test_version(capsys):
    from amp_rewrite import __version__

    code, out, _ = run_cli(["--version"], capsys)
    assert code == 0 and out.strip() == f"amp-rewrite {__version__}"


def test_help_shows_defaults_exit_codes_and_environment(capsys):
    from amp_rewrite.core import LowDtype
    from amp_rewrite.onnx.api import default_threshold
    from amp_rewrite.onnx.validate import REL_TOLERANCE

    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0
    for dtype in LowDtype:
        line = next(l for l in out.splitlines() if l.strip().startswith(dtype.value))
        assert f"--tolerance {REL_TOLERANCE[dtype]:g}" in line
        assert f"--threshold {default_threshold(dtype):g}" in line
    for needle in ("exit codes:", "  4  validation failed", "AMP_REWRITE_RULES",
                   "AMP_REWRITE_<CLASS>_ADD", "ALLOW, DENY, GRAY, CLEAR"):
        assert needle in out


@pytest.mark.parametrize("suffix", [".pt", ".pth"])
def test_torch_checkpoint_says_to_use_the_python_api(tmp_path, capsys, suffix):
    ckpt = tmp_path / f"model{suffix}"
    ckpt.write_bytes(b"PK\x03\x04 torch zip")
    code, _, err = run_cli([ckpt], capsys)
    assert_clean_failure(tmp_path, code, err, 2, "amp_rewrite.rewrite(", {ckpt: digest(ckpt)})


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.mark.parametrize("setup, needle", [
    ("rule_file", "unknown op 'Softmx' (did you mean Softmax?)"),
    ("env_value", "$AMP_REWRITE_DENY_ADD: unknown op 'MatMull' (did you mean MatMul?)"),
    ("env_name", "unknown environment variable $AMP_REWRITE_ALLOW_AD ignored (did you mean "
                 "AMP_REWRITE_ALLOW_ADD?)"),
    ("two_adds", "op 'Relu' is in both $AMP_REWRITE_ALLOW_ADD and $AMP_REWRITE_DENY_ADD"),
    ("keep_fp32", "--keep-fp32 'node_layer_nrm' matches no node (did you mean node_layer_norm?)"),
    ("explain", "--explain 'node_layer_nrm': no node of that name with float ports (did you "
                "mean node_layer_norm?)"),
])
def test_unknown_names_are_warned_with_a_close_match(model_path, tmp_path, capsys, caplog,
                                                     monkeypatch, setup, needle):
    flags = []
    if setup == "rule_file":
        rules = tmp_path / "r.toml"
        rules.write_text('schema = 1\n[deny]\nSoftmx = "typo"\n"acme::Mine" = "custom op"\n')
        flags = ["--rules", rules]
    elif setup == "env_value":
        monkeypatch.setenv("AMP_REWRITE_DENY_ADD", "MatMull")
    elif setup == "env_name":
        monkeypatch.setenv("AMP_REWRITE_ALLOW_AD", "MatMul")
    elif setup == "two_adds":
        monkeypatch.setenv("AMP_REWRITE_ALLOW_ADD", "Relu")
        monkeypatch.setenv("AMP_REWRITE_DENY_ADD", "Relu")
    elif setup == "keep_fp32":
        flags = ["--keep-fp32", "node_layer_nrm"]
    else:
        flags = ["--explain", "node_layer_nrm"]
    code, _, err = run_cli([model_path, "-q", *flags], capsys)
    assert code == 0, err
    warnings = _warnings(caplog)
    assert needle in " | ".join(warnings), warnings
    assert not any("acme::Mine" in w for w in warnings)  # custom domains are the user's


def test_known_names_give_no_warning(model_path, capsys, caplog, monkeypatch):
    monkeypatch.setenv("AMP_REWRITE_DENY_ADD", "Softmax")
    code, _, _ = run_cli([model_path, "-q", "--keep-fp32", "node_layer_*",
                          "--explain", "node_layer_norm"], capsys)
    assert code == 0 and not _warnings(caplog)


def test_nothing_to_change_note_when_the_rules_pin_everything(model_path, tmp_path, capsys):
    code, out, err = run_cli([model_path, "--keep-fp32", "*"], capsys)
    assert code == 0, err
    assert "nothing to change: the rules, --keep-fp32 patterns or calibration pins" in out


def test_summary_row_for_calibration_pins(model_path, tmp_path, capsys):
    report = tmp_path / "r.json"
    code, out, err = run_cli([model_path, "--calibrate", EXAMPLE_INPUTS, "--threshold", "0.5",
                              "--report", report], capsys)
    assert code == 0, err
    pinned = json.loads(report.read_text())["pinned_by_calibration"]
    assert pinned  # values of |x| > 0.5 exist in any normalised block
    row = next(l for l in out.splitlines() if l.startswith("pinned by calibration"))
    assert f"{len(pinned)} values above 0.5" in row


def test_report_lists_every_inserted_cast(model_path, tmp_path, capsys):
    report = tmp_path / "r.json"
    code, _, err = run_cli([model_path, "--report", report, "-o", tmp_path / "o.onnx"], capsys)
    assert code == 0, err
    data = json.loads(report.read_text())
    mixed = onnx.load(tmp_path / "o.onnx")
    casts = {n.output[0]: n for n in mixed.graph.node if n.op_type == "Cast"}
    listed = [c for c in data["inserted_casts"] if c["kind"] == "Cast"]
    assert len(listed) == data["casts_inserted"] == len(casts) > 0
    readers = {}
    for n in mixed.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n.name)
    outputs = {o.name for o in mixed.graph.output}
    names = {"float16": onnx.TensorProto.FLOAT16, "float": onnx.TensorProto.FLOAT}
    for c in listed:
        node = casts[c["cast_value"]]  # the cast's output as written
        assert node.input[0] == c["value"] and node.attribute[0].i == names[c["to"]]
        assert c["from"] in names and c["from"] != c["to"]
        expected = readers.get(c["cast_value"], []) + [
            f"graph output {c['cast_value']}"] * (c["cast_value"] in outputs)
        assert sorted(c["consumers"]) == sorted(expected)


def test_progress_bar_finishes_and_clears_before_the_summary(model_path, capsys, monkeypatch):
    import amp_rewrite.cli as cli

    events = []
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    real_exit, real_summary = cli._Stages.__exit__, cli._print_summary

    def exit_and_record(self, *exc):
        events.append(("bar", self.bar.n, self.total))
        real_exit(self, *exc)
        events.append(("closed", self.bar))

    monkeypatch.setattr(cli._Stages, "__exit__", exit_and_record)
    monkeypatch.setattr(cli, "_print_summary", lambda *a: (events.append(("summary",)),
                                                          real_summary(*a)))
    code, out, err = run_cli([model_path], capsys)
    assert code == 0
    assert [e[0] for e in events] == ["bar", "closed", "summary"]
    assert events[0][1] == events[0][2]  # every stage ran: load, rewrite, save
    assert events[1][1] is None
    assert "amp-rewrite" in err and err.endswith("\r")  # drawn, then cleared (leave=False)


def test_list_rules_shows_sources(monkeypatch, capsys):
    monkeypatch.setenv("AMP_REWRITE_ALLOW_ADD", "MyOp")
    code, out, _ = run_cli(["--list-rules"], capsys)
    assert code == 0
    line = next(l for l in out.splitlines() if " MyOp " in l)
    assert line.startswith("allow") and "$AMP_REWRITE_ALLOW_ADD" in line
    assert "onnx.toml" in next(l for l in out.splitlines() if " MatMul " in l)


def test_list_rules_shows_bounded_outputs(monkeypatch, capsys):
    monkeypatch.setenv("AMP_REWRITE_BOUNDED_OUTPUT_ADD", "Tanh")
    code, out, _ = run_cli(["--list-rules"], capsys)
    bounded = {l.split()[1]: l for l in out.splitlines() if l.startswith("bounded")}
    assert code == 0 and {"Sin", "Cos", "Tanh"} <= set(bounded)
    assert "$AMP_REWRITE_BOUNDED_OUTPUT_ADD" in bounded["Tanh"]


def test_console_script_exit_code(tmp_path):
    """The installed entry point itself: a subprocess, exit code 3, one stderr line."""
    exe = Path(sys.executable).with_name("amp-rewrite")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "amp_rewrite.cli"]
    proc = subprocess.run([*cmd, str(tmp_path / "missing.onnx")], capture_output=True, text=True)
    assert proc.returncode == 3 and proc.stderr.count("\n") == 1


def test_external_data_round_trip(tmp_path, capsys, rng):
    model = onnx.load(EXAMPLE)
    src = tmp_path / "ext.onnx"
    onnx.save(model, src, save_as_external_data=True, location="ext.onnx.data",
              size_threshold=0)
    code, _, err = run_cli([src, "-o", tmp_path / "out.onnx"], capsys)
    assert code == 0, err
    data_files = list(tmp_path.glob("out.onnx.*.data"))  # a name unique to this write
    assert len(data_files) == 1
    out = onnx.load(tmp_path / "out.onnx", load_external_data=False)
    assert any(t.data_location == onnx.TensorProto.EXTERNAL for t in out.graph.initializer)
    onnx.checker.check_model(str(tmp_path / "out.onnx"), full_check=True)
    import onnxruntime as ort

    feeds = dict(np.load(EXAMPLE_INPUTS))
    sess = ort.InferenceSession(str(tmp_path / "out.onnx"), providers=["CPUExecutionProvider"])
    assert np.isfinite(sess.run(None, feeds)[0]).all()


def test_list_rules_into_a_closed_pipe_exits_quietly():
    """`amp-rewrite --list-rules | head -1`: the reader closes the pipe; no 'internal error'."""
    import subprocess
    import sys

    code = "import sys; from amp_rewrite.cli import main; sys.exit(main(['--list-rules']))"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child writes anything: its first write hits EPIPE
    stderr = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, stderr
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr
