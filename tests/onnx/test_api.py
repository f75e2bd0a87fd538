"""``rewrite_onnx`` as a library call: what it accepts, and one clear error for what it does not."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewrite.errors import ModelError, UsageError
from amp_rewrite.onnx import rewrite_onnx

EXAMPLE = Path(__file__).parents[2] / "examples" / "transformer_block.onnx"


@pytest.fixture(scope="module")
def example() -> onnx.ModelProto:
    return onnx.load(EXAMPLE)


def casts(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Cast" for n in model.graph.node)


def test_path_proto_and_bytes_give_the_same_model(example):
    from_path = rewrite_onnx(EXAMPLE)
    assert rewrite_onnx(example) == from_path
    assert rewrite_onnx(example.SerializeToString()) == from_path


@pytest.mark.parametrize("source, error, needle", [
    (123, UsageError, "got int"),
    (b"not a model", ModelError, "not a serialized ONNX model"),
])
def test_unsupported_sources(source, error, needle):
    with pytest.raises(error, match=needle):
        rewrite_onnx(source)


def test_one_pattern_or_rule_file_as_a_plain_string(example, tmp_path):
    """A bare string is one item, not a list of characters (``"*"`` would pin everything)."""
    names = [n.name for n in example.graph.node if n.op_type == "MatMul"]
    one = rewrite_onnx(example, keep_fp32=names[0])
    assert casts(one) > casts(rewrite_onnx(example))  # one MatMul pinned, not all of them
    assert rewrite_onnx(example, keep_fp32=[names[0]]) == one
    rules = tmp_path / "r.toml"
    rules.write_text('schema = 1\n[deny]\nSoftmax = "kept fp32 in this test"\n')
    assert rewrite_onnx(example, rules=rules) == rewrite_onnx(example, rules=[str(rules)])


def test_calibration_data_naming_other_inputs_is_a_usage_error(example):
    with pytest.raises(UsageError, match=r"missing \['hidden_states'\], unknown \['wrong'\]"):
        rewrite_onnx(example, calibration_data={"wrong": np.zeros(3, np.float32)})
