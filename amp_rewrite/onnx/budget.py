"""The accuracy budget on the ONNX path: plans measured under per-op rounding.

One instrumented copy of the fused FP32 model serves every evaluation. Each port group of the
main graph (and each graph input and output the plan may make low) gets a boolean graph
input, its flag; every float input and output of the group goes through
``Where(flag, Cast(Cast(x, low), float), x)``. With a plan's labels as the flags, the copy
computes each op in float32 on inputs rounded to the low dtype and rounds its outputs once:
what a GPU kernel with fp32 accumulation does (tested against ``onnx.reference``). Casts need
no emulation: a value read in the other dtype is the rounded value. Flags all off give the
FP32 reference. A plan costs one min cut and one session run, not a rewrite.

The search, its estimate, the relaxation of calibration pins and the outcome are
``core.budget``'s (decision 0035); this module is its ``BudgetAdapter``: units are main-graph
nodes the default plan runs low whose precision the rules decide (the adapter's fixes
stay), weighted by FLOPs from the shapes of one FP32 run; relaxation candidates are the
nodes the calibration threshold pinned. Subgraph bodies run in FP32 in the emulation.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnx_ir as ir

from amp_rewrite import arguments
from amp_rewrite.core import LowDtype, Precision
from amp_rewrite.core import budget as core_budget
from amp_rewrite.core.flops import op_flops
from amp_rewrite.core.metric import worst_relative_error
from amp_rewrite.onnx import validate

logger = logging.getLogger(__name__)

_FLAG_PREFIX = "amp_rewrite.budget_flag."
_LOW_ONNX = {LowDtype.FLOAT16: ir.DataType.FLOAT16, LowDtype.BFLOAT16: ir.DataType.BFLOAT16}
MEASURED_BY = "onnxruntime float32 kernels, every low input and output rounded"
_PINNED = "pinned fp32 by the accuracy budget"
_LOWERED = "run low by the accuracy budget"


@dataclass
class BudgetOutcome(core_budget.BudgetOutcome):
    """``core.budget.BudgetOutcome`` with the FP32 model and held-out inputs, for the
    rewritten model's own check in onnxruntime (``api._held_out_on_runtime``)."""

    fp32: onnx.ModelProto | None = None
    held_feeds: dict | None = None


class Emulator:
    """The instrumented model of a prepared pass (module docstring) and its session."""

    def __init__(self, pass_, model: ir.Model) -> None:
        self.pass_ = pass_
        self.view = pass_.view
        self.low = _LOW_ONNX[self.view.low]
        self.flags: dict = {}  # group key -> flag input name
        self.visible: dict[str, str] = {}  # value name -> the name its readers see
        self.outputs = [v.name for v in model.graph.outputs]
        # before instrumenting: the names the model gives each node's inputs and outputs
        self.node_io = {node.name: ([v.name if v is not None else "" for v in node.inputs],
                                    [v.name for v in node.outputs], node.op_type)
                        for node, _ in self.view.groups.values()}
        self._instrument(model)
        self.session = _session(ir.to_proto(model))
        self.fetchable = [o.name for o in self.session.get_outputs()]

    def _instrument(self, model: ir.Model) -> None:
        graph = model.graph
        rounded: dict[ir.Value, ir.Value] = {}
        flags: dict = {}
        self._instrument_inputs(graph, rounded)
        # outputs first: readers of a rounded output then see the Where, not the raw value
        for key, (node, pg) in self.view.groups.items():
            if node.graph is not graph:
                continue
            flags[key] = flag = self._flag(graph, key)
            for j in pg.outputs:
                out = node.outputs[j]
                if out.dtype == ir.DataType.FLOAT and out.name not in self.visible:
                    self._round_output(graph, node, out, flag, rounded)
        for key, (node, pg) in self.view.groups.items():
            flag = flags.get(key)
            if flag is None:
                continue
            for i in pg.inputs:
                v = node.inputs[i]
                if v is None or v.dtype != ir.DataType.FLOAT:
                    continue
                chosen = self._where(graph, flag, self._rounded(graph, v, rounded), v,
                                     f"{v.name}.read{i}.{node.name}")
                node.replace_input_with(i, chosen)
        self._instrument_outputs(graph, rounded)
        graph.sort()
        existing = set(self.outputs)
        for node in list(graph):
            for v in node.outputs:
                if v.dtype == ir.DataType.FLOAT and v.name and v.name not in existing:
                    graph.outputs.append(v)
                    existing.add(v.name)

    def _instrument_inputs(self, graph, rounded) -> None:
        """Graph inputs the plan may make low (``keep_io_types=False``, ``low_io``): a flag
        each, the input rounded for every reader (before any reader is instrumented)."""
        inputs = set(graph.inputs)
        for key, (g, v, node) in self.view.sources.items():
            if g is not graph or node is not None or v.dtype != ir.DataType.FLOAT \
                    or v not in inputs:
                continue
            flag = self._flag(graph, key)
            uses = list(v.uses())
            chosen = self._where(graph, flag, self._rounded(graph, v, rounded), v,
                                 f"{v.name}.input_rounded")
            for use in uses:
                use.node.replace_input_with(use.idx, chosen)

    def _instrument_outputs(self, graph, rounded) -> None:
        """Graph outputs the plan may make low: a flag each, the output rounded."""
        for key, (g, index) in self.view.sinks.items():
            out = g.outputs[index]
            if g is not graph or out.dtype != ir.DataType.FLOAT:
                continue
            flag = self._flag(graph, key)
            chosen = self._where(graph, flag, self._rounded(graph, out, rounded), out,
                                 f"{out.name}.output_rounded")
            name = out.name
            out.name, chosen.name = f"{name}.unrounded_output", name
            graph.outputs[index] = chosen
            self.visible[name] = name

    def _flag(self, graph, key) -> ir.Value:
        flag = ir.Value(name=f"{_FLAG_PREFIX}{len(self.flags)}",
                        type=ir.TensorType(ir.DataType.BOOL), shape=ir.Shape([]))
        graph.inputs.append(flag)
        self.flags[key] = flag.name
        return flag

    def _round_output(self, graph, node, out: ir.Value, flag, rounded) -> None:
        uses = list(out.uses())
        was_output = out.is_graph_output()
        chosen = self._where(graph, flag, self._rounded(graph, out, rounded), out,
                             f"{out.name}.rounded")
        for use in uses:
            use.node.replace_input_with(use.idx, chosen)
        if was_output:
            index = next(k for k, v in enumerate(graph.outputs) if v is out)
            name = out.name
            out.name, chosen.name = f"{name}.unrounded", name
            graph.outputs[index] = chosen
            self.visible[name] = name
        else:
            self.visible[out.name] = chosen.name

    def _rounded(self, graph, v: ir.Value, rounded: dict) -> ir.Value:
        if v not in rounded:
            down = ir.node("Cast", [v], {"to": self.low})
            up = ir.node("Cast", [down.outputs[0]], {"to": ir.DataType.FLOAT})
            n = len(rounded)  # unique: a renamed graph output may reuse a value's name
            down.outputs[0].name = f"{v.name}.low{n}"
            up.outputs[0].name = f"{v.name}.round{n}"
            up.outputs[0].dtype = ir.DataType.FLOAT
            graph.extend([down, up])
            rounded[v] = up.outputs[0]
        return rounded[v]

    def _where(self, graph, flag, a, b, name: str) -> ir.Value:
        node = ir.node("Where", [flag, a, b])
        node.outputs[0].name = name
        node.outputs[0].dtype = ir.DataType.FLOAT
        graph.append(node)
        return node.outputs[0]

    def run(self, feeds: Mapping[str, np.ndarray], plan, fetch: list[str] | None = None
            ) -> list[np.ndarray]:
        """Outputs (or ``fetch``) under ``plan`` (None: all FP32)."""
        flags = {name: np.array(plan is not None and plan.precision(k) is Precision.LOW)
                 for k, name in self.flags.items()}
        return self.session.run(fetch or self.outputs, {**feeds, **flags})

    def error(self, feeds, reference: list[np.ndarray], plan) -> float:
        """The metric (``core.metric``) of the outputs under ``plan`` against ``reference``."""
        return worst_relative_error(reference, self.run(feeds, plan))


def _session(proto: onnx.ModelProto):
    import onnxruntime as ort

    from amp_rewrite.onnx.versions import loadable

    opts = ort.SessionOptions()
    opts.log_severity_level = 4
    # no graph optimisation: it may fold a float -> low -> float Cast pair, the rounding itself
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(loadable(proto).SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])



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
    copy it may fuse and instrument) for ``max_error`` (``core.budget``)."""
    max_error = arguments.max_error(max_error)
    arguments.max_evaluations(max_evaluations)
    start = time.perf_counter()
    adapter = OnnxBudget(pass_, model, search_feeds, held_feeds)
    option = f"--max-error {max_error:g}"
    result, units, relaxed = core_budget.plan_within_budget(
        adapter, max_error, option, max_evaluations=max_evaluations, progress=progress)
    adapter.fp32 = {}  # the search inputs' intermediate values: not needed any more
    final = relaxed.plan if relaxed else adapter.plan(frozenset(result.pins))
    outcome = BudgetOutcome(result, units, option, inputs, held_out_inputs, MEASURED_BY,
                            relaxed, adapter.measure(final, held_out=True),
                            adapter.measure(adapter.default, held_out=True),
                            (adapter.low_share(final), adapter.low_share(adapter.default)))
    outcome.warn_if_held_out_above(logger, "--calibrate data")
    outcome.seconds = time.perf_counter() - start
    return outcome


class OnnxBudget:
    """The ``core.budget.BudgetAdapter`` of a prepared pass: plans are ``PrecisionPlan``s
    measured by the ``Emulator``; units are node names, values are value names."""

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
        self.low_max = emulator.view.low.max_finite
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
                           "(--rules) and no --max-error reproduces the plan", fp32)
    write_bytes_atomically(path, text.encode("utf-8"))
