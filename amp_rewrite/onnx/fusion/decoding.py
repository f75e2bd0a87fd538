"""Rotary embeddings as transformers 5 exports them → ``com.microsoft::RotaryEmbedding``.

onnxscript's ``cos_sin_cache`` wants the angles as ``MatMul(inv_freq[1, E, 1], positions)``
followed by ``Transpose(0, 2, 1)``; the dynamo export of transformers 5 writes the product
over the size-1 dimension as ``Mul(Cast(Unsqueeze(position_ids, -1)), inv_freq[E])``, so that
rule (and ``gqa`` after it) never matches (docs/decisions/0031b-llm-decoding.md). This rule
matches the rotation itself, whatever computes the angles::

    f    = <angles>                       # (B, S, E), E = D/2, any producer
    emb  = Concat(f, f, axis=-1)
    cos4 = Unsqueeze(Cos(emb), [1])       # sin4 likewise
    y    = x·cos4 + Concat(-x[..., E:], x[..., :E])·sin4      # x: (B, H, S, D)

and writes ``RotaryEmbedding(x, position_ids, cos_cache, sin_cache)`` with per-token caches
computed in the graph from the same angles: ``cos_cache = Cos(Reshape(f, [-1, E]))`` (B·S
rows) and ``position_ids = Reshape(Range(0, B·S), [B, S])``, so row ``b·S + s`` is token
(b, s)'s own angle. The angles and Cos/Sin stay as they were (fp32 under the plan, their
outputs bounded); only the cache is cast to the op's type. One cache per angle tensor, shared
by every layer's Q and K.
"""
from __future__ import annotations

import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

MS_DOMAIN = "com.microsoft"


def _same_dim(a, b) -> bool:
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return a is not None and b is not None and a.value is not None and a.value == b.value


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
        return None
    return node


def _int_attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else attr.as_int()


class RotaryHalfFusion(pattern.RewriteRuleClassBase):
    """Half-split (non-interleaved) RoPE with per-token cos/sin → ORT RotaryEmbedding."""

    def __init__(self) -> None:
        super().__init__("amp_rewrite.RotaryEmbedding")
        self._caches: dict[ir.Value, tuple[ir.Value, ir.Value, ir.Value]] = {}
        self._angles: ir.Value | None = None

    def pattern(self, op, x, cos4, sin4, start1, end1, axes1, steps1, start2, end2, axes2,
                steps2):
        x1 = op.Slice(x, start1, end1, axes1, steps1)
        x2 = op.Slice(x, start2, end2, axes2, steps2)
        rotated = op.Concat(op.Neg(x2), x1, axis=-1)
        return op.Add(op.Mul(x, cos4), op.Mul(rotated, sin4))

    def check(self, context, x, cos4, sin4, start1, end1, axes1, steps1, start2, end2, axes2,
              steps2, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[3], int):
            return result.fail("x is not 4-D with a known head size", x)
        head = x.shape[3]
        if head % 2:
            return result.fail("odd head size", x)
        half = head // 2
        for axes, steps in ((axes1, steps1), (axes2, steps2)):
            if not (_ir_utils.is_singleton_value(axes, 3) or _ir_utils.is_singleton_value(axes, -1)):
                return result.fail("slice is not on the last axis", axes)
            if not _ir_utils.is_singleton_value(steps, 1):
                return result.fail("slice step is not 1", steps)
        if not (_ir_utils.is_singleton_value(start1, 0)
                and _ir_utils.is_singleton_value(end1, half)
                and _ir_utils.is_singleton_value(start2, half)
                and _ir_utils.is_singleton_value(end2, lambda v: v >= head)):
            return result.fail("x is not split into two halves")
        emb = None
        for value, trig in ((cos4, "Cos"), (sin4, "Sin")):
            unsq = _producer(value, "Unsqueeze")
            if unsq is None or len(unsq.inputs) < 2 or not _ir_utils.is_singleton_value(
                    unsq.inputs[1], 1):
                return result.fail(f"{trig} table is not Unsqueeze(., [1])", value)
            node = _producer(unsq.inputs[0], trig)
            if node is None:
                return result.fail(f"no {trig} under the table", value)
            if emb is not None and node.inputs[0] is not emb:
                return result.fail("cos and sin read different angles", value)
            emb = node.inputs[0]
        concat = _producer(emb, "Concat")
        if concat is None or len(concat.inputs) != 2 or concat.inputs[0] is not concat.inputs[1]:
            return result.fail("angles are not Concat(f, f)", emb)
        f = concat.inputs[0]
        if f.shape is None or len(f.shape) != 3:
            return result.fail("half angles are not 3-D", f)
        if _int_attr(concat, "axis", 0) not in (-1, 2):
            return result.fail("angles not concatenated on the last axis", emb)
        if not _same_dim(f.shape[2], half):
            return result.fail("half angles' width is not head_size / 2", f)
        # (B, S) of the angles must be x's own batch and sequence (no broadcast).
        if not (_same_dim(f.shape[0], x.shape[0]) and _same_dim(f.shape[1], x.shape[2])):
            return result.fail("angles' (batch, sequence) are not x's", f)
        if f.dtype is None or f.dtype != x.dtype:
            return result.fail("angles and x differ in dtype", f)
        self._angles = f
        return result

    def _cache(self, op, f: ir.Value, half: int):
        if f not in self._caches:
            batch_seq = op.Shape(f, start=0, end=2)
            rows = op.ReduceProd(batch_seq, keepdims=0)
            ids = op.Range(op.Constant(value_int=0), rows, op.Constant(value_int=1))
            position_ids = op.Reshape(ids, batch_seq)
            rows_f = op.Reshape(f, op.Constant(value_ints=[-1, half]))  # (B·S, E)
            cos_cache, sin_cache = op.Cos(rows_f), op.Sin(rows_f)
            self._caches[f] = (position_ids, cos_cache, sin_cache)
        return self._caches[f]

    def rewrite(self, op, x, **_):
        f, self._angles = self._angles, None
        position_ids, cos_cache, sin_cache = self._cache(op, f, x.shape[3] // 2)
        return op.RotaryEmbedding(x, position_ids, cos_cache, sin_cache, interleaved=0,
                                  _domain=MS_DOMAIN)

    def cleanup(self) -> None:
        self._caches.clear()
        self._angles = None


def rotary_rules():
    return pattern.RewriteRuleSet([RotaryHalfFusion.rule()])


def has_rotary_tables(nodes: list[ir.Node]) -> bool:
    """Whether some Cos output reaches a Mul through an Unsqueeze (the RoPE table)."""
    for node in nodes:
        if node.op_type == "Cos":
            for use in node.outputs[0].uses():
                if use.node.op_type == "Unsqueeze" and any(
                        u.node.op_type == "Mul" for u in use.node.outputs[0].uses()):
                    return True
    return False
