"""Device-aware lowering: low-precision GEMMs as fp32 kernels on CPUs without low GEMM units.

A CPU without bf16/fp16 matrix instructions (no AVX512-BF16/AMX-BF16/AVX512-FP16, e.g. any
AVX2-only CPU: ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` is False) runs PyTorch's
bf16/fp16 ``mm``/``linear``/``conv`` on a scalar fallback ~100x slower than fp32 (measured
here: a 1024x768 @ 768x768 GEMM takes 1.09 s in bf16, 7 ms in fp32; a conv 26x slower).

``EmulateLowKernels`` rewrites each GEMM, convolution and ``scaled_dot_product_attention``
the plan runs low into the same op in fp32 on the low-rounded operands, its output rounded to
the low dtype::

    linear(x_bf16, w_bf16, b_bf16)  →  _to_copy(linear(x_bf16.float(), w_bf16.float(),
                                                        b_bf16.float()), dtype=bf16)

This is the numerics class of the low kernel, not fp32: every operand is the bf16/fp16 value
the plan made; a product of two bf16 (or fp16) values is exact in fp32, the low kernels
accumulate in fp32 too, and the result is rounded to the low dtype where the plan said so.
The only difference is rounding order inside the fp32 accumulation, and for SDPA one rounding
fewer (the CPU low kernel rounds the softmax probabilities to the low dtype before ``· v``).
Backward follows through autograd: its GEMMs are fp32 kernels on low-rounded gradients too.
The casts join the pointwise regions next to them (``fx/pointwise.py``, which keeps their
rounding inside compiled regions).

On by default only for device 'cpu' without native low GEMM (``native_low_gemm``); never on
CUDA. Each lowered kernel carries ``meta[LOWERED_TAG] = "kernel"`` (its operand casts
"operand", its output cast "result"); ``gm.amp_report["emulated_gemms"]`` counts them and
``explain`` says so. ``RestoreLowKernels`` undoes it (a second rewrite plans the low graph).
"""
from __future__ import annotations

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

aten = torch.ops.aten
LOWERED_TAG = "amp_rewrite_lowered"  # node.meta key: "kernel", "operand" or "result"
_LOW_VAL = "amp_rewrite_lowered_val"  # node.meta key: the kernel's low example value
_LOW = (torch.float16, torch.bfloat16)
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
KERNELS = (aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default,
           aten.baddbmm.default, aten.matmul.default, aten.conv1d.default,
           aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
           aten.conv_transpose1d.default, aten.conv_transpose2d.input,
           aten.conv_transpose3d.input, aten.scaled_dot_product_attention.default)


def native_low_gemm(dtype: torch.dtype, device: str) -> bool:
    """Whether ``device`` has fast GEMM/conv kernels in ``dtype`` (CUDA: yes; CPU: oneDNN's
    check for AVX512-BF16/AMX (bf16) or AVX512-FP16/AMX-FP16 (fp16))."""
    if device != "cpu":
        return True
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


def _val(node: object) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _float_inputs(node: Node) -> list[Node]:
    return [a for a in node.all_input_nodes
            if _val(a) is not None and _val(a).dtype.is_floating_point]


def _is_low_kernel(node: Node) -> bool:
    """A kernel the plan runs low: low output, every floating input in that same dtype."""
    out = _val(node)
    if node.op != "call_function" or node.target not in KERNELS or out is None \
            or out.dtype not in _LOW or out.device.type != "cpu":
        return False
    inputs = _float_inputs(node)
    return bool(inputs) and all(_val(a).dtype == out.dtype for a in inputs)


def _cast(graph: torch.fx.Graph, value: Node, dtype: torch.dtype, role: str) -> Node:
    with graph.inserting_after(value):
        node = graph.create_node("call_function", aten._to_copy.default, (value,),
                                 {"dtype": dtype}, name=f"{value.name}_{_SHORT[dtype]}")
    node.meta["val"] = _val(value).to(dtype)
    node.meta[LOWERED_TAG] = role
    for key in ("nn_module_stack", "stack_trace"):
        if key in value.meta:
            node.meta[key] = value.meta[key]
    return node


def _fp32_of(graph: torch.fx.Graph, value: Node) -> Node:
    """An fp32 copy of a low value: an existing plain cast to fp32 if the plan made one."""
    for user in value.users:
        if user.target is aten._to_copy.default and dict(user.kwargs) == {
                "dtype": torch.float32} and user.meta.get(LOWERED_TAG) != "result":
            return user
    return _cast(graph, value, torch.float32, "operand")


class EmulateLowKernels(PassBase):
    """Low GEMMs/convs/SDPA → fp32 kernels on low-rounded operands (module docstring)."""

    def __init__(self) -> None:
        self.lowered: dict[str, int] = {}

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        for node in [n for n in graph.nodes if _is_low_kernel(n)]:
            low = _val(node).dtype
            upcast = {a: _fp32_of(graph, a) for a in _float_inputs(node)}
            node.args = torch.fx.node.map_arg(node.args, lambda a: upcast.get(a, a))
            node.kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: upcast.get(a, a))
            node.meta[_LOW_VAL] = node.meta["val"]
            node.meta["val"] = node.meta["val"].to(torch.float32)
            node.meta[LOWERED_TAG] = "kernel"
            users = list(node.users)
            rounded = _cast(graph, node, low, "result")
            for user in users:
                user.replace_input_with(node, rounded)
            op = str(node.target).split(".")[1]
            self.lowered[op] = self.lowered.get(op, 0) + 1
        if self.lowered:
            graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, bool(self.lowered))


class RestoreLowKernels(PassBase):
    """Undo ``EmulateLowKernels``: the kernels read their low operands again."""

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        graph = graph_module.graph
        kernels = [n for n in graph.nodes if n.meta.get(LOWERED_TAG) == "kernel"]
        for node in kernels:
            for user in [u for u in node.users if u.meta.get(LOWERED_TAG) == "result"]:
                user.replace_all_uses_with(node)
                _erase(graph, user)
            for arg in node.all_input_nodes:
                if arg.target is aten._to_copy.default and arg.meta.get("val") is not None \
                        and _val(arg.args[0]) is not None \
                        and _val(arg.args[0]).dtype == node.meta[_LOW_VAL].dtype:
                    node.replace_input_with(arg, arg.args[0])
                    if not arg.users and arg.meta.get(LOWERED_TAG) == "operand":
                        _erase(graph, arg)
            node.meta["val"] = node.meta.pop(_LOW_VAL)
            del node.meta[LOWERED_TAG]
        if kernels:
            graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, bool(kernels))


def _erase(graph: torch.fx.Graph, node: Node) -> None:
    """Erase ``node`` and free its name, so the cast re-created by the next lowering gets
    the same name (fx keeps erased names reserved): a second rewrite gives the same code."""
    graph.erase_node(node)
    graph._graph_namespace._used_names.discard(node.name)


def explanation(node: Node) -> str:
    low = _SHORT[node.meta[_LOW_VAL].dtype]
    return (f"{node.name}: emulated {low} kernel: runs in fp32 on {low}-rounded inputs, output "
            f"rounded to {low} (this CPU has no native {low} GEMM; emulate_gemms=False "
            "keeps the low kernel)")
