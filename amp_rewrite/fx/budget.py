"""The accuracy budget on the torch path: plans measured with the rewrite's own kernels.

``rewrite(..., max_error=E)`` keeps low the most FLOPs whose relative output error (the
metric of ``core.metric``, over outputs and batches) stays within E on the search batches.
The search, its estimate, the outcome and the rule overlay are ``core.budget``'s (decision
0035); this module is its ``BudgetAdapter``. The graph is captured and prepared (inlining,
fusion, masks) once; each measured plan is a copy of the prepared graph, sharing its
parameters, planned with the candidate pins, lowered as the final rewrite is (FP8,
padding, emulated GEMMs) and run on this device: its error is what the rewritten module
computes here, not a model of it. Pointwise fusion is left out of the copies: its Inductor
regions compute in fp32 inside and would cost a compilation per plan, so a measured error
is, if anything, pessimistic.

Units are the nodes the default plan runs low whose precision the rules decided (a group
the view fixed is not the budget's to move), weighted by FLOPs from ``meta['val']``. The
torch path has no calibration threshold, so ``core.budget.relax`` has nothing to lower
here. The final rewritten module is measured on the held-out batches, which the search
never saw.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.fx import Node

from amp_rewrite.core import Precision
from amp_rewrite.core import budget as core_budget
from amp_rewrite.core.metric import worst_relative_error
from amp_rewrite.errors import UsageError, first_line
from amp_rewrite.fx.capture import flat_inputs
from amp_rewrite.fx.flops import node_flops
from amp_rewrite.fx.lowering import LOWERED_TAG
from amp_rewrite.fx.options import BudgetRequest
from amp_rewrite.fx.view import CAST_TAG

log = logging.getLogger(__name__)

BUDGET_REASON = "pinned fp32 by the accuracy budget"


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


def _arrays(tensors: Sequence) -> list[np.ndarray]:
    return [t.detach().float().cpu().numpy() if isinstance(t, torch.Tensor) else t
            for t in tensors]


def relative_error(reference: Sequence, got: Sequence) -> float:
    """The metric (``core.metric.worst_relative_error``) of tensors or arrays, in order."""
    return worst_relative_error(_arrays(reference), _arrays(got))


def _run(gm: torch.nn.Module, batch: tuple, kwargs: dict) -> list[np.ndarray]:
    with torch.no_grad():
        return _arrays(float_outputs(gm(*batch, **kwargs)))


@dataclass
class References:
    """The FP32 graph's outputs on the search and held-out batches (before any pass)."""

    search: list[list[np.ndarray]]
    held: list[list[np.ndarray]]

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, req: BudgetRequest) -> References:
        try:
            return cls([_run(gm, b, req.kwargs) for b in req.search],
                       [_run(gm, b, req.kwargs) for b in req.held])
        except UsageError:
            raise
        except Exception as e:  # noqa: BLE001 - the batches do not fit the captured graph
            raise UsageError("max_error=: the FP32 graph cannot run a batch of "
                             f"calibration_data: {first_line(e)}") from e

    def error(self, gm: torch.nn.Module, batches: list[tuple], kwargs: dict,
              held: bool = False) -> float:
        """Worst relative error of ``gm`` over ``batches`` (the search or held-out ones)."""
        refs = self.held if held else self.search
        return max((worst_relative_error(r, _run(gm, b, kwargs))
                    for r, b in zip(refs, batches)), default=0.0)


def shared_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A deep copy of ``gm`` whose parameters and buffers are the originals' (a plan casts
    them in-graph and never writes them)."""
    memo = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    with warnings.catch_warnings():  # export's pytree specs warn when deep-copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(gm, memo)


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
            self.seen[name] = _arrays(float_outputs(out))
        return out


# ----------------------------------------------------------------------------- units


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
    return core_budget.low_flop_share(weights, [
        g.name for g in _node_groups(amp) if amp.plan.precision(g.key) is Precision.LOW])


# ----------------------------------------------------------------------------- the search


Lower = Callable[[torch.fx.GraphModule, Mapping[str, str]], Any]
MEASURED_BY = "the rewritten graph's own kernels on this device, pointwise fusion left out"


class FxBudget:
    """The ``core.budget.BudgetAdapter`` of a prepared graph: plans are lowered copies of
    it (``lower(copy, pins)`` plans and lowers one in place and returns its
    ``MixedPrecisionPass``); units and values are named by node."""

    mask_sentinel = torch.finfo(torch.float32).max  # a low op gets the low dtype's own

    def __init__(self, prepared: torch.fx.GraphModule, lower: Lower, req: BudgetRequest,
                 reference: References) -> None:
        self.prepared, self.lower, self.req, self.reference = prepared, lower, req, reference
        self.default = shared_copy(prepared)
        self.amp = lower(self.default, {})
        self.low_max = float(torch.finfo(self.amp.view.low).max)
        self.nodes = {n.name: n for n in prepared.graph.nodes}
        self.weights = node_weights(self.amp, prepared)
        self.unit_names: list[str] = []
        self.graph_outputs = frozenset(a.name for n in prepared.graph.nodes if n.op == "output"
                                       for a in n.all_input_nodes)

    def units(self) -> list[core_budget.Unit]:
        """The nodes the default plan runs low by the rules' choice, FLOPs as weight; no
        peaks: the magnitude candidate moved torch's plans both ways (decision 0028)."""
        low = {g.name for g in _node_groups(self.amp)
               if g.fixed is None and self.amp.plan.precision(g.key) is Precision.LOW}
        self.unit_names = sorted(low & self.weights.keys())
        return [core_budget.Unit(name, self.weights[name]) for name in self.unit_names]

    def relax_units(self) -> list[core_budget.Unit]:
        return []  # no calibration threshold pins on this path

    def fp32_reason(self, key: str) -> str:
        raise KeyError(key)

    def plan(self, pins: frozenset = frozenset(), low_pins: frozenset = frozenset()
             ) -> torch.fx.GraphModule:
        if not pins:
            return self.default
        gm = shared_copy(self.prepared)
        self.lower(gm, dict.fromkeys(pins, f"{BUDGET_REASON} max_error={self.req.max_error:g}"))
        return gm

    def measure(self, gm: torch.fx.GraphModule, held_out: bool = False) -> float | None:
        if held_out and not self.req.held:
            return None
        batches = self.req.held if held_out else self.req.search
        return self.reference.error(gm, batches, self.req.kwargs, held=held_out)

    def values(self, gm: torch.fx.GraphModule | None) -> dict[str, list[np.ndarray]]:
        """The units' and their inputs' values on the first search batch."""
        gm = self.prepared if gm is None else gm
        names = {name for unit in self.unit_names for name in (unit, *self.unit_io(unit)[0])}
        recorder = _Recorder(gm, names)
        with torch.no_grad():
            recorder.run(*flat_inputs(gm, self.req.search[0], self.req.kwargs))
        return recorder.seen

    def unit_io(self, name: str) -> tuple[list[str], list[str]]:
        return [a.name for a in self.nodes[name].all_input_nodes], [name]


@dataclass
class BudgetOutcome(core_budget.BudgetOutcome):
    """``core.budget.BudgetOutcome`` finished after the final rewrite: its share, its
    error on the held-out batches, the rule overlay."""

    request: BudgetRequest | None = None
    weights: dict[str, float] = field(default_factory=dict)  # node name -> FLOPs

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
        self.warn_if_held_out_above(log, "calibration_data")

    def write_rules(self, path: str | os.PathLike) -> Path:
        """A rule overlay whose ``[keep_fp32]`` table holds the pins: ``rules=[path]`` with
        the same other options and no max_error reproduces the plan (written atomically)."""
        from amp_rewrite.onnx.save import write_bytes_atomically

        text = self.overlay(f"amp_rewrite.rewrite({self.option}): rewriting with this overlay "
                            "(rules=[...]), the same other options and no max_error "
                            "reproduces the plan")
        return write_bytes_atomically(path, text.encode())


def search_budget(prepared: torch.fx.GraphModule, lower: Lower, req: BudgetRequest,
                  reference: References) -> BudgetOutcome:
    """Search the pins for ``req`` on copies of ``prepared`` (the graph the plan will run
    on; ``FxBudget``)."""
    start = time.perf_counter()
    adapter = FxBudget(prepared, lower, req, reference)
    option = f"max_error={req.max_error:g}"
    with _progress_bar(req.max_evaluations) as progress:
        result, units, relaxed = core_budget.plan_within_budget(
            adapter, req.max_error, option, max_evaluations=req.max_evaluations,
            progress=progress)
    default_held = adapter.measure(adapter.default, held_out=True)
    default_share = low_flop_share(adapter.amp, adapter.weights)
    # the final plan's share and held-out error come with the final rewrite (``finish``)
    return BudgetOutcome(result, units, option, req.inputs, req.held_out_inputs, MEASURED_BY,
                         relaxed, None, default_held, (default_share, default_share),
                         time.perf_counter() - start, request=req, weights=adapter.weights)


@contextlib.contextmanager
def _progress_bar(total: int) -> Iterator[Callable[[int, float], None]]:
    """A bar on a terminal (cleared when done), the plans in the log either way."""
    from tqdm import tqdm

    with tqdm(total=total, desc="amp_rewrite accuracy budget", unit="plan", leave=False,
              disable=not sys.stderr.isatty()) as bar:
        def progress(done: int, error: float) -> None:
            log.info("accuracy budget: plan %d measured, error %.3g", done, error)
            bar.update(done - bar.n)
            bar.set_postfix_str(f"error {error:.3g}")

        yield progress

