"""Device-aware lowering: low-precision GEMMs as fp32 kernels on CPUs without low GEMM units.

A CPU without bf16/fp16 matrix instructions runs PyTorch's low ``mm``/``linear``/``conv`` on a
scalar fallback far slower than fp32. ``EmulateLowKernels`` rewrites each GEMM, convolution
and ``scaled_dot_product_attention`` the plan runs low into the same op in fp32 on the
low-rounded operands, its output rounded to the low dtype::

    linear(x_bf16, w_bf16, b_bf16)  →  _to_copy(linear(x_bf16.float(), w_bf16.float(),
                                                        b_bf16.float()), dtype=bf16)

This is the low kernel's numerics class, not fp32: a product of two low values is exact in
fp32, low kernels accumulate in fp32 too, and the result is rounded where the plan said so.

Which kernels (``emulate_gemms=None``): on 'cpu', GEMMs and convolutions when the CPU has no
native low GEMM (``native_low_gemm``), and each distinct attention call when timing it here
says the fp32 kernel is faster (``attention_faster_in_fp32``: which wins depends on CPU and
shape); never on CUDA (decision 0021). Lowered nodes carry ``meta[LOWERED_TAG]``;
``RestoreLowKernels`` undoes it (a second rewrite plans the low graph).
"""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from amp_rewrite.fx.apply import DTYPE_SUFFIX, conversion, retyped
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


ATTENTION_MARGIN = 1.2  # the fp32 kernel must win by this factor: no flip-flop on near ties
_ATTENTION_CHOICES: dict[tuple, tuple[bool, float, float]] = {}  # per process: one timing


def device_choice(low: torch.dtype, native: bool, train: bool
                  ) -> Callable[[Node], str | None]:
    """``EmulateLowKernels``'s selection on a CPU: GEMMs/convs where it has no native low GEMM
    (``native``), attention calls where the fp32 kernel measures faster; with the reason."""
    name = DTYPE_SUFFIX[low]

    def select(node: Node) -> str | None:
        if node.target is SDPA:
            if attention_faster_in_fp32(node, train):
                return f"the fp32 attention kernel measured faster than the {name} one here"
            return None
        return None if native else f"this CPU has no native {name} GEMM"
    return select


def attention_faster_in_fp32(node: Node, train: bool) -> bool:
    """Whether ``node`` (a low SDPA call on CPU) runs faster as the fp32 kernel on upcast
    operands, forward and (``train``) backward, timed once per distinct call signature."""
    key = (_signature(node), train)
    if key not in _ATTENTION_CHOICES:
        try:
            _ATTENTION_CHOICES[key] = _time_attention(node, train)
        except Exception as e:  # noqa: BLE001 - an unusual call: keep the plan's kernel
            logger.debug("could not time %s (%s); it keeps its low kernel", node.name, e)
            _ATTENTION_CHOICES[key] = (False, float("nan"), float("nan"))
    return _ATTENTION_CHOICES[key][0]


def attention_timings() -> list[dict]:
    """The measurements behind ``attention_faster_in_fp32`` (for reports and benchmarks)."""
    return [{"call": str(key[0]), "train": key[1], "fp32": fp32, "low_ms": low, "fp32_ms": emu}
            for key, (fp32, low, emu) in _ATTENTION_CHOICES.items()]


def _signature(node: Node) -> tuple:
    def describe(a):
        val = tensor_val(a)
        if val is not None:
            return (tuple(size_hint(d) for d in val.shape), val.dtype)
        return a if isinstance(a, (int, float, bool, str, type(None))) else repr(a)
    return (tuple(map(describe, node.args)),
            tuple(sorted((k, describe(v)) for k, v in node.kwargs.items())))


def _example(a, grad: bool):
    """A real tensor like ``a``'s example value (zeros for a mask: no -inf rows)."""
    val = tensor_val(a)
    if val is None:
        return a
    shape = [size_hint(d) for d in val.shape]
    if val.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool)
    t = torch.randn(shape).to(val.dtype) if grad else torch.zeros(shape, dtype=val.dtype)
    return t.requires_grad_(grad and val.dtype.is_floating_point)


def _time_attention(node: Node, train: bool) -> tuple[bool, float, float]:
    # q, k, v take gradients in training; a mask only if it is learned (T5's position bias),
    # as CPU SDPA takes another backward path for a mask that needs one
    args = [_example(a, train and (i < 3 or _needs_grad(a))) for i, a in enumerate(node.args)]
    kwargs = {k: _example(v, train and _needs_grad(v)) for k, v in node.kwargs.items()}
    # same math every call; dropout costs both sides alike (dropout_p: 5th argument)
    if len(args) > 4:
        args[4] = 0.0
    elif "dropout_p" in kwargs:
        kwargs["dropout_p"] = 0.0
    low = tensor_val(node).dtype

    def run(fp32: bool) -> None:
        call_args = [a.float() if fp32 and _is_low(a) else a for a in args]
        call_kwargs = {k: v.float() if fp32 and _is_low(v) else v for k, v in kwargs.items()}
        with torch.set_grad_enabled(train):
            out = SDPA(*call_args, **call_kwargs).to(low)
            if train:
                out.backward(torch.ones_like(out))

    def median_ms(fp32: bool) -> float:
        """Median of >= 5 runs and >= 30 ms in all (not the minimum: the low backward is
        bimodal on CPU, and a step pays the usual run)."""
        run(fp32)  # warm-up
        times: list[float] = []
        while len(times) < 5 or (sum(times) < 0.03 and len(times) < 200):
            start = time.perf_counter()
            run(fp32)
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    low_ms, fp32_ms = median_ms(False), median_ms(True)
    return fp32_ms * ATTENTION_MARGIN < low_ms, round(low_ms, 3), round(fp32_ms, 3)


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
