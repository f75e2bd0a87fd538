"""Repairs of inputs that runtimes run but the ONNX checker rejects: graph outputs without a
type get the type shape inference recovers, and nothing else of its value_info.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

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


def untyped_outputs(proto: onnx.ModelProto) -> int:
    return sum(1 for g, _ in _graph_pairs(proto.graph, proto.graph)
               for o in g.output if _lacks_type(o))


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
            if _lacks_type(out) and not _lacks_type(inferred_out):
                out.type.CopyFrom(inferred_out.type)
                filled += 1
    if untyped_outputs(repaired):
        return None
    logger.warning("the input leaves %d graph output(s) untyped, which the ONNX checker "
                   "rejects; typed them from shape inference", filled)
    return repaired
