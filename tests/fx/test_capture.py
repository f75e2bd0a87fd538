"""Capture: torch.export, symbolic_trace, GraphModules as they are, and bad input."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import CaptureError, UsageError
from amp_rewrite.fx.capture import capture, has_fake_values


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if y.sum() > 0:  # data-dependent control flow
            return y * 2
        return y - 1


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + y


class _SlicesByLength(nn.Module):
    """HF's ``position_ids[:, :seq_length]``: a real tensor sliced by a traced size."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.arange(16.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.positions[: x.shape[-1]]


class _Integers(nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids * 3 + 1).cumsum(-1)


def test_data_dependent_control_flow_names_the_construct_and_suggests_fixes():
    with pytest.raises(CaptureError) as info:
        amp_rewrite.rewrite(_Branchy(), (torch.randn(2, 4),))
    message = str(info.value)
    assert "data-dependent control flow" in message
    assert "test_capture.py" in message and "if y.sum() > 0:" in message
    assert "capture='symbolic_trace'" in message and "torch.cond" in message


def test_symbolic_trace_of_data_dependent_branch_is_a_capture_error():
    with pytest.raises(CaptureError, match="symbolic_trace cannot capture _Branchy"):
        amp_rewrite.rewrite(_Branchy(), (torch.randn(2, 4),), capture="symbolic_trace")


def test_symbolic_trace_of_code_needing_concrete_values_names_the_line():
    with pytest.raises(CaptureError) as info:
        amp_rewrite.rewrite(_SlicesByLength(), (torch.randn(2, 4),), capture="symbolic_trace")
    message = str(info.value)
    assert "symbolic_trace cannot capture _SlicesByLength: TypeError" in message
    assert "test_capture.py" in message and "self.positions[: x.shape[-1]]" in message
    assert "capture='export'" in message
    gm = amp_rewrite.rewrite(_SlicesByLength(), (torch.randn(2, 4),))  # export handles it
    x = torch.randn(2, 4)
    torch.testing.assert_close(gm(x), _SlicesByLength()(x))


def test_missing_example_input_is_a_usage_error_naming_the_signature():
    with pytest.raises(UsageError, match=r"forward\(x.*y.*missing a required argument: 'y'"):
        amp_rewrite.rewrite(_TwoInputs(), (torch.randn(2, 4),))


def test_mismatched_example_input_shape_is_a_usage_error():
    with pytest.raises(UsageError, match="example inputs do not fit _TwoInputs"):
        amp_rewrite.rewrite(_TwoInputs(), (torch.randn(2, 5), torch.randn(2, 3)))


def test_mismatched_inputs_for_a_graph_module_are_a_usage_error():
    gm = torch.fx.symbolic_trace(_TwoInputs())
    with pytest.raises(UsageError, match="example inputs do not"):
        amp_rewrite.rewrite(gm, (torch.randn(2, 4),))


def test_no_example_inputs_for_a_module_is_a_usage_error():
    with pytest.raises(UsageError, match="example_inputs is required"):
        amp_rewrite.rewrite(_TwoInputs())


def test_unknown_capture_mode_is_a_usage_error():
    with pytest.raises(UsageError, match="capture='trace'"):
        amp_rewrite.rewrite(_TwoInputs(), (torch.randn(2, 4), torch.randn(2, 3)), capture="trace")


def test_model_without_floating_point_tensors_is_returned_unchanged_with_a_note():
    ids = torch.arange(6).reshape(2, 3)
    gm = amp_rewrite.rewrite(_Integers(), (ids,))
    assert "no floating-point tensors" in " ".join(gm.amp_report["notes"])
    assert gm.amp_report["casts_inserted"] == 0 and not gm.amp_report["modified"]
    assert torch.equal(gm(ids), _Integers()(ids))


@pytest.mark.parametrize("mode", ["export", "symbolic_trace"])
def test_the_users_module_is_not_mutated(mode):
    module = _TwoInputs()
    before = copy.deepcopy(module.state_dict())
    gm = amp_rewrite.rewrite(module, (torch.randn(2, 4), torch.randn(2, 3)), capture=mode)
    gm(torch.randn(2, 4), torch.randn(2, 3)).sum().backward()
    torch.optim.SGD(gm.parameters(), lr=1.0).step()  # training the result...
    after = module.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # ...leaves the original
    assert all(p.grad is None for p in module.parameters())
    assert type(module.fc) is nn.Linear


def test_a_graph_module_is_taken_as_is_and_not_mutated():
    gm = torch.fx.symbolic_trace(_TwoInputs())
    code = gm.code
    args = (torch.randn(2, 4), torch.randn(2, 3))
    out = amp_rewrite.rewrite(gm, args, dtype=torch.bfloat16, fuse=False)
    assert gm.code == code and "_to_copy" in out.code
    assert torch.allclose(out(*args), gm(*args), atol=2e-2)


def test_export_capture_annotates_fake_values():
    gm = capture(_TwoInputs(), (torch.randn(2, 4), torch.randn(2, 3)))
    assert has_fake_values(gm)
    assert isinstance(gm, torch.fx.GraphModule)


def test_train_and_eval_accept_the_captured_mode_and_explain_the_other():
    module = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    x = torch.randn(2, 4)
    trained = amp_rewrite.rewrite(module.train(), (x,))
    assert trained.train() is trained
    with pytest.raises(UsageError, match="captured in train mode.*mode=.both.*mode=.eval."):
        trained.eval()
    evaluated = amp_rewrite.rewrite(module.eval(), (x,))
    assert evaluated.eval() is evaluated
    assert torch.equal(evaluated(x), evaluated(x))  # no dropout in an eval-mode graph
    with pytest.raises(UsageError, match="captured in eval mode"):
        evaluated.train()
