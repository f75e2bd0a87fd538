"""Modules not held in float32: a bf16 module under an fp16 rewrite is converted like CPU
autocast would and keeps its output dtype; an fp64 module is returned unchanged with a note
that says so. Oracle: CPU autocast and the eager module.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.fx import rewrite_graph


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.body(x) * 8.0, y)


def _classifier_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(32, 16, generator=gen).to(dtype), torch.randint(0, 10, (32,),
                                                                       generator=gen)


def test_bf16_module_under_fp16_rewrite_is_converted_like_cpu_autocast():
    """It came back unchanged with the false note 'no floating-point tensors'."""
    torch.manual_seed(0)
    model = _Classifier().to(torch.bfloat16)
    x, y = _classifier_inputs(torch.bfloat16)
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (x, y), dtype=torch.float16,
                             keep_io_types=False, emulate_gemms=False)
    dtypes = {n.name: n.meta["val"].dtype for n in gm.graph.nodes
              if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)}
    assert dtypes["linear"] == dtypes["linear_1"] == torch.float16  # low ops: the target dtype
    assert dtypes["cross_entropy_loss"] == torch.float32  # fp32-list op: upcast, as autocast
    assert any("bfloat16 tensors are converted" in n for n in gm.amp_report["notes"])
    assert not any("no floating-point" in n for n in gm.amp_report["notes"])
    with torch.autocast("cpu", dtype=torch.float16):
        autocast_loss = model(x, y)
    fp32_loss = copy.deepcopy(model).float()(x.float(), y)
    assert gm(x, y).item() == pytest.approx(autocast_loss.item(), abs=2e-3)
    assert abs(gm(x, y).item() - fp32_loss.item()) <= abs(model(x, y).item()
                                                           - fp32_loss.item()) + 2e-3


def test_bf16_module_keeps_its_output_dtype_and_second_run_changes_nothing():
    model = _Classifier().to(torch.bfloat16)
    x, y = _classifier_inputs(torch.bfloat16)
    gm = amp_rewrite.rewrite(model, (x, y), dtype="fp16")
    assert gm(x, y).dtype == torch.bfloat16
    code = gm.code
    again = rewrite_graph(gm, dtype="fp16")
    assert again.code == code and not again.amp_report["modified"]


def test_fp64_module_is_returned_unchanged_with_a_true_note():
    model = _Classifier().double()
    x, y = _classifier_inputs(torch.float64)
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (x, y), dtype=torch.float16)
    torch.testing.assert_close(gm(x, y), model(x, y), rtol=0, atol=0)
    with torch.autocast("cpu", dtype=torch.float16):  # autocast never casts float64 either
        torch.testing.assert_close(model(x, y), gm(x, y), rtol=0, atol=0)
    notes = " ".join(gm.amp_report["notes"])
    assert "float64" in notes and "no floating-point" not in notes
