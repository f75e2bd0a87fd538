"""The torch pipeline as named passes on the core's contract (``core/pipeline.py``,
docs/design.md §1): ``prepare`` → ``plan`` → ``lower``, then the report. ``run_pipeline`` is
what ``rewrite``, ``rewrite_graph`` and the compile backend share."""
from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections import Counter
from collections.abc import Mapping

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from amp_rewrite.core import PadPolicy, RuleSet, load_rules
from amp_rewrite.core import pipeline as core_pipeline
from amp_rewrite.core import report as core_report
from amp_rewrite.core.pipeline import Pass
from amp_rewrite.core.rules import default_rules_path
from amp_rewrite.fx import budget as fx_budget
from amp_rewrite.fx.options import BudgetRequest
from amp_rewrite.fx import guards, kernel_timing, lowering, ranges
from amp_rewrite.fx.capture import fill_missing_fake_values, refresh_fake_values
from amp_rewrite.fx.fp8 import RestoreFp8Gemms, fp8_section
from amp_rewrite.fx.fusion import FUSED_FROM, FUSED_TAG, FuseAttention, FuseNorms, FuseTanhGelu
from amp_rewrite.fx.lowering import (LOWERED_TAG, EmulateLowKernels, RestoreLowKernels,
                                     native_low_gemm)
from amp_rewrite.fx.lowering import explanation as lowering_explanation
from amp_rewrite.fx.masks import DropTrivialAttentionMasks
from amp_rewrite.fx.pad import PadGemms
from amp_rewrite.fx.passes import (DropFullSlices, FunctionalizeInPlace, FxOptions,
                                   InlineModules, MixedPrecisionPass)
from amp_rewrite.fx.pointwise import CUDA_MIN_SAVED_BYTES, FusePointwise, UnfuseRegions
from amp_rewrite.fx.rescale import RescaleHotChains
from amp_rewrite.fx.rescale import explanation as rescale_explanation
from amp_rewrite.fx.view import is_cast
from amp_rewrite.runtime import gc_paused

log = logging.getLogger(__name__)

REPORT_KEY = "amp_rewrite_report"  # gm.meta key: the core Report, for explain()

# passes after which every fake value is propagated again (they restructure the graph);
# after pattern fusion only the new nodes need one
_RESTRUCTURING = ("unfuse regions", "restore low kernels", "restore fp8 gemms",
                  "inline modules")
_PATTERN_FUSION = ("fuse tanh gelu", "fuse attention", "fuse norms")


@dataclasses.dataclass
class Prepared:
    """A graph ready for the plan: options with the device, rules, what preparing found."""

    options: FxOptions
    rules: RuleSet
    convert: guards.ConvertForeignFloats
    masks: DropTrivialAttentionMasks
    record: core_pipeline.Record
    start: float
    rescale: RescaleHotChains = dataclasses.field(default_factory=RescaleHotChains)


@dataclasses.dataclass
class Lowered:
    """The plan and lowering passes of one run, holding what each did, for the report."""

    amp: MixedPrecisionPass
    fp8: _Fp8
    pad: _Pad
    emulate: _Emulate


def run_pipeline(gm: torch.fx.GraphModule, options: FxOptions,
                 budget: BudgetRequest | None = None,
                 examples: tuple[tuple, dict] | None = None) -> torch.fx.GraphModule:
    """The torch pipeline on a captured graph, in place, with checked options.
    ``budget``: search the accuracy budget's pins on copies of the prepared graph first,
    and measure the result on the held-out batches. ``examples``: (args, kwargs) of the
    forward; a mixed plan records the values' magnitudes on them (``fx/ranges.py``)."""
    if budget is not None:
        fx_budget.check_not_rewritten(gm)
        reference = fx_budget.References.of(gm, budget)
    prepared = prepare(gm, options)
    if options.mixed:
        core_pipeline.run(gm, "prepare", _range_passes(prepared, examples), prepared.record)
    outcome = None
    if budget is not None:
        outcome = fx_budget.search_budget(gm, lambda copy, pins: plan_and_lower(
            copy, prepared, pins).amp, budget, reference)
        prepared.options = dataclasses.replace(prepared.options, budget_pins=outcome.pins)
    with gc_paused():
        lowered = plan_and_lower(gm, prepared, record=prepared.record)
        pointwise = FusePointwise(CUDA_MIN_SAVED_BYTES if prepared.options.device == "cuda"
                                  else 0)
        # docs/design.md §7: pointwise fusion last, casts and pads included
        core_pipeline.run(gm, "lower", [Pass("fuse pointwise", pointwise)]
                          if prepared.options.fuse else [], prepared.record)
    report = _report(gm, prepared, lowered, pointwise)
    if outcome is not None:
        outcome.finish(lowered.amp)
        outcome.held_out(gm, reference)
        report.budget, report.pinned_by_budget = outcome.report(), outcome.pinned()
        if budget.emit_rules is not None:
            outcome.write_rules(budget.emit_rules)
    gm.meta[REPORT_KEY] = report
    gm.amp_report = report.to_json()
    for note in report.details.notes:
        log.warning("%s", note)
    return gm


def prepare_passes(options: FxOptions, rules: RuleSet, convert: guards.ConvertForeignFloats,
                   masks: DropTrivialAttentionMasks, record: core_pipeline.Record
                   ) -> list[Pass]:
    """Everything before the plan, in order: a second rewrite plans on the flat graph with
    its low kernels; integer data into GEMMs is refused, ops without a low kernel here stay
    fp32, and bf16/fp16/fp64-held models are adapted (fx/guards.py); then inlining, pattern
    fusion (docs/design.md §7.2), fresh fake values, functional ops, full slices, masks."""
    device, lows = options.device, options.low_dtypes
    fusion = [Pass("fuse tanh gelu", FuseTanhGelu()), Pass("fuse attention", FuseAttention()),
              Pass("fuse norms", FuseNorms())] if options.fuse else []
    return [
        Pass("unfuse regions", UnfuseRegions()),
        Pass("restore low kernels", RestoreLowKernels()),
        Pass("restore fp8 gemms", RestoreFp8Gemms()),
        Pass("refuse integer gemm inputs",
             lambda gm: guards.refuse_non_float_gemm_inputs(gm, rules) or False),
        Pass("keep ops without a low kernel fp32",
             lambda gm: guards.mark_missing_low_kernels(gm, lows, rules, device) or False),
        Pass("convert foreign floats", convert),
        Pass("inline modules", InlineModules()),
        *fusion,
        Pass("refresh fake values", _RefreshFakeValues(record)),
        Pass("functionalize in place", FunctionalizeInPlace()),
        Pass("drop full slices", DropFullSlices()),
        Pass("drop trivial attention masks", masks),
    ]


def _range_passes(prepared: Prepared, examples: tuple[tuple, dict] | None) -> list[Pass]:
    """A mixed plan's magnitudes, after the prepare passes (fusions and fresh fake values
    first): the ranges recorded on the examples, then hot GEMM chains shifted into fp16's
    range (fx/rescale.py), which reads them. A second rewrite has no examples; it keeps the
    first's (already shifted) ranges, and its shifted weights are no plain get_attr."""
    record = [Pass("record value ranges",
                   lambda g: ranges.record_ranges(g, *examples) and False)] \
        if examples is not None else []
    return [*record, Pass("rescale hot chains", prepared.rescale)]


def prepare(gm: torch.fx.GraphModule, options: FxOptions) -> Prepared:
    """The prepare stage, with the device and the rule set resolved."""
    device = options.device or graph_device(gm)
    options = dataclasses.replace(options, device=device)
    overlays = [default_rules_path("torch_cpu")] if device == "cpu" else []
    rules = load_rules("torch", extra_files=[*overlays, *options.rules])
    convert = guards.ConvertForeignFloats(options.low, options.keep_io_types)
    masks, record = DropTrivialAttentionMasks(), core_pipeline.Record()
    start = time.perf_counter()
    with gc_paused():
        core_pipeline.run(gm, "prepare", prepare_passes(options, rules, convert, masks, record),
                          record)
    return Prepared(options, rules, convert, masks, record, start)


def plan_and_lower(gm: torch.fx.GraphModule, prepared: Prepared,
                   budget_pins: Mapping[str, str] | None = None,
                   record: core_pipeline.Record | None = None) -> Lowered:
    """The plan, then FP8, padding and emulated kernels, on a prepared graph (``budget_pins``:
    node name -> reason, pinned fp32 besides the options' pins)."""
    options = prepared.options
    if budget_pins is not None:
        options = dataclasses.replace(options, budget_pins=budget_pins)
    record = record if record is not None else core_pipeline.Record()
    lowered = Lowered(MixedPrecisionPass(options, prepared.rules), _Fp8(options.fp8),
                      _Pad(options), _Emulate(options))
    core_pipeline.run(gm, "plan", [Pass("plan", lowered.amp)], record)
    core_pipeline.run(gm, "lower", [Pass("fp8 gemms", lowered.fp8),
                                    Pass("pad gemms", lowered.pad),
                                    Pass("emulate low kernels", lowered.emulate)], record)
    return lowered


class _RefreshFakeValues(PassBase):
    """``meta['val']`` for the nodes the passes before it made: everything again after a
    restructuring pass, only the new nodes after pattern fusion (when that is possible)."""

    def __init__(self, record: core_pipeline.Record) -> None:
        self.record = record

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        restructured = self.record.modified(*_RESTRUCTURING)
        fused = self.record.modified(*_PATTERN_FUSION)
        if restructured or (fused and not fill_missing_fake_values(graph_module)):
            refresh_fake_values(graph_module)
        return PassResult(graph_module, False)  # values of the same graph: nothing changed


class _Fp8(PassBase):
    """FP8 GEMMs where the options ask for them (fx/fp8.py); ``section`` for the report."""

    def __init__(self, fp8) -> None:
        self.fp8, self.section, self.lines = fp8, None, {}

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        self.section, self.lines = fp8_section(graph_module, self.fp8)
        return PassResult(graph_module, bool(self.lines))


class _Pad(PassBase):
    """Pad low GEMM/conv dims to multiples of 8 (``fx/pad.py``); None in the options: on
    for device 'cuda' only (Tensor Cores; padding buys nothing on a CPU)."""

    def __init__(self, options: FxOptions) -> None:
        self.enabled = options.device == "cuda" if options.pad is None else options.pad
        self.section: dict = {"enabled": False}

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        if not self.enabled:
            return PassResult(graph_module, False)
        pad = PadGemms(self.enabled if isinstance(self.enabled, PadPolicy) else None)
        modified = pad(graph_module).modified
        if modified:
            refresh_fake_values(graph_module)
        self.section = pad.report()
        return PassResult(graph_module, modified)


class _Emulate(PassBase):
    """Low GEMMs/convs/SDPA as fp32 kernels on low-rounded operands (``fx/lowering.py``)
    where that kernel measures faster on this CPU; ``section`` for the report, with the
    timings."""

    def __init__(self, options: FxOptions) -> None:
        self.low, self.device = options.low, options.device
        self.requested, self.fuse = options.emulate_gemms, options.fuse
        # a mixed plan runs GEMMs in both low dtypes: one answer per dtype
        native = {str(d).removeprefix("torch."): native_low_gemm(d, self.device)
                  for d in options.low_dtypes}
        self.section = {"enabled": False, "native_low_gemm": native if options.mixed
                        else native_low_gemm(self.low, self.device)}

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        requested = self.requested
        if requested is False or (requested is None and (not self.fuse
                                                          or self.device != "cpu")):
            return PassResult(graph_module, False)
        select = None if requested else lowering.MeasuredChoice(self.low,
                                                                _trained(graph_module))
        emulate = EmulateLowKernels(select)
        modified = emulate(graph_module).modified
        self.section.update(
            enabled=bool(emulate.lowered), kernels=emulate.lowered,
            why="fp32 kernels on low-rounded operands: " + (
                "requested" if requested else "where they measured faster on this CPU"),
            cpu=kernel_timing.cpu_model(), timings=select.timings if select else [])
        return PassResult(graph_module, modified)


def _trained(gm: torch.fx.GraphModule) -> bool:
    """Whether gradients flow (trainable parameters, or inputs needing grad): the kernel
    timing then times the backward too."""
    return any(p.requires_grad for p in gm.parameters()) or any(
        getattr(n.meta.get("val"), "requires_grad", False)
        for n in gm.graph.nodes if n.op == "placeholder")


def _report(gm: torch.fx.GraphModule, prepared: Prepared, lowered: Lowered,
            pointwise: FusePointwise) -> core_report.Report:
    device = prepared.options.device
    report = lowered.amp.report()
    for name, line in lowered.fp8.lines.items():
        report.why.setdefault(name, []).append(line)
    for entry in prepared.rescale.rescaled:
        for name in (entry["node"], entry["down"]):
            report.why.setdefault(name, []).append(rescale_explanation(entry))
    report.why = _for_device(_with_fusions(gm, report.why), device)
    report.padding, report.fused = lowered.pad.section, _fused_summary(gm, pointwise)
    details = report.details
    details.notes = _true_notes(details.notes, prepared.convert.notes)
    details.device, details.emulated_gemms = device, lowered.emulate.section
    details.rescaled = prepared.rescale.rescaled
    details.fp8, details.attention_masks_dropped = lowered.fp8.section, prepared.masks.dropped
    report.steps = prepared.record.as_report()
    report.seconds = round(time.perf_counter() - prepared.start, 4)
    return report


def _true_notes(notes: list[str], foreign_notes: list[str]) -> list[str]:
    """Replace the generic 'no floating-point tensors' note when the model had some."""
    if not foreign_notes:
        return notes
    return [*foreign_notes, *(n for n in notes if "no floating-point tensors" not in n)]


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


