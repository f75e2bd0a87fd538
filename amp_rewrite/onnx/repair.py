"""Repairs of inputs that runtimes run but the ONNX checker rejects.

Exporters leave graph outputs (If branches', bodies', even the main graph's) without a type;
onnxruntime infers them, the checker refuses the model. ONNX shape inference recovers the
types; only the missing output types are copied back (the inferred value_info of every
intermediate stays out: the model is described as much as it was, no more).
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


def untyped_outputs(proto: onnx.ModelProto) -> int:
    return sum(1 for g, _ in _graph_pairs(proto.graph, proto.graph)
               for o in g.output if not o.HasField("type"))


def fill_output_types(proto: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of ``proto`` whose untyped graph outputs carry their inferred types, or None
    when there is nothing to fill or inference cannot type them all."""
    if not untyped_outputs(proto):
        return None
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception as e:  # inference errors are the checker's to report
        logger.info("shape inference could not repair the model: %s", e)
        return None
    repaired = onnx.ModelProto()
    repaired.CopyFrom(proto)
    filled = 0
    for g, gi in _graph_pairs(repaired.graph, inferred.graph):
        for out, inferred_out in zip(g.output, gi.output):
            if not out.HasField("type") and inferred_out.HasField("type"):
                out.type.CopyFrom(inferred_out.type)
                filled += 1
    if untyped_outputs(repaired):
        return None
    logger.warning("the input leaves %d graph output(s) untyped, which the ONNX checker "
                   "rejects; typed them from shape inference", filled)
    return repaired
