"""``onnx.reference`` kernels for the onnxruntime contrib ops the fusion step can emit, and
float32-accumulating versions of the standard GEMMs, normalisations, global average pool,
reductions, softmaxes, Einsum and Attention.

Each follows the GPU kernel it stands for: inputs read in their declared dtype, arithmetic in
float32, every output rounded once to its declared dtype, so validation sees the runtime's
rounding. onnx.reference itself computes a float16 normalisation in float16 (x² overflows
for |x| > 256, where the runtime keeps its statistics in float32) and a float16 GEMM without
BLAS, about 20 times slower than the same product in float32. numpy sums a bfloat16 array
in bfloat16 (a sum of ones stops growing at 256) and a float16 one in float16 along a
strided axis, where the runtime's reductions, softmaxes and Einsum accumulate in float32.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
from onnx.reference.op_run import OpRun
from onnx.reference.ops import (op_conv, op_conv_transpose, op_einsum, op_gemm,
                                op_global_average_pool, op_instance_normalization,
                                op_layer_normalization, op_log_softmax, op_lp_normalization,
                                op_matmul, op_reduce_l1, op_reduce_l2, op_reduce_log_sum,
                                op_reduce_log_sum_exp, op_reduce_mean, op_reduce_prod,
                                op_reduce_sum, op_reduce_sum_square, op_softmax)

try:
    from onnx.reference.ops.op_rms_normalization import RMSNormalization as _RMSNormalization
except ImportError:  # onnx < 1.18 has no RMSNormalization (opset 23) to run
    _RMSNormalization = None
try:
    from onnx.reference.ops.op_attention import Attention as _Attention
except ImportError:  # nor the standard Attention (opset 23)
    _Attention = None

MS_DOMAIN = "com.microsoft"
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
LOW_FLOATS = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


def _erf(x: np.ndarray) -> np.ndarray:
    from scipy.special import erf

    return erf(x).astype(np.float32)


def gelu_erf(x: np.ndarray) -> np.ndarray:
    """0.5·x·(1 + erf(x/√2)) in float32."""
    return 0.5 * x * (1.0 + _erf(x / np.float32(math.sqrt(2.0))))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) in float32."""
    return 0.5 * x * (1.0 + np.tanh(np.float32(_SQRT_2_OVER_PI) * (x + 0.044715 * x * x * x)))


class Gelu(OpRun):
    op_domain = MS_DOMAIN

    def _run(self, x, approximate=None):  # the evaluator passes the standard Gelu's default
        return (gelu_erf(_f32(x)).astype(x.dtype),)


class FastGelu(OpRun):
    op_domain = MS_DOMAIN

    def _run(self, x, bias=None):
        v = _f32(x) if bias is None else _f32(x) + _f32(bias)
        return (gelu_tanh(v).astype(x.dtype),)


class BiasGelu(OpRun):
    op_domain = MS_DOMAIN

    def _run(self, a, b):
        return (gelu_erf(_f32(a) + _f32(b)).astype(a.dtype),)


class QuickGelu(OpRun):
    op_domain = MS_DOMAIN

    def _run(self, x, alpha=None):
        alpha = np.float32(1.702 if alpha is None else alpha)
        v = _f32(x)
        with np.errstate(over="ignore"):  # exp(-αx) → inf gives sigmoid 0, as intended
            return ((v / (1.0 + np.exp(-alpha * v))).astype(x.dtype),)


def _layer_norm(v: np.ndarray, epsilon: float, simplified: bool):
    """(normalised, mean, inv_std) over the last axis, float32, keepdims."""
    mean = np.zeros_like(v[..., :1]) if simplified else v.mean(axis=-1, keepdims=True)
    centred = v - mean
    inv_std = 1.0 / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + epsilon)
    return centred * inv_std, mean, inv_std.astype(np.float32)


class _OmitsOutputs(OpRun):
    """Base of kernels with optional outputs a node may omit (empty name): ``run`` hands
    back None there, else the result would be read as the next omitted optional input."""

    def run(self, *args, **kwargs):
        outputs = super().run(*args, **kwargs)
        names = list(self.onnx_node.output)
        return tuple(v if names[i] else None for i, v in enumerate(outputs[:len(names)]))


def _epsilon(epsilon) -> np.float32:
    return np.float32(1e-5 if epsilon is None else epsilon)


class SkipLayerNormalization(_OmitsOutputs):
    """LayerNorm(input + skip + bias)·gamma + beta; outputs (y, mean, inv_std, sum)."""

    op_domain = MS_DOMAIN

    def _run(self, x, skip, gamma, beta=None, bias=None, epsilon=None):
        total = _f32(x) + _f32(skip) + (0 if bias is None else _f32(bias))
        normalised, mean, inv_std = _layer_norm(total, _epsilon(epsilon), simplified=False)
        y = normalised * _f32(gamma) + (0 if beta is None else _f32(beta))
        return y.astype(x.dtype), mean.astype(np.float32), inv_std, total.astype(x.dtype)


class SkipSimplifiedLayerNormalization(_OmitsOutputs):
    """RMSNorm(input + skip + bias)·gamma; outputs (y, mean, inv_std, sum)."""

    op_domain = MS_DOMAIN

    def _run(self, x, skip, gamma, bias=None, epsilon=None):
        total = _f32(x) + _f32(skip) + (0 if bias is None else _f32(bias))
        normalised, mean, inv_std = _layer_norm(total, _epsilon(epsilon), simplified=True)
        y = normalised * _f32(gamma)
        return y.astype(x.dtype), mean.astype(np.float32), inv_std, total.astype(x.dtype)


class SimplifiedLayerNormalization(_OmitsOutputs):
    """onnxruntime's RMSNorm, registered in the default domain; Y has the scale's dtype."""

    op_domain = ""

    def _run(self, x, scale, axis=None, epsilon=None, stash_type=None):
        axis = -1 if axis is None else axis
        v = _f32(x)
        axes = tuple(range(axis % v.ndim, v.ndim))
        inv_std = 1.0 / np.sqrt((v * v).mean(axis=axes, keepdims=True) + _epsilon(epsilon))
        y = v * inv_std * _f32(scale)
        return y.astype(scale.dtype), inv_std.astype(np.float32)


class MultiHeadAttention(OpRun):
    """softmax(scale·QKᵀ + attention_bias [+ key_padding_mask])·V with 3-D (B, S, N·H)
    query/key/value, as the fusion emits it; other layouts and the KV-cache inputs raise."""

    op_domain = MS_DOMAIN

    def _run(self, query, key=None, value=None, bias=None, key_padding_mask=None,
             attention_bias=None, past_key=None, past_value=None, *rest, num_heads=None,
             scale=None, mask_filter_value=None, unidirectional=None, **_):
        # The fusion step emits only the 3-D, bias-free, cache-free form; other forms (from a
        # model that already had them) are refused rather than computed wrongly.
        if key is None or value is None or query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise NotImplementedError("MultiHeadAttention reference: only 3-D q/k/v")
        if past_key is not None or past_value is not None or bias is not None:
            raise NotImplementedError("MultiHeadAttention reference: no bias or KV cache")
        q, k, v = (self._heads(_f32(t), num_heads) for t in (query, key, value))
        head = q.shape[-1]
        scale = np.float32(1.0 / math.sqrt(head) if not scale else scale)
        scores = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
        if attention_bias is not None:
            scores = scores + _f32(attention_bias)
        scores = self._masked(scores, key_padding_mask, mask_filter_value, unidirectional)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        out = np.matmul(weights, v)  # (B, N, S, Hv)
        b, n, s, hv = out.shape
        return (out.transpose(0, 2, 1, 3).reshape(b, s, n * hv).astype(query.dtype),)

    @staticmethod
    def _heads(t: np.ndarray, num_heads: int) -> np.ndarray:
        b, s, hidden = t.shape
        return t.reshape(b, s, num_heads, hidden // num_heads).transpose(0, 2, 1, 3)

    @staticmethod
    def _masked(scores, key_padding_mask, mask_filter_value, unidirectional):
        fill = np.float32(-10000.0 if mask_filter_value is None else mask_filter_value)
        if key_padding_mask is not None:
            if key_padding_mask.ndim != 2:
                raise NotImplementedError("MultiHeadAttention reference: only a 2-D key_padding_mask")
            keep = key_padding_mask.astype(bool)[:, None, None, :]
            scores = np.where(keep, scores, fill)
        if unidirectional:
            s, t = scores.shape[-2:]
            causal = np.tril(np.ones((s, t), dtype=bool), k=t - s)
            scores = np.where(causal, scores, fill)
        return scores


class RotaryEmbedding(OpRun):
    """onnxruntime's RoPE: (B, N, S, H) or (B, S, N·H) input, ``position_ids`` (B, S) or a
    one-element start offset, ``cos_cache``/``sin_cache`` (max_position, rotary_dim / 2).
    The first ``rotary_dim`` features of each head rotate as halves (``interleaved=0``) or as
    adjacent pairs (``interleaved=1``); the rest pass through. Packed batching and a custom
    ``scale`` are refused rather than guessed."""

    op_domain = MS_DOMAIN

    def _run(self, x, position_ids, cos_cache, sin_cache, interleaved=None, num_heads=None,
             rotary_embedding_dim=None, scale=None, is_packed_batching=None):
        if is_packed_batching or (scale not in (None, 1.0)):
            raise NotImplementedError("RotaryEmbedding reference: no packed batching or scale")
        half = cos_cache.shape[-1]
        rotary = int(rotary_embedding_dim or 0) or 2 * half
        if rotary != 2 * half:
            raise ValueError(f"rotary_embedding_dim {rotary} != 2 x cos_cache width {half}")
        v = _f32(x)
        if v.ndim == 3:  # (B, S, N·H) -> (B, N, S, H)
            b, s, hidden = v.shape
            heads = int(num_heads or 0) or hidden // rotary
            v = v.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)
        elif v.ndim != 4:
            raise ValueError(f"RotaryEmbedding input must be 3-D or 4-D, got {v.shape}")
        b, _, s, _ = v.shape
        pos = np.asarray(position_ids).astype(np.int64)
        if pos.size == 1:
            pos = np.broadcast_to(pos.reshape(()) + np.arange(s, dtype=np.int64), (b, s))
        if pos.shape != (b, s):
            raise ValueError(f"position_ids shape {pos.shape} is not (batch, sequence) {(b, s)}")
        if pos.min() < 0 or pos.max() >= cos_cache.shape[0]:
            raise ValueError("position_ids outside the cos/sin cache")
        cos = _f32(cos_cache)[pos][:, None]  # (B, 1, S, half)
        sin = _f32(sin_cache)[pos][:, None]
        out = v.copy()
        if interleaved:
            a, c = v[..., 0:rotary:2], v[..., 1:rotary:2]
            out[..., 0:rotary:2] = a * cos - c * sin
            out[..., 1:rotary:2] = c * cos + a * sin
        else:
            a, c = v[..., :half], v[..., half:rotary]
            out[..., :half] = a * cos - c * sin
            out[..., half:rotary] = c * cos + a * sin
        if x.ndim == 3:
            out = out.transpose(0, 2, 1, 3).reshape(x.shape)
        return (out.astype(x.dtype),)


class GroupQueryAttention(_OmitsOutputs):
    """onnxruntime's GQA (CPU kernel semantics), the unpacked, rotary-free form: query (B, S,
    N·H), key/value (B, S, Nkv·H), optional past_key/past_value (B, Nkv, P, H) in BNSH,
    ``seqlens_k`` (B,) int32 = valid total length − 1 per batch, ``total_sequence_length``
    an int32 scalar. Per batch b: total_b = seqlens_k[b] + 1; on the first prompt (S equals
    total_sequence_length) the past is empty, else past_b = total_b − S: present holds
    past[:past_b] then the S new rows at past_b, zeros after, and is max(P, total) long.
    Query row s sees keys [0, past_b + s + 1) (causal with the past offset; right padding: a
    row past total_b sees only the valid keys), query head n reads KV head n // (N / Nkv).
    ``attention_bias`` (B|1, N|1, S, total) is added to the scores. Scores, softmax and the
    weighted sum run in float32; outputs are rounded to the input dtype once. Packed QKV,
    rotary, local windows, softcap and the other extras are refused."""

    op_domain = MS_DOMAIN

    def _run(self, query, key=None, value=None, past_key=None, past_value=None, seqlens_k=None,
             total_sequence_length=None, cos_cache=None, sin_cache=None, position_ids=None,
             attention_bias=None, *rest, num_heads=None, kv_num_heads=None, scale=None,
             do_rotary=None, local_window_size=None, softcap=None, **_):
        if key is None or value is None or query.ndim != 3:
            raise NotImplementedError("GroupQueryAttention reference: no packed QKV")
        if do_rotary or cos_cache is not None or (local_window_size not in (None, -1)) \
                or softcap or position_ids is not None or any(r is not None for r in rest):
            raise NotImplementedError(
                "GroupQueryAttention reference: no rotary, local window, softcap or extras")
        n, nkv = int(num_heads), int(kv_num_heads)
        b, s, hidden = query.shape
        head = hidden // n
        total = int(np.asarray(total_sequence_length).reshape(()))
        lens = np.asarray(seqlens_k).astype(np.int64).reshape(b) + 1
        past = 0 if past_key is None else past_key.shape[2]
        first_prompt = s == total
        length = max(past, total)
        q = _f32(query).reshape(b, s, n, head).transpose(0, 2, 1, 3)
        new_k = np.asarray(key).reshape(b, s, nkv, head).transpose(0, 2, 1, 3)
        new_v = np.asarray(value).reshape(b, s, nkv, head).transpose(0, 2, 1, 3)
        present_k = np.zeros((b, nkv, length, head), dtype=key.dtype)
        present_v = np.zeros((b, nkv, length, head), dtype=value.dtype)
        scale = np.float32(1.0 / math.sqrt(head) if not scale else scale)
        out = np.zeros((b, n, s, head), np.float32)
        group = n // nkv
        for i in range(b):
            past_i = 0 if first_prompt else int(lens[i]) - s
            if past_i < 0 or past_i > past or past_i + s > length:
                raise ValueError(f"seqlens_k[{i}] = {lens[i] - 1} does not fit the cache")
            if past_i:
                present_k[i, :, :past_i] = past_key[i, :, :past_i]
                present_v[i, :, :past_i] = past_value[i, :, :past_i]
            present_k[i, :, past_i:past_i + s] = new_k[i]
            present_v[i, :, past_i:past_i + s] = new_v[i]
            valid = min(int(lens[i]), length)
            keys = _f32(present_k[i, :, :valid]).repeat(group, axis=0)  # (N, T_b, H)
            values = _f32(present_v[i, :, :valid]).repeat(group, axis=0)
            scores = np.matmul(q[i], np.swapaxes(keys, -1, -2)) * scale  # (N, S, T_b)
            if attention_bias is not None:
                scores = scores + _f32(attention_bias[i % attention_bias.shape[0], :, :, :valid])
            seen = np.minimum(past_i + np.arange(s) + 1, valid)  # keys each query row sees
            scores = np.where(np.arange(valid)[None, :] < seen[:, None], scores, -np.inf)
            weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
            weights /= weights.sum(axis=-1, keepdims=True)
            out[i] = np.matmul(weights, values)
        result = out.transpose(0, 2, 1, 3).reshape(b, s, n * head).astype(query.dtype)
        return result, present_k, present_v


class _InFloat32(OpRun):
    """Mixin before an onnx.reference kernel: the kernel runs on float32 copies of the
    low-precision float inputs and the outputs listed in ``rounded_outputs`` (None: all) are
    rounded back to that dtype; the others (float32 statistics) stay float32."""

    op_domain = ""
    rounded_outputs: tuple[int, ...] | None = None

    def _run(self, *inputs, **attributes):
        low = next((x.dtype for x in inputs if _is_low(x)), None)
        if low is None:
            return super()._run(*inputs, **attributes)
        outputs = super()._run(*(_f32(x) if _is_low(x) else x for x in inputs), **attributes)
        return tuple(o.astype(low) if self.rounded_outputs is None or i in self.rounded_outputs
                     else o for i, o in enumerate(outputs))


def _is_low(x) -> bool:
    return isinstance(x, np.ndarray) and x.dtype in LOW_FLOATS


class MatMul(_InFloat32, op_matmul.MatMul):
    pass


class Gemm(_InFloat32, op_gemm.Gemm_7):
    def _run(self, a, b, c=None, broadcast=None, **attributes):
        # opset 6's ``broadcast`` flag: numpy broadcasts C in any case
        return super()._run(a, b, c, **attributes)


class Conv(_InFloat32, op_conv.Conv):
    pass


class ConvTranspose(_InFloat32, op_conv_transpose.ConvTranspose):
    pass


class LayerNormalization(_OmitsOutputs, _InFloat32, op_layer_normalization.LayerNormalization):
    rounded_outputs = (0,)  # Mean and InvStdDev are float32 (stash_type 1, all it supports)


class InstanceNormalization(_InFloat32, op_instance_normalization.InstanceNormalization):
    pass


class BatchNormalization(OpRun):
    """Inference BatchNormalization, scale·(x − mean)/√(var + ε) + B with the given mean
    and variance, in float32 and Y rounded once to X's dtype (cuDNN keeps a float16 X's
    statistics and arithmetic in float32). onnx.reference's opset 9-13 kernel switches to
    training mode whenever the node carries ``momentum`` (PaddlePaddle exports always
    write it) and then normalises with 0.9·mean + 0.1·(the batch's mean), its variance
    summed in float16 (inf past 65504); onnxruntime trains only a node with the optional
    outputs, and so does this kernel: training mode is refused here."""

    op_domain = ""

    def _run(self, x, scale, bias, mean, var, epsilon=None, momentum=None, training_mode=None,
             spatial=None, **_):
        if training_mode or len([o for o in self.onnx_node.output if o]) > 1:
            raise NotImplementedError("BatchNormalization reference: inference mode only")
        # spatial=0 (opsets 6-8): one statistic per element of x.shape[1:]
        shape = x.shape[1:] if spatial == 0 else (-1,) + (1,) * (x.ndim - 2)

        def param(p: np.ndarray) -> np.ndarray:
            return _f32(p).reshape(shape)

        y = param(scale) * (_f32(x) - param(mean)) / np.sqrt(param(var) + _epsilon(epsilon)) \
            + param(bias)
        return (y.astype(x.dtype),)


class GlobalAveragePool(_InFloat32, op_global_average_pool.GlobalAveragePool):
    """numpy averages a bfloat16 array in bfloat16 (a sum stops growing at 256 + 1), a
    float16 one in float32; the GPU kernel sums in float32 for both."""


# The reductions: onnx.reference's newest kernel serves every opset (the schema it reads
# the defaults from is the newest too, and ``axes`` arrives as the opset's attribute or input).
# onnxruntime's CUDA reductions accumulate a 16-bit input in float32 (cuDNN with a float
# compute type, or its own kernels with float accumulators); for ReduceSumSquare, ReduceLogSum
# and ReduceLogSumExp it rounds x², the sum or exp to the input dtype on the way, within an
# ulp of this.
class ReduceSum(_InFloat32, op_reduce_sum.ReduceSum_13):
    pass


class ReduceMean(_InFloat32, op_reduce_mean.ReduceMean_18):
    pass


class ReduceSumSquare(_InFloat32, op_reduce_sum_square.ReduceSumSquare_18):
    pass


class ReduceL1(_InFloat32, op_reduce_l1.ReduceL1_18):
    pass


class ReduceL2(_InFloat32, op_reduce_l2.ReduceL2_18):
    pass


class ReduceLogSum(_InFloat32, op_reduce_log_sum.ReduceLogSum_18):
    pass


class ReduceLogSumExp(_InFloat32, op_reduce_log_sum_exp.ReduceLogSumExp_18):
    pass


class ReduceProd(_InFloat32, op_reduce_prod.ReduceProd_18):
    pass


class Softmax(_InFloat32, op_softmax.Softmax):
    pass


class LogSoftmax(op_log_softmax.LogSoftmax):
    """x − max − log Σ exp(x − max) in float32, as the GPU kernel computes it; onnx.reference
    takes the log of a softmax (−inf where the probability underflows)."""

    op_domain = ""

    def _run(self, x):
        if not _is_low(x) or x.size == 0:
            return super()._run(x)
        v = _f32(x)
        shifted = v - v.max(axis=self.axis, keepdims=True)
        return ((shifted - np.log(np.exp(shifted).sum(axis=self.axis, keepdims=True)))
                .astype(x.dtype),)


class LpNormalization(_InFloat32, op_lp_normalization.LpNormalization):
    pass


class Einsum(_InFloat32, op_einsum.Einsum):
    """onnx.reference promotes bfloat16 itself, not float16 (cuBLAS and the CUDA reductions
    accumulate both in float32)."""


#: Standard ops computed in float32 and rounded once (module docstring).
FLOAT32_KERNELS: tuple[type[OpRun], ...] = (
    MatMul, Gemm, Conv, ConvTranspose, LayerNormalization, InstanceNormalization,
    BatchNormalization, GlobalAveragePool, ReduceSum, ReduceMean, ReduceSumSquare, ReduceL1,
    ReduceL2, ReduceLogSum, ReduceLogSumExp, ReduceProd, Softmax, LogSoftmax, LpNormalization,
    Einsum,
)
if _RMSNormalization is not None:
    class RMSNormalization(_InFloat32, _RMSNormalization):
        pass

    FLOAT32_KERNELS += (RMSNormalization,)

if _Attention is not None:
    class Attention(_OmitsOutputs, _Attention):
        """The standard Attention (opset 23, what ``--target onnx`` fuses SDPA into) in
        float32: onnx.reference computes QKᵀ, the softmax and its product with V in Q's dtype,
        where the GPU kernels (cuDNN, flash and memory-efficient attention, onnxruntime's CUDA
        Attention) accumulate in float32 and round the output once. Low-precision float inputs
        (Q, K, V, a float attn_mask, the past KV) run as float32 copies; Y and
        qk_matmul_output are rounded to Q's dtype, present_key/present_value (the past
        concatenated with the new K/V, so exactly representable) to K's and V's."""

        op_domain = ""

        def __init__(self, onnx_node, run_params, *args, **kwargs):
            super().__init__(onnx_node, run_params, *args, **kwargs)
            # onnx.reference checks the opset 25 rules only for a model at opset 25 or later
            opset = (run_params or {}).get("opsets", {}).get("", 25)
            self._validate_attention25 = opset >= 25

        def _run(self, q, k, v, *rest, **attributes):
            if not any(_is_low(x) for x in (q, k, v, *rest)):
                return super()._run(q, k, v, *rest, **attributes)
            outputs = super()._run(*(_f32(x) if _is_low(x) else x for x in (q, k, v, *rest)),
                                   **attributes)
            dtypes = (q.dtype, k.dtype, v.dtype, q.dtype)
            return tuple(o.astype(t) for o, t in zip(outputs, dtypes))

    FLOAT32_KERNELS += (Attention,)

#: Every contrib op the fusion step can emit (tests check the list against fusion.FUSED_OPS).
CONTRIB_OPS: tuple[type[OpRun], ...] = (
    Gelu, FastGelu, BiasGelu, QuickGelu, SkipLayerNormalization,
    SkipSimplifiedLayerNormalization, SimplifiedLayerNormalization, MultiHeadAttention,
    RotaryEmbedding, GroupQueryAttention,
)
