"""Exact min-cut placement: brute-force optimality on random graphs, and hand-counted cases."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amp_rewrite.core import GroupInfo, OpClass, Precision, PrecisionGraph, RuleEntry, RuleSet
from amp_rewrite.core import plan_precision

H, L = Precision.HIGH, Precision.LOW
CLASSES = {"allow": OpClass.ALLOW, "deny": OpClass.DENY, "gray": OpClass.GRAY,
           "clear": OpClass.CLEAR}
RULES = RuleSet([RuleEntry(op, c, f"test {op}", "test") for op, c in CLASSES.items()])


def build(ops: dict[str, str], edges: list[tuple[str, str]], *, sizes=None,
          inputs=(), outputs=(), low_inputs=()) -> PrecisionGraph:
    """Nodes named by ``ops`` (name -> class key); edges name -> name; one value per producer."""
    sizes = sizes or {}
    g = PrecisionGraph()
    for name in [*ops, *inputs, *low_inputs]:
        g.add_value(f"{name}:out", nbytes=sizes.get(name, 4))
    for name in inputs:
        g.add_source(name, f"{name}:out", name=name, fixed=H)
    for name in low_inputs:
        g.add_source(name, f"{name}:out", name=name, fixed=L)
    for name, op in ops.items():
        reads = [f"{a}:out" for a, b in edges if b == name]
        g.add_group(GroupInfo(name, name, name, op), inputs=reads, outputs=[f"{name}:out"])
    for name in outputs:
        g.add_sink(f"out:{name}", f"{name}:out", name=f"out:{name}", fixed=H)
    return g


def test_allow_gray_deny_chain():
    # TF AMP doc: input(fp32) → MatMul(allow) → Add(gray) → Exp(deny) → output(fp32).
    g = build({"mm": "allow", "add": "gray", "exp": "deny"},
              [("x", "mm"), ("mm", "add"), ("add", "exp")], inputs=["x"], outputs=["exp"])
    plan = plan_precision(g, RULES)
    assert [plan.precision(k) for k in ("mm", "add", "exp")] == [L, L, H]
    # One cast into the MatMul, one out of the low region before Exp.
    assert sorted((c.value, c.to) for c in plan.casts) == [("add:out", H), ("x:out", L)]


def test_bidirectional_clear_chain():
    # allow → clear → clear → allow: the clears stay low, no cast between the GEMMs.
    g = build({"mm1": "allow", "r1": "clear", "r2": "clear", "mm2": "allow"},
              [("x", "mm1"), ("mm1", "r1"), ("r1", "r2"), ("r2", "mm2")],
              inputs=["x"], outputs=["mm2"])
    plan = plan_precision(g, RULES)
    assert plan.precision("r1") is L and plan.precision("r2") is L
    assert len(plan.casts) == 2  # x into mm1, mm2's output back to fp32


def test_existing_cast_is_a_clear_op():
    # An existing Cast with free ports behaves like any clear op: one cast total before mm.
    g = build({"cast": "clear", "mm": "allow"}, [("x", "cast"), ("cast", "mm")],
              inputs=["x"], outputs=["mm"], sizes={"x": 8, "cast": 8})
    plan = plan_precision(g, RULES)
    assert len(plan.casts) == 2
    assert plan.precision("cast") is L  # tie broken toward low


def test_fan_out_to_mixed_consumers_shares_one_cast():
    g = build({"p": "gray", "mm1": "allow", "mm2": "allow", "exp": "deny"},
              [("x", "p"), ("p", "mm1"), ("p", "mm2"), ("p", "exp")],
              inputs=["x"], outputs=["mm1", "mm2", "exp"])
    plan = plan_precision(g, RULES)
    # p stays high (its input is fp32): one shared cast of p's output feeds both GEMMs.
    low_casts = [c for c in plan.casts if c.value == "p:out"]
    assert len(low_casts) == 1 and set(low_casts[0].consumers) == {"mm1", "mm2"}
    assert len(plan.casts) == 3  # p→low shared, mm1→fp32 out, mm2→fp32 out


def test_graph_output_that_also_feeds_nodes():
    # mm's output is a graph output (fp32) and feeds mm2: one cast to fp32 for the output only.
    g = build({"mm": "allow", "mm2": "allow"}, [("x", "mm"), ("mm", "mm2")],
              inputs=["x"], outputs=["mm", "mm2"])
    plan = plan_precision(g, RULES)
    to_high = [c for c in plan.casts if c.value == "mm:out"]
    assert len(to_high) == 1 and to_high[0].to is H and to_high[0].consumers == ("out:mm",)


def test_deny_propagates_through_gray_and_clear():
    # exp → reshape → add → mm: reshape and add are on a deny → gray path ⇒ high.
    g = build({"exp": "deny", "reshape": "clear", "add": "gray", "mm": "allow"},
              [("x", "exp"), ("exp", "reshape"), ("reshape", "add"), ("add", "mm")],
              inputs=["x"], outputs=["mm"])
    plan = plan_precision(g, RULES)
    assert plan.precision("reshape") is H and plan.precision("add") is H
    assert "exp" in plan.decisions["add"].reason


def test_clear_after_deny_before_allow_is_free():
    g = build({"exp": "deny", "reshape": "clear", "mm": "allow"},
              [("x", "exp"), ("exp", "reshape"), ("reshape", "mm")],
              inputs=["x"], outputs=["mm"], sizes={"exp": 64, "reshape": 64})
    plan = plan_precision(g, RULES)
    assert not plan.decisions["reshape"].fixed


def test_unlisted_op_is_kept_high_and_says_so():
    g = build({"mystery": "my::op"}, [("x", "mystery")], inputs=["x"], outputs=["mystery"])
    plan = plan_precision(g, RULES)
    assert plan.precision("mystery") is H
    assert plan.decisions["mystery"].op_class is OpClass.UNLISTED
    assert "no rule list" in plan.decisions["mystery"].reason


def test_keep_fp32_pattern_pins():
    g = build({"mm_a": "allow", "mm_b": "allow"}, [("x", "mm_a"), ("x", "mm_b")], inputs=["x"])
    plan = plan_precision(g, RULES, keep_fp32=["*_b"])
    assert plan.precision("mm_a") is L and plan.precision("mm_b") is H


def test_gray_between_high_stays_high_and_prefers_cheaper_cut():
    # x(64B) → g1 → g2(4B out) → mm: casting g2's small output is cheaper than x.
    g = build({"g1": "gray", "g2": "gray", "mm": "allow"},
              [("x", "g1"), ("g1", "g2"), ("g2", "mm")],
              inputs=["x"], outputs=["mm"], sizes={"x": 64, "g1": 64, "g2": 4})
    plan = plan_precision(g, RULES)
    assert plan.precision("g1") is H and plan.precision("g2") is H
    assert ("g2:out", L) in {(c.value, c.to) for c in plan.casts}


# -- brute force ------------------------------------------------------------------------------

def brute_force_free_reads(g: PrecisionGraph, nxg, fixed: dict) -> set:
    """(value, reader): a promoting reader with another dimensioned input made by a group fixed
    HIGH computes HIGH by type promotion, so running HIGH it reads the value as it comes."""
    free = set()
    for grp in g.groups():
        if not grp.promotes:
            continue
        reads = list(nxg.pred[grp.key])
        for v in reads:
            if any(u != v and g.value(u).anchors and fixed.get(next(iter(nxg.pred[u]))) is H
                   for u in reads):
                free.add((v, grp.key))
    return free


def brute_cast_cost(g: PrecisionGraph, nxg, label: dict, free_reads: set) -> int:
    """Σ_v bytes(v)·|{other dtypes v's readers want}|; a HIGH free reader wants nothing."""
    cost = 0
    for v in g.values():
        have = label[next(iter(nxg.pred[v.key]))]
        wanted = {label[c] for c in nxg.succ[v.key]
                  if not (label[c] is H and (v.key, c) in free_reads)}
        cost += (v.nbytes or 1) * len(wanted - {have})
    return cost


def brute_force_cast_bytes(g: PrecisionGraph, fixed: dict) -> int:
    """Exhaustive optimum of the cast bytes, written apart from the code under test."""
    free = [grp.key for grp in g.groups() if grp.key not in fixed]
    nxg = g.to_networkx()  # an independent view of the same links
    reads = brute_force_free_reads(g, nxg, fixed)
    return min(brute_cast_cost(g, nxg, {**fixed, **dict(zip(free, bits))}, reads)
               for bits in itertools.product((H, L), repeat=len(free)))


def brute_true_cost(g: PrecisionGraph, label: dict) -> int:
    """Cast bytes of a labelling when any HIGH anchor, fixed or not, makes a read free."""
    nxg = g.to_networkx()
    return brute_cast_cost(g, nxg, label, brute_force_free_reads(g, nxg, label))


def brute_force_true_optimum(g: PrecisionGraph, fixed: dict) -> int:
    free = [grp.key for grp in g.groups() if grp.key not in fixed]
    return min(brute_true_cost(g, {**fixed, **dict(zip(free, bits))})
               for bits in itertools.product((H, L), repeat=len(free)))


@st.composite
def random_graphs(draw):
    n = draw(st.integers(2, 9))
    kinds = draw(st.lists(st.sampled_from(["gray", "clear", "allow", "deny"]),
                          min_size=n, max_size=n))
    g = PrecisionGraph()
    n_in = draw(st.integers(1, 2))
    names = []
    for i in range(n_in):
        fixed = draw(st.sampled_from([H, L]))
        g.add_value(f"in{i}", nbytes=draw(st.integers(1, 64)), anchors=draw(st.booleans()))
        g.add_source(f"src{i}", f"in{i}", name=f"src{i}", fixed=fixed)
        names.append(f"in{i}")
    for i, kind in enumerate(kinds):
        k = draw(st.integers(1, min(3, len(names))))
        reads = draw(st.lists(st.sampled_from(names), min_size=1, max_size=k, unique=True))
        g.add_value(f"v{i}", nbytes=draw(st.integers(1, 64)), anchors=draw(st.booleans()))
        g.add_group(GroupInfo(f"n{i}", f"n{i}", f"n{i}", kind, promotes=draw(st.booleans())),
                    inputs=reads, outputs=[f"v{i}"])
        names.append(f"v{i}")
    for v in draw(st.lists(st.sampled_from(names[n_in:]), min_size=1, unique=True)):
        g.add_sink(f"sink:{v}", v, name=f"sink:{v}", fixed=draw(st.sampled_from([H, L])))
    return g


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_plan_matches_brute_force_optimum(g):
    """Exact where anchors are fixed; with free anchors never worse, and its cost is true."""
    plan = plan_precision(g, RULES)
    fixed = {k: d.precision for k, d in plan.decisions.items() if d.fixed}
    fixed_anchor_optimum = brute_force_cast_bytes(g, fixed)
    labels = {k: d.precision for k, d in plan.decisions.items()}
    assert plan.cast_units == brute_true_cost(g, labels)
    if not any(grp.promotes for grp in g.groups()):
        assert plan.cast_units == fixed_anchor_optimum
    assert brute_force_true_optimum(g, fixed) <= plan.cast_units <= fixed_anchor_optimum
    # Each (value, target) appears at most once: casts are shared by consumers.
    keys = [(c.value, c.to) for c in plan.casts]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize("enumerate_up_to", [0, 99])
def test_flow_and_enumeration_agree(monkeypatch, enumerate_up_to):
    """The same region solved by networkx min-cut and by enumeration gives the same labels."""
    from amp_rewrite.core import placement

    g = build({f"g{i}": "gray" for i in range(6)} | {"mm": "allow", "exp": "deny"},
              [("x", "g0"), ("g0", "g1"), ("g1", "g2"), ("g2", "mm"), ("g0", "g3"),
               ("g3", "g4"), ("g4", "g5"), ("g5", "exp"), ("mm", "g4")],
              inputs=["x"], outputs=["exp"], sizes={"g2": 2, "g3": 100})
    monkeypatch.setattr(placement, "ENUMERATE_UP_TO", enumerate_up_to)
    plan = plan_precision(g, RULES)
    assert plan.cast_units == brute_force_cast_bytes(
        g, {k: d.precision for k, d in plan.decisions.items() if d.fixed})


def test_savings_weight_runs_isolated_gray_op_low():
    g = build({"tanh": "gray"}, [("x", "tanh")], inputs=["x"], outputs=["tanh"])
    assert plan_precision(g, RULES).precision("tanh") is H  # no casts at all
    plan = plan_precision(g, RULES, savings_weight=1.0)
    assert plan.precision("tanh") is L and len(plan.casts) == 2  # its traffic pays the casts


def brute_force_energy(g: PrecisionGraph, fixed: dict, beta: float) -> float:
    """Exhaustive min of cast bytes + β·(traffic of groups left high), apart from the code."""
    nxg = g.to_networkx()
    free = [grp.key for grp in g.groups() if grp.key not in fixed]
    traffic = {k: sum((g.value(v).nbytes or 1) for v in (*nxg.pred[k], *nxg.succ[k]))
               for k in free if g.group(k).savings}
    reads = brute_force_free_reads(g, nxg, fixed)
    best = None
    for bits in itertools.product((H, L), repeat=len(free)):
        label = {**fixed, **dict(zip(free, bits))}
        cost = beta * sum(t for k, t in traffic.items() if label[k] is H)
        cost += brute_cast_cost(g, nxg, label, reads)
        best = cost if best is None else min(best, cost)
    return best


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_savings_weight_plan_matches_brute_force(g):
    plan = plan_precision(g, RULES, savings_weight=1.0)
    fixed = {k: d.precision for k, d in plan.decisions.items() if d.fixed}
    nxg = g.to_networkx()
    high_traffic = sum(sum((g.value(v).nbytes or 1) for v in (*nxg.pred[k], *nxg.succ[k]))
                       for k, d in plan.decisions.items()
                       if not d.fixed and d.precision is H and g.group(k).savings)
    assert plan.cast_units + high_traffic == brute_force_energy(g, fixed, 1.0)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_min_cut_matches_brute_force_optimum(g):
    """Every region through the flow network (free reads included), none enumerated."""
    from unittest import mock

    from amp_rewrite.core import placement

    with mock.patch.object(placement, "ENUMERATE_UP_TO", 0):
        plan = plan_precision(g, RULES)
    fixed = {k: d.precision for k, d in plan.decisions.items() if d.fixed}
    assert plan.cast_units == brute_force_cast_bytes(g, fixed)


# -- free reads (type promotion) -----------------------------------------------------------

def layer_scale_block(*, promotes: bool, scale_anchors: bool = True) -> PrecisionGraph:
    """ConvNeXt's ``h + layer_scale * mm(x)``: x low, h an fp32 input, layer_scale an fp32
    parameter, mul and add promoting (as torch's are; ONNX's are not)."""
    g = PrecisionGraph()
    for name, size, precision in (("x", 64, L), ("h", 64, H), ("scale", 16, H)):
        g.add_value(f"{name}:out", nbytes=size, anchors=name != "scale" or scale_anchors)
        g.add_source(name, f"{name}:out", name=name, fixed=precision)
    for name, op, reads in (("mm", "allow", ["x"]), ("mul", "gray", ["scale", "mm"]),
                            ("add", "gray", ["h", "mul"])):
        g.add_value(f"{name}:out", nbytes=64)
        g.add_group(GroupInfo(name, name, name, op, promotes=promotes and name != "mm"),
                    inputs=[f"{r}:out" for r in reads], outputs=[f"{name}:out"])
    g.add_sink("out", "add:out", name="out", fixed=H)
    return g


def test_layer_scale_promotes_for_free():
    # Hand count. Without promotion the best is mul, add HIGH with mm's output cast up
    # (64 B; mul LOW would cast the scale, 16 B, and then mul's or h's output, 64 B more).
    plan = plan_precision(layer_scale_block(promotes=False), RULES)
    assert plan.cast_units == 64 and [(c.value, c.to) for c in plan.casts] == [("mm:out", H)]
    # With it, mul HIGH reads mm's low output as it comes (the scale promotes it): no cast.
    plan = plan_precision(layer_scale_block(promotes=True), RULES)
    assert plan.precision("mul") is H and plan.precision("add") is H
    assert plan.casts == () and plan.cast_units == 0


def test_zero_dim_scale_does_not_promote():
    # A 0-dim fp32 tensor does not promote a dimensioned fp16 one, so mul HIGH would pay the
    # 64 B upcast again; mul LOW casts the 16 B scale, and the residual add, promoted by h,
    # reads mul's low output for free.
    plan = plan_precision(layer_scale_block(promotes=True, scale_anchors=False), RULES)
    assert plan.precision("mul") is L and plan.precision("add") is H
    assert plan.cast_units == 16 and [(c.value, c.to) for c in plan.casts] == [("scale:out", L)]


def test_free_read_needs_a_fixed_anchor_and_a_high_reader():
    # mul feeds a GEMM: running it LOW casts the 16 B scale, HIGH would cast its 64 B output
    # down; the free read only helps a HIGH reader, so mul stays LOW.
    g = build({"mm": "allow", "mul": "gray", "mm2": "allow"},
              [("x", "mm"), ("scale", "mul"), ("mm", "mul"), ("mul", "mm2")],
              low_inputs=["x"], inputs=["scale"], sizes={"scale": 2, "mm": 64, "mul": 64})
    g2 = PrecisionGraph()  # the same with mul promoting
    for v in g.values():
        g2.add_value(v.key, nbytes=v.nbytes)
    for grp in g.groups():
        g2.add_group(grp._replace(promotes=grp.key == "mul"), inputs=g.inputs(grp.key),
                     outputs=g.outputs(grp.key))
    for graph in (g, g2):
        plan = plan_precision(graph, RULES)
        assert plan.precision("mul") is L
        assert [(c.value, c.to) for c in plan.casts] == [("scale:out", L)]


def test_group_without_values_gets_a_precision():
    g = PrecisionGraph()
    g.add_group(GroupInfo("lonely", "lonely", "lonely", "gray"))
    assert plan_precision(g, RULES).precision("lonely") is L


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs(), st.randoms(use_true_random=False))
def test_constrained_regions_are_the_components_with_a_high_neighbour(g, rnd):
    """Against networkx's connected components of the free groups and their values, in the
    order a scan of all values meets them (the canonical form numbers groups in that order)."""
    import networkx as nx

    from amp_rewrite.core import placement

    keys = [grp.key for grp in g.groups()]
    labels = {k: rnd.choice([H, L]) for k in keys if rnd.random() < 0.4}
    free = [k for k in keys if k not in labels]
    ends = {v.key: [e for e in (g.producer(v.key), *g.consumers(v.key)) if e is not None]
            for v in g.values()}
    links = nx.Graph()
    links.add_nodes_from(("g", k) for k in free)
    links.add_edges_from((("g", e), ("v", v)) for v, es in ends.items() for e in es
                         if e not in labels)
    expected = []
    for part in nx.connected_components(links):
        values = [v for v in ends if ("v", v) in part]  # graph order
        if values and any(labels.get(e) is H for v in values for e in ends[v]):
            groups = dict.fromkeys(e for v in values for e in ends[v] if e not in labels)
            expected.append((tuple(groups), tuple(values)))
    found = [(r.groups, r.values) for r in placement.constrained_regions(g, labels)]
    assert sorted(found, key=repr) == sorted(expected, key=repr)
