"""Hot chains rescaled into fp16's range on the ONNX path (the decision: core/rescale.py).

A chain starts at ``v = MatMul(x, W_up)`` (optionally ``+ b``) or ``v = Conv(x, W_up, b)``, is
read only through ops positively homogeneous of degree one in it, and ends in either
* ``MatMul(u, W_down)``: ``W_down`` is multiplied by ``2^k``, undoing the shift; or
* an inference ``BatchNormalization(u, scale, bias, mean, var)``: ``mean`` is multiplied by
  ``2^-k`` and ``var`` and ``epsilon`` by ``2^-2k``; the normalisation divides the shift out
  (``√(2^-2k·(var + ε)) = 2^-k·√(var + ε)`` exactly). The trained detectors whose first conv
  writes values beyond fp16 normalise them at once (decision 0038).
``W_up`` and ``b`` are multiplied by ``2^-k``; the weights and statistics are constants
nothing else reads. Where calibration saw a chain value beyond fp16's threshold, the shift is
applied: exact in binary floating point, so the FP32 model computes the same and the chain
fits fp16.
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
    """One chain found in a graph: its ends, scaled weights and the values between."""

    up: ir.Node
    down: ir.Node  # a MatMul, or a BatchNormalization that normalises the shift away
    up_weights: tuple[ir.Value, ...]  # W_up and the bias, if any
    down_weight: ir.Value | None  # W_down of a MatMul end; None for a BatchNormalization
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
        if chain.down_weight is not None:
            _scale((chain.down_weight,), 2.0 ** k)
        else:
            _scale_statistics(chain.down, k)
        done.append(Rescaled(chain.up.name, chain.down.name, k,
                             tuple(v.name for v in chain.values)))
    return done


def values_a_shift_fits(graph: ir.Graph, maxima: Mapping[str, float]) -> set[str]:
    """Names of the values in ``maxima`` that ``rescale_hot_chains`` would bring within
    fp16's threshold, found without changing the graph (the opset decision asks it first)."""
    fitted: set[str] = set()
    for node in graph:
        chain = find_chain(graph, node)
        if chain is not None and chain_shift(chain, maxima) is not None:
            fitted.update(v.name for v in chain.values)
    return fitted


def chain_shift(chain: GemmChain, maxima: Mapping[str, float]) -> int | None:
    """``core.rescale.shift`` of the chain, None where calibration saw none of its values
    beyond the threshold (``maxima`` names only those) or a weight is not finite."""
    seen = [maxima[v.name] for v in chain.values if v.name in maxima]
    if not seen:
        return None
    up = max(_largest(w) for w in chain.up_weights)
    # a BatchNormalization end grows nothing: its statistics shrink, dividing the shift out
    down = _largest(chain.down_weight) if chain.down_weight is not None else 0.0
    if not all(np.isfinite(m) for m in (*seen, up, down)):
        return None
    return shift(Chain(max(seen), up, down))


def find_chain(graph: ir.Graph, up: ir.Node) -> GemmChain | None:
    """The chain that starts at ``up``, or None where ``up`` starts none: every value between
    the GEMMs must have exactly one reader, the next op of the chain, and be no graph output
    (a value read elsewhere would change there), which also keeps the other operand of a
    product independent of the chain."""
    if _is_conv_with_own_weights(graph, up):
        weights = [v for v in up.inputs[1:3] if v is not None]
    elif _is_gemm_with_own_weight(graph, up, 0):
        weights = [up.inputs[1]]
    else:
        return None
    value = up.outputs[0]
    values = [value]
    reader = _only_reader(value)
    if (up.op_type == "MatMul" and reader is not None and reader[0].op_type == "Add"
            and reader[0].domain == ""):
        bias = reader[0].inputs[1 - reader[1]]
        if _is_own_float_constant(graph, bias):
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
        if _is_normalisation_with_own_statistics(graph, node, index):
            return GemmChain(up, node, tuple(weights), None, tuple(values))
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
    """A MatMul reading the chain as ``x`` (input 0) of ``x · W``, W a float32 constant
    read by nothing else (scaling it changes no other op)."""
    return (node.op_type == "MatMul" and node.domain == "" and index == 0
            and len(node.inputs) == 2 and _is_own_float_constant(graph, node.inputs[1]))


def _is_conv_with_own_weights(graph: ir.Graph, node: ir.Node) -> bool:
    """A Conv whose weight and bias (if any) are float32 constants nothing else reads."""
    return (node.op_type == "Conv" and node.domain == "" and len(node.inputs) >= 2
            and all(_is_own_float_constant(graph, v) for v in node.inputs[1:3]
                    if v is not None))


def _is_normalisation_with_own_statistics(graph: ir.Graph, node: ir.Node, index: int) -> bool:
    """An inference BatchNormalization (one output, not training) reading the chain as X,
    whose mean and variance are float32 constants nothing else reads."""
    training = node.attributes.get_int("training_mode", 0)
    return (node.op_type == "BatchNormalization" and node.domain == "" and index == 0
            and len(node.inputs) == 5 and len([o for o in node.outputs if o.name]) == 1
            and not training
            and all(_is_own_float_constant(graph, v) for v in node.inputs[3:5]))


def _is_own_float_constant(graph: ir.Graph, value: ir.Value | None) -> bool:
    """A float32 constant nothing else reads: an initializer, or the output of a
    ``Constant(value=...)`` node (exporters such as paddle2onnx write weights that way)."""
    if value is None or value.dtype != ir.DataType.FLOAT or len(list(value.uses())) != 1:
        return False
    if _constant_node(value) is not None:
        return True
    return (value.const_value is not None and not value.is_graph_input()
            and graph.initializers.get(value.name) is value)


def _constant_node(value: ir.Value) -> ir.Node | None:
    node = value.producer()
    if (node is None or node.op_type != "Constant" or node.domain != ""
            or "value" not in node.attributes):
        return None
    return node


def _array(value: ir.Value) -> np.ndarray:
    node = _constant_node(value)
    if node is not None:
        return node.attributes["value"].value.numpy()
    return value.const_value.numpy()


def _largest(value: ir.Value) -> float:
    array = _array(value)
    return float(np.abs(array).max()) if array.size else 0.0


def _scale_statistics(norm: ir.Node, k: int) -> None:
    """A BatchNormalization reading ``2^-k`` times its old input: mean × ``2^-k``, variance
    and epsilon × ``2^-2k``, so that ``(x − mean) / √(var + ε)`` is unchanged."""
    _scale((norm.inputs[3],), 2.0 ** -k)
    _scale((norm.inputs[4],), 2.0 ** (-2 * k))
    epsilon = norm.attributes.get_float("epsilon", 1e-5)
    norm.attributes["epsilon"] = ir.AttrFloat32("epsilon", float(
        np.float32(epsilon) * np.float32(2.0 ** (-2 * k))))


def _scale(values, factor: float) -> None:
    """Multiply each initializer by a power of two: exact while nothing leaves float32's
    normal range, which ``core.rescale.shift`` keeps far away (it bounds W·2^k by fp16's)."""
    for value in values:
        array = (_array(value) * np.float32(factor)).astype(np.float32)
        tensor = ir.Tensor(array, name=value.name)
        node = _constant_node(value)
        if node is not None:
            node.attributes["value"] = ir.AttrTensor("value", tensor)
        if node is None or value.const_value is not None:  # loading mirrors a Constant's
            value.const_value = tensor
