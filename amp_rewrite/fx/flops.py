"""FLOPs of an fx node from the shapes in ``meta['val']`` (``core.flops.op_flops``): the
accuracy budget's unit weights and low-FLOP share (``fx/budget.py``), and the size of the
example call that times a CPU kernel (``fx/lowering.py``). Symbolic sizes count at their
example value (``opkeys.size_hint``)."""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from amp_rewrite.core.flops import op_flops
from amp_rewrite.fx.opkeys import size_hint, tensor_val


def node_flops(node: Node, op_key: str) -> float:
    """FLOPs of ``node`` (0 without a tensor value); ``op_key`` as the rules name it."""
    out = _first_tensor(node.meta.get("val"))
    if out is None:
        return 0.0
    op = op_key.rsplit(".", 1)[-1].removeprefix("aten::")
    transposed = op == "convolution" and len(node.args) > 6 and node.args[6] is True
    return op_flops(op, [_shape(tensor_val(a)) for a in node.args], [_shape(out)],
                    transposed=transposed)


def _shape(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(size_hint(d) for d in t.shape)


def _first_tensor(val: Any) -> torch.Tensor | None:
    return next((t for t in torch.utils._pytree.tree_leaves(val) if isinstance(t, torch.Tensor)),
                None)
