"""The accuracy budget on the ONNX path: plans measured under per-op rounding.

Every plan is measured on one instrumented copy of the fused FP32 model (``emulation.py``:
each main-graph op in float32 on inputs rounded to its dtype, its outputs rounded once;
subgraph bodies in FP32): one min cut (a mixed plan: one ``plan_mixed``, where a pin means
fp32 and the nodes left low take fp16 or bf16 anew) and one session run per plan, not a
rewrite.

The search, its estimate, the relaxation of calibration pins and the outcome are
``core.budget``'s (decision 0035); this module is its ``BudgetAdapter``: units are main-graph
nodes the default plan runs low whose precision the rules decide (the adapter's fixes
stay), weighted by FLOPs from the shapes of one FP32 run; relaxation candidates are the
nodes the calibration threshold pinned.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from amp_rewrite.core import LowDtype, Precision
from amp_rewrite.core import budget as core_budget
from amp_rewrite.core.flops import op_flops
from amp_rewrite.core.precision import Label
from amp_rewrite.onnx import validate
from amp_rewrite.onnx.emulation import Emulator

logger = logging.getLogger(__name__)

MEASURED_BY = "onnxruntime float32 kernels, every low input and output rounded"
MEASURED_BY_MIXED = f"{MEASURED_BY} to its node's dtype (fp16 or bf16)"
_MAX_FINITE = {Label.FP16: LowDtype.FLOAT16.max_finite, Label.BF16: LowDtype.BFLOAT16.max_finite}
_PINNED = "pinned fp32 by the accuracy budget"
_LOWERED = "run low by the accuracy budget"


@dataclass
class BudgetOutcome(core_budget.BudgetOutcome):
    """``core.budget.BudgetOutcome`` with the FP32 model and held-out inputs, for the
    rewritten model's own check in onnxruntime (``api._held_out_on_runtime``)."""

    fp32: onnx.ModelProto | None = None
    held_feeds: dict | None = None


def node_flops(op_type: str, inputs: list, outputs: list) -> float:
    """FLOPs of one node (``core.flops.op_flops``) from its inputs' and outputs' arrays or
    shapes (None: unknown)."""
    def shape(x):
        return None if x is None else tuple(getattr(x, "shape", x))

    return op_flops(op_type, [shape(x) for x in inputs], [shape(x) for x in outputs])


def default_feeds(proto: onnx.ModelProto, data) -> tuple[dict, dict, str, str]:
    """(search feeds, held-out feeds, where each came from): the calibration data split in
    two along a leading batch dim when it has ≥ 2 rows everywhere, else the data searched
    and seeded random inputs held out; without data, two seeded random draws."""
    if data is None:
        return (validate.random_feeds(proto, seed=0), validate.random_feeds(proto, seed=1),
                "seeded random inputs (no --calibrate data)",
                "seeded random inputs (another seed)")
    feeds = validate.load_feeds(data)
    validate.check_feeds(proto, feeds)
    rows = {np.asarray(a).shape[0] if np.asarray(a).ndim else 0 for a in feeds.values()}
    if len(rows) == 1 and min(rows) >= 2 and _batch_dim_free(proto):
        half = min(rows) // 2
        return ({k: np.asarray(a)[:half] for k, a in feeds.items()},
                {k: np.asarray(a)[half:] for k, a in feeds.items()},
                f"the calibration data, rows 0-{half - 1}",
                f"the calibration data, rows {half}-{min(rows) - 1}")
    return (feeds, validate.random_feeds(proto, seed=1), "the calibration data",
            "seeded random inputs (the data has one row: nothing to hold out)")


def _batch_dim_free(proto: onnx.ModelProto) -> bool:
    inits = {t.name for t in proto.graph.initializer}
    for inp in proto.graph.input:
        if inp.name in inits:
            continue
        dims = inp.type.tensor_type.shape.dim
        if not dims or dims[0].HasField("dim_value"):
            return False
    return True


def search_budget(pass_, model: ir.Model, max_error: float, search_feeds: dict,
                  held_feeds: dict, *, max_evaluations: int = core_budget.DEFAULT_MAX_EVALUATIONS,
                  inputs: str = "", held_out_inputs: str = "",
                  progress: Callable[[int, float], None] | None = None) -> BudgetOutcome:
    """Search the pins of ``pass_`` (an OnnxOptions pass not yet run) on ``model`` (an FP32
    copy it may fuse and instrument) for ``max_error`` (``core.budget``; both numbers checked
    by ``RewriteOptions``)."""
    start = time.perf_counter()
    adapter = OnnxBudget(pass_, model, search_feeds, held_feeds)
    option = f"--max-error {max_error:g}"
    result, units, relaxed = core_budget.plan_within_budget(
        adapter, max_error, option, max_evaluations=max_evaluations, progress=progress)
    adapter.fp32 = {}  # the search inputs' intermediate values: not needed any more
    final = relaxed.plan if relaxed else adapter.plan(frozenset(result.pins))
    measured_by = MEASURED_BY_MIXED if pass_.options.mixed else MEASURED_BY
    outcome = BudgetOutcome(result, units, option, inputs, held_out_inputs, measured_by,
                            relaxed, adapter.measure(final, held_out=True),
                            adapter.measure(adapter.default, held_out=True),
                            (adapter.low_share(final), adapter.low_share(adapter.default)))
    outcome.warn_if_held_out_above(logger, "--calibrate data")
    outcome.seconds = time.perf_counter() - start
    return outcome


class OnnxBudget:
    """The ``core.budget.BudgetAdapter`` of a prepared pass: plans are ``PrecisionPlan``s
    (``pass_.plan_view``: two-label or mixed) measured by the ``Emulator``; units are node
    names, values are value names."""

    mask_sentinel = None  # a float32-max mask rounds to inf here, as in the rewritten model

    def __init__(self, pass_, model: ir.Model, search_feeds: dict, held_feeds: dict) -> None:
        pass_.prepare(model)
        self.pass_, self.default = pass_, pass_.plan_view()
        self.emulator = emulator = Emulator(pass_, model)
        _warn_unmeasured_bodies(pass_, self.default, emulator)
        self.feeds = {False: search_feeds, True: held_feeds}
        fetch = emulator.fetchable
        self.fp32 = dict(zip(fetch, emulator.run(search_feeds, None, fetch)))
        self.references = {False: [self.fp32[name] for name in emulator.outputs]}
        self.shapes = _shapes(emulator, search_feeds, self.fp32)
        self.low_max = emulator.view.low.max_finite  # a mixed plan's: ``unit_low_max``
        self.graph_outputs = frozenset(emulator.outputs)
        self.unit_groups = _node_groups(pass_, emulator, lambda key: True)
        self.relax_groups = _relax_candidates(pass_, self.default, emulator)

    def units(self) -> list[core_budget.Unit]:
        """Main-graph nodes the default plan runs low by the rules' choice, with FLOPs and
        peaks from the FP32 run."""
        low = {name for name, keys in self.unit_groups.items()
               if any(self.default.precision(k) is Precision.LOW for k in keys)}
        fp32 = self.values(None)
        return [core_budget.Unit(name, self.weight(name),
                                 peak=core_budget.unit_peak(self, name, fp32))
                for name in sorted(low - _duplicate_names(self.pass_))]

    def relax_units(self) -> list[core_budget.Unit]:
        return [core_budget.Unit(name, self.weight(name)) for name in sorted(self.relax_groups)]

    def fp32_reason(self, name: str) -> str:
        return self.default.decisions[self.relax_groups[name][0]].reason

    def plan(self, pins: frozenset = frozenset(), low_pins: frozenset = frozenset()):
        high = {g: _PINNED for name in pins for g in self.unit_groups[name]}
        low = {g: _LOWERED for name in low_pins for g in self.relax_groups[name]}
        return self.pass_.plan_view(high, low) if high or low else self.default

    def measure(self, plan, held_out: bool = False) -> float:
        feeds = self.feeds[held_out]
        if held_out not in self.references:
            self.references[held_out] = self.emulator.run(feeds, None)
        return self.emulator.error(feeds, self.references[held_out], plan)

    def values(self, plan) -> dict[str, list]:
        fetch = self.emulator.fetchable
        run = self.fp32 if plan is None else dict(
            zip(fetch, self.emulator.run(self.feeds[False], plan, fetch)))
        return {name: [a] for name, a in run.items()}

    def unit_io(self, name: str) -> tuple[list[str], list[str]]:
        ins, outs, _ = self.emulator.node_io[name]
        seen = self.emulator.visible
        return [seen.get(v, v) for v in ins if v], [seen.get(v, v) for v in outs if v]

    def unit_low_max(self, name: str) -> float:
        """The largest finite value of the dtype the default plan runs ``name`` in (the
        narrowest of its low groups'): a mixed plan's bf16 node holds what fp16 cannot, so
        its FP32 peak overflows only beyond bf16's range."""
        low = self.emulator.low
        labels = {self.default.label(k, low) for k in self.unit_groups[name]} - {Label.FP32}
        return min((_MAX_FINITE[label] for label in labels), default=self.low_max)

    def weight(self, name: str) -> float:
        ins, outs, op = self.emulator.node_io[name]
        return node_flops(op, [self.shapes.get(v) for v in ins],
                          [self.shapes.get(v) for v in outs])

    def low_share(self, plan) -> float:
        """FLOPs of the main-graph nodes ``plan`` runs low (any port group low) over those
        of all main-graph nodes with float ports."""
        low: dict[str, bool] = {}
        for key, (node, _) in self.pass_.view.groups.items():
            if key in self.emulator.flags and node.name in self.emulator.node_io:
                low[node.name] = (low.get(node.name, False)
                                  or plan.precision(key) is Precision.LOW)
        weights = {name: self.weight(name) for name in low}
        return core_budget.low_flop_share(weights, [n for n, is_low in low.items() if is_low])


def _relax_candidates(pass_, default, emulator) -> dict[str, list]:
    """Node name -> its groups that run fp32 only because of a calibration pin (main graph,
    uniquely named nodes, not fixed by the adapter). Deny propagation is kept: it stands for
    inputs the data may not show (an all-masked row, a larger exp input), and its ops are
    light (decision 0028 §2)."""
    calibrated = set(pass_.option_pins[0])
    duplicated = _duplicate_names(pass_)
    groups = _node_groups(pass_, emulator, lambda key: key in calibrated
                          and default.decisions[key].precision is not Precision.LOW)
    return {name: keys for name, keys in groups.items() if name not in duplicated}


def _warn_unmeasured_bodies(pass_, default, emulator: Emulator) -> None:
    """The emulation computes If/Loop/Scan bodies in FP32: say so when the plan runs any of
    their nodes low (the rewritten model's own check, fp16 in onnxruntime, still sees them)."""
    hidden = {node.name for key, (node, _) in pass_.view.groups.items()
              if key not in emulator.flags and default.precision(key) is Precision.LOW}
    if hidden:
        logger.warning("accuracy budget: %d nodes inside If/Loop/Scan bodies run low but are "
                       "measured in fp32 (the emulation covers the main graph); check the "
                       "held-out error in onnxruntime (report: held_out_onnxruntime)",
                       len(hidden))


def _node_groups(pass_, emulator: Emulator, wanted) -> dict[str, list]:
    """Node name -> its ``wanted`` group keys (main graph, named nodes, not adapter-fixed)."""
    groups: dict[str, list] = {}
    for key, (node, _) in pass_.view.groups.items():
        if key in emulator.flags and node.name and pass_.view.graph.group(key).fixed is None \
                and wanted(key):
            groups.setdefault(node.name, []).append(key)
    return groups


def _duplicate_names(pass_) -> set[str]:
    seen, dup = set(), set()
    for node, _ in {id(n): (n, p) for n, p in pass_.view.groups.values()}.values():
        (dup if node.name in seen else seen).add(node.name)
    return dup


def _shapes(emulator: Emulator, feeds, fp32: Mapping[str, np.ndarray]) -> dict[str, tuple]:
    """Shape of every value of the main graph (from the FP32 run; feeds and weights too)."""
    shapes = {n: a.shape for n, a in fp32.items()}
    shapes.update({raw: shapes[seen] for raw, seen in emulator.visible.items() if seen in shapes})
    shapes.update({k: np.asarray(v).shape for k, v in feeds.items()})
    for init in emulator.view.graphs[0].initializers.values():
        if init.shape is not None:
            shapes[init.name] = tuple(d if isinstance(d, int) else 1 for d in init.shape.dims)
    return shapes


def write_rule_overlay(path, pass_, outcome: BudgetOutcome, options) -> None:
    """A rule overlay reproducing the budgeted plan without the search or the data: the
    budget's pins and lowered nodes, the nodes calibration pinned and the ``--keep-fp32``
    patterns given."""
    from amp_rewrite.onnx.save import write_bytes_atomically

    calibrated = sorted({pass_.view.graph.group(k).name
                         for k, d in pass_.plan.decisions.items()
                         if d.fixed and d.reason.startswith("calibration saw")} - {""})
    fp32 = [(core_budget.fnmatch_literal(n), "pinned fp32 by calibration (--calibrate)", "")
            for n in calibrated]
    fp32 += [(p, "--keep-fp32 pattern", "") for p in options.keep_fp32]
    text = outcome.overlay(f"amp-rewrite {outcome.option}: rewriting with this overlay "
                           f"(--rules){_also_needed(options)} and no --max-error reproduces "
                           "the plan", fp32)
    write_bytes_atomically(path, text.encode("utf-8"))


def _also_needed(options) -> str:
    """What a mixed plan needs besides the overlay: a rule file can pin a node fp32 or low,
    not bf16, so the nodes calibration sent to bf16 (values beyond fp16's threshold) come
    from the same data again."""
    if options.mixed and options.hot_values:
        return ", --dtype mixed, the same --calibrate data (its values beyond fp16 run bf16)"
    return ", --dtype mixed" if options.mixed else ""
