"""Repairs of inputs that runtimes run but the ONNX checker rejects: graph outputs without a
type get the type shape inference recovers, and nothing else of its value_info.

Cases: an output inference types fully gets element type and shape; an output inference
gives an element type but no shape (an If whose branches agree on float32 but return [1] and
[]) gets the element type with the shape left unset, which runtimes accept and the checker
does not (``shape_placeholders`` checks the rest of such a model); an output inference gives
no element type is not repaired.
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator

import onnx

logger = logging.getLogger(__name__)


def _graph_pairs(a: onnx.GraphProto, b: onnx.GraphProto
                 ) -> Iterator[tuple[onnx.GraphProto, onnx.GraphProto]]:
    """The same graphs of two structurally identical models, subgraphs included."""
    yield a, b
    for na, nb in zip(a.node, b.node):
        for aa, ab in zip(na.attribute, nb.attribute):
            if aa.HasField("g"):
                yield from _graph_pairs(aa.g, ab.g)
            for ga, gb in zip(aa.graphs, ab.graphs):
                yield from _graph_pairs(ga, gb)


def _lacks_type(value: onnx.ValueInfoProto) -> bool:
    """No type, an empty one, or a tensor type without its element type or its shape field
    (the checker requires both of graph outputs; onnxruntime infers them)."""
    if not value.HasField("type") or value.type.WhichOneof("value") is None:
        return True
    if value.type.WhichOneof("value") != "tensor_type":
        return False
    tensor = value.type.tensor_type
    return not tensor.elem_type or not tensor.HasField("shape")


def _has_element_type(value: onnx.ValueInfoProto) -> bool:
    """Typed as far as runtimes need: a tensor with its element type, or any other type."""
    kind = value.type.WhichOneof("value") if value.HasField("type") else None
    if kind != "tensor_type":
        return kind is not None
    return bool(value.type.tensor_type.elem_type)


def untyped_outputs(proto: onnx.ModelProto) -> int:
    return sum(1 for g, _ in _graph_pairs(proto.graph, proto.graph)
               for o in g.output if _lacks_type(o))


def untyped_main_outputs(graph: onnx.GraphProto) -> bool:
    """Some output of the main graph lacks its type (no walk of the nodes: cheap)."""
    return any(_lacks_type(o) for o in graph.output)


def first_untyped_output(proto: onnx.ModelProto) -> str | None:
    return next((o.name for g, _ in _graph_pairs(proto.graph, proto.graph)
                 for o in g.output if _lacks_type(o)), None)


def _drop_empty_value_info(graph: onnx.GraphProto) -> None:
    """value_info entries with an empty type describe nothing (and stop inference)."""
    keep = [v for v in graph.value_info if v.type.WhichOneof("value") is not None]
    if len(keep) != len(graph.value_info):
        del graph.value_info[:]
        graph.value_info.extend(keep)


def fill_output_types(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``proto`` whose untyped graph outputs carry their inferred types, or None
    when there is nothing to fill or inference cannot type them all."""
    if not untyped_outputs(proto):
        return None
    repaired = onnx.ModelProto()
    repaired.CopyFrom(proto)
    for g, _ in _graph_pairs(repaired.graph, repaired.graph):
        _drop_empty_value_info(g)
    try:
        inferred = onnx.shape_inference.infer_shapes(repaired)
    except Exception as e:  # inference errors are the checker's to report
        logger.info("shape inference could not repair the model: %s", e)
        return None
    filled = 0
    for g, gi in _graph_pairs(repaired.graph, inferred.graph):
        for out, inferred_out in zip(g.output, gi.output):
            if _lacks_type(out) and _has_element_type(inferred_out):
                out.type.CopyFrom(inferred_out.type)
                filled += 1
    if not all(_has_element_type(o) for g, _ in _graph_pairs(repaired.graph, repaired.graph)
               for o in g.output):
        return None
    shapeless = shapeless_outputs(repaired.graph)
    logger.warning("the input leaves %d graph output(s) untyped, which the ONNX checker "
                   "rejects; typed them from shape inference%s", filled,
                   f" ({', '.join(sorted(shapeless))} with no shape: inference finds none, "
                   "as for an If whose branches differ in rank)" if shapeless else "")
    return repaired


def shapeless_outputs(graph: onnx.GraphProto) -> set[str]:
    """Main-graph tensor outputs with an element type and no shape field: what
    ``fill_output_types`` leaves where inference finds no shape."""
    return {o.name for o in graph.output
            if o.type.WhichOneof("value") == "tensor_type" and o.type.tensor_type.elem_type
            and not o.type.tensor_type.HasField("shape")}


@contextlib.contextmanager
def shape_placeholders(proto: onnx.ModelProto, names: Collection[str]) -> Iterator[None]:
    """While checking, the main-graph outputs ``names`` that lack a shape field carry an
    empty one: the checker requires the field of every graph output, but no shape is right
    for a value whose rank depends on the input, and the rest of the model still deserves
    the check. The model is as it was afterwards."""
    placed = [o for o in proto.graph.output
              if o.name in names and o.type.WhichOneof("value") == "tensor_type"
              and not o.type.tensor_type.HasField("shape")]
    for out in placed:
        out.type.tensor_type.shape.SetInParent()
    try:
        yield
    finally:
        for out in placed:
            out.type.tensor_type.ClearField("shape")
