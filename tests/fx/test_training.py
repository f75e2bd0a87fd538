"""Training a rewritten model: fp16 with the loss-scaling wrapper reaches FP32's accuracy.

Oracle: the same model trained in FP32 from the same initial weights, with the same optimizer,
batches and number of steps, on scikit-learn's bundled ``load_digits`` (no download).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import amp_rewrite
from amp_rewrite.training import AmpOptimizer

pytestmark = pytest.mark.slow  # training to accuracy

STEPS, BATCH, LR = 300, 64, 2e-3


class DigitsNet(nn.Module):
    """A small MLP with a LayerNorm (deny) between GEMMs (allow)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm = nn.Linear(64, 64), nn.LayerNorm(64)
        self.fc2, self.head = nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        return self.head(F.gelu(self.fc2(h)) + h)


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    datasets = pytest.importorskip("sklearn.datasets")
    data = datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return x[train], y[train], x[test], y[test]


def _train(model: nn.Module, step, x: torch.Tensor, y: torch.Tensor) -> None:
    batches = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        idx = torch.randint(0, len(y), (BATCH,), generator=batches)
        step(F.cross_entropy(model(x[idx]).float(), y[idx]))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()


def fp32_baseline() -> tuple[tuple[torch.Tensor, ...], DigitsNet, dict]:
    """The digits data, a seeded DigitsNet trained in FP32 with Adam, and its initial state."""
    data = x, y, _, _ = _digits()
    torch.manual_seed(0)
    fp32 = DigitsNet()
    initial = copy.deepcopy(fp32.state_dict())
    adam = torch.optim.Adam(fp32.parameters(), lr=LR)

    def fp32_step(loss: torch.Tensor) -> None:
        adam.zero_grad()
        loss.backward()
        adam.step()

    _train(fp32, fp32_step, x, y)
    return data, fp32, initial


def test_fp16_rewritten_training_matches_fp32_accuracy_within_one_point():
    (x, y, x_test, y_test), fp32, initial = fp32_baseline()

    batch = torch.export.Dim("batch", min=1, max=4096)
    mixed = amp_rewrite.rewrite(DigitsNet(), (x[:BATCH],), dtype=torch.float16,
                                dynamic_shapes=({0: batch},))
    mixed.load_state_dict(initial)
    assert mixed.amp_report["precision_counts"]["low"] >= 3  # the GEMMs run fp16
    opt = AmpOptimizer(torch.optim.Adam(mixed.parameters(), lr=LR), dtype=torch.float16)

    def amp_step(loss: torch.Tensor) -> None:
        opt.backward(loss)
        opt.step()
        opt.zero_grad()

    _train(mixed, amp_step, x, y)

    ours, reference = _accuracy(mixed, x_test, y_test), _accuracy(fp32, x_test, y_test)
    assert reference > 0.9  # the task is learnt at all
    assert abs(ours - reference) <= 0.01
    assert all(p.dtype == torch.float32 for p in mixed.parameters())
