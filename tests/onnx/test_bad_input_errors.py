"""Issue 17: no data loss, no internal error, on every input the CLI can be given.

Each test names the defect. Bad input must give its documented exit code and one stderr
line, write nothing, and leave every input byte-identical.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from amp_rewrite.errors import UsageError
from amp_rewrite.onnx import load as loading
from amp_rewrite.onnx import save as saving
from amp_rewrite.onnx.api import rewrite_onnx_model

from .test_cli import EXAMPLE, EXAMPLE_INPUTS, assert_clean_failure, digest, run_cli

T = onnx.TensorProto


def small_model(nodes=None, inits=None, inputs=None, outputs=None, functions=(), ir_version=9,
                extra_opsets=()) -> onnx.ModelProto:
    x = oh.make_tensor_value_info("x", T.FLOAT, [2, 8])
    y = oh.make_tensor_value_info("y", T.FLOAT, [2, 8])
    w = onh.from_array(np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32), "w")
    graph = oh.make_graph(nodes or [oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          inputs or [x], outputs if outputs is not None else [y],
                          [w] if inits is None else inits)
    model = oh.make_model(graph, functions=list(functions),
                          opset_imports=[oh.make_opsetid("", 18), *extra_opsets])
    model.ir_version = ir_version
    return model


def save(tmp_path, model: onnx.ModelProto | bytes, name="m.onnx"):
    path = tmp_path / name
    path.write_bytes(model if isinstance(model, bytes) else model.SerializeToString())
    return path


@pytest.fixture
def ext_model(tmp_path):
    """The example block with its weights in ``a.onnx.data``."""
    path = tmp_path / "a.onnx"
    onnx.save(onnx.load(EXAMPLE), path, save_as_external_data=True, location="a.onnx.data",
              size_threshold=0)
    return path


# ---- data loss: every written path against every read path ----

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


# ---- atomic commit of model + external data ----

def _output_prediction(path) -> np.ndarray:
    from amp_rewrite.onnx.validate import session

    return session(onnx.load(str(path))).run(None, dict(np.load(EXAMPLE_INPUTS)))[0]


def test_kill_between_data_and_model_rename_keeps_the_old_pair(ext_model, tmp_path, capsys,
                                                               monkeypatch):
    out = tmp_path / "out.onnx"
    assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
    first = _output_prediction(out)
    old_data = set(tmp_path.glob("out.onnx.*.data"))
    real_replace = os.replace

    def killed_at_model_rename(src, dst):
        if str(dst) == str(out):
            raise KeyboardInterrupt  # what SIGINT/SIGTERM raise at this point
        real_replace(src, dst)

    monkeypatch.setattr(saving.os, "replace", killed_at_model_rename)
    code, _, _ = run_cli([ext_model, "-o", out, "-q", "--dtype", "bf16"], capsys)
    monkeypatch.setattr(saving.os, "replace", real_replace)
    assert code == 130
    onnx.checker.check_model(str(out), full_check=True)
    np.testing.assert_array_equal(_output_prediction(out), first)  # old model, old weights
    assert not list(tmp_path.glob(".amp_rewrite_tmp-*"))
    orphans = set(tmp_path.glob("out.onnx.*.data")) - old_data  # renamed before the kill
    assert len(orphans) == 1
    # the next write removes the replaced model's data file at once, the orphan once it is
    # an hour old (a younger one could be a concurrent write's)
    assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
    left = set(tmp_path.glob("out.onnx.*.data"))
    assert not left & old_data and orphans <= left and len(left) == 2
    for orphan in orphans:
        os.utime(orphan, (0, 0))
    assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
    left = set(tmp_path.glob("out.onnx.*.data"))
    assert len(left) == 1 and not left & (old_data | orphans)
    np.testing.assert_array_equal(_output_prediction(out), first)


def test_data_file_name_is_unique_per_write(ext_model, tmp_path, capsys):
    out = tmp_path / "out.onnx"
    names = []
    for _ in range(2):
        assert run_cli([ext_model, "-o", out, "-q"], capsys)[0] == 0
        names.append({t.name: {kv.key: kv.value for kv in t.external_data}["location"]
                      for t in onnx.load(out, load_external_data=False).graph.initializer
                      if t.data_location == T.EXTERNAL})
    assert names[0] and names[1]
    assert set(names[0].values()).isdisjoint(names[1].values())


def test_sigterm_during_save_removes_temp_files(tmp_path, capsys, monkeypatch):
    src = save(tmp_path, small_model())
    real = saving.save_proto

    def save_then_terminated(proto, output, keep=()):
        with saving._staged(output) as tmp:
            tmp.write_bytes(b"partial")
            os.kill(os.getpid(), signal.SIGTERM)
        return real(proto, output, keep)

    monkeypatch.setattr(saving, "save_proto", save_then_terminated)
    code, _, err = run_cli([src, "-q"], capsys)
    assert code == 143 and "terminated" in err
    assert not list(tmp_path.glob(".amp_rewrite_tmp-*"))
    assert not (tmp_path / "m.amp.onnx").exists()


def test_stale_temp_dirs_of_killed_runs_are_removed(tmp_path, capsys):
    src = save(tmp_path, small_model())
    dead_pid = 2**22 + 12345  # above pid_max's default: no such process
    stale = tmp_path / f"{saving.TEMP_PREFIX}{dead_pid}-abc"
    stale.mkdir()
    (stale / "m.onnx.deadbeef.data").write_bytes(b"\0" * 1024)
    live = tmp_path / f"{saving.TEMP_PREFIX}{os.getppid()}-abc"  # a live process: kept
    live.mkdir()
    foreign = tmp_path / ".other_tool_tmp"
    foreign.mkdir()
    assert run_cli([src, "-q"], capsys)[0] == 0
    assert not stale.exists() and live.exists() and foreign.exists()


# ---- crashes that must be a clear exit 3 or a correct rewrite ----

@pytest.mark.parametrize("field", ["graph_name", "producer", "metadata", "doc_string",
                                   "node_name", "value_name", "output_name"])
def test_invalid_utf8_in_string_fields_is_rewritten(tmp_path, capsys, field):
    model = small_model(nodes=[oh.make_node("MatMul", ["x", "w"], ["VALUEMARK"], name="NODEMARK"),
                               oh.make_node("Relu", ["VALUEMARK"], ["OUTPUTMARK"], name="relu")],
                        outputs=[oh.make_tensor_value_info("OUTPUTMARK", T.FLOAT, [2, 8])])
    model.graph.name = "GRAPHMARK"
    model.producer_name = "PRODMARK"
    model.graph.doc_string = "DOCMARK"
    oh.set_model_props(model, {"key": "METAMARK"})
    marker = {"graph_name": b"GRAPHMARK", "producer": b"PRODMARK", "metadata": b"METAMARK",
              "doc_string": b"DOCMARK", "node_name": b"NODEMARK", "value_name": b"VALUEMARK",
              "output_name": b"OUTPUTMARK"}
    bad = b"bad\xff\xc3(" + b"x" * (len(marker[field]) - 6)  # same length: framing intact
    data = model.SerializeToString().replace(marker[field], bad)
    src = save(tmp_path, data)
    onnx.checker.check_model(onnx.load(src), full_check=True)  # a valid model
    code, _, err = run_cli([src, "-q", "--validate"], capsys)
    assert code == 0, err
    out = tmp_path / "m.amp.onnx"
    onnx.checker.check_model(onnx.load(out), full_check=True)
    assert b"bad\\xff\\xc3(" in out.read_bytes()
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(model).run(None, {"x": x})[0]
    got = ReferenceEvaluator(onnx.load(out)).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def _local_function_model(body_calls_itself: bool, extra_actual: bool) -> onnx.ModelProto:
    body = [oh.make_node("F", ["a"], ["b"], domain="local")] if body_calls_itself else \
        [oh.make_node("Relu", ["a"], ["b"])]
    fn = oh.make_function("local", "F", ["a"], ["b"], body,
                          [oh.make_opsetid("", 18), oh.make_opsetid("local", 1)])
    call = oh.make_node("F", ["h", "x"] if extra_actual else ["h"], ["y"], domain="local")
    return small_model(nodes=[oh.make_node("MatMul", ["x", "w"], ["h"]), call], functions=[fn],
                       ir_version=7, extra_opsets=[oh.make_opsetid("local", 1)])


@pytest.mark.parametrize("recursive, extra_actual, needle", [
    (False, True, "cannot exceed number of formal"), (True, False, "recursive")])
def test_bad_model_local_functions_are_exit_3(tmp_path, capsys, recursive, extra_actual, needle):
    src = save(tmp_path, _local_function_model(recursive, extra_actual))
    code, _, err = run_cli([src], capsys)
    assert_clean_failure(tmp_path, code, err, 3, needle, {src: digest(src)})


@pytest.mark.parametrize("delta", [2, 4, -1])
def test_initializer_raw_data_length_not_matching_dims_is_exit_3(tmp_path, capsys, delta):
    w = onh.from_array(np.ones((8, 8), np.float32), "w")
    w.raw_data = w.raw_data + b"\0" * delta if delta > 0 else w.raw_data[:delta]
    src = save(tmp_path, small_model(inits=[w]))
    code, _, err = run_cli([src], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "tensor w", {src: digest(src)})


@pytest.mark.parametrize("key", ["offset", "length"])
def test_external_data_beyond_the_file_is_exit_3(ext_model, tmp_path, capsys, key):
    proto = onnx.load(ext_model, load_external_data=False)
    for kv in proto.graph.initializer[0].external_data:
        if kv.key == key:
            kv.value = str(10**9)
    first = proto.graph.initializer[0]
    if key == "length" and not any(kv.key == "length" for kv in first.external_data):
        first.external_data.add(key="length", value=str(10**9))
    src = save(tmp_path, proto, "bad.onnx")
    before = {src: digest(src), tmp_path / "a.onnx.data": digest(tmp_path / "a.onnx.data")}
    code, _, err = run_cli([src, "--validate"], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "beyond the end", before)


def test_unknown_elem_type_is_exit_3(tmp_path, capsys):
    model = small_model()
    model.graph.initializer[0].data_type = 77
    src = save(tmp_path, model)
    code, _, err = run_cli([src], capsys)
    assert code == 3 and "Traceback" not in err and "77" in err


@pytest.mark.parametrize("op, attr, value", [("Cast", "to", 99), ("Cast", "to", -3),
                                             ("Cast", "to", 0), ("SequenceEmpty", "dtype", 99)])
def test_dtype_attribute_out_of_range_is_exit_3(tmp_path, capsys, op, attr, value):
    nodes = [oh.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    if op == "Cast":
        nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]),
                 oh.make_node("Cast", ["h"], ["y"], name="bad", to=value)]
    else:
        nodes.append(oh.make_node("SequenceEmpty", [], ["s"], name="bad", dtype=value))
    src = save(tmp_path, small_model(nodes=nodes))
    code, _, err = run_cli([src], capsys)
    assert_clean_failure(tmp_path, code, err, 3, f"{attr}={value} is not an ONNX data type",
                         {src: digest(src)})


def test_validate_with_huge_dims_refuses_instead_of_allocating(tmp_path, capsys):
    big = [100000, 100000, 8]
    model = small_model(inputs=[oh.make_tensor_value_info("x", T.FLOAT, big)],
                        outputs=[oh.make_tensor_value_info("y", T.FLOAT, big)])
    src = save(tmp_path, model)
    code, out, err = run_cli([src, "--validate", "--report", tmp_path / "r.json"], capsys)
    assert code == 4 and "298 GiB" in err and "--calibrate" in err, err
    assert json.loads((tmp_path / "r.json").read_text())["output"] is None


def test_validate_when_onnxruntime_fails_on_random_feeds_suggests_calibrate(tmp_path, capsys):
    """Slice steps from an input: random int feeds give step 0, which onnxruntime rejects."""
    inputs = [oh.make_tensor_value_info("x", T.FLOAT, [4, 8]),
              oh.make_tensor_value_info("steps", T.INT64, [1])]
    inits = [onh.from_array(np.array([0], np.int64), "starts"),
             onh.from_array(np.array([4], np.int64), "ends"),
             onh.from_array(np.array([0], np.int64), "axes"),
             onh.from_array(np.ones((8, 8), np.float32), "w")]
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]),
             oh.make_node("Slice", ["h", "starts", "ends", "axes", "steps"], ["y"])]
    model = small_model(nodes=nodes, inits=inits, inputs=inputs,
                        outputs=[oh.make_tensor_value_info("y", T.FLOAT, [None, 8])])
    src = save(tmp_path, model)
    report = tmp_path / "r.json"
    code, out, err = run_cli([src, "--validate", "--report", report], capsys)
    assert code == 4, err
    assert "onnxruntime failed running the FP32 model on random inputs" in err
    assert "--calibrate" in err and "Traceback" not in err
    assert report.exists() and "not written" in out  # the report and the summary still come
    assert not (tmp_path / "m.amp.onnx").exists()


def test_validate_when_onnxruntime_fails_on_random_resize_scales(tmp_path, capsys):
    """Resize scales fed as an input: random normal scales are negative, which onnxruntime
    refuses at run time."""
    inputs = [oh.make_tensor_value_info("x", T.FLOAT, [1, 1, 2, 8]),
              oh.make_tensor_value_info("scales", T.FLOAT, [4])]
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]),
             oh.make_node("Resize", ["h", "", "scales"], ["y"], mode="nearest")]
    model = small_model(nodes=nodes, inputs=inputs,
                        outputs=[oh.make_tensor_value_info("y", T.FLOAT, list("nchw"))])
    src = save(tmp_path, model)
    code, _, err = run_cli([src, "--validate"], capsys)
    assert code == 4 and "on random inputs" in err and "--calibrate" in err, err


def test_validate_model_without_outputs_says_so(tmp_path, capsys):
    model = small_model(outputs=[])
    src = save(tmp_path, model)
    code, _, err = run_cli([src, "--validate"], capsys)
    assert code == 4 and "no graph outputs" in err


@pytest.mark.parametrize("defect, needle", [
    ("float64", "is float64"), ("rank", "has shape"), ("missing", "missing ["),
    ("unknown", "unknown ["), ("not_npz", "cannot read calibration data")])
def test_malformed_calibration_data_is_a_usage_error(tmp_path, capsys, defect, needle):
    feeds = dict(np.load(EXAMPLE_INPUTS))
    name = sorted(feeds)[0]
    if defect == "float64":
        feeds[name] = feeds[name].astype(np.float64)
    elif defect == "rank":
        feeds[name] = feeds[name][None]
    elif defect == "missing":
        del feeds[name]
    elif defect == "unknown":
        feeds["bogus"] = np.zeros(2, np.float32)
    data = tmp_path / "c.npz"
    if defect == "not_npz":
        data.write_bytes(b"PK\x03\x04 not a zip")
    else:
        np.savez(data, **feeds)
    src = tmp_path / "block.onnx"
    shutil.copy(EXAMPLE, src)
    for flags in (["--calibrate", data], ["--calibrate", data, "--validate"]):
        code, _, err = run_cli([src, *flags], capsys)
        assert_clean_failure(tmp_path, code, err, 2, needle, {src: digest(src)})
    if defect != "not_npz":
        with pytest.raises(UsageError, match=needle.replace("[", r"\[")):
            rewrite_onnx_model(str(src), calibration_data=feeds)


def test_invalid_utf8_in_node_metadata_is_rewritten(tmp_path, capsys):
    model = small_model()
    model.graph.node[0].metadata_props.add(key="k", value="NODEMETA")
    src = save(tmp_path, model.SerializeToString().replace(b"NODEMETA", b"N\xffDEMETA"))
    code, _, err = run_cli([src, "-q"], capsys)
    assert code == 0, err
    out = onnx.load(tmp_path / "m.amp.onnx")
    onnx.checker.check_model(out, full_check=True)
    assert any(p.value == "N\\xffDEMETA" for n in out.graph.node for p in n.metadata_props)


def test_input_failing_type_inference_is_blamed_not_called_an_internal_error(tmp_path, capsys):
    """Exp of an int64: the plain checker at load passes it, the full check of the output
    fails; the input fails that check too, so it is the model's fault (exit 3)."""
    nodes = [oh.make_node("MatMul", ["x", "w"], ["h"]),
             oh.make_node("Cast", ["h"], ["c"], to=T.INT64),
             oh.make_node("Exp", ["c"], ["y"])]
    model = small_model(nodes=nodes, outputs=[oh.make_tensor_value_info("y", T.INT64, [2, 8])])
    onnx.checker.check_model(model)
    with pytest.raises(Exception, match="unsupported type"):
        onnx.checker.check_model(model, full_check=True)
    src = save(tmp_path, model)
    code, _, err = run_cli([src], capsys)
    assert code == 3 and "internal error" not in err, err
    assert_clean_failure(tmp_path, code, err, 3, "m.onnx", {src: digest(src)})


def test_constant_value_raw_data_length_not_matching_dims_is_exit_3(tmp_path, capsys):
    value = onh.from_array(np.ones((8, 8), np.float32))
    value.raw_data = value.raw_data + b"\0" * 4
    nodes = [oh.make_node("Constant", [], ["c"], name="const", value=value),
             oh.make_node("MatMul", ["x", "c"], ["y"])]
    src = save(tmp_path, small_model(nodes=nodes, inits=[]))
    code, _, err = run_cli([src], capsys)
    assert_clean_failure(tmp_path, code, err, 3, "Constant const", {src: digest(src)})


def test_string_constant_is_carried_through(tmp_path, capsys):
    """A string Constant has no fixed element size: checked for nothing, kept as it is."""
    words = onh.from_array(np.array(["a", "bc"], dtype=object))
    nodes = [oh.make_node("Constant", [], ["words"], name="words", value=words),
             oh.make_node("MatMul", ["x", "w"], ["y"])]
    model = small_model(nodes=nodes)
    model.graph.output.append(oh.make_tensor_value_info("words", T.STRING, [2]))
    src = save(tmp_path, model)
    code, _, err = run_cli([src, "-q", "--validate"], capsys)
    assert code == 0, err
    out = onnx.load(tmp_path / "m.amp.onnx")
    const = next(n for n in out.graph.node if n.op_type == "Constant")
    assert [str(w) for w in onh.to_array(const.attribute[0].t)] == ["a", "bc"]


SLOW_SAVE_RUN = """
import sys, time
from amp_rewrite.onnx import save as saving
real = saving.save_proto
def slow(proto, output, keep=()):
    with saving._staged(output) as tmp:
        tmp.write_bytes(b"partial")
        print("staged", flush=True)
        time.sleep(60)
    return real(proto, output, keep)
saving.save_proto = slow
from amp_rewrite.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_from_another_process_removes_temp_files(tmp_path, sig, code):
    import subprocess
    import sys

    src = save(tmp_path, small_model())
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SAVE_RUN, str(src), "-q"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staged"
    assert list(tmp_path.glob(".amp_rewrite_tmp-*"))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == code, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.glob(".amp_rewrite_tmp-*"))
    assert not (tmp_path / "m.amp.onnx").exists()


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


def test_validate_and_calibrate_a_model_with_external_data(ext_model, tmp_path, capsys):
    """onnxruntime sessions built from bytes cannot resolve relative data files: both runs
    read the weights in (this failed with 'Cannot parse data from external tensors')."""
    code, out, err = run_cli([ext_model, "-o", tmp_path / "o.onnx", "--validate",
                              "--calibrate", EXAMPLE_INPUTS], capsys)
    assert code == 0, err
    assert "max rel" in out and "FAIL" not in out


def test_output_named_json_is_still_binary_onnx(ext_model, tmp_path, capsys):
    """onnx_ir picks the format from the extension; the output is always protobuf."""
    code, _, err = run_cli([ext_model, "-o", tmp_path / "model.json", "-q"], capsys)
    assert code == 0, err
    proto = onnx.ModelProto()
    proto.ParseFromString((tmp_path / "model.json").read_bytes())
    assert proto.graph.node
