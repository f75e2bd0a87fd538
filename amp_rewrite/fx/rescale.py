"""Hot GEMM chains shifted into fp16's range by an exact power of two (core/rescale.py decides
the shift; this module finds the chains in a prepared torch graph and applies it).

A chain is ``v = GEMM(x, W_up[, b])`` read only through ops positively homogeneous of degree
one in ``v`` and ending in ``GEMM(u, W_down, ...)``. ``W_up`` (and its bias) become
``W_up * 2^-k`` and ``W_down`` becomes ``W_down * 2^k``, as multiplies in the graph right
after the ``get_attr``: the parameters stay the user's FP32 masters and gradients flow
through the multiply, so training computes the same math. The values recorded on the example
inputs (``fx/ranges.RANGE_META``) of every chain value are divided by ``2^k``, so the plan sees
them within fp16's range. The multiplies carry ``RESCALE_TAG``: a second rewrite of the result
finds no plain ``get_attr`` weight behind them and shifts nothing again.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from amp_rewrite.core.rescale import Chain, shift
from amp_rewrite.fx.capture import fill_missing_fake_values, refresh_fake_values
from amp_rewrite.fx.ranges import RANGE_META, max_finite_magnitude

RESCALE_TAG = "amp_rewrite_rescale"  # node.meta key on the inserted multiplies: "up"/"down"

aten = torch.ops.aten
# GEMM packet -> (position of the activation, position of the weight, position of the bias)
_GEMMS = {aten.linear: (0, 1, 2), aten.mm: (0, 1, None), aten.matmul: (0, 1, None),
          aten.addmm: (1, 2, 0)}
# ops f with f(c·v) = c·f(v) for c > 0, reading the chain value as their first argument
_HOMOGENEOUS = {aten.relu, aten.leaky_relu, aten.dropout, aten.view, aten.reshape,
                aten._unsafe_view, aten.transpose, aten.t, aten.permute, aten.contiguous,
                aten.clone, aten.alias}
# reaching a weight through a layout op scales it the same (transposing commutes with 2^k)
_WEIGHT_LAYOUT = {aten.t, aten.transpose, aten.permute}


@dataclass
class _Found:
    """One chain: its GEMMs, the values between, and the weights to scale."""

    up: Node
    values: list[Node]
    downs: list[Node]


class RescaleHotChains:
    """The prepare pass (fx/pipeline.py): shift every hot chain it can; ``rescaled`` holds
    {"node", "shift", "down"} per shifted chain and down GEMM, for the report."""

    def __init__(self) -> None:
        self.rescaled: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule) -> bool:
        if not any(RANGE_META in n.meta for n in gm.graph.nodes):
            return False  # no recorded ranges: nothing says a chain is hot
        for node in list(gm.graph.nodes):
            found = _chain_from(gm, node)
            magnitudes = _magnitudes(gm, found) if found else None
            k = shift(magnitudes) if magnitudes else None
            if k:
                _apply(gm, found, k)
                self.rescaled += [{"node": found.up.name, "shift": k, "down": d.name}
                                  for d in found.downs]
        if self.rescaled:
            gm.graph.lint()
            if not fill_missing_fake_values(gm):
                refresh_fake_values(gm)
            gm.recompile()
        return bool(self.rescaled)


def explanation(entry: dict) -> str:
    """The explain line of a shifted chain's GEMMs (core/rescale.py)."""
    return (f"{entry['node']}: weights scaled by 2^-{entry['shift']} and {entry['down']}'s by "
            f"2^{entry['shift']} in the graph (exact power-of-two rescaling, "
            "core/rescale.py): the chain's values fit fp16's range")


def _packet(node: Node):
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


def _arg(node: Node, position: int | None):
    if position is None or position >= len(node.args):
        return None
    return node.args[position]


def _stored_weight(arg) -> tuple[Node, Node] | None:
    """(get_attr, the node reading it) where ``arg`` is a stored tensor, directly or through
    one layout op only this GEMM reads; None otherwise (an already shifted weight included)."""
    if not isinstance(arg, Node):
        return None
    if arg.op == "get_attr":
        return arg, None
    if _packet(arg) in _WEIGHT_LAYOUT and len(arg.users) == 1 \
            and isinstance(arg.args[0], Node) and arg.args[0].op == "get_attr":
        return arg.args[0], arg
    return None


def _chain_from(gm: torch.fx.GraphModule, up: Node) -> _Found | None:
    """The chain whose up projection is ``up``, or None where ``up`` is no such GEMM or a
    value of the chain has a reader outside it."""
    positions = _GEMMS.get(_packet(up))
    if positions is None or _stored_weight(_arg(up, positions[1])) is None:
        return None
    bias = _arg(up, positions[2])
    if bias is not None and _stored_weight(bias) is None:
        return None
    depends = _descendants(up)
    values, downs, pending = [], [], [up]
    while pending:
        value = pending.pop()
        values.append(value)
        for reader in value.users:
            kind = _reader_kind(reader, value, depends)
            if kind is None:
                return None
            (pending if kind == "value" else downs).append(reader)
    return _Found(up, values, list(dict.fromkeys(downs))) if downs else None


def _reader_kind(reader: Node, value: Node, depends: set[Node]) -> str | None:
    """"value" for a homogeneous op whose output stays in the chain, "down" for a closing
    GEMM with a stored weight, None for anything else (the chain is then left alone)."""
    packet = _packet(reader)
    if packet in _HOMOGENEOUS:
        return "value" if reader.args[0] is value and _others_independent(
            reader, value, depends) else None
    if packet is aten.mul:
        operands = reader.args[:2]
        return "value" if operands.count(value) == 1 and _others_independent(
            reader, value, depends) else None
    if packet is aten.div:
        return "value" if reader.args[0] is value and _others_independent(
            reader, value, depends) else None
    positions = _GEMMS.get(packet)
    if positions and _arg(reader, positions[0]) is value \
            and list(reader.args).count(value) == 1 \
            and _stored_weight(_arg(reader, positions[1])) is not None:
        return "down"
    return None


def _others_independent(reader: Node, value: Node, depends: set[Node]) -> bool:
    """Whether every input of ``reader`` besides ``value`` is independent of the chain."""
    return all(a not in depends for a in reader.all_input_nodes if a is not value)


def _descendants(node: Node) -> set[Node]:
    seen, pending = {node}, [node]
    while pending:
        for user in pending.pop().users:
            if user not in seen:
                seen.add(user)
                pending.append(user)
    return seen


def _tensor(gm: torch.fx.GraphModule, node: Node) -> torch.Tensor | None:
    tensor = operator.attrgetter(node.target)(gm)
    return tensor if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 \
        else None


def _largest(gm: torch.fx.GraphModule, args) -> float | None:
    """max |entry| over the stored tensors behind ``args``; None where one is not float32."""
    largest = 0.0
    for arg in args:
        if arg is None:
            continue
        tensor = _tensor(gm, _stored_weight(arg)[0])
        if tensor is None:
            return None
        largest = max(largest, max_finite_magnitude(tensor))
    return largest


def _magnitudes(gm: torch.fx.GraphModule, found: _Found) -> Chain | None:
    up_positions = _GEMMS[_packet(found.up)]
    up = _largest(gm, [_arg(found.up, up_positions[1]), _arg(found.up, up_positions[2])])
    down = _largest(gm, [_arg(d, _GEMMS[_packet(d)][1]) for d in found.downs])
    if up is None or down is None:
        return None
    peak = max(float(v.meta.get(RANGE_META, 0.0)) for v in found.values)
    return Chain(peak, up, down)


def _apply(gm: torch.fx.GraphModule, found: _Found, k: int) -> None:
    up_positions = _GEMMS[_packet(found.up)]
    for position in up_positions[1:]:
        if _arg(found.up, position) is not None:
            _scale_weight(gm, found.up, position, 2.0 ** -k, "up")
    for down in found.downs:
        _scale_weight(gm, down, _GEMMS[_packet(down)][1], 2.0 ** k, "down")
    for value in found.values:
        if RANGE_META in value.meta:
            value.meta[RANGE_META] = value.meta[RANGE_META] * 2.0 ** -k


def _scale_weight(gm: torch.fx.GraphModule, gemm: Node, position: int, factor: float,
                  role: str) -> None:
    """``get_attr * factor`` right after the get_attr, read by this GEMM's path only (a tied
    weight's other readers keep the unscaled tensor)."""
    stored, layout = _stored_weight(gemm.args[position])
    reader = layout or gemm
    with gm.graph.inserting_after(stored):
        scaled = gm.graph.call_function(aten.mul.Tensor, (stored, factor))
    scaled.meta[RESCALE_TAG] = role
    scaled.meta[RANGE_META] = max_finite_magnitude(_tensor(gm, stored)) * factor
    if "nn_module_stack" in gemm.meta:  # keep_fp32 modules find it with its GEMM
        scaled.meta["nn_module_stack"] = gemm.meta["nn_module_stack"]
    reader.replace_input_with(stored, scaled)
