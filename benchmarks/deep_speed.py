"""Rewrite time of deep real transformer exports against what users of the peers run.

The synthetic chains (``speed chains``) measure per-node cost; this measures the models people convert.
Each zoo architecture is built at a real model's depth (random weights, tiny width: the graph
does not depend on the width), exported with ``torch.onnx.export(dynamo=True)`` and converted
to fp16 by:

* ``amp_rewrite``: ``rewrite_onnx(path, keep_io_types=True, check=False)``, fusion on (the
  default), as the speed benchmark runs it (no peer checks its output); ``amp_rewrite
  --no-fuse``: the same without fusion, the counterpart of the plain converters;
* ``ort_optimizer``: ``onnxruntime.transformers.optimizer.optimize_model(path, model_type=T)``
  then ``.convert_float_to_float16(keep_io_types=True)``: what ORT users run. T is the
  model's own type where ORT's optimizer accepts the export, else ``bert`` (the first of
  ``MODEL_TYPES`` that works is used and printed);
* ``onnxconverter_common`` and ``ort_transformers`` (ORT's float16 converter alone): the two
  plain converters of ``benchmarks.peers``, which fuse nothing.

Converters take turns within each round (the host's speed drifts); the table has medians,
the node count of each output, its fused (``com.microsoft``) ops, its casts, and its max
relative error against the FP32 model
under onnxruntime (CPU) on the zoo model's inputs.

    python -m benchmarks speed deep [--models gpt2 bert llama] [--repeats 3]
        [--layers N] [--cache results/deep_exports] [--json FILE]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import onnx

from amp_rewrite.onnx import validate
from benchmarks import cli, peers
from benchmarks.timing import machine, probe_line, round_robin
from tests.models import zoo

log = logging.getLogger(__name__)

# model -> (HF config key of the depth, a real model's depth, ORT optimizer model type)
DEPTHS = {"gpt2": ("n_layer", 48, "gpt2"),  # GPT-2 XL
          "bert": ("num_hidden_layers", 24, "bert"),  # BERT-large
          "llama": ("num_hidden_layers", 32, "gpt2")}  # Llama-2-7B; ORT has no llama type
MODEL_TYPES = ("bert",)  # fall-backs after the model's own type


def _amp_rewrite(fuse: bool, dtype: str = "float16") -> Callable[[Path], onnx.ModelProto]:
    def convert(path: Path) -> onnx.ModelProto:
        import amp_rewrite

        return amp_rewrite.rewrite_onnx(path, dtype=dtype, keep_io_types=True,
                                        check=False, fuse=fuse)
    return convert


def _ort_optimizer(model_type: str) -> Callable[[Path], onnx.ModelProto]:
    return lambda path: peers.ort_optimizer_fp16(path, model_type)


def _peer(name: str) -> Callable[[Path], onnx.ModelProto]:
    """A plain converter of ``peers.PEERS``, in this process; loading the file is timed as
    for the others, which all read the path."""
    return lambda path: peers.PEERS[name].body(onnx.load(path), "float16")


def build_deep(name: str, depth: int) -> zoo.ZooModel:
    return zoo.build(name, config={DEPTHS[name][0]: depth})


def export_deep(name: str, depth: int, directory: Path) -> Path:
    path = directory / f"{name}-{depth}-layers.onnx"
    if not path.is_file():
        start = time.perf_counter()
        zoo.export_model(build_deep(name, depth), path)
        log.info("exported %s (%d layers) in %.1f s", name, depth, time.perf_counter() - start)
    return path


def ort_optimizer_for(name: str, path: Path) -> tuple[str, Callable] | None:
    """(model type, converter) for the first model type ORT's optimizer accepts."""
    for model_type in dict.fromkeys((DEPTHS[name][2], *MODEL_TYPES)):
        convert = _ort_optimizer(model_type)
        try:
            convert(path)
        except Exception as e:  # ORT's fusions index into graphs they do not expect
            log.warning("ORT optimizer, model_type=%s, fails on %s: %s: %s", model_type,
                        name, type(e).__name__, e)
            continue
        return model_type, convert
    return None


def _summary(model: onnx.ModelProto, fp32_out: dict, feeds: dict) -> dict:
    row = {"nodes": len(model.graph.node),
           "casts": sum(n.op_type == "Cast" for n in model.graph.node),
           "fused": sum(n.domain == "com.microsoft" for n in model.graph.node)}
    try:
        errors = validate.compare(fp32_out, validate.run(model, feeds))
    except Exception as e:  # a converter's invalid output is a result, not a crash
        return {**row, "max_rel": None, "new_nonfinite": False,
                "invalid": str(e).splitlines()[0][:160]}
    return {**row, "max_rel": max(e.max_rel for e in errors),
            "new_nonfinite": any(e.new_nonfinite for e in errors), "invalid": ""}


def converters_for(name: str, path: Path) -> dict[str, Callable[[Path], onnx.ModelProto]]:
    converters = {"amp_rewrite": _amp_rewrite(True), "amp_rewrite --no-fuse": _amp_rewrite(False),
                  "amp_rewrite --dtype mixed": _amp_rewrite(True, "mixed")}
    ort = ort_optimizer_for(name, path)
    if ort is not None:
        converters[f"ort_optimizer[{ort[0]}]"] = ort[1]
    for name in ("onnxconverter_common", "ort_transformers"):
        reason = peers.PEERS[name].unavailable_reason()
        if reason:  # onnxconverter-common is a bench extra
            log.warning("%s skipped: %s", name, reason)
        else:
            converters[name] = _peer(name)
    return converters


def bench_model(name: str, directory: Path, repeats: int, depth: int | None = None
                ) -> list[dict]:
    depth = depth or DEPTHS[name][1]
    path = export_deep(name, depth, directory)
    fp32 = onnx.load(path)
    feeds = zoo.onnx_inputs(build_deep(name, depth), fp32)
    fp32_out = validate.run(fp32, feeds)
    converters = converters_for(name, path)
    times, outputs, probes = round_robin(
        {c: (lambda convert=convert: convert(path)) for c, convert in converters.items()}, repeats)
    rows = []
    for converter, runs in times.items():
        rows.append({"model": name, "layers": depth, "input_nodes": len(fp32.graph.node),
                     "converter": converter, "seconds": statistics.median(runs), "runs": runs,
                     "host_probe": probes,
                     **_summary(outputs[converter], fp32_out, feeds)})
    base = rows[0]["seconds"]
    for row in rows:
        row["vs_amp_rewrite"] = row["seconds"] / base
    return rows


def print_table(rows: list[dict]) -> None:
    head = (f"{'model':7} {'layers':>6} {'nodes':>6}  {'converter':26} {'seconds':>8} "
            f"{'vs ours':>8} {'out nodes':>9} {'fused':>5} {'casts':>5} {'max rel':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        error = "invalid" if r["invalid"] else f"{r['max_rel']:9.2e}"
        bad = " NEW NaN/Inf" if r["new_nonfinite"] else ""
        print(f"{r['model']:7} {r['layers']:6d} {r['input_nodes']:6d}  {r['converter']:26} "
              f"{r['seconds']:8.2f} {r['vs_amp_rewrite']:7.2f}x {r['nodes']:9d} {r['fused']:5d} "
              f"{r['casts']:5d} {error:>9}{bad}")
    for r in rows:
        if r["invalid"]:
            print(f"  {r['model']} {r['converter']}: {r['invalid']}")


def speedup_line(rows: list[dict]) -> str:
    """How many times longer than ours each peer took, per model."""
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        peers_ = [f"{r['converter']} {r['vs_amp_rewrite']:.1f}x" for r in rows
                  if r["model"] == model and not r["converter"].startswith("amp_rewrite")]
        parts.append(f"{model}: " + (", ".join(peers_) or "-"))
    return "peers' time / ours: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEPTHS), choices=list(DEPTHS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, help="one depth for every model (default: "
                        "each model's real depth, DEPTHS)")
    parser.add_argument("--cache", type=Path, default=Path("results/deep_exports"))
    cli.add_json_argument(parser)
    args = parser.parse_args(argv)
    cli.setup_logging()
    args.cache = args.cache.resolve()  # the ORT converters run in a scratch directory
    args.cache.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.models:
        rows.extend(bench_model(name, args.cache, args.repeats, args.layers))
    print_table(rows)
    print(speedup_line(rows))
    print(probe_line([p for r in rows for p in r["host_probe"]]))
    cli.write_json(args.json, {**machine(), "rows": rows})
    return 0
