"""rules/onnx.toml: file format, coverage of every floating-point ONNX op, no typos, key classes.

The file is parsed with tomllib here, not through amp_rewrite.core.rules, so that a loader bug
cannot hide a broken rule file. The oracle for coverage and typos is onnx.defs (every opset of
the default domain) and, for contrib ops, onnxruntime's own schema registry.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import onnx.defs
import pytest
from onnx.defs import OpSchema

RULES_PATH = Path(__file__).resolve().parents[2] / "rules" / "onnx.toml"
CLASSES = ("allow", "deny", "gray", "clear")
CONTRIB = "com.microsoft"

# com.microsoft ops the rule file must classify (ORT transformer-optimizer output).
REQUIRED_CONTRIB = frozenset({
    "Gelu", "FastGelu", "BiasGelu", "SkipLayerNormalization", "Attention", "MultiHeadAttention",
})
# Further com.microsoft ops common in ORT-optimised transformer, LLM and diffusion models.
OPTIONAL_CONTRIB = frozenset({
    "SkipSimplifiedLayerNormalization", "RotaryEmbedding", "GroupQueryAttention", "BiasAdd",
    "QuickGelu", "FusedMatMul", "EmbedLayerNormalization", "TransposeMatMul", "FusedGemm",
    "FusedConv", "GemmFastGelu", "MatMulNBits", "BiasSplitGelu", "BiasSoftmax", "GroupNorm",
    "SkipGroupNorm", "PackedAttention", "PackedMultiHeadAttention",
    "DecoderMaskedMultiHeadAttention", "SparseAttention",
})
# ORT contrib ops that ORT registers in the default ONNX domain: their keys carry no prefix.
ORT_DEFAULT_DOMAIN = frozenset({"SimplifiedLayerNormalization"})
# Ops added after opset 21 (onnx 1.16, the oldest onnx pyproject.toml accepts) -> first opset.
# An older onnx does not know them; that must not read as a typo in the rule file.
NEWER_OPS = {
    "Attention": 23, "RMSNormalization": 23, "RotaryEmbedding": 23, "Swish": 24,
    "TensorScatter": 24, "BitCast": 26, "CumProd": 26, "CausalConvWithState": 27,
    "LinearAttention": 27, "SwiGLU": 28,
}
OLDEST_SUPPORTED_OPSET = 21

# float8/float4 types are not compute dtypes for this pass; '\)' keeps them from matching.
_FLOAT_TYPE = re.compile(r"tensor\((?:float16|float|bfloat16|double)\)")


def has_float_port(schema: OpSchema) -> bool:
    """Whether any input/output admits float16/float/bfloat16/double (also inside seq/optional)."""
    allowed = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
    ports = [*schema.inputs, *schema.outputs]
    return any(_FLOAT_TYPE.search(t) for p in ports for t in allowed.get(p.type_str, [p.type_str]))


def default_domain_schemas() -> list[OpSchema]:
    return [s for s in onnx.defs.get_all_schemas_with_history() if s.domain in ("", "ai.onnx")]


def first_opsets() -> dict[str, int]:
    first: dict[str, int] = {}
    for s in default_domain_schemas():
        first[s.name] = min(first.get(s.name, s.since_version), s.since_version)
    return first


@pytest.fixture(scope="module")
def rules() -> dict:
    with RULES_PATH.open("rb") as f:
        return tomllib.load(f)


@pytest.fixture(scope="module")
def op_class(rules: dict) -> dict[str, str]:
    """op key -> class; test_no_op_in_two_classes guards against silent overwrites here."""
    return {op: cls for cls in CLASSES for op in rules.get(cls, {})}


# (1) format ---------------------------------------------------------------------------------

def test_schema_is_1_and_only_the_four_class_tables_bounded_output_and_range(rules):
    assert rules.get("schema") == 1
    assert set(rules) == {"schema", *CLASSES, "bounded_output", "range"}
    assert all(isinstance(rules[cls], dict) and rules[cls] for cls in CLASSES)


def test_range_ops_are_onnx_ops_of_a_rule_class_with_a_reason(rules, op_class):
    """[range] changes only mixed plans: each entry is a listed op and says why bf16 holds it."""
    assert rules["range"]
    for op, reason in rules["range"].items():
        assert op in op_class and isinstance(reason, str) and "bf16" in reason, op


def test_bounded_output_ops_are_deny_ops_with_a_reason(rules, op_class):
    """Only a deny op's bounded output changes a plan; each entry says why it is bounded."""
    bounded = rules["bounded_output"]
    assert {op_class.get(op) for op in bounded} == {"deny"}
    assert {"Sin", "Cos"} <= set(bounded)
    assert all(isinstance(r, str) and r.strip() and "\n" not in r for r in bounded.values())


def test_every_reason_is_a_nonempty_single_line(rules):
    bad = [f"[{cls}] {op} = {reason!r}" for cls in CLASSES for op, reason in rules[cls].items()
           if not isinstance(reason, str) or not reason.strip() or "\n" in reason]
    assert not bad, f"reasons must be non-empty one-line strings: {bad}"


def test_no_op_in_two_classes(rules):
    seen: dict[str, list[str]] = {}
    for cls in CLASSES:
        for op in rules[cls]:
            seen.setdefault(op, []).append(cls)
    twice = {op: classes for op, classes in seen.items() if len(classes) > 1}
    assert not twice, f"ops in more than one class: {twice}"


# (2) coverage -------------------------------------------------------------------------------

@pytest.mark.parametrize(("op", "expected"), [
    ("MatMul", True), ("Shape", True), ("SequenceAt", True), ("OptionalGetElement", True),
    ("NonMaxSuppression", True), ("SequenceEmpty", True),
    ("And", False), ("MatMulInteger", False), ("StringNormalizer", False), ("BitShift", False),
])
def test_float_port_detection_on_real_schemas(op, expected):
    # Shape: float only on the input; SequenceAt: seq(tensor(float)); OptionalGetElement:
    # optional(tensor(float)); NonMaxSuppression: literal tensor(float) ports, no type variable.
    assert has_float_port(onnx.defs.get_schema(op)) is expected


def test_float8_only_ports_do_not_count_as_float():
    schema = OpSchema("Fp8Only", "test.amp_rewrite", 1,
                      inputs=[OpSchema.FormalParameter("x", "T")],
                      outputs=[OpSchema.FormalParameter("y", "T")],
                      type_constraints=[("T", ["tensor(float8e4m3fn)", "tensor(int8)"], "")])
    assert not has_float_port(schema)


def test_every_onnx_op_with_a_float_port_has_a_class(op_class):
    float_ops = {s.name for s in default_domain_schemas() if has_float_port(s)}
    assert len(float_ops) > 150, "onnx.defs returned implausibly few floating-point ops"
    missing = sorted(float_ops - set(op_class))
    assert not missing, f"rules/onnx.toml: ONNX ops with a floating-point port but no class: {missing}"


def test_required_contrib_ops_have_a_class(op_class):
    wanted = {f"{CONTRIB}::{op}" for op in REQUIRED_CONTRIB} | ORT_DEFAULT_DOMAIN
    missing = sorted(wanted - set(op_class))
    assert not missing, f"rules/onnx.toml: contrib ops without a class: {missing}"


# (3) typos ----------------------------------------------------------------------------------

def _is_known_key(key: str, onnx_ops: set[str], opset: int) -> bool:
    domain, sep, op = key.rpartition("::")
    if sep:
        return domain == CONTRIB and op in REQUIRED_CONTRIB | OPTIONAL_CONTRIB
    return op in onnx_ops or op in ORT_DEFAULT_DOMAIN or NEWER_OPS.get(op, 0) > opset


def test_every_entry_is_a_known_op(op_class):
    onnx_ops = {s.name for s in default_domain_schemas()}
    opset = onnx.defs.onnx_opset_version()
    unknown = sorted(k for k in op_class if not _is_known_key(k, onnx_ops, opset))
    assert not unknown, f"rules/onnx.toml: neither an ONNX op nor a listed contrib op: {unknown}"


def test_newer_ops_table_matches_installed_onnx():
    first = first_opsets()
    opset = onnx.defs.onnx_opset_version()
    known_newer = {op: v for op, v in NEWER_OPS.items() if v <= opset}
    actual_newer = {op: v for op, v in first.items() if v > OLDEST_SUPPORTED_OPSET}
    assert known_newer == actual_newer


def test_contrib_lists_exist_in_onnxruntime():
    ort_state = pytest.importorskip("onnxruntime.capi.onnxruntime_pybind11_state")
    get_schemas = getattr(ort_state, "get_all_operator_schema", None)
    if get_schemas is None:
        pytest.skip("this onnxruntime build does not expose its operator schemas")
    registered = {(s.domain, s.name) for s in get_schemas()}
    expected = ({(CONTRIB, op) for op in REQUIRED_CONTRIB | OPTIONAL_CONTRIB}
                | {("", op) for op in ORT_DEFAULT_DOMAIN})
    assert not sorted(expected - registered)


def test_unknown_keys_are_caught():
    onnx_ops = {s.name for s in default_domain_schemas()}
    opset = onnx.defs.onnx_opset_version()
    for typo in ("Matmul", "com.microsoft::Gelo", "ai.onnx::MatMul", "com.example::Gelu"):
        assert not _is_known_key(typo, onnx_ops, opset), typo
    assert _is_known_key("MatMul", onnx_ops, opset)
    assert _is_known_key("com.microsoft::Gelu", onnx_ops, opset)


# (4) hand-picked expectations ---------------------------------------------------------------

@pytest.mark.parametrize(("op", "cls"), [
    ("MatMul", "allow"), ("Gemm", "allow"), ("Conv", "allow"), ("ConvTranspose", "allow"),
    ("com.microsoft::Attention", "allow"), ("com.microsoft::MultiHeadAttention", "allow"),
    ("Exp", "deny"), ("Log", "deny"), ("Pow", "deny"), ("ReduceSum", "deny"),
    ("ReduceSumSquare", "deny"), ("ReduceLogSumExp", "deny"), ("ReduceProd", "deny"),
    ("CumSum", "deny"), ("SoftmaxCrossEntropyLoss", "deny"), ("NegativeLogLikelihoodLoss", "deny"),
    ("Add", "gray"), ("Mul", "gray"), ("Sub", "gray"), ("Softmax", "gray"),
    ("LayerNormalization", "gray"), ("com.microsoft::SkipLayerNormalization", "gray"),
    ("Reshape", "clear"), ("Transpose", "clear"), ("Slice", "clear"), ("Concat", "clear"),
    ("Gather", "clear"), ("Relu", "clear"), ("Cast", "clear"), ("If", "clear"),
])
def test_hand_picked_classes(op_class, op, cls):
    assert op_class.get(op) == cls
