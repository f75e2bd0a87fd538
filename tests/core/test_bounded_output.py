"""``[bounded_output]``: a deny op whose output is bounded starts no deny propagation.

Expected plans are derived by hand in each test's comment, and checked against the brute-force
optimum of ``test_placement`` for the same fixes.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from amp_rewrite.core import OpClass, RuleEntry, RuleSet, load_rules, plan_precision
from amp_rewrite.core.rules import BoundedEntry, parse_bounded_output
from amp_rewrite.errors import RuleFileError
from tests.core.test_placement import RULES, H, L, brute_force_cast_bytes, build, random_graphs

# "cos": deny with a bounded output; "deny" stays unbounded.
BOUNDED_RULES = RuleSet([*RULES.entries(), RuleEntry("cos", OpClass.DENY, "test cos", "test")],
                        [BoundedEntry("cos", "test: |cos| <= 1", "test")])
UNBOUNDED_RULES = RuleSet(BOUNDED_RULES.entries())


def rotary():
    """pos → ang(gray) → cos(deny, bounded) → unsq(clear) → rot(gray, ·q) → add(gray, +q) → mm.

    q comes from an allow MatMul; q-sized values are 256 bytes, angle-sized ones 64.
    """
    return build({"mm_q": "allow", "ang": "gray", "cos": "cos", "unsq": "clear",
                  "rot": "gray", "add": "gray", "mm": "allow"},
                 [("x", "mm_q"), ("pos", "ang"), ("ang", "cos"), ("cos", "unsq"),
                  ("unsq", "rot"), ("mm_q", "rot"), ("rot", "add"), ("mm_q", "add"),
                  ("add", "mm")],
                 inputs=["x", "pos"], outputs=["mm"],
                 sizes={"x": 256, "pos": 64, "ang": 64, "cos": 64, "unsq": 64, "mm_q": 256,
                        "rot": 256, "add": 256, "mm": 256})


def fixed_of(plan):
    return {k: d.precision for k, d in plan.decisions.items() if d.fixed}


def test_unbounded_deny_forces_the_rotary_high():
    # Without the entry: unsq, rot, add lie on cos → clear/gray → gray paths ⇒ high, so q
    # (256) is cast up and add's output (256) back down: x↓ + q↑ + add↓ + mm↑ = 4 × 256.
    plan = plan_precision(rotary(), UNBOUNDED_RULES)
    assert [plan.precision(k) for k in ("unsq", "rot", "add")] == [H, H, H]
    assert plan.cast_units == 4 * 256


def test_bounded_deny_output_leaves_readers_to_the_min_cut():
    # With it: cos and its input stay high (ang: running it low costs a cast of pos and one
    # of its own output, running it high nothing); unsq, rot, add are free and the cheapest
    # cut casts cos's 64-byte output once: x↓ + cos↓ + mm↑ = 256 + 64 + 256.
    plan = plan_precision(rotary(), BOUNDED_RULES)
    assert plan.precision("cos") is H and plan.decisions["cos"].fixed
    assert plan.precision("ang") is H
    assert [plan.precision(k) for k in ("unsq", "rot", "add")] == [L, L, L]
    assert not any(plan.decisions[k].fixed for k in ("unsq", "rot", "add"))
    assert sorted((c.value, c.to) for c in plan.casts) == [
        ("cos:out", L), ("mm:out", H), ("x:out", L)]
    assert plan.cast_units == 256 + 64 + 256 == brute_force_cast_bytes(rotary(), fixed_of(plan))


def test_bounded_deny_still_ends_a_path_from_another_deny():
    # exp → add → cos: add carries exp's output into a deny op ⇒ high, bounded or not.
    g = build({"exp": "deny", "add": "gray", "cos": "cos", "neg": "gray", "mm": "allow"},
              [("x", "exp"), ("exp", "add"), ("add", "cos"), ("cos", "neg"), ("neg", "mm")],
              inputs=["x"], outputs=["mm"])
    plan = plan_precision(g, BOUNDED_RULES)
    assert plan.precision("add") is H and plan.decisions["add"].fixed
    assert not plan.decisions["neg"].fixed  # after cos: free


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(random_graphs())
def test_bounded_output_only_frees_groups_and_never_costs_casts(g):
    """Marking every deny op bounded fixes a subset of the groups, and the plan stays the
    brute-force optimum for its fixes, so with fixed anchors it never casts more."""
    bounded_rules = RuleSet(RULES.entries(), [BoundedEntry("deny", "test", "test")])
    before, after = plan_precision(g, RULES), plan_precision(g, bounded_rules)
    assert set(fixed_of(after)) <= set(fixed_of(before))
    assert after.cast_units == brute_force_cast_bytes(g, fixed_of(after)) or any(
        grp.promotes for grp in g.groups())
    if not any(grp.promotes for grp in g.groups()):
        assert after.cast_units <= before.cast_units


# -- rule files -------------------------------------------------------------------------------

def test_packaged_rules_bound_sin_and_cos():
    rules = load_rules("onnx", env={})
    assert rules.has_bounded_output("Cos") and rules.has_bounded_output("Sin")
    assert not rules.has_bounded_output("Exp")
    assert rules.class_of("Cos") is OpClass.DENY  # bounded is not a class


def test_overlay_and_env_add_and_remove_bounded_ops(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('schema = 1\n[bounded_output]\n"my::Squash" = "output in [0, 1]"\n')
    env = {"AMP_REWRITE_BOUNDED_OUTPUT_ADD": "Tan", "AMP_REWRITE_BOUNDED_OUTPUT_REMOVE": "Sin"}
    rules = load_rules("onnx", [path], env=env)
    assert rules.has_bounded_output("my::Squash") and rules.has_bounded_output("Tan")
    assert not rules.has_bounded_output("Sin") and rules.has_bounded_output("Cos")
    sources = {e.op: e.source for e in rules.bounded_entries()}
    assert sources["my::Squash"] == str(path)
    assert sources["Tan"] == "$AMP_REWRITE_BOUNDED_OUTPUT_ADD"
    assert rules.class_of("Sin") is OpClass.DENY  # removing the bound keeps the class


def test_bounded_output_variables_are_known():
    from amp_rewrite.core.rules import known_env_vars

    assert {"AMP_REWRITE_BOUNDED_OUTPUT_ADD", "AMP_REWRITE_BOUNDED_OUTPUT_REMOVE"} <= set(
        known_env_vars())


@pytest.mark.parametrize("text, needle", [
    ('schema = 1\n[bounded_output]\nCos = ""\n', "non-empty reason"),
    ('schema = 1\nbounded_output = ["Cos"]\n', "must be a table"),
])
def test_malformed_bounded_output_names_file_and_key(tmp_path, text, needle):
    path = tmp_path / "r.toml"
    path.write_text(text)
    with pytest.raises(RuleFileError) as info:
        parse_bounded_output(path)
    assert needle in str(info.value) and str(path) in str(info.value)

