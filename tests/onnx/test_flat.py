"""The ModelProto path (``onnx/flat.py``) writes what the onnx_ir path writes.

The reference is the onnx_ir path on the same model and options (``rewrite_onnx_model``): same
nodes (op, name, inputs, outputs, attributes, metadata) in the same order, same initializers
(names, types, bytes), same value types, same IR version. Models the ModelProto path declines
are no evidence, so each test also asserts how many it took.
"""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import amp_rewrite
from amp_rewrite.onnx import api
from tests.onnx.conftest import parse, run_reference

sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
from bench_onnx_speed import VARIANTS, build_chain  # noqa: E402


def canonical(model: onnx.ModelProto) -> tuple:
    g = model.graph
    nodes = [(n.op_type, n.domain, n.name, list(n.input), list(n.output),
              [(a.name, helper.get_attribute_value(a)) for a in n.attribute],
              [(e.key, e.value) for e in n.metadata_props]) for n in g.node]
    inits = [(t.name, t.data_type, list(t.dims), numpy_helper.to_array(t).tobytes())
             for t in g.initializer]
    value_info = {v.name: v.type.SerializeToString() for v in g.value_info}
    graph_io = [(v.name, v.type.SerializeToString()) for v in (*g.input, *g.output)]
    opsets = [(o.domain, o.version) for o in model.opset_import]
    return nodes, inits, value_info, graph_io, model.ir_version, opsets


def assert_same_as_onnx_ir_path(model: onnx.ModelProto, label: str, **options) -> bool:
    """Whether the ModelProto path took the model; where it did, its output is the onnx_ir
    path's."""
    fast = api._rewrite_flat(model, check=False, **options)
    if fast is None:
        return False
    reference = api.rewrite_onnx_model(model, check=False, **options).proto()
    parts = ("nodes", "initializers", "value_info", "graph I/O", "IR version", "opsets")
    for part, got, want in zip(parts, canonical(fast), canonical(reference)):
        assert got == want, f"{label} {options}: {part} differ"
    return True


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16"}, {"keep_io_types": False},
                                     {"savings_weight": 1.0},
                                     {"keep_fp32": ["*"]}, {"pad": False, "fuse": False}])
@pytest.mark.parametrize("variant", VARIANTS)
def test_benchmark_chains_match(variant, options):
    assert assert_same_as_onnx_ir_path(build_chain(300, variant), variant, **options)


@pytest.mark.parametrize("options", [{}, {"dtype": "bfloat16", "keep_io_types": False}])
def test_node_test_corpus_matches(options):
    from onnx.backend.test.case.node import collect_testcases

    from amp_rewrite.bench.corpus import has_float32

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the generators overflow on purpose (Cast tests)
        models = [tc for tc in collect_testcases() if tc.model is not None
                  and has_float32(tc.model)]
    taken = sum(assert_same_as_onnx_ir_path(tc.model, tc.name, **options) for tc in models)
    assert taken > 800, f"the ModelProto path took only {taken} of {len(models)} models"


# The zoo exports without fusion and padding: the CNNs and vision transformers qualify (the
# text models hold Cast nodes, which only the onnx_ir path rewrites).
ZOO_FLAT = ["clip_vision", "convnext", "deit", "mobilenet_v2", "resnet", "segformer", "swin",
            "vit", "wav2vec2", "whisper_encoder"]


@pytest.mark.parametrize("name", ZOO_FLAT)
def test_zoo_models_match(name):
    from amp_rewrite.bench import zoo

    model = onnx.load(zoo.cached_onnx(name), load_external_data=False)
    assert assert_same_as_onnx_ir_path(model, name, fuse=False, pad=False)
    assert api._rewrite_flat(model, check=False) is None  # fusion would rewrite it


def test_shared_weight_copy_and_described_values_match():
    """A weight read at both precisions (a converted copy), an input read by both, and
    intermediates described by value_info (their casts keep a description)."""
    model = parse("""
    <ir_version: 9, opset_import: ["" : 17]>
    g (float[4, 8] x) => (float[4, 8] y, float[4, 8] z) <float[8, 8] w, int64 axis> {
        m = MatMul(x, w)
        r = Relu(m)
        c = CumSum(w, axis)
        s = CumSum(r, axis)
        e = Add(x, r)
        y = Add(s, e)
        z = MatMul(e, c)
    }""")
    rng = np.random.default_rng(0)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(
        rng.standard_normal((8, 8)).astype(np.float32), "w"))
    described = onnx.shape_inference.infer_shapes(model)
    assert len(described.graph.value_info) == 5
    for m in (model, described):
        for options in ({}, {"keep_io_types": False}, {"dtype": "bfloat16"}):
            # no padding: it would look at the MatMul of two activations
            assert assert_same_as_onnx_ir_path(m, "shared weight", pad=False, **options)
    out = amp_rewrite.rewrite_onnx(described, pad=False)
    assert any(t.name.startswith("w_") for t in out.graph.initializer)  # the copy
    assert {v.name for v in out.graph.value_info} > {"m", "r"}


def test_mask_sentinels_convert_as_on_the_onnx_ir_path():
    """-float32 max (an exporter's -inf) becomes fp16's -65504 in the one-call conversion's
    fallback (the batch overflows), as on the onnx_ir path."""
    mask = np.zeros((4, 8), np.float32)
    mask[:, 5:] = np.finfo(np.float32).min
    model = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "mask"], ["a"]),
         helper.make_node("Softmax", ["a"], ["y"], axis=-1)], "masked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [numpy_helper.from_array(np.eye(8, dtype=np.float32), "w"),
         numpy_helper.from_array(mask, "mask")]), opset_imports=[helper.make_opsetid("", 17)])
    assert assert_same_as_onnx_ir_path(model, "mask")
    out = amp_rewrite.rewrite_onnx(model)
    stored = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert stored["mask"].dtype == np.float16 and stored["mask"].min() == -65504
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    got, = run_reference(out, {"x": x})
    want, = run_reference(model, {"x": x})
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=2e-3)


def test_declines_what_only_the_onnx_ir_path_handles():
    """Each reason is a model the ModelProto path must not take; the public API still
    rewrites them (through onnx_ir)."""
    chain = build_chain(30, "residual")
    softmax_into_matmul = parse("""
    <ir_version: 9, opset_import: ["" : 17]>
    g (float[4, 8] q, float[4, 8] k) => (float[4, 4] y) {
        kt = Transpose <perm = [1, 0]> (k)
        s = MatMul(q, kt)
        p = Softmax <axis = -1> (s)
        y = MatMul(p, s)
    }""")
    misaligned = helper.make_model(helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 12])],
        [numpy_helper.from_array(np.ones((12, 12), np.float32), "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    wide = helper.make_model(helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [numpy_helper.from_array(np.full(4, 1e6, np.float32), "w")]),
        opset_imports=[helper.make_opsetid("", 17)])
    for label, model, options in [("attention", softmax_into_matmul, {}),
                                  ("misaligned weight", misaligned, {}),
                                  ("constant beyond fp16", wide, {}),
                                  ("calibration", chain, {"calibration_data": {
                                      "x": np.ones((4, 16), np.float32)}}),
                                  ("opset conversion", chain, {"opset": 18})]:
        assert api._rewrite_flat(model, check=False, **options) is None, label
        amp_rewrite.rewrite_onnx(model, **options)
    assert api._rewrite_flat(misaligned, check=False, pad=False) is not None


def test_rewrite_onnx_skips_the_onnx_ir_round_trip(monkeypatch):
    """What the speed comes from: a flat chain never enters onnx_ir."""
    calls = []
    for name in ("from_proto", "to_proto"):
        original = getattr(ir, name)
        monkeypatch.setattr(ir, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    model = build_chain(60, "residual_deny")
    out = amp_rewrite.rewrite_onnx(model)  # checked, as by default
    assert not calls
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    got, = run_reference(out, {"x": x})
    want, = run_reference(model, {"x": x})
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)
    amp_rewrite.rewrite_onnx(model, opset=18)  # an opset conversion: the onnx_ir path
    assert calls


def test_bad_input_fails_as_on_the_onnx_ir_path():
    """Damaged tensors and models the checker refuses: the same errors either way."""
    from amp_rewrite.errors import ModelError

    model = build_chain(9, "plain")
    model.graph.initializer[0].raw_data = model.graph.initializer[0].raw_data[:-2]
    with pytest.raises(ModelError, match="raw_data holds"):
        amp_rewrite.rewrite_onnx(model)
    broken = build_chain(9, "plain")
    broken.graph.node[1].input[0] = "nowhere"
    assert api._rewrite_flat(broken, check=False) is None
    with pytest.raises(ModelError, match="invalid ONNX model"):
        amp_rewrite.rewrite_onnx(broken)


def test_mutated_models_agree_with_the_onnx_ir_path(monkeypatch):
    """The CLI fuzz's mutations (amp_rewrite.bench.fuzz) of models the ModelProto path
    takes: the same output, or the same kind of error, either way."""
    from amp_rewrite.bench import fuzz

    models = {"chain": build_chain(60, "residual_deny"), "plain": build_chain(30, "plain")}
    flat_path = api._rewrite_flat
    taken = []

    def outcome(case, path, **options) -> tuple:
        monkeypatch.setattr(api, "_rewrite_flat", path)
        try:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return "ok", canonical(amp_rewrite.rewrite_onnx(case.data, **options))
        except Exception as e:  # noqa: BLE001 - the kind of error is what is compared
            return type(e).__name__, None

    def recording(*args, **kwargs):
        result = flat_path(*args, **kwargs)
        taken.append(result is not None)
        return result

    for seed in range(80):
        case = fuzz.make_case(seed, models)
        if case.external:
            continue
        options = {"dtype": "bfloat16"} if "bf16" in " ".join(case.flags) else {}
        got = outcome(case, recording, **options)
        want = outcome(case, lambda *a, **k: None, **options)
        assert got == want, f"seed {seed} ({case.mutations}): {got[0]} against {want[0]}"
    assert sum(taken) >= 15, f"the ModelProto path took {sum(taken)} mutated models"
