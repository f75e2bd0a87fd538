"""Sanity tests of the model zoo: every model builds, runs, captures, and stays deterministic.

Oracles: output shapes derived by hand from each tiny config (not from the code), the eager
FP32 forward for torch.export and onnxruntime.  Every model's ONNX agreement is checked by
``python -m benchmarks zoo``; here a subset that covers every wrapper kind keeps this file fast.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from amp_rewrite.errors import UsageError
from tests.models import zoo

# Hand-derived from the configs in zoo.py: batch 2, 16 tokens (8 decoder tokens), vocab 128,
# hidden 32, 10 classes; wav2vec2: 400 samples -> (400-10)//5+1 = 79 -> (79-3)//2+1 = 39
# frames; CLIP: (32/8)^2 = 16 patches + CLS; SegFormer: 64x64 image / stride 4, 5 classes.
EXPECTED_SHAPES = {
    "bert": [(2, 16, 32), (2, 32)],
    "roberta": [(2, 3)],
    "albert": [(2, 16, 32), (2, 32)],
    "distilbert": [(2, 16, 32)],
    "gpt2": [(2, 16, 128)],
    "llama": [(2, 16, 128)],
    "t5": [(2, 8, 128)],
    "bart": [(2, 8, 128)],
    "vit": [(2, 10)],
    "deit": [(2, 10)],
    "swin": [(2, 10)],
    "resnet": [(2, 10)],
    "convnext": [(2, 10)],
    "mobilenet_v2": [(2, 10)],
    "whisper_encoder": [(2, 16, 32)],
    "wav2vec2": [(2, 39, 32)],
    "clip_vision": [(2, 17, 32), (2, 32)],
    "segformer": [(2, 5, 16, 16)],
    "clip_text": [(2, 77, 32), (2, 32)],
    "llama_32k": [(2, 16, 32000)],
    "unet_block": [(2, 4, 16, 16)],  # predicted noise has the latents' shape
}
REQUIRED = {
    "bert", "distilbert", "gpt2", "llama", "t5", "bart", "vit", "swin", "resnet", "convnext",
    "mobilenet_v2", "whisper_encoder", "wav2vec2", "clip_vision", "segformer",
}  # fmt: skip
MASKED = ["bert", "roberta", "albert", "distilbert", "gpt2", "llama", "t5", "bart", "clip_text",
          "llama_32k"]
# One model per wrapper kind (text, seq2seq, image with BatchNorm, audio features/values).
ONNX_SUBSET = ["llama", "bart", "resnet", "whisper_encoder", "wav2vec2"]


def _outputs(model: zoo.ZooModel) -> list[torch.Tensor]:
    out = model.run()
    return list(out) if isinstance(out, tuple) else [out]


@pytest.fixture(scope="module")
def models() -> dict[str, zoo.ZooModel]:
    return {name: zoo.build(name) for name in zoo.NAMES}


def test_names_cover_required_architectures() -> None:
    assert REQUIRED <= set(zoo.NAMES)
    assert set(zoo.NAMES) == set(EXPECTED_SHAPES)


def test_import_does_not_load_torch() -> None:
    code = "import sys, tests.models.zoo; print('torch' in sys.modules, 'onnx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])  # the checkout: tests.models
    assert out.stdout.split() == ["False", "False"]  # transformers needs torch: covered


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.NAMES)
def test_forward_shapes_finite_and_not_degenerate(models: dict, name: str) -> None:
    model = models[name]
    assert not model.module.training
    assert all(p.dtype == torch.float32 for p in model.module.parameters())
    assert ("attention_mask" in model.named_inputs()) == (name in MASKED)
    outs = _outputs(model)
    assert [tuple(o.shape) for o in outs] == EXPECTED_SHAPES[name]
    for o in outs:
        assert o.dtype == torch.float32
        assert torch.isfinite(o).all()
        # Vanishing activations (e.g. BatchNorm left uncalibrated) make a useless test model.
        assert o.std() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.NAMES)
def test_torch_export_matches_eager(models: dict, name: str) -> None:
    model = models[name]
    program = torch.export.export(model.module, model.args, model.kwargs, strict=False)
    with torch.no_grad():
        got = program.module()(*model.args, **model.kwargs)
    got = list(got) if isinstance(got, tuple) else [got]
    for g, want in zip(got, _outputs(model), strict=True):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("name", zoo.NAMES)
def test_sdpa_attention_matches_eager(models: dict, name: str) -> None:
    sdpa = zoo.build(name, attn_implementation="sdpa")
    for got, want in zip(_outputs(sdpa), _outputs(models[name]), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", MASKED)
def test_attention_mask_reaches_the_model(models: dict, name: str) -> None:
    model = models[name]
    inputs = model.named_inputs()
    assert inputs["attention_mask"].dtype == torch.int64
    assert (inputs["attention_mask"] == 0).any()  # the zoo's mask really masks something
    unmasked = dict(inputs, attention_mask=torch.ones_like(inputs["attention_mask"]))
    with torch.no_grad():
        changed = model.module(**unmasked)
    changed = changed[0] if isinstance(changed, tuple) else changed
    assert not torch.allclose(changed, _outputs(model)[0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "resnet"])
def test_build_is_seeded_and_leaves_global_rng_alone(name: str) -> None:
    state = torch.random.get_rng_state()
    a, b, c = zoo.build(name, seed=0), zoo.build(name, seed=0), zoo.build(name, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)
    for x, y in zip(a.args, b.args, strict=True):
        assert torch.equal(x, y)
    for (key, x), y in zip(a.module.state_dict().items(), b.module.state_dict().values()):
        assert torch.equal(x, y), key
    assert not torch.equal(_outputs(a)[0], _outputs(c)[0])


@pytest.mark.slow
def test_batch_size_is_respected() -> None:
    model = zoo.build("bart", batch=3)
    assert all(t.shape[0] == 3 for t in model.args)
    assert _outputs(model)[0].shape == (3, 8, 128)


def test_unknown_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown zoo model 'nope'"):
        zoo.build("nope")
    with pytest.raises(UsageError):
        zoo.cached_onnx("nope")


def _graph_with_inputs(*names: str) -> onnx.ModelProto:
    inputs = [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.INT64, [2, 16])
              for n in names]
    out = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [2, 16])
    node = onnx.helper.make_node("Identity", [names[0]], ["y"])
    return onnx.helper.make_model(onnx.helper.make_graph([node], "g", inputs, [out]))


@pytest.mark.slow
def test_onnx_inputs_follow_the_graph_inputs(models: dict) -> None:
    model = models["bert"]
    assert list(zoo.onnx_inputs(model)) == ["input_ids", "attention_mask"]
    feeds = zoo.onnx_inputs(model, _graph_with_inputs("input_ids"))  # exporter dropped mask
    assert list(feeds) == ["input_ids"]
    np.testing.assert_array_equal(feeds["input_ids"], model.args[0].numpy())
    with pytest.raises(UsageError, match="token_type_ids"):
        zoo.onnx_inputs(model, _graph_with_inputs("input_ids", "token_type_ids"))


def test_cached_onnx_exports_once_per_key(tmp_path, monkeypatch) -> None:
    calls = []

    def fake_export(name, path, *, seed=0, opset=None, **variant):
        calls.append((name, seed, opset))
        path.write_bytes(b"onnx")
        return path

    monkeypatch.setattr(zoo, "export_onnx", fake_export)
    first = zoo.cached_onnx("resnet", tmp_path)
    assert zoo.cached_onnx("resnet", tmp_path) == first
    other = zoo.cached_onnx("resnet", tmp_path, seed=1)
    assert other != first and other.parent == first.parent == tmp_path
    assert calls == [("resnet", 0, zoo.DEFAULT_OPSET), ("resnet", 1, zoo.DEFAULT_OPSET)]


def test_default_cache_dir_honours_environment(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AMP_REWRITE_CACHE", str(tmp_path))
    assert zoo.default_cache_dir() == tmp_path
    monkeypatch.delenv("AMP_REWRITE_CACHE")
    assert zoo.default_cache_dir() != tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("name", ONNX_SUBSET)
def test_onnx_export_runs_in_onnxruntime(models: dict, name: str) -> None:
    import onnxruntime as ort

    path = zoo.cached_onnx(name)
    proto = onnx.load(str(path), load_external_data=False)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, zoo.onnx_inputs(models[name], proto))
    for g, want in zip(got, _outputs(models[name]), strict=True):
        want = want.numpy()
        assert np.abs(g - want).max() <= 1e-4 * np.abs(want).max()


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
def test_bundled_example_matches_its_script() -> None:
    """The committed quick-start model is small, standalone, and what the script builds."""
    import onnxruntime as ort

    script_path = EXAMPLES / "make_transformer_block.py"
    spec = importlib.util.spec_from_file_location("make_transformer_block", script_path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    path = EXAMPLES / "transformer_block.onnx"
    assert path.stat().st_size < 500 * 1024
    proto = onnx.load(str(path), load_external_data=False)
    onnx.checker.check_model(proto, full_check=True)
    assert not any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)
    feeds = dict(np.load(EXAMPLES / "transformer_block_inputs.npz"))
    assert list(feeds) == [i.name for i in proto.graph.input] == ["hidden_states"]
    block, x = script.build()
    np.testing.assert_array_equal(feeds["hidden_states"], x.numpy())
    (got,) = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    with torch.no_grad():
        want = block(x).numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.slow
def test_dynamic_export_has_symbolic_batch_and_sequence(tmp_path) -> None:
    """A serving export: one symbolic batch dim shared by ids and mask, one sequence dim."""
    model = onnx.load(zoo.cached_onnx("bert", dynamic=True), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in model.graph.input}
    assert dims == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"]}
