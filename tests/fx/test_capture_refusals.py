"""A capture that fails raises one error naming the construct, and prints nothing.

``torch.equal`` gates and data-dependent branches are capture errors (not bad inputs); a
wrong input shape is a usage error; neither leaves export's tracebacks or partial graphs on
stdout/stderr.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import CaptureError, UsageError


class _EqualGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.equal(x, y)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_torch_equal_capture_failure_names_the_construct(capture):
    """The symbolic_trace retry said 'example inputs do not fit the graph' (they do)."""
    x = torch.ones(2, 4)
    _EqualGate()(x, x + 1)  # the inputs fit the module eagerly
    with pytest.raises(CaptureError) as err:
        amp_rewrite.rewrite(_EqualGate(), (x, x + 1), capture=capture)
    message = str(err.value)
    assert "aten.equal" in message and "(x == y).all()" in message
    assert "do not fit" not in message


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


@pytest.mark.parametrize(("model", "x", "error"), [
    (nn.Linear(4, 4), torch.randn(2, 5), UsageError),  # wrong shape: fake-tensor traceback
    (_DataDependent(), torch.randn(2, 4), CaptureError),  # partial graph printed twice
])
def test_failed_capture_prints_nothing_but_raises_one_error(model, x, error, capfd):
    import logging

    logging.getLogger("torch").setLevel(logging.WARNING)  # torch's default, whatever ran before
    with pytest.raises(error):
        amp_rewrite.rewrite(model, (x,))
    out, err = capfd.readouterr()
    assert out == "" and err == "", err[:500]
