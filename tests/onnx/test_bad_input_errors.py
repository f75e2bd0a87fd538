"""Malformed models and calibration data: a clear exit 3 (or usage error), or a correct rewrite.

Each test names the defect. A refused input gives its documented exit code and one stderr
line, no traceback and no internal error (exit 1), and writes nothing.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from amp_rewrite.errors import UsageError
from amp_rewrite.onnx.api import rewrite_onnx_model

from .test_cli import EXAMPLE, EXAMPLE_INPUTS, assert_clean_failure, digest, run_cli
from ._helpers import T, save, small_model


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


def test_model_without_outputs_is_refused_before_validation(tmp_path, capsys):
    model = small_model(outputs=[])
    src = save(tmp_path, model)
    code, _, err = run_cli([src, "--validate"], capsys)
    assert code == 3 and "no graph outputs" in err


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


def test_validate_and_calibrate_a_model_with_external_data(ext_model, tmp_path, capsys):
    """onnxruntime sessions built from bytes cannot resolve relative data files: both runs
    read the weights in (this failed with 'Cannot parse data from external tensors')."""
    code, out, err = run_cli([ext_model, "-o", tmp_path / "o.onnx", "--validate",
                              "--calibrate", EXAMPLE_INPUTS], capsys)
    assert code == 0, err
    assert "max rel" in out and "FAIL" not in out
