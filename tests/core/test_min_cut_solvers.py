"""The compiled min cut (OR-Tools) gives the networkx solver's plans: same decisions, same casts.

Every region goes through the flow network (``ENUMERATE_UP_TO = 0``), so no region is answered
by enumeration on either side; the networkx construction is the reference.
"""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings

from amp_rewrite.core import GroupInfo, LowDtype, Precision, PrecisionGraph, load_rules, maxflow
from amp_rewrite.core import placement, plan_precision
from amp_rewrite.onnx.load import load_model, walk_graphs
from amp_rewrite.onnx.passes import infer_missing_types
from amp_rewrite.onnx.view import build_view

from tests.core.test_placement import RULES, random_graphs

H, L = Precision.HIGH, Precision.LOW
ONNX_RULES = load_rules("onnx")
COMPILED_CUT = placement._min_cut


def plans_by_solver(graph: PrecisionGraph, rules, monkeypatch, **kwargs) -> dict:
    """Plans of both solvers; ``plans["flows"]``: regions the compiled solver cut."""
    monkeypatch.setattr(placement, "ENUMERATE_UP_TO", 0)
    plans = {}
    flows = []
    monkeypatch.setattr(placement, "_min_cut", lambda *a: flows.append(1) or COMPILED_CUT(*a))
    for solver in ("networkx", "compiled"):
        monkeypatch.setattr(placement, "MIN_CUT_SOLVER", solver)
        plan = plan_precision(graph, rules, **kwargs)
        plans[solver] = (dict(plan.decisions), sorted(map(repr, plan.casts)), plan.cast_units)
    plans["flows"] = len(flows)
    return plans


def assert_same_plans(plans: dict, label: str) -> None:
    reference, compiled = plans["networkx"], plans["compiled"]
    assert compiled[2] == reference[2], f"{label}: cast units differ"
    assert compiled[1] == reference[1], f"{label}: casts differ"
    differ = [k for k, d in reference[0].items() if compiled[0][k] != d]
    assert not differ, f"{label}: decisions differ on {differ[:5]}"


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(random_graphs())
def test_compiled_min_cut_gives_networkx_plans_on_random_graphs(monkeypatch, g):
    assert_same_plans(plans_by_solver(g, RULES, monkeypatch), "random graph")
    assert_same_plans(plans_by_solver(g, RULES, monkeypatch, savings_weight=1.0),
                      "random graph, beta=1")


def test_tie_between_casts_goes_high_on_both_solvers(monkeypatch):
    """A source read by one HIGH and one LOW op costs one cast either way; networkx's cut
    keeps the smallest sink side, so the source (which saves no traffic) goes HIGH."""
    g = PrecisionGraph()
    for v in ("w", "x", "lo", "hi"):
        g.add_value(v, nbytes=4)
    g.add_group(GroupInfo("w", "w", "w", "<source>", savings=False), outputs=["w"])
    g.add_source("x", "x", name="x", fixed=H)
    g.add_group(GroupInfo("mm", "mm", "mm", "allow"), inputs=["x", "w"], outputs=["lo"])
    g.add_group(GroupInfo("exp", "exp", "exp", "deny"), inputs=["w"], outputs=["hi"])
    g.add_sink("out_lo", "lo", name="out_lo", fixed=L)
    g.add_sink("out_hi", "hi", name="out_hi", fixed=H)
    plans = plans_by_solver(g, RULES, monkeypatch)
    assert_same_plans(plans, "tie")
    assert plans["compiled"][0]["w"].precision is H
    assert plans["compiled"][2] == 8  # x into the MatMul, w to the MatMul: one cast each


def test_overflowing_capacities_fall_back_to_exact_integers():
    """A cast weight beyond int64 is solved on Python integers, with the same cut."""
    huge = 1 << 70
    net = maxflow.FlowNetwork(4)  # 0 source, 1 sink, 2 and 3 inner
    net.add(0, 2, huge)
    net.add(2, 1, huge + 1)  # 2 can keep sending: reaches the sink
    net.add(0, 3, huge + 5)
    net.add(3, 1, huge)  # saturated: 3 cannot reach the sink
    side = maxflow.sink_side(net, 0, 1)
    assert side.tolist() == [False, True, True, False]
    small = maxflow.FlowNetwork(4)
    for a, b, c in ((0, 2, 1), (2, 1, 2), (0, 3, 6), (3, 1, 1)):
        small.add(a, b, c)
    assert maxflow.sink_side(small, 0, 1).tolist() == side.tolist()


def onnx_graph(model: onnx.ModelProto) -> PrecisionGraph:
    ir_model = load_model(model).model
    graphs = list(walk_graphs(ir_model.graph))
    infer_missing_types(ir_model, graphs)
    return build_view(ir_model, LowDtype.FLOAT16, graphs=graphs).graph


@pytest.mark.slow
def test_compiled_min_cut_gives_networkx_plans_on_node_test_corpus(monkeypatch):
    from onnx.backend.test.case.node import collect_testcases

    from tests.models.corpus import has_float32

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")  # the generators overflow on purpose (Cast tests)
        models = [tc for tc in collect_testcases() if tc.model is not None
                  and has_float32(tc.model)]
    assert len(models) > 1000
    flows = 0
    for tc in models:
        plans = plans_by_solver(onnx_graph(tc.model), ONNX_RULES, monkeypatch)
        assert_same_plans(plans, tc.name)
        flows += plans["flows"]
    assert flows > 1000  # regions that went through the compiled max flow


ZOO = ["albert", "bart", "bert", "clip_vision", "convnext", "deit", "distilbert", "gpt2",
       "llama", "mobilenet_v2", "resnet", "roberta", "segformer", "swin", "t5", "vit",
       "wav2vec2", "whisper_encoder", "clip_text", "llama_32k", "unet_block"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_compiled_min_cut_gives_networkx_plans_on_zoo_model(monkeypatch, name):
    from tests.models import zoo

    assert name in zoo.NAMES
    graph = onnx_graph(onnx.load(zoo.cached_onnx(name), load_external_data=False))
    assert_same_plans(plans_by_solver(graph, ONNX_RULES, monkeypatch), name)


def test_zoo_list_is_the_whole_zoo():
    from tests.models import zoo

    assert sorted(zoo.NAMES) == sorted(ZOO)
