"""Pointwise fusion after the plan and its casts (docs/design.md §7, last step).

``FusePointwise`` partitions pointwise ATen ops, casts and norms into maximal acyclic regions
(``CapabilityBasedPartitioner``), each a ``FusedRegion`` submodule (``fused_0``, ...). At call
time, outside any tracing, a region runs compiled by Inductor through ``aot_autograd``, cached
process-wide by structure and input metadata (identical layers compile once), unless on a CPU
its eager ops measure faster (``_compiled_or_eager``); when traced it
is plain fx code, so the result still compiles and exports. If Inductor fails the regions run
eager with one log line; ``AMP_REWRITE_FUSED_BACKEND=eager`` skips compiling. Parameters stay
on the top module; ``UnfuseRegions`` inlines regions back for a second rewrite.
"""
from __future__ import annotations

import copy
import hashlib
import logging
import operator
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.fx import Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from amp_rewrite.errors import described
from amp_rewrite.fx import kernel_timing
from amp_rewrite.fx.view import finished, static_numel

log = logging.getLogger(__name__)

aten = torch.ops.aten
PREFIX = "fused_"
_TEMP_PREFIX = "_amp_region_"
BACKEND_ENV = "AMP_REWRITE_FUSED_BACKEND"
_CASTS = (aten._to_copy.default, aten.to.dtype)
# Norms: row reductions Inductor fuses with the pointwise ops and casts around them.
_COMPOSITES = (aten.rms_norm.default, aten.layer_norm.default)

# On CUDA a region call costs host time: it pays only where the traffic it saves takes
# longer than that (decision 0023).
CUDA_REGION_HOST_SECONDS = 70e-6
CUDA_MEMORY_BYTES_PER_SECOND = 3.0e12  # copy rate measured on an H100 here (H200: 4.3e12)
CUDA_MIN_SAVED_BYTES = int(CUDA_REGION_HOST_SECONDS * CUDA_MEMORY_BYTES_PER_SECOND)

# (region structure, input metas, grad mode) -> compiled callable, or None where the eager ops
# measured faster on this CPU; shared by identical regions
_COMPILED: dict[tuple, Callable | None] = {}
_STATE: dict[str, Any] = {"broken": None, "compile_seconds": 0.0, "compiles": 0}


def is_fusible(node: Node) -> bool:
    """Legality: a pointwise ATen op, a dtype conversion or a composite norm (``_COMPOSITES``)
    on tensors, nothing in place."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    target = node.target
    if target in _CASTS:
        if set(node.kwargs) - {"dtype"}:
            return False
    elif target not in _COMPOSITES and (torch.Tag.pointwise not in target.tags
                                        or torch.Tag.nondeterministic_seeded in target.tags
                                        or target._schema.is_mutable):
        return False
    return all(isinstance(n.meta.get("val"), torch.Tensor) for n in (node, *node.all_input_nodes))


class _Pointwise(OperatorSupportBase):
    def is_node_supported(self, submodules: dict, node: Node) -> bool:
        return is_fusible(node)


WINDOW = 256  # graph nodes per partitioner run


def propose_regions(gm: torch.fx.GraphModule) -> list[list[Node]]:
    """The partitioner's regions (horizontal merging on), proposed window by window of
    ``WINDOW`` consecutive nodes, as its cost grows with the cube of the graph (decision
    0022). Windows are contiguous in topological order, so a merge acyclic inside a window is
    acyclic in the graph; a window ends before a node that cannot fuse."""
    nodes = list(gm.graph.nodes)
    if len(nodes) <= WINDOW:
        return _partitions(gm, dict(zip(nodes, nodes)))
    regions = []
    start = 0
    while start < len(nodes):
        end = min(start + WINDOW, len(nodes))
        while end < len(nodes) and is_fusible(nodes[end]):  # do not cut a chain in two
            end += 1
        window, original = _window_module(gm, nodes[start:end])
        regions += _partitions(window, original)
        start = end
    return regions


def _partitions(gm: torch.fx.GraphModule, original: dict[Node, Node]) -> list[list[Node]]:
    partitioner = CapabilityBasedPartitioner(gm, _Pointwise(), allows_single_node_partition=False)
    return [[original[n] for n in p.nodes] for p in partitioner.propose_partitions()]


def _window_module(gm: torch.fx.GraphModule, window: list[Node]
                   ) -> tuple[torch.fx.GraphModule, dict[Node, Node]]:
    """The window's call_function nodes as a graph of their own: values from outside come in
    as placeholders, values read outside (or returned) go out; copies keep their meta."""
    graph = torch.fx.Graph()
    copies: dict[Node, Node] = {}
    members = {n for n in window if n.op == "call_function"}

    def outer(arg: Node) -> Node:
        if arg not in copies:
            copies[arg] = graph.placeholder(f"outer_{arg.name}")
            copies[arg].meta = arg.meta
        return copies[arg]
    for node in window:
        if node in members:
            copies[node] = graph.node_copy(node, lambda a: copies[a] if a in members else outer(a))
    escaping = [copies[n] for n in window if n in members
                and any(u not in members for u in n.users)]
    graph.output(tuple(escaping))
    original = {copy_: node for node, copy_ in copies.items() if node in members}
    return torch.fx.GraphModule(gm, graph), original


class FusedRegion(nn.Module):
    """A fused pointwise region: plain fx code, run compiled by Inductor outside tracing."""

    def __init__(self, region: torch.fx.GraphModule, stats: dict | None = None) -> None:
        super().__init__()
        self.region = region
        # shared by the regions of one graph; its amp_report["fused"]["compile"]
        self.stats = {"compiles": 0, "compile_seconds": 0.0, "reused": 0} \
            if stats is None else stats
        self._seen: set[tuple] = set()  # compile keys this region has run with
        self.signature = structure(region)
        ops = op_names(region)
        self.__doc__ = (f"Fused pointwise region of {len(ops)} ops: {', '.join(ops)}. "
                        "Runs compiled by Inductor (lazily, at the first call outside "
                        "torch.compile/torch.export tracing); eager if no compiler works.")

    def forward(self, *args: Any) -> Any:
        if _tracing(args):
            return self.region(*args)
        compiled = _compiled_for(self.signature, self.region, args, self.stats, self._seen)
        return self.region(*args) if compiled is None else compiled(*args)


def op_names(region: torch.fx.GraphModule) -> list[str]:
    return [str(n.target).split(".")[1] for n in region.graph.nodes if n.op == "call_function"]


def structure(region: torch.fx.GraphModule) -> str:
    """A canonical text of the region's graph: equal for regions that compute the same."""
    index: dict[Node, int] = {}
    lines = []

    def ref(arg: Any) -> Any:
        return torch.fx.node.map_arg(arg, lambda n: f"%{index[n]}")

    for i, node in enumerate(region.graph.nodes):
        index[node] = i
        lines.append(f"{node.op} {node.target if node.op != 'placeholder' else ''} "
                     f"{ref(node.args)!r} {ref(dict(node.kwargs))!r}")
    return "\n".join(lines)


def _tracing(args: Sequence[Any]) -> bool:
    if torch.compiler.is_compiling() or torch.compiler.is_exporting():
        return True
    if torch.fx._symbolic_trace.is_fx_symbolic_tracing():
        return True
    return any(not isinstance(a, torch.Tensor) or type(a) not in (torch.Tensor, nn.Parameter)
               for a in args)


def _input_key(args: Sequence[torch.Tensor]) -> tuple:
    return tuple((tuple(a.shape), a.stride(), a.dtype, a.device.type, a.requires_grad)
                 for a in args)


def _compiled_for(signature: str, region: torch.fx.GraphModule,
                  args: Sequence[torch.Tensor], stats: dict, seen: set
                  ) -> Callable | None:
    if os.environ.get(BACKEND_ENV, "inductor") == "eager" or _STATE["broken"]:
        return None
    key = (signature, _input_key(args), torch.is_grad_enabled())
    if key not in _COMPILED:
        if not _STATE["compiles"]:  # the first call pauses for seconds: say why, once
            log.warning("compiling fused pointwise regions with Inductor (once per distinct "
                        "region and input shape; %s=eager skips it)", BACKEND_ENV)
        start = time.perf_counter()
        compiled = _compile(region, args)
        if compiled is None:
            return None
        stats["compiles"] += 1
        if all(a.device.type == "cpu" for a in args):
            choice = _compiled_or_eager(signature, region, compiled, args)
            stats.setdefault("measured", []).append(choice.as_dict())
            if choice.chosen == "eager":
                compiled = None
        _COMPILED[key] = compiled
        stats["compile_seconds"] = round(stats["compile_seconds"]
                                         + time.perf_counter() - start, 3)
    elif key not in seen:
        stats["reused"] += 1  # compiled for an identical region, here or in another graph
    seen.add(key)
    return _COMPILED[key]


def _compiled_or_eager(signature: str, region: torch.fx.GraphModule, compiled: Callable,
                       args: Sequence[torch.Tensor]) -> kernel_timing.Choice:
    """Whether the compiled region beats its eager ops on this CPU, forward and (with grad
    mode on) backward, timed once per process and shape class (``fx/kernel_timing.py``).
    Eager is the default, which the compiled region must beat by the margin: a region's
    kernels save memory traffic, but on CPUs Inductor's generated code and its autograd
    wrapper often cost more than the eager ATen kernels, and timed alone (inputs in cache)
    a region flatters the compiled side; whole training steps ran slower with every region
    compiled than with none (docs/decisions/0033-cpu-kernels-by-measurement.md)."""
    inputs = [a.detach().requires_grad_(a.requires_grad) for a in args]

    def timed(fn: Callable) -> Callable[[], None]:
        def call() -> None:
            outs = [o for o in torch.utils._pytree.tree_leaves(fn(*inputs))
                    if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs and torch.is_grad_enabled():
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        return call

    digest = hashlib.sha1(signature.encode()).hexdigest()[:10]
    shape_class = (f"{digest}: {', '.join(op_names(region))}",
                   tuple(tuple(a.shape) for a in args), torch.is_grad_enabled())
    return kernel_timing.choose("pointwise", shape_class,
                                {"compiled": timed(compiled), "eager": timed(region)},
                                "eager")


def _compile(region: torch.fx.GraphModule, args: Sequence[torch.Tensor]) -> Callable | None:
    from torch._inductor.compile_fx import compile_fx  # heavy import: only when first needed

    start = time.perf_counter()
    try:
        # keep every cast's rounding (Inductor may skip it inside a kernel)
        compiled = compile_fx(copy.deepcopy(region), list(args),
                              config_patches={"emulate_precision_casts": True})
    except Exception as e:  # noqa: BLE001 - any compiler failure: run eager, say so once
        _STATE["broken"] = described(e)
        log.warning("fused pointwise regions run eager: Inductor could not compile them (%s)",
                    _STATE["broken"])
        return None
    _STATE["compile_seconds"] += time.perf_counter() - start
    _STATE["compiles"] += 1
    single = not isinstance(_output_arg(region), (tuple, list))

    def run(*inputs: torch.Tensor) -> Any:
        out = compiled(*inputs)
        if single:
            return out[0] if isinstance(out, (tuple, list)) else out
        return tuple(out)

    return run


def _output_arg(region: torch.fx.GraphModule) -> Any:
    return next(n for n in region.graph.nodes if n.op == "output").args[0]


def compile_stats() -> dict[str, float]:
    """Process-wide: Inductor compilations of fused regions so far and their seconds."""
    return {"compiles": _STATE["compiles"],
            "compile_seconds": round(_STATE["compile_seconds"], 3),
            "cached_variants": len(_COMPILED)}


def saved_bytes(region: Sequence[Node]) -> int:
    """Memory traffic a region saves at its example sizes: each value that lives only inside
    it is neither written nor read back by its readers."""
    members = set(region)
    saved = 0
    for node in region:
        if node.users and all(user in members for user in node.users):
            saved += _example_bytes(node) * (1 + len(node.users))
    return saved


def _example_bytes(node: Node) -> int:
    val = node.meta.get("val")
    numel = static_numel(val) if isinstance(val, torch.Tensor) else None
    return 0 if numel is None else numel * val.element_size()  # unknown size: saves nothing


class FusePointwise(PassBase):
    """Maximal pointwise regions → ``FusedRegion`` submodules (module docstring).

    ``min_saved_bytes``: regions saving less memory traffic (``saved_bytes``) stay unfused,
    where a region call costs more host time than its kernels save (``CUDA_MIN_SAVED_BYTES``).
    """

    def __init__(self, min_saved_bytes: int = 0) -> None:
        self.regions: list[str] = []
        self.compile = {"compiles": 0, "compile_seconds": 0.0, "reused": 0}
        self.min_saved_bytes = min_saved_bytes
        self.declined = 0

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        sink_to_first_use(graph_module)
        proposed = [p for p in propose_regions(graph_module) if len(p) > 1]
        partitions = [p for p in proposed if saved_bytes(p) >= self.min_saved_bytes]
        self.declined = len(proposed) - len(partitions)
        if not partitions:
            return PassResult(graph_module, False)
        # by name, so a region's inputs do not depend on where earlier passes put the nodes
        fuse_by_partitions(graph_module,
                           [dict.fromkeys(sorted(p, key=_name_key)) for p in partitions],
                           prefix=_TEMP_PREFIX)
        calls = [n for n in graph_module.graph.nodes
                 if n.op == "call_module" and n.target.startswith(_TEMP_PREFIX)]
        position = {node: i for i, node in enumerate(graph_module.graph.nodes)}
        for i, node in enumerate(calls):  # numbered in graph order: stable across rewrites
            region = FusedRegion(graph_module.get_submodule(node.target), self.compile)
            delattr(graph_module, node.target)
            node.target = f"{PREFIX}{i}"
            graph_module.add_submodule(node.target, region)
            node._rename(node.target)
            _canonical_outputs(node, region.region, position)
            region.signature = structure(region.region)
            _name_outputs(node)
            self.regions.append(region.signature)
        return finished(graph_module, True)

    def summary(self) -> dict[str, int]:
        """``compile`` is the regions' one-time Inductor cost, filled in as they first run:
        ``compiles`` and ``compile_seconds`` of this graph, ``reused``: compilations of
        identical regions (this graph's or another's, e.g. train and eval) it ran instead;
        on a CPU, ``measured``: each compiled region timed against its eager ops, and which
        one runs (``_compiled_or_eager``)."""
        return {"regions": len(self.regions), "distinct_regions": len(set(self.regions)),
                "declined_as_too_small": self.declined, "compile": self.compile}


def sink_to_first_use(gm: torch.fx.GraphModule) -> None:
    """Order the graph so that every fusible node sits just before the first non-fusible
    node that needs it (depth first over its arguments), so the regions depend on the graph
    alone, not on where earlier passes put nodes, and a second rewrite fuses the same."""
    graph = gm.graph
    placed: set[Node] = set()
    order: list[Node] = []

    def place(node: Node) -> None:
        stack = [(node, iter(node.all_input_nodes))]
        while stack:
            current, inputs = stack[-1]
            arg = next((a for a in inputs if a not in placed and is_fusible(a)), None)
            if arg is not None:
                stack.append((arg, iter(arg.all_input_nodes)))
                continue
            stack.pop()
            if current not in placed:
                placed.add(current)
                order.append(current)

    anchors = [n for n in graph.nodes if not is_fusible(n)]
    for anchor in anchors:
        place(anchor)
    if len(order) != len(graph.nodes):  # fusible nodes nothing reads: before the output
        order[-1:-1] = [n for n in graph.nodes if n not in placed]
    previous = order[0]
    for node in order[1:]:
        if previous.next is not node:
            previous.append(node)
        previous = node


def _name_key(node: Node) -> tuple[str, int]:
    """``add_10`` after ``add_9``: the same order in every layer of a stack."""
    base, _, number = node.name.rpartition("_")
    return (base, int(number)) if base and number.isdigit() else (node.name, -1)


def _canonical_outputs(call: Node, region: torch.fx.GraphModule,
                       position: dict[Node, int]) -> None:
    """Number a region's outputs by where the graph first reads them, which, unlike the
    order ``fuse_by_partitions`` gives (seeded by names), is the same on a second rewrite."""
    output = next(n for n in region.graph.nodes if n.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)) or len(values) < 2:
        return
    getitems = {u.args[1]: u for u in call.users if u.target is operator.getitem}

    def first_read(index: int) -> tuple[int, int]:
        item = getitems.get(index)
        if item is None or not item.users:
            return (len(position), index)
        user = min(item.users, key=position.__getitem__)
        reads = torch.fx.node.map_aggregate((user.args, user.kwargs), lambda a: a)
        flat = [a for a in torch.utils._pytree.tree_leaves(reads) if isinstance(a, Node)]
        return (position[user], flat.index(item) if item in flat else 0)

    order = sorted(range(len(values)), key=first_read)
    if order == list(range(len(values))):
        return
    output.args = (tuple(values[i] for i in order),)
    for new, old in enumerate(order):
        if old in getitems:
            getitems[old].args = (call, new)
    val = call.meta.get("val")
    if isinstance(val, (tuple, list)) and len(val) == len(values):  # the fake outputs follow
        call.meta["val"] = type(val)(val[i] for i in order)
    region.recompile()


def _name_outputs(call: Node) -> None:
    """``fused_3_out1 = fused_3[1]`` right after the call: the same code on every rewrite."""
    anchor = call
    for user in sorted(call.users, key=lambda u: u.args[1] if u.target is operator.getitem
                       else -1):
        if user.target is operator.getitem:
            user._rename(f"{call.name}_out{user.args[1]}")
            anchor.append(user)
            anchor = user


class UnfuseRegions(PassBase):
    """``FusedRegion`` calls → their ops inlined back (a second rewrite sees the flat graph)."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        calls = [n for n in graph_module.graph.nodes if n.op == "call_module"
                 and isinstance(graph_module.get_submodule(n.target), FusedRegion)]
        for node in calls:
            _inline(graph_module, node)
        return finished(graph_module, bool(calls))


def _inline(gm: torch.fx.GraphModule, call: Node) -> None:
    region = gm.get_submodule(call.target).region
    graph = gm.graph
    env: dict[Node, Any] = {}
    inputs = iter(call.args)
    with graph.inserting_before(call):
        for node in region.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
            elif node.op == "output":
                result = torch.fx.node.map_arg(node.args[0], env.__getitem__)
            else:
                env[node] = graph.node_copy(node, env.__getitem__)
    if isinstance(result, (tuple, list)):
        for user in list(call.users):  # getitem(call, i)
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        call.replace_all_uses_with(result)
    graph.erase_node(call)
    delattr(gm, call.target)

