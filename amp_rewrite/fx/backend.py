"""amp_rewrite as a ``torch.compile`` backend (docs/design.md §1: dynamo is the capture).

``torch.compile(model, backend="amp_rewrite", options={"dtype": "bf16"})`` (the name is
registered by the ``torch_dynamo_backends`` entry point) or ``amp_rewrite.compile(model, ...)``.
On each graph dynamo hands over, graph breaks included:

1. ``to_aten``: re-trace the dynamo graph (torch-level ops, parameters as inputs) to a
   pre-dispatch ATen graph with ``make_fx`` on dynamo's own fake inputs, so symbolic sizes stay
   symbolic and every node carries ``meta['val']``;
2. ``rewrite_graph``: the one pipeline of ``amp_rewrite.rewrite`` (rules, autocast floor,
   min-cut casts, padding, fusion); the casts are graph ops, so autograd differentiates through
   them and the user's FP32 parameters get FP32 gradients;
3. ``inner``: 'inductor' (default) compiles the rewritten graph with Inductor, which does its
   own pointwise fusion (amp_rewrite's pointwise regions are inlined back first); 'eager' runs it
   as it is, as ``rewrite`` returns it.

Activation checkpointing (``torch.utils.checkpoint``, ``gradient_checkpointing_enable()``):
dynamo hands over each checkpointed region as a ``tag_activation_checkpoint`` higher-order op.
``to_aten`` inlines its body, so the region is planned like the rest of the graph, and tags the
body's ATen nodes ``recompute=PREFER_RECOMPUTE`` (one ``ac_graph_id`` per region), which is
what the op itself does for AOTAutograd: Inductor's partitioner recomputes them in the backward
instead of saving them. ``inner='eager'`` runs the graph as it is and saves them (one warning).

Every graph's report is kept, keyed weakly by the parameters it reads:
``amp_rewrite.report(compiled)`` lists them, ``amp_rewrite.explain(compiled, name)`` searches them.
"""
from __future__ import annotations

import itertools
import logging
import operator
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.weak import WeakIdKeyDictionary

from amp_rewrite import arguments
from amp_rewrite.core import report as core_report
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import REPORT_KEY, run_pipeline
from amp_rewrite.fx import explain as explain_graph
from amp_rewrite.fx.options import GRAPH, TorchOptions
from amp_rewrite.fx.passes import FxOptions
from amp_rewrite.fx.pointwise import UnfuseRegions

__all__ = ["backend", "compile", "explain", "report"]

log = logging.getLogger(__name__)

INNER = ("inductor", "eager")
_GRAPH_NUMBER = itertools.count()
_CHECKPOINT_REGIONS = itertools.count()  # ac_graph_id of each inlined checkpointed region
_RECOMPUTE, _AC_GRAPH_ID = "recompute", "ac_graph_id"  # node.meta keys AOTAutograd reads
_TRACED_META = frozenset({"val", "tensor_meta", _RECOMPUTE, _AC_GRAPH_ID})
# parameter -> reports of the graphs that read it (a model's graphs, via its parameters)
_REPORTS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors compare elementwise
# compiled callable -> reports of graphs without parameters, for amp_rewrite.compile
_OWN_REPORTS: weakref.WeakKeyDictionary[Any, list[_GraphReport]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _GraphReport:
    number: int  # global compile order: sorts one model's graphs
    report: core_report.Report
    json: dict


@dataclass(frozen=True)
class BackendOptions:
    """``options=`` of the backend, checked once: a wrong one is a one-line ``UsageError``."""

    fx: FxOptions
    inner: str = "inductor"

    @classmethod
    def checked(cls, options: Mapping[str, Any] | None) -> BackendOptions:
        options = {} if options is None else options
        if not isinstance(options, Mapping):
            raise UsageError(f"options must be a dict, got {type(options).__name__}")
        inner = arguments.choice(options.get("inner", "inductor"), INNER, name="inner")
        # the per-graph options: capture, mode and dynamic shapes belong to dynamo
        graph = TorchOptions.of({k: v for k, v in options.items() if k != "inner"},
                                "the amp_rewrite backend", scopes=(GRAPH,))
        return cls(FxOptions.of(graph), inner)


def backend(gm: torch.fx.GraphModule, example_inputs: list[Any], *,
            options: Mapping[str, Any] | None = None) -> Callable:
    """The dynamo backend: the module docstring's three steps on one captured graph."""
    return _Backend(BackendOptions.checked(options))(gm, example_inputs)


class _Backend:
    """A backend with checked options; ``owner`` (if any) also gets parameterless graphs."""

    def __init__(self, options: BackendOptions) -> None:
        self.options = options
        self.own: list[_GraphReport] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        aten = to_aten(gm, example_inputs)
        checkpointed = any(_RECOMPUTE in n.meta for n in aten.graph.nodes)
        rewritten = run_pipeline(aten, self.options.fx)
        _remember(rewritten, example_inputs, self.own)
        if self.options.inner == "eager":
            if checkpointed:
                log.warning("activation checkpointing: inner='eager' runs the rewritten graph "
                            "as it is, so its backward keeps the checkpointed activations; "
                            "inner='inductor' recomputes them")
            return rewritten
        UnfuseRegions()(rewritten)  # Inductor fuses pointwise ops itself, casts included
        if checkpointed:
            _tag_inserted_nodes(rewritten)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(rewritten, example_inputs)


def to_aten(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> torch.fx.GraphModule:
    """The dynamo graph as a pre-dispatch ATen graph traced on dynamo's fake inputs (their
    symbolic sizes kept); placeholders in the same order, so it takes the same inputs."""
    fakes = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    # dynamo's own fake mode (its shape env holds the symbolic sizes), not the backend's copy
    # (detect_fake_mode would prefer the tracing context's, the backend's copy)
    mode = next((v.fake_mode for v in fakes if isinstance(v, FakeTensor)), None)
    if mode is None or len(fakes) != len(example_inputs) or any(v is None for v in fakes):
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        fakes = [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x
                 for x in example_inputs]
    if not inline_activation_checkpoints(gm):
        with mode:
            return make_fx(gm, pre_dispatch=True)(*fakes)

    def run(*args: Any) -> Any:  # node by node, so each ATen node gets its node's tags
        return torch.fx.Interpreter(gm).run(*args)

    with mode, fx_traceback.preserve_node_meta():
        aten = make_fx(run, pre_dispatch=True)(*fakes)
    for node in aten.graph.nodes:  # only the tags: the rest (module paths, ...) as without
        for key in set(node.meta) - _TRACED_META:
            del node.meta[key]
    return aten


def inline_activation_checkpoints(gm: torch.fx.GraphModule) -> int:
    """Replace each ``tag_activation_checkpoint(body, *args)`` of a dynamo graph by the body's
    nodes, tagged for recomputation as the op tags them (module docstring); the number
    inlined. The pre-dispatch re-trace cannot keep the op (torch reads a context function
    dynamo sets only for selective checkpointing), and its body would be opaque to the plan."""
    from torch.utils.checkpoint import CheckpointPolicy

    hop = torch.ops.higher_order.tag_activation_checkpoint
    calls = list(gm.graph.find_nodes(op="call_function", target=hop))
    for call in calls:
        body_node, *inputs = call.args
        body = getattr(gm, body_node.target)
        if "_checkpoint_context_fn" in body.meta:  # selective: its policy runs per op
            log.warning("activation checkpointing with a context_fn (selective policy): "
                        "amp_rewrite recomputes the whole region instead")
        region = next(_CHECKPOINT_REGIONS)
        env: dict[torch.fx.Node, Any] = {}
        result: Any = None
        with gm.graph.inserting_before(call):
            for node in body.graph.nodes:
                if node.op == "placeholder":
                    env[node] = inputs[len(env)]
                    continue
                if node.op == "output":
                    result = torch.fx.map_arg(node.args[0], env.__getitem__)
                    continue
                if node.op == "get_attr":
                    name = _fresh_attribute(gm, f"{body_node.target}_{node.target}")
                    setattr(gm, name, _attribute(body, node.target))
                    new = gm.graph.get_attr(name)
                    new.meta = dict(node.meta)
                else:
                    new = gm.graph.node_copy(node, env.__getitem__)
                new.meta[_RECOMPUTE] = CheckpointPolicy.PREFER_RECOMPUTE
                new.meta[_AC_GRAPH_ID] = region
                env[node] = new
        for user in list(call.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                gm.graph.erase_node(user)
            else:
                user.replace_input_with(call, result)  # the body's output tuple as it is
        gm.graph.erase_node(call)
        if not body_node.users:
            gm.graph.erase_node(body_node)
            delattr(gm, body_node.target)
    if calls:
        gm.graph.lint()
        gm.recompile()
    return len(calls)


def _attribute(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _fresh_attribute(gm: torch.fx.GraphModule, base: str) -> str:
    base = base.replace(".", "_")
    name, i = base, 0
    while hasattr(gm, name):
        i += 1
        name = f"{base}_{i}"
    return name


def _tag_inserted_nodes(gm: torch.fx.GraphModule) -> None:
    """Casts (and other nodes) the rewrite put inside a checkpointed region join it: a node
    every reader of which is in region r, and that reads only region r or graph inputs, is
    recomputed with r rather than saved for the backward."""
    from torch.utils.checkpoint import CheckpointPolicy

    def region(node: object) -> object:
        return node.meta.get(_AC_GRAPH_ID) if isinstance(node, torch.fx.Node) else None

    changed = True
    while changed:
        changed = False
        for node in gm.graph.nodes:
            if node.op != "call_function" or _RECOMPUTE in node.meta or not node.users:
                continue
            regions = {region(u) for u in node.users}
            if len(regions) != 1 or None in regions:
                continue
            (r,) = regions
            if all(region(a) == r or a.op in ("placeholder", "get_attr")
                   for a in node.all_input_nodes):
                node.meta[_RECOMPUTE] = CheckpointPolicy.PREFER_RECOMPUTE
                node.meta[_AC_GRAPH_ID] = r
                changed = True


def _remember(gm: torch.fx.GraphModule, example_inputs: list[Any],
              own: list[_GraphReport]) -> None:
    entry = _GraphReport(next(_GRAPH_NUMBER), gm.meta[REPORT_KEY], gm.amp_report)
    parameters = [x for x in example_inputs if isinstance(x, torch.nn.Parameter)]
    for parameter in parameters:
        _REPORTS.setdefault(parameter, []).append(entry)
    if not parameters:
        own.append(entry)


def compile(model: torch.nn.Module, *, dtype: torch.dtype | str = torch.float16,  # noqa: A001
            dynamic: bool | None = None, fullgraph: bool = False,
            **options: Any) -> torch.nn.Module:
    """``torch.compile(model, backend=amp_rewrite)`` with ``options`` checked now: ``inner``
    ('inductor' | 'eager') and the ``rewrite`` options ``rules``, ``keep_fp32``,
    ``keep_io_types``, ``device``, ``autocast_floor``, ``pad``, ``fuse``, ``emulate_gemms``,
    ``fp8``, ``fp8_grad_dtype``, ``fp8_min_size``, ``keep_bf16``.
    The model, its ``state_dict``, hooks and optimizer stay the user's."""
    checked = _Backend(BackendOptions.checked({**options, "dtype": dtype}))
    compiled = torch.compile(model, backend=checked, dynamic=dynamic, fullgraph=fullgraph)
    _OWN_REPORTS[compiled] = checked.own
    return compiled


def _entries(model: Any) -> list[_GraphReport]:
    own = _OWN_REPORTS.get(model, []) if _weakrefable(model) else []
    found = {id(e): e for e in own}
    module = getattr(model, "_orig_mod", model)
    if isinstance(module, torch.nn.Module):
        for parameter in module.parameters():
            found.update((id(e), e) for e in _REPORTS.get(parameter, []))
    return sorted(found.values(), key=lambda e: e.number)


def _weakrefable(model: Any) -> bool:
    try:
        weakref.ref(model)
    except TypeError:
        return False
    return True


def report(model: Any) -> list[dict]:
    """The reports of every graph compiled for ``model`` (the compiled or the original
    module), in compile order: ``[{"graph": i, "report": amp_report}]``; a GraphModule from
    ``rewrite`` gives its one report."""
    if isinstance(getattr(model, "amp_report", None), dict):
        return [{"graph": 0, "report": model.amp_report}]
    entries = _entries(model)
    if not entries:
        raise UsageError(f"no amp_rewrite report for this {type(model).__name__}: compile it "
                         "with backend='amp_rewrite' and run it once (dynamo compiles on the "
                         "first call)")
    return [{"graph": i, "report": e.json} for i, e in enumerate(entries)]


def explain(model: Any, node_name: str) -> list[str]:
    """Why ``node_name`` runs low or high: for a GraphModule from ``rewrite`` as
    ``amp_rewrite.fx.explain``; for a compiled model, the lines of every graph that has a
    node of that name, each headed ``graph i:``."""
    entries = [] if REPORT_KEY in getattr(model, "meta", {}) else _entries(model)
    if not entries:
        return explain_graph(model, node_name)
    lines: list[str] = []
    for i, entry in enumerate(entries):
        if entry.report.why.get(node_name):
            lines += [f"graph {i}:", *core_report.explain(entry.report, node_name)]
    if not lines:  # the nearest names, from the first graph's error
        core_report.explain(entries[0].report, node_name)
    return lines
