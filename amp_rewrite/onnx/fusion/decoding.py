"""Rotary embeddings as transformers 5 exports them → ``com.microsoft::RotaryEmbedding``
(``--target ort``) or ONNX ``RotaryEmbedding``-23 (``--target onnx``); KV-cache attention →
``com.microsoft::GroupQueryAttention`` or ONNX ``Attention``-23 with past/present (below).

onnxscript's rotary rule does not match these exports (decision 0031b). This rule matches the
rotation itself, whatever computes the angles::

    f    = <angles>                       # (B, S, E), E = D/2, any producer
    emb  = Concat(f, f, axis=-1)
    cos4 = Unsqueeze(Cos(emb), [1])       # sin4 likewise
    y    = x·cos4 + Concat(-x[..., E:], x[..., :E])·sin4      # x: (B, H, S, D)

and writes ``RotaryEmbedding(x, position_ids, cos_cache, sin_cache)`` with per-token caches
from the same angles (``cos_cache = Cos(Reshape(f, [-1, E]))``, ``position_ids =
Reshape(Range(0, B·S), [B, S])``), one cache per angle tensor, shared by every layer's Q and K.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern

from amp_rewrite.onnx.fusion.canonical import constant_array as _const

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
    """Half-split (non-interleaved) RoPE with per-token cos/sin → RotaryEmbedding.

    Only the written op differs by target: ``"ort"`` writes the contrib op with (B·S, E)
    caches and ``position_ids = arange(B·S)``; ``"onnx"`` writes ``RotaryEmbedding``-23
    ``(x, Cos(f), Sin(f))`` on the per-token (B, S, E) tables themselves."""

    def __init__(self, target: str = "ort") -> None:
        super().__init__("amp_rewrite.RotaryEmbedding" + ("" if target == "ort" else ".onnx"))
        self.target = target
        self._caches: dict[ir.Value, tuple[ir.Value | None, ir.Value, ir.Value]] = {}
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
        if f not in self._caches and self.target == "onnx":
            self._caches[f] = (None, op.Cos(f), op.Sin(f))  # (B, S, E): per-token tables
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
        if self.target == "onnx":
            return op.RotaryEmbedding(x, cos_cache, sin_cache, interleaved=0)
        return op.RotaryEmbedding(x, position_ids, cos_cache, sin_cache, interleaved=0,
                                  _domain=MS_DOMAIN)

    def cleanup(self) -> None:
        self._caches.clear()
        self._angles = None


def rotary_rules(target: str = "ort"):
    return pattern.RewriteRuleSet([RotaryHalfFusion.rule(target)])


def has_rotary_tables(nodes: list[ir.Node]) -> bool:
    """Whether some Cos output reaches a Mul through an Unsqueeze (the RoPE table)."""
    return any(use.node.op_type == "Unsqueeze"
               and any(u.node.op_type == "Mul" for u in use.node.outputs[0].uses())
               for node in nodes if node.op_type == "Cos" for use in node.outputs[0].uses())


# ------------------------------------------------------------------ GroupQueryAttention
#
# The attention block of a transformers 5 GQA decoder (SDPA, dynamo export) after the rotary
# and key-transpose steps, per layer:
#
#     k_all = Concat(past_key, k, axis=-2)              # present.{i}.key (decode only)
#     k_rep = Reshape(Expand(Unsqueeze(k_all, [2]), (B, Hkv, G, T, D)), (B, Hkv·G, T, D))
#     p     = Softmax(Mul(q, a) @ Mul(Transpose(k_rep, (0, 1, 3, 2)), b) + mask)
#             (attn_implementation="eager": Softmax(Mul(q @ Transpose(k_rep, ..), a) + mask))
#     p     = Where(IsNaN(p), 0, p)                       # optional NaN guard
#     y     = Reshape(Transpose([Reshape](p @ v_rep), (0, 2, 1, 3)), (B, S, H·D))
#
# with ``mask = Where(causal ∧ padding, 0, fill)``, built from the 2-D ``attention_mask``:
#
#     kv      = Unsqueeze…(Range(0, mask.shape[1], 1))               # (1, 1, 1, T) key index
#     qpos    = Unsqueeze…(Add(arange(S), past_key.shape[2]))        # (1, 1, S, 1); prefill:
#               Range(0, mask.shape[1], 1) with S = T
#     causal  = LessOrEqual(kv, qpos)
#     bidx    = Unsqueeze…(Range(0, mask.shape[0], 1))               # (B, 1, 1, 1)
#     padding = GatherND(Cast(attention_mask, BOOL), Concat(Unsqueeze(Expand(bidx, s), -1),
#                                    Unsqueeze(Expand(kv, s), -1), axis=-1))  # s = bcast shape
#
# The rule proves each of these from the graph (declining otherwise) and writes one
# ``GroupQueryAttention(q, k, v, past_key, past_value, seqlens_k, total_sequence_length,
# attention_bias=Where(causal ∧ padding, 0, -65504))`` in BSD, ``do_rotary=0``, whose present
# outputs replace the Concats, so the head repeat and the explicit cache Concat go.
# ``seqlens_k = T − 1`` on every row (int32) and ``total_sequence_length = T =
# attention_mask.shape[1]`` (int32 scalar): GQA appends the S new K/V rows after the whole
# past, as the export's Concat does, and sees keys [0, T) causally; the bias hides the padding
# wherever it sits (left, right or gaps), so the fused graph equals the export for every
# mask. GQA's other convention (seqlens_k = valid length − 1, no bias) holds for right padding
# only; left-padded prompts, how transformers batches prompts for generation, came out wrong.

_FLOAT_MIN = -1e30  # an additive mask fill this low underflows exp to exactly 0
# GQA's attention_bias fill: float16's lowest, finite in every dtype the plan may give the
# bias (-1e30 would round to -inf in float16, and a row with no valid key to NaN), and still
# low enough that exp(score + fill) is exactly 0
_BIAS_FILL = -65504.0


def _cache_and_repeat_kv(op, with_past, k_new, v_new, past_key, past_value, unsq_k, unsq_v,
                         expand_k, expand_v, shape_k, shape_v):
    """The pattern of the cache Concat (decode step) and transformers' ``repeat_kv`` of K and V,
    shared by the GroupQueryAttention and the opset-23 Attention rules."""
    if with_past:
        k_all = op.Concat(past_key, k_new, axis=-2, _outputs=["k_all"])
        v_all = op.Concat(past_value, v_new, axis=-2, _outputs=["v_all"])
    else:
        k_all, v_all = k_new, v_new
    k_rep = op.Reshape(op.Expand(op.Unsqueeze(k_all, unsq_k), expand_k), shape_k,
                       _outputs=["k_rep"])
    v_rep = op.Reshape(op.Expand(op.Unsqueeze(v_all, unsq_v), expand_v), shape_v,
                       _outputs=["v_rep"])
    return k_all, v_all, k_rep, v_rep


def _through_unsqueeze(value: ir.Value | None) -> ir.Value | None:
    """The value under a chain of Unsqueezes (which only add size-1 axes)."""
    while value is not None:
        node = _producer(value, "Unsqueeze")
        if node is None:
            return value
        value = node.inputs[0]
    return None


def _is_range_from_zero(value: ir.Value | None) -> ir.Node | None:
    """``Range(0, limit, 1)``'s node, else None."""
    node = _producer(value, "Range")
    if node is None or len(node.inputs) != 3:
        return None
    start, delta = _const(node.inputs[0]), _const(node.inputs[2])
    if start is None or delta is None or start.size != 1 or delta.size != 1:
        return None
    return node if int(start.ravel()[0]) == 0 and int(delta.ravel()[0]) == 1 else None


def _dim_of(value: ir.Value | None) -> tuple[ir.Value, int] | None:
    """``(source, axis)`` when ``value`` is ``Squeeze(Shape(source, axis:axis+1))`` (a 0-d or
    1-element dimension of ``source``), else None."""
    node = _producer(value, "Squeeze")
    if node is not None:
        value = node.inputs[0]
    shape = _producer(value, "Shape")
    if shape is None or shape.inputs[0] is None or shape.inputs[0].shape is None:
        return None
    rank = len(shape.inputs[0].shape)
    start = _int_attr(shape, "start", 0) % rank if rank else 0
    end = _int_attr(shape, "end", rank)
    end = min(end + rank if end < 0 else end, rank)
    return (shape.inputs[0], start) if end == start + 1 else None


def _shape_is(value: ir.Value | None, dims: list) -> bool:
    """Whether ``value``'s static shape is ``dims`` (ints or symbolic dims/names)."""
    if value is None or value.shape is None or len(value.shape) != len(dims):
        return False
    return all(_same_dim(a, b) for a, b in zip(value.shape, dims))


def _repeat_kv_fail(unsq: ir.Value, rep: ir.Value, q: ir.Value, kv_heads: int, total) -> str:
    """Why ``rep = Reshape(Expand(Unsqueeze(kv, unsq), .), .)`` is not transformers'
    ``repeat_kv`` of a (B, Hkv, T, D) cache for (B, H, S, D) queries, else "".

    repeat_kv: (B, Hkv, T, D) -> (B, Hkv, 1, T, D) -> (B, Hkv, G, T, D) -> (B, H, T, D), so
    query head h reads KV head h // G: GroupQueryAttention's grouping and ONNX Attention's
    (``np.repeat`` over the head axis) alike."""
    batch, heads, _, head = q.shape
    axes = _const(unsq)
    if axes is None or axes.ravel().tolist() != [2]:
        return "head repeat does not unsqueeze axis 2"
    expand = rep.producer().inputs[0]
    if not _shape_is(expand, [batch, kv_heads, heads // kv_heads, total, head]):
        return "head repeat does not expand to (B, Hkv, G, T, D)"
    if not _shape_is(rep, [batch, heads, total, head]):
        return "head repeat does not reshape to (B, H, T, D)"
    return ""


def _kv_cache_fail(context, q, k_new, v_new, k_all, v_all, unsq_k, unsq_v, k_rep, v_rep,
                   past_key=None, past_value=None) -> tuple[str, ir.Value | None]:
    """The checks both KV-cache attention rules share (GQA for ``--target ort``, ONNX
    Attention-23 for ``--target onnx``): q (B, H, S, D) with known H and D, new k/v
    (B, Hkv, S, D), the cache ``k_all``/``v_all`` (B, Hkv, T, D) = Concat(past, new) with
    ``past_*`` (B, Hkv, P, D) graph inputs (decode; None: prompt, cache = new), one dtype,
    and ``repeat_kv`` on both. ("", None) when all hold, else (why, where)."""
    if q.shape is None or len(q.shape) != 4 or not all(
            isinstance(d, int) for d in (q.shape[1], q.shape[3])):
        return "query is not (B, H, S, D) with known H, D", q
    batch, heads, seq, head = q.shape
    for value in (k_new, v_new, k_all, v_all):
        if value.shape is None or len(value.shape) != 4 or not isinstance(value.shape[1], int):
            return "key/value are not (B, Hkv, T, D) with known Hkv", value
    kv_heads = k_new.shape[1]
    if heads % kv_heads or v_new.shape[1] != kv_heads:
        return "query heads are not a multiple of the KV heads", k_new
    if not (_shape_is(k_new, [batch, kv_heads, seq, head])
            and _shape_is(v_new, [batch, kv_heads, seq, head])):
        return "new key/value are not (B, Hkv, S, D)", k_new
    total = k_all.shape[2]
    if past_key is not None or past_value is not None:
        for past in (past_key, past_value):
            if past is None or past not in context.graph_or_function.inputs or not _shape_is(
                    past, [batch, kv_heads, past.shape[2], head]):
                return "past key/value are not (B, Hkv, P, D) graph inputs", past
    if q.dtype is None or any(v.dtype != q.dtype for v in (k_new, v_new)):
        return "q, k, v differ in dtype", q
    for unsq, rep in ((unsq_k, k_rep), (unsq_v, v_rep)):
        why = _repeat_kv_fail(unsq, rep, q, kv_heads, total)
        if why:
            return why, rep
    if not _same_dim(v_all.shape[2], total):
        return "key and value lengths differ", v_all
    return "", None


class _MaskProof:
    """Proves ``mask`` (additive, (B|1, 1, S, T)) is exactly causal-with-past ∧ the padding
    of a 2-D ``attention_mask`` graph input; ``fail`` says why not."""

    def __init__(self, graph_inputs, q: ir.Value, past_key: ir.Value | None) -> None:
        self.inputs = graph_inputs
        self.q = q
        self.past_key = past_key
        self.attention_mask: ir.Value | None = None
        self.condition: ir.Value | None = None  # the proven causal ∧ padding (bool)
        self.fail = ""

    def _no(self, why: str) -> None:
        self.fail = why

    def prove(self, mask: ir.Value) -> bool | None:
        """True when ``mask`` is proven; else None, and ``fail`` says why."""
        where = _producer(mask, "Where")
        if where is None:
            return self._no("mask is not Where(cond, 0, fill)")
        cond, zero, fill = where.inputs
        zero, fill = _const(zero), _const(fill)
        if zero is None or fill is None or zero.size != 1 or fill.size != 1:
            return self._no("mask values are not constants")
        if float(zero.ravel()[0]) != 0.0 or not float(fill.ravel()[0]) <= _FLOAT_MIN:
            return self._no("mask is not 0 where allowed and <= -1e30 elsewhere")
        self.condition = cond
        leaves: list[ir.Value] = []
        stack = [cond]
        while stack:
            value = stack.pop()
            node = _producer(value, "And")
            if node is not None:
                stack.extend(node.inputs)
                continue
            const = _const(value)
            if const is not None and const.dtype == np.bool_ and bool(const.all()):
                continue  # And with all-true: a no-op
            leaves.append(value)
        if len(leaves) != 2:
            return self._no(f"mask condition has {len(leaves)} terms, not causal and padding")
        for first, second in (leaves, leaves[::-1]):
            kv = self._causal(first)
            if kv is not None:
                return self._padding(second, kv)
        return self._no(self.fail or "no causal term in the mask")

    def _mask_dim(self, value: ir.Value | None, axis: int) -> bool:
        """Whether ``value`` is ``attention_mask.shape[axis]``: read from the mask itself, or
        (once the mask is known) from another graph input whose dimension carries the same
        symbolic dim, which the exporter proved equal (it takes the batch size from whichever
        input it likes: a deeper export reads it off ``past_key_values.6.value``)."""
        dim = _dim_of(value)
        if dim is None:
            return False
        source, source_axis = dim
        if self.attention_mask is None:
            if source_axis != axis or source not in self.inputs or source.shape is None \
                    or len(source.shape) != 2:
                return False
            self.attention_mask = source
        if source is self.attention_mask:
            return source_axis == axis
        mask_dim = self.attention_mask.shape[axis]
        return (source.is_graph_input() and source.shape is not None
                and not isinstance(mask_dim, int)
                and _same_dim(source.shape[source_axis], mask_dim))

    def _causal(self, value: ir.Value) -> ir.Value | None:
        node = _producer(value, "LessOrEqual")
        if node is None:
            return self._no("no LessOrEqual(key index, query position) in the mask")
        kv, qpos = node.inputs
        kv_range = _is_range_from_zero(_through_unsqueeze(kv))
        if kv_range is None or not self._mask_dim(kv_range.inputs[1], 1):
            return self._no("key index is not Range(0, attention_mask.shape[1])")
        total = self.attention_mask.shape[1]
        if not _shape_is(kv, [1, 1, 1, total]):
            return self._no("key index is not on the last axis")
        s = self.q.shape[2]
        if not _shape_is(qpos, [1, 1, s, 1]):
            return self._no("query position is not on the query axis")
        positions = _through_unsqueeze(qpos)
        if self.past_key is None:  # prompt: positions 0..S-1 with S = T
            if not _same_dim(s, total):
                return self._no("prompt query length is not attention_mask.shape[1]")
            if positions is not kv_range.outputs[0] and not (
                    _is_range_from_zero(positions) is not None
                    and self._mask_dim(_is_range_from_zero(positions).inputs[1], 1)):
                return self._no("query positions are not Range(0, T)")
            return kv
        add = _producer(positions, "Add")
        if add is None:
            return self._no("query positions are not arange(S) + past length")
        for arange, past in (add.inputs, add.inputs[::-1]):
            dim = _dim_of(past)
            if dim is None or dim[1] != 2 or dim[0] not in self.inputs:
                continue
            source = dim[0]
            if source.shape is None or len(source.shape) != 4 or not _same_dim(
                    source.shape[2], self.past_key.shape[2]):
                continue
            const = _const(arange)
            if const is not None and const.ravel().tolist() == list(range(const.size)) \
                    and _same_dim(s, const.size):
                return kv
            rng = _is_range_from_zero(arange)
            if rng is not None:
                dim = _dim_of(rng.inputs[1])
                if dim is not None and dim[0].shape is not None and _same_dim(
                        dim[0].shape[dim[1]], s):
                    return kv
        return self._no("query positions are not arange(S) + past length")

    def _padding(self, value: ir.Value, kv: ir.Value) -> bool | None:
        gather = _producer(value, "GatherND")
        if gather is None or _int_attr(gather, "batch_dims", 0) != 0:
            return self._no("padding term is not GatherND(attention_mask, (b, key))")
        data, index = gather.inputs
        cast = _producer(data, "Cast")
        if cast is None or cast.inputs[0] is not self.attention_mask or _int_attr(
                cast, "to", 0) != ir.DataType.BOOL:
            return self._no("padding term does not read Cast(attention_mask, bool)")
        concat = _producer(index, "Concat")
        if concat is None or len(concat.inputs) != 2 or _int_attr(concat, "axis", 0) != -1:
            return self._no("padding index is not Concat(batch, key, axis=-1)")
        parts = []
        for part in concat.inputs:
            unsq = _producer(part, "Unsqueeze")
            axes = _const(unsq.inputs[1]) if unsq is not None and len(unsq.inputs) > 1 else None
            expand = _producer(unsq.inputs[0], "Expand") if unsq is not None else None
            if axes is None or axes.ravel().tolist() != [-1] or expand is None:
                return self._no("padding index parts are not Unsqueeze(Expand(.), -1)")
            parts.append(expand)
        (eb, ek) = parts
        if ek.inputs[0] is not kv or eb.inputs[1] is not ek.inputs[1]:
            return self._no("padding index does not use the causal key index")
        bidx = eb.inputs[0]
        brange = _is_range_from_zero(_through_unsqueeze(bidx))
        if brange is None or not self._mask_dim(brange.inputs[1], 0):
            return self._no("batch index is not Range(0, attention_mask.shape[0])")
        if not _shape_is(bidx, [self.attention_mask.shape[0], 1, 1, 1]):
            return self._no("batch index is not on the batch axis")
        shape = _producer(eb.inputs[1], "Shape")
        joint = _producer(shape.inputs[0], "Max") if shape is not None else None
        if (joint is None or _int_attr(shape, "start", 0) != 0 or shape.attributes.get("end")
                is not None or {id(v) for v in joint.inputs} != {id(bidx), id(kv)}):
            return self._no("padding index is not expanded to the broadcast shape")
        return True


class _KVCacheRule(pattern.RewriteRuleClassBase):
    """A cache-aware attention rule: ``with_past`` matches the decode step, whose cache
    Concats become the fused op's present outputs; without it, the prompt."""

    def __init__(self, name: str, with_past: bool) -> None:
        # remove_nodes=False: the key-transpose step leaves its dead shape computations
        # reading the head repeat until the pass's final cleanup (which drops the matched
        # nodes too); a live outside reader simply keeps its value.
        super().__init__(name + ("" if with_past else ".prompt"), remove_nodes=False)
        self.with_past = with_past
        self._found: dict = {}

    def _cache_fail(self, context, q, k_new, v_new, unsq_k, unsq_v, k_rep, v_rep, past_key,
                    past_value, kw) -> tuple[str, ir.Value | None, ir.Value]:
        """``_kv_cache_fail`` of this variant's match, and the cache ``k_all``."""
        self._found = {}
        k_all = kw.get("k_all", k_new)
        why, where = _kv_cache_fail(context, q, k_new, v_new, k_all, kw.get("v_all", v_new),
                                    unsq_k, unsq_v, k_rep, v_rep,
                                    past_key if self.with_past else None,
                                    past_value if self.with_past else None)
        return why, where, k_all

    def _shaped(self, outputs: list[ir.Value], found: dict):
        """The fused op's outputs with the matched shapes, as the pattern returns them."""
        outputs[0].shape = found["out_shape"]
        for present in outputs[1:]:
            present.shape = found["present_shape"]
        return tuple(outputs) if self.with_past else outputs[0]

    def cleanup(self) -> None:
        self._found = {}


class GroupQueryAttentionFusion(_KVCacheRule):
    """GQA decoder attention (head repeat + SDPA + causal/padding mask) →
    ``com.microsoft::GroupQueryAttention``."""

    rule_name = "amp_rewrite.GroupQueryAttention"

    def __init__(self, with_past: bool) -> None:
        super().__init__(self.rule_name, with_past)
        self._mask_values: dict[ir.Value, tuple[ir.Value, ir.Value, ir.Value]] = {}

    @staticmethod
    def _scores(op, q, k_rep, a, b):
        """torchlib's SDPA decomposition: √scale on each side, ``(q·a) @ (kᵀ·b)``."""
        return op.MatMul(op.Mul(q, a), op.Mul(op.Transpose(k_rep, perm=[0, 1, 3, 2]), b))

    @staticmethod
    def _scale(a, b) -> float | None:
        """The product of the matched scale factors when each is a constant scalar."""
        scales = [_const(a), _const(b)]
        if any(s is None or s.size != 1 for s in scales):
            return None
        return float(np.float64(scales[0].ravel()[0]) * np.float64(scales[1].ravel()[0]))

    def pattern(self, op, q, k_new, v_new, past_key, past_value, unsq_k, unsq_v, expand_k,
                expand_v, shape_k, shape_v, a, b, mask, zero, out_shape):
        k_all, v_all, k_rep, v_rep = _cache_and_repeat_kv(
            op, self.with_past, k_new, v_new, past_key, past_value, unsq_k, unsq_v, expand_k,
            expand_v, shape_k, shape_v)
        probs = op.Softmax(op.Add(self._scores(op, q, k_rep, a, b), mask), axis=-1)
        guarded = op.Where(op.IsNaN(probs), zero, probs)
        attn = op.MatMul(pattern.OrValue([probs, guarded]), v_rep, _outputs=["attn"])
        same = op.Reshape(attn, pattern.ANY_VALUE, _outputs=["same"])
        bsnh = op.Transpose(pattern.OrValue([attn, same]), perm=[0, 2, 1, 3])
        out = op.Reshape(bsnh, out_shape, _outputs=["out"])
        if self.with_past:
            return out, k_all, v_all
        return out

    def check(self, context, q, k_new, v_new, unsq_k, unsq_v, k_rep, v_rep, a, mask, attn,
              out, b=None, past_key=None, past_value=None, zero=None, same=None, **kw):
        result = pattern.MatchResult()
        why, where, k_all = self._cache_fail(context, q, k_new, v_new, unsq_k, unsq_v, k_rep,
                                             v_rep, past_key, past_value, kw)
        if why:
            return result.fail(why, where)
        batch, heads, seq, head = q.shape
        kv_heads, total = k_new.shape[1], k_all.shape[2]
        scale = self._scale(a, b)
        if scale is None:
            return result.fail("the scale is not a constant scalar", a)
        if not scale > 0:
            return result.fail("the scale is not positive", a)
        if zero is not None:
            z = _const(zero)
            if z is None or z.size != 1 or float(z.ravel()[0]) != 0.0:
                return result.fail("NaN guard does not write 0", zero)
        if same is not None and not _shape_is(same, list(attn.shape or [])):
            return result.fail("Reshape after the attention is not the identity", same)
        if not _shape_is(out, [batch, seq, heads * head]):
            return result.fail("output is not (B, S, H·D)", out)
        proof = _MaskProof(list(context.graph_or_function.inputs), q,
                           past_key if self.with_past else None)
        if not proof.prove(mask):
            return result.fail(proof.fail, mask)
        if not _same_dim(total, proof.attention_mask.shape[1]):
            return result.fail("cache length is not attention_mask.shape[1]", k_all)
        self._found = dict(heads=heads, kv_heads=kv_heads, scale=scale, proof=proof,
                           out_shape=out.shape, present_shape=k_all.shape)
        return result

    @staticmethod
    def _bsd(op, x: ir.Value) -> ir.Value:
        """(B, N, S, D) -> (B, S, N·D), reading under a Transpose(0, 2, 1, 3) if there is one."""
        node = _producer(x, "Transpose")
        if node is not None and list(node.attributes.get("perm").as_ints()) == [0, 2, 1, 3]:
            source = node.inputs[0]
        else:
            source = op.Transpose(x, perm=[0, 2, 1, 3])
        return op.Reshape(source, op.Constant(value_ints=[0, 0, -1]))

    def _mask_inputs(self, op, proof: _MaskProof, dtype: np.dtype):
        """(seqlens_k, total_sequence_length, attention_bias), made once per mask: every layer
        reads the same ones."""
        if proof.condition not in self._mask_values:
            total = op.Cast(op.Squeeze(op.Shape(proof.attention_mask, start=1, end=2)),
                            to=ir.DataType.INT32)
            last = op.Sub(total, op.Constant(value=ir.tensor(1, dtype=ir.DataType.INT32)))
            seqlens = op.Expand(last, op.Shape(proof.attention_mask, start=0, end=1))
            bias = op.Where(proof.condition, op.Constant(value=ir.tensor(np.zeros((), dtype))),
                            op.Constant(value=ir.tensor(np.array(_BIAS_FILL, dtype))))
            self._mask_values[proof.condition] = (seqlens, total, bias)
        return self._mask_values[proof.condition]

    def rewrite(self, op, q, k_new, v_new, past_key=None, past_value=None, **_):
        found, self._found = self._found, {}
        seqlens, total, bias = self._mask_inputs(op, found["proof"], q.dtype.numpy())
        outputs = op.GroupQueryAttention(
            self._bsd(op, q), self._bsd(op, k_new), self._bsd(op, v_new),
            past_key if self.with_past else None, past_value if self.with_past else None,
            seqlens, total, None, None, None, bias, num_heads=found["heads"],
            kv_num_heads=found["kv_heads"], scale=found["scale"], do_rotary=0,
            _domain=MS_DOMAIN, _outputs=3)
        return self._shaped(outputs, found)

    def cleanup(self) -> None:
        super().cleanup()
        self._mask_values.clear()


class EagerGroupQueryAttentionFusion(GroupQueryAttentionFusion):
    """The same attention exported with ``attn_implementation="eager"`` (what several
    exporters force): transformers' ``eager_attention_forward`` scales after the product,
    ``(q @ kᵀ)·scale``, where torchlib's SDPA splits √scale over both operands. The rest of
    the block (cache Concat, ``repeat_kv``, additive mask, softmax, ``@ v``) and so the mask
    proof and the written GroupQueryAttention are the SDPA rule's."""

    rule_name = "amp_rewrite.GroupQueryAttention.eager"

    @staticmethod
    def _scores(op, q, k_rep, a, b):
        del b  # one scale factor: check() reads b as absent
        return op.Mul(op.MatMul(q, op.Transpose(k_rep, perm=[0, 1, 3, 2])), a)

    @staticmethod
    def _scale(a, b) -> float | None:
        scale = _const(a)
        return None if scale is None or scale.size != 1 else float(scale.ravel()[0])


def _rule_set(*classes, with_past: bool):
    """A rule-set factory for one variant of cache-aware attention rules (decode step with
    ``with_past``, prompt without): the fusion steps make their rules lazily."""
    return lambda: pattern.RewriteRuleSet([cls.rule(with_past=with_past) for cls in classes])


gqa_decode_rules = _rule_set(GroupQueryAttentionFusion, EagerGroupQueryAttentionFusion,
                             with_past=True)
gqa_prompt_rules = _rule_set(GroupQueryAttentionFusion, EagerGroupQueryAttentionFusion,
                             with_past=False)


def has_kv_cache(nodes: list[ir.Node]) -> bool:
    """Whether a graph input is concatenated on axis -2 (a past K/V cache): the decode-step
    rules have several output nodes, which onnxscript matches by trying node combinations,
    so they run only on graphs that can hold a match."""
    return any(node.op_type == "Concat" and node.attributes.get_int("axis", 0) in (-2, 2)
               and any(v is not None and v.is_graph_input() for v in node.inputs)
               for node in nodes)


# ------------------------------------------------------------ ONNX Attention-23 (--target onnx)
#
# At opset ≥ 23 these decoders' attention is already an ONNX ``Attention``, but it reads the
# head-repeated, Concat-ed cache (``_cache_and_repeat_kv``). A 4-D Attention with fewer KV
# heads is GQA (query head h reads KV head h // G, as repeat_kv), so the head repeat goes and
# past/present replace the Concats. The mask travels unchanged, so unlike GQA's
# ``seqlens_k`` no mask proof is needed and left padding stays exact. ``softmax_precision``
# becomes FLOAT: scores and softmax in fp32, as the fp32 model computed them.


class AttentionKVCacheFusion(_KVCacheRule):
    """``Attention(q, repeat_kv([Concat(past,] k[)]), ..., mask)`` → ONNX Attention-23 with
    ``past_key``/``past_value`` (``with_past``) and no head repeat."""

    def __init__(self, with_past: bool) -> None:
        super().__init__("amp_rewrite.Attention23", with_past)

    def pattern(self, op, q, k_new, v_new, past_key, past_value, unsq_k, unsq_v, expand_k,
                expand_v, shape_k, shape_v, mask):
        k_all, v_all, k_rep, v_rep = _cache_and_repeat_kv(
            op, self.with_past, k_new, v_new, past_key, past_value, unsq_k, unsq_v, expand_k,
            expand_v, shape_k, shape_v)
        y = op.Attention(q, k_rep, v_rep, mask, _outputs=["y"])
        return (y, k_all, v_all) if self.with_past else y

    def check(self, context, q, k_new, v_new, unsq_k, unsq_v, k_rep, v_rep, mask, y,
              past_key=None, past_value=None, **kw) -> pattern.MatchResult:
        result = pattern.MatchResult()
        why, where, k_all = self._cache_fail(context, q, k_new, v_new, unsq_k, unsq_v, k_rep,
                                             v_rep, past_key, past_value, kw)
        if why:
            return result.fail(why, where)
        node = y.producer()
        if node.domain not in ("", "ai.onnx"):
            return result.fail("not the ONNX Attention", y)
        if any(out.uses() or out.is_graph_output() for out in node.outputs[1:]):
            return result.fail("the Attention's present/qk outputs are read", y)
        attrs = node.attributes
        for name in ("q_num_heads", "kv_num_heads", "nonpad_kv_seqlen"):
            if name in attrs:
                return result.fail(f"{name} is set", y)
        if _int_attr(node, "is_causal", 0) != 0:
            return result.fail("is_causal=1 (the causal frontier would move with a past)", y)
        if _int_attr(node, "qk_matmul_output_mode", 0) != 0:
            return result.fail("qk_matmul_output_mode is set", y)
        softcap = attrs.get("softcap")
        if softcap is not None and softcap.as_float() != 0.0:
            return result.fail("softcap is set", y)
        if mask.shape is None or not 2 <= len(mask.shape) <= 4 or not _same_dim(
                mask.shape[-1], k_all.shape[2]):
            return result.fail("the mask does not span the whole cache", mask)
        scale = attrs.get("scale")
        self._found = dict(scale=None if scale is None else scale.as_float(),
                           out_shape=y.shape, present_shape=k_all.shape)
        return result

    def rewrite(self, op, q, k_new, v_new, mask, past_key=None, past_value=None, **_):
        found, self._found = self._found, {}
        attrs = {"softmax_precision": int(ir.DataType.FLOAT)}
        if found["scale"] is not None:
            attrs["scale"] = found["scale"]
        if not self.with_past:
            return self._shaped([op.Attention(q, k_new, v_new, mask, **attrs)], found)
        return self._shaped(op.Attention(q, k_new, v_new, mask, past_key, past_value, **attrs,
                                         _outputs=3), found)


attention23_decode_rules = _rule_set(AttentionKVCacheFusion, with_past=True)
attention23_prompt_rules = _rule_set(AttentionKVCacheFusion, with_past=False)


def attention_reads_head_repeat(nodes: list[ir.Node]) -> bool:
    """Whether some ONNX Attention reads its key through a Reshape (a head repeat)."""
    return any(n.op_type == "Attention" and n.domain in ("", "ai.onnx") and len(n.inputs) > 1
               and _producer(n.inputs[1], "Reshape") is not None for n in nodes)
