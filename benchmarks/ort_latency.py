"""Latency of our ONNX output on onnxruntime, CUDA execution provider, against FP32 and peers.

Models, exported here with random weights (``torch.onnx.export(dynamo=True)``, no downloads):
BERT-base at 1x128 and 8x512 tokens, GPT-2 small at 1x128 and 8x512, ViT-B/16 and ResNet-50 on
32 images of 224x224 (the zoo's serving exports, ``zoo.py``, at the real sizes); a ~100M Llama
(hidden 768, 12 layers, 12 heads, FFN 2048, vocabulary 32000; the decoders' wrappers,
``decoders.py``): a prefill of 8x512 tokens, and a decode step at a 1,024-token past, also with
its cache in low precision (``--low-io``, ours only); the zoo's UNet stage on 8 latents of
4x64x64 and the decoders' Whisper decoder step (batch 1, 256-token past), both at those modules'
own (small) widths. ``--tiny`` shrinks every model and shape: a smoke test, not a benchmark.

Variants: ``fp32`` (the export as is); ``ours_fp16``, ``ours_bf16`` (``amp_rewrite.rewrite_onnx``
with its defaults, target ``ort``; ORT's CPU provider has almost no bf16 kernels, so bf16 runs on
CUDA only); ``ort_opt_fp16`` (onnxruntime's transformers optimizer, then its float16 conversion,
``peers.ort_optimizer_fp16``, with the model's type, or ``bert`` where that one raises: the
row's ``ort_model_type``); ``modelopt_fp16`` (ModelOpt AutoCast, ``peers.PEERS``, where it is
installed). Exports and conversions are kept in ``--work-dir`` and reused while this file, the
decoders', the zoo's and torch's versions stay the same.

Method: one ``InferenceSession`` on ``--provider``, inputs bound once as device OrtValues,
outputs bound to the device, ``--warmup`` runs, then the median of ``--runs`` timed
``run_with_iobinding`` calls (each returns after the provider synchronised). Every variant runs
in a fresh interpreter by default, so a crash or a hang costs one row (``--variant-timeout``).
``max_abs_error_vs_fp32``: the largest |output - FP32 output| on the same inputs, same provider
(``fp32_max_abs`` gives the scale); ``cuda_use_tf32``: whether the FP32 GEMMs ran in TF32.
``--profile`` adds a session with ORT's profiler: ``cast_share`` is the Cast nodes' share of the
nodes' time. On CUDA that time is measured on the host (ORT's released builds have no CUDA kernel
profiling), so it is the share of launch work, not of GPU time. ``memcpy_nodes`` and
``cpu_nodes`` name the copies ORT inserted and the nodes it left on the CPU provider.

``--json FILE`` is a list of rows ``{model, variant, median_ms, provider, device, ...}``,
rewritten after every row; a failed variant has ``median_ms: null`` and a one-line ``error``
(a comparison or profile that fails after the timing: ``compare_error``, ``profile_error``).
``tools/gpu_session.sh ort`` and ``ort2`` run it on the lent GPU.

    python -m benchmarks gpu ort [--models ...] [--variants ...] [--provider cuda|cpu]
        [--runs 100] [--warmup 10] [--tiny] [--profile] [--json FILE] [--work-dir DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from amp_rewrite.errors import AmpRewriteError, described
from amp_rewrite.fx.kernel_timing import cpu_model
from benchmarks import cli, deployed, peers
from tests.models import decoders, zoo

logger = logging.getLogger(__name__)

VARIANTS = ("fp32", "ours_fp16", "ours_bf16", "ort_opt_fp16", "modelopt_fp16")
OURS = ("ours_fp16", "ours_bf16")
PEER_VARIANTS = ("ort_opt_fp16", "modelopt_fp16")
# by --provider, which is also onnxruntime's name of the device its values live on
PROVIDERS = {"cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
             "cpu": ["CPUExecutionProvider"]}
PROFILED_RUNS = 10
GENERIC_ORT_MODEL_TYPE = "bert"  # the optimizer's fusions without a model's own patterns
ORT_MODEL_TYPE_KEY = "ort_model_type"  # metadata of ort_opt_fp16's model, and its row's key
ERROR_CHARS = 300

# the ~100M Llama of gpu_training.py, with its multi-head attention written out
LLAMA_100M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 12, "intermediate_size": 2048, "vocab_size": 32000}
LLAMA_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 256}
# zoo config overrides giving the real models (the zoo's own configs are the tiny ones)
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
             "intermediate_size": 3072, "max_position_embeddings": 512}
GPT2_SMALL = {"n_embd": 768, "n_layer": 12, "n_head": 12, "n_positions": 1024}
VIT_B16 = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
           "intermediate_size": 3072, "num_labels": 1000}
RESNET50 = {"embedding_size": 64, "hidden_sizes": [256, 512, 1024, 2048],
            "depths": [3, 4, 6, 3], "num_labels": 1000}


class VariantUnavailableError(AmpRewriteError):
    """A variant cannot run here (its converter is not installed, or the provider is missing)."""


# ----------------------------------------------------------------------------- inputs
# Each takes ``tiny`` and the case's shape; ids start at 4, clear of the special tokens.


def text_feeds(tiny: bool, batch: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"input_ids": rng.integers(4, 100, (batch, seq), dtype=np.int64),
            "attention_mask": np.ones((batch, seq), np.int64)}


def image_feeds(tiny: bool, batch: int, size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"pixel_values": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}


def latent_feeds(tiny: bool, batch: int, size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"sample": rng.standard_normal((batch, 4, size, size)).astype(np.float32),
            "timestep": rng.integers(0, 1000, (batch,)).astype(np.float32)}


def llama_feeds(tiny: bool, batch: int, new: int, past: int = 0) -> dict[str, np.ndarray]:
    """A prefill's inputs (``past=0``) or a decode step's, with a unit-normal cache."""
    sizes = LLAMA_TINY if tiny else LLAMA_100M
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(4, 100, (batch, new), dtype=np.int64),
             "attention_mask": np.ones((batch, past + new), np.int64),
             "position_ids": np.broadcast_to(np.arange(past, past + new, dtype=np.int64),
                                             (batch, new)).copy()}
    head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
    for name in llama_cache_names(sizes["num_hidden_layers"]) if past else ():
        feeds[name] = rng.standard_normal(
            (batch, sizes["num_key_value_heads"], past, head_dim)).astype(np.float32)
    return feeds


def whisper_feeds(tiny: bool, batch: int, past: int) -> dict[str, np.ndarray]:
    return decoders.inputs("whisper-decode", past=past, batch=batch)


def llama_cache_names(layers: int, prefix: str = "past_key_values") -> list[str]:
    """The cache's names as optimum gives them (what ``deployed.LOW_IO`` matches)."""
    return [f"{prefix}.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]


# ----------------------------------------------------------------------------- exports


def _export_zoo(name: str, full_config: Mapping[str, Any] | None) -> Callable[[Path, bool], None]:
    """A serving export (symbolic batch, sequence, image sides) of zoo model ``name``, with
    transformers' default attention; ``full_config`` makes it the real model."""

    def export(path: Path, tiny: bool) -> None:
        model = zoo.build(name, attn_implementation="sdpa",
                          real_sizes=not tiny and full_config is not None,
                          config=None if tiny else full_config)
        zoo.export_model(model, path, dynamic=True)

    return export


def _export_llama(step: str) -> Callable[[Path, bool], None]:
    """The Llama's prefill or decode step in the decoders' wrapper (logits and the cache out),
    exported with the decoders' symbolic batch, sequence and past axes."""

    def export(path: Path, tiny: bool) -> None:
        import torch

        module = decoders._wrappers()[step](_llama(tiny)).eval()
        layers = (LLAMA_TINY if tiny else LLAMA_100M)["num_hidden_layers"]
        # batch 2: an example axis of size 1 would be exported as a constant 1
        feeds = llama_feeds(tiny, batch=2, new=1 if step == "decode" else 4,
                            past=4 if step == "decode" else 0)
        names = list(feeds)
        program = torch.onnx.export(
            module, tuple(torch.from_numpy(feeds[n]) for n in names), dynamo=True,
            opset_version=decoders.OPSET, external_data=False, input_names=names,
            output_names=["logits", *llama_cache_names(layers, "present")],
            dynamic_shapes=decoders._dynamic_shapes(f"llama-{step}", len(names)), verbose=False)
        zoo.save_program(program, path)

    return export


def _llama(tiny: bool):
    import torch
    import transformers

    config = transformers.LlamaConfig(**(LLAMA_TINY if tiny else LLAMA_100M),
                                      max_position_embeddings=decoders.MAX_POSITIONS,
                                      tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()


def _export_whisper_step(path: Path, tiny: bool) -> None:
    # The decoders' Whisper step has one (small) size, and caches its own export.
    shutil.copyfile(decoders.cached_decoder("whisper-decode", path.parent), path)


@dataclasses.dataclass(frozen=True)
class Family:
    """One export, measured at one or more shapes; ``ort_model_type`` is the model type
    users give onnxruntime's transformers optimizer for it."""

    name: str
    export: Callable[[Path, bool], None]  # (path, tiny): write the FP32 model there
    feeds: Callable[..., dict[str, np.ndarray]]  # (tiny, **shape) -> inputs by name
    ort_model_type: str


FAMILIES = {f.name: f for f in (
    Family("bert_base", _export_zoo("bert", BERT_BASE), text_feeds, "bert"),
    Family("gpt2_small", _export_zoo("gpt2", GPT2_SMALL), text_feeds, "gpt2"),
    Family("vit_b16", _export_zoo("vit", VIT_B16), image_feeds, "vit"),
    Family("resnet50", _export_zoo("resnet", RESNET50), image_feeds, GENERIC_ORT_MODEL_TYPE),
    Family("llama_prefill", _export_llama("prefill"), llama_feeds,
           decoders.spec("llama-prefill").model_type),
    Family("llama_decode", _export_llama("decode"), llama_feeds,
           decoders.spec("llama-decode").model_type),
    Family("unet_block", _export_zoo("unet_block", None), latent_feeds, "unet"),
    Family("whisper_decoder_step", _export_whisper_step, whisper_feeds,
           decoders.spec("whisper-decode").model_type),
)}


@dataclasses.dataclass(frozen=True)
class Case:
    """A model row: a family's export at one shape (``full`` on the GPU, ``tiny`` otherwise).
    ``low_io``: ours keeps the KV cache in low precision; the peers cannot, so the table
    compares it with the peers of ``peers_of``."""

    name: str
    family: str
    full: Mapping[str, int]
    tiny: Mapping[str, int]
    low_io: bool = False
    peers_of: str | None = None

    @property
    def variants(self) -> tuple[str, ...]:
        return ("fp32", *OURS) if self.low_io else VARIANTS

    def feeds(self, tiny: bool) -> dict[str, np.ndarray]:
        return FAMILIES[self.family].feeds(tiny, **(self.tiny if tiny else self.full))


CASES = {c.name: c for c in (
    Case("bert_base_1x128", "bert_base", {"batch": 1, "seq": 128}, {"batch": 1, "seq": 16}),
    Case("bert_base_8x512", "bert_base", {"batch": 8, "seq": 512}, {"batch": 2, "seq": 32}),
    Case("gpt2_1x128", "gpt2_small", {"batch": 1, "seq": 128}, {"batch": 1, "seq": 16}),
    Case("gpt2_8x512", "gpt2_small", {"batch": 8, "seq": 512}, {"batch": 2, "seq": 32}),
    Case("vit_b16_32", "vit_b16", {"batch": 32, "size": 224}, {"batch": 2, "size": 32}),
    Case("resnet50_32", "resnet50", {"batch": 32, "size": 224}, {"batch": 2, "size": 32}),
    Case("llama_prefill_8x512", "llama_prefill", {"batch": 8, "new": 512},
         {"batch": 2, "new": 32}),
    Case("llama_decode_past1024", "llama_decode", {"batch": 1, "new": 1, "past": 1024},
         {"batch": 1, "new": 1, "past": 16}),
    Case("llama_decode_past1024_lowio", "llama_decode", {"batch": 1, "new": 1, "past": 1024},
         {"batch": 1, "new": 1, "past": 16}, low_io=True, peers_of="llama_decode_past1024"),
    Case("unet_block", "unet_block", {"batch": 8, "size": 64}, {"batch": 2, "size": 16}),
    Case("whisper_decoder_step", "whisper_decoder_step", {"batch": 1, "past": 256},
         {"batch": 1, "past": 4}),
)}


@functools.cache
def _export_tag() -> str:
    """Changes with this file, the decoders' and the zoo's (and torch's version): a stale
    export is never reused."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(decoders._tag().encode())
    return digest.hexdigest()[:10]


def exported(family: str, tiny: bool, work_dir: Path) -> Path:
    """The family's FP32 export in ``work_dir``, exported on first use only."""
    path = work_dir / f"{family}-{'tiny' if tiny else 'full'}-{_export_tag()}.onnx"
    if not path.is_file():
        from benchmarks.zoo_export import _quiet_exporter

        _quiet_exporter()
        path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("exporting %s to %s", family, path)
        FAMILIES[family].export(path, tiny)
    return path


# ----------------------------------------------------------------------------- variants


def _ours(dtype: str) -> Callable[[Path, Case], onnx.ModelProto]:
    def convert(path: Path, case: Case) -> onnx.ModelProto:
        low_io = list(deployed.LOW_IO) if case.low_io else []
        return deployed.convert_ours(path, dtype, target="ort", low_io=low_io)

    return convert


def _ort_optimizer_fp16(path: Path, case: Case) -> onnx.ModelProto:
    """With the family's model type; where its fusions raise (GPT-2's expects every Gemm to
    have a bias, and the dynamo export's LM head has none), with the generic type, as a user
    would retry."""
    model_type = FAMILIES[case.family].ort_model_type
    try:
        model = peers.ort_optimizer_fp16(path, model_type)
    except Exception as e:  # its fusions index into graphs they do not expect
        if model_type == GENERIC_ORT_MODEL_TYPE:
            raise
        logger.warning("ORT optimizer, model type %s: %s; retrying with %s", model_type,
                       described(e), GENERIC_ORT_MODEL_TYPE)
        model_type = GENERIC_ORT_MODEL_TYPE
        model = peers.ort_optimizer_fp16(path, model_type)
    # the row reports it (the conversion is reused from its file by later rows)
    onnx.helper.set_model_props(model, {ORT_MODEL_TYPE_KEY: model_type})
    return model


def _modelopt_fp16(path: Path, case: Case) -> onnx.ModelProto:
    peer = peers.PEERS["modelopt_autocast"]
    reason = peer.unavailable_reason()
    if reason is not None:
        raise VariantUnavailableError(f"ModelOpt AutoCast is not installed: {reason}")
    return peer(onnx.load(str(path)), "float16")


CONVERTERS: dict[str, Callable[[Path, Case], onnx.ModelProto]] = {
    "ours_fp16": _ours("float16"), "ours_bf16": _ours("bfloat16"),
    "ort_opt_fp16": _ort_optimizer_fp16, "modelopt_fp16": _modelopt_fp16,
}


def variant_model(case: Case, variant: str, tiny: bool, work_dir: Path) -> Path:
    """The variant's model file, converted from the export on first use only (the cases of
    one family share their conversions)."""
    source = exported(case.family, tiny, work_dir)
    if variant == "fp32":
        return source
    path = source.with_name(f"{source.stem}.{variant}{'.lowio' if case.low_io else ''}.onnx")
    if not path.is_file():
        model = CONVERTERS[variant](source, case)
        tmp = path.with_suffix(".tmp")
        onnx.save(model, str(tmp))
        os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------- sessions


@functools.cache
def _preload_cuda_libraries() -> None:
    """onnxruntime-gpu finds cuDNN and cuBLAS in the nvidia wheels (torch's) only this way."""
    import onnxruntime as ort

    ort.preload_dlls()


def new_session(path: Path, provider: str, options=None):
    """A session on ``provider``; VariantUnavailableError where onnxruntime fell back to the
    CPU (it does so silently when the CUDA provider cannot load)."""
    import onnxruntime as ort

    if provider == "cuda":
        _preload_cuda_libraries()
    if options is None:
        options = ort.SessionOptions()
    options.log_severity_level = 3
    wanted = PROVIDERS[provider]
    session = ort.InferenceSession(str(path), options, providers=wanted)
    if wanted[0] not in session.get_providers():
        raise VariantUnavailableError(f"onnxruntime has no working {wanted[0]} here "
                                      f"(got {session.get_providers()})")
    return session


def _element_type(ort_type: str) -> int:
    """``"tensor(float16)"`` -> ``TensorProto.FLOAT16``."""
    return onnx.TensorProto.DataType.Value(ort_type.removeprefix("tensor(").rstrip(")").upper())


def _bits(array: np.ndarray) -> np.ndarray:
    """The array as numpy holds it; bfloat16 (ml_dtypes) as its raw 16 bits, which is how
    onnxruntime takes it."""
    array = np.ascontiguousarray(array)
    return array.view(np.uint16) if array.dtype.name == "bfloat16" else array


def bind(session, feeds: Mapping[str, np.ndarray], provider: str):
    """An IO binding with every input copied to the device once, in the dtype the model
    declares (a low-io cache is fed low), and every output left on the device."""
    import onnxruntime as ort

    binding = session.io_binding()
    for meta in session.get_inputs():
        element = _element_type(meta.type)
        array = np.asarray(feeds[meta.name])
        if np.issubdtype(array.dtype, np.floating):
            array = array.astype(onnx.helper.tensor_dtype_to_np_dtype(element))
        value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), element, provider)
        value.update_inplace(_bits(array))
        binding.bind_ortvalue_input(meta.name, value)
    for meta in session.get_outputs():
        binding.bind_output(meta.name, provider)
    return binding


def read_outputs(session, binding) -> list[np.ndarray]:
    """The outputs of one more run, as float32 on the host; the binding must have run once
    (its outputs give the shapes). Each is bound to a host buffer: numpy has no bfloat16, so
    ``.numpy()`` cannot return a bf16 output."""
    import onnxruntime as ort

    buffers = []
    for meta, value in zip(session.get_outputs(), binding.get_outputs(), strict=True):
        element = value.element_type()
        dtype = onnx.helper.tensor_dtype_to_np_dtype(element)
        buffer = np.empty(value.shape(), np.uint16 if dtype.name == "bfloat16" else dtype)
        binding.bind_ortvalue_output(
            meta.name, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(buffer, element))
        buffers.append(buffer.view(dtype))
    session.run_with_iobinding(binding)
    return [b.astype(np.float32) for b in buffers]


def output_error(got: list[np.ndarray], reference: list[np.ndarray]) -> dict:
    """``max_abs_error_vs_fp32`` (null where an output is NaN/Inf and FP32's is not: then
    ``nonfinite_outputs`` counts them) and ``fp32_max_abs``, its scale."""
    worst, nonfinite = 0.0, 0
    for g, r in zip(got, reference, strict=True):
        if g.shape != r.shape:
            raise ValueError(f"an output has shape {g.shape}, FP32's has {r.shape}")
        diff = np.abs(g - r)
        bad = ~np.isfinite(diff) & np.isfinite(r)
        nonfinite += int(bad.sum())
        worst = max(worst, float(np.max(diff[~bad], initial=0.0)))
    scale = max(float(np.max(np.abs(r), initial=0.0)) for r in reference)
    if nonfinite:
        return {"max_abs_error_vs_fp32": None, "nonfinite_outputs": nonfinite,
                "fp32_max_abs": scale}
    return {"max_abs_error_vs_fp32": worst, "fp32_max_abs": scale}


# ----------------------------------------------------------------------------- profile


def profile(path: Path, feeds: Mapping[str, np.ndarray], provider: str) -> dict:
    """``cast_share``, ``memcpy_nodes`` and ``cpu_nodes`` from ORT's profile of a few runs."""
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "ort")
        session = new_session(path, provider, options)
        binding = bind(session, feeds, provider)
        for _ in range(PROFILED_RUNS):
            session.run_with_iobinding(binding)
        events = json.loads(Path(session.end_profiling()).read_text())
    return profile_summary(events, provider)


def profile_summary(events: list[dict], provider: str) -> dict:
    """From ORT's trace events: the Cast nodes' share of all nodes' time, the names of the
    Memcpy nodes, and of the nodes on the CPU provider when another provider was asked for."""
    nodes = [e for e in events
             if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    total = sum(e["dur"] for e in nodes)
    casts = sum(e["dur"] for e in nodes if e["args"].get("op_name") == "Cast")

    def names(keep: Callable[[dict], bool]) -> list[str]:
        return sorted({e["name"].removesuffix("_kernel_time") for e in nodes if keep(e["args"])})

    on_cpu = provider != "cpu"
    return {"cast_share": casts / total if total else 0.0,
            "memcpy_nodes": names(lambda a: a.get("op_name", "").startswith("Memcpy")),
            "cpu_nodes": names(lambda a: on_cpu and a.get("provider") == "CPUExecutionProvider")}


# ----------------------------------------------------------------------------- rows


@functools.cache
def device_name(provider: str) -> str:
    """The GPU's name (``nvidia-smi``) on CUDA, else the CPU's model."""
    if provider == "cuda":
        try:
            done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                                   "-i", "0"], capture_output=True, text=True, timeout=30)
            return done.stdout.strip() or "unknown GPU"
        except (OSError, subprocess.TimeoutExpired):
            return "unknown GPU"
    return cpu_model()


def failed_row(case: str, variant: str, provider: str, error: str) -> dict:
    return {"model": case, "variant": variant, "median_ms": None, "provider": provider,
            "device": device_name(provider), "error": error.replace("\n", " ")[:ERROR_CHARS]}


def measure_row(case: Case, variant: str, args: argparse.Namespace) -> dict:
    """The variant's row: a failure before its time is known is the row's ``error``; the
    comparison and the profile after it note their own failures beside the time."""
    try:
        row, outputs = _timed(case, variant, args)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a result, not a crash
        return failed_row(case.name, variant, args.provider, described(e))
    row.update(_compared(outputs, case, variant, args))
    if args.profile:
        row.update(_profiled(case, variant, args))
    return row


def _timed(case: Case, variant: str, args: argparse.Namespace) -> tuple[dict, list[np.ndarray]]:
    """The row with its median, and the outputs of one more run."""
    session = new_session(variant_model(case, variant, args.tiny, args.work_dir),
                          args.provider)
    binding = bind(session, case.feeds(args.tiny), args.provider)
    row = {"model": case.name, "variant": variant,
           "median_ms": deployed.median_run_ms(session, binding, args.runs, args.warmup),
           "provider": args.provider, "device": device_name(args.provider)}
    if args.provider == "cuda":  # TF32 GEMMs make the FP32 baseline faster and coarser
        options = session.get_provider_options()["CUDAExecutionProvider"]
        row["cuda_use_tf32"] = options.get("use_tf32") == "1"
    metadata = session.get_modelmeta().custom_metadata_map
    if ORT_MODEL_TYPE_KEY in metadata:
        row[ORT_MODEL_TYPE_KEY] = metadata[ORT_MODEL_TYPE_KEY]
    return row, read_outputs(session, binding)


def _compared(outputs: list[np.ndarray], case: Case, variant: str,
              args: argparse.Namespace) -> dict:
    """fp32 saves its outputs; the others' error against them (run here if fp32's row did
    not save them)."""
    source = exported(case.family, args.tiny, args.work_dir)
    reference = source.with_name(f"{source.stem}.{case.name}.{args.provider}.fp32-outputs.npz")
    try:
        if variant == "fp32":
            _save_outputs(reference, outputs)
            return {}
        if not reference.is_file():
            _save_outputs(reference, _fp32_outputs(case, args))
        with np.load(reference) as saved:
            return output_error(outputs, [saved[f"arr_{i}"] for i in range(len(saved.files))])
    except Exception as e:  # noqa: BLE001 - recorded in the row beside its time
        return {"compare_error": described(e)[:ERROR_CHARS]}


def _profiled(case: Case, variant: str, args: argparse.Namespace) -> dict:
    try:
        return profile(variant_model(case, variant, args.tiny, args.work_dir),
                       case.feeds(args.tiny), args.provider)
    except Exception as e:  # noqa: BLE001 - recorded in the row beside its time
        return {"profile_error": described(e)[:ERROR_CHARS]}


def _fp32_outputs(case: Case, args: argparse.Namespace) -> list[np.ndarray]:
    session = new_session(variant_model(case, "fp32", args.tiny, args.work_dir), args.provider)
    binding = bind(session, case.feeds(args.tiny), args.provider)
    session.run_with_iobinding(binding)
    return read_outputs(session, binding)


def _save_outputs(path: Path, outputs: list[np.ndarray]) -> None:
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, *outputs)
    os.replace(tmp, path)


def row_in_fresh_process(case: Case, variant: str, args: argparse.Namespace) -> dict:
    """The row measured by ``python -m benchmarks gpu ort --same-process`` in a fresh
    interpreter, killed after ``--variant-timeout`` seconds. (Not ``timing.rows_in_fresh_process``:
    a hung CUDA session must cost one row, not the section.)"""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        argv = [sys.executable, "-m", "benchmarks", "gpu", "ort", "--same-process",
                "--models", case.name, "--variants", variant, *_shared_flags(args),
                "--json", str(out)]
        try:
            done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, timeout=args.variant_timeout, check=False,
                                  env=cli.child_env())
        except subprocess.TimeoutExpired:
            return failed_row(case.name, variant, args.provider,
                              f"killed after {args.variant_timeout:g} s")
        if out.is_file():
            return json.loads(out.read_text())[0]
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return failed_row(case.name, variant, args.provider, f"the fresh process failed: {last}")


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return ["--provider", args.provider, "--runs", str(args.runs), "--warmup",
            str(args.warmup), "--work-dir", str(args.work_dir),
            *(["--tiny"] if args.tiny else []), *(["--profile"] if args.profile else [])]


def run(args: argparse.Namespace) -> list[dict]:
    """Every chosen (model, variant), in order; the JSON is rewritten after each row."""
    rows: list[dict] = []
    for case in (CASES[name] for name in args.models):
        failure = _export_failure(case.family, args.tiny, args.work_dir)
        for variant in (v for v in args.variants if v in case.variants):
            if failure is not None:
                row = failed_row(case.name, variant, args.provider, f"export failed: {failure}")
            elif args.same_process:
                row = measure_row(case, variant, args)
            else:
                row = row_in_fresh_process(case, variant, args)
            rows.append(row)
            write_rows(args.json, rows)
            print(format_row(row), flush=True)
    return rows


@functools.cache
def _export_failure(family: str, tiny: bool, work_dir: Path) -> str | None:
    """None once the family is exported (here, so that no variant's process pays for it),
    else why not; asked once per family."""
    try:
        exported(family, tiny, work_dir)
    except Exception as e:  # noqa: BLE001 - every row of the family records it
        return described(e)
    return None


def write_rows(path: Path | None, rows: list[dict]) -> None:
    """The rows as a JSON list, replacing ``path`` atomically (a killed run keeps its rows)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rows, indent=1))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- table


def format_row(row: dict) -> str:
    ms = f"{row['median_ms']:10.3f} ms" if row["median_ms"] is not None else "    failed"
    extra = row.get("error") or (f"max abs err {row['max_abs_error_vs_fp32']:.2e}"
                                 if row.get("max_abs_error_vs_fp32") is not None else "")
    return f"{row['model']:28s} {row['variant']:14s} {ms}  {extra}"


def format_table(rows: list[dict]) -> str:
    """Models by variants (median ms), and ours_fp16's speed-up over fp32 and over the
    fastest peer (the peers convert to fp16 only); failures listed below."""
    cells: dict[str, dict[str, dict]] = {}
    for row in rows:
        cells.setdefault(row["model"], {})[row["variant"]] = row
    head = ["model", *VARIANTS, "fp16 vs fp32", "fp16 vs best peer"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for model, by_variant in cells.items():
        ms = {v: by_variant.get(v, {}).get("median_ms") for v in VARIANTS}
        peers_of = CASES[model].peers_of if model in CASES else None
        peer_rows = cells.get(peers_of, by_variant) if peers_of else by_variant
        peer_ms = [r["median_ms"] for v, r in peer_rows.items()
                   if v in PEER_VARIANTS and r["median_ms"] is not None]
        lines.append(" | ".join([
            model, *(_cell(v, by_variant, ms[v]) for v in VARIANTS),
            _speedup(ms["fp32"], ms["ours_fp16"]),
            _speedup(min(peer_ms) if peer_ms else None, ms["ours_fp16"])]))
    failures = [f"  {r['model']} {r['variant']}: {r['error']}" for r in rows if "error" in r]
    return "\n".join(lines + (["failed:", *failures] if failures else []))


def _cell(variant: str, by_variant: dict, ms: float | None) -> str:
    if ms is not None:
        return f"{ms:.3f}"
    return "failed" if variant in by_variant else "-"


def _speedup(base: float | None, ours: float | None) -> str:
    return f"{base / ours:.2f}x" if base is not None and ours else "-"


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks gpu ort",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(CASES), default=list(CASES),
                   metavar="MODEL", help=f"any of {', '.join(CASES)} (default: all)")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                   metavar="VARIANT", help=f"any of {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--provider", choices=list(PROVIDERS), default="cuda")
    p.add_argument("--runs", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny models and shapes (smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="also profile each variant: cast_share, memcpy_nodes, cpu_nodes")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the rows here")
    p.add_argument("--work-dir", type=Path, default=zoo.default_cache_dir() / "ort_latency",
                   help="exports, conversions and FP32 outputs (reused while valid)")
    p.add_argument("--variant-timeout", type=float, default=600.0, metavar="S",
                   help="seconds a variant's fresh process may take")
    p.add_argument("--same-process", action="store_true",
                   help="measure every variant in this process (default: each in a fresh one)")
    args = p.parse_args(argv)
    args.variants = [v for v in VARIANTS if v in args.variants]
    args.work_dir = args.work_dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print(f"onnxruntime {_ort_version()}, provider {args.provider} on "
          f"{device_name(args.provider)}, median of {args.runs} runs after {args.warmup}"
          f"{' (tiny models)' if args.tiny else ''}")
    rows = run(args)
    print(format_table(rows))
    if args.json is not None:
        print(f"wrote {args.json}")
    return 0 if any(r["median_ms"] is not None for r in rows) else 1


def _ort_version() -> str:
    import onnxruntime as ort

    return ort.__version__
