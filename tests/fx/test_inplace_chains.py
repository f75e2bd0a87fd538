"""Chained in-place updates (buffers, views of buffers, no-grad parameters, intermediates)
give what the eager module gives, under export and symbolic_trace; state updates that
symbolic_trace would run eagerly, or run outside their ``no_grad`` block, are refused as
capture errors. Oracle: the eager FP32 module, and a
hand-derived value.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import CaptureError


class _BufferChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.9).add_(x.mean(0))
        return self.lin(x) + self.ema


class _BufferViewChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", torch.ones(2, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats[0].mul_(0.5).add_(x.sum(0)).clamp_(max=100.0)
        self.stats[1:].add_(1.0).mul_(2.0)
        return self.lin(x) * self.stats[1]


class _ParameterChainNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.bias.mul_(0.5).add_(0.25)
        return self.lin(x)


class _IntermediateChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.mul_(2.0).add_(1.0)
        return torch.relu(y)


_CHAINS = [_BufferChain, _BufferViewChain, _ParameterChainNoGrad, _IntermediateChain]


@pytest.mark.parametrize("module_type", _CHAINS)
def test_chained_inplace_updates_match_eager(module_type, capture="export"):
    """``buf.mul_(0.9).add_(x)`` kept 0.9 instead of 1.9: the add_ was made out of place."""
    torch.manual_seed(0)
    eager = module_type()
    x = torch.randn(3, 4)
    gm = amp_rewrite.rewrite(copy.deepcopy(eager), (x,), dtype=torch.bfloat16, capture=capture)
    for _ in range(3):  # the state evolves: each call must update it as eager does
        want, got = eager(x), gm(x)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
    for name, tensor in eager.state_dict().items():
        torch.testing.assert_close(gm.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_chain_on_buffer_stays_inplace_and_exact_by_hand():
    gm = amp_rewrite.rewrite(_BufferChain(), (torch.ones(2, 4),), dtype=torch.float16)
    gm(torch.ones(2, 4))
    assert gm.ema.tolist() == pytest.approx([1.9] * 4)  # 1 * 0.9 + mean(1, 1)


def test_chained_inplace_on_intermediate_matches_eager_under_symbolic_trace():
    test_chained_inplace_updates_match_eager(_IntermediateChain, capture="symbolic_trace")


@pytest.mark.parametrize("module_type", [_BufferChain, _BufferViewChain])
def test_symbolic_trace_refuses_state_updates_it_would_run_eagerly(module_type):
    """symbolic_trace runs ``self.ema.mul_(0.9)`` (constant operands) instead of recording it."""
    with pytest.raises(CaptureError, match="capture='export'") as err:
        amp_rewrite.rewrite(module_type(), (torch.ones(2, 4),), capture="symbolic_trace")
    assert "during tracing" in str(err.value)


def test_symbolic_trace_losing_no_grad_is_a_capture_error_not_bad_inputs():
    x = torch.ones(2, 4)
    _ParameterChainNoGrad()(x)
    with pytest.raises(CaptureError, match="node mul_ .*no_grad"):
        amp_rewrite.rewrite(_ParameterChainNoGrad(), (x,), capture="symbolic_trace")
