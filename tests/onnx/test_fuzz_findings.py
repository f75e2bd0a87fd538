"""What the CLI mutation fuzzer found, each as the smallest model that shows it.

Cases: element type UNDEFINED (0) on a graph input or an initializer: the checker passes it,
onnxruntime refuses it ("Invalid tensor data type 0"), so the CLI refuses it (exit 3, one line
naming the value); on a graph output the plain checker and the rewrite accept it (it was an
internal error in the padding step, which sizes every value by its type), and is typed from
inference as any untyped output is. Strings beside padded GEMMs (the same padding step). A
model below opset 6, where Cast's ``to`` is a string: refused naming ``--opset 13``, which
then converts it (the inserted casts made an output the checker refused).
"""
from __future__ import annotations

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import pytest

from amp_rewrite.cli import main

from ._helpers import ort_run, small_model

T = onnx.TensorProto


def misaligned_gemms(output_type: int = T.FLOAT) -> onnx.ModelProto:
    """y = (x @ w) @ w with K = N = 12, so the padding step plans for them."""
    w = onh.from_array((np.random.default_rng(0).standard_normal((12, 12)) / 4)
                       .astype(np.float32), "w")
    return small_model(nodes=[oh.make_node("MatMul", ["x", "w"], ["h"]),
                              oh.make_node("MatMul", ["h", "w"], ["y"])],
                       inputs=[oh.make_tensor_value_info("x", T.FLOAT, [2, 12])],
                       outputs=[oh.make_tensor_value_info("y", output_type, [2, 12])], inits=[w])


def run(tmp_path, capsys, model: onnx.ModelProto, *flags) -> tuple[int, str]:
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    code = main([str(src), "-o", str(tmp_path / "out.onnx"), "-q", *flags])
    return code, capsys.readouterr().err


def with_undefined_input(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.input[0].type.tensor_type.elem_type = T.UNDEFINED
    return model


def with_undefined_initializer(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.initializer[0].data_type = T.UNDEFINED
    return model


@pytest.mark.parametrize("damage, name", [(with_undefined_input, "'x'"),
                                          (with_undefined_initializer, "'w'")])
def test_undefined_input_or_initializer_type_is_refused_naming_it(tmp_path, capsys, damage,
                                                                  name):
    code, err = run(tmp_path, capsys, damage(misaligned_gemms()))
    assert code == 3, err
    assert err.count("\n") == 1 and name in err and "UNDEFINED" in err
    assert not (tmp_path / "out.onnx").exists()


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_undefined_output_type_is_typed_from_inference_and_kept(tmp_path, capsys, dtype):
    fp32 = misaligned_gemms(T.UNDEFINED)
    onnx.checker.check_model(fp32)  # the plain check lets it pass
    code, err = run(tmp_path, capsys, fp32, f"--dtype={dtype}")
    assert code == 0, err
    mixed = onnx.load(tmp_path / "out.onnx")
    assert mixed.graph.output[0].type.tensor_type.elem_type == T.FLOAT  # as inferred, kept
    assert any(i.data_type != T.FLOAT for i in mixed.graph.initializer)  # lowered


def test_the_same_model_typed_float_matches_fp32(tmp_path, capsys):
    """Oracle for the rewrite of that model: typed FLOAT, it runs in onnxruntime."""
    fp32 = misaligned_gemms()
    code, err = run(tmp_path, capsys, fp32)
    assert code == 0, err
    x = np.random.default_rng(1).standard_normal((2, 12)).astype(np.float32)
    (expected,), (got,) = ort_run(fp32, {"x": x}), ort_run(onnx.load(tmp_path / "out.onnx"),
                                                          {"x": x})
    assert np.abs(expected - got).max() <= 1e-2 * np.abs(expected).max()


def with_string_passthrough(model: onnx.ModelProto) -> onnx.ModelProto:
    """A string input copied to a string output beside the compute (tokenizer-fed models
    pass their text along): a type of no fixed size."""
    model.graph.input.append(oh.make_tensor_value_info("text", T.STRING, [2]))
    model.graph.output.append(oh.make_tensor_value_info("text_out", T.STRING, [2]))
    model.graph.node.append(oh.make_node("Identity", ["text"], ["text_out"]))
    return model


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_string_values_beside_padded_gemms(tmp_path, capsys, dtype):
    code, err = run(tmp_path, capsys, with_string_passthrough(misaligned_gemms()),
                    f"--dtype={dtype}")
    assert code == 0, err
    onnx.checker.check_model(onnx.load(tmp_path / "out.onnx"), full_check=True)


@pytest.mark.parametrize("opset", [1, 5])
def test_opset_older_than_cast_is_refused_with_the_conversion_to_use(tmp_path, capsys, opset):
    """Cast's ``to`` is a string before opset 6: the inserted casts made an output the
    checker refused ("internal error", exit 3). onnxruntime refuses such models too."""
    model = misaligned_gemms()
    model.opset_import[0].version = opset
    code, err = run(tmp_path, capsys, model)
    assert code == 3 and err.count("\n") == 1, err
    assert f"opset {opset}" in err and "--opset 13" in err and "internal error" not in err
    code, err = run(tmp_path, capsys, model, "--opset", "13")  # the fix the message names
    assert code == 0, err
