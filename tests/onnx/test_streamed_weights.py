"""External float32 weights are converted to float16 while the output is written, chunk by
chunk (``convert.Float16Stream``): same bytes, same report as converting them whole."""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import onnx
import onnx.helper as oh
import onnx.numpy_helper as onh
import onnx_ir as ir
import pytest

from amp_rewrite.errors import ModelError
from amp_rewrite.onnx import convert, save
from amp_rewrite.onnx.api import rewrite_onnx_model

SENTINEL = np.finfo(np.float32).max  # what exporters write for -inf in attention masks


def _weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    plain = rng.standard_normal((96, 96)).astype(np.float32)
    masked = rng.standard_normal((96, 96)).astype(np.float32)
    masked[5, :7] = -SENTINEL  # finite beyond fp16: mapped to -65504, not counted as clamped
    masked[90, 3] = SENTINEL
    with_nan = rng.standard_normal((96, 32)).astype(np.float32)
    with_nan[17, 10:14] = [np.nan, np.inf, -np.inf, 65504.0]  # kept as they are
    # (96 -> 32 -> 96: the narrow value between the last two MatMuls is the cheapest cast)
    too_wide = rng.standard_normal((32, 96)).astype(np.float32)
    too_wide[1, 1] = 1e6  # the low dtype cannot hold it: stays fp32 with its reader
    return {"w_plain": plain, "w_masked": masked, "w_nan": with_nan, "w_wide": too_wide}


def _external_model(tmp_path) -> str:
    weights = _weights()
    small = onh.from_array(np.arange(3, dtype=np.float32), "bias")  # shifts every offset
    nodes, prev = [], "x"
    for i, name in enumerate(weights):
        nodes.append(oh.make_node("MatMul", [prev, name], [f"h{i}"]))
        prev = f"h{i}"
    nodes.append(oh.make_node("Add", [prev, "bias3"], ["y"]))
    inits = [small, *(onh.from_array(w, n) for n, w in weights.items()),
             onh.from_array(np.zeros(96, np.float32), "bias3")]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                 [2, 96])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 96])],
                          inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])
    path = tmp_path / "in" / "m.onnx"
    path.parent.mkdir()
    onnx.save(model, path, save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    return str(path)


@pytest.fixture
def small_chunks(monkeypatch):
    """Stream every external weight, in chunks of an odd size (a partial last chunk, chunk
    starts off the page grid)."""
    monkeypatch.setattr(convert, "STREAM_MIN_BYTES", 0)
    monkeypatch.setattr(convert, "CHUNK_ELEMENTS", 1001)


def _saved_weights(result, out) -> tuple[dict[str, bytes], onnx.ModelProto]:
    result.save(out)
    proto = onnx.load(str(out))
    weights = {t.name: onh.to_array(t).tobytes() for t in proto.graph.initializer}
    proto.graph.ClearField("initializer")
    return weights, proto


def _stats(result) -> dict:
    stats = dataclasses.asdict(result.pass_.stats)
    stats.pop("inserted_casts")
    return stats


def test_streamed_weights_are_the_bytes_of_converting_them_whole(tmp_path, small_chunks,
                                                                  monkeypatch):
    src = _external_model(tmp_path)
    streamed = rewrite_onnx_model(src)
    kinds = {v.name: type(v.const_value) for v in streamed.model.graph.initializers.values()}
    assert all(kinds[n] is convert.Float16Stream for n in ("w_plain", "w_masked", "w_nan"))
    assert kinds["w_wide"] is not convert.Float16Stream
    got, got_graph = _saved_weights(streamed, tmp_path / "streamed.onnx")

    monkeypatch.setattr(convert, "can_stream", lambda tensor: False)
    whole = rewrite_onnx_model(src)
    want, want_graph = _saved_weights(whole, tmp_path / "whole.onnx")
    assert got == want
    assert got_graph == want_graph
    assert _stats(streamed) == _stats(whole)
    assert streamed.pass_.stats.values_clamped == 0  # sentinels are no clamped values


def test_streamed_weights_match_numpy_with_sentinels_at_the_float16_extreme(tmp_path,
                                                                           small_chunks):
    out = tmp_path / "out.onnx"
    rewrite_onnx_model(_external_model(tmp_path)).save(out)
    saved = {t.name: onh.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    weights = _weights()
    for name in ("w_plain", "w_masked", "w_nan"):
        source = weights[name]
        with np.errstate(over="ignore"):
            want = np.where(np.abs(source) == SENTINEL, np.sign(source) * 65504.0,
                            source).astype(np.float16)
        assert saved[name].dtype == np.float16
        assert np.array_equal(saved[name].view(np.uint16), want.view(np.uint16)), name
    assert saved["w_wide"].dtype == np.float32


def test_saving_streamed_weights_never_loads_a_whole_source_tensor(tmp_path, small_chunks,
                                                                  monkeypatch):
    result = rewrite_onnx_model(_external_model(tmp_path))

    def whole_load(self, *args, method_name, **kwargs):
        # (tensors under ir.save's 256-byte threshold are stored inline, from tobytes)
        if self.nbytes > 256:
            raise AssertionError(f"{self.name}: loaded whole")
        return original[type(self), method_name](self, *args, **kwargs)

    original = {}
    for cls in (ir.ExternalTensor, convert.Float16Stream):
        for method_name in ("numpy", "tobytes", "__array__"):
            original[cls, method_name] = getattr(cls, method_name)
            monkeypatch.setattr(cls, method_name, functools.partialmethod(
                whole_load, method_name=method_name))
    # w_wide stays an fp32 ExternalTensor: onnx_ir copies it with tofile, in chunks
    result.save(tmp_path / "out.onnx")
    assert onnx.load(str(tmp_path / "out.onnx")).graph.initializer


def test_clamp_constants_converts_whole_and_counts_the_clamped(tmp_path, small_chunks):
    result = rewrite_onnx_model(_external_model(tmp_path), clamp_constants=True)
    assert not any(isinstance(v.const_value, convert.Float16Stream)
                   for v in result.model.graph.initializers.values())
    assert result.pass_.stats.values_clamped == 1  # w_wide's 1e6 (the infs stay infs)


def test_source_truncated_before_the_save_fails_and_writes_nothing(tmp_path, small_chunks):
    src = _external_model(tmp_path)
    result = rewrite_onnx_model(src)
    data = tmp_path / "in" / "m.onnx.data"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    out = tmp_path / "out" / "m.amp.onnx"
    out.parent.mkdir()
    with pytest.raises(ModelError, match="shorter than tensor"):
        result.save(out)
    assert list(out.parent.iterdir()) == []


def test_cast_into_converts_in_place_like_numpy():
    source = np.random.default_rng(0).standard_normal(3 * convert.CHUNK_ELEMENTS // 2 + 7,
                                                      dtype=np.float32)
    source[:4] = [65520.0, -1e30, np.nan, 6e-8]
    out = np.full(source.size, np.float16(7.0))
    convert.cast_into(source, out)
    with np.errstate(over="ignore"):
        assert np.array_equal(out.view(np.uint16), source.astype(np.float16).view(np.uint16))


def test_io_keeps_its_atomic_data_file_name(tmp_path, small_chunks):
    """The streamed write goes through save_model's staging: OUT.<8 hex>.data beside OUT,
    nothing else left behind."""
    out = tmp_path / "out" / "m.amp.onnx"
    out.parent.mkdir()
    rewrite_onnx_model(_external_model(tmp_path)).save(out)
    names = sorted(p.name for p in out.parent.iterdir())
    assert len(names) == 2 and names[0] == out.name
    assert names[1].startswith(out.name + ".") and names[1].endswith(save.DATA_SUFFIX)


def _bias_chain(with_sentinel: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    inits, nodes, prev = [], [], "x"
    for i in range(12):
        w = rng.standard_normal((8, 8)).astype(np.float32)
        b = (rng.standard_normal(8) * 10.0 ** rng.integers(-9, 4)).astype(np.float32)
        b[0] = [np.nan, -0.0, 65504.0, 6e-8][i % 4]
        if with_sentinel and i == 7:
            b[1] = -SENTINEL  # overflows: clamped to -65504, tensor by tensor
        inits += [onh.from_array(w, f"w{i}"), onh.from_array(b, f"b{i}")]
        nodes += [oh.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]),
                  oh.make_node("Add", [f"m{i}", f"b{i}"], [f"h{i}"])]
        prev = f"h{i}"
    nodes[-1].output[0] = "y"
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT,
                                                                 [2, 8])],
                          [oh.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 8])],
                          inits)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 18)])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("with_sentinel", [False, True])
def test_small_initializers_converted_together_equal_one_by_one(dtype, with_sentinel,
                                                                monkeypatch):
    from amp_rewrite.onnx import apply

    model = _bias_chain(with_sentinel)
    together = rewrite_onnx_model(model, dtype=dtype)
    monkeypatch.setattr(apply, "_small_initializers_converted", lambda *args: ({}, 0))
    one_by_one = rewrite_onnx_model(model, dtype=dtype)
    assert together.proto().SerializeToString(deterministic=True) == \
        one_by_one.proto().SerializeToString(deterministic=True)
    assert _stats(together) == _stats(one_by_one)
    assert together.pass_.stats.constants_converted >= 20


def test_streamed_weights_in_memory_equal_the_written_ones(tmp_path, small_chunks):
    """Validation and calibration serialise the model in memory (``tobytes``, the whole
    array built chunk by chunk): the same bytes as the file."""
    result = rewrite_onnx_model(_external_model(tmp_path))
    in_memory = {t.name: onh.to_array(t).tobytes()
                 for t in save.proto_with_weights(result.model, result.info).graph.initializer}
    written, _ = _saved_weights(result, tmp_path / "out.onnx")
    assert in_memory == written
