"""The accuracy budget on the ONNX path: measure plans under per-op rounding, search pins.

One instrumented copy of the fused FP32 model serves every evaluation. Each port group of the
main graph (and each graph input and output the plan may make low) gets a boolean graph
input, its flag; every float input and output of the group goes through
``Where(flag, Cast(Cast(x, low), float), x)``. With a plan's labels as the flags, the copy
computes each op in float32 on inputs rounded to the low dtype and rounds its outputs once:
what a GPU kernel with fp32 accumulation does (tested against ``onnx.reference``). Casts need
no emulation: a value read in the other dtype is the rounded value. Flags all off give the
FP32 reference. A plan costs one min cut and one session run, not a rewrite.

Units are main-graph nodes the default plan runs low whose precision the rules decide (the
adapter's fixes stay); their weight is FLOPs from the shapes of one FP32 run. Where the units
are too many to measure one by one, the estimate is infinite for a node with an input or
output beyond the low dtype's range in the FP32 run, else the error it injects in the default
plan (with those pinned): its outputs' relative error less its inputs'. With slack in the
default plan, nodes pinned by the calibration threshold are tried low (``_relax``).
Subgraph bodies run in FP32 in the emulation.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir

from amp_rewrite import arguments
from amp_rewrite.core import LowDtype, Precision
from amp_rewrite.core import budget as core_budget
from amp_rewrite.core.budget import rounded
from amp_rewrite.onnx import validate

logger = logging.getLogger(__name__)

_FLAG_PREFIX = "amp_rewrite.budget_flag."
_LOW_ONNX = {LowDtype.FLOAT16: ir.DataType.FLOAT16, LowDtype.BFLOAT16: ir.DataType.BFLOAT16}


@dataclass
class BudgetOutcome:
    """What the search chose and measured, for the final rewrite and the report."""

    pins: dict[str, str]  # node name -> reason (OnnxOptions.budget_pins)
    result: core_budget.BudgetResult
    units: list[core_budget.Unit]
    inputs: str  # where the search inputs came from
    held_out_inputs: str
    held_out_error: float
    default_held_out_error: float
    seconds: float
    relax: Relaxed | None = None  # fp32 nodes run low where the default plan had slack
    fp32: onnx.ModelProto | None = None  # the FP32 model and held-out inputs, for the
    held_feeds: dict | None = None  # rewritten model's own check (api._held_out_on_runtime)
    shares: tuple[float, float] = (1.0, 1.0)  # FLOP-weighted low share: (final, default)

    @property
    def lowered(self) -> dict[str, str]:
        return self.relax.lowered if self.relax else {}

    def report(self) -> dict:
        r, x = self.result, self.relax
        return {"max_error": r.budget, "reachable": r.reachable,
                "achieved": rounded(x.result.error if x else r.error),
                "held_out": rounded(self.held_out_error),
                "default_plan_error": rounded(r.start_error),
                "default_plan_held_out": rounded(self.default_held_out_error),
                "all_pinned_error": rounded(r.floor_error),
                "evaluations": r.evaluations + (x.result.evaluations if x else 0),
                "seconds": round(self.seconds, 3),
                "contributions": "measured" if r.measured else "estimated",
                "low_flop_share": round(self.shares[0], 4),
                "default_low_flop_share": round(self.shares[1], 4),
                "inputs": self.inputs, "held_out_inputs": self.held_out_inputs,
                "emulation": "onnxruntime float32 kernels, every low input and output rounded"}

    def pinned(self) -> list[dict]:
        return core_budget.pinned_records(self.result, self.units)

    def lowered_nodes(self) -> list[dict]:
        if not self.relax:
            return []
        weight = {u.key: u.weight for u in self.relax.units}
        return [{"node": n, "flops": weight[n]} for n in sorted(self.lowered)]


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
        got = self.run(feeds, plan)
        errors = validate.compare(dict(zip(self.outputs, reference)),
                                  dict(zip(self.outputs, got)))
        return max((math.inf if e.new_nonfinite else e.max_rel for e in errors), default=0.0)


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
    """FLOPs of one node from the shapes of its inputs and outputs (arrays or shapes)."""
    def shape(x):
        return tuple(getattr(x, "shape", x) or ())

    out = shape(outputs[0]) if outputs else ()
    out_n = float(math.prod(out)) if out else 1.0
    ins = [shape(x) if x is not None else () for x in inputs]
    if op_type in ("MatMul", "FusedMatMul", "Gemm") and ins and ins[0]:
        return 2.0 * out_n * ins[0][-1]  # K of A as stored (Gemm's transA is rare)
    if op_type in ("Conv", "ConvTranspose") and len(ins) > 1 and len(ins[1]) > 2:
        # Conv: each output reads C_in/groups · kernel weights; ConvTranspose: each input
        base = out_n if op_type == "Conv" else float(math.prod(ins[0]))
        return 2.0 * base * math.prod(ins[1][1:])
    if op_type in ("MultiHeadAttention", "Attention", "GroupQueryAttention",
                   "PackedMultiHeadAttention") and ins and ins[0]:
        q = ins[0]
        kv = ins[1] if len(ins) > 1 and ins[1] else q
        s_kv = kv[-2] if len(kv) == 4 else kv[1] if len(kv) == 3 else q[-2]
        return 4.0 * float(math.prod(q)) * s_kv
    return out_n


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
    copy it may fuse and instrument) for ``max_error`` (module docstring)."""
    max_error = arguments.max_error(max_error)
    arguments.max_evaluations(max_evaluations)
    start = time.perf_counter()
    pass_.prepare(model)
    default = pass_.plan_view()
    emulator = Emulator(pass_, model)
    _warn_unmeasured_bodies(pass_, default, emulator)
    fetch = emulator.fetchable
    fp32 = dict(zip(fetch, emulator.run(search_feeds, None, fetch)))
    reference = [fp32[name] for name in emulator.outputs]
    shapes = _shapes(emulator, search_feeds, fp32)
    units, unit_groups = _units(pass_, default, emulator, shapes)
    unit_list = _peaks(list(units.values()), emulator, fp32)

    def plan_of(pins: frozenset):
        extra = {g: "pinned fp32 by the accuracy budget" for k in pins for g in unit_groups[k]}
        return pass_.plan_view(extra) if extra else default

    def evaluate(pins: frozenset) -> float:
        return emulator.error(search_feeds, reference, plan_of(pins))

    def estimate() -> dict:
        """One run of the default plan with the overflowing units pinned (module docstring)."""
        overflowing = _overflowing(unit_list, emulator)
        return _scores(unit_list, emulator, search_feeds, fp32,
                       plan_of(frozenset(overflowing)), overflowing)

    result = core_budget.search(unit_list, evaluate, max_error, estimate=estimate,
                                max_evaluations=max_evaluations, progress=progress)
    del fp32
    relax = _relax(pass_, default, emulator, search_feeds, reference, shapes, max_error,
                   max_evaluations - result.evaluations, result, progress)
    final = plan_of(frozenset(result.pins)) if relax is None else relax.plan
    held_reference = emulator.run(held_feeds, None)
    held = emulator.error(held_feeds, held_reference, final)
    held_default = emulator.error(held_feeds, held_reference, default)
    if held > max_error:
        logger.warning("accuracy budget: the plan's error on held-out inputs is %.3g, above "
                       "--max-error %g (%.3g on the inputs searched); pass more varied "
                       "--calibrate data", held, max_error, result.error)
    option = f"--max-error {max_error:g}"
    pins = {k: core_budget.pin_reason(result, k, option) for k in result.pins}
    shares = (low_flop_share(pass_, final, emulator, shapes),
              low_flop_share(pass_, default, emulator, shapes))
    return BudgetOutcome(pins, result, unit_list, inputs, held_out_inputs, held,
                         held_default, time.perf_counter() - start, relax=relax,
                         shares=shares)


def low_flop_share(pass_, plan, emulator: Emulator, shapes) -> float:
    """FLOPs of the main-graph nodes ``plan`` runs low (any port group low) over those of all
    main-graph nodes with float ports."""
    low: dict[str, bool] = {}
    for key, (node, _) in pass_.view.groups.items():
        if key in emulator.flags and node.name in emulator.node_io:
            low[node.name] = low.get(node.name, False) or plan.precision(key) is Precision.LOW
    weights = {name: _weight(emulator, name, shapes) for name in low}
    total = sum(weights.values())
    return sum(w for n, w in weights.items() if low[n]) / total if total else 1.0


@dataclass
class Relaxed:
    """Nodes the calibration threshold kept fp32 that the budget runs low."""

    result: core_budget.BudgetResult  # its pins: the candidates kept fp32
    units: list[core_budget.Unit]
    lowered: dict[str, str]  # node name -> reason (OnnxOptions.budget_low)
    plan: object


def _relax(pass_, default, emulator, feeds, reference, shapes, max_error: float, left: int,
           tightened: core_budget.BudgetResult, progress) -> Relaxed | None:
    """With the default plan within the budget, the most FLOPs of the nodes the calibration
    threshold kept fp32 run low instead, measured as the pins are (``core_budget.search``
    with pinned = kept fp32)."""
    if tightened.pins or not tightened.reachable or left < 3:
        return None
    groups = _relax_candidates(pass_, default, emulator)
    if not groups:
        return None
    units = [core_budget.Unit(name, _weight(emulator, name, shapes)) for name in sorted(groups)]

    def plan_of(kept: frozenset):
        low = {g: "run low by the accuracy budget" for name, gs in groups.items()
               if name not in kept for g in gs}
        return pass_.plan_view(None, low) if low else default

    def evaluate(kept: frozenset) -> float:
        return emulator.error(feeds, reference, plan_of(kept))

    shown = (lambda done, error: progress(tightened.evaluations + done, error)) if progress \
        else None
    result = core_budget.search(units, evaluate, max_error, max_evaluations=left,
                                progress=shown)
    kept = set(result.pins) if result.reachable else set(groups)
    lowered = {name: (f"run low by the accuracy budget --max-error {max_error:g} (the plan "
                      f"measures {rounded(result.error)}; the rules kept it fp32: "
                      f"{default.decisions[groups[name][0]].reason})")
               for name in groups if name not in kept}
    return Relaxed(result, units, lowered, plan_of(frozenset(kept)))


def _relax_candidates(pass_, default, emulator) -> dict[str, list]:
    """Node name -> its groups that run fp32 only because of a calibration pin (main graph,
    uniquely named nodes, not fixed by the adapter). The threshold (4096 for fp16) leaves
    headroom below the range that the measurement can give back; deny propagation is kept:
    it encodes what inputs the data may not show (an all-masked row, a larger exp input),
    and its ops are light."""
    calibrated = set(pass_.option_pins[0])
    duplicated = _duplicate_names(pass_)
    groups = _node_groups(pass_, emulator, lambda key: key in calibrated
                          and default.decisions[key].precision is not Precision.LOW)
    return {name: keys for name, keys in groups.items() if name not in duplicated}


def _weight(emulator, name: str, shapes) -> float:
    ins, outs, op = emulator.node_io[name]
    return node_flops(op, [shapes.get(v) for v in ins], [shapes.get(v) for v in outs])


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


def _units(pass_, default, emulator: Emulator, shapes) -> tuple[dict, dict]:
    """(node name -> Unit, node name -> its group keys) for the main-graph
    nodes the default plan runs low by the rules' choice; FLOPs from one FP32 run."""
    groups = _node_groups(pass_, emulator)
    low = {n for n, ks in groups.items() if any(default.precision(k) is Precision.LOW for k in ks)}
    names_ = sorted(low - _duplicate_names(pass_))
    units = {name: core_budget.Unit(name, _weight(emulator, name, shapes)) for name in names_}
    return units, {n: groups[n] for n in names_}


def _node_groups(pass_, emulator: Emulator, wanted=lambda key: True) -> dict[str, list]:
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


def _peaks(units: list, emulator: Emulator, fp32: Mapping[str, np.ndarray]) -> list:
    """The units with ``peak``: the largest finite |x| of their float inputs and outputs in
    the FP32 run (weights aside: the range screen has judged them)."""
    peaks: dict[str, float] = {}

    def peak(name: str) -> float:
        seen = emulator.visible.get(name, name)
        if seen not in peaks:
            a = fp32.get(seen)
            finite = a[np.isfinite(a)] if a is not None and a.dtype.kind == "f" else None
            peaks[seen] = float(np.abs(finite).max()) if finite is not None and finite.size \
                else 0.0
        return peaks[seen]

    out = []
    for unit in units:
        ins, outs, _ = emulator.node_io[unit.key]
        top = max((peak(v) for v in (*ins, *outs) if v), default=0.0)
        out.append(dataclasses.replace(unit, peak=top))
    return out


def _overflowing(units: list, emulator: Emulator) -> set:
    """Units with a float input or output beyond the low dtype's range in the FP32 run: low,
    they overflow whatever else runs low (found without a run, where an overflow upstream
    would hide the next one behind its infinities)."""
    limit = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max if emulator.view.low is
                  LowDtype.BFLOAT16 else np.finfo(np.float16).max)
    return {u.key for u in units if u.peak > limit}


def _scores(units: list, emulator: Emulator, feeds, fp32: Mapping[str, np.ndarray], plan,
            overflowing: set) -> dict:
    """Each unit's injected error in ``plan`` (the default plan with the overflowing units
    pinned): max relative error of its outputs less that of its inputs, both against the
    FP32 run, by unit key; for a node writing a graph output, its output's error; an
    overflowing unit's is infinite."""
    fetch = emulator.fetchable
    low = dict(zip(fetch, emulator.run(feeds, plan, fetch)))
    rel_cache: dict[str, float] = {}

    def rel(name: str) -> float:
        seen = emulator.visible.get(name, name)
        if seen not in rel_cache:
            a, b = fp32.get(seen), low.get(seen)
            if a is None or b is None:
                rel_cache[seen] = 0.0
            else:
                e = validate.compare({seen: a}, {seen: b})[0]
                rel_cache[seen] = math.inf if e.new_nonfinite else e.max_rel
        return rel_cache[seen]

    graph_outputs = set(emulator.outputs)
    scores = {}
    for unit in units:
        if unit.key in overflowing:
            scores[unit.key] = math.inf
            continue
        ins, outs, _ = emulator.node_io[unit.key]
        out_err = max((rel(v) for v in outs), default=0.0)
        # an output's own rounding reaches the graph output whole: no input error to deduct
        in_err = 0.0 if graph_outputs & set(outs) else max((rel(v) for v in ins if v),
                                                            default=0.0)
        if math.isinf(out_err):
            scores[unit.key] = 0.0 if math.isinf(in_err) else math.inf
        else:
            scores[unit.key] = max(out_err - in_err, 0.0)
    return scores


def write_rule_overlay(path, pass_, outcome: BudgetOutcome, options) -> None:
    """A rule overlay reproducing the budgeted plan without the search or the data: the
    budget's pins, the nodes calibration pinned and the ``--keep-fp32`` patterns given."""
    from amp_rewrite.onnx.save import write_bytes_atomically

    r = outcome.result
    entries = core_budget.pin_entries(r, outcome.units, outcome.pins)
    calibrated = sorted({pass_.view.graph.group(k).name
                         for k, d in pass_.plan.decisions.items()
                         if d.fixed and d.reason.startswith("calibration saw")} - {""})
    entries += [(core_budget.fnmatch_literal(n), "pinned fp32 by calibration (--calibrate)", "")
                for n in calibrated]
    entries += [(p, "--keep-fp32 pattern", "") for p in options.keep_fp32]
    low = [(core_budget.fnmatch_literal(n), why, "") for n, why in sorted(outcome.lowered.items())]
    header = [f"amp-rewrite --max-error {r.budget:g}: rewriting with this overlay (--rules) and "
              "no --max-error reproduces the plan",
              f"error {rounded(r.error)} on {outcome.inputs}; {rounded(outcome.held_out_error)} "
              f"held out; {r.evaluations} evaluations"]
    write_bytes_atomically(path, core_budget.rule_overlay(entries, header, low).encode("utf-8"))
