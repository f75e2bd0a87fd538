"""``explain`` of a softmax where the model called ``scaled_dot_product_attention`` itself.

transformers' default attention is one SDPA call, so the captured graph has no softmax node
to explain. Cases: one attention node (its name given), one per layer (the first given), and a
name no attention covers (the plain unknown-name error). Oracle: the SDPA nodes read from the
rewritten graph's targets, not from the report.
"""
from __future__ import annotations

import pytest
import torch

import amp_rewrite
from amp_rewrite.core.report import UnknownNodeError

transformers = pytest.importorskip("transformers")
aten = torch.ops.aten


def rewritten_bert(num_layers: int) -> torch.fx.GraphModule:
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=num_layers,
                                  num_attention_heads=2, intermediate_size=64, vocab_size=64,
                                  max_position_embeddings=16)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    return amp_rewrite.rewrite(model, (torch.randint(0, 64, (2, 8)),))


def attention_nodes(gm: torch.fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes
            if n.target is aten.scaled_dot_product_attention.default]


@pytest.mark.parametrize("num_layers", [1, 2])
def test_softmax_names_the_attention_node_the_model_called(num_layers):
    gm = rewritten_bert(num_layers)
    called = attention_nodes(gm)
    assert len(called) == num_layers
    assert not any("softmax" in n.name for n in gm.graph.nodes)
    with pytest.raises(UnknownNodeError) as raised:
        amp_rewrite.explain(gm, "softmax")
    message = str(raised.value)
    assert message.startswith("no node named 'softmax'")
    assert "attention is one fused node" in message
    assert all(repr(name) in message for name in called)
    assert f"(explain(gm, {called[0]!r}))" in message
    lines = amp_rewrite.explain(gm, called[0])  # the advice works
    assert lines and lines[0].startswith(called[0])


def test_a_name_no_attention_covers_keeps_the_plain_error():
    gm = rewritten_bert(1)
    with pytest.raises(UnknownNodeError) as raised:
        amp_rewrite.explain(gm, "no_such_node")
    assert "attention" not in str(raised.value)
