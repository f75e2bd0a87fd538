"""Write ONNX models safely: output path checks, atomic writes of a model and its weights
(committed as a pair), cleanup of our temporary and orphaned files."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import onnx
import onnx.external_data_helper
import onnx_ir as ir

from amp_rewrite.errors import ModelError, OutputCheckError, UsageError, first_line
from amp_rewrite.onnx.load import LoadInfo, model_graphs, repair_all_text, warn_repaired

logger = logging.getLogger(__name__)
PROTOBUF_LIMIT = 2**31 - 1


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
    parent = Path(path).parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable; choose another")


def check_path_conflicts(reads: Mapping[str, Iterable[str | os.PathLike]],
                         writes: Mapping[str, str | os.PathLike]) -> None:
    """No file the run writes is one it reads, nor another file it writes (links and
    relative paths resolved): exit 2 before anything is written. ``reads``: label -> paths;
    ``writes``: label -> path."""
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


def proto_with_weights(model: ir.Model, info: LoadInfo) -> onnx.ModelProto:
    """The model as one in-memory ModelProto with its external weights read in: onnxruntime
    sessions built from bytes (calibration, validation) cannot resolve relative data files."""
    proto = to_proto(model, info)
    files = external_data_files(model, info)
    if not files:
        return proto
    if sum(f.stat().st_size for f in files) > PROTOBUF_LIMIT:
        raise ModelError("the model's weights exceed 2 GB: onnxruntime cannot run it from "
                         "memory for calibration or validation; run without them")
    base = info.source.parent if info.source is not None else files[0].parent
    onnx.external_data_helper.load_external_data_for_model(proto, str(base))
    return proto


def check_save_target(model: ir.Model, info: LoadInfo, output: str | os.PathLike) -> Path:
    """Where ``save`` may write the model loaded by ``load_model``: the checks of
    ``check_output_path``, and never the source file or one of its external-data files
    (the Python API's guard; the CLI checks all its paths up front)."""
    source = info.source
    out = check_output_path(source, output)
    check_path_conflicts({"the input model": [source] if source else [],
                          "an external-data file of the input":
                              external_data_files(model, info)},
                         {"the output": out})
    return out


def external_data_files(model: ir.Model, info: LoadInfo) -> list[Path]:
    """The files the model's initializers are stored in (recorded by ``load_model`` for a
    file; else found by a walk, subgraphs included)."""
    if info.external_files is not None:
        return list(info.external_files)
    files = {Path(v.const_value.path) for g in model_graphs(model, info.flat)
             for v in g.initializers.values() if isinstance(v.const_value, ir.ExternalTensor)}
    return sorted(files)


def needs_external_data(model: ir.Model, had_external: bool) -> bool:
    if had_external:
        return True
    total = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                if v.const_value is not None)
    return total > PROTOBUF_LIMIT // 2


@contextlib.contextmanager
def initializers_undescribed(model: ir.Model, info: LoadInfo) -> Iterator[None]:
    """While serialising, initializers get no (redundant) value_info unless the input gave
    them one; the IR keeps its types."""
    described = info.described
    cleared = [(v, v.type, v.shape) for g in model_graphs(model, info.flat)
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


def to_proto(model: ir.Model, info: LoadInfo) -> onnx.ModelProto:
    with initializers_undescribed(model, info):
        return serialised(model)


def serialised(model: ir.Model) -> onnx.ModelProto:
    """``ir.to_proto(model)``, with text that is not valid UTF-8 escaped in place first if
    serialising fails on it (names a file's bytes gave, kept as bytes by protobuf)."""
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
        warn_repaired("the model", repaired)
        return serialise()


def save_model(model: ir.Model, info: LoadInfo, output: str | os.PathLike,
               keep: Iterable[str | os.PathLike] = ()) -> Path:
    """Write ``model`` with its weights in a data file beside it, committed as a pair.

    The data file's name is new for each write (``OUTPUT.<token>.data``), so replacing the
    model file is the single commit (decision 0009). Data files of earlier writes to
    ``output`` go after the commit, except those in ``keep`` (files the run reads). The file
    is checked before the commit, so an invalid model never lands at ``output``.
    """
    out = Path(output)
    data_name = f"{out.name}.{secrets.token_hex(4)}{DATA_SUFFIX}"
    with _staged(out) as tmp_model:
        with initializers_undescribed(model, info):
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
    """Replace ``out`` by ``tmp_model`` (one rename), then remove data files of ours nothing
    references: the replaced model's at once, orphans once an hour old (a younger one may
    be a concurrent write's). ``keep`` always stays; ``data_name``: the new data file."""
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


def remove_stale_temp_dirs(directory: Path) -> None:
    """Remove temp dirs of ours whose process is gone (a run killed with SIGKILL)."""
    with contextlib.suppress(OSError):
        for entry in Path(directory).iterdir():
            pid = _temp_dir_pid(entry)
            if pid is not None and not _process_alive(pid) and entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
                logger.info("removed %s, left by a killed run", entry)


def _temp_dir_pid(entry: Path) -> int | None:
    if not entry.name.startswith(TEMP_PREFIX):
        return None
    pid = entry.name[len(TEMP_PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only the existence check
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        pass
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
                         f"{first_line(e)}") from e
