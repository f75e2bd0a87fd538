"""The mixed plan the adapters apply (``core/multilabel.plan_mixed``): the rules' ``[range]``
table, kernel admissibility, and the PrecisionPlan form (labels on decisions and casts)."""
from amp_rewrite.core import Precision, RuleEntry, RuleSet
from amp_rewrite.core.multilabel import plan_mixed
from amp_rewrite.core.precision import Label, OpClass
from amp_rewrite.core.rules import BoundedEntry

from tests.core.test_placement import build

F16, B16, F32 = Label.FP16, Label.BF16, Label.FP32
CLASSES = {"allow": OpClass.ALLOW, "gray": OpClass.GRAY, "deny": OpClass.DENY,
           "ranged": OpClass.DENY}
RULES = RuleSet([RuleEntry(op, c, f"test {op}", "test") for op, c in CLASSES.items()],
                range_ops=[BoundedEntry("ranged", "a sum: range, not mantissa", "test")])


def _chain():
    # x → mm(allow) → sq(ranged deny) → add(gray) → exp(deny) → out, 4 bytes per value
    return build({"mm": "allow", "sq": "ranged", "add": "gray", "exp": "deny"},
                 [("x", "mm"), ("mm", "sq"), ("sq", "add"), ("add", "exp")],
                 inputs=["x"], outputs=["exp"])


def test_a_range_op_runs_bf16_and_starts_no_deny_propagation():
    plan = plan_mixed(_chain(), RULES)
    labels = {k: plan.label(k, F16) for k in ("mm", "sq", "add", "exp")}
    # mm fp16 (allow), sq bf16 by [range], add follows sq (bf16: no cast), exp fp32 (deny)
    assert labels == {"mm": F16, "sq": B16, "add": B16, "exp": F32}
    assert plan.decisions["sq"].reason.startswith("range: a sum")
    assert plan.decisions["sq"].precision is Precision.LOW
    # casts by hand: x→fp16 (4), mm's fp16 out→bf16 (4), add's bf16 out→fp32 (4)
    assert plan.cast_units == 12
    assert sorted((c.value, plan.cast_label(c, F16)) for c in plan.casts) == [
        ("add:out", F32), ("mm:out", B16), ("x:out", F16)]
    assert plan.solver["status"] == "OPTIMAL" and plan.solver["gap"] == 0
    assert plan.solver["two_step_cast_bytes"] >= plan.cast_units


def test_without_the_range_entry_the_same_op_is_deny_and_its_readers_fp32():
    rules = RuleSet([RuleEntry(op, c, f"test {op}", "test") for op, c in CLASSES.items()])
    plan = plan_mixed(_chain(), rules)
    assert [plan.label(k, F16) for k in ("mm", "sq", "add", "exp")] == [F16, F32, F32, F32]


def test_a_kernel_without_bf16_keeps_a_range_op_fp32_with_the_reason():
    plan = plan_mixed(_chain(), RULES, admissible={"sq": frozenset({F16, F32})})
    assert plan.label("sq", F16) is F32
    assert "takes no bfloat16" in plan.decisions["sq"].reason


def test_fp16_wide_values_send_their_reader_to_bf16_not_fp32():
    # add (gray) reads c, which fp16 cannot hold (|c| up to 70000), and feeds a [range] op.
    # By hand (4 bytes a value, add's output 400): add bf16 casts x→fp16, mm→bf16, c→bf16
    # and the range op's output →fp32 = 16 bytes; add fp32 would cast add's 400-byte output
    # to bf16 instead of c: 412 bytes.
    g = build({"mm": "allow", "add": "gray", "sum": "ranged"},
              [("x", "mm"), ("mm", "add"), ("c", "add"), ("add", "sum")],
              inputs=["x", "c"], outputs=["sum"], sizes={"add": 400})
    plan = plan_mixed(g, RULES, fp16_wide_values={"c:out": "|c| up to 70000"})
    assert [plan.label(k, F16) for k in ("mm", "add", "sum")] == [F16, B16, B16]
    assert "70000" in plan.decisions["add"].reason
    assert "runs bf16, not fp16" in plan.decisions["add"].reason
    assert plan.cast_units == 16


def test_the_mixed_report_section_counts_cast_bytes_per_dtype_pair_and_flop_shares():
    from amp_rewrite.core.report import mixed_summary, node_records

    g = _chain()
    plan = plan_mixed(g, RULES)
    # flops by hand: mm 100, sq 10, add 1, exp 1 (of 112)
    section = mixed_summary(plan, g, {"mm": 100.0, "sq": 10.0, "add": 1.0, "exp": 1.0})
    assert section["cast_bytes"] == {"float16->bfloat16": 4, "float32->float16": 4,
                                     "bfloat16->float32": 4}
    assert section["flop_share"] == {"float32": round(1 / 112, 6),
                                     "float16": round(100 / 112, 6),
                                     "bfloat16": round(11 / 112, 6)}
    assert section["solver"]["status"] == "OPTIMAL"
    records = {r["name"]: r["dtype"] for r in node_records(plan, g)}
    assert records == {"mm": "float16", "sq": "bfloat16", "add": "bfloat16", "exp": "float32"}
