"""Schemas of onnxruntime's contrib ops, for port typing and the ONNX checker.

``onnx.defs`` knows only the standard domains; :func:`runtime_schema` reads a contrib schema
from onnxruntime's registry in the shape ``ports`` reads ``onnx.defs`` schemas, so a fused
node's ports get the same treatment as a standard op's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import onnx


@dataclass(frozen=True)
class Param:
    name: str
    type_str: str


@dataclass(frozen=True)
class Constraint:
    type_param_str: str
    allowed_type_strs: tuple[str, ...]


@dataclass(frozen=True)
class RuntimeSchema:
    """The parts of an onnxruntime contrib-op schema that ``ports`` reads."""

    domain: str
    name: str
    since_version: int
    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    type_constraints: tuple[Constraint, ...]


@functools.cache
def _runtime_registry() -> dict[tuple[str, str], tuple[RuntimeSchema, ...]]:
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_c

    registry: dict[tuple[str, str], list[RuntimeSchema]] = {}
    for s in ort_c.get_all_operator_schema():
        if s.domain not in ("com.microsoft", ""):
            continue
        schema = RuntimeSchema(
            s.domain, s.name, s.since_version,
            tuple(Param(p.name, p.typeStr) for p in s.inputs),
            tuple(Param(p.name, p.typeStr) for p in s.outputs),
            tuple(Constraint(c.type_param_str, tuple(c.allowed_type_strs))
                  for c in s.type_constraints))
        registry.setdefault((s.domain, s.name), []).append(schema)
    return {k: tuple(sorted(v, key=lambda x: x.since_version)) for k, v in registry.items()}


def runtime_schema(domain: str, op_type: str, opset: int) -> RuntimeSchema | None:
    """onnxruntime's schema of a contrib op at ``opset`` (None if it has none)."""
    domain = "" if domain == "ai.onnx" else domain
    schemas = _runtime_registry().get((domain, op_type), ())  # by ascending since_version
    return next((s for s in reversed(schemas) if s.since_version <= opset), None)


@functools.cache
def register_default_domain_contrib_ops() -> None:
    """Make the ONNX checker accept ORT's default-domain ``SimplifiedLayerNormalization``
    (its RMSNorm, unknown to ``onnx.defs``) by registering ORT's signature."""
    try:
        onnx.defs.get_schema("SimplifiedLayerNormalization", 1, "")
        return
    except onnx.defs.SchemaError:
        pass
    op = onnx.defs.OpSchema
    floats = ["tensor(float)", "tensor(double)", "tensor(float16)", "tensor(bfloat16)"]
    schema = op(
        "SimplifiedLayerNormalization", "", 1,
        doc="onnxruntime contrib op: RMS normalisation (statistics in stash_type)",
        inputs=[op.FormalParameter("X", "T"), op.FormalParameter("scale", "V")],
        outputs=[op.FormalParameter("Y", "V"),
                 op.FormalParameter("inv_std_var", "U",
                                    param_option=op.FormalParameterOption.Optional)],
        type_constraints=[("T", floats, ""), ("V", floats, ""),
                          ("U", ["tensor(float)", "tensor(double)"], "")],
        attributes=[op.Attribute("axis", op.AttrType.INT, "", required=False),
                    op.Attribute("epsilon", op.AttrType.FLOAT, "", required=False),
                    op.Attribute("stash_type", op.AttrType.INT, "", required=False)],
    )
    onnx.defs.register_schema(schema)
