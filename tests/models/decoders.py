"""KV-cache decoders as deployed: a decode step and a prefill of Llama- and Qwen2-style
models (GQA, rotary embeddings) and a Whisper-style decoder step (self- and cross-attention
caches), exported as optimum names their inputs and outputs.

* decode step: ``input_ids`` (batch, 1), ``attention_mask`` (batch, past + 1),
  ``position_ids`` (batch, 1), ``past_key_values.{i}.key/value`` (batch, kv_heads, past,
  head_dim) in; ``logits``, ``present.{i}.key/value`` (past + 1 rows) out. The past length
  is a dynamic axis, so one export runs at a 4-token and at a 1,000-token past.
* prefill: the same without ``past_key_values.*`` (16 prompt tokens, dynamic).
* Whisper decoder step: ``past_key_values.{i}.decoder.key/value`` (self attention, grows)
  and ``past_key_values.{i}.encoder.key/value`` (cross attention, fixed) in;
  ``present.{i}.decoder.key/value`` out.

Tiny configs (hidden 64, 4 heads, 2 KV heads, 2 layers, vocab 256) with seeded random
weights; attention is HF's default (SDPA), what people deploy. ``cached_decoder`` caches
exports like ``zoo.cached_onnx`` (same directory, a tag that changes with this file).
``import tests.models.decoders`` is cheap: torch and transformers load inside functions.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from amp_rewrite.errors import CaptureError, UsageError
from tests.models import zoo

if TYPE_CHECKING:
    import numpy as np
    import torch

log = logging.getLogger(__name__)

LAYERS = 2
KV_HEADS = 2
HEADS = 4
HIDDEN = 64
HEAD_DIM = HIDDEN // HEADS
VOCAB = 256
PROMPT = 16
PAST = 4  # the past length of the default decode-step inputs
ENCODER_FRAMES = 12  # Whisper: encoder positions the cross-attention cache holds
MAX_POSITIONS = 2048  # room for the 1,000-token-past checks
OPSET = 18


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    name: str
    arch: str  # "llama", "qwen2", "whisper"
    step: str  # "decode" or "prefill"
    model_type: str  # ORT transformers optimizer's model type for this architecture

    @property
    def has_past(self) -> bool:
        return self.step == "decode"


DECODERS: dict[str, DecoderSpec] = {s.name: s for s in (
    DecoderSpec("llama-decode", "llama", "decode", "gpt2"),
    DecoderSpec("llama-prefill", "llama", "prefill", "gpt2"),
    DecoderSpec("qwen2-decode", "qwen2", "decode", "gpt2"),
    DecoderSpec("qwen2-prefill", "qwen2", "prefill", "gpt2"),
    DecoderSpec("whisper-decode", "whisper", "decode", "bart"),
)}


def spec(name: str) -> DecoderSpec:
    try:
        return DECODERS[name]
    except KeyError:
        raise UsageError(f"unknown decoder {name!r}; known: {sorted(DECODERS)}") from None


# ----------------------------------------------------------------------------- models


def _hf_model(arch: str, seed: int) -> torch.nn.Module:
    import torch
    import transformers

    torch.manual_seed(seed)
    if arch in ("llama", "qwen2"):
        config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
        config = config_cls(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128,
            num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
            max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=False,
        )  # fmt: skip
        cls = {"llama": transformers.LlamaForCausalLM,
               "qwen2": transformers.Qwen2ForCausalLM}[arch]
    else:
        config = transformers.WhisperConfig(
            vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS,
            encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
            encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
            max_source_positions=ENCODER_FRAMES, max_target_positions=MAX_POSITIONS,
            pad_token_id=1, bos_token_id=2, eos_token_id=3, decoder_start_token_id=2,
        )  # fmt: skip
        cls = transformers.WhisperForConditionalGeneration
    model = cls(config).eval()
    with torch.no_grad():  # HF's init gives tiny weights; widen them so fp16 error shows
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


@functools.cache
def _wrappers() -> dict[str, type]:
    import torch
    from transformers import DynamicCache, EncoderDecoderCache

    def flat_present(cache, n: int) -> tuple:
        out = []
        for i in range(n):
            layer = cache.layers[i]
            out += [layer.keys, layer.values]
        return tuple(out)

    class CausalDecode(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *past):  # noqa: D102
            cache = DynamicCache(
                [(past[2 * i], past[2 * i + 1]) for i in range(len(past) // 2)],
                config=self.model.config)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=cache, use_cache=True)
            return (out.logits, *flat_present(out.past_key_values, len(past) // 2))

    class CausalPrefill(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):  # noqa: D102
            cache = DynamicCache(config=self.model.config)
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, past_key_values=cache, use_cache=True)
            return (out.logits, *flat_present(out.past_key_values,
                                              self.model.config.num_hidden_layers))

    class WhisperDecode(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, *past):  # noqa: D102
            self_kv = [(past[4 * i], past[4 * i + 1]) for i in range(LAYERS)]
            cross_kv = [(past[4 * i + 2], past[4 * i + 3]) for i in range(LAYERS)]
            cache = EncoderDecoderCache(DynamicCache(self_kv), DynamicCache(cross_kv))
            # The cross-attention cache is filled, so the encoder states are never read;
            # HF only needs them present to run the cross-attention layers.
            unread = past[2].new_zeros(past[2].shape[0], 1, HIDDEN)
            out = self.model.model.decoder(input_ids=input_ids, past_key_values=cache,
                                           encoder_hidden_states=unread, use_cache=True)
            logits = self.model.proj_out(out.last_hidden_state)
            return (logits, *flat_present(out.past_key_values.self_attention_cache, LAYERS))

    return {"decode": CausalDecode, "prefill": CausalPrefill, "whisper": WhisperDecode}


def input_names(name: str) -> list[str]:
    s = spec(name)
    if s.arch == "whisper":
        return ["input_ids"] + [f"past_key_values.{i}.{part}.{kv}" for i in range(LAYERS)
                                for part in ("decoder", "encoder") for kv in ("key", "value")]
    names = ["input_ids", "attention_mask", "position_ids"]
    if s.has_past:
        names += [f"past_key_values.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]
    return names


def output_names(name: str) -> list[str]:
    part = ".decoder" if spec(name).arch == "whisper" else ""
    return ["logits"] + [f"present.{i}{part}.{kv}" for i in range(LAYERS)
                         for kv in ("key", "value")]


def build(name: str, seed: int = 0) -> torch.nn.Module:
    """The wrapped float32 decoder (eval mode)."""
    s = spec(name)
    model = _hf_model(s.arch, seed)
    kind = "whisper" if s.arch == "whisper" else s.step
    return _wrappers()[kind](model).eval()


def inputs(name: str, past: int = PAST, seed: int = 0, batch: int = 1) -> dict[str, np.ndarray]:
    """Fixed inputs keyed by ONNX input name; ``past``: cached tokens of a decode step.

    The cache holds K/V of the magnitude a real one has (unit normal); Whisper's
    cross-attention cache holds ``ENCODER_FRAMES`` positions."""
    import numpy as np

    s = spec(name)
    rng = np.random.default_rng(seed)
    heads = HEADS if s.arch == "whisper" else KV_HEADS
    new = 1 if s.has_past else PROMPT
    feeds: dict[str, np.ndarray] = {
        "input_ids": rng.integers(4, VOCAB, (batch, new), dtype=np.int64)}
    if s.arch != "whisper":
        feeds["attention_mask"] = np.ones((batch, (past if s.has_past else 0) + new), np.int64)
        start = past if s.has_past else 0
        feeds["position_ids"] = np.broadcast_to(
            np.arange(start, start + new, dtype=np.int64), (batch, new)).copy()
    if s.has_past:
        for i in range(LAYERS):
            parts = ((("decoder", past), ("encoder", ENCODER_FRAMES)) if s.arch == "whisper"
                     else (("", past),))
            for part, length in parts:
                for kv in ("key", "value"):
                    key = f"past_key_values.{i}.{part + '.' if part else ''}{kv}"
                    feeds[key] = rng.standard_normal(
                        (batch, heads, length, HEAD_DIM)).astype(np.float32)
    return feeds


def _dynamic_shapes(name: str, count: int):
    import torch

    s = spec(name)
    batch = torch.export.Dim("batch", min=1, max=64)
    if s.arch == "whisper":
        past = torch.export.Dim("past", min=1, max=MAX_POSITIONS - 2)
        kv = []
        for _ in range(LAYERS):
            kv += [{0: batch, 2: past}, {0: batch, 2: past}, {0: batch}, {0: batch}]
        return ({0: batch}, tuple(kv))  # *past is one argument to torch.export
    if s.has_past:
        past = torch.export.Dim("past", min=1, max=MAX_POSITIONS - 2)
        total = past + 1
        kv = [{0: batch, 2: past}] * (count - 3)
        return ({0: batch}, {0: batch, 1: total}, {0: batch}, tuple(kv))
    seq = torch.export.Dim("sequence", min=2, max=MAX_POSITIONS)
    return ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: seq})


def export(name: str, path: str | Path, *, seed: int = 0, opset: int = OPSET) -> Path:
    """Export decoder ``name`` to one standalone ``.onnx`` (written atomically)."""
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    module = build(name, seed)
    feeds = inputs(name, seed=seed)
    args = tuple(torch.from_numpy(feeds[n]) for n in input_names(name))
    try:
        program = torch.onnx.export(
            module, args, dynamo=True, opset_version=opset, external_data=False,
            input_names=input_names(name), output_names=output_names(name),
            dynamic_shapes=_dynamic_shapes(name, len(args)), verbose=False,
        )  # fmt: skip
    except Exception as e:  # torch raises many types here; all mean "could not export"
        raise CaptureError(f"decoder {name!r}: ONNX export failed: {e}") from e
    return zoo.save_program(program, path)


def _tag() -> str:
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(zoo._cache_tag().encode())
    return digest.hexdigest()[:10]


def cached_decoder(name: str, cache_dir: str | Path | None = None, *, seed: int = 0,
                   opset: int = OPSET) -> Path:
    """Path to decoder ``name`` as ONNX, exported on first use only (see ``zoo.cached_onnx``)."""
    spec(name)
    directory = Path(cache_dir) if cache_dir is not None else zoo.default_cache_dir()
    path = directory / f"{name}-seed{seed}-opset{opset}-{_tag()}.onnx"
    if not path.is_file():
        log.info("exporting decoder %s to %s", name, path)
        export(name, path, seed=seed, opset=opset)
    return path


def torch_reference(name: str, feeds: dict[str, np.ndarray], seed: int = 0) -> list[np.ndarray]:
    """The float32 PyTorch outputs on ``feeds`` (an oracle the ONNX path did not compute)."""
    import torch

    module = build(name, seed)
    args = tuple(torch.from_numpy(feeds[n]) for n in input_names(name))
    with torch.no_grad():
        return [t.numpy() for t in module(*args)]
