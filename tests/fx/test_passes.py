"""The fx passes, one test per case of their docstrings, ``modified`` asserted both ways."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from amp_rewrite.fx.capture import capture
from amp_rewrite.fx.opkeys import mutated_argument
from amp_rewrite.fx.passes import FunctionalizeInPlace, InlineModules



# ----------------------------------------------------------------------------- InlineModules


@pytest.mark.parametrize("module", [
    nn.Linear(4, 3), nn.Conv1d(2, 3, 3, padding="same"), nn.Conv2d(2, 3, 3, stride=2),
    nn.LayerNorm(4), nn.GroupNorm(2, 4), nn.Embedding(7, 4, padding_idx=0), nn.PReLU(),
    nn.RMSNorm(4), nn.Linear(4, 3, bias=False),
], ids=lambda m: type(m).__name__)
def test_inline_parameterised_module_computes_the_same(module):
    x = torch.randint(0, 7, (2, 5)) if isinstance(module, nn.Embedding) else _input(module)
    gm = torch.fx.symbolic_trace(nn.Sequential(copy.deepcopy(module)))  # a leaf call_module
    assert InlineModules()(gm).modified
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    assert list(gm.state_dict()) == [f"0.{k}" for k in module.state_dict()]
    assert torch.equal(gm(x), module(x))


def _input(module: nn.Module) -> torch.Tensor:
    if isinstance(module, nn.Conv1d):
        return torch.randn(2, 2, 8)
    if isinstance(module, nn.Conv2d):
        return torch.randn(2, 2, 8, 8)
    if isinstance(module, nn.GroupNorm):
        return torch.randn(2, 4, 3)
    return torch.randn(2, 4)


@pytest.mark.parametrize("module", [
    nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), nn.BatchNorm1d(4),
    nn.Embedding(7, 4, max_norm=1.0), nn.ReLU(),
], ids=lambda m: f"{type(m).__name__}")
def test_modules_whose_functional_form_differs_stay_modules(module):
    gm = torch.fx.symbolic_trace(nn.Sequential(module))
    assert not InlineModules()(gm).modified
    assert [n.op for n in gm.graph.nodes].count("call_module") == 1


# ----------------------------------------------------------------------- FunctionalizeInPlace


class _InPlaceIntermediate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        y.add_(1.0)  # nobody reads y's old value afterwards
        return y.relu()


class _InPlaceInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2.0)  # the caller's tensor: must stay in place
        return x + 1


class _InPlaceBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(x.sum(0))
        return x * 2


class _InPlaceReadLater(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        view = y[0]
        view.add_(1.0)  # writes into y through a view; y is read afterwards
        return y * 3


@pytest.mark.parametrize("capture_mode", ["export", "symbolic_trace"])
def test_inplace_op_on_an_intermediate_becomes_out_of_place(capture_mode):
    x = torch.randn(2, 3)
    gm = capture(_InPlaceIntermediate(), (x,), mode=capture_mode)
    assert FunctionalizeInPlace()(gm).modified
    assert not any(mutated_argument(n, gm) for n in gm.graph.nodes)
    assert torch.equal(gm(x.clone()), _InPlaceIntermediate()(x.clone()))


@pytest.mark.parametrize("module", [_InPlaceInput(), _InPlaceBuffer(), _InPlaceReadLater()],
                         ids=lambda m: type(m).__name__)
def test_inplace_op_on_inputs_buffers_or_tensors_read_later_stays(module):
    x = torch.randn(2, 3)
    gm = capture(copy.deepcopy(module), (x.clone(),), mode="symbolic_trace")
    assert not FunctionalizeInPlace()(gm).modified
    expected_x, got_x = x.clone(), x.clone()
    assert torch.equal(gm(got_x), copy.deepcopy(module)(expected_x))
    assert torch.equal(got_x, expected_x)


def test_mutated_tensor_keeps_its_precision_through_the_rewrite():
    import amp_rewrite

    class Accumulate(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            y[0].add_(1.0)  # in place through a view, then y is read again
            return self.fc(y) + y

    x = torch.randn(2, 3)
    gm = amp_rewrite.rewrite(Accumulate(), (x,), capture="symbolic_trace")
    module = Accumulate()
    module.load_state_dict(gm.state_dict())
    with torch.no_grad():
        ours, ref = gm(x), module(x)
    assert (ours - ref).abs().max() < 1e-2  # a cast copy of y would lose the +1
