"""What a mixed plan (``--dtype mixed``, core/multilabel.py) needs from the ONNX view.

The view of a mixed plan is built for fp16 (``OnnxView.mixed``): fp16 is what every group
takes unless its range is short. From it come, once per view, ``plan_mixed``'s arguments:
the dtypes each group's schema admits at the model's opset (no opset conversion: a Conv at
opset 18 takes fp16 or fp32), the dtypes the adapter fixed, the constants fp16 cannot hold
and those bf16 cannot hold either, and the groups that need range because calibration saw
their values beyond the fp16 threshold (producers and readers, as calibration pins groups
in a two-label plan: decision 0012). The report's FLOP shares are counted here too.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import onnx_ir as ir

from amp_rewrite.core import LowDtype, Precision
from amp_rewrite.core.precision import Label
from amp_rewrite.onnx.kernels import lacks_bf16_kernel
from amp_rewrite.onnx.load import SYMBOLIC_DIM_EXTENT, model_graphs
from amp_rewrite.onnx.ports import admitted_labels, node_opset
from amp_rewrite.onnx.view import OnnxView, constant_range_problems, range_problem

_LABELS = {ir.DataType.FLOAT: Label.FP32, ir.DataType.FLOAT16: Label.FP16,
           ir.DataType.BFLOAT16: Label.BF16}


@dataclass(frozen=True)
class MixedInputs:
    """``plan_mixed``'s arguments that come from the view (module docstring)."""

    admissible: Mapping[Hashable, frozenset[Label]] = field(default_factory=dict)
    adapter_dtypes: Mapping[Hashable, Label] = field(default_factory=dict)
    fp16_wide_values: Mapping[ir.Value, str] = field(default_factory=dict)
    wide_values: Mapping[ir.Value, str] = field(default_factory=dict)
    range_groups: Mapping[Hashable, str] = field(default_factory=dict)
    pins: Mapping[Hashable, str] = field(default_factory=dict)  # constants beyond bf16


def mixed_inputs(view: OnnxView, hot_values: Mapping[str, float]) -> MixedInputs:
    """``MixedInputs`` of ``view``; ``hot_values``: value name → the max |x| calibration saw,
    above the fp16 threshold and within bf16's."""
    wide, beyond_bf16 = _wide_constants(view)
    range_groups = {key: f"calibration saw {why}: beyond fp16's range"
                    for key, why in hot_groups(view, hot_values).items()}
    sources = {("source", v): why for v, why in wide.items()}
    range_groups.update({k: f"{why}: stored bf16" for k, why in sources.items()
                         if k[1] not in beyond_bf16})
    pins = {k: f"{why}: beyond bf16's range too, kept fp32" for k, why in sources.items()
            if k[1] in beyond_bf16}
    return MixedInputs(admissible(view), adapter_dtypes(view), wide, beyond_bf16,
                       range_groups, pins)


def range_op_types(model: ir.Model, hot_values: Mapping[str, float], rules,
                   flat: bool = False) -> set[str]:
    """The ai.onnx op types a mixed plan may want bf16 for range: of nodes that write or read
    a value calibration saw beyond fp16's threshold (``hot_values``), that read a constant
    fp16 cannot hold, or that a ``[range]`` rule names. Only their bf16 kernels decide
    whether the model's opset must be converted for a mixed plan (``api._low_dtype_opset``):
    a model that needs no range keeps its opset."""
    graphs = model_graphs(model, flat)
    wide = constant_range_problems(graphs, LowDtype.FLOAT16).keys()
    found = set()
    for graph in graphs:
        for node in graph:
            if node.domain not in ("", "ai.onnx") or node.op_type in found:
                continue
            values = [v for v in (*node.inputs, *node.outputs) if v is not None]
            if (rules.needs_range(node.op_type) or any(v in wide for v in values)
                    or any(v.name in hot_values for v in values)):
                found.add(node.op_type)
    return found


# Cast admits bfloat16 from ai.onnx opset 13: below it no bf16 value can enter the graph
CAST_BF16_OPSET = 13


def bf16_casts_admitted(opsets: Mapping[str, int]) -> bool:
    """Whether the model's ai.onnx opset lets a Cast write bfloat16 (a custom op without a
    schema would otherwise be free to take bf16 at an opset whose casts cannot feed it)."""
    return opsets.get("", opsets.get("ai.onnx", CAST_BF16_OPSET)) >= CAST_BF16_OPSET


def admissible(view: OnnxView) -> dict[Hashable, frozenset[Label]]:
    """Group → the dtypes its schema admits at the model's opset, where that is not all;
    without bf16 where onnxruntime's CUDA provider has no bf16 kernel for it
    (``OnnxView.cuda_bf16_only``), and for every group below ``CAST_BF16_OPSET``."""
    found = {}
    groups = [(key, node, pg.tvars) for key, (node, pg) in view.groups.items()]
    groups += [(key, node, ("V",)) for key, (node, _) in view.ties.items()]
    casts_bf16 = bf16_casts_admitted(view.opsets)
    for key, node, tvars in groups:
        opset = node_opset(node, view.opsets)
        labels = admitted_labels(node.domain, node.op_type, opset, tvars)
        if not casts_bf16 or (view.cuda_bf16_only
                              and lacks_bf16_kernel(node.domain, node.op_type, opset)):
            labels = labels - {Label.BF16}
        if len(labels) < len(Label):
            found[key] = labels
    return found


def adapter_dtypes(view: OnnxView) -> dict[Hashable, Label]:
    """Groups the adapter fixed low (kept graph I/O, values low in the model) → the dtype
    of their ports; groups fixed high are fp32 anyway."""
    graph = view.graph
    fixed = {}
    for group in graph.groups():
        if group.fixed is not Precision.LOW:
            continue
        values = [*graph.outputs(group.key), *graph.inputs(group.key)]
        label = next((_LABELS[v.dtype] for v in values
                      if v.dtype in _LABELS and v.dtype != ir.DataType.FLOAT), None)
        if label is not None:
            fixed[group.key] = label
    return fixed


def _wide_constants(view: OnnxView) -> tuple[dict[ir.Value, str], dict[ir.Value, str]]:
    """(constants fp16 cannot hold → why: the view's range screen against fp16, those of
    them bf16 cannot hold either → why)."""
    beyond_bf16 = {}
    for key, (_, value, node) in view.sources.items():
        if value not in view.wide_values:
            continue
        array = _constant_array(value, node)
        problem = None if array is None else range_problem(array, LowDtype.BFLOAT16)
        if problem:
            beyond_bf16[value] = f"{value.name or 'a constant'} ({problem})"
    return dict(view.wide_values), beyond_bf16


def _constant_array(value: ir.Value, node: ir.Node | None):
    try:
        if node is not None:
            return node.attributes["value"].value.numpy()
        return value.const_value.numpy() if value.const_value is not None else None
    except Exception:  # noqa: BLE001 - malformed data: left to the conversion to report
        return None


def hot_groups(view: OnnxView, hot: Mapping[str, float]) -> dict[Hashable, str]:
    """Groups that produce or read a value named in ``hot`` (value name → max |x| seen),
    and graph outputs that return one → what was seen: a producer run in the dtype
    overflows, and so does a reader through its Cast to it (decision 0012)."""
    found: dict[Hashable, str] = {}
    if not hot:
        return found
    groups = [(k, node.outputs, pg.outputs, node.inputs, pg.inputs)
              for k, (node, pg) in view.groups.items()]
    groups += [(k, node.outputs, tie.outputs, node.inputs, tie.inputs)
               for k, (node, tie) in view.ties.items()]
    for key, outputs, out_ports, inputs, in_ports in groups:
        why = _hot_port(hot, outputs, out_ports, "its output") or _hot_port(
            hot, inputs, in_ports, "its input")
        if why:
            found[key] = why
    for key, (g, index) in view.sinks.items():
        name = g.outputs[index].name
        if name in hot:
            found[key] = f"|{name}| up to {hot[name]:.4g} (graph output)"
    return found


def _hot_port(hot: Mapping[str, float], values, ports, role: str) -> str | None:
    for i in ports:
        name = values[i].name
        if name in hot:
            return f"|{name}| up to {hot[name]:.4g} ({role})"
    return None


def group_flops(view: OnnxView, inferred: Mapping[str, int | None] | None = None
                ) -> dict[Hashable, float]:
    """FLOPs of each node (``core.flops`` through ``budget.node_flops``) from its values'
    shapes (symbolic dims as ``load.SYMBOLIC_DIM_EXTENT``; a value without one by its size
    from load-time shape inference, ``inferred``), on the group that writes its first output
    (else its first group): a node's FLOPs count once, in its dtype."""
    from amp_rewrite.onnx.budget import node_flops

    inferred = inferred or {}
    flops: dict[Hashable, float] = {}
    counted: set[int] = set()
    ordered = sorted(view.groups.items(), key=lambda item: 0 not in item[1][1].outputs)
    for key, (node, _) in ordered:
        if id(node) in counted:
            continue
        counted.add(id(node))
        inputs = [_shape(v, inferred) for v in node.inputs]
        if node.op_type in ("MatMul", "Gemm", "FusedMatMul") and len(inputs) > 1:
            inputs[0] = _gemm_a_shape(node, inputs[0], inputs[1])
        flops[key] = node_flops(node.op_type, inputs,
                                [_shape(v, inferred) for v in node.outputs])
    return flops


def _gemm_a_shape(node: ir.Node, a, b):
    """A GEMM's first operand's shape, or where only its size is known, its reduced dim
    from the second operand (a weight has a shape): all ``core.flops`` reads of it."""
    if a is None or len(a) != 1 or b is None or len(b) < 2:
        return a
    trans_b = node.op_type == "Gemm" and "transB" in node.attributes and \
        node.attributes["transB"].as_int()
    return (b[-1] if trans_b else b[-2],)


def _shape(value: ir.Value | None, inferred: Mapping[str, int | None]
           ) -> tuple[int, ...] | None:
    """The value's shape; a value without one as a flat shape of its inferred size."""
    if value is None:
        return None
    if value.shape is None:
        nbytes = inferred.get(value.name)
        return (nbytes // 4,) if nbytes else None
    return tuple(d if isinstance(d, int) else SYMBOLIC_DIM_EXTENT for d in value.shape.dims)
