"""The tanh-GELU fusion carries the example values over, so the rewrite skips a full fake
propagation: the carried values must equal what that propagation computes."""
from __future__ import annotations

import torch

from amp_rewrite.fx.capture import capture, refresh_fake_values
from amp_rewrite.fx.fusion import FuseTanhGelu
from tests.fx.test_device_and_floor import NewGelu


def _vals(gm: torch.fx.GraphModule) -> dict[str, tuple]:
    return {n.name: (tuple(n.meta["val"].shape), n.meta["val"].dtype) for n in gm.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def test_fused_gelu_value_equals_a_fresh_fake_propagation():
    gm = capture(NewGelu().eval(), (torch.randn(2, 5, 8),), None)
    assert FuseTanhGelu()(gm).modified
    gelu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.gelu.default)
    carried = _vals(gm)
    assert gelu.name in carried
    refresh_fake_values(gm)
    assert _vals(gm) == carried
