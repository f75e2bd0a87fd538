"""Pattern fusion before precision planning (docs/design.md §7): spelled-out chains → fused ATen kernels.

Each pass replaces a chain PyTorch has one kernel for, so the planner sees one op that computes
in fp32 registers where the chain needs an fp32 island and its casts (decision 0015). Rewrites
are exact in fp32 up to rounding order, keep ``nn_module_stack`` and tag the new node with
``meta[FUSED_TAG] = pattern``.

* ``FuseTanhGelu``: ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`` →
  ``gelu(x, approximate="tanh")`` (ATen and ``symbolic_trace`` spellings).
* ``FuseAttention``: ``softmax(q·kᵀ · scale + masks) · v`` with identity conversions and
  dropout between → ``scaled_dot_product_attention``; ``masked_fill(scores, m, v)`` becomes
  the additive mask ``where(m, v, 0)``, training dropout ``dropout_p``.
* ``FuseNorms``: spelled-out RMSNorm → ``rms_norm``, LayerNorm → ``layer_norm`` (last dim).

All work on ATen graphs; ``FuseTanhGelu`` also on ``symbolic_trace`` graphs.
"""
from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.subgraph_rewriter import replace_pattern_with_filters

from amp_rewrite.fx.opkeys import tensor_val
from amp_rewrite.fx.view import finished

aten = torch.ops.aten
FUSED_TAG = "amp_rewrite_fused"  # node.meta key: the pattern a fused node replaced
FUSED_FROM = "amp_rewrite_fused_from"  # node.meta key: the ops it replaced, for explain()
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_ASSERT_OPS = (aten._assert_tensor_metadata.default,)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    half_x = aten.mul.Tensor(x, 0.5)
    inner = aten.add.Tensor(x, aten.mul.Tensor(aten.pow.Tensor_Scalar(x, 3.0), 0.044715))
    tanh = aten.tanh.default(aten.mul.Tensor(inner, _SQRT_2_OVER_PI))
    return aten.mul.Tensor(half_x, aten.add.Tensor(tanh, 1.0))


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return aten.gelu.default(x, approximate="tanh")


def _gelu_new_traced(x: torch.Tensor) -> torch.Tensor:
    """``transformers.activations.NewGELUActivation.forward`` as symbolic_trace records it."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                       * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_tanh_traced(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


class FuseTanhGelu(PassBase):
    """The spelled-out tanh GELU → ``gelu(x, approximate="tanh")`` (module docstring).

    The fused node keeps the example value (``meta['val']``) of the chain it replaces.
    """

    def __init__(self) -> None:  # the ATen spelling and the symbolic_trace one
        self.patterns = [(_gelu_new, _gelu_tanh), (_gelu_new_traced, _gelu_tanh_traced)]

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        count = 0
        for pattern, replacement in self.patterns:
            replaced = replace_pattern_with_filters(graph_module, pattern, replacement,
                                                    ignore_literals=False)
            for match in replaced:
                # ``match.anchor`` is the pattern's node; the graph's own is in ``nodes_map``.
                # The fused gelu returns what the chain's last op did (x's shape and dtype):
                # it takes that node's meta, module path (keep_fp32 patterns) and example
                # value alike, so no fake propagation is needed.
                last = match.nodes_map[match.anchor]
                for new in match.replacements:
                    new.meta.update(last.meta)
                    new.meta[FUSED_TAG] = "tanh_gelu"
                    new.meta[FUSED_FROM] = "mul, pow, mul, add, mul, tanh, add, mul"
            count += len(replaced)
        return finished(graph_module, bool(count))


# --- helpers on ATen nodes ------------------------------------------------------------------

def _is(node: object, *targets: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _readers(node: Node) -> list[Node]:
    """Users that read the value (``_assert_tensor_metadata`` checks only look at it)."""
    return [u for u in node.users if u.target not in _ASSERT_OPS]


def _is_identity(node: Node) -> bool:
    """A conversion to the dtype the value already has, ``alias``, or dropout that is off."""
    if _is(node, aten.to.dtype, aten._to_copy.default, aten.alias.default, aten.clone.default):
        src, out = tensor_val(node.args[0]), tensor_val(node)
        extra = {k for k in node.kwargs if k not in ("dtype", "memory_format")}
        return (src is not None and out is not None and src.dtype == out.dtype
                and src.device == out.device and not extra)
    if _is(node, aten.dropout.default):
        return node.args[1] == 0 or node.args[2] is False
    return False


def _through_identities(node: Node) -> Node:
    """The value ``node`` reads, seen backwards through identity conversions."""
    while isinstance(node, Node) and _is_identity(node):
        node = node.args[0]
    return node


def _last_dim(dims: object, rank: int) -> bool:
    if isinstance(dims, int):
        dims = [dims]
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and dims[0] in (-1, rank - 1)


def _scalar(arg: object) -> float | None:
    return float(arg) if isinstance(arg, numbers.Real) and not isinstance(arg, bool) else None


def _scalar_operand(node: Node, *targets: object) -> tuple[Node, float] | None:
    """``(tensor, c)`` when ``node`` is ``target(tensor, c)`` or ``target(c, tensor)``."""
    if not _is(node, *targets) or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if isinstance(a, Node) and _scalar(b) is not None:
        return a, _scalar(b)
    if isinstance(b, Node) and _scalar(a) is not None and node.target is not aten.div.Tensor:
        return b, _scalar(a)
    return None


@dataclass
class _Match:
    """Matched nodes (erased after the rewrite) and the node whose value the fused op gives."""

    nodes: set[Node] = field(default_factory=set)
    output: Node | None = None
    optional: set[Node] = field(default_factory=set)  # erased only when nothing else reads them


def _private(match: _Match) -> bool:
    """No matched node other than the output is read outside the match."""
    return all(u in match.nodes for node in match.nodes - {match.output} for u in _readers(node))


def _replace(gm: torch.fx.GraphModule, match: _Match, target: Callable, args: tuple,
             kwargs: dict, pattern: str, build: Callable[[], tuple] | None = None) -> Node:
    """Insert ``target(*args, **kwargs)`` before the output, rewire, erase the match."""
    graph, out = gm.graph, match.output
    with graph.inserting_before(out):
        if build is not None:
            args, kwargs = build()
        fused = graph.call_function(target, args, kwargs)
    fused.meta.update({k: v for k, v in out.meta.items() if k != "val"})
    fused.meta[FUSED_TAG] = pattern
    fused.meta[FUSED_FROM] = ", ".join(sorted(str(n.target).split(".")[1] for n in match.nodes
                                              if n.op == "call_function"))
    out.replace_all_uses_with(fused)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(match.nodes | match.optional, key=order.__getitem__, reverse=True):
        if _readers(node):
            continue
        for check in list(node.users):
            graph.erase_node(check)
        graph.erase_node(node)
    return fused


# --- attention ------------------------------------------------------------------------------

_MATMULS = (aten.matmul.default, aten.bmm.default)


@dataclass
class _Scores:
    qk: Node  # the q·kᵀ matmul
    scale: float = 1.0
    masks: list[tuple[str, tuple]] = field(default_factory=list)  # ("add", (m,)) / ("fill", (m, v))


class _AnchoredFusion(PassBase):
    """A fusion that tries ``_fuse(gm, node)`` at every node calling one of ``anchors``."""

    anchors: tuple = ()

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        count = 0
        for node in list(graph_module.graph.nodes):
            # a node an earlier fusion erased is no longer in the graph
            if node.graph is graph_module.graph and _is(node, *self.anchors):
                count += self._fuse(graph_module, node)
        return finished(graph_module, bool(count))

    @abc.abstractmethod
    def _fuse(self, gm: torch.fx.GraphModule, anchor: Node) -> int:
        """Rewrite the pattern rooted at ``anchor``; 1 if fused, else 0."""


class FuseAttention(_AnchoredFusion):
    """``softmax(q·kᵀ·scale + masks)·v`` → ``scaled_dot_product_attention`` (module docstring)."""

    anchors = (aten.softmax.int, aten._softmax.default)

    def _fuse(self, gm: torch.fx.GraphModule, softmax: Node) -> int:
        match = _Match({softmax})
        scores_in, val = softmax.args[0], tensor_val(softmax)
        if val is None or not val.is_floating_point() or not _last_dim(softmax.args[1], val.dim()):
            return 0
        if tensor_val(scores_in) is None or tensor_val(scores_in).dtype != val.dtype:
            return 0
        pv, dropout_p = self._probs_to_matmul(softmax, match)
        if pv is None:
            return 0
        scores = self._scores(scores_in, match)
        if scores is None:
            return 0
        q, k_t, v = scores.qk.args[0], scores.qk.args[1], pv.args[1]
        if not self._shapes_fit(q, k_t, v, val.dtype):
            return 0
        match.output = pv
        if not _private(match):
            return 0

        def build() -> tuple:
            key = self._untransposed(gm, k_t)
            mask = self._mask(gm, scores.masks)
            return (q, key, v), {"attn_mask": mask, "dropout_p": dropout_p,
                                 "scale": scores.scale}

        _replace(gm, match, aten.scaled_dot_product_attention.default, (), {}, "attention",
                 build)
        return 1

    @staticmethod
    def _probs_to_matmul(softmax: Node, match: _Match) -> tuple[Node | None, float]:
        """Forward from softmax through identities/dropout to the ``probs · v`` matmul."""
        node, dropout_p = softmax, 0.0
        while True:
            readers = _readers(node)
            if len(readers) != 1:
                return None, 0.0
            user = readers[0]
            if _is(user, *_MATMULS) and user.args[0] is node:
                match.nodes.add(user)
                return user, dropout_p
            if _is(user, aten.dropout.default) and not _is_identity(user) and dropout_p == 0:
                dropout_p = float(user.args[1])
            elif not _is_identity(user):
                return None, 0.0
            match.nodes.add(user)
            node = user

    def _scores(self, node: Node, match: _Match) -> _Scores | None:
        """Backward from the softmax input: masks (outermost), then scale, then q·kᵀ."""
        if not isinstance(node, Node) or tensor_val(node) is None:
            return None
        match.nodes.add(node)
        if _is(node, *_MATMULS):
            return _Scores(node)
        if _is_identity(node):
            return self._scores(node.args[0], match)
        scaled = _scalar_operand(node, aten.mul.Tensor, aten.div.Tensor)
        if scaled is not None:
            inner = self._scores(scaled[0], match)
            if inner is None or inner.masks:  # (s + m) * c scales the mask too
                return None
            inner.scale *= scaled[1] if node.target is aten.mul.Tensor else 1.0 / scaled[1]
            return inner
        if _is(node, aten.add.Tensor) and len(node.args) == 2 and not node.kwargs:
            return self._masked(node, match)
        if _is(node, aten.masked_fill.Scalar):
            inner = self._scores(node.args[0], match)
            if inner is not None:
                inner.masks.append(("fill", (node.args[1], node.args[2])))
            return inner
        return None

    def _masked(self, add: Node, match: _Match) -> _Scores | None:
        for scores, mask in (add.args, add.args[::-1]):
            if not isinstance(mask, Node) or tensor_val(mask) is None:
                continue
            if tensor_val(mask).dtype != tensor_val(add).dtype:
                continue
            trial = _Match(set(match.nodes))
            inner = self._scores(scores, trial)
            if inner is not None:
                match.nodes |= trial.nodes
                inner.masks.append(("add", (mask,)))
                return inner
        return None

    @staticmethod
    def _shapes_fit(q: object, k_t: object, v: object, dtype: torch.dtype) -> bool:
        vals = [tensor_val(x) for x in (q, k_t, v)]
        if any(x is None or x.dtype != dtype or x.dim() < 3 for x in vals):
            return False
        qv, kv, vv = vals
        same_rank = qv.dim() == kv.dim() == vv.dim()
        return (same_rank and qv.shape[:-2] == kv.shape[:-2] == vv.shape[:-2]
                and qv.shape[-1] == kv.shape[-2] and kv.shape[-1] == vv.shape[-2])

    @staticmethod
    def _untransposed(gm: torch.fx.GraphModule, k_t: Node) -> Node:
        """``k`` from ``kᵀ``: the transpose's input when it swaps the last two dims."""
        rank = tensor_val(k_t).dim()
        if _is(k_t, aten.transpose.int):
            dims = {d % rank for d in k_t.args[1:3]}
            if dims == {rank - 2, rank - 1}:
                return k_t.args[0]
        return gm.graph.call_function(aten.transpose.int, (k_t, -2, -1))

    @staticmethod
    def _mask(gm: torch.fx.GraphModule, masks: list[tuple[str, tuple]]) -> Node | None:
        """One additive mask from the added masks and the masked fills, in graph order."""
        total = None
        for kind, args in masks:
            term = (gm.graph.call_function(aten.where.Scalar, (args[0], args[1], 0.0))
                    if kind == "fill" else args[0])
            total = term if total is None else gm.graph.call_function(aten.add.Tensor,
                                                                       (total, term))
        return total


# --- norms ----------------------------------------------------------------------------------

class FuseNorms(_AnchoredFusion):
    """Spelled-out RMSNorm → ``rms_norm``, LayerNorm → ``layer_norm`` (module docstring)."""

    anchors = (aten.rsqrt.default, aten.sqrt.default)

    def _fuse(self, gm: torch.fx.GraphModule, root: Node) -> int:
        """``root`` is ``rsqrt(var + eps)`` or ``sqrt(var + eps)``."""
        match = _Match({root})
        stats = self._statistics(root.args[0], match)
        if stats is None:
            return 0
        centred, eps = stats
        x, mean = self._centre(centred, match)
        normed = self._normalised(root, centred, mean, match)
        if normed is None:
            return 0
        weight, bias, out = self._affine(normed, match, allow_bias=mean is not None)
        x_val, out_val = tensor_val(x), tensor_val(out)
        if x_val is None or out_val is None or x_val.dtype != out_val.dtype:
            return 0
        if x_val.shape != out_val.shape or not x_val.is_floating_point():
            return 0
        match.output = out
        if not _private(match):
            return 0
        shape = [x_val.shape[-1]]
        if mean is None:
            _replace(gm, match, aten.rms_norm.default, (x, shape, weight, eps), {}, "rms_norm")
        else:
            _replace(gm, match, aten.layer_norm.default, (x, shape, weight, bias, eps), {},
                     "layer_norm")
        return 1

    @staticmethod
    def _statistics(node: Node, match: _Match) -> tuple[Node, float] | None:
        """``mean(t², -1, keepdim) + eps`` → ``(t, eps)``."""
        added = _scalar_operand(node, aten.add.Tensor, aten.add.Scalar)
        if added is None:
            return None
        mean, eps = added
        if not _is(mean, aten.mean.dim) or tensor_val(mean) is None:
            return None
        if not _last_dim(mean.args[1], tensor_val(mean).dim()) or not _keepdim(mean):
            return None
        square = mean.args[0]
        t = _squared(square)
        if t is None:
            return None
        match.nodes |= {node, mean, square}
        return t, eps

    @staticmethod
    def _centre(t: Node, match: _Match) -> tuple[Node, Node | None]:
        """``t = x - mean(x, -1, keepdim)`` → ``(x, mean)``; else ``(t, None)`` (RMS)."""
        if _is(t, aten.sub.Tensor) and len(t.args) == 2 and not t.kwargs:
            x, mean = t.args
            if (_is(mean, aten.mean.dim) and mean.args[0] is x and tensor_val(mean) is not None
                    and _last_dim(mean.args[1], tensor_val(mean).dim()) and _keepdim(mean)):
                match.nodes |= {t, mean}
                return x, mean
        return t, None  # the model's own conversion stays the input: its fp32 request holds

    @staticmethod
    def _normalised(root: Node, centred: Node, mean: Node | None, match: _Match) -> Node | None:
        """The one reader of ``root`` that divides (sqrt) or multiplies (rsqrt) the input."""
        readers = _readers(root)
        if len(readers) != 1:
            return None
        user = readers[0]
        if root.target is aten.sqrt.default:
            ok = _is(user, aten.div.Tensor) and user.args[1] is root
            operand = user.args[0] if ok else None
        else:
            ok = _is(user, aten.mul.Tensor) and root in user.args and len(user.args) == 2
            operand = (user.args[1] if user.args[0] is root else user.args[0]) if ok else None
        if not ok or not isinstance(operand, Node):
            return None
        if mean is None:
            if _through_identities(operand) is not _through_identities(centred):
                return None
            match.optional |= {n for n in (operand,) if _is_identity(n) and n is not centred}
        elif operand is not centred:
            if not (_is(operand, aten.sub.Tensor) and operand.args == centred.args):
                return None
            match.nodes.add(operand)
        match.nodes.add(user)
        return user

    @staticmethod
    def _affine(normed: Node, match: _Match, allow_bias: bool
                ) -> tuple[Node | None, Node | None, Node]:
        """Optional identity conversion, ``* w`` and (layer norm) ``+ b`` over the last dim."""
        node, weight, bias = normed, None, None
        size = tensor_val(normed).shape[-1] if tensor_val(normed) is not None else None
        while True:
            readers = _readers(node)
            if len(readers) != 1:
                return weight, bias, node
            user = readers[0]
            if _is_identity(user) and weight is None:
                match.nodes.add(user)
                node = user
                continue
            other = _vector_operand(user, node, size)
            if other is None or tensor_val(user) is None or tensor_val(user).shape != tensor_val(node).shape:
                return weight, bias, node
            if weight is None and bias is None and user.target is aten.mul.Tensor:
                weight = other
            elif allow_bias and bias is None and user.target is aten.add.Tensor:
                bias = other
            else:
                return weight, bias, node
            match.nodes.add(user)
            node = user


def _keepdim(mean: Node) -> bool:
    return (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)) is True


def _squared(node: Node) -> Node | None:
    if (_is(node, aten.pow.Tensor_Scalar) and node.args[1] == 2) or _is(node, aten.square.default):
        return node.args[0]
    if _is(node, aten.mul.Tensor) and len(node.args) == 2 and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _vector_operand(user: Node, node: Node, size: int | None) -> Node | None:
    """The other operand of a binary mul/add when it is a vector over the last dim."""
    if not _is(user, aten.mul.Tensor, aten.add.Tensor) or len(user.args) != 2 or user.kwargs:
        return None
    other = user.args[1] if user.args[0] is node else user.args[0]
    val = tensor_val(other)
    if val is None or val.dim() != 1 or val.shape[0] != size or other is node:
        return None
    return other
