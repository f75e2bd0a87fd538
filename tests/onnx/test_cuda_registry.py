"""Which providers run the output: onnxruntime's CUDA kernel registry, packaged.

``amp_rewrite/onnx/data/cuda_kernels.json`` is onnxruntime-gpu 1.31.1's CUDA registry, listed
by ``tools/cuda_registry.py``; ``validate.cuda_registry`` falls back to it where the CUDA
provider does not load. The kernel facts below were read from that listing (op, domain,
version range, type constraints), not computed by the code under test.
"""
from __future__ import annotations

import importlib.resources
import json
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import onnx_ir as ir
import onnxruntime
import pytest
from onnx import TensorProto, helper

from amp_rewrite.cli import _runs_on_text
from amp_rewrite.onnx import validate

BF16, F16, F32 = TensorProto.BFLOAT16, TensorProto.FLOAT16, TensorProto.FLOAT
REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = REPO / "amp_rewrite" / "onnx" / "data" / "cuda_kernels.json"
CUDA = "CUDAExecutionProvider"


def _file() -> dict:
    return json.loads(SNAPSHOT.read_text())


@pytest.fixture
def packaged():
    """The packaged registry, as cuda_registry gives it where the CUDA provider cannot be
    listed (here: its libraries are missing)."""
    snapshot = validate.read_cuda_snapshot()
    return validate.CudaRegistry(validate.snapshot_kernels(snapshot), "the packaged registry")


@pytest.fixture
def fresh_registry():
    validate.cuda_registry.cache_clear()
    yield
    validate.cuda_registry.cache_clear()


def _has(registry, op, opset, dtypes, domain=""):
    wanted = {f"tensor({d})" for d in dtypes}
    return any(d == domain and o == op and since <= opset <= until and wanted <= types
               for d, o, (since, until), types in registry.kernels)


def _model(nodes, inputs, outputs, opset=18, extra_opsets=()) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    opsets = [helper.make_opsetid("", opset), *(helper.make_opsetid(d, v)
                                                for d, v in extra_opsets)]
    return ir.from_proto(helper.make_model(graph, opset_imports=opsets))


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


# -- the snapshot ---------------------------------------------------------------------------

def test_the_snapshot_names_the_onnxruntime_it_was_read_from():
    snapshot = _file()
    assert snapshot["onnxruntime"] == "1.31.1" and snapshot["package"] == "onnxruntime-gpu"
    assert snapshot["provider"] == CUDA and snapshot["kernels_listed"] == 1565
    assert validate.read_cuda_snapshot() == snapshot  # what the package ships is this file
    assert SNAPSHOT.stat().st_size < 200_000


@pytest.mark.parametrize("op, opset, dtypes, domain, present", [
    # MatMul: float16 from opset 1, bfloat16 from 13 only (kernels 1-8, 9-12, 13+)
    ("MatMul", 13, {"bfloat16"}, "", True),
    ("MatMul", 13, {"float16"}, "", True),
    ("MatMul", 9, {"float16"}, "", True),
    ("MatMul", 12, {"bfloat16"}, "", False),
    # Log, ReduceSumSquare, Resize, Einsum: float16 kernels, none in bfloat16
    ("Log", 18, {"float16"}, "", True),
    ("Log", 18, {"bfloat16"}, "", False),
    ("ReduceSumSquare", 18, {"bfloat16"}, "", False),
    ("Resize", 19, {"bfloat16"}, "", False),
    ("Einsum", 12, {"float16"}, "", True),
    ("Einsum", 12, {"bfloat16"}, "", False),
    # ReduceSum<BFloat16> from opset 13; Div's bfloat16 kernels from 13; Conv's from 22
    ("ReduceSum", 13, {"bfloat16"}, "", True),
    ("Div", 13, {"bfloat16"}, "", True),
    ("Div", 12, {"bfloat16"}, "", False),
    ("Conv", 22, {"bfloat16"}, "", True),
    ("Conv", 21, {"bfloat16"}, "", False),
    # LayerNormalization: T bfloat16 with U (mean, inv std dev) float
    ("LayerNormalization", 17, {"bfloat16", "float"}, "", True),
    # contrib ops: SkipLayerNormalization and FastGelu in both, BiasSplitGelu float16 only
    ("SkipLayerNormalization", 1, {"bfloat16"}, "com.microsoft", True),
    ("FastGelu", 1, {"bfloat16"}, "com.microsoft", True),
    ("BiasSplitGelu", 1, {"float16"}, "com.microsoft", True),
    ("BiasSplitGelu", 1, {"bfloat16"}, "com.microsoft", False),
])
def test_snapshot_kernels_are_onnxruntimes(packaged, op, opset, dtypes, domain, present):
    assert _has(packaged, op, opset, dtypes, domain) is present


# -- cuda_kernels on the snapshot ------------------------------------------------------------

def test_a_bf16_model_whose_ops_all_have_cuda_bf16_kernels_runs(packaged):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Add", ["h", "b"], ["a"], name="add"),
             helper.make_node("LayerNormalization", ["a", "g", "beta"], ["n"], name="ln"),
             helper.make_node("Softmax", ["n"], ["y"], name="sm"),
             helper.make_node("Cast", ["y"], ["out"], name="up", to=F32)]
    inputs = [_vi("x", BF16, [2, 4]), _vi("w", BF16, [4, 4]), _vi("b", BF16, [4]),
              _vi("g", BF16, [4]), _vi("beta", BF16, [4])]
    model = _model(nodes, inputs, [_vi("out", F32, [2, 4])], opset=18)
    assert validate.cuda_kernels(model, packaged) == {
        CUDA: True, "missing": [], "source": "the packaged registry"}


def test_nodes_without_a_cuda_kernel_are_named_with_dtype_and_opset(packaged):
    # Log has no bfloat16 CUDA kernel at any opset; at opset 12 MatMul's kernel is float16 only
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Log", ["h"], ["y"], name="log")]
    inputs = [_vi("x", BF16, [2, 4]), _vi("w", BF16, [4, 4])]
    at_12 = _model(nodes, inputs, [_vi("y", BF16, [2, 4])], opset=12)
    assert validate.cuda_kernels(at_12, packaged)["missing"] == [
        "Log(bfloat16) opset 12", "MatMul(bfloat16) opset 12"]
    at_18 = _model(nodes, inputs, [_vi("y", BF16, [2, 4])], opset=18)
    result = validate.cuda_kernels(at_18, packaged)
    assert result[CUDA] is False and result["missing"] == ["Log(bfloat16) opset 18"]
    # the same graph in float16 has its kernels
    f16 = [_vi("x", F16, [2, 4]), _vi("w", F16, [4, 4])]
    assert validate.cuda_kernels(_model(nodes, f16, [_vi("y", F16, [2, 4])], opset=18),
                                 packaged)[CUDA] is True


def test_contrib_nodes_are_looked_up_in_their_domain(packaged):
    node = helper.make_node("BiasSplitGelu", ["x", "b"], ["y"], name="bsg",
                            domain="com.microsoft")
    model = _model([node], [_vi("x", BF16, [1, 4, 8]), _vi("b", BF16, [8])],
                   [_vi("y", BF16, [1, 4, 4])], extra_opsets=[("com.microsoft", 1)])
    assert validate.cuda_kernels(model, packaged)["missing"] == ["BiasSplitGelu(bfloat16) opset 1"]


# -- where the registry comes from ------------------------------------------------------------

def test_without_a_listable_provider_the_packaged_registry_answers(monkeypatch, fresh_registry):
    monkeypatch.setattr(validate, "list_cuda_kernels", lambda env=None: "cannot be listed here")
    monkeypatch.setattr(onnxruntime, "__version__", _file()["onnxruntime"])
    registry = validate.cuda_registry()
    assert registry.source == f"onnxruntime-gpu 1.31.1's CUDA registry, read {_file()['read']}"
    assert len(registry.kernels) == sum(len(ks) for ops in _file()["kernels"].values()
                                        for ks in ops.values())


def test_another_onnxruntimes_snapshot_says_whose_it_is(monkeypatch, fresh_registry):
    monkeypatch.setattr(validate, "list_cuda_kernels", lambda env=None: "cannot be listed here")
    monkeypatch.setattr(onnxruntime, "__version__", "1.40.0")
    source = validate.cuda_registry().source
    assert source.startswith("onnxruntime-gpu 1.31.1's CUDA registry, read ")
    assert source.endswith("this onnxruntime is 1.40.0, whose CUDA kernels may differ")


def test_a_listed_registry_comes_first(monkeypatch, fresh_registry):
    kernels = (("", "Log", (13, 2 ** 31 - 1), frozenset({"tensor(bfloat16)"})),)
    monkeypatch.setattr(validate, "list_cuda_kernels", lambda env=None: kernels)
    registry = validate.cuda_registry()
    assert registry.kernels == kernels and registry.source.endswith("listed here")


def test_no_registry_at_all_is_unknown(monkeypatch, fresh_registry):
    monkeypatch.setattr(validate, "list_cuda_kernels", lambda env=None: "cannot be listed here")
    monkeypatch.setattr(validate, "read_cuda_snapshot", lambda: "no snapshot")
    node = helper.make_node("Log", ["x"], ["y"], name="log")
    model = _model([node], [_vi("x", BF16, [2])], [_vi("y", BF16, [2])])
    result = validate.cuda_kernels(model)
    assert result[CUDA] is None and result["unknown"] == "cannot be listed here; no snapshot"


def test_the_cli_says_where_the_kernels_were_read():
    text = _runs_on_text({CUDA: False, "missing": ["Log(bfloat16) opset 18"], "note": None,
                          "source": "onnxruntime-gpu 1.31.1's CUDA registry, read 2026-11-29"})
    assert text == ("CUDAExecutionProvider lacks 1 kernel(s): Log(bfloat16) opset 18 (per "
                    "onnxruntime-gpu 1.31.1's CUDA registry, read 2026-11-29)")


def test_the_wheel_ships_the_snapshot():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder, name = validate.CUDA_SNAPSHOT.rsplit("/", 1)
    package = f"amp_rewrite.onnx.{folder}"
    assert package in setuptools["packages"]
    assert any(fnmatch(name, p) for p in setuptools["package-data"][package])
    assert (importlib.resources.files("amp_rewrite.onnx") / validate.CUDA_SNAPSHOT).is_file()
