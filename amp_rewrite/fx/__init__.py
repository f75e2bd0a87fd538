"""The torch adapter: ``rewrite(module, example_inputs)`` → a mixed-precision GraphModule.

Capture (``torch.export`` by default, ``symbolic_trace`` on request, or a GraphModule as is),
then the passes of :mod:`amp_rewrite.fx.passes` on the shared core (docs/design.md §1-2). The result
keeps FP32 parameters (cast in-graph once per forward), the original ``state_dict`` keys, shapes
and dtypes, and carries ``gm.amp_report`` (the ONNX ``--report`` schema).
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from amp_rewrite import arguments
from amp_rewrite.core import PadPolicy, RuleSet, load_rules
from amp_rewrite.core import options as core_options
from amp_rewrite.core import report as core_report
from amp_rewrite.core.rules import default_rules_path
from amp_rewrite.runtime import gc_paused
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import budget as fx_budget
from amp_rewrite.fx import guards, kernel_timing, lowering
from amp_rewrite.fx.capture import capture as capture_module
from amp_rewrite.fx.capture import fill_missing_fake_values, refresh_fake_values
from amp_rewrite.fx.fp8 import RestoreFp8Gemms, fp8_section
from amp_rewrite.fx.fusion import FUSED_FROM, FUSED_TAG, FuseAttention, FuseNorms, FuseTanhGelu
from amp_rewrite.fx.lowering import (LOWERED_TAG, EmulateLowKernels, RestoreLowKernels,
                                     native_low_gemm)
from amp_rewrite.fx.lowering import explanation as lowering_explanation
from amp_rewrite.fx.modes import TrainEvalModule, in_mode
from amp_rewrite.fx.options import BUDGET, GRAPH, TorchOptions
from amp_rewrite.fx.pad import PadGemms
from amp_rewrite.fx.passes import (DropFullSlices, FunctionalizeInPlace, FxOptions,
                                   InlineModules, MixedPrecisionPass)
from amp_rewrite.fx.masks import DropTrivialAttentionMasks
from amp_rewrite.fx.pointwise import CUDA_MIN_SAVED_BYTES, FusePointwise, UnfuseRegions
from amp_rewrite.fx.view import is_cast

__all__ = ["TrainEvalModule", "TorchOptions", "explain", "rewrite", "rewrite_graph",
           "run_pipeline"]

log = logging.getLogger(__name__)

REPORT_KEY = "amp_rewrite_report"  # gm.meta key: the core Report, for explain()


def rewrite(model: torch.nn.Module, example_inputs: Any = None, **options: Any
            ) -> torch.fx.GraphModule | TrainEvalModule:
    """Capture ``model`` and return a trainable mixed-precision ``GraphModule``.

    ``example_inputs``: a tensor or a tuple of the forward's positional arguments (only
    needed for a GraphModule whose nodes carry no ``meta['val']``). ``options``: the fields
    of ``TorchOptions`` (``amp_rewrite/fx/options.py``, listed below), checked here.
    With ``max_error``: one batch of ``calibration_data`` is held out and ``example_inputs``
    searched; the report's ``budget`` and ``pinned_by_budget`` say what was achieved.
    The user's module is never mutated; the result owns copies of its parameters.
    """
    opts = TorchOptions.of(options, "rewrite")
    fx_options = FxOptions.of(opts)
    budget = fx_budget.request(opts.max_error, calibration_data=opts.calibration_data,
                               max_evaluations=opts.max_evaluations,
                               emit_rules=opts.emit_rules, example_inputs=example_inputs,
                               example_kwargs=opts.example_kwargs)
    mode = opts.mode
    if budget is not None and mode == "both":
        raise UsageError("max_error= with mode='both': rewrite each mode on its own (one "
                         "search per captured graph)")
    if example_inputs is None and not isinstance(model, torch.fx.GraphModule):
        raise UsageError("example_inputs is required to capture an nn.Module")
    if mode is not None and isinstance(model, torch.fx.GraphModule):
        raise UsageError("mode= needs an nn.Module to capture; a GraphModule is taken as it "
                         "is, in the mode it was captured in")
    capture_args = (model, () if example_inputs is None else example_inputs,
                    opts.example_kwargs, opts.capture, opts.dynamic_shapes)
    if mode == "both":  # both captures, sharing one set of parameters (fx/modes.py)
        train, eval_ = (_capture_and_rewrite(*capture_args, m, fx_options)
                        for m in ("train", "eval"))
        return TrainEvalModule(train, eval_, training=model.training)
    return _capture_and_rewrite(*capture_args, mode, fx_options, budget)


def _capture_and_rewrite(model: torch.nn.Module, example_inputs: Any,
                         example_kwargs: Mapping[str, Any] | None, capture: str,
                         dynamic_shapes: Any, mode: str | None, options: FxOptions,
                         budget: fx_budget.BudgetRequest | None = None
                         ) -> torch.fx.GraphModule:
    start = time.perf_counter()
    with in_mode(model, mode) if mode else contextlib.nullcontext():
        gm = capture_module(model, example_inputs, example_kwargs, mode=capture,
                            dynamic_shapes=dynamic_shapes)
    captured = time.perf_counter()
    gm = run_pipeline(gm, options, budget)
    gm.amp_report["capture_seconds"] = round(captured - start, 4)
    return gm


def rewrite_graph(gm: torch.fx.GraphModule, **options: Any) -> torch.fx.GraphModule:
    """Run the passes on a captured GraphModule (``meta['val']`` on its nodes), in place.

    ``options``: the graph's and the budget's fields of ``TorchOptions`` (listed below); with
    ``max_error``, ``calibration_data`` is required (one batch: searched, nothing held out).
    """
    opts = TorchOptions.of(options, "rewrite_graph", scopes=(GRAPH, BUDGET))
    budget = fx_budget.request(opts.max_error, calibration_data=opts.calibration_data,
                               max_evaluations=opts.max_evaluations,
                               emit_rules=opts.emit_rules)
    return run_pipeline(gm, FxOptions.of(opts), budget)


@dataclasses.dataclass
class _Prepared:
    """A graph ready for the plan: options with the device, rules, what preparing found."""

    options: FxOptions
    rules: RuleSet
    foreign_notes: list[str]
    masks: DropTrivialAttentionMasks
    start: float


@dataclasses.dataclass
class _Lowered:
    """What the plan and the lowering after it did, for the report."""

    amp: MixedPrecisionPass
    fp8: Any
    fp8_lines: dict[str, str]
    padding: dict
    emulated: dict


def run_pipeline(gm: torch.fx.GraphModule, options: FxOptions,
                   budget: fx_budget.BudgetRequest | None = None) -> torch.fx.GraphModule:
    """The torch pipeline on a captured graph, with checked options: what ``rewrite``,
    ``rewrite_graph`` and the compile backend share. ``budget``: search the accuracy
    budget's pins on copies of the prepared graph first, and measure the result on the
    held-out batches."""
    if budget is not None:
        fx_budget.check_not_rewritten(gm)
        reference = fx_budget.References.of(gm, budget)
    prepared = _prepare(gm, options)
    outcome = None
    if budget is not None:
        outcome = fx_budget.search_budget(gm, lambda copy, pins: _plan_and_lower(
            copy, prepared, pins).amp, budget, reference)
        prepared.options = dataclasses.replace(prepared.options, budget_pins=outcome.pins)
    with gc_paused():
        lowered = _plan_and_lower(gm, prepared)
        pointwise = FusePointwise(CUDA_MIN_SAVED_BYTES if prepared.options.device == "cuda"
                                  else 0)
        if prepared.options.fuse:  # docs/design.md §7: pointwise fusion last, casts and pads included
            pointwise(gm)
    report = _report(gm, prepared, lowered, pointwise)
    if outcome is not None:
        outcome.finish(lowered.amp)
        outcome.held_out(gm, reference)
        report.extra.update(budget=outcome.report(), pinned_by_budget=outcome.pinned())
        if budget.emit_rules is not None:
            outcome.write_rules(budget.emit_rules)
    gm.meta[REPORT_KEY] = report
    gm.amp_report = report.to_json()
    for note in report.extra["notes"]:
        log.warning("%s", note)
    return gm


def _prepare(gm: torch.fx.GraphModule, options: FxOptions) -> _Prepared:
    """Everything before the plan: dtypes, inlining, fusion, functional ops, masks."""
    device = options.device or graph_device(gm)
    options = dataclasses.replace(options, device=device)
    overlays = [default_rules_path("torch_cpu")] if device == "cpu" else []
    rule_set = load_rules("torch", extra_files=[*overlays, *options.rules])
    # a second rewrite plans on the flat graph with its low kernels
    unfused = (UnfuseRegions()(gm).modified | RestoreLowKernels()(gm).modified
               | RestoreFp8Gemms()(gm).modified)
    # refuse integer data into GEMMs, keep ops without a low kernel here fp32, adapt
    # bf16/fp16/fp64-held models (fx/guards.py)
    guards.refuse_non_float_gemm_inputs(gm, rule_set)
    guards.mark_missing_low_kernels(gm, options.low, rule_set, device)
    convert = guards.ConvertForeignFloats(options.low, options.keep_io_types)
    convert(gm)
    start = time.perf_counter()
    with gc_paused():
        inlined = unfused | InlineModules()(gm).modified
        fused = options.fuse and any([p(gm).modified for p in (
            FuseTanhGelu(), FuseAttention(), FuseNorms())])
        if inlined or (fused and not fill_missing_fake_values(gm)):
            refresh_fake_values(gm)
        FunctionalizeInPlace()(gm)
        DropFullSlices()(gm)
        masks = DropTrivialAttentionMasks()
        masks(gm)
    return _Prepared(options, rule_set, convert.notes, masks, start)


def _plan_and_lower(gm: torch.fx.GraphModule, prepared: _Prepared,
                    budget_pins: Mapping[str, str] | None = None) -> _Lowered:
    """The plan, FP8, padding and emulated kernels on a prepared graph (``budget_pins``:
    node name -> reason, pinned fp32 besides the options' pins)."""
    options = prepared.options
    if budget_pins is not None:
        options = dataclasses.replace(options, budget_pins=budget_pins)
    amp = MixedPrecisionPass(options, prepared.rules)
    amp(gm)
    fp8, fp8_lines = fp8_section(gm, options.fp8)
    pad = options.device == "cuda" if options.pad is None else options.pad  # a policy is truthy
    padding = _pad(gm, pad)
    emulated = _emulate_gemms(gm, options.low, options.device, options.fuse,
                              options.emulate_gemms)
    return _Lowered(amp, fp8, fp8_lines, padding, emulated)


def _report(gm: torch.fx.GraphModule, prepared: _Prepared, lowered: _Lowered,
            pointwise: FusePointwise) -> core_report.Report:
    device = prepared.options.device
    report = lowered.amp.report()
    for name, line in lowered.fp8_lines.items():
        report.why.setdefault(name, []).append(line)
    report.why = _for_device(_with_fusions(gm, report.why), device)
    report.padding, report.fused = lowered.padding, _fused_summary(gm, pointwise)
    notes = _true_notes(report.extra.pop("notes"), prepared.foreign_notes)
    report.extra.update(notes=notes, device=device, emulated_gemms=lowered.emulated,
                        fp8=lowered.fp8, attention_masks_dropped=prepared.masks.dropped,
                        seconds=round(time.perf_counter() - prepared.start, 4))
    return report


def _true_notes(notes: list[str], foreign_notes: list[str]) -> list[str]:
    """Replace the generic 'no floating-point tensors' note when the model had some."""
    if not foreign_notes:
        return notes
    return [*foreign_notes, *(n for n in notes if "no floating-point tensors" not in n)]


def _pad(gm: torch.fx.GraphModule, enabled: bool | PadPolicy) -> dict:
    """Pad low GEMM/conv dims to multiples of 8 (``fx/pad.py``); the report's section."""
    if not enabled:
        return {"enabled": False}
    pad = PadGemms(enabled if isinstance(enabled, PadPolicy) else None)
    if pad(gm).modified:
        refresh_fake_values(gm)
    return pad.report()


def _emulate_gemms(gm: torch.fx.GraphModule, low: torch.dtype, device: str, fuse: bool,
                   requested: bool | None) -> dict:
    """Low GEMMs/convs/SDPA as fp32 kernels on low-rounded operands (``fx/lowering.py``)
    where that kernel measures faster on this CPU; the report's section, with the timings."""
    native = native_low_gemm(low, device)
    if requested is False or (requested is None and (not fuse or device != "cpu")):
        return {"enabled": False, "native_low_gemm": native}
    # time the backward too where gradients flow: trainable parameters or inputs needing grad
    trained = any(p.requires_grad for p in gm.parameters()) or any(
        getattr(n.meta.get("val"), "requires_grad", False)
        for n in gm.graph.nodes if n.op == "placeholder")
    select = None if requested else lowering.MeasuredChoice(low, trained)
    emulate = EmulateLowKernels(select)
    emulate(gm)
    return {"enabled": bool(emulate.lowered), "native_low_gemm": native,
            "kernels": emulate.lowered,
            "why": "fp32 kernels on low-rounded operands: " + (
                "requested" if requested else "where they measured faster on this CPU"),
            "cpu": kernel_timing.cpu_model(),
            "timings": select.timings if select else []}


def _fused_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    nodes = list(gm.graph.nodes)
    for module in gm.children():
        region = getattr(module, "region", None)
        if isinstance(region, torch.fx.GraphModule):
            nodes.extend(region.graph.nodes)
    # casts and region outputs copy their producer's meta: only the fused ops themselves
    return [n for n in nodes if n.meta.get(FUSED_TAG) and not is_cast(n)
            and isinstance(n.target, torch._ops.OpOverload)]


def _fused_summary(gm: torch.fx.GraphModule, pointwise: FusePointwise) -> dict:
    patterns = Counter(node.meta[FUSED_TAG] for node in _fused_nodes(gm))
    return {"patterns": dict(patterns), **pointwise.summary()}


def _with_fusions(gm: torch.fx.GraphModule,
                  explanations: dict[str, list[str]]) -> dict[str, list[str]]:
    """Explanations of fused nodes start with what the fusion replaced."""
    for node in _fused_nodes(gm):
        line = (f"{node.name}: fused {node.meta[FUSED_TAG]} pattern (replaced "
                f"{node.meta[FUSED_FROM]})")
        explanations[node.name] = [line, *explanations.get(node.name, [])]
    for node in gm.graph.nodes:
        if node.meta.get(LOWERED_TAG) == "kernel":
            explanations.setdefault(node.name, []).append(lowering_explanation(node))
    return explanations


def graph_device(gm: torch.fx.GraphModule) -> str:
    """Device type of the first tensor among the graph's example values, else of its params."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return next((p.device.type for p in gm.parameters()), "cpu")


# The torch rules' reasons describe the CUDA kernels (autocast's CUDA lists are their base);
# on another device the same decision holds for that device's kernels, named here.
_CUDA_WORDING = ((re.compile(r"\bon Tensor Cores\b"), "in the device's low-precision GEMM"),
                 (re.compile(r"\bTensor Cores?\b"), "low-precision GEMM units"),
                 (re.compile(r"\bcu(BLAS|DNN|BLASLt)\b"), "oneDNN"))


def _for_device(explanations: dict[str, list[str]], device: str) -> dict[str, list[str]]:
    if device == "cuda":
        return explanations
    def true(line: str) -> str:
        for pattern, wording in _CUDA_WORDING:
            line = pattern.sub(wording, line)
        return line
    return {name: [true(line) for line in lines] for name, lines in explanations.items()}


def explain(gm: torch.fx.GraphModule, node_name: str) -> list[str]:
    """Why node ``node_name`` of a rewritten module runs low or high (the lines; the CLI
    prints them). An unknown name is a ``UsageError`` with the nearest names, including
    fused nodes that replaced an op of that name (``softmax`` inside attention), or the
    attention nodes the model called itself (its softmax never was a node)."""
    report = getattr(gm, "meta", {}).get(REPORT_KEY)
    if report is None:
        raise UsageError("this GraphModule was not produced by amp_rewrite.rewrite")
    try:
        return core_report.explain(report, node_name)
    except core_report.UnknownNodeError:
        hint = _captured_attention_hint(gm, report, node_name)
        if hint is None:
            raise
        raise core_report.UnknownNodeError(node_name, hint) from None


# The names a softmax node gets in fx graphs: softmax, _softmax_2, _safe_softmax_1, ...
_SOFTMAX_NAME = re.compile(r"_?(safe_)?softmax(_\d+)?")


def _captured_attention_hint(gm: torch.fx.GraphModule, report: core_report.Report,
                             name: str) -> str | None:
    """For a softmax name where the model called ``scaled_dot_product_attention`` itself
    (transformers' default attention): the attention nodes to explain instead. Nodes our
    fusion made are left out: ``core.report.explain`` already names those."""
    if not _SOFTMAX_NAME.fullmatch(name):
        return None
    attention = {r["name"] for r in report.nodes
                 if r["op_type"] == "scaled_dot_product_attention"}
    called = [n.name for n in gm.graph.nodes if n.name in attention and FUSED_TAG not in n.meta]
    if not called:
        return None
    if len(called) == 1:
        return f": attention is one fused node here, {called[0]!r} (explain(gm, {called[0]!r}))"
    shown = ", ".join(map(repr, called[:3])) + (" ..." if len(called) > 3 else "")
    return (f": attention is one fused node per call here, {shown} "
            f"(explain(gm, {called[0]!r}))")


# help() and editors show the options as keywords; the docstrings list them
for _entry, _scopes in ((rewrite, None), (rewrite_graph, (GRAPH, BUDGET))):
    _entry.__signature__ = core_options.signature(_entry, TorchOptions, _scopes)
    _entry.__doc__ += "\n    Options:\n\n" + "\n".join(
        "    " + line for line in core_options.describe(TorchOptions, _scopes).splitlines()
    ) + "\n"
del _entry, _scopes
