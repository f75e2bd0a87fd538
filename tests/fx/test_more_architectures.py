"""What users bring beyond the zoo (``transformers`` architectures and training setups a sweep
found broken): activation checkpointing through the ``torch.compile`` backend, Falcon's
``weight.T`` linear layers, and the capture error of a branch on a ``nonzero`` count
(DeBERTa-v2's classification loss).

Oracles: the FP32 model (outputs and gradients) and ``torch.autocast`` on the same inputs;
for the error message, the model's own source line."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import amp_rewrite
from amp_rewrite.errors import CaptureError
from amp_rewrite.fx import backend
from amp_rewrite.fx.pointwise import UnfuseRegions
from amp_rewrite.fx.view import is_cast
from tests.models.measure import relative_error

transformers = pytest.importorskip("transformers")

AUTOCAST_FACTOR = 1.5
LOW = [torch.float16, torch.bfloat16]


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _ids(seed: int, batch: int = 2, seq: int = 8) -> torch.Tensor:
    return torch.randint(3, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().flatten() for p in module.parameters() if p.grad is not None]


def _vector_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return relative_error([torch.cat(grads)], [torch.cat(reference)])


# --- activation checkpointing through the torch.compile backend -----------------------------

def _tiny_llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_gradient_checkpointing_trains_through_the_backend_like_autocast(dtype):
    """``gradient_checkpointing_enable()`` made dynamo hand over ``tag_activation_checkpoint``,
    which the pre-dispatch re-trace failed on (KeyError '_checkpoint_context_fn')."""
    model = _tiny_llama()
    model.gradient_checkpointing_enable()
    model.train()
    reference = copy.deepcopy(model)
    ids = _ids(0)

    compiled = amp_rewrite.compile(model, dtype=dtype, inner="eager")
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    fp32 = reference(input_ids=ids, labels=ids).loss
    fp32.backward()
    autocast_model = copy.deepcopy(reference)
    autocast_model.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        autocast_loss = autocast_model(input_ids=ids, labels=ids).loss
    autocast_loss.backward()

    grads = _grads(model)
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in model.parameters())
    assert abs(loss.item() - fp32.item()) <= (
        AUTOCAST_FACTOR * abs(autocast_loss.item() - fp32.item()) + 1e-3 * abs(fp32.item()))
    error = _vector_error(grads, _grads(reference))
    autocast_error = _vector_error(_grads(autocast_model), _grads(reference))
    assert error <= AUTOCAST_FACTOR * autocast_error + 1e-6
    # the layers ran low: the checkpointed body was planned, not left as an opaque fp32 op
    reports = amp_rewrite.report(compiled)
    assert all(r["report"]["unlisted_ops"] == [] for r in reports)
    assert sum(r["report"]["precision_counts"].get("low", 0) for r in reports) > 0


def test_rewrite_of_a_checkpointed_model_warns_that_export_drops_recomputation(caplog):
    """torch.export traces through the checkpoint: the rewritten graph saves what the FP32
    model with checkpointing recomputes (counted by saved-tensor hooks), and says so."""
    model = _tiny_llama()
    model.gradient_checkpointing_enable()
    model.train()
    ids = _ids(2)

    def saved(call) -> int:
        count = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: count.append(1) or t,
                                                      lambda t: t):
            loss = call()
        loss.backward()
        return len(count)

    with caplog.at_level("WARNING", logger="amp_rewrite.fx.capture"):
        gm = amp_rewrite.rewrite(model, (ids,), example_kwargs={"labels": ids},
                                 dtype=torch.bfloat16, mode="train")
    assert "activation checkpointing" in caplog.text and "compile" in caplog.text
    checkpointed = saved(lambda: model(input_ids=ids, labels=ids).loss)
    plain = copy.deepcopy(model)
    plain.gradient_checkpointing_disable()
    assert saved(lambda: gm(ids, labels=ids).loss) > checkpointed
    assert saved(lambda: plain(input_ids=ids, labels=ids).loss) > checkpointed
    caplog.clear()
    with caplog.at_level("WARNING", logger="amp_rewrite.fx.capture"):
        amp_rewrite.rewrite(plain, (ids,), example_kwargs={"labels": ids},
                            dtype=torch.bfloat16, mode="train")
    assert "activation checkpointing" not in caplog.text


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 4)

    def layer(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)).softmax(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.layer, x, use_reentrant=False).sum()


def _dynamo_graph(module: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list]:
    captured = []

    def keep(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm

    torch.compile(module, backend=keep)(x)
    return captured[0]


def test_checkpointed_region_is_inlined_and_tagged_for_recomputation():
    """What ``tag_activation_checkpoint`` does for AOTAutograd: every op of the region tagged
    PREFER_RECOMPUTE with one region id; the casts the plan puts inside join the region."""
    from torch.utils.checkpoint import CheckpointPolicy

    torch.manual_seed(0)
    module = _Checkpointed()
    x = torch.randn(8, 16, requires_grad=True)
    gm, example_inputs = _dynamo_graph(module, x)
    assert any(n.target is torch.ops.higher_order.tag_activation_checkpoint
               for n in gm.graph.nodes)
    aten = backend.to_aten(gm, example_inputs)
    ops = [n for n in aten.graph.nodes if n.op == "call_function"]
    tagged = [n for n in ops if n.meta.get("recompute") == CheckpointPolicy.PREFER_RECOMPUTE]
    assert {n.target for n in tagged} >= {torch.ops.aten.linear.default,
                                          torch.ops.aten.relu.default,
                                          torch.ops.aten.softmax.int}
    assert len({n.meta["ac_graph_id"] for n in tagged}) == 1
    assert not [n for n in ops if n.target is torch.ops.aten.sum.default and n in tagged]

    rewritten = amp_rewrite.rewrite(aten, dtype=torch.bfloat16)
    UnfuseRegions()(rewritten)
    backend._tag_inserted_nodes(rewritten)
    inside = [n for n in rewritten.graph.nodes if is_cast(n)
              and all("recompute" in u.meta for u in n.users)]
    assert inside and all("recompute" in n.meta for n in inside)
    # the graph computes what the module does
    out = rewritten(*example_inputs)[0]
    assert relative_error(out, module(x)) < 5e-2


# --- Falcon: linear layers spelled ``x @ weight.T`` ---------------------------------------------

@pytest.mark.parametrize("dtype", LOW, ids=["fp16", "bf16"])
def test_falcon_weight_transpose_is_classified_and_close_to_autocast(dtype):
    """``weight.T`` is ``aten.numpy_T`` in the captured graph: it was an unlisted op."""
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=4, num_hidden_layers=2)).eval()
    ids = _ids(1)
    gm = amp_rewrite.rewrite(model, (ids,), dtype=dtype, keep_io_types=False)
    assert gm.amp_report["unlisted_ops"] == []
    with torch.no_grad():
        ours, fp32 = gm(ids).logits, model(ids, use_cache=False).logits
        with torch.autocast("cpu", dtype=dtype):
            autocast = model(ids, use_cache=False).logits
    error, autocast_error = relative_error(ours, fp32), relative_error(autocast, fp32)
    assert error <= AUTOCAST_FACTOR * autocast_error + 1e-6


# --- capture errors name the line of a branch on a nonzero count --------------------------------

class _LabelledRows(nn.Module):
    """DeBERTa-v2's classification loss: ``if (labels >= 0).nonzero().size(0) > 0``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        index = (labels >= 0).nonzero()
        if index.size(0) > 0:
            return logits.sum() + index.sum()
        return logits.sum()


def test_branch_on_a_nonzero_count_names_the_model_line():
    with pytest.raises(CaptureError) as info:
        amp_rewrite.rewrite(_LabelledRows(), (torch.randn(2, 4), torch.tensor([0, 1])))
    message = str(info.value)
    assert "data-dependent control flow" in message
    assert f"{__file__}:" in message and "if index.size(0) > 0:" in message
