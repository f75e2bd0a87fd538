"""Schema-aware port groups: which ports of an ONNX node must share a dtype, and may go low.

DESIGN §2: the unit of painting is the (node, type variable) pair. We read the node's schema
from ``onnx.defs`` at the model's opset, bind each actual input/output to its formal parameter
(variadic parameters take the rest), and group floating ports by type variable. Type variables
of one node are then merged into one group, because runtime kernels are registered for tied
types (ORT's fp16 BatchNormalization takes fp16 scale and mean) — except for ops whose type
variables are independent by design (Cast, EyeLike, ...), and statistics outputs that runtimes
keep in fp32 (LayerNormalization's ``U``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from amp_rewrite.core import LowDtype

# Ops whose output type comes from an attribute; their type variables are independent.
RETYPE_ATTRIBUTE = {
    "Cast": "to", "EyeLike": "dtype", "RandomNormalLike": "dtype", "RandomUniformLike": "dtype",
    "Bernoulli": "dtype", "RandomNormal": "dtype", "RandomUniform": "dtype",
    "ConstantOfShape": "value",
}
INDEPENDENT_TYPE_VARS = {"CastLike", *RETYPE_ATTRIBUTE}
# Type variables that ORT/TensorRT kernels only implement in fp32 whatever the data type.
HIGH_TYPE_VARS = {
    ("", "LayerNormalization"): {"U": "runtimes keep LayerNorm statistics (U) in fp32"},
    ("com.microsoft", "SkipLayerNormalization"): {"U": "statistics outputs stay fp32 in ORT"},
    ("com.microsoft", "SimplifiedLayerNormalization"): {"U": "statistics stay fp32 in ORT"},
}
CONTROL_FLOW = {"If", "Loop", "Scan"}


@dataclass(frozen=True)
class PortGroup:
    """Candidate (float32 or target-dtype) ports of one node that must share a dtype."""

    tvars: tuple[str, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    fixed_reason: str | None  # why the group cannot run low; None if it may
    retype_attribute: str | None = None  # attribute that sets the output dtype, if any
    # False for the converted input of Cast, CastLike, EyeLike, ...: the op converts whatever
    # it reads, so reading it low saves nothing that a Cast in front would not cost again.
    saves_traffic: bool = True

    @functools.cached_property  # port groups are cached and shared: computed once
    def label(self) -> str:
        return "" if self.tvars == ("*",) else ",".join(self.tvars)


def is_candidate(value: ir.Value | None, low: ir.DataType) -> bool:
    """A plain tensor of float32 or of the target low dtype."""
    if value is None or not isinstance(value.type, ir.TensorType):
        return False
    return value.dtype in (ir.DataType.FLOAT, low)


@functools.lru_cache(maxsize=4096)
def _schema(domain: str, op_type: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        # onnxruntime's contrib ops (fused norms, GELUs, attention) have their schemas in
        # onnxruntime's registry: their type variables are bound like a standard op's.
        from amp_rewrite.onnx.fusion.schemas import runtime_schema

        return runtime_schema(domain, op_type, opset)


def node_opset(node: ir.Node, opsets: dict[str, int]) -> int:
    return node.version or opsets.get(node.domain, opsets.get("", 1))


def _port_signature(v: ir.Value | None) -> object:
    if v is None:
        return None
    t = v.type
    if t is None:
        return "untyped" if v.name else None
    return t.dtype if isinstance(t, ir.TensorType) else "other"


_CACHE: dict[tuple, tuple[PortGroup, ...]] = {}


def port_groups(node: ir.Node, opset: int, low: LowDtype) -> tuple[PortGroup, ...]:
    """Group the node's candidate ports; see module docstring.

    The answer depends only on the op, opset and the ports' types, so it is cached by that
    signature: large models repeat a few dozen signatures thousands of times.
    """
    key = (node.domain, node.op_type, opset, low,
           tuple(map(_port_signature, node.inputs)), tuple(map(_port_signature, node.outputs)))
    cached = _CACHE.get(key)
    if cached is None:
        cached = _CACHE[key] = tuple(_port_groups(node, opset, low))
    return cached


def _port_groups(node: ir.Node, opset: int, low: LowDtype) -> list[PortGroup]:
    low_ir = to_ir_dtype(low)
    ins = [i for i, v in enumerate(node.inputs) if is_candidate(v, low_ir)]
    outs = [i for i, v in enumerate(node.outputs) if is_candidate(v, low_ir)]
    if not ins and not outs:
        return []
    if node.op_type in CONTROL_FLOW and node.domain == "":
        return [PortGroup(("*",), tuple(ins), tuple(outs),
                          "control-flow boundary keeps its dtype; its body is rewritten")]
    if any(v.type is None for v in node.outputs if v.name):
        return [PortGroup(("*",), tuple(ins), tuple(outs),
                          "an output's type is unknown after shape inference")]
    if _has_non_tensor_port(node):
        return [PortGroup(("*",), tuple(ins), tuple(outs),
                          "sequence/optional element types are not rewritten")]
    schema = _schema(node.domain, node.op_type, opset)
    if schema is None:  # contrib or custom op: the rules decide for all its ports together
        return [PortGroup(("*",), tuple(ins), tuple(outs), None)]
    by_tvar = _bind(schema, ins, outs)
    return _merge(node, schema, by_tvar, low)


def _has_non_tensor_port(node: ir.Node) -> bool:
    values = [v for v in (*node.inputs, *node.outputs) if v is not None and v.type is not None]
    return any(not isinstance(v.type, ir.TensorType) for v in values)


def _bind(schema, ins: list[int], outs: list[int]) -> dict[str, tuple[list[int], list[int]]]:
    by_tvar: dict[str, tuple[list[int], list[int]]] = {}
    for side, indices, params in ((0, ins, schema.inputs), (1, outs, schema.outputs)):
        for i in indices:
            param = params[min(i, len(params) - 1)]
            by_tvar.setdefault(param.type_str, ([], []))[side].append(i)
    return by_tvar


def _merge(node: ir.Node, schema, by_tvar, low: LowDtype) -> list[PortGroup]:
    constraints = {tc.type_param_str: tc.allowed_type_strs for tc in schema.type_constraints}
    high_policy = HIGH_TYPE_VARS.get((node.domain, node.op_type), {})
    # Type variables the model already gives different dtypes are left independent.
    independent = node.op_type in INDEPENDENT_TYPE_VARS or len(
        {_current_dtype(node, ins, outs) for ins, outs in by_tvar.values()}) > 1
    merged: dict[object, list] = {}
    for tvar, (ins, outs) in by_tvar.items():
        reason = _fixed_reason(node, tvar, constraints, high_policy, ins, low)
        attr = RETYPE_ATTRIBUTE.get(node.op_type) if not ins else None
        key = (tvar,) if independent or reason else ("merged",)
        slot = merged.setdefault(key, [[], [], [], reason, attr])
        slot[0].append(tvar), slot[1].extend(ins), slot[2].extend(outs)
    converts = node.op_type in INDEPENDENT_TYPE_VARS
    return [PortGroup(tuple(t), tuple(sorted(i)), tuple(sorted(o)), r, a,
                      saves_traffic=not (converts and not o))
            for t, i, o, r, a in merged.values()]


def _current_dtype(node: ir.Node, ins: list[int], outs: list[int]) -> frozenset:
    return frozenset([node.inputs[i].dtype for i in ins] + [node.outputs[o].dtype for o in outs])


def _fixed_reason(node, tvar: str, constraints, high_policy, ins, low: LowDtype) -> str | None:
    if tvar in high_policy:
        return high_policy[tvar]
    allowed = constraints.get(tvar)
    if allowed is None:  # a concrete type such as tensor(float)
        return f"the {node.op_type} schema fixes this port to {tvar}"
    if f"tensor({low.value})" not in allowed:
        return f"{node.op_type}'s {tvar} does not admit {low.value} at this opset"
    if not ins and node.op_type not in RETYPE_ATTRIBUTE:
        return f"{node.op_type}'s output type {tvar} cannot be retyped"
    return None


def to_ir_dtype(low: LowDtype) -> ir.DataType:
    return ir.DataType.FLOAT16 if low is LowDtype.FLOAT16 else ir.DataType.BFLOAT16


def infer_output_dtypes(node: ir.Node, opset: int) -> bool:
    """Give untyped outputs the dtype their schema ties to a typed input (or attribute).

    A cheap, dtype-only stand-in for ONNX shape inference, which serialises the whole model
    (weights included) and costs seconds and gigabytes on large models. Returns False when an
    output stays unknown.
    """
    untyped = [(i, v) for i, v in enumerate(node.outputs) if v.name and v.type is None]
    if not untyped:
        return True
    schema = _schema(node.domain, node.op_type, opset)
    if schema is None:
        return False
    bound = _bound_input_dtypes(node, schema)
    allowed = {tc.type_param_str: tc.allowed_type_strs for tc in schema.type_constraints}
    done = True
    for i, value in untyped:
        param = schema.outputs[min(i, len(schema.outputs) - 1)]
        if any(not t.startswith("tensor(") for t in allowed.get(param.type_str, ())):
            done = False  # may be a sequence or optional: leave it to shape inference
            continue
        dtype = (bound.get(param.type_str) or _concrete(param.type_str)
                 or _from_attribute(node) or _statistics_dtype(allowed.get(param.type_str)))
        if dtype is None:
            done = False
        else:
            value.dtype = dtype
    return done


def _bound_input_dtypes(node: ir.Node, schema) -> dict[str, ir.DataType]:
    bound = {}
    for i, value in enumerate(node.inputs):
        if value is not None and isinstance(value.type, ir.TensorType) and schema.inputs:
            bound.setdefault(schema.inputs[min(i, len(schema.inputs) - 1)].type_str, value.dtype)
    return bound


def _statistics_dtype(allowed) -> ir.DataType | None:
    """An output-only type variable that admits one type has that type (Shape's ``T1``); one
    limited to float/double (LayerNormalization's and the contrib norms' mean and
    inv_std_var ``U``) is float32, the default stash_type."""
    if allowed and len(allowed) == 1:
        return _concrete(allowed[0])
    if allowed and "tensor(float)" in allowed and set(allowed) <= {"tensor(float)",
                                                                 "tensor(double)"}:
        return ir.DataType.FLOAT
    return None


def _concrete(type_str: str) -> ir.DataType | None:
    if type_str.startswith("tensor(") and type_str.endswith(")"):
        name = type_str[7:-1].upper()
        return {"FLOAT": ir.DataType.FLOAT, "INT64": ir.DataType.INT64,
                "BOOL": ir.DataType.BOOL, "INT32": ir.DataType.INT32}.get(name)
    return None


def _from_attribute(node: ir.Node) -> ir.DataType | None:
    name = RETYPE_ATTRIBUTE.get(node.op_type) or ("value" if node.op_type == "Constant" else None)
    attr = node.attributes.get(name) if name else None
    if attr is None:
        # ConstantOfShape and RandomNormal/Uniform default to float32
        return ir.DataType.FLOAT if node.op_type in (
            "ConstantOfShape", "RandomNormal", "RandomUniform") else None
    if attr.type == ir.AttributeType.TENSOR:
        return attr.value.dtype
    return ir.DataType(attr.value) if attr.type == ir.AttributeType.INT else None
