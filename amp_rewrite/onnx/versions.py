"""IR and opset versions of the output: loadable by the installed runtime, no newer than needed.

``make_model`` may stamp an IR version the runtime refuses although nothing needs it; the IR a
model needs follows from its opset imports and element types (decision 0013).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

import onnx
import onnx_ir as ir

from amp_rewrite.errors import ModelError, UsageError, first_line
from amp_rewrite.onnx.load import model_graphs

logger = logging.getLogger(__name__)
# Below IR 7 the format differs in ways not visible from opsets or dtypes (IR < 4 wants
# initializers listed as inputs, ...): a model is never lowered below min(its own, 7).
SAFE_FLOOR = 7
_FLOAT8 = {ir.DataType.FLOAT8E4M3FN, ir.DataType.FLOAT8E4M3FNUZ, ir.DataType.FLOAT8E5M2,
           ir.DataType.FLOAT8E5M2FNUZ}
_INT4 = {ir.DataType.UINT4, ir.DataType.INT4}
_KNOWN_DTYPES_IR = 11  # dtypes up to FLOAT4E2M1; anything newer keeps the model's IR


def dtype_ir_version(dtypes: set[ir.DataType]) -> int | None:
    """The IR version the element types need; None when one is too new to know."""
    need = 3
    for dtype in dtypes:
        if dtype in _FLOAT8:
            need = max(need, 9)
        elif dtype in _INT4:
            need = max(need, 10)
        elif dtype == ir.DataType.FLOAT4E2M1:
            need = max(need, _KNOWN_DTYPES_IR)
        elif int(dtype) > int(ir.DataType.FLOAT4E2M1):
            return None
    return need


def _model_dtypes(model: ir.Model, flat: bool) -> set[ir.DataType]:
    dtypes = set()
    for g in model_graphs(model, flat):
        values = [*g.inputs, *g.initializers.values()]
        for n in g:  # one walk for outputs and Cast targets
            values.extend(n.outputs)
            if n.op_type == "Cast" and "to" in n.attributes:
                dtypes.add(ir.DataType(n.attributes["to"].value))
        dtypes.update(v.dtype for v in values if v.dtype is not None)
    return dtypes


def lowest_ir_version(model: ir.Model, flat: bool = False) -> int:
    """The lowest IR version ``model``'s opsets and element types allow, never below
    min(the model's own, SAFE_FLOOR); the model's own where a feature is too new to judge.
    ``flat``: the model has no subgraph (``LoadInfo.flat``)."""
    own = model.ir_version
    opsets = [onnx.helper.make_opsetid(d, v) for d, v in model.opset_imports.items()]
    try:
        by_opset = onnx.helper.find_min_ir_version_for(opsets, ignore_unknown=True)
    except ValueError:  # an ai.onnx opset newer than this onnx knows
        return own
    if own <= max(by_opset, SAFE_FLOOR):
        return max(own, by_opset)  # nothing to lower: skip the scan of every value's dtype
    by_dtype = dtype_ir_version(_model_dtypes(model, flat))
    if by_dtype is None:
        return own
    need = max(by_opset, by_dtype)
    return max(need, min(own, max(need, SAFE_FLOOR)))


def set_lowest_ir_version(model: ir.Model, flat: bool = False) -> bool:
    """Lower (or raise, where a conversion needs it) ``model.ir_version``; True if changed."""
    target = lowest_ir_version(model, flat)
    if target == model.ir_version:
        return False
    logger.info("IR version %d -> %d (the lowest the model's opsets and types allow)",
                model.ir_version, target)
    model.ir_version = target
    return True


def loadable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with the lowest IR version it allows (a copy where that differs): an FP32
    baseline made by onnx 1.23's make_model (IR 14) loads in onnxruntime 1.31 this way."""
    model = ir.from_proto(proto)
    target = lowest_ir_version(model)
    if target == proto.ir_version:
        return proto
    lowered = onnx.ModelProto()
    lowered.CopyFrom(proto)
    lowered.ir_version = target
    return lowered


def convert_opset(model: ir.Model, target: int) -> ir.Model:
    """``model`` converted to ai.onnx opset ``target`` with onnx's version converter.

    A model already at ``target`` comes back as is; converting down is refused (ops the
    target lacks would have to be rewritten, which the converter does not do reliably).
    """
    current = model.opset_imports.get("", None)
    if current is None or current == target:
        return model
    if target < current:
        raise UsageError(f"--opset {target}: the model is at opset {current}; only upgrades "
                         "are supported")
    if target > onnx.defs.onnx_opset_version():
        raise UsageError(f"--opset {target}: this onnx knows opsets up to "
                         f"{onnx.defs.onnx_opset_version()}")
    from onnx import version_converter

    proto = _serialised_for_conversion(model, current, target)
    try:
        converted = version_converter.convert_version(proto, target)
    except Exception as e:  # the converter raises RuntimeError/ValueError/ConvertError
        raise ModelError(f"cannot convert the model from opset {current} to {target}: "
                         f"{first_line(e)}; "
                         "convert it yourself or leave --opset out") from None
    logger.info("converted opset %d -> %d", current, target)
    return ir.from_proto(converted)


def _serialised_for_conversion(model: ir.Model, current: int, target: int
                               ) -> onnx.ModelProto:
    """The converter works on a ModelProto: a model onnx_ir cannot serialise (damaged
    tensors, text it cannot escape) is a ModelError naming the cause, which the bf16 opset
    conversion answers by keeping the opset."""
    from amp_rewrite.onnx import save

    try:
        return save.serialised(model)
    except Exception as e:  # onnx_ir wraps every serialiser error in a SerdeError chain
        cause = _innermost(e)
        raise ModelError(f"cannot convert the model from opset {current} to {target}: it "
                         f"cannot be serialised ({type(cause).__name__}: {first_line(cause)})"
                         ) from e


def _innermost(error: BaseException) -> BaseException:
    """The root of an exception chain: onnx_ir's SerdeError says only which object failed."""
    while error.__cause__ is not None:
        error = error.__cause__
    return error


def _admits(op_type: str, opset: int, low_type: str) -> bool | None:
    """Whether ai.onnx ``op_type`` at ``opset`` admits ``low_type`` ("tensor(bfloat16)") for
    its first input's type variable; None for ops without such a schema."""
    try:
        schema = onnx.defs.get_schema(op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    if not schema.inputs:
        return None
    allowed = {tc.type_param_str: tc.allowed_type_strs for tc in schema.type_constraints}
    types = allowed.get(schema.inputs[0].type_str)
    if types is None or not any(t.startswith("tensor(float") for t in types):
        return None  # not a float op (Shape, Range's ints, ...)
    return low_type in types


def low_dtype_opset(opset: int, op_types: set[str], low_type: str = "tensor(bfloat16)",
                    compute: Callable[[str], bool] = lambda op: True,
                    ) -> tuple[int, list[str]] | None:
    """(the opset to convert to, the ops that need it) when float ``compute`` ops of the
    model do not admit ``low_type`` at ai.onnx ``opset`` but do at a later one this onnx
    knows (bf16: Conv, BatchNormalization, pooling, LSTM, ... gained it in opset 22)."""
    latest = onnx.defs.onnx_opset_version()
    needed, target = [], opset
    for op in sorted(op_types):
        if not compute(op) or _admits(op, opset, low_type) is not False:
            continue
        first = next((v for v in range(opset + 1, latest + 1) if _admits(op, v, low_type)), None)
        if first is not None:
            needed.append(op)
            target = max(target, first)
    return (target, needed) if needed else None


def default_domain_op_types(model: ir.Model, flat: bool = False) -> set[str]:
    """The ai.onnx op types of the model's graphs (subgraphs included)."""
    return {n.op_type for g in model_graphs(model, flat) for n in g if n.domain in ("", "ai.onnx")}


def ai_onnx_opset(opset_imports: Mapping[str, int]) -> int | None:
    return opset_imports.get("", opset_imports.get("ai.onnx"))
