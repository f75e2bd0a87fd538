"""The rewrite fits real training loops: batch and sequence are dynamic by default (the last
smaller batch runs), static on request; train and eval (dropout, batchnorm) follow the
module's mode, and a single-mode capture explains how to get the other. Oracle: the eager
FP32 module.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import UsageError


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(h.mean(-1))


def test_dynamic_batch_and_sequence_by_default_so_the_last_smaller_batch_runs():
    """A graph captured with batch 4 refused batch 9 (Guard failed: input.size()[0] == 4)."""
    torch.manual_seed(0)
    model = _Net().eval()
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (torch.randn(4, 4, 16),),
                             dtype=torch.bfloat16)
    for shape in ((9, 4, 16), (3, 4, 5), (2, 4, 33)):  # other batch and sequence lengths
        x = torch.randn(*shape)
        torch.testing.assert_close(gm(x), model(x), rtol=3e-2, atol=3e-2)


def test_dynamic_shapes_static_on_request_and_explicit_spec_overrides():
    model, x = _Net().eval(), torch.randn(4, 4, 16)
    static = amp_rewrite.rewrite(model, (x,), dynamic_shapes="static")
    with pytest.raises(Exception, match="4"):  # export's guard names the captured size
        static(torch.randn(9, 4, 16))
    batch = torch.export.Dim("batch", min=2, max=64)
    only_batch = amp_rewrite.rewrite(model, (x,), dynamic_shapes=({0: batch},))
    assert only_batch(torch.randn(9, 4, 16)).shape == (9, 3)
    with pytest.raises(Exception, match="16"):  # the sequence stayed static under this spec
        only_batch(torch.randn(9, 4, 5))


def test_train_then_evaluate_with_dropout_and_batchnorm():
    """A train-mode capture refused .eval(); mode='both' gives one module for the loop."""
    torch.manual_seed(0)
    reference = _Net()
    model = amp_rewrite.rewrite(copy.deepcopy(reference), (torch.randn(8, 4, 16),),
                                dtype=torch.bfloat16, mode="both")
    assert model.training and set(model.state_dict()) == set(reference.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, 16, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(4)] + [(torch.randn(5, 4, 16, generator=gen),  # smaller last batch
                                   torch.randint(0, 3, (5,), generator=gen))]
    for net, optimizer in ((model, opt), (reference, ref_opt)):
        torch.manual_seed(1)  # same dropout masks in both loops
        net.train()
        for x, y in data:
            nn.functional.cross_entropy(net(x).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    # BatchNorm statistics were updated by the train graph and are read by the eval graph.
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean,
                               rtol=5e-2, atol=2e-2)
    assert model.bn.num_batches_tracked.item() == 5
    model.eval()
    reference.eval()
    x = torch.randn(6, 4, 16, generator=gen)
    first = model(x)
    torch.testing.assert_close(model(x), first, rtol=0, atol=0)  # no dropout in eval
    torch.testing.assert_close(first.float(), reference(x), rtol=5e-2, atol=5e-2)
    model.train()
    assert not torch.equal(model(x), first)  # dropout and batch statistics again


def test_single_mode_capture_explains_how_to_get_the_other_mode():
    gm = amp_rewrite.rewrite(_Net(), (torch.randn(4, 4, 16),), mode="eval")
    with pytest.raises(UsageError, match="captured in eval mode.*mode='both'"):
        gm.train()


def test_mode_on_a_graph_module_is_a_usage_error():
    gm = amp_rewrite.rewrite(_Net(), (torch.randn(4, 4, 16),))
    with pytest.raises(UsageError, match="mode= needs an nn.Module"):
        amp_rewrite.rewrite(gm, mode="both")


def test_mode_leaves_the_users_module_flags_alone():
    model = _Net()
    model.bn.eval()  # mixed flags on purpose
    amp_rewrite.rewrite(model, (torch.randn(4, 4, 16),), mode="eval")
    assert model.training and model.conv.training and not model.bn.training
