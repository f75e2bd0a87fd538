"""``DropFullSlices`` (``amp_rewrite/fx/passes.py``): a slice that keeps every element is
dropped, any other slice stays, and the values are those of the model."""
from __future__ import annotations

import torch
from torch import nn

import amp_rewrite


class _Head(nn.Module):
    """Hugging Face LMs' ``hidden_states[:, slice(-0, None), :]`` before the LM head, plus a
    slice that drops the first position."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.proj(x)
        return self.head(h[:, 0:, :]), h[:, 1:, :].sum(-1)


def _slices(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.slice.Tensor]


def test_full_slices_are_dropped_and_partial_ones_kept():
    torch.manual_seed(0)
    model, x = _Head(), torch.randn(2, 5, 16)
    dynamic = {"x": {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}}
    exported = torch.export.export(model, (x,), dynamic_shapes=dynamic).module()
    assert len(_slices(exported)) >= 2  # with dynamic dims the export keeps both
    gm = amp_rewrite.rewrite(model, (x,), dtype=torch.bfloat16, fuse=False)
    kept = _slices(gm)
    assert len(kept) == 1 and kept[0].args[2] == 1  # the slice from position 1 stays
    with torch.no_grad():
        logits, rest = gm(x)
        ref_logits, ref_rest = model(x)
    assert logits.shape == ref_logits.shape and rest.shape == ref_rest.shape == (2, 4)
    torch.testing.assert_close(logits, ref_logits, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(rest, ref_rest, rtol=5e-2, atol=5e-2)
    gm(x)[0].float().sum().backward()  # gradients still reach the first layer
    assert gm.get_parameter("proj.weight").grad is not None


def test_a_slice_written_through_in_place_stays():
    class Writes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            y[:, 0:].add_(1)  # the write must reach y
            return y

    x = torch.randn(3, 4)
    gm = amp_rewrite.rewrite(Writes(), (x,), dtype=torch.bfloat16, fuse=False)
    torch.testing.assert_close(gm(x), x * 2 + 1, rtol=2e-2, atol=2e-2)
