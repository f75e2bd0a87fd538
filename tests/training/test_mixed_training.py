"""Training a ``dtype="mixed"`` rewrite with ``AmpOptimizer``: a T5 whose FFN intermediates
exceed fp16's range (tests/models/hot.py, as trained T5 checkpoints have) trains like FP32,
where autocast fp16 overflows in the forward; loss scaling follows the fp16 nodes."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import amp_rewrite
from amp_rewrite.errors import UsageError
from amp_rewrite.fx.pointwise import BACKEND_ENV
from amp_rewrite.training import AmpOptimizer
from amp_rewrite.training.optimizer import scaling_dtype

STEPS = 200
LEARNING_RATE = 3e-4


def _hot_t5() -> nn.Module:
    from tests.models.hot import hot_variant

    torch.manual_seed(0)
    module = hot_variant("t5", target=3e5).module
    for m in module.modules():  # dropout off: the two runs see the same function
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return module.train()


def _batches(count: int = 8) -> list[tuple[torch.Tensor, ...]]:
    """Copy task: the decoder predicts the first 8 encoder tokens."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(1, 128, (8, 16), generator=gen)
        decoder_ids = torch.randint(1, 128, (8, 8), generator=gen)
        out.append((ids, torch.ones(8, 16, dtype=torch.long), decoder_ids, ids[:, :8]))
    return out


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _train(model: nn.Module, step, data) -> list[float]:
    losses = []
    for i in range(STEPS):
        ids, mask, decoder_ids, labels = data[i % len(data)]
        loss = _loss(model(ids, mask, decoder_ids), labels)
        step(loss)
        losses.append(loss.item())
    return losses


def _late(losses: list[float]) -> float:
    return sum(losses[-20:]) / 20


def test_a_hot_t5_trains_in_mixed_like_fp32_where_autocast_fp16_overflows(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "eager")  # no Inductor compilations in a unit test
    base, data = _hot_t5(), _batches()

    with torch.autocast("cpu", dtype=torch.float16), torch.no_grad():  # the model is hot
        assert not torch.isfinite(_loss(base(*data[0][:3]), data[0][3]))

    fp32 = copy.deepcopy(base)
    adam = torch.optim.Adam(fp32.parameters(), lr=LEARNING_RATE)

    def fp32_step(loss):
        loss.backward()
        adam.step()
        adam.zero_grad()

    reference = _train(fp32, fp32_step, data)

    # every low GEMM as an fp32 kernel on low-rounded operands (fx/lowering.py): the same
    # kernels on every run, where the default picks each by timing it on this machine
    gm = amp_rewrite.rewrite(copy.deepcopy(base), data[0][:3], dtype="mixed", device="cpu",
                             mode="train", emulate_gemms=True)
    counts = gm.amp_report["dtype_counts"]
    # the hot FFNs are shifted into fp16's range (fx/rescale.py): they run fp16, not bf16
    assert counts["float16"] > 0 and gm.amp_report["rescaled"]
    amp = AmpOptimizer(torch.optim.Adam(gm.parameters(), lr=LEARNING_RATE), model=gm)
    assert amp.scaler.scaling  # fp16 nodes: scaled

    def mixed_step(loss):
        amp.backward(loss)
        amp.step()
        amp.zero_grad()

    mixed = _train(gm, mixed_step, data)
    assert all(torch.isfinite(torch.tensor(mixed)))
    assert _late(reference) < reference[0] - 0.1  # it learned something
    assert abs(_late(mixed) - _late(reference)) < 0.01 * _late(reference)


def test_loss_scaling_follows_the_fp16_nodes_of_a_mixed_rewrite():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(8, 8)

        def forward(self, x):
            return self.linear(x).pow(2).sum(-1)  # GEMM fp16, [range] ops bf16

    class RangeOnly(nn.Module):
        def forward(self, x):
            return x.pow(2).sum(-1)  # bf16 only

    x = torch.randn(4, 8, requires_grad=True)
    with_fp16 = amp_rewrite.rewrite(Tiny(), (x,), dtype="mixed", device="cpu", fuse=False)
    bf16_only = amp_rewrite.rewrite(RangeOnly(), (x,), dtype="mixed", device="cpu",
                                    fuse=False)
    assert scaling_dtype(model=with_fp16) == torch.float16
    assert scaling_dtype(model=bf16_only) == torch.bfloat16
    assert scaling_dtype("mixed") == torch.float16  # without the model: scale
    assert not AmpOptimizer(torch.optim.SGD([x], lr=0.1), model=bf16_only).scaler.scaling
    with pytest.raises(UsageError, match="model="):
        AmpOptimizer(torch.optim.SGD([x], lr=0.1), dtype="fp16", model=with_fp16)
