"""Hugging Face models trained as people train them: default configs (dropout on,
``use_cache`` left to the model), labels given, ``mode="both"``, train / eval at another
batch and sequence length / train again.

Oracles: the FP32 model's eval logits, and ``torch.autocast`` (+ ``GradScaler`` for fp16)
training of the same model from the same seed with dropout 0 (no mask to disagree on).
"""
from __future__ import annotations

import copy

import pytest
import torch

import amp_rewrite
from amp_rewrite.errors import UsageError
from amp_rewrite.fx.pointwise import FusedRegion
from amp_rewrite.training import AmpOptimizer
from tests.models import zoo

pytestmark = pytest.mark.slow  # trains Hugging Face models

# causal LMs and an encoder classifier of the zoo, with the config keys of their dropout
MODELS = {"gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
          "llama": ("attention_dropout",),
          "roberta": ("hidden_dropout_prob", "attention_probs_dropout_prob")}
CAUSAL = {"gpt2", "llama"}
LR = 1e-3


def _hf_model(name: str, dropout: bool = True) -> torch.nn.Module:
    """The zoo's HF model itself (not its logits-only wrapper), in train mode."""
    config = {} if dropout else dict.fromkeys(MODELS[name], 0.0)
    return zoo.build(name, config=config).module.model.train()


def _batch(name: str, seed: int, batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (batch, seq), generator=g)
    labels = ids if name in CAUSAL else torch.randint(0, 3, (batch,), generator=g)
    return {"input_ids": ids, "labels": labels}


def _rewrite(model: torch.nn.Module, name: str, dtype: str, fuse: bool):
    example = _batch(name, 0, 4, 16)
    return amp_rewrite.rewrite(model, (example["input_ids"],),
                               example_kwargs={"labels": example["labels"]}, dtype=dtype,
                               mode="both", fuse=fuse)


def _ours(model: torch.nn.Module, name: str, dtype: str, fuse: bool, steps: int
          ) -> list[float]:
    gm = _rewrite(model, name, dtype, fuse)
    opt = AmpOptimizer(torch.optim.AdamW(gm.parameters(), lr=LR), dtype=dtype)
    losses = []
    for step in range(steps):
        batch = _batch(name, 100 + step, 4, 16)
        loss = gm(batch["input_ids"], labels=batch["labels"]).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def autocast_losses(model: torch.nn.Module, name: str, dtype: str, steps: int) -> list[float]:
    """The reference: ``torch.autocast`` on the eager model, ``GradScaler`` for fp16."""
    low = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=low is torch.float16)
    losses = []
    for step in range(steps):
        batch = _batch(name, 100 + step, 4, 16)
        with torch.autocast("cpu", dtype=low):
            loss = model(**batch, use_cache=False).loss if name in CAUSAL else \
                model(**batch).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_train_eval_train_with_default_config(name, dtype, fuse):
    torch.manual_seed(0)
    model = _hf_model(name)
    reference = copy.deepcopy(model).eval()
    gm = _rewrite(model, name, dtype, fuse)
    # each graph runs its own regions: the two captures number them independently
    for graph in (gm.train_graph, gm.eval_graph):
        for child_name, child in graph.named_children():
            if isinstance(child, FusedRegion):
                assert graph.get_submodule(child_name) is child
    train_regions = {id(m) for m in gm.train_graph.children() if isinstance(m, FusedRegion)}
    assert not train_regions & {id(m) for m in gm.eval_graph.children()
                                if isinstance(m, FusedRegion)}
    opt = AmpOptimizer(torch.optim.AdamW(gm.parameters(), lr=LR), dtype=dtype)

    def train(steps: int, batch: int, seq: int) -> None:
        gm.train()
        for step in range(steps):
            inputs = _batch(name, step, batch, seq)
            loss = gm(inputs["input_ids"], labels=inputs["labels"]).loss
            assert torch.isfinite(loss)
            opt.backward(loss)
            opt.step()
            opt.zero_grad()

    train(3, 4, 16)
    gm.eval()
    inputs = _batch(name, 7, 3, 11)  # another batch size and sequence length
    reference.load_state_dict(gm.state_dict())
    with torch.no_grad():
        ours = gm(inputs["input_ids"], labels=inputs["labels"])
        fp32 = reference(**inputs)
    error = (ours.logits.float() - fp32.logits).abs().max() / fp32.logits.abs().max()
    assert error < 0.05 and abs(ours.loss.item() - fp32.loss.item()) < 0.02 * fp32.loss.item()
    train(2, 2, 9)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_losses_follow_autocast_with_dropout_off(name, dtype):
    """Same seed, same batches, dropout 0: every step's loss within 2% of autocast's."""
    ours = _ours(_hf_model(name, dropout=False), name, dtype, fuse=True, steps=5)
    reference = autocast_losses(_hf_model(name, dropout=False), name, dtype, steps=5)
    for mine, theirs in zip(ours, reference):
        assert abs(mine - theirs) <= 0.02 * abs(theirs), (ours, reference)


def test_keywords_of_the_capture_are_named_when_a_call_differs():
    model = _hf_model("gpt2")
    gm = _rewrite(model, "gpt2", "bf16", fuse=False)
    ids = _batch("gpt2", 1, 2, 8)["input_ids"]
    gm(ids, labels=ids)  # use_cache was set at capture and is filled in
    with pytest.raises(UsageError, match="captured with labels="):
        gm(ids)
    with pytest.raises(UsageError, match="use_cache=True: this graph was captured with "
                                         "use_cache=False"):
        gm(ids, labels=ids, use_cache=True)
    with pytest.raises(UsageError, match="captured without attention_mask="):
        gm(ids, labels=ids, attention_mask=torch.ones_like(ids))


def test_a_tensor_in_the_cache_parameter_is_named(caplog):
    model = _hf_model("gpt2").eval()
    ids = _batch("gpt2", 1, 2, 8)["input_ids"]
    with pytest.raises(UsageError, match=r"#2 -> '(cache|past_key_values)'"):
        amp_rewrite.rewrite(model, (ids, torch.ones_like(ids)))
