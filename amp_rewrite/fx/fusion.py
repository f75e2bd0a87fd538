"""Pointwise chains that PyTorch has one fused kernel for, recognised before precision planning.

``FuseTanhGelu``: the tanh approximation of GELU spelled out in eight ATen ops (Hugging Face's
``gelu_new`` / ``NewGELUActivation``, used by GPT-2, ALBERT, T5 v1.1, ...):

    0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))

becomes ``aten.gelu(x, approximate="tanh")``, which computes the same formula in one pass over
memory. It matters for precision too: ``x**3`` alone leaves the fp16 range for |x| > 40, so
``pow`` is deny and the spelled-out chain costs a cast into and out of fp32 per layer; the
fused kernel computes in fp32 registers (``opmath``) for fp16/bf16 inputs, so it can run low.
Both sides of the rewrite are plain ATen, so the result stays exportable and differentiable.
"""
from __future__ import annotations

import math

import torch
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

aten = torch.ops.aten
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    half_x = aten.mul.Tensor(x, 0.5)
    inner = aten.add.Tensor(x, aten.mul.Tensor(aten.pow.Tensor_Scalar(x, 3.0), 0.044715))
    tanh = aten.tanh.default(aten.mul.Tensor(inner, _SQRT_2_OVER_PI))
    return aten.mul.Tensor(half_x, aten.add.Tensor(tanh, 1.0))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return aten.gelu.default(x, approximate="tanh")


class FuseTanhGelu(PassBase):
    """The spelled-out tanh GELU → ``aten.gelu(x, approximate="tanh")`` (module docstring).

    The fused node keeps the example value (``meta['val']``) of the chain it replaces.
    """

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        replaced = replace_pattern_with_filters(graph_module, _gelu_new, _gelu_tanh,
                                                ignore_literals=False)
        for match in replaced:
            # ``match.anchor`` is the pattern's node; the graph's own is in ``nodes_map``.
            last = match.nodes_map[match.anchor]
            # The fused gelu is the one replacement and returns what the chain's last op did
            # (x's shape and dtype): it takes that node's meta, module path (for keep_fp32
            # patterns) and example value alike, so no fake propagation is needed.
            (gelu,) = match.replacements
            gelu.meta.update(last.meta)
        if replaced:
            graph_module.graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, bool(replaced))
