"""``rewrite_onnx`` as a library call: what it accepts, and one clear error for what it does not."""
from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from amp_rewrite.errors import ModelError, UsageError
from amp_rewrite.onnx import load, rewrite_onnx, rewrite_onnx_model

from .conftest import IF_CAPTURES_OUTER, parse

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


def ir_garbage(action: Callable[[], object]) -> list[str]:
    """Types of the onnx_ir objects that only the cyclic collector frees after ``action``."""
    gc.collect()
    flags = gc.get_debug()
    gc.disable()
    try:
        action()
        gc.set_debug(gc.DEBUG_SAVEALL)  # keep what a collection finds, to look at it
        gc.collect()
        return [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith("onnx_ir")]
    finally:
        gc.set_debug(flags)
        gc.garbage.clear()
        gc.enable()


def test_rewrite_frees_its_ir_by_reference_counting(example):
    """Collecting ~1M cyclic IR objects cost ~1 s at 50k nodes; ``rewrite_onnx`` unlinks them."""
    assert ir_garbage(lambda: rewrite_onnx(example)) == []
    kept = []
    assert ir_garbage(lambda: kept.append(rewrite_onnx_model(example))) == []
    assert "Node" in ir_garbage(kept.clear)  # control: the returned IR is whole, hence cyclic


def test_release_unlinks_subgraphs_and_captured_values():
    model = parse(IF_CAPTURES_OUTER)

    def load_and_release() -> None:
        assert load.release(load.load_model(model).model)

    assert ir_garbage(load_and_release) == []


def test_save_writes_the_checked_model(example, tmp_path):
    result = rewrite_onnx_model(example)
    out = result.save(tmp_path / "out.onnx")
    assert out.read_bytes() == result.proto().SerializeToString()
    assert onnx.load(out) == rewrite_onnx(example)
    assert [p.name for p in tmp_path.iterdir()] == ["out.onnx"]  # no temp file left behind


CHAIN_UNTYPED = """
<ir_version: 8, opset_import: ["" : 18, "acme" : 1]>
g (float[4, 16] x, float[16, 16] w) => (float[4, 16] y) {
    m = MatMul(x, w)
    a = Add(m, x)
    r = Relu(a)
    y = Exp(r)
}
"""
CUSTOM_OUTPUT = """
<ir_version: 8, opset_import: ["" : 18, "acme" : 1]>
g (float[4, 16] x, float[16, 16] w) => (float[4, 16] y) {
    m = MatMul(x, w)
    c = acme.Mystery(m)
    y = Relu(c)
}
"""


@pytest.mark.parametrize("text, skipped", [(CHAIN_UNTYPED, True), (CUSTOM_OUTPUT, False)])
def test_dtype_propagation_runs_only_where_loading_left_a_value_untyped(monkeypatch, text,
                                                                       skipped):
    """Shape inference types every intermediate of a standard chain (the propagation has
    nothing to add, so it is skipped), not the output of a custom op; either way the output
    is the one with the propagation forced."""
    from amp_rewrite.onnx import passes

    calls = []
    real = passes.infer_missing_types
    monkeypatch.setattr(passes, "infer_missing_types",
                        lambda *args: calls.append(args) or real(*args))
    model = parse(text)
    fast = rewrite_onnx(model, check=False)
    assert (not calls) is skipped
    real_load = load._from_proto

    def load_untyped(*args):  # forces the propagation
        loaded = real_load(*args)
        loaded.info.typed = False
        return loaded

    monkeypatch.setattr(load, "_from_proto", load_untyped)
    forced = rewrite_onnx(model, check=False)
    assert len(calls) == 1 + (not skipped)
    assert fast.SerializeToString(deterministic=True) == \
        forced.SerializeToString(deterministic=True)


def test_load_info_records_the_source_file_and_its_weight_files(tmp_path):
    """What loading learns travels in ``LoadInfo``, not in the IR: a file's path and data
    files; an ``ir.Model`` handed in is taken with nothing known about it."""
    proto = onnx.load(EXAMPLE)
    path = tmp_path / "m.onnx"
    onnx.save(proto, path, save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    loaded = load.load_model(path)
    assert loaded.info.source == path and loaded.info.had_external_data
    assert loaded.info.external_files == [tmp_path / "m.data"]
    assert load.load_model(loaded) is loaded
    assert not loaded.model.meta  # nothing of ours rides on the IR
    bare = load.load_model(loaded.model).info
    assert bare.source is None and bare.external_files is None and not bare.typed
