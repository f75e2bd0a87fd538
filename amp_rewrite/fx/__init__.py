"""The torch adapter: ``rewrite(module, example_inputs)`` → a mixed-precision GraphModule.

Capture (``torch.export`` by default, ``symbolic_trace`` on request, or a GraphModule as is),
then the pipeline of :mod:`amp_rewrite.fx.pipeline` on the shared core (docs/design.md §1-2). The result
keeps FP32 parameters (cast in-graph once per forward), the original ``state_dict`` keys, shapes
and dtypes, and carries ``gm.amp_report`` (the ONNX ``--report`` schema).
"""
from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping
from typing import Any

import torch

from amp_rewrite.core import options as core_options
from amp_rewrite.core import report as core_report
from amp_rewrite.errors import UsageError
from amp_rewrite.fx.capture import capture as capture_module
from amp_rewrite.fx.capture import normalize_inputs
from amp_rewrite.fx.fusion import FUSED_TAG
from amp_rewrite.fx.modes import TrainEvalModule, in_mode
from amp_rewrite.fx.options import (BUDGET, GRAPH, BudgetRequest, TorchOptions,
                                    budget_request)
from amp_rewrite.fx.passes import FxOptions
from amp_rewrite.fx.pipeline import REPORT_KEY, run_pipeline

__all__ = ["TrainEvalModule", "TorchOptions", "explain", "rewrite", "rewrite_graph",
           "run_pipeline"]



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
    budget = budget_request(opts.max_error, calibration_data=opts.calibration_data,
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
                         budget: BudgetRequest | None = None
                         ) -> torch.fx.GraphModule:
    start = time.perf_counter()
    with in_mode(model, mode) if mode else contextlib.nullcontext():
        gm = capture_module(model, example_inputs, example_kwargs, mode=capture,
                            dynamic_shapes=dynamic_shapes)
    captured = time.perf_counter()
    examples = normalize_inputs(example_inputs, example_kwargs) if options.mixed \
        and not isinstance(model, torch.fx.GraphModule) else None
    gm = run_pipeline(gm, options, budget, examples)
    gm.amp_report["capture_seconds"] = round(captured - start, 4)
    return gm


def rewrite_graph(gm: torch.fx.GraphModule, **options: Any) -> torch.fx.GraphModule:
    """Run the passes on a captured GraphModule (``meta['val']`` on its nodes), in place.

    ``options``: the graph's and the budget's fields of ``TorchOptions`` (listed below); with
    ``max_error``, ``calibration_data`` is required (one batch: searched, nothing held out).
    """
    opts = TorchOptions.of(options, "rewrite_graph", scopes=(GRAPH, BUDGET))
    budget = budget_request(opts.max_error, calibration_data=opts.calibration_data,
                               max_evaluations=opts.max_evaluations,
                               emit_rules=opts.emit_rules)
    return run_pipeline(gm, FxOptions.of(opts), budget)


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
