"""``rewrite`` checks its arguments: each bad one is a UsageError at the call, naming the
argument and what it expects; integer inputs into a Linear are refused at rewrite time;
the dtype and device spellings ``AmpOptimizer`` accepts are accepted.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import UsageError


class _IntoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(ids)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_integer_input_into_linear_is_a_usage_error_at_rewrite_time(capture):
    """It rewrote fine and failed when called: 'mat1 and mat2 must have the same dtype'."""
    ids = torch.arange(8).reshape(2, 4)
    with pytest.raises(RuntimeError, match="same dtype"):
        _IntoLinear()(ids)  # eager fails too: the model is wrong, not the rewrite
    with pytest.raises(UsageError, match=r"node \w+ \(linear in module proj\) reads ids as "
                                         r"torch.int64.*ids.float\(\)"):
        amp_rewrite.rewrite(_IntoLinear(), (ids,), capture=capture)


def _tiny() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(3, 4),)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"keep_fp32": 5}, r"keep_fp32=5: expected a string or a list of strings"),
    ({"keep_fp32": ["lin*", 3]}, r"keep_fp32 holds 3 \(int\): expected strings"),
    ({"device": "tpu"}, r"device='tpu': amp_rewrite has kernel facts for cuda, cpu only"),
    ({"keep_io_types": "no"}, r"keep_io_types='no': expected True or False"),
    ({"autocast_floor": None}, r"autocast_floor=None: expected True or False"),
    ({"dtype": torch.float32}, r"dtype=torch.float32: expected a low-precision dtype"),
    ({"dtype": "int8"}, r"dtype='int8': expected one of torch.float16"),
    ({"mode": "training"}, r"mode='training': expected one of 'train', 'eval', 'both'"),
])
def test_bad_rewrite_arguments_are_usage_errors_at_the_call(kwargs, message):
    """keep_fp32=5 raised a TypeError deep inside; device='tpu', keep_io_types='no' passed."""
    model, inputs = _tiny()
    with pytest.raises(UsageError, match=message):
        amp_rewrite.rewrite(model, inputs, **kwargs)


def test_amp_optimizer_and_rewrite_accept_the_same_dtype_spellings():
    """AmpOptimizer(dtype='fp16') was refused while rewrite(dtype='fp16') worked."""
    from amp_rewrite.training import AmpOptimizer

    model, inputs = _tiny()
    for spelling, want in (("fp16", torch.float16), ("bf16", torch.bfloat16),
                           ("half", torch.float16), (torch.bfloat16, torch.bfloat16)):
        gm = amp_rewrite.rewrite(model, inputs, dtype=spelling)
        assert gm.amp_report["dtype"] == str(want).removeprefix("torch.")
        optimizer = AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dtype=spelling)
        assert optimizer.dtype == want
    for bad in (torch.float32, "fp32", torch.int8):
        with pytest.raises(UsageError):
            AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), dtype=bad)
        with pytest.raises(UsageError):
            amp_rewrite.rewrite(model, inputs, dtype=bad)


def test_device_accepts_torch_device_and_index():
    model, inputs = _tiny()
    gm = amp_rewrite.rewrite(model, inputs, device=torch.device("cpu"))
    assert gm.amp_report["device"] == "cpu"
    assert amp_rewrite.rewrite(model, inputs, device="cuda:0").amp_report["device"] == "cuda"
