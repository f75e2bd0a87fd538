"""Fuse-then-plan against ORT's transformers optimizer + float16 and ModelOpt AutoCast.

On the zoo architectures (torch.onnx dynamo exports, random weights), fp16, one run:

* ``amp_rewrite``: ``rewrite_onnx(fuse=True, target="ort")``; ``amp_rewrite_nofuse``: the
  same with ``fuse=False`` (the plan on the spelled-out graph);
* ``ort_optimizer``: ``onnxruntime.transformers.optimizer.optimize_model(path, model_type=T)``
  then ``.convert_float_to_float16(keep_io_types=True)``, for every model type in
  ``ORT_MODEL_TYPES``; the best valid result per model is kept (most fused ops with a kernel,
  then most fused ops, then fewest casts, then smallest error) and its model type printed;
* ``modelopt``: NVIDIA ModelOpt AutoCast (``benchmarks.peers``; its own venv through
  ``AMP_REWRITE_MODELOPT_PYTHON``).

Per model and converter: casts, fused ops (nodes of the fused kinds in the output), share of
values in low precision (by count), deny-class ops left in fp16, max relative error vs the
FP32 model under onnxruntime and under onnx.reference (true fp16 rounding; the contrib ops run
on ``amp_rewrite.onnx.reference_ops``, FusedConv on a kernel here; nodes sorted first),
validity (checker, ORT, both errors ≤ 1e-2, no new
NaN/Inf), ``runs_ort``: whether an onnxruntime CPU session loads and runs it, and
``fused_lowk``: its fused ops less those run in a dtype for which no onnxruntime provider has
a kernel (``FLOAT_ONLY_KERNELS``: an fp16 ``FusedConv`` is a fusion in name only), and
``ort_fused``: fused ops in onnxruntime's own optimised graph
(ORT_ENABLE_EXTENDED, CPU provider) of the output, next to that of the FP32 input
(``fp32 ort_fused``); ``splits``: casts placed on a value inside a chain that ORT's optimiser
fuses in the FP32 model (provider-independent: such a cast keeps ORT from fusing the chain).

    AMP_REWRITE_CACHE=... python -m benchmarks compare fusion [--names bert t5] [--opset 23]
        [--target ort|onnx] [--seeds 4] [--json results/compare_fusion.json] [--markdown F]

Errors are measured on ``--seeds`` input draws (seed 0: the zoo's own inputs; seed s: the
inputs ``zoo.build(name, seed=s)`` draws, same weights): ``*_rel`` is the max over draws of
the max relative error, ``*_rel_mean`` its mean, ``*_rms`` the mean over draws of
rms(error)/rms(FP32 output) (every element counts: the least noisy of the three).
``floor`` / ``wfloor``: the FP32 model's own max relative error when only its float inputs /
only its float weights are rounded to fp16 and everything is computed in float32 (what any
converter that reads the input / stores the weights in fp16 pays at least; a model whose
floor is near the tolerance is ill-conditioned, not badly converted). A converter is
``worse`` than a peer on an error only if the paired per-draw differences say so: mean
difference > 2 standard errors and > 1% of the peer's mean (``significantly_worse``).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from amp_rewrite.core import OpClass, load_rules
from amp_rewrite.onnx import validate
from benchmarks import peers
from tests.models import corpus, zoo

log = logging.getLogger("compare_fusion")
TOLERANCE = 1e-2
ORT_MODEL_TYPES = ("bert", "gpt2", "t5", "bart", "vit", "clip", "swin", "conformer")
FUSED_KINDS = {"LayerNormalization", "RMSNormalization", "Gelu", "Attention",
               "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"}
FLOAT16 = onnx.TensorProto.FLOAT16
COLUMNS = ["model", "converter", "valid", "runs_ort", "casts", "fused", "fused_lowk", "share",
           "deny_low", "ort_rel", "ort_rel_mean", "ort_rms", "ref_rel", "ref_rel_mean", "ref_rms",
           "floor", "wfloor",
           "ort_fused", "splits", "note"]
# Fused contrib ops whose kernels exist for float32 only, in every onnxruntime provider this
# comparison is about. onnxruntime 1.31: CPU registers FusedConv/FusedGemm for float
# (contrib_ops/cpu/fused_conv.cc, fused_gemm.cc); the CUDA provider's FusedConv<T> is
# instantiated for float only (the installed libonnxruntime_providers_cuda.so has the one type
# N11onnxruntime7contrib4cuda9FusedConvIfEE). An fp16 node of these runs on CPU in float
# behind casts ORT inserts, and on CUDA falls back to the CPU provider.
FLOAT_ONLY_KERNELS = {"FusedConv", "FusedGemm"}


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
    try:
        return peers.ort_optimized_graph(model)
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


def fused_without_low_kernel(model: onnx.ModelProto) -> int:
    """Fused ops of ``FLOAT_ONLY_KERNELS`` that read a non-float32 tensor: no provider has a
    kernel for the dtype they are meant to run in."""
    types = _value_types(model)
    return sum(1 for g in corpus.iter_graphs(model.graph) for n in g.node
               if n.domain == "com.microsoft" and n.op_type in FLOAT_ONLY_KERNELS
               and types.get(n.input[0], onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT)


def _value_types(model: onnx.ModelProto) -> dict[str, int]:
    inferred = corpus.infer_types(model)
    types = {v.name: v.type.tensor_type.elem_type for g in corpus.iter_graphs(inferred.graph)
             for v in (*g.input, *g.output, *g.value_info)}
    types.update({t.name: t.data_type for g in corpus.iter_graphs(inferred.graph)
                  for t in g.initializer})
    return types


def deny_ops_low(model: onnx.ModelProto, deny: set[str]) -> int:
    """Deny-class nodes with a float16 input or output (shape-inferred types)."""
    types = _value_types(model)
    return sum(1 for g in corpus.iter_graphs(model.graph) for n in g.node
               if n.op_type in deny and n.domain in ("", "ai.onnx")
               and any(types.get(x) == FLOAT16 for x in (*n.input, *n.output)))


def max_rel(reference: dict, got: dict) -> tuple[float, bool]:
    errors = validate.compare(reference, got)
    return max(e.max_rel for e in errors), any(e.new_nonfinite for e in errors)


@dataclass
class Draws:
    """Input draws of one model and the FP32 model's outputs on each."""

    feeds: list[dict]
    fp32_out: list[dict]


def rms_rel(reference: dict, got: dict) -> float:
    """Largest over float outputs of rms(got - reference) / rms(reference): every element
    counts, so it is far less noisy across input draws than the max."""
    worst = 0.0
    for name, ref in reference.items():
        if not np.issubdtype(ref.dtype, np.floating):
            continue
        ref64, out64 = ref.astype(np.float64), np.asarray(got[name], np.float64)
        finite = np.isfinite(ref64) & np.isfinite(out64)
        scale = np.sqrt(np.mean(ref64[finite] ** 2)) if finite.any() else 0.0
        diff = np.sqrt(np.mean((out64[finite] - ref64[finite]) ** 2)) if finite.any() else 0.0
        worst = max(worst, float(diff / max(scale, 1e-30)))
    return worst


def errors_over_draws(converted: onnx.ModelProto, draws: Draws,
                      run: Callable) -> tuple[list[float], list[float], bool]:
    """Max relative error and rms relative error per draw, and whether any draw had new
    NaN/Inf."""
    rels, rms, nonfinite = [], [], False
    for feeds, reference in zip(draws.feeds, draws.fp32_out):
        got = run(converted, validate.as_declared(converted, feeds))
        rel, bad = max_rel(reference, got)
        rels.append(rel)
        rms.append(rms_rel(reference, got))
        nonfinite |= bad
    return rels, rms, nonfinite


def sorted_reference_run(model: onnx.ModelProto, feeds: dict) -> dict:
    """``validate.reference_run`` on the model with its nodes in topological order:
    onnx.reference needs that order and ORT does not (the ORT optimizer path's fp16 graphs
    read a cast before the node making it); the computation is the same. The ORT path's
    ``FusedConv`` gets a kernel here too (amp_rewrite never emits it)."""
    import onnx_ir as ir
    from onnx.reference import ReferenceEvaluator

    ir_model = ir.from_proto(model)
    ir_model.graph.sort()
    sorted_model = ir.to_proto(ir_model)
    names = [o.name for o in sorted_model.graph.output]
    evaluator = ReferenceEvaluator(sorted_model,
                                   new_ops=[*validate._reference_fixes(), _fused_conv_kernel()])
    return dict(zip(names, evaluator.run(None, dict(feeds))))


def _fused_conv_kernel() -> type:
    """onnx.reference kernel for com.microsoft FusedConv: Conv (+ Z) then the activation,
    computed as the standard Conv in the declared dtype."""
    from onnx.reference.op_run import OpRun
    from onnx.reference.ops.op_conv import _conv_implementation

    activations = {
        "Relu": lambda y, p: np.maximum(y, 0),
        "Clip": lambda y, p: np.clip(y, p[0], p[1]),
        "LeakyRelu": lambda y, p: np.where(y >= 0, y, y * p[0]),
        "Sigmoid": lambda y, p: 1 / (1 + np.exp(-y)),
        "Tanh": lambda y, p: np.tanh(y),
    }

    class FusedConv(OpRun):
        op_domain = "com.microsoft"

        def _run(self, X, W, B=None, Z=None, activation=None, activation_params=None,
                 auto_pad=None, dilations=None, group=None, kernel_shape=None, pads=None,
                 strides=None):
            spatial = W.ndim - 2  # the attribute defaults of Conv
            y = _conv_implementation(
                X, W, B, auto_pad or "NOTSET", dilations or [1] * spatial, group or 1,
                kernel_shape or list(W.shape[2:]), pads or [0] * 2 * spatial,
                strides or [1] * spatial).astype(X.dtype)
            if Z is not None:
                y = (y + Z).astype(X.dtype)
            if activation:
                params = [X.dtype.type(v) for v in (activation_params or [])]
                y = activations[activation.decode() if isinstance(activation, bytes)
                                else activation](y, params).astype(X.dtype)
            return (y,)

    return FusedConv


def evaluate(draws: Draws, converted: onnx.ModelProto, deny: set[str],
             inside: set[str]) -> dict:
    fused = fused_ops(converted)
    row = {"casts": corpus.count_casts(converted), "fused": fused,
           "fused_lowk": fused - fused_without_low_kernel(converted),
           "splits": split_chains(inside, converted),
           "share": corpus.low_precision_share(converted, "float16")[0],
           "deny_low": deny_ops_low(converted, deny), "ort_fused": ort_session_fused(converted)}
    failures = []
    checker = corpus._checker_error(converted)
    if checker:
        failures.append(f"checker: {checker}")
    for key, run in (("ort_rel", validate.run), ("ref_rel", sorted_reference_run)):
        try:
            rels, rms, nonfinite = errors_over_draws(converted, draws, run)
        except Exception as e:  # a failed run is a finding, reported per converter
            row[key] = row[f"{key}_mean"] = row[key.replace("_rel", "_rms")] = None
            failures.append(f"{key}: {corpus.first_line(e)[:80]}")
            continue
        row[key], row[f"{key}_mean"] = max(rels), float(np.mean(rels))
        row[key.replace("_rel", "_rms")] = float(np.mean(rms))
        row[f"{key}_draws"], row[key.replace("_rel", "_rms") + "_draws"] = rels, rms
        if nonfinite or not row[key] <= TOLERANCE:
            why = "new NaN/Inf" if nonfinite else f"{row[key]:.3g} > {TOLERANCE}"
            failures.append(f"{key}: {why}")
    row["runs_ort"] = row["ort_rel"] is not None
    row["valid"] = not failures
    row["note"] = failures[0][:70] if failures else ""
    return row


def ort_optimizer_candidates(path: Path) -> dict[str, onnx.ModelProto]:
    out = {}
    for model_type in ORT_MODEL_TYPES:
        try:
            out[model_type] = peers.ort_optimizer_fp16(path, model_type)
        except Exception as e:  # a model type that does not fit this architecture
            log.info("ort optimizer %s failed: %s", model_type, e)
    return out


def best_ort_optimizer(draws: Draws, path: Path, deny, inside) -> dict | None:
    """Every model type evaluated; the best valid one (else the best invalid one) kept."""
    rows = []
    for model_type, model in ort_optimizer_candidates(path).items():
        row = evaluate(draws, model, deny, inside)
        row["note"] = f"model_type={model_type} {row['note']}".strip()
        rows.append(row)
    if not rows:
        return None
    err = [(max(r["ort_rel"] or 1e9, r["ref_rel"] or 1e9)) for r in rows]
    order = sorted(range(len(rows)),
                   key=lambda i: (not rows[i]["valid"], -rows[i]["fused_lowk"],
                                 -rows[i]["fused"], rows[i]["casts"],
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


def input_draws(name: str, path: Path, fp32: onnx.ModelProto, seeds: int) -> Draws:
    """Seed 0: the zoo model's inputs; seed s: the inputs ``zoo.build(name, seed=s)`` draws
    (only its inputs are used: the weights stay those of the exported model)."""
    feeds = [zoo.onnx_inputs(zoo.build(name, seed=s), path) for s in range(seeds)]
    return Draws(feeds, [validate.run(fp32, f) for f in feeds])


def input_rounding_floor(fp32: onnx.ModelProto, draws: Draws) -> float:
    """The FP32 model's max relative error when only its float inputs are rounded to fp16."""
    rounded = [{k: _rounded(v) for k, v in f.items()} for f in draws.feeds]
    return max(max_rel(ref, validate.run(fp32, f))[0]
               for f, ref in zip(rounded, draws.fp32_out))


def weight_rounding_floor(fp32: onnx.ModelProto, draws: Draws) -> float:
    """The FP32 model's max relative error when only its float32 initializers are rounded
    to fp16 (and back: the arithmetic stays float32)."""
    from onnx import numpy_helper

    rounded = onnx.ModelProto.FromString(fp32.SerializeToString())
    for tensor in rounded.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(_rounded(numpy_helper.to_array(tensor)),
                                                    tensor.name))
    return max(max_rel(ref, validate.run(rounded, f))[0]
               for f, ref in zip(draws.feeds, draws.fp32_out))


def _rounded(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float16).astype(array.dtype) if array.dtype == np.float32 else array


def compare_model(name: str, chosen: dict, deny: set[str], opset: int | None,
                  seeds: int = 1) -> list[dict]:
    path = zoo.cached_onnx(name, opset=opset)
    fp32 = onnx.load(path)
    draws = input_draws(name, path, fp32, seeds)
    inside = fused_away(fp32)
    base = {"model": name}
    rows = [dict(base, converter="fp32", valid=True, runs_ort=True,
                 casts=corpus.count_casts(fp32), fused=fused_ops(fp32),
                 fused_lowk=fused_ops(fp32), share=0.0, deny_low=0, ort_rel=0.0, ref_rel=None,
                 floor=input_rounding_floor(fp32, draws),
                 wfloor=weight_rounding_floor(fp32, draws), ort_fused=ort_session_fused(fp32),
                 note="input")]
    for conv_name, convert in chosen.items():
        start = time.perf_counter()
        try:
            converted = convert(onnx.load(path))
        except Exception as e:  # a converter that fails on a model is a result too
            rows.append(dict(base, converter=conv_name, valid=False,
                             note=f"conversion failed: {corpus.first_line(e)[:60]}"))
            continue
        row = evaluate(draws, converted, deny, inside)
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(dict(base, converter=conv_name, **row))
    ort_row = best_ort_optimizer(draws, path, deny, inside)
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
    """Per model, the fusion targets that amp_rewrite misses (empty lists: all met).

    Fused ops are compared with the ORT optimizer path's ``fused_lowk`` (fused ops that some
    provider can run in their dtype). Errors are compared on the max and on the mean over the
    input draws; a miss on one of them only is named as such. The ORT-CPU session count is
    compared with the FP32 input's and with the ORT optimizer path's
    fp16 output on the same provider (``cpu-fused``)."""
    missed: dict[str, list[str]] = {}
    for name in dict.fromkeys(r["model"] for r in rows):
        mine = {r["converter"]: r for r in rows if r["model"] == name}
        ours = mine.get("amp_rewrite")
        if ours is None or not ours.get("valid"):
            missed[name] = ["amp_rewrite output invalid: " + (ours or {}).get("note", "")]
            continue
        missed[name] = _misses(ours, mine.get("ort_optimizer"), mine.get("modelopt"),
                               mine["fp32"])
    return missed


def significantly_worse(ours: list[float] | None, peer: list[float] | None) -> bool:
    """Paired over the same input draws: is ours' error larger by more than noise (mean
    difference above 2 standard errors and above 1% of the peer's mean)?"""
    if not ours or not peer or len(ours) != len(peer):
        return False
    diff = np.asarray(ours) - np.asarray(peer)
    spread = 2 * diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else 0.0
    return bool(diff.mean() > max(spread, 0.01 * np.mean(peer)))


def _misses(ours: dict, ortp: dict | None, mo: dict | None, fp32: dict) -> list[str]:
    misses = []
    if ortp and ortp.get("runs_ort") and ours["casts"] > ortp["casts"]:
        misses.append(f"casts {ours['casts']} > ORT optimizer {ortp['casts']}")
    if ortp and ours["fused"] < ortp.get("fused_lowk", 0):
        misses.append(f"fused {ours['fused']} < ORT optimizer {ortp['fused_lowk']}")
    if mo and mo.get("valid"):
        if ours["casts"] > mo["casts"]:
            misses.append(f"casts {ours['casts']} > ModelOpt {mo['casts']}")
        if (ours["share"] or 0) < (mo["share"] or 0):
            misses.append(f"share {ours['share']:.3f} < ModelOpt {mo['share']:.3f}")
    if ours["deny_low"]:
        misses.append(f"{ours['deny_low']} deny ops low")
    for peer in (ortp, mo):
        for key in ("ort_rel", "ref_rel"):
            if not peer or peer.get(key) is None:
                continue
            for label, draws in (("max rel", key + "_draws"),
                                 ("rms rel", key.replace("_rel", "_rms") + "_draws")):
                if significantly_worse(ours.get(draws), peer.get(draws)):
                    misses.append(f"{key[:3]} {label} worse than {peer['converter']}: "
                                  f"mean {np.mean(ours[draws]):.2g} > "
                                  f"{np.mean(peer[draws]):.2g}")
    if ours["splits"]:
        misses.append(f"{ours['splits']} casts split chains ORT fuses in FP32")
    if (ours["ort_fused"] or 0) < (fp32["ort_fused"] or 0):
        same = ortp and (ours["ort_fused"] or 0) >= (ortp.get("ort_fused") or 0)
        misses.append(f"ORT-CPU session fuses {ours['ort_fused']} < FP32's {fp32['ort_fused']}"
                      + (f" (>= ORT optimizer's fp16 {ortp['ort_fused']})" if same else ""))
    return misses


MARKDOWN = [  # (header, row key, converters shown: amp_rewrite, nofuse, ORT optimizer, ModelOpt)
    ("casts ours / nofuse / ORT-opt / ModelOpt", "casts", 4),
    ("fused ours / ORT-opt [with a kernel in its dtype] (FP32 input)", "fused", 0),
    ("share ours / ModelOpt", "share", 2),
    ("deny low ours / ModelOpt", "deny_low", 2),
    ("ORT max rel, max over draws: ours / nofuse / ORT-opt / ModelOpt", "ort_rel", 4),
    ("ORT rms rel: ours / nofuse / ORT-opt / ModelOpt", "ort_rms", 4),
    ("reference max rel: ours / nofuse / ORT-opt / ModelOpt", "ref_rel", 4),
    ("reference rms rel: ours / nofuse / ORT-opt / ModelOpt", "ref_rms", 4),
    ("floor: fp16 inputs / fp16 weights", "floor", 1),
    ("ORT-CPU session fused: FP32 / ours / ORT-opt", "ort_fused", 3),
    ("runs in ORT / valid: ours / ORT-opt (type) / ModelOpt", "valid", 0),
]


def markdown(rows: list[dict]) -> str:
    """One line per model, the converters side by side."""
    lines = ["| model | " + " | ".join(h for h, _, _ in MARKDOWN) + " |",
             "|---" * (len(MARKDOWN) + 1) + "|"]
    for name in dict.fromkeys(r["model"] for r in rows):
        by = {r["converter"]: r for r in rows if r["model"] == name}
        get = lambda conv, key: fmt(by.get(conv, {}).get(key))  # noqa: E731
        ortp = by.get("ort_optimizer", {})
        cells = []
        for _, key, n in MARKDOWN:
            convs = ["amp_rewrite", "amp_rewrite_nofuse", "ort_optimizer", "modelopt"][:n]
            if key == "share" or key == "deny_low":
                convs = ["amp_rewrite", "modelopt"]
            elif key == "floor":
                cells.append(f"{get('fp32', 'floor')} / {get('fp32', 'wfloor')}")
                continue
            elif key == "ort_fused":
                convs = ["fp32", "amp_rewrite", "ort_optimizer"]
            if key == "fused":
                cells.append(f"{get('amp_rewrite', 'fused')} / {get('ort_optimizer', 'fused')} "
                             f"[{get('ort_optimizer', 'fused_lowk')}] ({get('fp32', 'fused')})")
            elif key == "valid":
                model_type = ortp.get("note", "").split(" ")[0].replace("model_type=", "")
                cells.append(" / ".join(
                    f"{'runs' if by.get(c, {}).get('runs_ort') else 'fails'}, "
                    f"{'valid' if by.get(c, {}).get('valid') else 'invalid'}"
                    + (f" ({model_type})" if c == "ort_optimizer" else "")
                    for c in ("amp_rewrite", "ort_optimizer", "modelopt")))
            else:
                cells.append(" / ".join(get(c, key) for c in convs))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--names", nargs="*", default=list(zoo.NAMES))
    p.add_argument("--json", type=Path, default=Path("results/compare_fusion.json"))
    p.add_argument("--opset", type=int, default=None, help="zoo export opset (default 18)")
    p.add_argument("--target", choices=["ort", "onnx"], default="ort",
                   help="amp_rewrite's fusion target")
    p.add_argument("--seeds", type=int, default=4, help="input draws per model (default 4)")
    p.add_argument("--markdown", type=Path, help="also write the side-by-side table here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    warnings.simplefilter("ignore")
    chosen = converters(args.target)
    deny = set(load_rules("onnx").ops(OpClass.DENY))
    rows = []
    for name in args.names:
        rows += compare_model(name, chosen, deny, args.opset, args.seeds)
        print(f"[{name} done]", file=sys.stderr, flush=True)
    print_table(rows)
    missed = targets(rows)
    print()
    for name, misses in missed.items():
        print(f"{name:16} {'all targets met' if not misses else '; '.join(misses)}")
    if args.markdown:
        args.markdown.write_text(markdown(rows) + "\n\n" + "\n".join(
            f"* {name}: {'all targets met' if not m else '; '.join(m)}"
            for name, m in missed.items()) + "\n")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "targets_missed": missed}, indent=1,
                                   default=str))
    return 0
