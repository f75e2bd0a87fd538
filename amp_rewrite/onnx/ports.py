"""Schema-aware port groups: which ports of an ONNX node must share a dtype, and may go low.

docs/design.md §3: the unit of painting is the (node, type variable) pair, bound from the node's
``onnx.defs`` schema at the model's opset. A node's type variables are merged into one group,
as runtime kernels are registered for tied types, except for ops whose type variables are
independent by design (Cast, EyeLike, ...) and statistics outputs runtimes keep in fp32.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from amp_rewrite.core import LowDtype
from amp_rewrite.core.precision import Label

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
NOT_ADMITTED = "does not admit"


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
    # Fixed high only because the schema at this opset does not admit the low dtype (a
    # newer opset would): counted for the "re-run with --opset N" advice.
    opset_limited: bool = False

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


def signature(node: ir.Node, opset: int, low: LowDtype) -> tuple:
    """What ``port_groups`` depends on: the op, its opset and its ports' types (dtypes)."""
    return (node.domain, node.op_type, opset, low,
            tuple(map(_port_signature, node.inputs)), tuple(map(_port_signature, node.outputs)))


def port_groups(node: ir.Node, opset: int, low: LowDtype) -> list[PortGroup]:
    """Group the node's candidate ports (module docstring); the view caches the groups by
    ``signature``."""
    low_ir = to_ir_dtype(low)
    ins = [i for i, v in enumerate(node.inputs) if is_candidate(v, low_ir)]
    outs = [i for i, v in enumerate(node.outputs) if is_candidate(v, low_ir)]
    if not ins and not outs:
        return []
    if node.op_type in CONTROL_FLOW and node.domain == "":
        # Only where ``control_flow_ties`` cannot pair the ports with the bodies' boundary:
        # each port keeps its own dtype (a Scan may carry fp32 state beside fp16 inputs).
        why = "control-flow port keeps its dtype (its body boundary could not be paired)"
        return [*(PortGroup(("*",), (i,), (), why) for i in ins),
                *(PortGroup(("*",), (), (o,), why) for o in outs)]
    if any(v is not None and v.name and v.type is None for v in (*node.inputs, *node.outputs)):
        # Retyping the typed ports would contradict the untyped ones' real dtype.
        return [PortGroup(("*",), tuple(ins), tuple(outs),
                          "a port's type is unknown after shape inference")]
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
                      saves_traffic=not (converts and not o),
                      opset_limited=bool(r) and NOT_ADMITTED in r)
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
        return f"{node.op_type}'s {tvar} {NOT_ADMITTED} {low.value} at this opset"
    if not ins and node.op_type not in RETYPE_ATTRIBUTE:
        return f"{node.op_type}'s output type {tvar} cannot be retyped"
    return None


def to_ir_dtype(low: LowDtype) -> ir.DataType:
    return ir.DataType.FLOAT16 if low is LowDtype.FLOAT16 else ir.DataType.BFLOAT16


def infer_output_dtypes(node: ir.Node, opset: int) -> bool:
    """Give untyped outputs the dtype their schema ties to a typed input (or attribute): a
    cheap, dtype-only stand-in for shape inference. False when an output stays unknown."""
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


def body_graphs(node: ir.Node) -> list[ir.Graph]:
    """The subgraphs held by the node's attributes (If branches, Loop/Scan bodies)."""
    bodies = []
    for attr in node.attributes.values():
        if attr.type == ir.AttributeType.GRAPH:
            bodies.append(attr.value)
        elif attr.type == ir.AttributeType.GRAPHS:
            bodies.extend(attr.value)
    return bodies


def body_input_sources(node: ir.Node, opset: int) -> list[ir.Value | None]:
    """For each input of a Loop/Scan body, the outer value whose dtype it takes (or None).

    Loop's body reads (iteration, condition, carried...) for the node's (M, cond, carried...);
    Scan's (state..., scan elements...) for the node's inputs, after ``sequence_lens`` at
    opset 8. If branches have no inputs.
    """
    if node.domain != "" or node.op_type not in ("Loop", "Scan"):
        return []
    if node.op_type == "Loop":
        return [None, None, *node.inputs[2:]]
    return list(node.inputs[1:] if opset < 9 else node.inputs)


def body_output_slots(node: ir.Node, body: ir.Graph) -> list[tuple[ir.Value, ir.Value]]:
    """(node output, body output) pairs that carry the same dtype."""
    if node.domain != "" or node.op_type not in CONTROL_FLOW:
        return []
    skip = 1 if node.op_type == "Loop" else 0  # a Loop body returns its condition first
    return list(zip(node.outputs, body.outputs[skip:]))


def type_body_inputs(node: ir.Node, opset: int) -> None:
    """Give untyped Loop/Scan body inputs the dtype of the outer value that feeds them.

    Exporters (and onnx's own opset-27 expanded tests) leave body inputs untyped; the checker
    infers them, so an output that retyped a body without typing them would contradict it.
    """
    sources = body_input_sources(node, opset)
    for body in body_graphs(node):
        for inner, outer in zip(body.inputs, sources):
            if inner.type is None and outer is not None and isinstance(outer.type, ir.TensorType):
                inner.dtype = outer.dtype
        if node.op_type == "Loop" and len(body.inputs) >= 2:
            for inner, dtype in zip(body.inputs[:2], (ir.DataType.INT64, ir.DataType.BOOL)):
                if inner.type is None:
                    inner.dtype = dtype


def type_outputs_from_bodies(node: ir.Node) -> None:
    """Untyped outputs of a control-flow node take the dtype of the body output they return."""
    for body in body_graphs(node):
        for outer, inner in body_output_slots(node, body):
            if outer.type is None and isinstance(inner.type, ir.TensorType):
                outer.dtype = inner.dtype


@dataclass(frozen=True)
class Tie:
    """Ports of a control-flow node and of its bodies that carry one value, so one dtype:
    a Scan state is the node's input, the body's input, the body's output and the node's
    output. Reads are node inputs and body outputs; writes are body inputs and node outputs.
    """

    inputs: tuple[int, ...]
    body_outputs: tuple[tuple[ir.Graph, int], ...]
    body_inputs: tuple[ir.Value, ...]
    outputs: tuple[int, ...]
    fixed_reason: str | None

    def reads(self, node: ir.Node) -> list[ir.Value]:
        return [node.inputs[i] for i in self.inputs] + [g.outputs[k] for g, k in self.body_outputs]

    def writes(self, node: ir.Node) -> list[ir.Value]:
        return [*self.body_inputs, *(node.outputs[o] for o in self.outputs)]


def control_flow_ties(node: ir.Node, opset: int, low: LowDtype) -> list[Tie] | None:
    """The ties of an If/Loop/Scan node, or None where its ports cannot all be paired with a
    body boundary of the same float dtype (then ``port_groups`` keeps each port as it is)."""
    slots = _tie_slots(node, opset)
    if slots is None:
        return None
    low_ir = to_ir_dtype(low)
    schema = _schema("", node.op_type, opset)
    admits = schema is not None and any(
        tc.type_param_str == "V" and f"tensor({low.value})" in tc.allowed_type_strs
        for tc in schema.type_constraints)
    reason = None if admits else f"{node.op_type}'s V does not admit {low.value} at this opset"
    ties = []
    for ins, bouts, bins, outs in slots:
        tie = Tie(tuple(ins), tuple(bouts), tuple(bins), tuple(outs), reason)
        values = tie.reads(node) + tie.writes(node)
        candidates = [v for v in values if is_candidate(v, low_ir)]
        if not candidates:
            continue
        if len(candidates) != len(values) or len({v.dtype for v in candidates}) > 1:
            return None
        ties.append(tie)
    return ties


def _tie_slots(node: ir.Node, opset: int) -> list[tuple] | None:
    """(node inputs, body outputs, body inputs, node outputs) per carried value."""
    if node.domain != "" or node.op_type not in CONTROL_FLOW:
        return None
    attrs = node.attributes
    if node.op_type == "If":
        then, other = attrs["then_branch"].value, attrs["else_branch"].value
        n = len(node.outputs)
        if len(then.outputs) != n or len(other.outputs) != n:
            return None
        return [((), ((then, i), (other, i)), (), (i,)) for i in range(n)]
    body = attrs["body"].value
    if node.op_type == "Loop":
        carried = len(node.inputs) - 2
        scanned = len(node.outputs) - carried
        if len(body.inputs) != carried + 2 or len(body.outputs) != 1 + carried + scanned:
            return None
        return [*(((2 + j,), ((body, 1 + j),), (body.inputs[2 + j],), (j,))
                  for j in range(carried)),
                *(((), ((body, 1 + carried + k),), (), (carried + k,)) for k in range(scanned))]
    if opset < 9 or "num_scan_inputs" not in attrs:
        return None  # opset-8 Scan: batched, with sequence_lens first
    scan_in = attrs["num_scan_inputs"].value
    state = len(node.inputs) - scan_in
    scan_out = len(node.outputs) - state
    if len(body.inputs) != state + scan_in or len(body.outputs) != state + scan_out:
        return None
    return [*(((j,), ((body, j),), (body.inputs[j],), (j,)) for j in range(state)),
            *(((state + m,), (), (body.inputs[state + m],), ()) for m in range(scan_in)),
            *(((), ((body, state + k),), (), (state + k,)) for k in range(scan_out))]


def first_opset_admitting(domain: str, op_type: str, low: LowDtype, after: int) -> int | None:
    """The first opset after ``after`` whose schema of the op admits ``low`` for its first
    input's type variable (where Conv, BatchNormalization, LSTM gained bf16: 22)."""
    for opset in range(after + 1, onnx.defs.onnx_opset_version() + 1):
        schema = _schema(domain, op_type, opset)
        if schema is None or not schema.inputs:
            continue
        tvar = schema.inputs[0].type_str
        allowed = {tc.type_param_str: tc.allowed_type_strs for tc in schema.type_constraints}
        if f"tensor({low.value})" in allowed.get(tvar, ()):
            return opset
    return None


_LABEL_TYPES = ((Label.FP16, "tensor(float16)"), (Label.BF16, "tensor(bfloat16)"))


@functools.lru_cache(maxsize=4096)
def admitted_labels(domain: str, op_type: str, opset: int,
                    tvars: tuple[str, ...]) -> frozenset[Label]:
    """The dtypes a port group's type variables all admit at ``opset`` (fp32 always): what
    a mixed plan may give the group: Conv at opset 18 takes fp16 or fp32, not bf16 (a mixed
    plan converts the opset first only where an op needing range would lack bf16,
    ``api._low_dtype_opset``). An op without a schema here (a custom op) is left to the
    rules: every dtype."""
    schema = _schema(domain, op_type, opset)
    if schema is None or tvars == ("*",):
        return frozenset(Label)
    allowed = {tc.type_param_str: tc.allowed_type_strs for tc in schema.type_constraints}
    admitted = {Label.FP32}
    for label, type_str in _LABEL_TYPES:
        if all(type_str in allowed.get(t, (type_str,)) for t in tvars):
            admitted.add(label)
    return frozenset(admitted)
