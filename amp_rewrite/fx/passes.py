"""The fx passes, on ``torch.fx.passes.infra.pass_base.PassBase`` (docs/design.md §1).

* ``InlineModules``: ``call_module`` of a parameterised leaf module → its functional form on
  ``get_attr`` parameters, so parameters can be cast in-graph (``state_dict()`` unchanged).
* ``FunctionalizeInPlace``: an in-place op on an intermediate tensor nothing reads afterwards
  → its out-of-place form; in-place ops on inputs, parameters and buffers (also through views)
  or on tensors read later stay.
* ``DropFullSlices``: a ``slice`` that keeps every element (``x[:, 0:]``) → ``x``.
* ``MixedPrecisionPass``: view → core plan → apply → refreshed ``meta['val']``.

Each returns ``PassResult(gm, modified)`` from what it changed; a second run changes nothing.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from amp_rewrite.core import LowDtype, PadPolicy, Precision, PrecisionPlan, RuleSet, plan_precision
from amp_rewrite.core import multilabel, placement
from amp_rewrite.core.graph import SINK_OP, SOURCE_OP
from amp_rewrite.core.multilabel import plan_mixed
from amp_rewrite.core.options import ArgumentError
from amp_rewrite.core.precision import MIXED, Label
from amp_rewrite.core.report import Reasons, Report, mixed_summary, node_records
from amp_rewrite.fx import opkeys
from amp_rewrite.fx.apply import ApplyResult, apply_plan, check_applied, retype_values
from amp_rewrite.fx.floor import autocast_pins
from amp_rewrite.fx.flops import node_flops
from amp_rewrite.fx.fp8 import Fp8Options
from amp_rewrite.fx.ranges import screen
from amp_rewrite.fx.view import (LABELS, MISSING_LOW_KERNELS, FxView, alias_set, build_view,
                                 finished, resolve)

log = logging.getLogger(__name__)

# module type -> (function, arguments after the input: attribute names, "@param" for params)
_INLINE: dict[type, tuple[Callable, tuple[str, ...]]] = {
    nn.Linear: (F.linear, ("@weight", "@bias")),
    nn.Conv1d: (F.conv1d, ("@weight", "@bias", "stride", "padding", "dilation", "groups")),
    nn.Conv2d: (F.conv2d, ("@weight", "@bias", "stride", "padding", "dilation", "groups")),
    nn.Conv3d: (F.conv3d, ("@weight", "@bias", "stride", "padding", "dilation", "groups")),
    nn.LayerNorm: (F.layer_norm, ("normalized_shape", "@weight", "@bias", "eps")),
    nn.GroupNorm: (F.group_norm, ("num_groups", "@weight", "@bias", "eps")),
    nn.RMSNorm: (F.rms_norm, ("normalized_shape", "@weight", "eps")),
    nn.PReLU: (F.prelu, ("@weight",)),
    nn.Embedding: (F.embedding, ("@weight", "padding_idx")),
}


def _can_inline(module: nn.Module) -> bool:
    """Legality: the functional form must compute exactly what the module's forward does."""
    if type(module) not in _INLINE:
        return False
    if isinstance(module, nn.modules.conv._ConvNd) and module.padding_mode != "zeros":
        return False
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse
                                             or module.scale_grad_by_freq):
        return False
    return True


class InlineModules(PassBase):
    """Parameterised leaf ``call_module`` nodes → functional calls on ``get_attr`` parameters."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        nodes = [n for n in graph_module.graph.nodes if n.op == "call_module"
                 and _can_inline(graph_module.get_submodule(n.target))]
        for node in nodes:
            self._inline(graph_module, node)
        return finished(graph_module, bool(nodes))

    @staticmethod
    def _inline(gm: torch.fx.GraphModule, node: Node) -> None:
        module = gm.get_submodule(node.target)
        function, fields = _INLINE[type(module)]
        with gm.graph.inserting_before(node):
            extra = [_field(gm, node, module, f) for f in fields]
            call = gm.graph.call_function(function, (*node.args, *extra), dict(node.kwargs))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)


def _field(gm: torch.fx.GraphModule, node: Node, module: nn.Module, field: str) -> object:
    if not field.startswith("@"):
        return getattr(module, field)
    name = field[1:]
    if getattr(module, name, None) is None:
        return None
    return gm.graph.get_attr(f"{node.target}.{name}")


class DropFullSlices(PassBase):
    """``aten.slice(x, dim, 0, end >= size)`` with step 1 → ``x``. Exports keep such slices
    (Hugging Face LMs slice the hidden states for ``logits_to_keep=0``); eager autograd then
    runs a SliceBackward that zero-fills and copies a gradient of the full size. Slices that
    an in-place op writes through stay: the write must reach the base."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        dropped = 0
        for node in list(graph_module.graph.nodes):
            if _is_full_slice(node) and not any(
                    opkeys.mutated_argument(user, graph_module) is not None
                    for user in node.users):
                node.replace_all_uses_with(node.args[0])
                graph_module.graph.erase_node(node)
                dropped += 1
        return finished(graph_module, bool(dropped))


def _is_full_slice(node: Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor \
            or node.kwargs:
        return False
    defaults = (None, 0, None, None, 1)  # slice.Tensor(self, dim=0, start=None, end=None, step=1)
    source, dim, start, end, step = (*node.args, *defaults[len(node.args):])
    source_val, val = opkeys.tensor_val(source), opkeys.tensor_val(node)
    if source_val is None or val is None or step != 1 or start not in (0, None):
        return False
    size = source_val.shape[dim]
    # a slice to the end of the dim (sys.maxsize, as exported) or past its (static) size
    whole = end is None or isinstance(end, int) and (
        end >= 2**62 or isinstance(size, int) and end >= size)
    return whole and val.shape == source_val.shape


class FunctionalizeInPlace(PassBase):
    """In-place ops on intermediate tensors → out-of-place ops (see the module docstring)."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        order = {n: i for i, n in enumerate(graph_module.graph.nodes)}
        changed = 0
        for node in list(graph_module.graph.nodes):
            if node.op not in ("call_function", "call_method"):
                continue
            later = self._later_readers(graph_module, node, order)
            if later is not None:
                written = resolve(opkeys.mutated_argument(node, graph_module))
                changed += _make_functional(node)
                for user in later:  # they read the written tensor: now the op's result
                    user.replace_input_with(written, node)
        return finished(graph_module, bool(changed))

    def _later_readers(self, gm: torch.fx.GraphModule, node: Node,
                       order: dict[Node, int]) -> list[Node] | None:
        """Legality: readers of the written tensor after ``node``, or None if it must stay.

        It must stay when the tensor is an input, parameter or buffer (the write is the
        point), or when a view or base of it is read after the write (no result to rewire).
        The node's own result is the written tensor too; its readers read the out-of-place
        result afterwards, which holds the same values.
        """
        target = opkeys.mutated_argument(node, gm)
        if target is None or not _replaceable(node):
            return None
        written = resolve(target)
        aliases = storage_aliases(written, gm)
        if any(a.op in ("placeholder", "get_attr") for a in aliases):
            return None
        later = []
        for alias in aliases:
            for user in alias.users:
                if user is node or alias is node or order[user] < order[node]:
                    continue
                if alias is not written:
                    return None
                later.append(user)
        return later


def storage_aliases(value: Node, gm: torch.fx.GraphModule) -> set[Node]:
    """Every node that may share memory with ``value``: views, bases, and in-place results.

    ``alias_set`` follows views; an in-place op returns its written argument as well
    (``buf.mul_(0.9)`` *is* ``buf``), so this closes over both kinds of edge until nothing
    new is found.
    """
    found, stack = {value}, [value]
    while stack:
        node = stack.pop()
        linked = set(alias_set(node, gm))
        target = _inplace_target(node, gm)
        if target is not None:
            linked.add(target)
        linked |= {u for u in node.users if _inplace_target(u, gm) is node}
        for other in linked - found:
            found.add(other)
            stack.append(other)
    return found


def _inplace_target(node: Node, gm: torch.fx.GraphModule) -> Node | None:
    """The tensor an in-place node writes (and returns), or None."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None
    target = opkeys.mutated_argument(node, gm)
    return resolve(target) if target is not None else None


def _replaceable(node: Node) -> bool:
    if node.kwargs.get("inplace") is True:
        return True
    variant = opkeys.functional_variant(node)
    if node.op == "call_method":
        return hasattr(torch.Tensor, variant)
    return variant is not None


def _make_functional(node: Node) -> int:
    if node.kwargs.get("inplace") is True:
        node.update_kwarg("inplace", False)
    else:
        node.target = opkeys.functional_variant(node)
    return 1


@dataclass(frozen=True)
class FxOptions:
    """What the passes need, from the checked user options (``FxOptions.of``)."""

    low: torch.dtype = torch.float16  # the view's low dtype; fp16 in a mixed plan
    mixed: bool = False  # dtype="mixed": fp16, bf16 or fp32 per group (core/multilabel.py)
    rules: tuple[str, ...] = ()
    keep_fp32: tuple[str, ...] = ()
    keep_io_types: bool = True
    device: str | None = None  # device type the model runs on; None: the graph's
    autocast_floor: bool = True  # never lower precision than torch.autocast (fx/floor.py)
    pad: bool | PadPolicy | None = None  # None: on for device 'cuda'
    fuse: bool = True
    emulate_gemms: bool | None = None
    fp8: Fp8Options | None = None  # None: no FP8 GEMMs (fx/fp8.py)
    # node name -> reason: pinned fp32 by the accuracy budget (amp_rewrite.fx.budget)
    budget_pins: Mapping[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def of(cls, options) -> FxOptions:
        """The passes' options from the user's checked ones (``fx/options.TorchOptions``);
        the FP8 options are checked together here (they depend on each other and the dtype)."""
        mixed = options.dtype == MIXED
        if mixed and options.fp8 is not None:
            raise ArgumentError(f"fp8={options.fp8!r} with dtype='mixed': FP8 GEMMs replace "
                                "bf16 GEMMs of a bf16 plan; use dtype=torch.bfloat16")
        low = torch.float16 if mixed else options.dtype
        return cls(low, mixed, options.rules, options.keep_fp32, options.keep_io_types,
                   options.device, options.autocast_floor, options.pad, options.fuse,
                   options.emulate_gemms,
                   Fp8Options.checked(options.fp8, options.fp8_grad_dtype,
                                      options.fp8_min_size, options.keep_bf16, low))

    @property
    def dtype_name(self) -> str:
        """The report's ``dtype``: 'float16', 'bfloat16' or 'mixed'."""
        return MIXED if self.mixed else str(self.low).removeprefix("torch.")

    @property
    def low_dtypes(self) -> tuple[torch.dtype, ...]:
        """The low dtypes a group may run in."""
        return (torch.float16, torch.bfloat16) if self.mixed else (self.low,)


class MixedPrecisionPass(PassBase):
    """View → plan (core) → apply → refreshed ``meta['val']``; see docs/design.md §1."""

    def __init__(self, options: FxOptions, rules: RuleSet) -> None:
        self.options, self.rules = options, rules
        self.view: FxView | None = None
        self.plan: PrecisionPlan | None = None
        self.applied: ApplyResult | None = None

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        self.view, self.plan = self._plan(graph_module)
        self.applied = apply_plan(graph_module, self.view, self.plan)
        retype_values(graph_module, self.view, self.plan)
        return PassResult(graph_module, self.applied.modified)

    def _plan(self, gm: torch.fx.GraphModule) -> tuple[FxView, PrecisionPlan]:
        """View and plan; the model's own fp32 conversions go low only if all readers do.

        A conversion planned low with a high reader is kept fp32, as a deny source, and the
        plan redone: the model asked for fp32 there (Llama's RMSNorm upcast, which also
        carries the residual stream), and only readers that all run low make that moot.
        """
        kept: dict[Node, str] = {}
        while True:
            view, plan = self._plan_once(gm, kept)
            new = _conversions_with_high_readers(view, plan)
            if not new:
                return view, plan
            kept.update(new)

    def _plan_once(self, gm: torch.fx.GraphModule,
                   kept: dict[Node, str]) -> tuple[FxView, PrecisionPlan]:
        """One view and its plan; the core reads promoting ops' inputs for free (view)."""
        opts = self.options
        # a mixed view fixes fp32 only what bf16 cannot hold (bf16's range)
        widest = torch.bfloat16 if opts.mixed else opts.low
        view = build_view(gm, opts.low, max_finite=LowDtype.parse(widest).max_finite,
                          keep_io_types=opts.keep_io_types,
                          keep_fp32_modules=list(opts.keep_fp32), kept_conversions=kept,
                          device=opts.device, mixed=opts.mixed)
        pins = autocast_pins(view.graph, self.rules, range_low=opts.mixed) \
            if opts.autocast_floor else {}
        pins.update(_budget_pins(view, opts.budget_pins))
        if opts.mixed:
            return view, _mixed_plan(gm, view, self.rules, opts.keep_fp32, pins)
        return view, plan_precision(view.graph, self.rules, keep_fp32=opts.keep_fp32,
                                    pins=pins)

    def ensures(self, graph_module: torch.fx.GraphModule) -> None:
        if self.view is not None and self.plan is not None:
            check_applied(self.view, self.plan)

    def report(self) -> Report:
        """Per-node decisions and totals (``core.report``), with every node's reasons."""
        records = node_records(self.plan, self.view.graph)
        applied = self.applied
        report = Report(self.options.dtype_name, records,
                        applied.casts_inserted, self.plan.cast_units,
                        applied.conversions_retyped, applied.modified,
                        why=dict(Reasons(self.plan, self.view.graph)))
        if self.options.mixed:
            report.mixed = mixed_summary(self.plan, self.view.graph, _group_flops(self.view))
        notes = []
        if not records:
            notes.append("the model has no floating-point tensors: returned unchanged")
        if report.unlisted_ops:
            notes.append(f"ops in no rule list, kept fp32: {', '.join(report.unlisted_ops)}")
        report.details = TorchDetails(len(self.plan.casts), applied.upcasts_by_promotion, notes)
        return report


@dataclass
class TorchDetails:
    """The torch path's own report keys (``core/report.Report.details``; docs/python.md);
    the plan sets the first three, the pipeline the rest (``fx/pipeline.py``)."""

    casts_planned: int
    upcasts_by_promotion: int
    notes: list[str]
    device: str | None = None
    emulated_gemms: dict | None = None
    fp8: dict | None = None
    attention_masks_dropped: int = 0
    # hot GEMM chains shifted into fp16's range: {"node", "shift", "down"} (fx/rescale.py)
    rescaled: list[dict] = field(default_factory=list)


def _mixed_plan(gm: torch.fx.GraphModule, view: FxView, rules: RuleSet,
                keep_fp32: tuple[str, ...], pins: dict) -> PrecisionPlan:
    """fp16, bf16 or fp32 per group (``core.multilabel.plan_mixed``, decision 0037): the
    view's fixed dtypes, the kernels this device has, the ranges of ``fx/ranges.py``, the
    pins, and promoting reads next to fp32-fixed anchors read for free (decision 0004)."""
    ranges = screen(gm, view)
    constraints = dict(
        adapter_dtypes={k: LABELS[d] for k, d in view.fixed_dtypes.items() if d in LABELS},
        keep_fp32=keep_fp32, pins=pins, fp16_wide_values=ranges.fp16_wide_values,
        wide_values=ranges.wide_values, range_groups=ranges.range_groups)
    admissible = _admissible(view)
    free = _free_reads(view.graph, rules, admissible, constraints)
    return plan_mixed(view.graph, rules, admissible=admissible, free=free, **constraints)


def _admissible(view: FxView) -> dict:
    """Group key -> the labels its kernel has on this device, for nodes that lack some low
    kernel (``fx/guards.mark_missing_low_kernels``)."""
    found = {}
    for info in view.graph.groups():
        missing = getattr(info.node, "meta", {}).get(MISSING_LOW_KERNELS)
        if missing:
            found[info.key] = frozenset(Label) - {LABELS[d] for d in missing}
    return found


def _free_reads(graph, rules: RuleSet, admissible: Mapping, constraints: dict
                ) -> placement.FreeReads:
    """Promoting reads anchored by a group that can only run fp32 (``plan_mixed`` models
    fixed anchors only: core/multilabel.py)."""
    sets = multilabel.label_sets(graph, rules, **constraints)
    fp32 = {k: Precision.HIGH for k, a in sets.items()
            if not (a.labels & admissible.get(k, a.labels)) - {Label.FP32}}
    return placement.free_reads(graph, fp32, placement.promotion_candidates(graph))


def _group_flops(view: FxView) -> dict:
    """FLOPs per op group (``fx/flops.py``), for the mixed report's FLOP shares."""
    return {g.key: node_flops(g.node, g.op_key) for g in view.graph.groups()
            if isinstance(g.node, Node) and g.op_key not in (SOURCE_OP, SINK_OP)}


def _budget_pins(view: FxView, pinned: Mapping[str, str]) -> dict:
    """Group key -> reason for the groups of the nodes the accuracy budget pinned; groups
    the view fixed keep their precision (a conversion's output keeps the dtype asked for)."""
    return {g.key: pinned[g.name] for g in view.graph.groups()
            if g.fixed is None and g.name in pinned}


def _conversions_with_high_readers(view: FxView, plan: PrecisionPlan) -> dict[Node, str]:
    """Free conversion outputs planned low although one of their readers runs high."""
    graph, found = view.graph, {}
    for info in graph.groups():
        if info.tvar != "out" or info.fixed is not None or info.op_key not in opkeys.RETYPABLE:
            continue
        if plan.precision(info.key) is not Precision.LOW:
            continue
        readers = [c for v in graph.outputs(info.key) for c in graph.consumers(v)]
        if any(plan.precision(c) is Precision.HIGH for c in readers):
            found[info.node] = (f"{info.op_key}: the model's own conversion to float32 is "
                                "kept because a reader runs high")
    return found
