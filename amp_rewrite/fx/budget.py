"""The accuracy budget on the torch path: measure plans with the rewrite's own kernels.

``rewrite(..., max_error=E)`` keeps low the most FLOPs whose relative output error
(max|out − fp32| / max|fp32| per float output, the largest over outputs and batches; a NaN
or Inf where FP32 had none is infinite) stays within E on the search batches
(``core.budget``). The graph is captured and prepared (inlining, fusion, masks) once; each
measured plan is a copy of the prepared graph, sharing its parameters, planned with the
candidate pins, lowered as the final rewrite is (FP8, padding, emulated GEMMs) and run on
this device: its error is what the rewritten module computes here, not a model of it.
Pointwise fusion is left out of the copies: its Inductor regions compute in fp32 inside and
would cost a compilation per plan, so a measured error is, if anything, pessimistic.

Units are the nodes the default plan runs low whose precision the rules decided (a group
the view fixed is not the budget's to move); their weight is FLOPs from ``meta['val']``.
Where the units are too many to measure one by one, each unit's score is the error it adds
in the default plan: the relative error of its output less that of its inputs, against the
FP32 graph's intermediate values. The final rewritten module is measured on the held-out
batches, which the search never saw.
"""
from __future__ import annotations

import copy
import logging
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.fx import Node

from amp_rewrite import arguments
from amp_rewrite.core import Precision
from amp_rewrite.core import budget as core_budget
from amp_rewrite.core.budget import rounded
from amp_rewrite.errors import UsageError
from amp_rewrite.fx.capture import flat_inputs, normalize_inputs
from amp_rewrite.fx.lowering import LOWERED_TAG
from amp_rewrite.fx.opkeys import size_hint, tensor_val
from amp_rewrite.fx.view import CAST_TAG

log = logging.getLogger(__name__)

BUDGET_REASON = "pinned fp32 by the accuracy budget"


@dataclass(frozen=True)
class BudgetRequest:
    """What the user asked: the budget and the batches, split into searched and held out."""

    max_error: float
    max_evaluations: int
    search: list[tuple]
    held: list[tuple]  # empty: nothing held out
    inputs: str  # where the search batches came from, for the report
    held_out_inputs: str
    kwargs: dict = field(default_factory=dict)  # example_kwargs, passed with every batch
    emit_rules: str | os.PathLike | None = None


def request(max_error: object, *, calibration_data: object, max_evaluations: object,
            emit_rules: object, example_inputs: Any = None,
            example_kwargs: Mapping[str, Any] | None = None) -> BudgetRequest | None:
    """The checked request (None without ``max_error``). Batches: the first half of
    ``calibration_data`` searched, the rest held out; one batch: ``example_inputs``
    searched and the batch held out; no batch, or one without examples: nothing held out."""
    arguments.max_evaluations(max_evaluations)
    if max_error is None:
        for name, value in (("calibration_data", calibration_data), ("emit_rules", emit_rules)):
            if value is not None:
                raise arguments.ArgumentError(f"{name}= needs max_error=: it feeds the "
                                              "accuracy-budget search")
        return None
    budget = arguments.max_error(max_error)
    emit = arguments.file_path(emit_rules, name="emit_rules")
    data = None if calibration_data is None else arguments.batches(calibration_data)
    examples = None
    kwargs: dict = {}
    if example_inputs is not None and (not isinstance(example_inputs, Sequence)
                                       or len(example_inputs)):
        examples, kwargs = normalize_inputs(example_inputs, example_kwargs)
    search, held, inputs, held_inputs = _split(data, examples)
    return BudgetRequest(budget, max_evaluations, search, held, inputs, held_inputs, kwargs,
                         emit)


def _split(data: list[tuple] | None, examples: tuple | None
           ) -> tuple[list, list, str, str]:
    nothing = "none: pass calibration_data with two batches or more to hold some out"
    if data is None:
        if examples is None:
            raise arguments.ArgumentError("max_error= needs example_inputs or calibration_data "
                                          "to measure the error on")
        return [examples], [], "example_inputs", nothing
    if len(data) == 1:
        if examples is None:
            return data, [], "calibration_data[0]", nothing
        return [examples], data, "example_inputs", "calibration_data[0]"
    half = (len(data) + 1) // 2
    return (data[:half], data[half:], _span(0, half), _span(half, len(data)))


def _span(start: int, stop: int) -> str:
    return (f"calibration_data[{start}]" if stop - start == 1
            else f"calibration_data[{start}:{stop}]")


def check_not_rewritten(gm: torch.fx.GraphModule) -> None:
    """The FP32 reference is the graph as given: one amp_rewrite already made low has none."""
    if any(n.meta.get(CAST_TAG) or n.meta.get(LOWERED_TAG) for n in gm.graph.nodes):
        raise UsageError("max_error= needs the FP32 model: this GraphModule was already "
                         "rewritten by amp_rewrite")


# ----------------------------------------------------------------------------- measuring


def float_outputs(out: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a (nested) output, in order, as fp32."""
    return [t.detach().float() for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point()]


def relative_error(reference: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> float:
    """max|got − ref| / max|ref| per output, the largest; a NaN or Inf where the reference
    is finite, or a changed output structure, is infinite (entries where FP32 itself is not
    finite are left out)."""
    if len(reference) != len(got):
        return math.inf
    worst = 0.0
    for ref, out in zip(reference, got):
        if ref.shape != out.shape:
            return math.inf
        finite = torch.isfinite(ref)
        if bool((finite & ~torch.isfinite(out)).any()):
            return math.inf
        if not bool(finite.any()):
            continue
        diff = float((ref[finite] - out[finite]).abs().max())
        scale = float(ref[finite].abs().max())
        worst = max(worst, diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf))
    return worst


def _run(gm: torch.nn.Module, batch: tuple, kwargs: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return float_outputs(gm(*batch, **kwargs))


@dataclass
class References:
    """The FP32 graph's outputs on the search and held-out batches (before any pass)."""

    search: list[list[torch.Tensor]]
    held: list[list[torch.Tensor]]

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, req: BudgetRequest) -> References:
        try:
            return cls([_run(gm, b, req.kwargs) for b in req.search],
                       [_run(gm, b, req.kwargs) for b in req.held])
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - the batches do not fit the captured graph
            raise UsageError(f"max_error=: the FP32 graph cannot run a batch of "
                             f"calibration_data: {str(e).splitlines()[0] if str(e) else e!r}"
                             ) from e

    def error(self, gm: torch.nn.Module, batches: list[tuple], kwargs: dict,
              held: bool = False) -> float:
        """Worst relative error of ``gm`` over ``batches`` (the search or held-out ones)."""
        refs = self.held if held else self.search
        return max((relative_error(r, _run(gm, b, kwargs)) for r, b in zip(refs, batches)),
                   default=0.0)


def shared_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of ``gm`` whose parameters and buffers are the originals' (a plan casts
    them in-graph and never writes them)."""
    memo = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    with warnings.catch_warnings():  # export's pytree specs warn when deep-copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm, memo)


# ----------------------------------------------------------------------------- units


def node_flops(node: Node, op_key: str) -> float:
    """FLOPs of one node from ``meta['val']`` shapes: 2·M·N·K for GEMMs, 2·out·C_in/g·k
    for convolutions, 4·B·H·Sq·Skv·D for attention, else the output's element count."""
    out = _first_tensor(node.meta.get("val"))
    if out is None:
        return 0.0
    out_n = _numel(out)
    args = [tensor_val(a) for a in node.args]
    op = op_key.rsplit(".", 1)[-1].removeprefix("aten::")
    if op in ("linear", "mm", "bmm", "matmul") and args and args[0] is not None:
        return 2.0 * out_n * size_hint(args[0].shape[-1])
    if op in ("addmm", "baddbmm") and len(args) > 1 and args[1] is not None:
        return 2.0 * out_n * size_hint(args[1].shape[-1])
    if op.startswith("conv") and len(args) > 1 and args[1] is not None and args[1].dim() > 2:
        weight = _numel(args[1]) / size_hint(args[1].shape[0])
        transposed = "transpose" in op or (op == "convolution" and len(node.args) > 6
                                           and node.args[6] is True)
        base = _numel(args[0]) if transposed and args[0] is not None else out_n
        return 2.0 * base * weight
    if "attention" in op and len(args) > 1 and args[0] is not None and args[1] is not None:
        return 4.0 * _numel(args[0]) * size_hint(args[1].shape[-2])
    return out_n


def _first_tensor(val: Any) -> torch.Tensor | None:
    return next((t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)),
                None)


def _numel(t: torch.Tensor) -> float:
    return float(math.prod(size_hint(d) for d in t.shape))


def _node_groups(amp) -> list:
    """The groups of ``amp``'s view that are a node's (not a source's or an output's)."""
    return [g for g in amp.view.graph.groups() if isinstance(g.key, tuple) and g.key[0] == "g"]


def node_weights(amp, prepared: torch.fx.GraphModule) -> dict[str, float]:
    """FLOPs of every node the plan has a group for (the share's denominator)."""
    nodes = {n.name: n for n in prepared.graph.nodes}
    return {g.name: node_flops(nodes[g.name], g.op_key) for g in _node_groups(amp)
            if g.name in nodes}


def low_flop_share(amp, weights: Mapping[str, float]) -> float:
    """FLOPs of the nodes ``amp``'s plan runs low (any group low) over ``weights``' total."""
    low = {g.name for g in _node_groups(amp)
           if g.name in weights and amp.plan.precision(g.key) is Precision.LOW}
    total = sum(weights.values())
    return sum(weights[n] for n in low) / total if total else 1.0


def _units(amp, prepared: torch.fx.GraphModule) -> dict[str, core_budget.Unit]:
    """Node name -> Unit for the nodes ``amp``'s plan runs low by the rules' choice."""
    low: dict[str, str] = {}
    for g in _node_groups(amp):
        if g.fixed is None and amp.plan.precision(g.key) is Precision.LOW:
            low.setdefault(g.name, g.op_key)
    nodes = {n.name: n for n in prepared.graph.nodes}
    return {name: core_budget.Unit(name, node_flops(nodes[name], op))
            for name, op in sorted(low.items()) if name in nodes}


class _Recorder(torch.fx.Interpreter):
    """Runs a graph and keeps the values of the named nodes (an emulated kernel's value is
    its rounded result, what its readers see)."""

    def __init__(self, gm: torch.fx.GraphModule, names: set[str]) -> None:
        super().__init__(gm)
        self.names, self.seen = names, {}

    def run_node(self, n: Node) -> Any:
        out = super().run_node(n)
        name = n.args[0].name if n.meta.get(LOWERED_TAG) == "result" else n.name
        if name in self.names:
            self.seen[name] = float_outputs(out)
        return out


def _scores(units: dict[str, core_budget.Unit], prepared: torch.fx.GraphModule,
            default: torch.fx.GraphModule, low: torch.dtype, lower: Lower, req: BudgetRequest
            ) -> dict[str, float]:
    """Each unit's injected error on the first search batch: the relative error of the
    output less the largest of its inputs', both against FP32. A unit whose FP32 output or
    input exceeds the low dtype's range overflows when run low: infinite. What follows an
    overflow reads Inf and shows nothing, so the rest are scored in the plan with those
    pinned (one FP32 recording and one plan run: ``core.budget`` counts it as one plan)."""
    nodes = {n.name: n for n in prepared.graph.nodes}
    inputs = {u: [a.name for a in nodes[u].all_input_nodes] for u in units}
    names = set(units) | {a for names in inputs.values() for a in names}
    fp32 = _values(prepared, names, req)
    overflowing = {u for u in units if any(_beyond(t, low) for name in (u, *inputs[u])
                                           for t in fp32.get(name, ()))}
    plan = default
    if overflowing:
        plan = shared_copy(prepared)
        lower(plan, _reasons(frozenset(overflowing), req.max_error))
    scores = _injected(units, inputs, fp32, _values(plan, names, req))
    scores.update(dict.fromkeys(overflowing, math.inf))
    return scores


def _beyond(t: torch.Tensor, low: torch.dtype) -> bool:
    """Whether ``t`` holds values the low dtype cannot (the fp32 mask sentinel aside: a low
    op gets the low dtype's own, ``fx/view.py``)."""
    magnitude = t.abs()
    sentinel = torch.finfo(torch.float32).max
    return bool(((magnitude > torch.finfo(low).max) & (magnitude < sentinel)).any())


def _values(gm: torch.fx.GraphModule, names: set[str], req: BudgetRequest) -> dict:
    recorder = _Recorder(gm, names)
    with torch.no_grad():
        recorder.run(*flat_inputs(gm, req.search[0], req.kwargs))
    return recorder.seen


def _injected(units: Mapping[str, core_budget.Unit], inputs: Mapping[str, list[str]],
              fp32: Mapping[str, list], low: Mapping[str, list]) -> dict[str, float]:
    """Each unit's output error less its inputs' (Inf where it turns finite inputs into
    Inf or NaN, 0 where its inputs are already not finite: nothing is known there)."""
    def rel(name: str) -> float:
        if name not in fp32 or name not in low:
            return 0.0
        return relative_error(fp32[name], low[name])

    scores = {}
    for name in units:
        out = rel(name)
        before = max((rel(a) for a in inputs[name]), default=0.0)
        if math.isinf(before):
            scores[name] = 0.0
        elif math.isinf(out):
            scores[name] = math.inf
        else:
            scores[name] = max(out - before, 0.0)
    return scores


# ----------------------------------------------------------------------------- the search


Lower = Callable[[torch.fx.GraphModule, Mapping[str, str]], Any]


@dataclass
class BudgetOutcome:
    """What the search chose and measured, for the final rewrite and its report."""

    request: BudgetRequest
    result: core_budget.BudgetResult
    units: list[core_budget.Unit]
    seconds: float
    default_held_out: float | None
    held_out_error: float | None = None
    pins: dict[str, str] = field(default_factory=dict)  # node name -> reason (FxOptions)
    weights: dict[str, float] = field(default_factory=dict)  # node name -> FLOPs
    shares: tuple[float, float] = (1.0, 1.0)  # FLOP-weighted low share: (final, default)

    def finish(self, amp) -> None:
        """Record the final plan's share (``amp``: its MixedPrecisionPass)."""
        self.shares = (low_flop_share(amp, self.weights), self.shares[1])

    def held_out(self, gm: torch.nn.Module, reference: References) -> None:
        """The final rewritten module's error on the held-out batches; a warning above E."""
        if not self.request.held:
            return
        start = time.perf_counter()
        self.held_out_error = reference.error(gm, self.request.held, self.request.kwargs,
                                              held=True)
        self.seconds += time.perf_counter() - start
        if self.held_out_error > self.request.max_error:
            log.warning("accuracy budget: the rewritten module's error on the held-out batches "
                        "(%s) is %.3g, above max_error %g (%.3g on the batches searched); pass "
                        "more varied calibration_data", self.request.held_out_inputs,
                        self.held_out_error, self.request.max_error, self.result.error)

    def report(self) -> dict:
        r = self.result
        return {"max_error": r.budget, "reachable": r.reachable, "achieved": rounded(r.error),
                "held_out": rounded(self.held_out_error),
                "default_plan_error": rounded(r.start_error),
                "default_plan_held_out": rounded(self.default_held_out),
                "all_pinned_error": rounded(r.floor_error),
                "evaluations": r.evaluations, "seconds": round(self.seconds, 3),
                "contributions": "measured" if r.measured else "estimated",
                "low_flop_share": round(self.shares[0], 4),
                "default_low_flop_share": round(self.shares[1], 4),
                "inputs": self.request.inputs, "held_out_inputs": self.request.held_out_inputs,
                "measured_on": "the rewritten graph's own kernels on this device, pointwise "
                               "fusion left out"}

    def pinned(self) -> list[dict]:
        return core_budget.pinned_records(self.result, self.units)

    def write_rules(self, path: str | os.PathLike) -> Path:
        """A rule overlay whose ``[keep_fp32]`` table holds the pins: ``rules=[path]`` with
        the same other options and no max_error reproduces the plan (written atomically)."""
        r = self.result
        entries = core_budget.pin_entries(r, self.units, self.pins)
        header = [f"amp_rewrite.rewrite(max_error={r.budget:g}): rewriting with this overlay "
                  "(rules=[...]), the same other options and no max_error reproduces the plan",
                  f"error {rounded(r.error)} on {self.request.inputs}; "
                  f"{rounded(self.held_out_error)} on {self.request.held_out_inputs}; "
                  f"{r.evaluations} evaluations"]
        from amp_rewrite.onnx.save import write_bytes_atomically

        return write_bytes_atomically(path, core_budget.rule_overlay(entries, header).encode())


def search_budget(prepared: torch.fx.GraphModule, lower: Lower, req: BudgetRequest,
                  reference: References) -> BudgetOutcome:
    """Search the pins for ``req`` on copies of ``prepared`` (the graph the plan will run
    on); ``lower(copy, pins)`` plans and lowers a copy in place and returns its
    ``MixedPrecisionPass``."""
    start = time.perf_counter()
    default = shared_copy(prepared)
    amp = lower(default, {})
    units = _units(amp, prepared)

    def estimate() -> dict[str, float]:
        return _scores(units, prepared, default, amp.view.low, lower, req)

    def evaluate(pins: frozenset) -> float:
        if not pins:
            gm = default
        else:
            gm = shared_copy(prepared)
            lower(gm, _reasons(pins, req.max_error))
        return reference.error(gm, req.search, req.kwargs)

    from tqdm import tqdm

    # a bar on a terminal (cleared when done), the plans in the log either way
    with tqdm(total=req.max_evaluations, desc="amp_rewrite accuracy budget", unit="plan",
              leave=False, disable=not sys.stderr.isatty()) as bar:
        def progress(done: int, error: float) -> None:
            log.info("accuracy budget: plan %d measured, error %.3g", done, error)
            bar.update(done - bar.n)
            bar.set_postfix_str(f"error {error:.3g}")

        result = core_budget.search(units.values(), evaluate, req.max_error,
                                    estimate=estimate, max_evaluations=req.max_evaluations,
                                    progress=progress)
    default_held = (reference.error(default, req.held, req.kwargs, held=True)
                    if req.held else None)
    outcome = BudgetOutcome(req, result, list(units.values()), time.perf_counter() - start,
                            default_held)
    option = f"max_error={req.max_error:g}"
    outcome.pins = {k: core_budget.pin_reason(result, k, option) for k in result.pins}
    outcome.weights = node_weights(amp, prepared)
    default_share = low_flop_share(amp, outcome.weights)
    outcome.shares = (default_share, default_share)  # the final plan's: ``finish``
    return outcome


def _reasons(pins: frozenset, budget: float) -> dict[str, str]:
    return {k: f"{BUDGET_REASON} max_error={budget:g}" for k in pins}


