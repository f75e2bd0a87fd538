"""Load and save ONNX models safely: clear errors, external data, atomic writes."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
import onnx.inliner
import onnx_ir as ir

from amp_rewrite.errors import ModelError, UsageError

logger = logging.getLogger(__name__)
PROTOBUF_LIMIT = 2**31 - 1
INFERRED_SIZES = "amp_rewrite.inferred_sizes"  # model.meta key: value name -> fp32 bytes
UNTYPED_AT_LOAD = "amp_rewrite.untyped_at_load"  # model.meta key: node outputs with no type
# model.meta key: names the input described with a value_info (consulted for initializers)
DESCRIBED_INITIALIZERS = "amp_rewrite.described_initializers"
SYMBOLIC_DIM_EXTENT = 64  # nominal size of a symbolic dim (batch, sequence) for cast costs


def walk_graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """The graph and every subgraph, outer before inner.

    ``Model.graphs()`` does the same through onnx_ir's generic node traversal at twice the
    cost: 0.07 s against 0.035 s per call on a 50k-node model.
    """
    yield graph
    for node in graph:
        if not node.attributes:
            continue
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from walk_graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    yield from walk_graphs(sub)


def load_model(source: str | os.PathLike | onnx.ModelProto | bytes) -> ir.Model:
    """An onnx_ir model from a path (external data stays on disk, memory-mapped), a
    ModelProto (never mutated) or its serialized bytes, with ONNX shape inference filled in
    where it was missing."""
    if isinstance(source, bytes):
        source = _parse_bytes(source)
    if isinstance(source, onnx.ModelProto):
        source = _checked_or_repaired(source, "<ModelProto>")
        proto = _inline_local_functions(source)
        return _from_proto(proto)
    path = check_input_path(source)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning, ValueError, ...
        raise ModelError(f"{path}: not a readable ONNX model ({_first_line(e)}); "
                         "check that the file is complete and really ONNX") from None
    if not proto.graph.node and not proto.graph.input and not proto.graph.output:
        raise ModelError(f"{path}: not an ONNX model (no graph found); is it truncated?")
    proto = _checked_or_repaired(proto, str(path), path if _has_external_data(proto) else None)
    proto = _inline_local_functions(proto)
    model = _from_proto(proto)
    ir.external_data.set_base_dir(model.graph, path.parent)
    return model


def _parse_bytes(data: bytes) -> onnx.ModelProto:
    try:
        return onnx.load_model_from_string(data)
    except Exception as e:  # protobuf's DecodeError and friends
        raise ModelError(f"<bytes>: not a serialized ONNX model ({_first_line(e)})") from None


def check_input_path(source: str | os.PathLike) -> Path:
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(f"model must be a path, an onnx.ModelProto or its serialized bytes; "
                         f"got {type(source).__name__}")
    path = Path(source)
    if path.is_dir():
        raise ModelError(f"{path}: is a directory; pass the path of an .onnx model")
    if not path.is_file():
        raise ModelError(f"{path}: no such file; pass the path of an .onnx model")
    return path


def _inline_local_functions(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Calls of model-local functions replaced by their bodies (a new proto).

    Precision is decided per call site, and a function body is shared by all its calls, so
    without inlining every op inside would stay fp32 behind an opaque custom op. ONNX's C++
    inliner touches only nodes; initializers, external ones included, are left as they are.
    """
    if not proto.functions:
        return proto
    logger.info("inlining %d model-local functions", len(proto.functions))
    return onnx.inliner.inline_local_functions(proto)


def _from_proto(proto: onnx.ModelProto) -> ir.Model:
    model = ir.from_proto(proto)
    model.meta[DESCRIBED_INITIALIZERS] = _value_info_names(proto.graph)
    return _with_inferred_facts(model, proto)


def _value_info_names(graph: onnx.GraphProto) -> set[str]:
    names = {vi.name for vi in graph.value_info}
    for sub in _subgraph_protos(graph):
        names |= _value_info_names(sub)
    return names


def _subgraph_protos(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The bodies held by the graph's nodes (one level down)."""
    for node in graph.node:
        for attr in node.attribute:
            yield from (attr.g,) if attr.HasField("g") else attr.graphs


def _with_inferred_facts(model: ir.Model, proto: onnx.ModelProto) -> ir.Model:
    """Dtypes and sizes for values the model does not describe, from ONNX shape inference.

    Cast costs are bytes, so values need sizes. Inference reads only initializer dims, never
    external data, and runs only when some node output has no recorded type. The inferred
    dtypes go onto the IR values; the sizes go to ``model.meta[INFERRED_SIZES]`` instead of
    value shapes, because parsing and re-serialising 50k inferred shapes doubled the cost of
    the onnx_ir round trip.
    """
    undescribed = [v for g in walk_graphs(model.graph) for node in g for v in node.outputs
                   if v.name and (v.type is None or v.shape is None)]
    untyped = {v for v in undescribed if v.type is None}
    if not untyped:
        return model
    model.meta[UNTYPED_AT_LOAD] = untyped
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception as e:  # a partial answer is still better than none: keep going
        logger.info("shape inference failed (%s); sizes of some values unknown", _first_line(e))
        return model
    facts = _tensor_facts(inferred.graph, {})
    sizes = model.meta.setdefault(INFERRED_SIZES, {})
    for v in undescribed:
        fact = facts.get(v.name)
        if fact is not None:
            if v.type is None:
                v.dtype = fact[0]
            if v.shape is None:
                sizes[v.name] = fact[1]
    return model


TensorFact = tuple[ir.DataType, int | None]  # (dtype, bytes in fp32 or None)


def _tensor_facts(graph: onnx.GraphProto, by_type: dict[bytes, TensorFact | None]
                  ) -> dict[str, TensorFact]:
    """name -> fact for every inferred tensor, subgraphs included.

    Facts are parsed once per distinct TypeProto (``by_type``, keyed by its bytes): models
    repeat a few types thousands of times, and reading protobuf fields from Python costs
    ~0.2 µs each, so parsing every value_info took 0.2 s on a 50k-node chain.
    """
    facts = {}
    for vi in graph.value_info:
        key = vi.type.SerializeToString()
        if key not in by_type:
            by_type[key] = _type_fact(vi.type)
        fact = by_type[key]
        if fact is not None:
            facts[vi.name] = fact
    for sub in _subgraph_protos(graph):
        facts.update(_tensor_facts(sub, by_type))
    return facts


def _type_fact(tp: onnx.TypeProto) -> TensorFact | None:
    t = tp.tensor_type if tp.HasField("tensor_type") else None
    if t is None or not t.elem_type:
        return None
    if not t.HasField("shape"):
        return ir.DataType(t.elem_type), None
    dims = [d.dim_value if d.HasField("dim_value") else SYMBOLIC_DIM_EXTENT for d in t.shape.dim]
    return ir.DataType(t.elem_type), 4 * max(1, math.prod(dims))


def _has_external_data(proto: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


def _checked_or_repaired(proto: onnx.ModelProto, label: str,
                         path: Path | None = None) -> onnx.ModelProto:
    """``proto`` if it passes the checker, else a copy repaired of what runtimes infer
    anyway (``repair.fill_output_types``) if that passes; else the checker's error."""
    try:
        _check_input(path or proto, label)
        return proto
    except ModelError:
        from amp_rewrite.onnx import repair

        repaired = repair.fill_output_types(proto)
        if repaired is None:
            raise
    _check_input(repaired, label)
    return repaired


def _check_input(model: onnx.ModelProto | Path, label: str) -> None:
    try:
        onnx.checker.check_model(str(model) if isinstance(model, Path) else model)
    except Exception as e:
        raise ModelError(f"{label}: invalid ONNX model: {_first_line(e)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def default_output_path(input_path: str | os.PathLike) -> Path:
    path = Path(input_path)
    return path.with_name(path.name.removesuffix(".onnx") + ".amp.onnx")


def check_output_path(input_path: str | os.PathLike | None, output: str | os.PathLike) -> Path:
    """The file to write: ``output``, or the default name inside it when it is a directory."""
    out = Path(output)
    if out.is_dir():
        if input_path is None:
            raise UsageError(f"{out}: is a directory; give the output file name")
        out = out / default_output_path(input_path).name
    if input_path is not None and out.resolve() == Path(input_path).resolve():
        raise UsageError(f"{out}: the output would overwrite the input; choose another -o path")
    if not out.parent.is_dir():
        raise UsageError(f"{out}: directory {out.parent} does not exist")
    return out


def needs_external_data(model: ir.Model, had_external: bool) -> bool:
    if had_external:
        return True
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                if v.const_value is not None)
    return total > PROTOBUF_LIMIT // 2


@contextlib.contextmanager
def initializers_undescribed(model: ir.Model) -> Iterator[None]:
    """While serialising, initializers get no value_info unless the input gave them one.

    onnx_ir writes a value_info for every typed initializer, although the tensor holds its
    dtype and shape: 25k redundant entries on a 50k-node chain, ~0.15 s to write and ~0.1 s
    to check. The types are cleared only for the duration; the IR keeps them.
    """
    described = model.meta.get(DESCRIBED_INITIALIZERS, set())
    cleared = [(v, v.type, v.shape) for g in walk_graphs(model.graph)
               for v in g.initializers.values()
               if v.name not in described and not v.is_graph_input() and not v.is_graph_output()
               and not v.metadata_props and not v.doc_string]
    for v, _, _ in cleared:
        v.type, v.shape = None, None
    try:
        yield
    finally:
        for v, type_, shape in cleared:
            v.type, v.shape = type_, shape


def release(model: ir.Model) -> bool:
    """Unlink an IR that will not be used again, so reference counting frees it at once.

    onnx_ir links nodes, values, graphs and the boxes of its node lists both ways, so a
    dropped model is ~15 cyclic objects per node that only the cyclic collector frees: ~1 s
    for a 50k-node chain, a fifth of the rewrite. Unlinked, plain deallocation takes a quarter
    of that. The links are onnx_ir's private slots (1.x); should they change, this stops at
    the first missing one, returns False, and the collector frees the rest as before. Either
    way ``model`` is unusable afterwards.
    """
    try:
        for graph in list(walk_graphs(model.graph)):  # listed first: unlinking stops the walk
            _unlink_graph(graph)
    except AttributeError as e:
        logger.debug("could not unlink the IR (%s); the garbage collector will free it", e)
        return False
    return True


def _unlink_graph(graph: ir.Graph) -> None:
    # Cut every cycle once: node <-> its outputs (producer), node <-> its inputs (uses),
    # node <-> its graph and its attribute map, graph <-> its I/O values and containers,
    # and the list boxes (each pair of neighbours, the root, the id map).
    nodes = graph._nodes
    for node in nodes:
        node._inputs = node._outputs = ()
        node._graph = node._attributes._owner = None
    for value in (*graph.inputs, *graph.outputs, *graph.initializers.values()):
        value._graph = None
    for container in (graph._inputs, graph._outputs, graph._initializers):
        container._graph = None
    for box in nodes._value_ids_to_boxes.values():
        box.prev = None
    nodes._value_ids_to_boxes = {}
    nodes._root.next = nodes._root.prev = nodes._root.owning_list = None


def to_proto(model: ir.Model) -> onnx.ModelProto:
    with initializers_undescribed(model):
        return ir.to_proto(model)


def save_model(model: ir.Model, output: str | os.PathLike) -> Path:
    """Write ``model`` with its weights in ``OUTPUT.data``, atomically (``_staged``).

    The file is checked by path before the rename (in memory the model may be too large for
    protobuf), so an invalid model never lands at ``output``.
    """
    out = Path(output)
    data_name = out.name + ".data"
    with _staged(out) as tmp_model:
        with initializers_undescribed(model):
            ir.save(model, tmp_model, external_data=data_name)
        _check_saved(tmp_model)
        os.replace(tmp_model.with_name(data_name), out.parent / data_name)
    logger.info("wrote %s (+ %s)", out, data_name)
    return out


def save_proto(proto: onnx.ModelProto, output: str | os.PathLike) -> Path:
    """Write an in-memory model atomically. Writing the ModelProto the check already built
    saves serialising the IR again."""
    out = Path(output)
    with _staged(out) as tmp_model:
        tmp_model.write_bytes(proto.SerializeToString())
    logger.info("wrote %s", out)
    return out


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out``, renamed to ``out`` only if the block succeeds: the
    output is never half-written, and the input is never touched."""
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".amp_rewrite_") as tmp:
        tmp_model = Path(tmp) / out.name
        yield tmp_model
        os.replace(tmp_model, out)


def _check_saved(path: Path) -> None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise ModelError(f"internal error: the rewritten model fails the ONNX checker: "
                         f"{_first_line(e)}") from e


def input_had_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor)
               for v in model.graph.initializers.values())
