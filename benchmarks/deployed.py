"""Decoders as deployed: amp_rewrite against ORT's transformers optimizer + float16 and
ModelOpt AutoCast on the KV-cache exports of ``bench.decoders``.

Per model and converter: the fp16 share of the float compute nodes, casts added, cast
traffic (bytes Cast nodes read and write at the decode step's shapes), fused attention /
GroupQueryAttention / RotaryEmbedding nodes, the error against PyTorch float32 under true
rounding (``onnx.reference``) at fixed inputs and at a 1,000-token past, and for
amp_rewrite's ``low_io`` cache the bytes saved per step and the error after 32 chained
decode steps fed their own cache.

``python -m benchmarks decoders [--provider cpu|cuda]`` prints the table; ``cuda``
times each model with IO binding (median of 100 runs after warm-up).
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx

from amp_rewrite.core.metric import worst_relative_error
from tests.models import decoders

logger = logging.getLogger(__name__)

LOW_IO = ("past_key_values.*", "present.*")
LONG_PAST = 1000
CHAIN_STEPS = 32
_FLOAT = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_LOW = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_ITEMSIZE = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2,
             onnx.TensorProto.BFLOAT16: 2, onnx.TensorProto.DOUBLE: 8,
             onnx.TensorProto.INT64: 8, onnx.TensorProto.INT32: 4, onnx.TensorProto.BOOL: 1}


# ----------------------------------------------------------------------------- metrics


def relative_error(got: list[np.ndarray], ref: list[np.ndarray]) -> float:
    """The product's metric (``amp_rewrite.core.metric``, what ``--validate`` and
    ``--max-error`` measure) of the outputs ``got`` against ``ref``, in order."""
    return worst_relative_error(ref, got)


def node_dtypes(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, list[int]]]:
    """Each main-graph node with its outputs' element types (contrib ops included)."""
    from amp_rewrite.onnx import load as io
    from amp_rewrite.onnx.passes import infer_missing_types

    ir_model = io.load_model(onnx.ModelProto.FromString(model.SerializeToString())).model
    infer_missing_types(ir_model)
    out = []
    for node, ir_node in zip(model.graph.node, ir_model.graph, strict=True):
        out.append((node, [int(v.dtype) if v.dtype is not None else 0
                           for v in ir_node.outputs]))
    return out


def low_share(model: onnx.ModelProto) -> tuple[int, int]:
    """(low, all) float compute nodes: nodes with a float output, casts and constants aside."""
    low = total = 0
    for node, types in node_dtypes(model):
        if node.op_type in ("Cast", "Constant", "CastLike") or not _FLOAT & set(types):
            continue
        total += 1
        low += bool(_LOW & set(types))
    return low, total


def fused_ops(model: onnx.ModelProto) -> dict[str, int]:
    """Attention-family and rotary nodes by op type."""
    wanted = ("Attention", "MultiHeadAttention", "GroupQueryAttention", "RotaryEmbedding")
    counts: dict[str, int] = {}
    for node in model.graph.node:
        if node.op_type in wanted:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def cast_traffic(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> tuple[int, int]:
    """(Cast nodes, bytes they read and write) running on ``feeds`` (onnxruntime, CPU)."""
    probe = onnx.ModelProto.FromString(model.SerializeToString())
    casts = [n for n in probe.graph.node if n.op_type == "Cast"]
    outputs = {o.name for o in probe.graph.output}
    itemsize_in = {}
    produced = {o: t for n, ts in node_dtypes(probe) for o, t in zip(n.output, ts)}
    inputs = {i.name: i.type.tensor_type.elem_type for i in probe.graph.input}
    inits = {i.name: i.data_type for i in probe.graph.initializer}
    for cast in casts:
        src = cast.input[0]
        itemsize_in[cast.output[0]] = _ITEMSIZE.get(
            produced.get(src) or inputs.get(src) or inits.get(src) or 1, 4)
        if cast.output[0] not in outputs:
            to = next(a.i for a in cast.attribute if a.name == "to")
            probe.graph.output.append(onnx.helper.make_tensor_value_info(cast.output[0], to, None))
    if not casts:
        return 0, 0
    got = dict(zip([o.name for o in probe.graph.output], _run(probe, feeds)))
    total = 0
    for cast in casts:
        value = got[cast.output[0]]
        total += value.size * (value.itemsize + itemsize_in[cast.output[0]])
    return len(casts), total


# ----------------------------------------------------------------------------- running


def _as_declared(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict:
    from amp_rewrite.onnx.validate import as_declared

    return as_declared(model, feeds)


def _run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return session.run(None, {k: v for k, v in _as_declared(model, feeds).items() if k in names})


def run_reference(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs under true rounding: every op in its declared dtype (``onnx.reference``)."""
    from amp_rewrite.onnx.validate import reference_evaluator

    names = {i.name for i in model.graph.input}
    feeds = {k: v for k, v in _as_declared(model, feeds).items() if k in names}
    return [np.asarray(o, dtype=np.float32) for o in reference_evaluator(model).run(None, feeds)]


def run_ort(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(o, dtype=np.float32) for o in _run(model, feeds)]


def chained_error(model: onnx.ModelProto, name: str, run: Callable = run_reference,
                  steps: int = CHAIN_STEPS) -> float:
    """Error of the last step's outputs after ``steps`` decode steps, each fed the cache the
    previous step returned (the model's own, in its own dtype), against PyTorch float32
    fed its own float32 cache, on the same token sequence."""
    import torch

    module = decoders.build(name)
    feeds = decoders.inputs(name)
    ref_feeds = dict(feeds)
    past = decoders.PAST
    rng = np.random.default_rng(1)
    in_names = decoders.input_names(name)
    cache_names = [n for n in in_names if n.startswith("past_key_values.")
                   and ".encoder." not in n]
    out_names = decoders.output_names(name)
    got = ref = []
    for _ in range(steps):
        got = run(model, feeds)
        with torch.no_grad():
            ref = [t.numpy() for t in module(*(torch.from_numpy(np.ascontiguousarray(ref_feeds[n]))
                                               for n in in_names))]
        token = rng.integers(4, decoders.VOCAB, (1, 1), dtype=np.int64)
        past += 1
        # float32 copies of fp16/bf16 outputs are exact: as_declared gives back the same bits
        for step_feeds, outs in ((feeds, got), (ref_feeds, ref)):
            by_name = dict(zip(out_names, outs))
            step_feeds["input_ids"] = token
            if "attention_mask" in step_feeds:
                step_feeds["attention_mask"] = np.ones((1, past + 1), np.int64)
                step_feeds["position_ids"] = np.array([[past]], np.int64)
            for cache in cache_names:
                step_feeds[cache] = by_name[cache.replace("past_key_values.", "present.")]
    return relative_error(got, ref)


# ----------------------------------------------------------------------------- converters


def convert_ours(path: Path, dtype: str = "float16", **options) -> onnx.ModelProto:
    import amp_rewrite

    return amp_rewrite.rewrite_onnx(str(path), dtype=dtype, **options)


def convert_ort_optimizer(path: Path, dtype: str = "float16") -> onnx.ModelProto:
    """ORT's transformers optimizer + float16, the best-fusing model type for the model."""
    from benchmarks.peers import ort_optimizer_fp16

    best, best_fused = None, -1
    for model_type in ("gpt2", "bert", "bart"):
        try:
            model = ort_optimizer_fp16(path, model_type)
        except Exception as e:  # its fusions raise on graphs they do not expect
            logger.info("ORT optimizer %s failed: %s", model_type, e)
            continue
        fused = sum(fused_ops(model).values())
        if fused > best_fused:
            best, best_fused = model, fused
    if best is None:
        raise RuntimeError("ORT's transformers optimizer failed for every model type")
    # Its float16 conversion appends the casts of graph inputs after their readers; ORT
    # sorts a graph when it loads it (so ORT users never notice), the checker does not.
    import onnx_ir as ir

    graph = ir.from_proto(best)
    graph.graph.sort()
    return ir.to_proto(graph)


_MODELOPT = """
import sys
from modelopt.onnx.autocast import convert_to_mixed_precision
import onnx
low = {"float16": "fp16", "bfloat16": "bf16"}[sys.argv[3]]
model = convert_to_mixed_precision(sys.argv[1], low_precision_type=low, keep_io_types=True,
                                   calibration_data=sys.argv[2])
onnx.save(model, sys.argv[4])
"""


def convert_modelopt(path: Path, dtype: str = "float16", name: str | None = None
                     ) -> onnx.ModelProto:
    """ModelOpt AutoCast in its own interpreter (``peers._modelopt_python``), calibrated on
    the decoder's fixed inputs: its own random feeds give the dynamic past and mask
    lengths that disagree, and its reference run fails."""
    import subprocess
    import tempfile

    from benchmarks.peers import _modelopt_python

    name = name or next(n for n in decoders.DECODERS if Path(path).name.startswith(n + "-"))
    with tempfile.TemporaryDirectory() as tmp:
        feeds = Path(tmp) / "feeds.npz"
        np.savez(feeds, **decoders.inputs(name))
        out = Path(tmp) / "out.onnx"
        python = _modelopt_python() or sys.executable
        done = subprocess.run([python, "-c", _MODELOPT, str(path), str(feeds), dtype, str(out)],
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode:
            raise RuntimeError(f"modelopt failed: {done.stderr.strip().splitlines()[-1:]}")
        return onnx.load(str(out))


def modelopt_unavailable() -> str | None:
    from benchmarks.peers import PEERS

    return PEERS["modelopt_autocast"].unavailable_reason()


# ----------------------------------------------------------------------------- the table


def measure(name: str, convert: Callable[[Path], onnx.ModelProto], *, low_io: bool = False,
            long_past: int = LONG_PAST) -> dict:
    path = decoders.cached_decoder(name)
    fp32 = onnx.load(str(path))
    start = time.perf_counter()
    model = convert(path)
    seconds = time.perf_counter() - start
    feeds = decoders.inputs(name)
    ref = decoders.torch_reference(name, feeds)
    low, total = low_share(model)
    casts, cast_bytes = cast_traffic(model, feeds)
    base_casts = sum(n.op_type == "Cast" for n in fp32.graph.node)
    row = {"model": name, "fp16_share": low / max(total, 1), "low_nodes": low,
           "float_nodes": total, "casts_added": casts - base_casts, "cast_bytes": cast_bytes,
           "fused": fused_ops(model), "seconds": round(seconds, 2),
           "error": relative_error(run_reference(model, feeds), ref),
           "error_ort": relative_error(run_ort(model, feeds), ref)}
    if decoders.spec(name).has_past:
        long = decoders.inputs(name, past=long_past)
        row["error_long"] = relative_error(run_reference(model, long),
                                           decoders.torch_reference(name, long))
        if low_io:
            row["chained_error"] = chained_error(model, name)
            fp32_io = sum(_io_bytes(fp32, long, n) for n in LOW_IO)
            row["low_io_bytes_saved_at_long_past"] = fp32_io // 2
    return row


def _io_bytes(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], pattern: str) -> int:
    import fnmatch

    total = 0
    for name, array in feeds.items():
        if fnmatch.fnmatchcase(name, pattern):
            total += array.nbytes
    if pattern.startswith("present"):  # one row more than the past
        total = sum(a.nbytes // a.shape[2] * (a.shape[2] + 1) for n, a in feeds.items()
                    if fnmatch.fnmatchcase(n, "past_key_values.*") and ".encoder." not in n)
    return total


def rows(names: list[str], peers: bool = True) -> list[dict]:
    converters: list[tuple[str, Callable, bool]] = [
        ("amp_rewrite", convert_ours, False),
        ("amp_rewrite --low-io", lambda p: convert_ours(p, low_io=list(LOW_IO)), True)]
    if peers:
        converters.append(("ort_optimizer+fp16", convert_ort_optimizer, False))
        reason = modelopt_unavailable()
        if reason is None:
            converters.append(("modelopt_autocast", convert_modelopt, False))
        else:
            print(f"modelopt_autocast: not measured ({reason})", file=sys.stderr)
    out = []
    for name in names:
        for label, convert, low_io in converters:
            if low_io and not decoders.spec(name).has_past:
                continue
            try:
                row = measure(name, convert, low_io=low_io)
            except Exception as e:  # a peer failing on a model is a result, not a crash
                row = {"model": name, "failed": f"{type(e).__name__}: {str(e)[:160]}"}
            out.append({"converter": label, **row})
    return out


def format_table(table: list[dict]) -> str:
    head = ("model", "converter", "fp16 share", "casts+", "cast KiB", "fused",
            "err fixed", "err past1000", "low-io saved KiB", "32-step err")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in table:
        if "failed" in r:
            lines.append(f"{r['model']} | {r['converter']} | failed: {r['failed']}")
            continue
        fused = ", ".join(f"{k} {v}" for k, v in sorted(r["fused"].items())) or "none"
        lines.append(" | ".join([
            r["model"], r["converter"], f"{r['fp16_share']:.0%} ({r['low_nodes']}/"
            f"{r['float_nodes']})", str(r["casts_added"]), f"{r['cast_bytes'] / 1024:.1f}",
            fused, f"{r['error']:.1e}", _num(r.get("error_long")),
            _num(r.get("low_io_bytes_saved_at_long_past"), "{:.0f}", 1024),
            _num(r.get("chained_error"))]))
    return "\n".join(lines)


def _num(x, fmt: str = "{:.1e}", scale: float = 1) -> str:
    return "-" if x is None else fmt.format(x / scale)


# ----------------------------------------------------------------------------- GPU timing


def time_cuda(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], runs: int = 100,
              warmup: int = 10) -> float:
    """Median seconds of one run on the CUDA provider with IO binding (inputs and outputs
    stay on the device), after ``warmup`` runs."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(),
                                   providers=["CUDAExecutionProvider"])
    binding = session.io_binding()
    for name, array in _as_declared(model, feeds).items():
        binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array, "cuda", 0))
    for out in session.get_outputs():
        binding.bind_output(out.name, "cuda")
    return median_run_ms(session, binding, runs, warmup) / 1e3


def median_run_ms(session, binding, runs: int, warmup: int) -> float:
    """Median milliseconds of ``runs`` bound runs of ``session`` after ``warmup`` runs (each
    returns after the provider synchronised)."""
    for _ in range(warmup):
        session.run_with_iobinding(binding)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks decoders",
                                description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=list(decoders.DECODERS))
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--no-peers", dest="peers", action="store_false")
    p.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    table = rows(args.models, peers=args.peers)
    if args.provider == "cuda":
        for row in table:
            if "failed" in row:
                continue
            convert = {"amp_rewrite": convert_ours, "ort_optimizer+fp16": convert_ort_optimizer,
                       "modelopt_autocast": convert_modelopt}.get(row["converter"])
            if convert is not None:
                path = decoders.cached_decoder(row["model"])
                row["cuda_ms"] = 1e3 * time_cuda(convert(path), decoders.inputs(row["model"]))
    print(format_table(table))
    if args.provider == "cuda":
        for row in table:
            if "cuda_ms" in row:
                print(f"{row['model']} {row['converter']}: {row['cuda_ms']:.3f} ms (CUDA)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1, default=str))
    return 0
