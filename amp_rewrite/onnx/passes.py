"""The ONNX mixed-precision pass, on the onnx_ir pass contract.

``MixedPrecisionPass.call(model)`` orchestrates named steps: build the precision view, plan
(core), apply (adapter). ``PassResult.modified`` is derived from what the apply step changed,
so running the pass on its own output reports ``modified=False``.
"""
from __future__ import annotations

from collections.abc import Mapping
import dataclasses
import fnmatch
import functools
import logging
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from amp_rewrite.core import (LowDtype, PadPolicy, PrecisionPlan, RuleSet, load_rules,
                              plan_precision)
from amp_rewrite.core import pipeline as core_pipeline
from amp_rewrite.core.pipeline import Pass
from amp_rewrite.core.multilabel import plan_mixed
from amp_rewrite.core.precision import MIXED
from amp_rewrite.core.report import Reasons, Report, mixed_summary, node_records
from amp_rewrite.onnx.load import LoadInfo, model_graphs
from amp_rewrite.onnx.apply import ApplyStats, apply_plan
from amp_rewrite.core.rules import close_match
from amp_rewrite.onnx.mixed import MixedInputs, group_flops, hot_groups, mixed_inputs
from amp_rewrite.onnx.pad import PadStats, pad_model, pad_report
from amp_rewrite.onnx.rescale import Rescaled, rescale_hot_chains
from amp_rewrite.onnx.fusion import FUSED_TAG, FusionPass
from amp_rewrite.onnx.view import INSERTED_TAG, OnnxView, build_view

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OnnxOptions:
    """Options shared by the CLI and ``rewrite_onnx``."""

    dtype: LowDtype = LowDtype.FLOAT16
    keep_io_types: bool = True
    rules: tuple[str, ...] = ()
    keep_fp32: tuple[str, ...] = ()
    # value name -> observed max |x| from calibration, already above the threshold
    pinned_values: Mapping[str, float] = field(default_factory=dict)
    savings_weight: float = 0.0  # β: see amp_rewrite.core.placement.place
    # store constants beyond the low dtype's range clamped (decision 0010: off by default)
    clamp_constants: bool = False
    pad: bool = True  # pad low GEMM/conv dims to multiples of 8 (onnx/pad.py)
    pad_policy: PadPolicy | None = None  # None: core.padding.PadPolicy()
    fuse: bool = True  # pattern fusion before the plan (amp_rewrite.onnx.fusion)
    target: str = "ort"  # "ort": contrib ops allowed; "onnx": standard ops only
    # fnmatch patterns of main-graph inputs/outputs made low (a KV cache); others keep types
    low_io: tuple[str, ...] = ()
    # node name -> reason: pinned fp32 / run low by the accuracy budget (onnx/budget.py)
    budget_pins: Mapping[str, str] = field(default_factory=dict)
    budget_low: Mapping[str, str] = field(default_factory=dict)
    # a mixed plan (core/multilabel.py): ``dtype`` is the view's (fp16); ``pinned_values``
    # are those beyond bf16's threshold, ``hot_values`` those beyond fp16's only (bf16)
    mixed: bool = False
    hot_values: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_rewrite(cls, options, pinned_values: Mapping[str, float],
                     hot_values: Mapping[str, float] | None = None) -> OnnxOptions:
        """The pass's options from the user's (``onnx/options.RewriteOptions``) and the
        values calibration found beyond its threshold (mixed: beyond bf16's, and
        ``hot_values`` beyond fp16's only)."""
        pad = options.pad
        mixed = options.dtype == MIXED
        return cls(LowDtype.FLOAT16 if mixed else options.dtype, options.keep_io_types,
                   options.rules, options.keep_fp32, pinned_values, options.savings_weight,
                   options.clamp_constants, pad=bool(pad),
                   pad_policy=pad if isinstance(pad, PadPolicy) else None,
                   fuse=options.fuse, target=options.target, low_io=options.low_io,
                   mixed=mixed, hot_values=dict(hot_values or {}))

    @property
    def plan_dtype(self) -> str:
        """What the report calls the plan: float16, bfloat16 or mixed."""
        return MIXED if self.mixed else self.dtype.value


@dataclass
class OnnxDetails:
    """The ONNX path's own report keys (``core/report.Report.details``; docs/cli.md)."""

    identity_casts_removed: int
    constants_converted: int
    constant_bytes_converted: int
    constant_copies: int
    values_clamped: int
    clamped_constants: list
    constants_kept_fp32: list[str]
    pinned_by_calibration: list[str]
    inserted_casts: list
    opset_advice: str | None
    low_io: dict
    fusion_rules: dict[str, int]
    opset_conversion: str | None = None  # set by the entry point, which converts
    # hot GEMM chains rescaled into fp16's range: {"node": up, "shift": k, "down": down}
    rescaled: list = field(default_factory=list)


class MixedPrecisionPass(ir.passes.InPlacePass):
    """Rewrite float32 ops to the low dtype with the exact minimum of casts."""

    def __init__(self, options: OnnxOptions, rules: RuleSet | None = None,
                 info: LoadInfo | None = None) -> None:
        """``info``: what loading learned about the model the pass will run on (None: nothing
        known, every fact is looked up)."""
        super().__init__()
        self.options = options
        self.rules = rules if rules is not None else onnx_rules(options.rules)
        self.info = info if info is not None else LoadInfo()
        self.view: OnnxView | None = None
        self.plan: PrecisionPlan | None = None
        self.stats: ApplyStats | None = None
        self.fusion: FusionPass | None = None
        self.low_io: dict = {}
        # (group key -> reason) fixed high, and fixed low, by the options (``prepare``)
        self.option_pins: tuple[dict, dict] = ({}, {})
        self.mixed_inputs: MixedInputs | None = None  # a mixed plan's, once per view
        self.flops: dict = {}  # a mixed plan's FLOPs per group (the report's shares)
        self.pad_stats = PadStats()
        self.rescaled: list[Rescaled] = []  # hot GEMM chains scaled into fp16 (onnx/rescale.py)
        self.record = core_pipeline.Record()
        self._graphs: list[ir.Graph] | None = None

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """The pipeline (docs/design.md §1) as named passes on the core's contract."""
        self.record = core_pipeline.Record()
        core_pipeline.run(model, "prepare", self.prepare_passes(), self.record)
        core_pipeline.run(model, "plan", [Pass("plan", self._plan_and_apply)], self.record)
        core_pipeline.run(model, "lower", [Pass("pad gemms", self._pad)] if self.options.pad
                          else [], self.record)
        _forget_load_time_types(self.info.untyped)
        return ir.passes.PassResult(model, modified=self.modified or bool(self.rescaled)
                                    or bool(self.fusion and self.fusion.rule_hits))

    def prepare_passes(self) -> list[Pass]:
        """Fuse patterns first, then plan (docs/design.md §1); the view is built on the
        fused model, with types inferred where fusion or loading left none. A mixed plan
        with values calibration saw beyond fp16 first rescales the hot GEMM chains it can
        into fp16's range (onnx/rescale.py), on the fused graph, whose FFNs are the chains."""
        fusion = [Pass("fuse patterns", self._fuse)] if self.options.fuse else []
        rescale = [Pass("rescale hot chains", self._rescale)] \
            if self.options.mixed and self.options.hot_values else []
        return [*fusion, *rescale, Pass("infer missing types", self._infer_types),
                Pass("build precision view", self._build_view)]

    def prepare(self, model: ir.Model) -> OnnxView:
        """The prepare stage alone (the accuracy budget re-plans the view it builds)."""
        core_pipeline.run(model, "prepare", self.prepare_passes(), self.record)
        return self.view

    def _fuse(self, model: ir.Model) -> ir.passes.PassResult:
        self.fusion = FusionPass(self.options.target)
        return self.fusion(model)

    def _rescale(self, model: ir.Model) -> bool:
        """Scale hot chains' weights by powers of two (exact: the FP32 model computes the
        same) and divide their values' recorded maxima alike: within fp16's threshold, they
        leave ``hot_values`` and the plan runs them fp16 (core/rescale.py)."""
        self.rescaled = rescale_hot_chains(model.graph, self.options.hot_values)
        if self.rescaled:
            self.options = dataclasses.replace(
                self.options, hot_values=_shifted_maxima(self.options.hot_values, self.rescaled))
        return bool(self.rescaled)

    def _infer_types(self, model: ir.Model) -> bool:
        self._graphs = model_graphs(model, self.info.flat)  # one walk for both steps
        # typed as loaded, and fusion added no untyped value: nothing to infer
        inferred = not self.info.typed or bool(self.fusion and self.fusion.rule_hits)
        if inferred:
            infer_missing_types(model, self._graphs)
        self.info.typed = False  # the pass changes the model: it holds for it no more
        return False  # types of values already there: the model means the same

    def _build_view(self, model: ir.Model) -> bool:
        self.view = build_view(model, self.options.dtype,
                               keep_io_types=self.options.keep_io_types, graphs=self._graphs,
                               clamp_constants=self.options.clamp_constants,
                               low_io=self.options.low_io,
                               inferred_sizes=self.info.inferred_sizes,
                               mixed=self.options.mixed,
                               cuda_bf16_only=self.options.target == "ort")
        if self.options.mixed:
            self.mixed_inputs = mixed_inputs(self.view, self.options.hot_values)
        if self.options.low_io:
            self.low_io = low_io_report(model, self.options.low_io)
        # once per view: the accuracy-budget search re-plans with them many times
        self.option_pins = (self._pins(), {
            k: self.options.budget_low[node.name] for k, (node, _) in self.view.groups.items()
            if node.name in self.options.budget_low})
        return False

    def _plan_and_apply(self, model: ir.Model) -> bool:
        self.plan = self.plan_view()
        _warn_unmatched_patterns(self.options.keep_fp32, self.view)
        if self.options.mixed:  # from the shapes before apply puts casts between the nodes
            self.flops = group_flops(self.view, self.info.inferred_sizes)
        self.stats = apply_plan(model, self.view, self.plan)
        return self.stats.modified

    def _pad(self, model: ir.Model) -> bool:
        # onnxruntime's CUDA provider has no bf16 Pad kernel (kernels.py): Concat instead
        concat = (ir.DataType.BFLOAT16,) if self.options.target == "ort" else ()
        self.pad_stats = pad_model(model, self.options.pad_policy, concat_dtypes=concat)
        return self.pad_stats.modified

    def plan_view(self, extra_pins: Mapping | None = None,
                  low_pins: Mapping | None = None) -> PrecisionPlan:
        """The plan of the prepared view; ``extra_pins`` / ``low_pins``: group key -> reason,
        fixed high / low besides the options' (the accuracy-budget search re-plans with them)."""
        pins, low = self.option_pins
        pins, low = {**pins, **(extra_pins or {})}, {**low, **(low_pins or {})}
        if self.options.mixed:
            return self._plan_mixed(pins, low)
        return plan_precision(self.view.graph, self.rules, keep_fp32=self.options.keep_fp32,
                              pins=pins, low_pins=low,
                              savings_weight=self.options.savings_weight,
                              wide_values=self.view.wide_values)

    def _plan_mixed(self, pins: Mapping, low_pins: Mapping) -> PrecisionPlan:
        """fp16, bf16 or fp32 per group, one exact plan (core/multilabel.py); calibration's
        values beyond bf16 are in ``pins`` (``_pins``), those beyond fp16 only make their
        producers and readers need range (``onnx/mixed.py``)."""
        m = self.mixed_inputs
        return plan_mixed(self.view.graph, self.rules, admissible=m.admissible,
                          adapter_dtypes=m.adapter_dtypes, keep_fp32=self.options.keep_fp32,
                          pins={**m.pins, **pins}, low_pins=low_pins,
                          fp16_wide_values=m.fp16_wide_values, wide_values=m.wide_values,
                          range_groups=m.range_groups,
                          savings_weight=self.options.savings_weight)

    @property
    def modified(self) -> bool:
        """Whether precision or padding changed (fusion is reported apart, in ``fused``)."""
        return self.stats.modified or self.pad_stats.modified

    def _pins(self) -> dict:
        """Groups that produce or read a value observed beyond the calibration threshold run
        high: a producer run low overflows, and a reader run low reads the value through a
        Cast to the low dtype, which overflows just the same (the down-projection reading a
        hot FFN intermediate was the case calibration missed)."""
        pins = {k: self.options.budget_pins[node.name]
                for k, (node, _) in self.view.groups.items()
                if node.name in self.options.budget_pins}
        for key, why in hot_groups(self.view, self.options.pinned_values).items():
            pins[key] = f"calibration saw {why}: kept fp32"
        return pins

    def report(self) -> Report:
        """Per-node decisions and totals (the ``--report`` JSON schema)."""
        s = self.stats
        return Report(
            self.options.plan_dtype, node_records(self.plan, self.view.graph),
            s.casts_inserted, self.plan.cast_units, s.nodes_retyped, self.modified,
            padding=pad_report(self.pad_stats) if self.options.pad else {"enabled": False},
            fused=dict(self.fusion.fused) if self.fusion else {},
            details=OnnxDetails(
                s.identity_casts_removed, s.constants_converted, s.constant_bytes_converted,
                s.constant_copies, s.values_clamped, s.clamped_constants,
                sorted(self.view.wide_values.values()), sorted(self.options.pinned_values),
                s.inserted_casts, self.opset_advice(), self.low_io,
                dict(self.fusion.rule_hits) if self.fusion else {},
                rescaled=[r.as_report() for r in self.rescaled]),
            mixed=self._mixed_section() if self.options.mixed else None,
            steps=self.record.as_report(),
            why=Reasons(self.plan, self.view.graph, self._created_by))

    def _mixed_section(self) -> dict:
        """The report's ``mixed``: core/report.mixed_summary with FLOPs from the shapes, and
        the values calibration saw beyond fp16 (their nodes run bf16)."""
        section = mixed_summary(self.plan, self.view.graph, self.flops)
        section["bf16_by_calibration"] = sorted(self.options.hot_values)
        return section

    def opset_advice(self) -> str | None:
        """What to do when most compute stays fp32 because the model's opset does not admit
        the low dtype (bf16 before opset 22 for Conv, BatchNormalization, LSTM, ...)."""
        from amp_rewrite.core import OpClass
        from amp_rewrite.onnx.ports import first_opset_admitting

        if not any(pg.opset_limited for _, pg in self.view.groups.values()):
            return None
        compute = limited = 0
        ops: dict[tuple[str, str], int] = {}
        for node, pg in self.view.groups.values():
            op_key = node.op_type if node.domain == "" else f"{node.domain}::{node.op_type}"
            if self.rules.class_of(op_key) not in (OpClass.ALLOW, OpClass.GRAY):
                continue
            compute += 1
            if pg.opset_limited:
                limited += 1
                ops[(node.domain, node.op_type)] = node.version or self._opset(node.domain)
        if not compute or limited * 2 <= compute:
            return None
        low = self.options.dtype
        targets = [first_opset_admitting(d, op, low, v) for (d, op), v in ops.items()]
        names = ", ".join(sorted(op for _, op in ops))
        current = self._opset("")
        advice = (f"{limited} of {compute} compute ops ({names}) do not admit {low.value} at "
                  f"opset {current}, so most compute stays fp32")
        known = [t for t in targets if t is not None]
        if known:
            advice += f": re-run with --opset {max(known)} (or opset={max(known)})"
        return advice

    def _opset(self, domain: str) -> int:
        return dict(self.view.opsets).get(domain, 1)

    def _created_by(self, name: str, keys: list) -> list[str]:
        """Lines ``explain`` puts first: the fusion rule that created the node, and the
        rescaling that changed its weights."""
        return [*self._fused_by(name, keys), *_rescaled_lines(name, self.rescaled)]

    def _fused_by(self, name: str, keys: list) -> list[str]:
        rules = {self.view.groups[k][0].metadata_props.get(FUSED_TAG)
                 for k in keys if k in self.view.groups} - {None}
        return [f"{name}: created by fusion rule {r}" for r in sorted(rules)]


def _shifted_maxima(maxima: Mapping[str, float], rescaled: list[Rescaled]) -> dict:
    """Calibration maxima with each rescaled chain value's divided by its chain's 2^k, and
    those now within fp16's threshold dropped (``core.rescale.shift`` chose k for that)."""
    factors = {name: 2.0 ** -r.shift for r in rescaled for name in r.values}
    shifted = {name: m * factors.get(name, 1.0) for name, m in maxima.items()}
    threshold = LowDtype.FLOAT16.range_threshold
    return {name: m for name, m in shifted.items() if name not in factors or m > threshold}


def _rescaled_lines(name: str, rescaled: list[Rescaled]) -> list[str]:
    lines = []
    for r in rescaled:
        if name == r.up:
            lines.append(f"{name}: weights scaled by 2^-{r.shift} (and {r.down}'s by "
                         f"2^{r.shift}) so the chain to {r.down} fits fp16 (core/rescale.py)")
        elif name == r.down:
            lines.append(f"{name}: weights scaled by 2^{r.shift} (and {r.up}'s by "
                         f"2^-{r.shift}) so the chain from {r.up} fits fp16 "
                         "(core/rescale.py)")
    return lines


def _warn_unmatched_patterns(patterns: tuple[str, ...], view: OnnxView) -> None:
    if not patterns:
        return
    names = {g.name for g in view.graph.groups() if g.name}
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            logger.warning("--keep-fp32 %r matches no node%s", pattern,
                           close_match(pattern, names))


def low_io_report(model: ir.Model, patterns: tuple[str, ...]) -> dict:
    """The float32 graph inputs/outputs ``patterns`` make low, and the bytes that saves per
    run: ``{"values": [...], "bytes_saved": {"2048*past": 2, ...}}`` keyed by the product
    of the symbolic dims (``"1"`` for static values), as a sum of terms."""
    terms: dict[str, int] = {}
    names = []
    for v in [*model.graph.inputs, *model.graph.outputs]:
        if v.dtype != ir.DataType.FLOAT or v.shape is None or not v.name:
            continue
        if not any(fnmatch.fnmatchcase(v.name, p) for p in patterns):
            continue
        names.append(v.name)
        static, symbolic = 2, []  # fp32 -> 16-bit: two bytes per element saved
        for d in v.shape.dims:
            if isinstance(d, int):
                static *= d
            else:
                symbolic.append(f"({d})" if " " in str(d) else str(d))
        key = "*".join(sorted(symbolic)) or "1"
        terms[key] = terms.get(key, 0) + static
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            logger.warning("--low-io %r matches no float32 graph input or output", pattern)
    return {"values": names, "bytes_saved": terms}


def format_bytes_saved(terms: Mapping[str, int]) -> str:
    """``low_io_report``'s bytes as text (a sum of terms over the symbolic dims)."""
    return " + ".join(f"{c}" if k == "1" else f"{c}*{k}" for k, c in terms.items()) + " B"


def onnx_rules(paths: tuple[str, ...] = ()) -> RuleSet:
    """The ONNX rule set with the overlays at ``paths``."""
    return load_rules("onnx", paths, known_ops=known_op_keys())


@functools.cache
def known_op_keys() -> frozenset[str]:
    """Every op ONNX defines, as rule-file keys (``op`` or ``domain::op``): rule overlays
    naming anything else of these domains get a warning."""
    keys = set()
    for schema in onnx.defs.get_all_schemas_with_history():
        domain = "" if schema.domain in ("", "ai.onnx") else schema.domain
        keys.add(f"{domain}::{schema.name}" if domain else schema.name)
    return frozenset(keys)


def infer_missing_types(model: ir.Model, graphs: list[ir.Graph] | None = None) -> None:
    """Dtypes for node outputs and subgraph inputs that still have none after loading
    (load_model already ran ONNX shape inference where node outputs lacked types): a
    dtype-only propagation through the op schemas and across control-flow boundaries."""
    _infer_graph(model.graph, dict(model.opset_imports))


def _infer_graph(graph: ir.Graph, opsets: dict[str, int]) -> None:
    from amp_rewrite.onnx.ports import (body_graphs, infer_output_dtypes, node_opset,
                                        type_body_inputs, type_outputs_from_bodies)

    for n in graph:
        opset = node_opset(n, opsets)
        if n.attributes and body_graphs(n):
            type_body_inputs(n, opset)
            for body in body_graphs(n):
                _infer_graph(body, opsets)
            type_outputs_from_bodies(n)
        infer_output_dtypes(n, opset)


def _forget_load_time_types(untyped: set[ir.Value]) -> None:
    """Node outputs the input left untyped go back to untyped, and so do casts of them: the
    output describes its values as much as the input did."""
    if not untyped:
        return
    casts = [u.node.outputs[0] for v in untyped for u in v.uses()
             if u.node.op_type == "Cast" and INSERTED_TAG in u.node.metadata_props]
    for v in (*untyped, *casts):
        if not v.is_graph_output():
            v.type, v.shape = None, None
