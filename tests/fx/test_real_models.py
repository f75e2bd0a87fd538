"""Real ``transformers`` architectures (tests.models.zoo, random weights): capture, rewrite for
fp16 and bf16, run on CPU, and compare with the FP32 model and with ``torch.autocast``.

Oracles: the FP32 model's outputs; ``torch.autocast(device_type="cpu")`` on the same inputs.
"""
from __future__ import annotations

import copy
import operator

import pytest
import torch

from amp_rewrite.core import load_rules
from amp_rewrite.fx import opkeys
from amp_rewrite.fx import rewrite_graph
from amp_rewrite.fx.capture import refresh_fake_values
from tests.models import zoo
from tests.models.measure import compare_with_autocast, float_outputs

# torch's deepcopy of export's pytree specs uses its own deprecated LeafSpec check.
pytestmark = [pytest.mark.slow,  # every zoo model, captured and rewritten
              pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")]

# Relative error vs FP32 (max |diff| / max |ref|). MobileNetV2 (17 depthwise blocks with
# BatchNorm) amplifies rounding most: 0.21 in bf16, exactly autocast's error there as well.
TOL = {torch.float16: 5e-2, torch.bfloat16: 2.5e-1}
AUTOCAST_FACTOR = 1.5
LOW = [torch.float16, torch.bfloat16]

@pytest.fixture(scope="module")
def rewritten(zoo_capture):
    """(ZooModel, {dtype: rewritten GraphModule}) per zoo model, rewritten once per dtype."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model, gm = zoo_capture(name)
            cache[name] = (model, {dtype: rewrite_graph(copy.deepcopy(gm), dtype=dtype,
                                                         keep_io_types=False)
                                   for dtype in LOW})
        return cache[name]
    return get


@pytest.mark.parametrize("name", zoo.NAMES)
def test_every_op_in_the_exported_graph_has_a_rule_class(zoo_capture, name):
    _, gm = zoo_capture(name)
    rules = load_rules("torch", env={})
    keys = {opkeys.op_key(n, gm) for n in gm.graph.nodes
            if n.op in ("call_function", "call_method", "call_module")
            and n.target is not operator.getitem and n.target != "_guards_fn"}
    assert keys and not [k for k in keys if rules.classify(k) is None]


@pytest.mark.parametrize("name", zoo.NAMES)
def test_report_lists_no_unclassified_op(rewritten, name):
    _, by_dtype = rewritten(name)
    report = by_dtype[torch.float16].amp_report
    assert report["unlisted_ops"] == [] and report["notes"] == []
    assert not [r for r in report["nodes"] if r["class"] == "unlisted"]


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", zoo.NAMES)
def test_error_within_tolerance_and_close_to_autocast(rewritten, name, dtype):
    model, by_dtype = rewritten(name)
    result = compare_with_autocast(model.module, by_dtype[dtype], model.args, model.kwargs, dtype)
    assert result.error < TOL[dtype]  # finite too: NaN/Inf count as infinite error
    assert result.error <= AUTOCAST_FACTOR * result.autocast_error + 1e-6


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", zoo.NAMES)
def test_conversions_executed_at_most_autocasts(zoo_capture, name, dtype, request):
    # the plan's conversions: the CPU GEMM emulation (fx/lowering.py) adds its operand casts
    model, gm = zoo_capture(name)
    gm = rewrite_graph(gm, dtype=dtype, keep_io_types=False, emulate_gemms=False)
    result = compare_with_autocast(model.module, gm, model.args, model.kwargs, dtype)
    assert result.conversions <= result.autocast_conversions


@pytest.mark.parametrize("name", zoo.NAMES)
def test_backward_gives_finite_fp32_gradients_where_fp32_has_them(rewritten, name):
    model, by_dtype = rewritten(name)
    gm = by_dtype[torch.float16]
    _loss(gm(*model.args, **model.kwargs)).backward()
    reference = copy.deepcopy(model.module)
    _loss(reference(*model.args, **model.kwargs)).backward()
    expected = {k for k, p in reference.named_parameters() if p.grad is not None}
    got = dict(gm.named_parameters())
    assert expected and expected <= set(got)
    for key in expected:
        grad = got[key].grad
        assert grad is not None and grad.dtype == torch.float32, key
        assert torch.isfinite(grad).all(), key
    gm.zero_grad()


def _loss(out: object) -> torch.Tensor:
    return sum(t.float().pow(2).mean() for t in float_outputs(out))


@pytest.mark.parametrize("name", zoo.NAMES)
def test_cheap_meta_update_matches_full_fake_propagation(rewritten, name):
    _, by_dtype = rewritten(name)
    gm = copy.deepcopy(by_dtype[torch.float16])
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    before = {n.name: _dtypes(n.meta.get("val")) for n in nodes}
    refresh_fake_values(gm)
    after = {n.name: _dtypes(n.meta.get("val")) for n in nodes}
    assert before == after


def _dtypes(val: object) -> object:
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, list | tuple):
        return tuple(_dtypes(v) for v in val)
    return None


@pytest.mark.parametrize("name", zoo.NAMES)
def test_second_run_on_a_real_model_changes_nothing(rewritten, name):
    _, by_dtype = rewritten(name)
    gm = copy.deepcopy(by_dtype[torch.bfloat16])
    code = gm.code
    rewrite_graph(gm, dtype=torch.bfloat16, keep_io_types=False)
    assert not gm.amp_report["modified"] and gm.code == code
