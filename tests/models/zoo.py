"""A zoo of real ``transformers`` architectures with tiny configs and seeded random weights.

Tests and benchmarks of both adapters (ONNX and torch.fx) need real models, not toy graphs:
real attention with masks, LayerNorm/RMSNorm, relative position buckets, windowed attention,
depthwise convs, group norm, interpolation.  Every model here is built from a ``transformers``
config (no downloads), shrunk to hidden sizes of 16-64, two layers and 32x32/64x64 images or
16-token sequences, so exporting and running one takes seconds.

``import tests.models.zoo`` is cheap: torch, transformers and onnx are imported only inside
functions.

Each model is wrapped so that it takes plain tensors (positional, in forward-signature order)
and returns a tensor or a tuple of tensors; the wrapper's parameter names (``input_ids``,
``pixel_values``, ...) become the ONNX graph input names.  Attention uses the ``eager``
implementation by default, so the softmax, masking and scaling are explicit ops in both the fx
graph and the ONNX graph (``attn_implementation="sdpa"`` gives fused SDPA calls instead).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_rewrite.errors import CaptureError, UsageError

if TYPE_CHECKING:
    import numpy as np
    import onnx
    import torch

log = logging.getLogger(__name__)

DEFAULT_OPSET = 18

_VOCAB = 128
_SEQ = 16
_DEC_SEQ = 8
_IMAGE = 32
_CLIP_SEQ = 77
_UNET_IN, _UNET_IMAGE, _UNET_CHANNELS = 4, 16, 32


@dataclasses.dataclass
class ZooModel:
    """A zoo model ready to run as ``module(*args, **kwargs)``."""

    name: str
    module: torch.nn.Module  # eval mode, float32
    args: tuple
    kwargs: dict
    description: str

    def run(self) -> Any:
        """Forward pass without autograd."""
        import torch

        with torch.no_grad():
            return self.module(*self.args, **self.kwargs)

    def named_inputs(self) -> dict[str, torch.Tensor]:
        """Inputs keyed by forward-parameter name, in signature order (the ONNX input names)."""
        bound = inspect.signature(self.module.forward).bind(*self.args, **self.kwargs)
        return dict(bound.arguments)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """How to build one zoo model: the HF model, its wrapper kind and its inputs."""

    make: Callable[[str], torch.nn.Module]  # attn_implementation -> HF model
    kind: str  # wrapper signature, see _wrapper_types()
    inputs: Callable[[torch.Generator, int], tuple]  # (generator, batch) -> positional args
    description: str
    picks: tuple[int, ...] = (0,)  # which entries of the HF output tuple to return
    extra: tuple[tuple[str, Any], ...] = ()  # constant keyword arguments of the HF call
    # build(real_sizes=True): config overrides restoring the real model's misaligned sizes
    # (vocabularies, ViT's 197 tokens), and the image size its inputs then need
    real: tuple[tuple[str, Any], ...] = ()
    real_image: int | None = None


# ----------------------------------------------------------------------------- wrappers


@functools.cache
def _wrapper_types() -> dict[str, type]:
    """Wrapper classes, keyed by input signature; defined lazily so torch loads lazily."""
    import torch

    class _Wrapper(torch.nn.Module):
        """Calls the HF model with return_dict=False and returns the picked outputs."""

        def __init__(self, model: torch.nn.Module, picks: tuple[int, ...], extra: dict) -> None:
            super().__init__()
            self.model = model
            self.picks = picks
            self.extra = extra

        def _call(self, **inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
            out = self.model(**inputs, **self.extra, return_dict=False)
            if isinstance(out, torch.Tensor):  # e.g. models that ignore return_dict
                out = (out,)
            picked = tuple(out[i] for i in self.picks)
            return picked[0] if len(picked) == 1 else picked

    class Text(_Wrapper):
        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):  # noqa: D102
            return self._call(input_ids=input_ids, attention_mask=attention_mask)

    class Seq2Seq(_Wrapper):
        def forward(  # noqa: D102
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            decoder_input_ids: torch.Tensor,
        ):
            return self._call(
                input_ids=input_ids,
                attention_mask=attention_mask,
                decoder_input_ids=decoder_input_ids,
            )

    class Image(_Wrapper):
        def forward(self, pixel_values: torch.Tensor):  # noqa: D102
            return self._call(pixel_values=pixel_values)

    class AudioFeatures(_Wrapper):
        def forward(self, input_features: torch.Tensor):  # noqa: D102
            return self._call(input_features=input_features)

    class AudioValues(_Wrapper):
        def forward(self, input_values: torch.Tensor):  # noqa: D102
            return self._call(input_values=input_values)

    class Denoiser(_Wrapper):
        def forward(self, sample: torch.Tensor, timestep: torch.Tensor):  # noqa: D102
            return self._call(sample=sample, timestep=timestep)

    return {
        "text": Text,
        "seq2seq": Seq2Seq,
        "image": Image,
        "audio_features": AudioFeatures,
        "audio_values": AudioValues,
        "denoiser": Denoiser,
    }


# ----------------------------------------------------------------------------- inputs


def _tokens(g: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    import torch

    # Ids >= 4 avoid the special tokens (pad/bos/eos/unk) whose ids some models treat
    # specially (RoBERTa's position ids skip padding tokens).
    return torch.randint(4, _VOCAB, (batch, seq), generator=g, dtype=torch.int64)


def _mask(batch: int, seq: int) -> torch.Tensor:
    import torch

    # Right-pad the last sequence so the mask really masks something, while every query row
    # (causal ones included) still sees at least one real token.
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq - seq // 4 :] = 0
    return mask


def _text_inputs(g: torch.Generator, batch: int) -> tuple:
    return (_tokens(g, batch, _SEQ), _mask(batch, _SEQ))


def _seq2seq_inputs(g: torch.Generator, batch: int) -> tuple:
    return (_tokens(g, batch, _SEQ), _mask(batch, _SEQ), _tokens(g, batch, _DEC_SEQ))


def _image_inputs(size: int) -> Callable[[torch.Generator, int], tuple]:
    def inputs(g: torch.Generator, batch: int) -> tuple:
        import torch

        return (torch.randn(batch, 3, size, size, generator=g),)

    return inputs


def _randn_inputs(*shape: int) -> Callable[[torch.Generator, int], tuple]:
    def inputs(g: torch.Generator, batch: int) -> tuple:
        import torch

        return (torch.randn(batch, *shape, generator=g),)

    return inputs


# ----------------------------------------------------------------------------- models
# Shared tiny transformer sizes: hidden 32, 4 heads, MLP 64, two layers.
_TINY = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}


def _hf(
    cls_name: str, config_name: str, uses_attention: bool = True, **config: Any
) -> Callable[[str], torch.nn.Module]:
    """A maker that builds ``transformers.<cls_name>(<config_name>(**config))``.

    Attention-free models get no ``attn_implementation``: HF refuses "sdpa" for them.
    """

    def make(attn: str, **overrides: Any) -> torch.nn.Module:
        import transformers

        attn_config = {"attn_implementation": attn} if uses_attention else {}
        cfg = getattr(transformers, config_name)(**attn_config, **{**config, **overrides})
        return getattr(transformers, cls_name)(cfg)

    return make


def _whisper_encoder(attn: str, **overrides: Any) -> torch.nn.Module:
    import transformers

    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    # Only the encoder is built; the special token ids must still lie inside the tiny vocab.
    overrides = {"vocab_size": _VOCAB, **overrides}
    cfg = transformers.WhisperConfig(
        attn_implementation=attn, num_mel_bins=16, d_model=32,
        encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=16, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, decoder_start_token_id=3, **overrides,
    )  # fmt: skip
    return WhisperEncoder(cfg)


def _clip_text_inputs(g: torch.Generator, batch: int) -> tuple:
    """77 tokens as CLIP's tokenizer pads them: text, the end-of-text token (id 2, the
    config's eos_token_id, which the pooler looks for), then masked padding."""
    ids, mask = _tokens(g, batch, _CLIP_SEQ), _mask(batch, _CLIP_SEQ)
    ends = mask.sum(dim=1) - 1
    ids[range(batch), ends] = 2
    return (ids, mask)


def _denoiser_inputs(g: torch.Generator, batch: int) -> tuple:
    import torch

    latents = torch.randn(batch, _UNET_IN, _UNET_IMAGE, _UNET_IMAGE, generator=g)
    timesteps = torch.randint(0, 1000, (batch,), generator=g).to(torch.float32)
    return (latents, timesteps)


def _unet_block(attn: str, **overrides: Any) -> torch.nn.Module:
    """A Stable Diffusion UNet stage, hand-written (``diffusers`` is not a dependency)."""
    if overrides:
        raise UsageError(f"unet_block takes no config overrides, got {sorted(overrides)}")
    return _unet_types()["UNetBlock"](sdpa=attn == "sdpa")


@functools.cache
def _unet_types() -> dict[str, type]:
    """diffusers' UNet2DConditionModel pieces, written out at tiny sizes: the sinusoidal
    ``Timesteps`` + ``TimestepEmbedding`` MLP, ``ResnetBlock2D`` (GroupNorm, SiLU, 3x3 conv,
    time embedding added per channel, residual) and ``Transformer2DModel`` with one
    ``BasicTransformerBlock`` (GroupNorm, 1x1 proj_in, LayerNorm + self-attention,
    LayerNorm + GEGLU feed-forward, 1x1 proj_out, residual); conv_in/conv_out around them."""
    import math

    import torch
    from torch import nn
    from torch.nn import functional as F

    ch, groups, heads = _UNET_CHANNELS, 8, 4

    class ResnetBlock2D(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.GroupNorm(groups, ch, eps=1e-5)
            self.conv1 = nn.Conv2d(ch, ch, 3, padding=1)
            self.time_emb_proj = nn.Linear(4 * ch, ch)
            self.norm2 = nn.GroupNorm(groups, ch, eps=1e-5)
            self.conv2 = nn.Conv2d(ch, ch, 3, padding=1)

        def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
            h = self.conv1(F.silu(self.norm1(x)))
            h = h + self.time_emb_proj(F.silu(temb))[:, :, None, None]
            h = self.conv2(F.silu(self.norm2(h)))
            return x + h

    class Attention(nn.Module):
        def __init__(self, sdpa: bool) -> None:
            super().__init__()
            self.sdpa = sdpa
            self.to_q = nn.Linear(ch, ch, bias=False)
            self.to_k = nn.Linear(ch, ch, bias=False)
            self.to_v = nn.Linear(ch, ch, bias=False)
            self.to_out = nn.Linear(ch, ch)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, n, _ = x.shape
            q, k, v = (p(x).view(b, n, heads, ch // heads).transpose(1, 2)
                       for p in (self.to_q, self.to_k, self.to_v))
            if self.sdpa:
                o = F.scaled_dot_product_attention(q, k, v)
            else:
                scores = q @ k.transpose(-1, -2) * (ch // heads) ** -0.5
                o = scores.softmax(dim=-1) @ v
            return self.to_out(o.transpose(1, 2).reshape(b, n, ch))

    class Transformer2D(nn.Module):
        def __init__(self, sdpa: bool) -> None:
            super().__init__()
            self.norm = nn.GroupNorm(groups, ch, eps=1e-6)
            self.proj_in = nn.Conv2d(ch, ch, 1)
            self.norm1 = nn.LayerNorm(ch)
            self.attn1 = Attention(sdpa)
            self.norm3 = nn.LayerNorm(ch)
            self.ff_proj = nn.Linear(ch, 2 * 4 * ch)  # GEGLU
            self.ff_out = nn.Linear(4 * ch, ch)
            self.proj_out = nn.Conv2d(ch, ch, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, c, hgt, wid = x.shape
            h = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)
            h = h + self.attn1(self.norm1(h))
            hidden, gate = self.ff_proj(self.norm3(h)).chunk(2, dim=-1)
            h = h + self.ff_out(hidden * F.gelu(gate))
            h = h.transpose(1, 2).reshape(b, c, hgt, wid)
            return x + self.proj_out(h)

    class UNetBlock(nn.Module):
        def __init__(self, sdpa: bool) -> None:
            super().__init__()
            self.linear_1 = nn.Linear(ch, 4 * ch)
            self.linear_2 = nn.Linear(4 * ch, 4 * ch)
            self.conv_in = nn.Conv2d(_UNET_IN, ch, 3, padding=1)
            self.resnet = ResnetBlock2D()
            self.transformer = Transformer2D(sdpa)
            self.norm_out = nn.GroupNorm(groups, ch, eps=1e-5)
            self.conv_out = nn.Conv2d(ch, _UNET_IN, 3, padding=1)

        def forward(self, sample: torch.Tensor, timestep: torch.Tensor,
                    return_dict: bool = False) -> tuple[torch.Tensor]:
            half = ch // 2  # Timesteps(ch, flip_sin_to_cos=True, downscale_freq_shift=0)
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32)
                              / half)
            args = timestep[:, None] * freqs[None, :]
            t_emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
            temb = self.linear_2(F.silu(self.linear_1(t_emb)))
            h = self.transformer(self.resnet(self.conv_in(sample), temb))
            return (self.conv_out(F.silu(self.norm_out(h))),)

    return {"UNetBlock": UNetBlock}


_SPECS: dict[str, _Spec] = {
    "bert": _Spec(
        _hf("BertModel", "BertConfig", vocab_size=_VOCAB, hidden_size=32, **_TINY,
            max_position_embeddings=64),
        "text", _text_inputs,
        "BERT encoder; returns last hidden state and tanh pooler output",
        picks=(0, 1), real=(("vocab_size", 30522),),
    ),
    "roberta": _Spec(
        _hf("RobertaForSequenceClassification", "RobertaConfig", vocab_size=_VOCAB,
            hidden_size=32, **_TINY, max_position_embeddings=66, num_labels=3),
        "text", _text_inputs,
        "RoBERTa sequence classifier (padding-aware position ids); returns logits",
        real=(("vocab_size", 50265),),
    ),
    "albert": _Spec(
        _hf("AlbertModel", "AlbertConfig", vocab_size=_VOCAB, embedding_size=16,
            hidden_size=32, **_TINY, max_position_embeddings=64),
        "text", _text_inputs,
        "ALBERT encoder (factorised embeddings; both layers share one set of weights); "
        "returns last hidden state and pooler output",
        picks=(0, 1),
    ),
    "distilbert": _Spec(
        _hf("DistilBertModel", "DistilBertConfig", vocab_size=_VOCAB, dim=32, n_layers=2,
            n_heads=4, hidden_dim=64, max_position_embeddings=64),
        "text", _text_inputs,
        "DistilBERT encoder; returns last hidden state",
        real=(("vocab_size", 30522),),
    ),
    "gpt2": _Spec(
        _hf("GPT2LMHeadModel", "GPT2Config", vocab_size=_VOCAB, n_positions=64, n_embd=32,
            n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
        "text", _text_inputs,
        "GPT-2 causal LM (Conv1D projections, tanh GELU); returns logits",
        extra=(("use_cache", False),), real=(("vocab_size", 50257),),
    ),
    "llama": _Spec(
        _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=_VOCAB, hidden_size=32, **_TINY,
            num_key_value_heads=2, max_position_embeddings=64),
        "text", _text_inputs,
        "Llama causal LM (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU); "
        "returns logits",
        extra=(("use_cache", False),),
    ),
    "t5": _Spec(
        _hf("T5ForConditionalGeneration", "T5Config", vocab_size=_VOCAB, d_model=32, d_kv=8,
            d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            relative_attention_num_buckets=8, decoder_start_token_id=0),
        "seq2seq", _seq2seq_inputs,
        "T5 encoder-decoder (RMS layer norm, relative position buckets); returns logits",
        extra=(("use_cache", False),),
    ),
    "bart": _Spec(
        _hf("BartForConditionalGeneration", "BartConfig", vocab_size=_VOCAB, d_model=32,
            encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
            max_position_embeddings=64),
        "seq2seq", _seq2seq_inputs,
        "BART encoder-decoder with cross-attention; returns logits",
        extra=(("use_cache", False),), real=(("vocab_size", 50265),),
    ),
    "vit": _Spec(
        _hf("ViTForImageClassification", "ViTConfig", image_size=_IMAGE, patch_size=8,
            hidden_size=32, **_TINY, num_labels=10),
        "image", _image_inputs(_IMAGE),
        "ViT image classifier on 32x32 images, 8x8 patches; returns logits",
        real=(("image_size", 224), ("patch_size", 16)), real_image=224,
    ),
    "deit": _Spec(
        _hf("DeiTForImageClassificationWithTeacher", "DeiTConfig", image_size=_IMAGE,
            patch_size=8, hidden_size=32, **_TINY, num_labels=10),
        "image", _image_inputs(_IMAGE),
        "DeiT with distillation token (two heads averaged); returns logits",
    ),
    "swin": _Spec(
        _hf("SwinForImageClassification", "SwinConfig", image_size=_IMAGE, patch_size=2,
            embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4, mlp_ratio=2.0,
            num_labels=10),
        "image", _image_inputs(_IMAGE),
        "Swin transformer (shifted-window attention, patch merging); returns logits",
    ),
    "resnet": _Spec(
        _hf("ResNetForImageClassification", "ResNetConfig", uses_attention=False,
            embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1], layer_type="bottleneck",
            num_labels=10),
        "image", _image_inputs(_IMAGE),
        "ResNet with bottleneck blocks and batch norm; returns logits",
    ),
    "convnext": _Spec(
        _hf("ConvNextForImageClassification", "ConvNextConfig", uses_attention=False,
            patch_size=4, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
        "image", _image_inputs(_IMAGE),
        "ConvNeXt (7x7 depthwise convs, channels-last LayerNorm, layer scale); returns logits",
    ),
    "mobilenet_v2": _Spec(
        _hf("MobileNetV2ForImageClassification", "MobileNetV2Config", uses_attention=False,
            image_size=_IMAGE, depth_multiplier=0.25, min_depth=8, finegrained_output=False,
            num_labels=10),
        "image", _image_inputs(_IMAGE),
        "MobileNetV2 (inverted residuals, depthwise convs, ReLU6); returns logits",
    ),
    "whisper_encoder": _Spec(
        _whisper_encoder,
        "audio_features", _randn_inputs(16, 32),
        "Whisper audio encoder (conv stem on 16 mel bins x 32 frames); returns hidden states",
        real=(("vocab_size", 51865),),
    ),
    "wav2vec2": _Spec(
        _hf("Wav2Vec2Model", "Wav2Vec2Config", hidden_size=32, **_TINY, conv_dim=(16, 16),
            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
            num_conv_pos_embedding_groups=4),
        "audio_values", _randn_inputs(400),
        "wav2vec 2.0 on 400 raw samples (conv feature encoder, group norm, weight-normed "
        "positional conv); returns hidden states",
    ),
    "clip_vision": _Spec(
        _hf("CLIPVisionModel", "CLIPVisionConfig", image_size=_IMAGE, patch_size=8,
            hidden_size=32, **_TINY, projection_dim=16),
        "image", _image_inputs(_IMAGE),
        "CLIP vision tower (quick GELU, pre-LN); returns last hidden state and pooled output",
        picks=(0, 1),
    ),
    "segformer": _Spec(
        _hf("SegformerForSemanticSegmentation", "SegformerConfig", num_encoder_blocks=2,
            depths=[1, 1], sr_ratios=[4, 2], hidden_sizes=[16, 32], patch_sizes=[7, 3],
            strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
            decoder_hidden_size=32, num_labels=5),
        "image", _image_inputs(64),
        "SegFormer segmentation on 64x64 images (efficient attention, bilinear upsampling); "
        "returns logits",
    ),
    "clip_text": _Spec(
        _hf("CLIPTextModel", "CLIPTextConfig", vocab_size=_VOCAB, hidden_size=32, **_TINY,
            max_position_embeddings=_CLIP_SEQ, projection_dim=16, bos_token_id=0,
            eos_token_id=2, pad_token_id=1),
        "text", _clip_text_inputs,
        "CLIP text encoder on 77 tokens (causal + padding mask, quick GELU, pooled at the "
        "end-of-text token); returns last hidden state and pooled output",
        picks=(0, 1),
    ),
    "llama_32k": _Spec(
        _hf("LlamaForCausalLM", "LlamaConfig", vocab_size=32000, hidden_size=32, **_TINY,
            num_key_value_heads=2, max_position_embeddings=64),
        "text", _text_inputs,
        "Llama causal LM with the real 32000-word vocabulary (a 32000 x 32 LM head); "
        "returns logits",
        extra=(("use_cache", False),),
    ),
    "unet_block": _Spec(
        _unet_block,
        "denoiser", _denoiser_inputs,
        "Stable Diffusion UNet stage, hand-written after diffusers (not a dependency): "
        "sinusoidal timestep embedding + MLP, ResnetBlock2D (GroupNorm, SiLU, conv, time "
        "embedding) and a Transformer2D block (self-attention, GEGLU) on 4x16x16 latents; "
        "returns the predicted noise",
    ),
}  # fmt: skip

NAMES: tuple[str, ...] = tuple(_SPECS)


# ----------------------------------------------------------------------------- build


def _spec(name: str) -> _Spec:
    try:
        return _SPECS[name]
    except KeyError:
        raise UsageError(f"unknown zoo model {name!r}; known: {', '.join(NAMES)}") from None


def build(
    name: str, *, seed: int = 0, batch: int = 2, attn_implementation: str = "eager",
    real_sizes: bool = False, config: Mapping[str, Any] | None = None,
) -> ZooModel:
    """Build zoo model ``name`` with weights and inputs drawn from ``seed``.

    ``batch`` is the leading dimension of every input.  ``attn_implementation`` is passed to
    the HF config ("eager": explicit MatMul/Softmax; "sdpa": one fused attention call per
    layer); attention-free models ignore it.  The global torch RNG is left untouched (weights
    are drawn inside ``fork_rng``). ``real_sizes``: the real model's misaligned sizes where
    they differ from the tiny config (GPT-2's 50257-word vocabulary, BERT's 30522, ViT's 224
    pixel images in 16-pixel patches: 197 tokens); hidden sizes stay tiny. ``config``: more
    HF config overrides (a real model's depth: ``{"n_layer": 48}``). Default configs are
    unchanged (tests rely on them).
    """
    import torch

    spec = _spec(name)
    overrides = {**(dict(spec.real) if real_sizes else {}), **(config or {})}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        hf_model = spec.make(attn_implementation, **overrides)
    wrapper = _wrapper_types()[spec.kind](hf_model, spec.picks, dict(spec.extra))
    module = wrapper.to(torch.float32).eval()
    inputs = (_image_inputs(spec.real_image) if real_sizes and spec.real_image
              else spec.inputs)
    _calibrate_batchnorm(module, inputs(torch.Generator().manual_seed(seed + 1), 8))
    gen = torch.Generator().manual_seed(seed)
    return ZooModel(name, module, inputs(gen, batch), {}, spec.description)


def _calibrate_batchnorm(module: torch.nn.Module, calib_args: tuple) -> None:
    """Set BatchNorm running statistics from one batch of calibration inputs.

    HF initialises conv weights with std 0.02 and BatchNorm with mean 0 / var 1, so in a deep
    conv net (MobileNetV2) the activations shrink ~10x per block and the logits end near
    1e-27: useless for precision tests, and unlike any trained model, whose BatchNorm
    statistics match its data.  One forward pass in train mode with a cumulative average
    (momentum None) gives every BatchNorm the statistics of its real input.
    """
    import torch

    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [bn.momentum for bn in norms]
    for bn in norms:
        bn.reset_running_stats()
        bn.momentum = None
        bn.train()
    with torch.no_grad():
        module(*calib_args)
    for bn, momentum in zip(norms, momenta):
        bn.momentum = momentum
    module.eval()


# ----------------------------------------------------------------------------- ONNX


def export_model(model: ZooModel, path: str | Path, *, opset: int | None = None,
                 dynamic: bool = False) -> Path:
    """Export a built zoo model to one standalone ``.onnx`` file (weights inside).

    ``dynamic``: export for serving, with symbolic batch and sequence axes (and image height
    and width) through ``dynamic_shapes=`` (``dynamic_axes`` below). The file appears
    atomically, so concurrent exports of the same model cannot leave a half-written file.
    """
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        program = torch.onnx.export(
            model.module, model.args, kwargs=model.kwargs or None, dynamo=True,
            opset_version=opset or DEFAULT_OPSET, external_data=False, verbose=False,
            dynamic_shapes=_dynamic_shapes(model) if dynamic else None,
        )  # fmt: skip
    except Exception as e:  # torch raises many types here; all mean "could not export"
        raise CaptureError(f"zoo model {model.name!r}: ONNX export failed: {e}") from e
    return save_program(program, path)


def save_program(program: Any, path: Path) -> Path:
    """Save an ONNX export program to ``path`` atomically (a temp file renamed into place), so
    concurrent exports of the same model cannot leave a half-written file behind."""
    fd, tmp = tempfile.mkstemp(suffix=".onnx.tmp", dir=path.parent)
    os.close(fd)
    try:
        program.save(tmp, external_data=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def dynamic_axes(model: ZooModel) -> dict[str, tuple[int, ...]]:
    """The axes a serving export makes symbolic, by input name: the batch axis of every
    input, the sequence axis of token ids and masks, height and width of images."""
    axes = {}
    for name, tensor in model.named_inputs().items():
        if tensor.is_floating_point() and tensor.dim() == 4:
            axes[name] = (0, 2, 3)
        elif not tensor.is_floating_point() and tensor.dim() == 2:
            axes[name] = (0, 1)
        else:
            axes[name] = (0,)
    return axes


def _dynamic_shapes(model: ZooModel) -> dict[str, dict[int, Any]]:
    """``dynamic_shapes=`` for ``dynamic_axes``, as one exports for serving: one ``batch``
    dimension shared by all inputs, one ``sequence`` shared by ids and mask; image height
    and width are ``Dim.AUTO``, which stays static where the model specialises it (ViT
    checks its image size in Python)."""
    from torch.export import Dim

    batch, sequence = Dim("batch"), Dim("sequence")
    shapes = {}
    for name, axes in dynamic_axes(model).items():
        dims = {0: batch}
        if len(axes) == 2:
            dims[1] = sequence
        elif len(axes) == 3:
            dims.update({2: Dim.AUTO, 3: Dim.AUTO})
        shapes[name] = dims
    return shapes


def input_batches(name: str, seeds: Iterable[int], batch: int = 2) -> list[tuple]:
    """Positional inputs of zoo model ``name`` drawn from its input generator, one batch per
    seed (``build`` draws the model's own example inputs with its ``seed``)."""
    import torch

    spec = _spec(name)
    return [spec.inputs(torch.Generator().manual_seed(seed), batch) for seed in seeds]


def export_onnx(
    name: str, path: str | Path, *, seed: int = 0, opset: int | None = None,
    attn_implementation: str = "eager", dynamic: bool = False,
) -> Path:
    """Build zoo model ``name`` and export it to ``path`` (a standalone ``.onnx``)."""
    model = build(name, seed=seed, attn_implementation=attn_implementation)
    return export_model(model, path, opset=opset, dynamic=dynamic)


def onnx_inputs(
    model: ZooModel, onnx_model: str | Path | onnx.ModelProto | None = None
) -> dict[str, np.ndarray]:
    """The model's inputs as numpy arrays keyed by ONNX graph input name.

    Without ``onnx_model`` every forward input is returned (dynamo export names graph inputs
    after the forward parameters).  With it, only the inputs the exported graph declares:
    the exporter drops inputs the graph does not use.
    """
    arrays = {n: t.detach().cpu().numpy() for n, t in model.named_inputs().items()}
    if onnx_model is None:
        return arrays
    names = _graph_input_names(onnx_model)
    missing = [n for n in names if n not in arrays]
    if missing:
        raise UsageError(f"zoo model {model.name!r} has no input for ONNX input(s) {missing}")
    return {n: arrays[n] for n in names}


def _graph_input_names(onnx_model: str | Path | onnx.ModelProto) -> list[str]:
    import onnx

    if not isinstance(onnx_model, onnx.ModelProto):
        onnx_model = onnx.load(str(onnx_model), load_external_data=False)
    initializers = {i.name for i in onnx_model.graph.initializer}
    return [i.name for i in onnx_model.graph.input if i.name not in initializers]


# ----------------------------------------------------------------------------- cache


def default_cache_dir() -> Path:
    """``$AMP_REWRITE_CACHE``, else ``<repo>/.cache/zoo`` in a checkout, else a temp dir."""
    env = os.environ.get("AMP_REWRITE_CACHE")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file() and os.access(repo, os.W_OK):
        return repo / ".cache" / "zoo"
    return Path(tempfile.gettempdir()) / "amp_rewrite_zoo"


def _cache_tag() -> str:
    """Changes whenever an export could differ: this file, torch, transformers, onnxscript."""
    from importlib import metadata  # not at module level: keeps ``import zoo`` at ~10 ms

    digest = hashlib.sha256(Path(__file__).read_bytes())
    for dist in ("torch", "transformers", "onnxscript"):
        try:
            digest.update(metadata.version(dist).encode())
        except metadata.PackageNotFoundError:
            digest.update(b"none")
    return digest.hexdigest()[:10]


def cached_onnx(
    name: str,
    cache_dir: str | Path | None = None,
    *,
    seed: int = 0,
    opset: int | None = None,
    attn_implementation: str = "eager",
    dynamic: bool = False,
) -> Path:
    """Path to zoo model ``name`` as ONNX, exporting it on first use only.

    Tests that need the same model share one export.  The file name carries the seed, the
    opset, the attention implementation and ``dynamic`` (where not the defaults) and a hash
    of this file and the torch/transformers/onnxscript versions, so a stale export is never
    reused.  ``attn_implementation="sdpa"`` and ``dynamic=True`` give the exports people
    deploy (transformers' default attention; symbolic batch and sequence axes).
    """
    _spec(name)  # fail on unknown names before touching the file system
    opset = opset or DEFAULT_OPSET
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    variant = ("" if attn_implementation == "eager" else f"-{attn_implementation}") + (
        "-dynamic" if dynamic else "")
    path = directory / f"{name}{variant}-seed{seed}-opset{opset}-{_cache_tag()}.onnx"
    if not path.is_file():
        log.info("exporting zoo model %s to %s", name, path)
        export_onnx(name, path, seed=seed, opset=opset,
                    attn_implementation=attn_implementation, dynamic=dynamic)
    return path
