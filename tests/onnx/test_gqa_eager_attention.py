"""GroupQueryAttention from Llama/Qwen2 decoders exported with ``attn_implementation="eager"``
(docs/design.md §7.1): ``softmax(q·kᵀ·scale + mask)·v`` on the ``repeat_kv`` of the
cache-concatenated keys and values, the spelling several exporters force.

The models are built as a user builds them (transformers config with
``attn_implementation="eager"``, ``use_cache=True``, random weights, ``torch.onnx.export(...,
dynamo=True)`` with dynamic batch, sequence and past), mirroring the SDPA fixtures of
``tests/models/decoders.py``. Oracles: onnxruntime CPU on the FP32 export, and the node and
cast counts of onnxruntime's transformers optimizer + float16 on the same export.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from benchmarks import deployed
from tests.models import decoders

TOLERANCE = 1e-2
LEFT_PAD = 5  # padding tokens at the start of the second prompt (batched generation)
LONG_PAST = 1000
FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16,
               onnx.TensorProto.DOUBLE}

pytestmark = pytest.mark.slow


def _eager_model(arch: str, seed: int = 0):
    """The fixtures' tiny GQA decoder (2 layers, 4 query / 2 KV heads, rotary), eager."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    config = config_cls(
        vocab_size=decoders.VOCAB, hidden_size=decoders.HIDDEN, intermediate_size=128,
        num_hidden_layers=decoders.LAYERS, num_attention_heads=decoders.HEADS,
        num_key_value_heads=decoders.KV_HEADS, max_position_embeddings=decoders.MAX_POSITIONS,
        tie_word_embeddings=False, use_cache=True, attn_implementation="eager",
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():  # as the fixtures: weights wide enough for fp16 error to show
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model


def _export(name: str, path) -> str:
    import torch

    spec = decoders.spec(name)
    module = decoders._wrappers()[spec.step](_eager_model(spec.arch)).eval()
    feeds = decoders.inputs(name)
    args = tuple(torch.from_numpy(feeds[n]) for n in decoders.input_names(name))
    program = torch.onnx.export(
        module, args, dynamo=True, opset_version=decoders.OPSET, external_data=False,
        input_names=decoders.input_names(name), output_names=decoders.output_names(name),
        dynamic_shapes=decoders._dynamic_shapes(name, len(args)), verbose=False,
    )  # fmt: skip
    program.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def eager_exports(tmp_path_factory):
    directory = tmp_path_factory.mktemp("eager")
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = _export(name, directory / f"{name}-eager.onnx")
        return cache[name]

    return get


@pytest.fixture(scope="module")
def rewritten(eager_exports):
    import amp_rewrite

    cache: dict[str, onnx.ModelProto] = {}

    def get(name: str) -> onnx.ModelProto:
        if name not in cache:
            cache[name] = amp_rewrite.rewrite_onnx(eager_exports(name), dtype="float16")
        return cache[name]

    return get


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("name", ["llama-decode", "llama-prefill", "qwen2-decode",
                                  "qwen2-prefill"])
def test_eager_export_fuses_to_group_query_attention(eager_exports, rewritten, name):
    export = onnx.load(eager_exports(name))
    assert _ops(export).count("Softmax") == decoders.LAYERS  # the eager spelling is there
    model = rewritten(name)
    ops = _ops(model)
    assert ops.count("GroupQueryAttention") == decoders.LAYERS, ops
    assert "MultiHeadAttention" not in ops and "Softmax" not in ops, ops
    # the head repeat is gone: the Expands left are integer index and seqlens_k builders
    types = {v.name: v.type.tensor_type.elem_type for v in
             [*model.graph.value_info, *model.graph.input, *model.graph.output]}
    expanded = {types.get(n.output[0]) for n in model.graph.node if n.op_type == "Expand"}
    assert expanded <= {onnx.TensorProto.INT32, onnx.TensorProto.INT64}, expanded
    for node in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["num_heads"] == decoders.HEADS and attrs["kv_num_heads"] == decoders.KV_HEADS
        assert attrs["scale"] == pytest.approx(decoders.HEAD_DIM ** -0.5)
        if decoders.spec(name).has_past:  # the cache Concat became GQA's past/present
            assert node.input[3].startswith("past_key_values.")


def _float_casts(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Casts to a float type (the precision casts; the index casts to bool/int32 are not)."""
    return [n for n in model.graph.node if n.op_type == "Cast"
            and onnx.helper.get_attribute_value(n.attribute[0]) in FLOAT_TYPES]


@pytest.mark.parametrize("name", ["llama-decode", "qwen2-decode"])
def test_casts_against_ort_optimizer_fp16(eager_exports, rewritten, name):
    """Our casts are ORT optimizer + float16's plus the fp16 casts of the two rotary tables.

    ORT's float16 conversion casts the float positions to fp16 and computes the angles
    position·inv_freq in fp16 (half a radian off at position 1,000); the plan keeps the
    angles and Cos/Sin in fp32 and casts the tables, once for every layer. The one
    remaining cast, int64→int32 for GroupQueryAttention's seqlens_k, is an index cast."""
    pytest.importorskip("onnxruntime.transformers.optimizer")
    from benchmarks import peers

    path = eager_exports(name)
    ort_model = peers.ort_optimizer_fp16(path, decoders.spec(name).model_type)
    model = rewritten(name)
    producers = {o: n for n in model.graph.node for o in n.output}
    ours = _float_casts(model)
    rotary_tables = [n for n in ours if producers.get(n.input[0]) is not None
                     and producers[n.input[0]].op_type in ("Cos", "Sin")]
    assert len(rotary_tables) == 2, [n.input[0] for n in ours]
    assert len(ours) - len(rotary_tables) <= len(_float_casts(ort_model))
    casts = _ops(model).count("Cast")
    assert casts - len(rotary_tables) - 1 <= _ops(ort_model).count("Cast"), casts
    # what the table casts keep: a 1,000-token past stays within fp16 tolerance
    feeds = decoders.inputs(name, past=LONG_PAST, batch=2)
    reference = deployed.run_ort(onnx.load(path), feeds)
    got = deployed.run_ort(model, feeds)
    assert deployed.relative_error(got, reference) <= TOLERANCE


# ------------------------------------------------ prefill, then a decode step on its cache


def _left_padded_prompt() -> dict[str, np.ndarray]:
    """Two prompts; the second has LEFT_PAD padding tokens first, positions counted from its
    first real token (how transformers batches prompts for generation)."""
    feeds = decoders.inputs("llama-prefill", batch=2)
    feeds["attention_mask"][1, :LEFT_PAD] = 0
    feeds["position_ids"][1] = np.maximum(np.arange(decoders.PROMPT) - LEFT_PAD, 0)
    return feeds


def _decode_feeds(prompt: dict[str, np.ndarray], present: list[np.ndarray]) -> dict:
    """One next token per row on the cache the prefill returned."""
    rng = np.random.default_rng(7)
    batch = prompt["input_ids"].shape[0]
    mask = np.concatenate([prompt["attention_mask"], np.ones((batch, 1), np.int64)], axis=1)
    feeds = {"input_ids": rng.integers(4, decoders.VOCAB, (batch, 1), dtype=np.int64),
             "attention_mask": mask,
             "position_ids": prompt["position_ids"][:, -1:] + 1}
    names = [n for n in decoders.input_names("llama-decode") if n.startswith("past_key_values")]
    feeds.update(zip(names, present))
    return feeds


def _valid(outputs: list[np.ndarray], mask: np.ndarray) -> list[np.ndarray]:
    """Logits at the valid query rows and the cache at the valid key positions: a padded
    row's outputs past the first layer derive from fully masked queries, undefined in both."""
    keys = mask.astype(bool)
    logits = outputs[0]
    rows = [logits[b, keys[b][-logits.shape[1]:]] for b in range(len(mask))]
    cache = [p[b][:, keys[b]] for p in outputs[1:] for b in range(len(mask))]
    return rows + cache


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_then_decode_matches_fp32_onnxruntime(eager_exports, rewritten, arch):
    """fp16 rewrite vs the FP32 export, both on onnxruntime CPU, each decode step fed its own
    prefill's cache: logits and present K/V within 1e-2 relative, all finite."""
    prefill, decode = f"{arch}-prefill", f"{arch}-decode"
    prompt = _left_padded_prompt()
    fp32_prefill = deployed.run_ort(onnx.load(eager_exports(prefill)), prompt)
    ours_prefill = deployed.run_ort(rewritten(prefill), prompt)
    assert all(np.isfinite(out).all() for out in ours_prefill)
    mask = prompt["attention_mask"]
    assert deployed.relative_error(_valid(ours_prefill, mask),
                                   _valid(fp32_prefill, mask)) <= TOLERANCE

    fp32_step = _decode_feeds(prompt, fp32_prefill[1:])
    ours_step = _decode_feeds(prompt, ours_prefill[1:])
    fp32_decode = deployed.run_ort(onnx.load(eager_exports(decode)), fp32_step)
    ours_decode = deployed.run_ort(rewritten(decode), ours_step)
    assert all(np.isfinite(out).all() for out in ours_decode)
    mask = fp32_step["attention_mask"]
    assert deployed.relative_error([ours_decode[0]], [fp32_decode[0]]) <= TOLERANCE
    assert deployed.relative_error(_valid(ours_decode, mask),
                                   _valid(fp32_decode, mask)) <= TOLERANCE


# ----------------------------------------------------------------- unproven masks decline


@pytest.mark.parametrize("mutation", ["strict_causal", "no_padding"])
def test_eager_gqa_declines_unproven_masks(eager_exports, mutation):
    """A mask the proof cannot equate with causal ∧ padding keeps the attention unfused by
    GQA (onnxscript's SDPA rule takes it to MultiHeadAttention, which reads the mask)."""
    import onnx_ir as ir

    from amp_rewrite.onnx.api import rewrite_onnx_model

    model = ir.load(eager_exports("llama-decode"))
    if mutation == "strict_causal":
        next(n for n in model.graph if n.op_type == "LessOrEqual").op_type = "Less"
    else:
        gather = next(n for n in model.graph if n.op_type == "GatherND")
        outer = next(u.node for u in gather.outputs[0].uses() if u.node.op_type == "And")
        outer.replace_input_with(1, outer.inputs[0])
    fused = rewrite_onnx_model(model).report["fused"]
    assert "com.microsoft::GroupQueryAttention" not in fused, fused
    assert fused.get("com.microsoft::MultiHeadAttention") == decoders.LAYERS, fused
