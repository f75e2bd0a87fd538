"""Device-aware lowering: low-precision GEMMs as fp32 kernels on CPUs without low GEMM units.

A CPU without bf16/fp16 matrix instructions runs PyTorch's low ``mm``/``linear``/``conv`` on a
scalar fallback far slower than fp32. ``EmulateLowKernels`` rewrites each GEMM, convolution
and ``scaled_dot_product_attention`` the plan runs low into the same op in fp32 on the
low-rounded operands, its output rounded to the low dtype::

    linear(x_bf16, w_bf16, b_bf16)  →  _to_copy(linear(x_bf16.float(), w_bf16.float(),
                                                        b_bf16.float()), dtype=bf16)

This is the low kernel's numerics class, not fp32: a product of two low values is exact in
fp32, low kernels accumulate in fp32 too, and the result is rounded where the plan said so.

Which kernels (``emulate_gemms=None``): on 'cpu', each low GEMM, convolution and attention call
whose fp32 kernel measures faster on this machine than its low one (``kernel_choice``, timed
once per process and shape class by ``fx/kernel_timing.py``): a CPU without bf16 units loses
~100x on low GEMMs, one with them wins ~2x, and attention goes either way by shape; never on
CUDA (decision 0021). Lowered nodes carry ``meta[LOWERED_TAG]``; ``RestoreLowKernels`` undoes it
(a second rewrite plans the low graph).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from amp_rewrite.fx import kernel_timing
from amp_rewrite.fx.apply import DTYPE_SUFFIX, conversion, retyped
from amp_rewrite.fx.flops import node_flops
from amp_rewrite.fx.opkeys import size_hint, tensor_val
from amp_rewrite.fx.view import finished

logger = logging.getLogger(__name__)
aten = torch.ops.aten
LOWERED_TAG = "amp_rewrite_lowered"  # node.meta key: "kernel", "operand" or "result"
_LOW_VAL = "amp_rewrite_lowered_val"  # node.meta key: the kernel's low example value
_WHY = "amp_rewrite_lowered_why"  # node.meta key: why this kernel runs in fp32
_LOW = (torch.float16, torch.bfloat16)
SDPA = aten.scaled_dot_product_attention.default
KERNELS = (aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
           aten.baddbmm.default, aten.matmul.default, aten.conv1d.default,
           aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
           aten.conv_transpose1d.default, aten.conv_transpose2d.input,
           aten.conv_transpose3d.input, SDPA)


def native_low_gemm(dtype: torch.dtype, device: str) -> bool:
    """Whether ``device`` has fast GEMM/conv kernels in ``dtype`` (CUDA: yes; CPU: oneDNN's
    check for AVX512-BF16/AMX (bf16) or AVX512-FP16/AMX-FP16 (fp16))."""
    if device != "cpu":
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


class MeasuredChoice:
    """``EmulateLowKernels``'s selection on a CPU: the GEMMs, convolutions and attention calls
    whose fp32 kernel measures faster here than the low one (``kernel_choice``), with the
    reason; ``timings``: the measurements behind this graph's choices, one per shape class."""

    def __init__(self, low: torch.dtype, train: bool) -> None:
        self.name, self.train = DTYPE_SUFFIX[low], train
        self._used: dict[str, kernel_timing.Choice] = {}

    def __call__(self, node: Node) -> str | None:
        choice = kernel_choice(node, self.train)
        self._used[choice.shape_class] = choice
        if choice.chosen != "fp32":
            return None
        # a mixed plan's kernels are fp16 or bf16: the node's own dtype names the kernel
        name = DTYPE_SUFFIX.get(tensor_val(node).dtype, self.name)
        return (f"the fp32 kernel measured faster here: {choice.ms['fp32']:.3g} ms against "
                f"{choice.ms['low']:.3g} ms for the {name} one")

    @property
    def timings(self) -> list[dict]:
        return [choice.as_dict() for choice in self._used.values()]


PROXY_FLOPS = 2.5e8  # forward work of one timed call: the leading dim is cut down to fit


def kernel_choice(node: Node, train: bool) -> kernel_timing.Choice:
    """The low kernel of ``node`` (a low GEMM, conv or SDPA call on CPU) against the fp32 one
    on upcast operands, forward and (``train``) backward, timed once per shape class: the
    call with its leading (batch or row) dim cut to ``PROXY_FLOPS`` of work, as which kernel
    wins does not change with more rows, and a slow candidate (a low GEMM on a CPU without
    low units) then costs milliseconds, not seconds."""
    op = str(node.target).split(".")[1]
    try:
        args, kwargs = _proxy_call(node, train)
    except Exception as e:  # noqa: BLE001 - an unusual call: keep the plan's kernel
        logger.debug("could not build a timing call for %s (%s)", node.name, e)
        args, kwargs = None, None
    shape_class = (op, train, _describe_call(args, kwargs) if args is not None else node.name)
    if args is None:
        return kernel_timing.choose("kernel", shape_class, {}, "low")
    low = tensor_val(node).dtype
    target = node.target

    def run(fp32: bool) -> Callable[[], None]:
        call_args = [a.float() if fp32 and _is_low(a) else a for a in args]
        call_kwargs = {k: v.float() if fp32 and _is_low(v) else v for k, v in kwargs.items()}

        def call() -> None:
            with torch.set_grad_enabled(train):
                out = target(*call_args, **call_kwargs).to(low)
                if train and out.requires_grad:
                    out.backward(torch.ones_like(out))
        return call
    return kernel_timing.choose("kernel", shape_class, {"low": run(False), "fp32": run(True)},
                                "low")


def _proxy_call(node: Node, train: bool) -> tuple[list, dict]:
    """Real example operands for ``node``: random values (zeros for a float mask: no -inf
    rows), gradients where they flow in training, the leading dim cut to ``PROXY_FLOPS``."""
    op = str(node.target).split(".")[1]
    rows = size_hint(tensor_val(node).shape[0]) if tensor_val(node).dim() else 1
    cut = max(1, rows // max(1, math.ceil(node_flops(node, f"aten::{op}") / PROXY_FLOPS)))

    def example(a, position):
        val = tensor_val(a)
        if val is None:
            return a
        shape = [size_hint(d) for d in val.shape]
        if shape and shape[0] == rows and _is_row_operand(op, position, len(shape)):
            shape[0] = cut
        if val.dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        # in training every operand takes a gradient (activations' example values do not
        # say so), but an attention mask only if it is learned (T5's position bias): CPU SDPA
        # takes another backward path for a mask that needs one
        mask = node.target is SDPA and position not in (0, 1, 2)
        grad = train and val.dtype.is_floating_point and (not mask or _needs_grad(a))
        if mask and not grad:
            return torch.zeros(shape, dtype=val.dtype)
        return torch.randn(shape).to(val.dtype).requires_grad_(grad)
    args = [example(a, i) for i, a in enumerate(node.args)]
    kwargs = {k: example(v, k) for k, v in node.kwargs.items()}
    return args, kwargs


def _is_row_operand(op: str, position: int | str, rank: int) -> bool:
    """Whether operand ``position`` of ``op`` is indexed by the output's leading dim (the
    batch, or a GEMM's rows), so that cutting the rows cuts it too. By position, not by size:
    a weight or a bias may have as many rows as the batch (GPT-2's 1024-wide FFN at 8 x 128
    tokens)."""
    if op in ("bmm", "baddbmm", "scaled_dot_product_attention"):
        return True  # batch-major operands; a broadcast mask's leading 1 never matches
    if op == "addmm":  # (bias, rows, weight): a bias is cut only as a full [M, N] matrix
        return position == 1 or (position == 0 and rank == 2)
    if op == "matmul":  # a batched right operand shares the batch
        return position == 0 or (position == 1 and rank >= 3)
    return position == 0  # linear, mm, convolutions: the input, never the weight or bias


def _describe_call(args: list, kwargs: dict) -> tuple:
    def describe(a):
        if isinstance(a, torch.Tensor):
            return (tuple(a.shape), a.dtype, a.requires_grad)
        return a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)
    return (tuple(map(describe, args)), tuple(sorted((k, describe(v)) for k, v in kwargs.items())))


def _needs_grad(a) -> bool:
    val = tensor_val(a)
    return val is not None and bool(val.requires_grad)


def _is_low(a) -> bool:
    return isinstance(a, torch.Tensor) and a.dtype in _LOW


def _float_inputs(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes
            if tensor_val(a) is not None and tensor_val(a).dtype.is_floating_point]


def _is_low_kernel(node: Node) -> bool:
    """A kernel the plan runs low: low output, every floating input in that same dtype."""
    out = tensor_val(node)
    if node.op != "call_function" or node.target not in KERNELS or out is None \
            or out.dtype not in _LOW or out.device.type != "cpu":
        return False
    inputs = _float_inputs(node)
    return bool(inputs) and all(tensor_val(a).dtype == out.dtype for a in inputs)


def _cast(graph: torch.fx.Graph, value: Node, dtype: torch.dtype, role: str,
          memo: dict) -> Node:
    node = conversion(graph, value, dtype)
    node.meta["val"] = retyped(tensor_val(value), dtype, memo)
    node.meta[LOWERED_TAG] = role
    return node


def _fp32_of(graph: torch.fx.Graph, value: Node, memo: dict) -> Node:
    """An fp32 copy of a low value: an existing plain cast to fp32 if the plan made one."""
    for user in value.users:
        if user.target is aten._to_copy.default and dict(user.kwargs) == {
                "dtype": torch.float32} and user.meta.get(LOWERED_TAG) != "result":
            return user
    return _cast(graph, value, torch.float32, "operand", memo)


class EmulateLowKernels(PassBase):
    """Low GEMMs/convs/SDPA → fp32 kernels on low-rounded operands (module docstring);
    ``select``: which of the low kernels (default all), with the reason ``explain`` gives."""

    def __init__(self, select: Callable[[Node], str | None] | None = None) -> None:
        self.lowered: dict[str, int] = {}
        self.select = select or (lambda node: "requested")

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        chosen = [(n, self.select(n)) for n in graph.nodes if _is_low_kernel(n)]
        memo: dict = {}  # see apply.retyped
        for node, why in chosen:
            if why is None:
                continue
            low = tensor_val(node).dtype
            upcast = {a: _fp32_of(graph, a, memo) for a in _float_inputs(node)}
            node.args = torch.fx.node.map_arg(node.args, lambda a: upcast.get(a, a))
            node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: upcast.get(a, a))
            node.meta[_LOW_VAL] = node.meta["val"]
            node.meta["val"] = retyped(node.meta["val"], torch.float32, memo)
            node.meta[LOWERED_TAG] = "kernel"
            node.meta[_WHY] = why
            users = list(node.users)
            rounded = _cast(graph, node, low, "result", memo)
            for user in users:
                user.replace_input_with(node, rounded)
            op = str(node.target).split(".")[1]
            self.lowered[op] = self.lowered.get(op, 0) + 1
        return finished(graph_module, bool(self.lowered))


class RestoreLowKernels(PassBase):
    """Undo ``EmulateLowKernels``: the kernels read their low operands again."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        kernels = [n for n in graph.nodes if n.meta.get(LOWERED_TAG) == "kernel"]
        for node in kernels:
            for user in [u for u in node.users if u.meta.get(LOWERED_TAG) == "result"]:
                user.replace_all_uses_with(node)
                erase_node(graph, user)
            for arg in node.all_input_nodes:
                if arg.target is aten._to_copy.default and arg.meta.get("val") is not None \
                        and tensor_val(arg.args[0]) is not None \
                        and tensor_val(arg.args[0]).dtype == node.meta[_LOW_VAL].dtype:
                    node.replace_input_with(arg, arg.args[0])
                    if not arg.users and arg.meta.get(LOWERED_TAG) == "operand":
                        erase_node(graph, arg)
            node.meta["val"] = node.meta.pop(_LOW_VAL)
            del node.meta[LOWERED_TAG]
            node.meta.pop(_WHY, None)
        return finished(graph_module, bool(kernels))


def erase_node(graph: torch.fx.Graph, node: Node) -> None:
    """Erase ``node`` and free its name, so the cast re-created by the next lowering gets
    the same name (fx keeps erased names reserved): a second rewrite gives the same code."""
    graph.erase_node(node)
    graph._graph_namespace._used_names.discard(node.name)


def explanation(node: Node) -> str:
    low = DTYPE_SUFFIX[node.meta[_LOW_VAL].dtype]
    return (f"{node.name}: emulated {low} kernel: runs in fp32 on {low}-rounded inputs, output "
            f"rounded to {low} ({node.meta.get(_WHY, 'requested')}; emulate_gemms=False "
            "keeps the low kernel)")
