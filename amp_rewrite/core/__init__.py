"""Framework-neutral planning core: rules, precision graph, constraints, min-cut placement.

Nothing here imports torch or onnx; adapters build a PrecisionGraph and apply the plans.
"""
from amp_rewrite.core.graph import GroupInfo, PrecisionGraph, ValueInfo
from amp_rewrite.core.padding import (PadGraph, PaddingPlan, PadPolicy, padding_report,
                                      plan_padding)
from amp_rewrite.core.plan import CastPlan, Decision, PrecisionPlan, explain_chain, plan_precision
from amp_rewrite.core.precision import LowDtype, OpClass, Precision
from amp_rewrite.core.rules import RuleEntry, RuleSet, load_rules, parse_rule_file

__all__ = [
    "CastPlan", "Decision", "GroupInfo", "LowDtype", "OpClass", "PadGraph", "PadPolicy",
    "PaddingPlan", "Precision", "PrecisionGraph",
    "PrecisionPlan", "RuleEntry", "RuleSet", "ValueInfo", "explain_chain", "load_rules",
    "padding_report", "parse_rule_file", "plan_padding", "plan_precision",
]
