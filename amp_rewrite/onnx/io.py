"""Load and save ONNX models safely: clear errors, external data, atomic writes."""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import onnx
import onnx.external_data_helper
import onnx.inliner
import onnx_ir as ir

from amp_rewrite.core.runtime import Background
from amp_rewrite.errors import ModelError, OutputCheckError, UsageError

logger = logging.getLogger(__name__)
PROTOBUF_LIMIT = 2**31 - 1
INFERRED_SIZES = "amp_rewrite.inferred_sizes"  # model.meta key: value name -> fp32 bytes
UNTYPED_AT_LOAD = "amp_rewrite.untyped_at_load"  # model.meta key: node outputs with no type
# model.meta key: names the input described with a value_info (consulted for initializers)
DESCRIBED_INITIALIZERS = "amp_rewrite.described_initializers"
EXTERNAL_FILES = "amp_rewrite.external_files"  # model.meta key: data files read at load
SOURCE_PATH = "amp_rewrite.source_path"  # model.meta key: the file the model was loaded from
SYMBOLIC_DIM_EXTENT = 64  # nominal size of a symbolic dim (batch, sequence) for cast costs


FLAT = "amp_rewrite.flat"  # model.meta key: no node held a graph attribute at load
# model.meta key: a flat model whose node outputs all had a dtype after loading
# (``passes.infer_missing_types`` has nothing to add then)
TYPED = "amp_rewrite.typed"



class _OneLine(logging.Filter):
    """onnx_ir's shape inference logs its failures at WARNING with the traceback (exc_info),
    which the CLI would print; ours ignore such a failure (shapes stay unknown), so the
    record becomes one INFO line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({type(error).__name__}: " \
                         f"{str(error).strip().splitlines()[0] if str(error).strip() else ''})"
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


logging.getLogger("onnx_ir.passes.common.shape_inference").addFilter(_OneLine())

def model_graphs(model: ir.Model) -> list[ir.Graph]:
    """The model's graph and subgraphs: ``walk_graphs``, skipped for a model that had no
    subgraph at load (``FLAT``; no pass of ours creates one). Each walk costs ~0.035 s at 50k
    nodes, and a rewrite needs the list in five places."""
    if model.meta.get(FLAT):
        return [model.graph]
    return list(walk_graphs(model.graph))


def walk_graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """The graph and every subgraph, outer before inner.

    ``Model.graphs()`` does the same through onnx_ir's generic node traversal at twice the
    cost: 0.07 s against 0.035 s per call on a 50k-node model.
    """
    yield graph
    for node in graph:
        # onnx_ir's Attributes is a UserDict: its own len() and values() go through
        # collections.abc per item, 3x the cost of the dict it wraps (``data``).
        attrs = getattr(node.attributes, "data", node.attributes)
        if not attrs:
            continue
        for attr in attrs.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from walk_graphs(attr.value)
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.value:
                    yield from walk_graphs(sub)


def load_model(source: str | os.PathLike | onnx.ModelProto | bytes | ir.Model) -> ir.Model:
    """An onnx_ir model from a path (external data stays on disk, memory-mapped), a
    ModelProto (never mutated) or its serialized bytes, with ONNX shape inference filled in
    where it was missing. An ``ir.Model`` this function returned is passed through."""
    if isinstance(source, ir.Model):
        return source
    if isinstance(source, bytes):
        source = _parse_bytes(source)
    if isinstance(source, onnx.ModelProto):
        _check_tensors(source, "<ModelProto>", None)
        return _loaded(source, "<ModelProto>")
    path = check_input_path(source)
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # protobuf raises DecodeError, RuntimeWarning, ValueError, ...
        raise ModelError(f"{path}: not a readable ONNX model ({_first_line(e)}); "
                         "check that the file is complete and really ONNX") from None
    if not proto.graph.node and not proto.graph.input and not proto.graph.output:
        raise ModelError(f"{path}: not an ONNX model (no graph found); is it truncated?")
    external = _check_tensors(proto, str(path), path)
    model = _loaded(proto, str(path), path if external else None)
    ir.external_data.set_base_dir(model.graph, path.parent)
    model.meta[EXTERNAL_FILES] = sorted({path.parent / loc for loc in external})
    model.meta[SOURCE_PATH] = path
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
    if path.suffix.lower() in TORCH_SUFFIXES:
        raise UsageError(f"{path}: a PyTorch checkpoint, not an ONNX model; rewrite the "
                         "nn.Module in Python with amp_rewrite.rewrite(module, example_inputs)")
    if path.is_dir():
        raise ModelError(f"{path}: is a directory; pass the path of an .onnx model")
    if not path.is_file():
        raise ModelError(f"{path}: no such file; pass the path of an .onnx model")
    return path


def _inline_local_functions(proto: onnx.ModelProto, label: str) -> onnx.ModelProto:
    """Calls of model-local functions replaced by their bodies (a new proto).

    Precision is decided per call site, and a function body is shared by all its calls, so
    without inlining every op inside would stay fp32 behind an opaque custom op. ONNX's C++
    inliner touches only nodes; initializers, external ones included, are left as they are.
    """
    if not proto.functions:
        return proto
    logger.info("inlining %d model-local functions", len(proto.functions))
    try:
        return onnx.inliner.inline_local_functions(proto)
    except Exception as e:  # the C++ inliner asserts: too many actuals, recursion, ...
        raise ModelError(f"{label}: its model-local functions cannot be inlined "
                         f"({_first_line(e)}); fix the function calls in the exporter") from None


def _loaded(proto: onnx.ModelProto, label: str, path: Path | None = None) -> ir.Model:
    """The checked (or repaired), inlined proto in onnx_ir, with inferred facts.

    The checker and shape inference read only the proto: on a large model they run on the
    other core (``Background``) while onnx_ir loads the same proto here (0.4 of 1.1 s at 50k
    nodes). A model the checker refuses, or with functions to inline, takes the serial path.
    """
    if proto.functions or len(proto.graph.node) < BACKGROUND_NODES:
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
            release(model)
        return _loaded_serially(proto, label, path)
    return model


def _loaded_serially(proto: onnx.ModelProto, label: str, path: Path | None) -> ir.Model:
    proto = _checked_or_repaired(proto, label, path)
    proto = _inline_local_functions(proto, label)
    return _from_proto(proto, label, functools.partial(_inferred_facts, proto))


def _checked_and_inferred(proto: onnx.ModelProto, label: str, path: Path | None
                          ) -> tuple[str | None, dict[str, TensorFact] | str]:
    """(the checker's error or None, ``_inferred_facts`` if the check passed)."""
    try:
        _check_input(path or proto, label)
    except ModelError as e:
        return str(e), "not run: the checker refused the model"
    return None, _inferred_facts(proto)


def _from_proto(proto: onnx.ModelProto, label: str,
                facts: Callable[[], dict[str, TensorFact] | str]) -> ir.Model:
    try:
        model = ir.from_proto(proto)
    except Exception as e:  # an unknown elem_type, a malformed attribute, ...
        cause = e.__cause__ or e
        raise ModelError(f"{label}: unsupported ONNX content ({type(cause).__name__}: "
                         f"{_first_line(cause)}); check the exporter's output") from None
    graphs = list(walk_graphs(model.graph))  # one walk for the three steps
    model.meta[FLAT] = len(graphs) == 1
    _scan_nodes(model, label, graphs)
    # Without subgraphs in the IR there are none in the proto: its node walk (protobuf
    # fields read from Python, ~0.1 s per walk at 50k nodes) is skipped.
    nested = len(graphs) > 1
    model.meta[DESCRIBED_INITIALIZERS] = _value_info_names(proto.graph, nested)
    return _with_inferred_facts(model, facts, graphs)


TORCH_SUFFIXES = (".pt", ".pth", ".ckpt")
# Attributes whose int is a TensorProto.DataType (Cast, CastLike's saturate aside,
# SequenceEmpty, EyeLike, RandomNormal*, Multinomial, Bernoulli, ...).
DTYPE_ATTRIBUTES = frozenset({"to", "dtype"})


def _text(raw: str | bytes) -> str:
    """A protobuf string field as text: python-protobuf hands invalid UTF-8 back as bytes
    (proto2 does not validate), which cannot be written back; the bad bytes are escaped."""
    return raw.decode("utf-8", errors="backslashreplace")


def _scan_nodes(model: ir.Model, label: str, graphs: list[ir.Graph]) -> None:
    """One walk over the nodes: text fields repaired (``_repair_fields``: the pass matches
    node names against --keep-fp32 globs) and dtype attributes checked
    (``_check_type_attribute``). Value names and metadata are repaired only if serialising
    fails (``to_proto``): checking every value on every load cost more than the rare repair
    (and reading ``metadata_props`` allocates a dict per object)."""
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
        _warn_repaired(label, count)


def _warn_repaired(label: str, count: int) -> None:
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
        for node in g:
            count += _repair_fields(node, ("name", "doc_string"))
    return count


def _repair_fields(obj, fields: tuple[str, ...]) -> int:
    count = 0
    for f in fields:
        raw = getattr(obj, f, None)
        if type(raw) is bytes:
            setattr(obj, f, _text(raw))
            count += 1
    props = getattr(obj, "metadata_props", None)
    if props and any(type(k) is bytes or type(v) is bytes for k, v in props.items()):
        fixed = {_text(k) if type(k) is bytes else k: _text(v) if type(v) is bytes else v
                 for k, v in props.items()}
        count += len(props)
        props.clear()
        props.update(fixed)
    return count


# Ops with an int attribute that must be a TensorProto.DataType.
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
    checker refuses only too-short data; 258 bytes for an 8x8 float failed deep in the
    rewrite with a bare numpy error), and external data lies inside its file
    (``_check_extent``). Returns the external data files' locations. Constant values are
    checked in the node walk (``_check_constant_size``)."""
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


def _with_inferred_facts(model: ir.Model, facts: Callable[[], dict[str, TensorFact] | str],
                         graphs: list[ir.Graph]) -> ir.Model:
    """Dtypes and sizes for values the model does not describe, from ONNX shape inference
    (``facts``: ``_inferred_facts`` of the loaded proto).

    Cast costs are bytes, so values need sizes. Inference reads only initializer dims, never
    external data, and is waited for only when some node output has no recorded type. The
    inferred dtypes go onto the IR values; the sizes go to ``model.meta[INFERRED_SIZES]``
    instead of value shapes, because parsing and re-serialising 50k inferred shapes doubled
    the cost of the onnx_ir round trip.
    """
    undescribed = [v for g in graphs for node in g for v in node.outputs
                   if v.name and (v.type is None or v.shape is None)]
    untyped = {v for v in undescribed if v.type is None}
    model.meta[TYPED] = len(graphs) == 1  # until an untyped value stays untyped
    if not untyped:
        return model
    model.meta[UNTYPED_AT_LOAD] = untyped
    facts = facts()
    if isinstance(facts, str):  # a partial answer is still better than none: keep going
        logger.info("shape inference failed (%s); sizes of some values unknown", facts)
        model.meta[TYPED] = False
        return model
    sizes = model.meta.setdefault(INFERRED_SIZES, {})
    for v in undescribed:
        fact = facts.get(v.name)
        if fact is not None:
            if v.type is None:
                v.dtype = fact[0]
            if v.shape is None:
                sizes[v.name] = fact[1]
        elif v.type is None:
            model.meta[TYPED] = False
    return model


def _inferred_facts(proto: onnx.ModelProto) -> dict[str, TensorFact] | str:
    """name -> (dtype, fp32 bytes) of every tensor shape inference types, or why it failed."""
    try:
        inferred = onnx.shape_inference.infer_shapes(proto)
    except Exception as e:
        return _first_line(e)
    return _tensor_facts(inferred.graph, {})


# Below this many nodes checking and inference take a few ms: a fork costs more than it saves.
BACKGROUND_NODES = 4096

TensorFact = tuple[ir.DataType, int | None]
_KNOWN_ELEM_TYPES = frozenset(int(d) for d in ir.DataType)  # (dtype, bytes in fp32 or None)


def _tensor_facts(graph: onnx.GraphProto, by_type: dict[bytes, TensorFact | None],
                  nested: bool = True) -> dict[str, TensorFact]:
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
    for sub in _subgraph_protos(graph) if nested else ():
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
    """``proto`` if it passes the checker, else a copy repaired of what runtimes infer
    anyway (``repair.fill_output_types``) if that passes; else the checker's error."""
    try:
        _check_input(path or proto, label)
        return proto
    except ModelError:
        from amp_rewrite.onnx import repair

        repaired = repair.fill_output_types(proto)
        if repaired is None:
            missing = repair.first_untyped_output(proto)
            if missing is None:
                raise
            raise ModelError(f"{label}: invalid ONNX model: graph output {missing!r} has no "
                             "element type or shape field and shape inference cannot infer "
                             "them; declare its type (onnx.helper.make_tensor_value_info)"
                             ) from None
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
    """The file to write: ``output``, or the default name inside it when it is a directory
    (``DIR/`` with a trailing slash must be one). Its directory must exist and be writable."""
    out = Path(output)
    if out.is_dir():
        if input_path is None:
            raise UsageError(f"{out}: is a directory; give the output file name")
        out = out / default_output_path(input_path).name
    elif str(output).endswith((os.sep, "/")):
        raise UsageError(f"{output}: directory does not exist; create it or give a file name")
    if input_path is not None and _identity(out) == _identity(Path(input_path)):
        raise UsageError(f"{out}: the output would overwrite the input; choose another -o path")
    check_writable_file(out, "-o")
    return out


def check_writable_file(path: str | os.PathLike, flag: str) -> None:
    """``path`` can be created or replaced: not a directory (nor written as one, with a
    trailing slash), in a writable directory."""
    if str(path).endswith((os.sep, "/")) or Path(path).is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable; choose another")


def check_path_conflicts(reads: Mapping[str, Iterable[str | os.PathLike]],
                         writes: Mapping[str, str | os.PathLike]) -> None:
    """No file the run writes is one it reads, nor another file it writes (symlinks, hard
    links and relative paths resolved): exit 2 before anything is written.

    ``reads``: label -> paths (the model, its external-data files, calibration data, rule
    files); ``writes``: label -> path (-o, --report).
    """
    read_ids = {_identity(Path(p)): (label, p) for label, paths in reads.items() for p in paths}
    written: dict[tuple, str] = {}
    for label, path in writes.items():
        ident = _identity(Path(path))
        if ident in read_ids:
            what, source = read_ids[ident]
            raise UsageError(f"{label} {path} is {what} {source}; writing it would destroy an "
                             "input: choose another path")
        if ident in written:
            raise UsageError(f"{label} {path} is also the {written[ident]} path; give each "
                             "output its own file")
        written[ident] = label


def proto_with_weights(model: ir.Model) -> onnx.ModelProto:
    """The model as one in-memory ModelProto with its external weights read in: onnxruntime
    sessions built from bytes (calibration, validation) cannot resolve relative data files."""
    proto = to_proto(model)
    files = external_data_files(model)
    if not files:
        return proto
    if sum(f.stat().st_size for f in files) > PROTOBUF_LIMIT:
        raise ModelError("the model's weights exceed 2 GB: onnxruntime cannot run it from "
                         "memory for calibration or validation; run without them")
    source = model.meta.get(SOURCE_PATH)
    base = source.parent if source is not None else files[0].parent
    onnx.external_data_helper.load_external_data_for_model(proto, str(base))
    return proto


def check_save_target(model: ir.Model, output: str | os.PathLike) -> Path:
    """Where ``save`` may write the model loaded by ``load_model``: the checks of
    ``check_output_path``, and never the source file or one of its external-data files
    (the Python API's guard; the CLI checks all its paths up front)."""
    source = model.meta.get(SOURCE_PATH)
    out = check_output_path(source, output)
    check_path_conflicts({"the input model": [source] if source else [],
                          "an external-data file of the input": external_data_files(model)},
                         {"the output": out})
    return out


def external_data_files(model: ir.Model) -> list[Path]:
    """The files the model's initializers are stored in (recorded by ``load_model``; else
    found by a walk, subgraphs included)."""
    if EXTERNAL_FILES in model.meta:
        return list(model.meta[EXTERNAL_FILES])
    files = {Path(v.const_value.path) for g in model_graphs(model)
             for v in g.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)}
    return sorted(files)


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
    cleared = [(v, v.type, v.shape) for g in model_graphs(model)
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
        for graph in model_graphs(model):  # listed first: unlinking stops the walk
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
        return _retry_with_text_names(model, lambda: ir.to_proto(model))


def _retry_with_text_names(model: ir.Model, serialise):
    """``serialise()``; if it fails on text that is not valid UTF-8, once more with it
    escaped (``repair_all_text``), so the common case pays nothing for the check."""
    try:
        return serialise()
    except Exception:
        repaired = repair_all_text(model)
        if not repaired:
            raise
        _warn_repaired("the model", repaired)
        return serialise()


def save_model(model: ir.Model, output: str | os.PathLike,
               keep: Iterable[str | os.PathLike] = ()) -> Path:
    """Write ``model`` with its weights in a data file beside it, committed as a pair.

    The data file's name is new for each write (``OUTPUT.<token>.data``), so replacing the
    model file is the single commit: a run killed before it leaves the old model with its old
    weights, one killed after it the new pair. Data files of earlier writes to ``output`` go
    only after the commit, except those in ``keep`` (files the run reads). The file is checked
    by path before the commit (in memory the model may be too large for protobuf), so an
    invalid model never lands at ``output``.
    """
    out = Path(output)
    data_name = f"{out.name}.{secrets.token_hex(4)}{DATA_SUFFIX}"
    with _staged(out) as tmp_model:
        with initializers_undescribed(model):
            _retry_with_text_names(
                # binary whatever the name: onnx_ir picks JSON/text from the extension
                model, lambda: ir.save(model, tmp_model, format="protobuf",
                                       external_data=data_name))
        _check_saved(tmp_model)
        os.replace(tmp_model.with_name(data_name), out.parent / data_name)
        _commit(tmp_model, out, data_name, keep)
    logger.info("wrote %s (+ %s)", out, data_name)
    return out


def save_proto(proto: onnx.ModelProto, output: str | os.PathLike,
               keep: Iterable[str | os.PathLike] = ()) -> Path:
    """Write an in-memory model atomically. Writing the ModelProto the check already built
    saves serialising the IR again."""
    out = Path(output)
    with _staged(out) as tmp_model:
        tmp_model.write_bytes(proto.SerializeToString())
        _commit(tmp_model, out, None, keep)
    logger.info("wrote %s", out)
    return out


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` by rename: never half-written (reports, side files)."""
    path = Path(path)
    with _staged(path) as tmp:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return path


DATA_SUFFIX = ".data"
TEMP_PREFIX = ".amp_rewrite_tmp-"  # + pid + "-" + random: see remove_stale_temp_dirs


def _commit(tmp_model: Path, out: Path, data_name: str | None,
            keep: Iterable[str | os.PathLike]) -> None:
    """Replace ``out`` by ``tmp_model`` (one rename), then remove data files of ours that
    nothing references any more: the replaced model's at once, orphans of a run killed
    between its two renames once they are an hour old (a younger one may be a concurrent
    write's, not yet committed). Files the run reads (``keep``) always stay; ``data_name``
    is the new model's own data file (None: weights inline)."""
    ours = [p for p in _our_data_files(out) if p.name != data_name]
    if not ours:  # the common case: nothing to clean, no need to read the replaced model
        os.replace(tmp_model, out)
        return
    replaced = _referenced_data_files(out) if out.is_file() else set()
    os.replace(tmp_model, out)
    kept = {_identity(Path(p)) for p in keep}
    for stale in ours:
        if _identity(stale) in kept:
            continue
        if stale.name in replaced or _age_s(stale) > ORPHAN_AGE_S:
            with contextlib.suppress(OSError):
                stale.unlink()
                logger.info("removed %s (weights no model refers to)", stale)


ORPHAN_AGE_S = 3600


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def _our_data_files(out: Path) -> list[Path]:
    """``OUT.data`` and ``OUT.<8 hex>.data``: the names this module gives data files."""
    pattern = re.compile(re.escape(out.name) + r"(\.[0-9a-f]{8})?" + re.escape(DATA_SUFFIX))
    with contextlib.suppress(OSError):
        return [p for p in out.parent.iterdir() if pattern.fullmatch(p.name) and p.is_file()]
    return []


def _referenced_data_files(model_path: Path) -> set[str]:
    try:
        proto = onnx.load(str(model_path), format="protobuf", load_external_data=False)
    except Exception:  # noqa: BLE001 - unreadable: keep every file
        return {p.name for p in _our_data_files(model_path)}
    return {kv.value for t in proto.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
            for kv in t.external_data if kv.key == "location"}


@contextlib.contextmanager
def _staged(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out`` named ``TEMP_PREFIX<pid>-...``, removed on
    success, failure and KeyboardInterrupt (the CLI turns SIGTERM into one); the caller
    renames its files out. The output is never half-written, the input never touched."""
    remove_stale_temp_dirs(out.parent)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f"{TEMP_PREFIX}{os.getpid()}-") as tmp:
        yield Path(tmp) / out.name


def remove_stale_temp_dirs(directory: Path) -> list[Path]:
    """Remove temp dirs of ours whose process is gone (a run killed with SIGKILL)."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in Path(directory).iterdir():
            pid = _temp_dir_pid(entry)
            if (pid is not None and not _process_alive(pid) or _is_legacy_temp_dir(entry)) \
                    and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
                logger.info("removed %s, left by a killed run", entry)
    return removed


def _is_legacy_temp_dir(entry: Path) -> bool:
    """``.amp_rewrite_XXXXXXXX`` (tempfile's 8 characters), as versions before the pid in
    the name made them; one not touched for an hour belongs to no running rewrite."""
    return LEGACY_TEMP.fullmatch(entry.name) is not None and _age_s(entry) > LEGACY_TEMP_AGE_S


LEGACY_TEMP = re.compile(r"\.amp_rewrite_[a-z0-9_]{8}")
LEGACY_TEMP_AGE_S = 3600


def _temp_dir_pid(entry: Path) -> int | None:
    if not entry.name.startswith(TEMP_PREFIX):
        return None
    pid = entry.name[len(TEMP_PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _identity(path: Path) -> tuple:
    """What two paths must share to be the same file: (device, inode) when it exists (hard
    links, symlinks, ``..``), else the resolved path."""
    try:
        st = path.stat()
        return (st.st_dev, st.st_ino)
    except OSError:
        return (str(path.resolve()),)


def _check_saved(path: Path) -> None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise OutputCheckError(f"internal error: the rewritten model fails the ONNX checker: "
                         f"{_first_line(e)}") from e


def input_had_external_data(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor)
               for v in model.graph.initializers.values())
