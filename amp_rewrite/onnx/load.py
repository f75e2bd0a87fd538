"""Load ONNX models into onnx_ir: clear errors, checks, external data, text repair, inferred
facts (``LoadInfo``), and the IR's release when it is no longer needed."""
from __future__ import annotations

import functools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnx.inliner
import onnx_ir as ir

from amp_rewrite.errors import ModelError, UsageError, described, first_line
from amp_rewrite.runtime import Background

logger = logging.getLogger(__name__)
# Size assumed for a symbolic dim in cast costs: nominal, it only weighs activations against
# static weights (padding and random validation inputs have their own).
SYMBOLIC_DIM_EXTENT = 64


@dataclass
class LoadInfo:
    """What loading learned about a model that its IR does not hold; the defaults: nothing."""

    source: Path | None = None  # the file the model was loaded from
    external_files: list[Path] | None = None  # data files read at load (None: not recorded)
    had_external_data: bool = False  # some main-graph initializer is stored externally
    flat: bool = False  # no node held a graph attribute at load (no pass of ours adds one)
    typed: bool = False  # flat, and every node output had a dtype after loading
    untyped: set[ir.Value] = field(default_factory=set)  # node outputs the file left untyped
    # value name -> fp32 bytes from shape inference, for values the file gives no shape
    inferred_sizes: dict[str, int | None] = field(default_factory=dict)
    described: set[str] = field(default_factory=set)  # names the file gave a value_info
    # graph outputs typed at load with no shape, which no shape fits (repair.py)
    shapeless_outputs: set[str] = field(default_factory=set)


@dataclass
class LoadedModel:
    model: ir.Model
    info: LoadInfo


class _OneLine(logging.Filter):
    """onnx_ir's shape-inference failures (ignored: shapes stay unknown) as one INFO line,
    not a WARNING with a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({described(error)})"
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


logging.getLogger("onnx_ir.passes.common.shape_inference").addFilter(_OneLine())

def model_graphs(model: ir.Model, flat: bool = False) -> list[ir.Graph]:
    """The model's graph and subgraphs; no walk for a model ``LoadInfo.flat`` at load."""
    return [model.graph] if flat else list(walk_graphs(model.graph))


def walk_graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """The graph and every subgraph, outer before inner (``Model.graphs()``, cheaper)."""
    yield graph
    for node in graph:
        # the dict behind onnx_ir's UserDict: its own len()/values() are slow
        attrs = getattr(node.attributes, "data", node.attributes)
        if not attrs:
            continue
        for attr in attrs.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from walk_graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    yield from walk_graphs(sub)


Source = str | os.PathLike | onnx.ModelProto | bytes | ir.Model | LoadedModel


def load_model(source: Source) -> LoadedModel:
    """An onnx_ir model from a path (external data stays on disk, memory-mapped), a
    ModelProto (never mutated) or its serialized bytes, with ONNX shape inference filled in
    where it was missing, and what loading learned. A ``LoadedModel`` is passed through; an
    ``ir.Model`` is taken as it is, with nothing known about it."""
    if isinstance(source, LoadedModel):
        return source
    if isinstance(source, ir.Model):
        _check_has_outputs(len(source.graph.outputs), "<ir.Model>")
        return LoadedModel(source, LoadInfo(had_external_data=had_external_data(source)))
    if isinstance(source, bytes):
        source = parse_bytes(source)
    if isinstance(source, onnx.ModelProto):
        _check_tensors(source, "<ModelProto>", None)
        return _loaded(source, "<ModelProto>")
    path = check_input_path(source)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning, ValueError, ...
        raise ModelError(f"{path}: not a readable ONNX model ({first_line(e)}); "
                         "check that the file is complete and really ONNX") from None
    if not proto.graph.node and not proto.graph.input and not proto.graph.output:
        raise ModelError(f"{path}: not an ONNX model (no graph found); is it truncated?")
    external = _check_tensors(proto, str(path), path)
    loaded = _loaded(proto, str(path), path if external else None)
    ir.external_data.set_base_dir(loaded.model.graph, path.parent)
    loaded.info.external_files = sorted({path.parent / loc for loc in external})
    loaded.info.source = path
    return loaded


def parse_bytes(data: bytes) -> onnx.ModelProto:
    try:
        return onnx.load_model_from_string(data)
    except Exception as e:  # protobuf's DecodeError and friends
        raise ModelError(f"<bytes>: not a serialized ONNX model ({first_line(e)})") from None


def check_input_path(source: str | os.PathLike) -> Path:
    if not isinstance(source, (str, os.PathLike)):
        raise UsageError(f"model must be a path, an onnx.ModelProto or its serialized bytes; "
                         f"got {type(source).__name__}")
    path = Path(source)
    if path.suffix.lower() in TORCH_SUFFIXES:
        raise UsageError(f"{path}: a PyTorch checkpoint, not an ONNX model; rewrite the "
                         "nn.Module in Python with amp_rewrite.rewrite(module, example_inputs)")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory; pass the path of an .onnx model")
    if not path.is_file():
        raise ModelError(f"{path}: no such file; pass the path of an .onnx model")
    return path


def _inline_local_functions(proto: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """Calls of model-local functions replaced by their bodies (a new proto): precision is
    decided per call site, and a shared body would stay fp32 behind an opaque op."""
    if not proto.functions:
        return proto
    logger.info("inlining %d model-local functions", len(proto.functions))
    try:
        return onnx.inliner.inline_local_functions(proto)
    except Exception as e:  # the C++ inliner asserts: too many actuals, recursion, ...
        raise ModelError(f"{label}: its model-local functions cannot be inlined "
                         f"({first_line(e)}); fix the function calls in the exporter") from None


def _loaded(proto: onnx.ModelProto, label: str, path: Path | None = None) -> LoadedModel:
    """The checked (or repaired), inlined proto in onnx_ir, with inferred facts. On a large
    model the checker and shape inference run in the ``Background`` while onnx_ir loads;
    a model the checker refuses, or with functions to inline, takes the serial path."""
    from amp_rewrite.onnx import repair

    _check_has_outputs(len(proto.graph.output), label)
    _check_defined_types(proto.graph, label)
    if (proto.functions or len(proto.graph.node) < BACKGROUND_NODES
            or repair.untyped_main_outputs(proto.graph)):
        return _loaded_serially(proto, label, path)
    job = Background(_checked_and_inferred, proto, label, path)
    try:
        model = _from_proto(proto, label, lambda: job.result()[1])
    except ModelError:
        if job.result()[0] is None:
            raise
        model = None  # the checker's error (or repair) explains this better: serial path
    if job.result()[0] is not None:
        if model is not None:
            release(model.model)
        return _loaded_serially(proto, label, path)
    return model


def _check_has_outputs(count: int, label: str) -> None:
    """A graph without outputs computes nothing anyone can read: onnxruntime loads it but
    refuses every run, and the checker lets it pass, so the rewrite would write it."""
    if count == 0:
        raise ModelError(f"{label}: the model has no graph outputs, so it computes nothing a "
                         "runtime can return; declare the values it should return as graph "
                         "outputs (onnx.helper.make_tensor_value_info) or export it again")


def _check_defined_types(graph: onnx.GraphProto, label: str) -> None:
    """A graph input or initializer of element type UNDEFINED: the checker lets it pass (with
    external data, or on an input), onnxruntime refuses the model ("Invalid tensor data type
    0"), and no step that sizes values by their type can take it."""
    undefined = onnx.TensorProto.UNDEFINED
    names = [t.name for t in graph.initializer if t.data_type == undefined] + [
        v.name for v in graph.input
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type == undefined]
    if names:
        raise ModelError(f"{label}: {text(names[0])!r} has element type UNDEFINED (0), which "
                         "no runtime loads; the file is damaged or was written by a broken "
                         "exporter")


def _loaded_serially(proto: onnx.ModelProto, label: str, path: Path | None) -> LoadedModel:
    from amp_rewrite.onnx import repair

    proto = _checked_or_repaired(proto, label, path)
    proto = _inline_local_functions(proto, label)
    loaded = _from_proto(proto, label, functools.partial(_inferred_facts, proto))
    loaded.info.shapeless_outputs = repair.shapeless_outputs(proto.graph)
    return loaded


def _checked_and_inferred(proto: onnx.ModelProto, label: str, path: Path | None
                          ) -> tuple[str | None, dict[str, TensorFact] | str]:
    """(the checker's error or None, ``_inferred_facts`` if the check passed)."""
    try:
        _check_input(path or proto, label)
    except ModelError as e:
        return str(e), "not run: the checker refused the model"
    return None, _inferred_facts(proto)


def _from_proto(proto: onnx.ModelProto, label: str,
                facts: Callable[[], dict[str, TensorFact] | str]) -> LoadedModel:
    try:
        model = ir.from_proto(proto)
    except Exception as e:  # an unknown elem_type, a malformed attribute, ...
        cause = e.__cause__ or e
        raise ModelError(f"{label}: unsupported ONNX content ({type(cause).__name__}: "
                         f"{first_line(cause)}); check the exporter's output") from None
    graphs = list(walk_graphs(model.graph))  # one walk for the three steps
    _scan_nodes(model, label, graphs)
    # without subgraphs in the IR there are none in the proto: skip its (slow) node walk
    nested = len(graphs) > 1
    info = LoadInfo(had_external_data=had_external_data(model), flat=not nested,
                    described=_value_info_names(proto.graph, nested))
    _add_inferred_facts(info, facts, graphs)
    return LoadedModel(model, info)


TORCH_SUFFIXES = (".pt", ".pth", ".ckpt")
# attributes (of ``DTYPE_OPS``) whose int is a TensorProto.DataType
DTYPE_ATTRIBUTES = frozenset({"to", "dtype"})


def text(raw: str | bytes) -> str:
    """A protobuf string field as text: python-protobuf hands invalid UTF-8 back as bytes
    (proto2 does not validate), which cannot be written back; the bad bytes are escaped."""
    return raw.decode("utf-8", errors="backslashreplace") if type(raw) is bytes else raw


def _scan_nodes(model: ir.Model, label: str, graphs: list[ir.Graph]) -> None:
    """One walk over the nodes: node text fields repaired (--keep-fp32 globs match names),
    dtype attributes and Constant sizes checked. Value names and metadata are repaired
    only if serialising fails (``repair_all_text``)."""
    count = _repair_fields(model, ("producer_name", "producer_version", "domain", "doc_string"))
    for g in graphs:
        count += _repair_fields(g, ("name", "doc_string"))
        for node in g:
            if type(node.name) is bytes or type(node.doc_string) is bytes:
                count += _repair_fields(node, ("name", "doc_string"))
            if node.op_type in DTYPE_OPS:
                _check_type_attribute(node, label)
            elif node.op_type == "Constant":
                _check_constant_size(node, label)
    if count:
        warn_repaired(label, count)


def warn_repaired(label: str, count: int) -> None:
    logger.warning("%s: %d string fields are not valid UTF-8; written with the bad bytes "
                   "escaped (\\xNN)", label, count)


def repair_all_text(model: ir.Model) -> int:
    """Every text field of nodes and values (names, docs, metadata) that is not valid UTF-8,
    escaped in place; the count. The same bytes always give the same text, so references
    between names stay consistent."""
    count = 0
    for g in walk_graphs(model.graph):
        count += _repair_fields(g, ())
        for v in (*g.inputs, *g.initializers.values(), *(o for n in g for o in n.outputs)):
            count += _repair_fields(v, ("name", "doc_string"))
        for v in g.initializers.values():
            count += _repair_tensor_text(v)
        for node in g:
            count += _repair_fields(node, ("name", "doc_string"))
    return count


def _repair_tensor_text(value: ir.Value) -> int:
    """An initializer's own metadata_props, escaped. onnx_ir serialises a tensor read from a
    file by copying its TensorProto, bytes included, so the value gets a tensor over a copy
    of that proto with the text repaired (the caller's ModelProto is never mutated)."""
    tensor = value.const_value
    if not isinstance(tensor, ir.serde.TensorProtoTensor):
        return 0
    props = tensor.metadata_props
    if not any(type(k) is bytes or type(v) is bytes for k, v in props.items()):
        return 0
    proto = onnx.TensorProto()
    proto.CopyFrom(tensor.raw)
    # onnx_ir writes metadata_props after copying the proto: the copy keeps none of its own
    proto.ClearField("metadata_props")
    repaired = ir.serde.TensorProtoTensor(proto)
    repaired.metadata_props.update({text(k): text(v) for k, v in props.items()})
    value.const_value = repaired
    return len(props)


def _repair_fields(obj, fields: tuple[str, ...]) -> int:
    count = 0
    for f in fields:
        raw = getattr(obj, f, None)
        if type(raw) is bytes:
            setattr(obj, f, text(raw))
            count += 1
    props = getattr(obj, "metadata_props", None)
    if props and any(type(k) is bytes or type(v) is bytes for k, v in props.items()):
        fixed = {text(k): text(v) for k, v in props.items()}
        count += len(props)
        props.clear()
        props.update(fixed)
    return count


DTYPE_OPS = frozenset({"Cast", "SequenceEmpty", "EyeLike", "RandomNormal", "RandomUniform",
                       "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli",
                       "TreeEnsemble"})
_VALID_DTYPES = frozenset(int(d) for d in ir.DataType if int(d) != 0)


def _check_type_attribute(node: ir.Node, label: str) -> None:
    """A dtype attribute no runtime can honour (``Cast to=99``) is a bad model (exit 3); the
    checker lets it pass and the rewrite would copy it into the output."""
    if node.domain not in ("", "ai.onnx"):
        return
    for name in DTYPE_ATTRIBUTES & node.attributes.keys():
        attr = node.attributes[name]
        if attr.type == ir.AttributeType.INT and attr.value not in _VALID_DTYPES:
            raise ModelError(f"{label}: node {node.name or '(unnamed)'} ({node.op_type}): "
                             f"attribute {name}={attr.value} is not an ONNX data type; "
                             "fix or remove the node")


def _check_constant_size(node: ir.Node, label: str) -> None:
    """``_check_tensors`` for a Constant's value (found during the node walk)."""
    attr = node.attributes.get("value")
    tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else None
    if not isinstance(tensor, ir.serde.TensorProtoTensor) or not _whole_bytes(tensor.dtype):
        return
    proto = tensor.raw
    if proto.HasField("raw_data") and proto.data_location != onnx.TensorProto.EXTERNAL:
        size, needed = len(proto.raw_data), tensor.nbytes
        if size != needed:
            raise ModelError(f"{label}: Constant {node.name or '(unnamed)'}: its value holds "
                             f"{size} bytes, its dims {list(tensor.shape)} and type need "
                             f"{needed}; the file is damaged or was written by a broken exporter")


def _whole_bytes(dtype: ir.DataType) -> bool:
    try:
        return dtype.bitwidth % 8 == 0
    except TypeError:  # strings: no fixed size
        return False


def _check_tensors(proto: onnx.ModelProto, label: str, path: Path | None) -> set[str]:
    """One pass over the initializers: raw_data holds exactly what dims and type need (the
    checker refuses only too-short data), and external data lies inside its file. Returns
    the external data files' locations."""
    external = set()
    sizes: dict[str, int] = {}
    for t in proto.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            if path is not None:
                external.add(_check_extent(t, path, sizes))
        elif t.HasField("raw_data"):
            needed = _tensor_bytes(t)
            if needed is not None and len(t.raw_data) != needed:
                raise ModelError(
                    f"{label}: tensor {t.name or '(constant)'}: raw_data holds "
                    f"{len(t.raw_data)} bytes, its dims {list(t.dims)} and type need {needed}; "
                    "the file is damaged or was written by a broken exporter")
    return external


def _check_extent(t: onnx.TensorProto, path: Path, sizes: dict[str, int]) -> str:
    """The external tensor lies inside its file (its location, returned): onnx_ir would fail
    later with a bare ValueError (offset past the end) or memory-map less than it needs."""
    info = {kv.key: kv.value for kv in t.external_data}
    location = info.get("location", "")
    data = path.parent / location
    if location not in sizes:
        sizes[location] = data.stat().st_size if data.is_file() else -1
    size = sizes[location]
    if size < 0:
        raise ModelError(f"{path}: tensor {t.name}: external data file {data} is missing; "
                         "copy it beside the model")
    try:
        offset, length = int(info.get("offset", 0)), info.get("length")
        length = int(length) if length is not None else None
    except ValueError:
        raise ModelError(f"{path}: tensor {t.name}: external data offset/length are not "
                         "integers") from None
    needed = _tensor_bytes(t)
    if offset < 0 or offset + (length or 0) > size or (
            needed is not None and offset + needed > size) or (
            length is not None and needed is not None and length < needed):
        raise ModelError(f"{path}: tensor {t.name}: external data (offset {offset}, length "
                         f"{length}, {needed} bytes needed) lies beyond the end of {data} "
                         f"({size} bytes); the data file does not belong to this model or "
                         "is truncated")
    return location


def _tensor_bytes(t: onnx.TensorProto) -> int | None:
    """Bytes the tensor's dims and type need, or None for types of no fixed size."""
    bits = _element_bits(t.data_type)
    return None if bits is None else math.ceil(math.prod(t.dims) * bits / 8)


@functools.cache
def _element_bits(data_type: int) -> int | None:
    if data_type in _SUB_BYTE_TYPES:  # packed: two (4-bit) or four (2-bit) per byte
        return _SUB_BYTE_TYPES[data_type]
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(data_type))
    except Exception:  # noqa: BLE001 - unknown types: no size to check against
        return None
    return None if dtype.kind in "OUS" else 8 * dtype.itemsize


_SUB_BYTE_TYPES = {int(d): bits for name, bits in (("INT4", 4), ("UINT4", 4), ("FLOAT4E2M1", 4),
                                                   ("INT2", 2), ("UINT2", 2))
                   for d in ir.DataType if d.name == name}


def _value_info_names(graph: onnx.GraphProto, nested: bool = True) -> set[str]:
    names = {vi.name for vi in graph.value_info}
    for sub in _subgraph_protos(graph) if nested else ():
        names |= _value_info_names(sub)
    return names


def _subgraph_protos(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """The bodies held by the graph's nodes (one level down)."""
    for node in graph.node:
        for attr in node.attribute:
            yield from (attr.g,) if attr.HasField("g") else attr.graphs


def _add_inferred_facts(info: LoadInfo, facts: Callable[[], dict[str, TensorFact] | str],
                        graphs: list[ir.Graph]) -> None:
    """Dtypes (onto the IR values) and sizes (to ``info.inferred_sizes``, not value shapes,
    which would be re-serialised) from shape inference, for values the model does not
    describe; ``facts`` is waited for only when some node output has no type."""
    undescribed = [v for g in graphs for node in g for v in node.outputs
                   if v.name and (v.type is None or v.shape is None)]
    untyped = {v for v in undescribed if v.type is None}
    info.typed = len(graphs) == 1  # until an untyped value stays untyped
    if not untyped:
        return
    info.untyped = untyped
    facts = facts()
    if isinstance(facts, str):  # a partial answer is still better than none: keep going
        logger.info("shape inference failed (%s); sizes of some values unknown", facts)
        info.typed = False
        return
    sizes = info.inferred_sizes
    for v in undescribed:
        fact = facts.get(v.name)
        if fact is not None:
            if v.type is None:
                v.dtype = fact[0]
            if v.shape is None:
                sizes[v.name] = fact[1]
        elif v.type is None:
            info.typed = False


def _inferred_facts(proto: onnx.ModelProto) -> dict[str, TensorFact] | str:
    """name -> (dtype, fp32 bytes) of every tensor shape inference types, or why it failed."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception as e:
        return first_line(e)
    return _tensor_facts(inferred.graph, {})


BACKGROUND_NODES = 4096  # below it a fork costs more than checking saves

TensorFact = tuple[ir.DataType, int | None]
_KNOWN_ELEM_TYPES = frozenset(int(d) for d in ir.DataType)  # (dtype, bytes in fp32 or None)


def _tensor_facts(graph: onnx.GraphProto, by_type: dict[bytes, TensorFact | None]
                  ) -> dict[str, TensorFact]:
    """name -> fact for every inferred tensor, subgraphs included; parsed once per distinct
    TypeProto (``by_type``), as models repeat a few types thousands of times."""
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
    if t is None or not t.elem_type or t.elem_type not in _KNOWN_ELEM_TYPES:
        return None
    if not t.HasField("shape"):
        return ir.DataType(t.elem_type), None
    dims = [d.dim_value if d.HasField("dim_value") else SYMBOLIC_DIM_EXTENT for d in t.shape.dim]
    return ir.DataType(t.elem_type), 4 * max(1, math.prod(dims))


def _checked_or_repaired(proto: onnx.ModelProto, label: str,
                         path: Path | None = None) -> onnx.ModelProto:
    """``proto`` if it passes the checker with its outputs typed, else a copy repaired of
    what runtimes infer anyway (``repair.fill_output_types``) if that passes; else the
    checker's error."""
    from amp_rewrite.onnx import repair

    try:
        _check_input(path or proto, label)
    except ModelError as e:
        return _repaired(proto, label, e)
    if not repair.untyped_main_outputs(proto.graph):
        return proto
    # the checker passes an output of element type 0 that has a shape; the rest of the
    # model passed as it is, so the outputs inference types need no second check
    return repair.fill_output_types(proto) or proto


def _repaired(proto: onnx.ModelProto, label: str, error: ModelError) -> onnx.ModelProto:
    """``proto`` with its untyped outputs typed, checked; else the checker's ``error``."""
    from amp_rewrite.onnx import repair

    repaired = repair.fill_output_types(proto)
    if repaired is None:
        missing = repair.first_untyped_output(proto)
        if missing is None:
            raise error
        raise ModelError(f"{label}: invalid ONNX model: graph output {missing!r} has no "
                         "element type or shape field and shape inference cannot infer "
                         "them; declare its type (onnx.helper.make_tensor_value_info)"
                         ) from None
    with repair.shape_placeholders(repaired, repair.shapeless_outputs(repaired.graph)):
        _check_input(repaired, label)
    return repaired


def _check_input(model: onnx.ModelProto | Path, label: str) -> None:
    try:
        onnx.checker.check_model(str(model) if isinstance(model, Path) else model)
    except Exception as e:
        raise ModelError(f"{label}: invalid ONNX model: {first_line(e)}") from None


def release(model: ir.Model, flat: bool = False) -> bool:
    """Unlink an IR that will not be used again, so reference counting frees it at once
    instead of the cyclic collector (decision 0003). Uses onnx_ir's private slots: should
    they change, returns False and the collector frees the rest. ``model`` is unusable after."""
    try:
        for graph in model_graphs(model, flat):  # listed first: unlinking stops the walk
            unlink_graph(graph)
    except AttributeError as e:
        logger.debug("could not unlink the IR (%s); the garbage collector will free it", e)
        return False
    return True


def unlink_graph(graph: ir.Graph) -> None:
    # cut every cycle once: node <-> values, graph, attributes; graph <-> I/O; list boxes
    nodes = graph._nodes
    unlink_nodes(nodes)
    for value in (*graph.inputs, *graph.outputs, *graph.initializers.values()):
        value._graph = None
    for container in (graph._inputs, graph._outputs, graph._initializers):
        container._graph = None
    for box in nodes._value_ids_to_boxes.values():
        box.prev = None
    nodes._value_ids_to_boxes = {}
    nodes._root.next = nodes._root.prev = nodes._root.owning_list = None


def unlink_nodes(nodes: Iterable[ir.Node]) -> None:
    """Cut the node <-> value and node <-> attribute cycles of nodes no graph uses any more
    (``release``; the fusion step's dropped nodes), so reference counting frees them."""
    for node in nodes:
        node._inputs = node._outputs = ()
        node._graph = node._attributes._owner = None


def had_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor)
               for v in model.graph.initializers.values())
