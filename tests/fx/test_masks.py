"""Attention masks that mask nothing are dropped (``fx/masks.py``), and only those."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.fx.masks import DropTrivialAttentionMasks, masks_nothing

transformers = pytest.importorskip("transformers")
SDPA = torch.ops.aten.scaled_dot_product_attention.default


class _Attention(nn.Module):
    """SDPA with a boolean mask built from ``arange`` and a comparison with ``threshold``."""

    def __init__(self, threshold: int, offset: int = 0) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.threshold, self.offset = threshold, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)
        idx = torch.arange(x.shape[1], device=x.device) + self.offset
        mask = (idx >= self.threshold)[None, None, None, :].expand(x.shape[0], 1, x.shape[1], -1)
        return nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def _masks(gm: torch.fx.GraphModule) -> list:
    return [n.args[3] if len(n.args) > 3 else n.kwargs.get("attn_mask")
            for n in gm.graph.find_nodes(op="call_function", target=SDPA)]


@pytest.mark.parametrize(("threshold", "offset", "dropped"),
                         [(0, 0, True), (-3, 0, True), (2, 3, True), (1, 0, False),
                          (4, 3, False)])
def test_only_masks_true_for_every_shape_are_dropped(threshold: int, offset: int,
                                                     dropped: bool) -> None:
    torch.manual_seed(0)
    model = _Attention(threshold, offset).eval()
    x = torch.randn(2, 6, 16)
    gm = torch.export.export(model, (x,)).module()
    want = model(x)
    result = DropTrivialAttentionMasks()(gm)
    assert result.modified is dropped
    assert (_masks(gm) == [None]) is dropped
    # the mask (1, 0) masks index 0 only: dropping it would change the output
    torch.testing.assert_close(gm(x), want)


def test_a_mask_from_an_input_is_never_dropped() -> None:
    graph = torch.fx.Graph()
    mask = graph.placeholder("mask")
    mask.meta["val"] = torch.ones(2, 2, dtype=torch.bool)
    assert not masks_nothing(mask)


def _bert(num_layers: int = 2) -> nn.Module:
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=num_layers,
                                  num_attention_heads=2, intermediate_size=64, vocab_size=64)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def _rewrite(model: nn.Module, args: tuple) -> torch.fx.GraphModule:
    return amp_rewrite.rewrite(copy.deepcopy(model), args, dtype=torch.float16, device="cuda",
                               fuse=False)


def test_bert_without_padding_runs_attention_without_a_mask() -> None:
    model, ids = _bert(), torch.randint(0, 64, (2, 12))
    gm = _rewrite(model, (ids,))
    assert gm.amp_report["attention_masks_dropped"] == 2
    assert _masks(gm) == [None, None]
    want = model(ids).last_hidden_state
    got = gm(ids)[0]
    assert torch.isfinite(got).all()
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_bert_with_a_padding_mask_keeps_it() -> None:
    model, ids = _bert(), torch.randint(0, 64, (2, 12))
    attention_mask = torch.ones(2, 12, dtype=torch.long)
    attention_mask[1, 8:] = 0
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (ids, attention_mask), dtype=torch.float16,
                             device="cuda", fuse=False)
    assert gm.amp_report["attention_masks_dropped"] == 0
    assert all(m is not None for m in _masks(gm))
    want = model(ids, attention_mask).last_hidden_state
    got = gm(ids, attention_mask)[0]
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_gpt2_causal_mask_is_kept() -> None:
    cfg = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32,
                                  use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg).eval()
    ids = torch.randint(0, 64, (2, 12))
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (ids,), dtype=torch.float16, device="cuda",
                             fuse=False)
    assert gm.amp_report["attention_masks_dropped"] == 0
    want = model(ids).last_hidden_state
    got = gm(ids)[0]
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_add_with_alpha_is_not_taken_for_a_plain_add():
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    n = graph.placeholder("n")
    idx = graph.call_function(aten.arange.default, (n,))
    scaled = graph.call_function(aten.add.Tensor, (idx, idx), {"alpha": -5})  # -4·idx
    mask = graph.call_function(aten.ge.Scalar, (scaled, 0))
    mask.meta["val"] = torch.ones(6, dtype=torch.bool)
    plain = graph.call_function(aten.ge.Scalar,
                                (graph.call_function(aten.add.Tensor, (idx, idx)), 0))
    plain.meta["val"] = torch.ones(6, dtype=torch.bool)
    assert not masks_nothing(mask) and masks_nothing(plain)
