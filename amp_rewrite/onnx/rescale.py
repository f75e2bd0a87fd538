"""Hot GEMM chains rescaled into fp16's range on the ONNX path (the decision: core/rescale.py).

A chain is ``v = MatMul(x, W_up)`` (optionally ``+ b``), read only through ops positively
homogeneous of degree one in it, ending in ``MatMul(u, W_down)``; ``W_up``, ``b`` and
``W_down`` are initializers nothing else reads. Where calibration saw a chain value beyond
fp16's threshold, ``W_up`` and ``b`` are multiplied by ``2^-k`` and ``W_down`` by ``2^k``:
exact in binary floating point, so the FP32 model computes the same and the chain fits fp16.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from amp_rewrite.core.rescale import Chain, shift

# ops f with f(c·v) = c·f(v) for c > 0, reading the chain value as their first input (the
# others - a shape, a perm, a ratio - do not scale with it)
_HOMOGENEOUS_FIRST = frozenset({"Relu", "LeakyRelu", "Identity", "Dropout", "Reshape",
                                "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Div"})
# a product is homogeneous in either operand while the other does not depend on the chain
_HOMOGENEOUS_ANY = frozenset({"Mul"})
_LONGEST_CHAIN = 32  # ops between the two GEMMs: a guard, FFNs have one to three


@dataclass(frozen=True)
class GemmChain:
    """One chain found in a graph: its GEMMs, scaled weights and the values between."""

    up: ir.Node
    down: ir.Node
    up_weights: tuple[ir.Value, ...]  # W_up and the bias, if any
    down_weight: ir.Value
    values: tuple[ir.Value, ...]  # every value from the up GEMM's output to the down's input


@dataclass(frozen=True)
class Rescaled:
    """A chain the pass rescaled, and by how much (``2^-shift`` up, ``2^shift`` down)."""

    up: str
    down: str
    shift: int
    values: tuple[str, ...]

    def as_report(self) -> dict:
        return {"node": self.up, "shift": self.shift, "down": self.down}


def rescale_hot_chains(graph: ir.Graph, maxima: Mapping[str, float]) -> list[Rescaled]:
    """Rescale every chain of ``graph`` with a value in ``maxima`` (value name → the max |x|
    calibration saw) that ``core.rescale.shift`` can bring within fp16's threshold."""
    done = []
    for node in list(graph):
        chain = find_chain(graph, node)
        if chain is None:
            continue
        k = chain_shift(chain, maxima)
        if k is None:
            continue
        _scale(chain.up_weights, 2.0 ** -k)
        _scale((chain.down_weight,), 2.0 ** k)
        done.append(Rescaled(chain.up.name, chain.down.name, k,
                             tuple(v.name for v in chain.values)))
    return done


def chain_shift(chain: GemmChain, maxima: Mapping[str, float]) -> int | None:
    """``core.rescale.shift`` of the chain, None where calibration saw none of its values
    beyond the threshold (``maxima`` names only those) or a weight is not finite."""
    seen = [maxima[v.name] for v in chain.values if v.name in maxima]
    if not seen:
        return None
    up = max(_largest(w) for w in chain.up_weights)
    down = _largest(chain.down_weight)
    if not all(np.isfinite(m) for m in (*seen, up, down)):
        return None
    return shift(Chain(max(seen), up, down))


def find_chain(graph: ir.Graph, up: ir.Node) -> GemmChain | None:
    """The chain that starts at ``up``, or None where ``up`` starts none: every value between
    the GEMMs must have exactly one reader, the next op of the chain, and be no graph output
    (a value read elsewhere would change there), which also keeps the other operand of a
    product independent of the chain."""
    if not _is_gemm_with_own_weight(graph, up, 0):
        return None
    weights = [up.inputs[1]]
    value = up.outputs[0]
    values = [value]
    reader = _only_reader(value)
    if reader is not None and reader[0].op_type == "Add" and reader[0].domain == "":
        bias = reader[0].inputs[1 - reader[1]]
        if _is_own_float_initializer(graph, bias):
            weights.append(bias)
            value = reader[0].outputs[0]
            values.append(value)
    for _ in range(_LONGEST_CHAIN):
        reader = _only_reader(value)
        if reader is None:
            return None
        node, index = reader
        if _is_gemm_with_own_weight(graph, node, index):
            return GemmChain(up, node, tuple(weights), node.inputs[1], tuple(values))
        if not _homogeneous_in(node, index):
            return None
        value = node.outputs[0]
        values.append(value)
    return None


def _homogeneous_in(node: ir.Node, index: int) -> bool:
    if node.domain != "":
        return False
    return node.op_type in _HOMOGENEOUS_ANY or (
        node.op_type in _HOMOGENEOUS_FIRST and index == 0)


def _only_reader(value: ir.Value) -> tuple[ir.Node, int] | None:
    """(node, input index) of the value's single use, None if it has several or is returned."""
    if value.is_graph_output():
        return None
    uses = list(value.uses())
    if len(uses) != 1:
        return None
    node, index = uses[0]
    return node, index


def _is_gemm_with_own_weight(graph: ir.Graph, node: ir.Node, index: int) -> bool:
    """A MatMul reading the chain as ``x`` (input 0) of ``x · W``, W a float32 initializer
    read by nothing else (scaling it changes no other op)."""
    return (node.op_type == "MatMul" and node.domain == "" and index == 0
            and len(node.inputs) == 2 and _is_own_float_initializer(graph, node.inputs[1]))


def _is_own_float_initializer(graph: ir.Graph, value: ir.Value | None) -> bool:
    return (value is not None and value.const_value is not None
            and graph.initializers.get(value.name) is value and not value.is_graph_input()
            and value.dtype == ir.DataType.FLOAT and len(list(value.uses())) == 1)


def _largest(value: ir.Value) -> float:
    array = value.const_value.numpy()
    return float(np.abs(array).max()) if array.size else 0.0


def _scale(values, factor: float) -> None:
    """Multiply each initializer by a power of two: exact while nothing leaves float32's
    normal range, which ``core.rescale.shift`` keeps far away (it bounds W·2^k by fp16's)."""
    for value in values:
        array = value.const_value.numpy() * np.float32(factor)
        value.const_value = ir.Tensor(array.astype(np.float32), name=value.name)
