"""Fuse-then-plan against ORT's transformers optimizer + float16 and ModelOpt AutoCast.

On the zoo architectures (torch.onnx dynamo exports, random weights), fp16, one run:

* ``amp_rewrite``: ``rewrite_onnx(fuse=True, target="ort")``; ``amp_rewrite_nofuse``: the
  same with ``fuse=False`` (the plan on the spelled-out graph);
* ``ort_optimizer``: ``onnxruntime.transformers.optimizer.optimize_model(path, model_type=T)``
  then ``.convert_float_to_float16(keep_io_types=True)``, for every model type in
  ``ORT_MODEL_TYPES``; the best valid result per model is kept (most fused ops, then fewest
  casts, then smallest error) and its model type printed;
* ``modelopt``: NVIDIA ModelOpt AutoCast (``amp_rewrite.bench.peers``; its own venv through
  ``AMP_REWRITE_MODELOPT_PYTHON``).

Per model and converter: casts, fused ops (nodes of the fused kinds in the output), share of
values in low precision (by count), deny-class ops left in fp16, max relative error vs the
FP32 model under onnxruntime and under onnx.reference (true fp16 rounding; the contrib ops run
on ``amp_rewrite.onnx.reference_ops``), validity (checker, ORT, both errors ≤ 1e-2, no new
NaN/Inf), and ``ort_fused``: fused ops in onnxruntime's own optimised graph
(ORT_ENABLE_EXTENDED, CPU provider) of the output, next to that of the FP32 input
(``fp32 ort_fused``); ``splits``: casts placed on a value inside a chain that ORT's optimiser
fuses in the FP32 model (provider-independent: such a cast keeps ORT from fusing the chain).

    AMP_REWRITE_CACHE=... python tools/compare_fusion.py [--names bert t5] [--opset 23]
        [--target ort|onnx] [--out results/compare_fusion.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from amp_rewrite.bench import corpus, peers, zoo
from amp_rewrite.core import OpClass, load_rules
from amp_rewrite.onnx import validate

log = logging.getLogger("compare_fusion")
TOLERANCE = 1e-2
ORT_MODEL_TYPES = ("bert", "gpt2", "t5", "bart", "vit", "clip", "swin", "conformer")
FUSED_KINDS = {"LayerNormalization", "RMSNormalization", "Gelu", "Attention",
               "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"}
FLOAT16 = onnx.TensorProto.FLOAT16
COLUMNS = ["model", "converter", "valid", "casts", "fused", "share", "deny_low", "ort_rel",
           "ref_rel", "ort_fused", "splits", "note"]


def fused_ops(model: onnx.ModelProto) -> int:
    """Nodes of fused kinds: any com.microsoft op, and the standard fused norms/GELU/attention."""
    return sum(1 for g in corpus.iter_graphs(model.graph) for n in g.node
               if n.domain == "com.microsoft" or n.op_type in FUSED_KINDS)


def ort_session_fused(model: onnx.ModelProto) -> int | None:
    """Fused ops in onnxruntime's own optimised graph (ORT_ENABLE_EXTENDED, CPU)."""
    optimized = ort_optimized(model)
    return None if optimized is None else fused_ops(optimized)


def ort_optimized(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """onnxruntime's own optimised graph (ORT_ENABLE_EXTENDED, CPU), None if it fails."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = os.path.join(tmp, "optimized.onnx")
        options.log_severity_level = 4
        try:
            ort.InferenceSession(model.SerializeToString(), options,
                                 providers=["CPUExecutionProvider"])
            return onnx.load(options.optimized_model_filepath)
        except Exception as e:  # a model ORT cannot load has no optimised graph
            log.info("ORT cannot optimise: %s", str(e).splitlines()[0])
            return None


def fused_away(fp32: onnx.ModelProto) -> set[str]:
    """Values inside chains that ORT's optimiser fuses in the FP32 model: produced by a node
    there, gone from its optimised graph (fusions keep only a chain's boundary values)."""
    optimized = ort_optimized(fp32)
    if optimized is None:
        return set()
    kept = {v for n in optimized.graph.node for v in (*n.input, *n.output)}
    constant = {o for n in fp32.graph.node if n.op_type == "Constant" for o in n.output}
    return {o for n in fp32.graph.node for o in n.output if o not in kept and o not in constant}


def split_chains(inside: set[str], converted: onnx.ModelProto) -> int:
    """Casts on a value inside a chain ORT fuses in FP32: each splits that chain (ORT's
    fusions do not reach across a Cast). Independent of the execution provider."""
    return sum(1 for n in converted.graph.node if n.op_type == "Cast" and n.input[0] in inside)


def deny_ops_low(model: onnx.ModelProto, deny: set[str]) -> int:
    """Deny-class nodes with a float16 input or output (shape-inferred types)."""
    inferred = corpus.infer_types(model)
    types = {v.name: v.type.tensor_type.elem_type for g in corpus.iter_graphs(inferred.graph)
             for v in (*g.input, *g.output, *g.value_info)}
    types.update({t.name: t.data_type for g in corpus.iter_graphs(inferred.graph)
                  for t in g.initializer})
    return sum(1 for g in corpus.iter_graphs(inferred.graph) for n in g.node
               if n.op_type in deny and n.domain in ("", "ai.onnx")
               and any(types.get(x) == FLOAT16 for x in (*n.input, *n.output)))


def max_rel(reference: dict, got: dict) -> tuple[float, bool]:
    errors = validate.compare(reference, got)
    return max(e.max_rel for e in errors), any(e.new_nonfinite for e in errors)


def evaluate(fp32_out: dict, feeds: dict, converted: onnx.ModelProto, deny: set[str],
             inside: set[str]) -> dict:
    row = {"casts": corpus.count_casts(converted), "fused": fused_ops(converted),
           "splits": split_chains(inside, converted),
           "share": corpus.low_precision_share(converted, "float16")[0],
           "deny_low": deny_ops_low(converted, deny), "ort_fused": ort_session_fused(converted)}
    failures = []
    checker = corpus._checker_error(converted)
    if checker:
        failures.append(f"checker: {checker}")
    for key, run in (("ort_rel", validate.run), ("ref_rel", validate.reference_run)):
        try:
            rel, nonfinite = max_rel(fp32_out, run(converted, validate.as_declared(converted,
                                                                                     feeds)))
        except Exception as e:  # a failed run is a finding, reported per converter
            row[key] = None
            failures.append(f"{key}: {corpus.first_line(e)[:80]}")
            continue
        row[key] = rel
        if nonfinite or not rel <= TOLERANCE:
            failures.append(f"{key}: {'new NaN/Inf' if nonfinite else f'{rel:.3g} > {TOLERANCE}'}")
    row["valid"] = not failures
    row["note"] = failures[0][:70] if failures else ""
    return row


def ort_optimizer_candidates(path: Path) -> dict[str, onnx.ModelProto]:
    from onnxruntime.transformers import optimizer

    out = {}
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)  # its shape inference and fp16 conversion leave files in the cwd
        try:
            for model_type in ORT_MODEL_TYPES:
                try:
                    optimized = optimizer.optimize_model(str(path), model_type=model_type)
                    optimized.convert_float_to_float16(keep_io_types=True)
                    out[model_type] = optimized.model
                except Exception as e:  # a model type that does not fit this architecture
                    log.info("ort optimizer %s failed: %s", model_type, e)
        finally:
            os.chdir(here)
    return out


def best_ort_optimizer(fp32_out, feeds, path: Path, deny, inside) -> dict | None:
    """Every model type evaluated; the best valid one (else the best invalid one) kept."""
    rows = []
    for model_type, model in ort_optimizer_candidates(path).items():
        row = evaluate(fp32_out, feeds, model, deny, inside)
        row["note"] = f"model_type={model_type} {row['note']}".strip()
        rows.append(row)
    if not rows:
        return None
    err = [(max(r["ort_rel"] or 1e9, r["ref_rel"] or 1e9)) for r in rows]
    order = sorted(range(len(rows)),
                   key=lambda i: (not rows[i]["valid"], -rows[i]["fused"], rows[i]["casts"],
                                  err[i]))
    return rows[order[0]]


def converters(target: str) -> dict[str, Callable[[onnx.ModelProto], onnx.ModelProto]]:
    import amp_rewrite

    chosen = {
        "amp_rewrite": lambda m: amp_rewrite.rewrite_onnx(m, dtype="float16", fuse=True,
                                                          target=target),
        "amp_rewrite_nofuse": lambda m: amp_rewrite.rewrite_onnx(m, dtype="float16",
                                                                 fuse=False),
    }
    modelopt = peers.PEERS["modelopt_autocast"]
    reason = modelopt.unavailable_reason()
    if reason:
        log.warning("ModelOpt unavailable: %s", reason)
    else:
        chosen["modelopt"] = lambda m: modelopt(m, "float16")
    return chosen


def compare_model(name: str, chosen: dict, deny: set[str], opset: int | None) -> list[dict]:
    path = zoo.cached_onnx(name, opset=opset)
    fp32 = onnx.load(path)
    feeds = zoo.onnx_inputs(zoo.build(name), path)
    fp32_out = validate.run(fp32, feeds)
    inside = fused_away(fp32)
    base = {"model": name}
    rows = [dict(base, converter="fp32", valid=True, casts=corpus.count_casts(fp32),
                 fused=fused_ops(fp32), share=0.0, deny_low=0, ort_rel=0.0, ref_rel=None,
                 ort_fused=ort_session_fused(fp32), note="input")]
    for conv_name, convert in chosen.items():
        start = time.perf_counter()
        try:
            converted = convert(onnx.load(path))
        except Exception as e:  # a converter that fails on a model is a result too
            rows.append(dict(base, converter=conv_name, valid=False,
                             note=f"conversion failed: {corpus.first_line(e)[:60]}"))
            continue
        row = evaluate(fp32_out, feeds, converted, deny, inside)
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(dict(base, converter=conv_name, **row))
    ort_row = best_ort_optimizer(fp32_out, feeds, path, deny, inside)
    if ort_row is not None:
        rows.append(dict(base, converter="ort_optimizer", **ort_row))
    return rows


def fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def print_table(rows: list[dict]) -> None:
    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in COLUMNS}
    print("  ".join(c.ljust(widths[c]) for c in COLUMNS))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(widths[c]) for c in COLUMNS))


def targets(rows: list[dict]) -> dict[str, list[str]]:
    """Per model, the issue's targets that amp_rewrite misses (empty lists: all met)."""
    missed: dict[str, list[str]] = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = {r["converter"]: r for r in rows if r["model"] == name}
        ours, misses = mine.get("amp_rewrite"), []
        if ours is None or not ours.get("valid"):
            missed[name] = ["amp_rewrite output invalid"]
            continue
        ortp, mo, fp32 = mine.get("ort_optimizer"), mine.get("modelopt"), mine["fp32"]
        if ortp and ortp.get("valid") and ours["casts"] > ortp["casts"]:
            misses.append(f"casts {ours['casts']} > ORT optimizer {ortp['casts']}")
        if ortp and ours["fused"] < ortp.get("fused", 0):
            misses.append(f"fused {ours['fused']} < ORT optimizer {ortp['fused']}")
        if mo and mo.get("valid"):
            if ours["casts"] > mo["casts"]:
                misses.append(f"casts {ours['casts']} > ModelOpt {mo['casts']}")
            if (ours["share"] or 0) < (mo["share"] or 0):
                misses.append(f"share {ours['share']:.3f} < ModelOpt {mo['share']:.3f}")
        if ours["deny_low"]:
            misses.append(f"{ours['deny_low']} deny ops low")
        for peer in (ortp, mo):
            if peer and peer.get("valid"):
                for key in ("ort_rel", "ref_rel"):
                    if (ours[key] or 0) > (peer[key] or 0):
                        misses.append(f"{key} {ours[key]:.2g} > {peer['converter']} "
                                      f"{peer[key]:.2g}")
        if ours["splits"]:
            misses.append(f"{ours['splits']} casts split chains ORT fuses in FP32")
        if (ours["ort_fused"] or 0) < (fp32["ort_fused"] or 0):
            misses.append(f"ORT-CPU session fuses {ours['ort_fused']} < FP32's "
                          f"{fp32['ort_fused']}")
        missed[name] = misses
    return missed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", nargs="*", default=list(zoo.NAMES))
    p.add_argument("--out", type=Path, default=Path("results/compare_fusion.json"))
    p.add_argument("--opset", type=int, default=None, help="zoo export opset (default 18)")
    p.add_argument("--target", choices=["ort", "onnx"], default="ort",
                   help="amp_rewrite's fusion target")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("ignore")
    chosen = converters(args.target)
    deny = set(load_rules("onnx").ops(OpClass.DENY))
    rows = []
    for name in args.names:
        rows += compare_model(name, chosen, deny, args.opset)
        print(f"[{name} done]", file=sys.stderr, flush=True)
    print_table(rows)
    missed = targets(rows)
    print()
    for name, misses in missed.items():
        print(f"{name:16} {'all targets met' if not misses else '; '.join(misses)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "targets_missed": missed}, indent=1,
                                   default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
