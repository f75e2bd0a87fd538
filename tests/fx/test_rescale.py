"""``dtype="mixed"`` shifts hot GEMM chains into fp16's range by an exact power of two
(fx/rescale.py, core/rescale.py): the GEMMs run fp16 where they ran bf16, the FP32 math is
unchanged (outputs and gradients), and chains with a reader outside them are left alone."""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

import amp_rewrite
from amp_rewrite.fx import rewrite_graph
from amp_rewrite.fx.rescale import RESCALE_TAG
from amp_rewrite.training import AmpOptimizer
from tests.fx.test_mixed import _relative_error, _runtime_dtypes

FP16_TOLERANCE = 2e-3  # a few fp16 roundings (2^-11 each) on the way to the output
FP16_THRESHOLD = 4096.0  # core/precision.LowDtype.FLOAT16.range_threshold
HOT = 3e4  # the hidden values reach ~1e5


def _hot_ffn() -> tuple[nn.Sequential, torch.Tensor]:
    """Linear, ReLU, Linear with the hidden values beyond fp16's range and the second layer
    scaled down to compensate: its outputs are ordinary."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 8))
    with torch.no_grad():
        model[0].weight.mul_(HOT)
        model[0].bias.mul_(HOT)
        model[2].weight.div_(HOT)
    return model, torch.randn(4, 16)


def _mixed(model: nn.Module, x: torch.Tensor, **kwargs) -> torch.fx.GraphModule:
    return amp_rewrite.rewrite(model, (x,), dtype="mixed", device="cpu", fuse=False,
                               **kwargs)


def _no_shift(monkeypatch) -> None:
    """The mixed plan as it was before rescaling: no chain is ever shifted."""
    monkeypatch.setattr("amp_rewrite.fx.rescale.shift", lambda chain: None)


def test_a_hot_chain_runs_fp16_within_fp16_tolerance_where_it_ran_bf16(monkeypatch):
    model, x = _hot_ffn()
    with torch.no_grad():
        want = model(x)
        peak = float(model[0](x).abs().max())
    assert peak > 2e4  # hot: beyond fp16's threshold of 4096
    shifted = _mixed(copy.deepcopy(model), x)
    _no_shift(monkeypatch)
    unshifted = _mixed(copy.deepcopy(model), x)

    assert _runtime_dtypes(shifted, x)["linear"] == torch.float16
    assert _runtime_dtypes(shifted, x)["linear_1"] == torch.float16
    assert _runtime_dtypes(unshifted, x)["linear"] == torch.bfloat16
    assert _runtime_dtypes(unshifted, x)["linear_1"] == torch.bfloat16

    k = math.ceil(math.log2(peak / FP16_THRESHOLD))  # the smallest 2^-k bringing it within
    assert shifted.amp_report["rescaled"] == [{"node": "linear", "shift": k,
                                               "down": "linear_1"}]
    assert unshifted.amp_report["rescaled"] == []
    with torch.no_grad():
        shifted_error = _relative_error(want, shifted(x))
        unshifted_error = _relative_error(want, unshifted(x))
    assert shifted_error < FP16_TOLERANCE
    assert shifted_error < unshifted_error  # fp16's mantissa against bf16's
    for name in ("linear", "linear_1"):
        assert any("core/rescale.py" in line for line in amp_rewrite.explain(shifted, name))


def test_the_parameters_stay_the_users_and_the_scaling_is_in_the_graph():
    model, x = _hot_ffn()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    gm = _mixed(model, x)
    for name, p in gm.named_parameters():
        assert torch.equal(p.detach(), before[name])
    tags = sorted(n.meta[RESCALE_TAG] for n in gm.graph.nodes if RESCALE_TAG in n.meta)
    assert tags == ["down", "up", "up"]  # W_up, its bias, W_down


def test_a_hot_value_with_a_reader_outside_the_chain_is_left_alone():
    class SecondReader(nn.Module):
        def __init__(self, ffn: nn.Sequential) -> None:
            super().__init__()
            self.up, self.down = ffn[0], ffn[2]

        def forward(self, x):
            h = torch.relu(self.up(x))
            return self.down(h), h.amax(-1)  # h is read outside the chain

    ffn, x = _hot_ffn()
    gm = _mixed(SecondReader(ffn), x)
    assert gm.amp_report["rescaled"] == []
    assert _runtime_dtypes(gm, x)["linear"] == torch.bfloat16


def test_a_second_rewrite_does_not_shift_again():
    model, x = _hot_ffn()
    gm = _mixed(model, x)
    code = gm.code
    again = rewrite_graph(gm, dtype="mixed", device="cpu", fuse=False)
    assert again.amp_report["rescaled"] == []
    assert again.code == code


def test_one_training_step_gives_fp32_gradients():
    model, x = _hot_ffn()
    target = torch.randn(4, 8)
    fp32 = copy.deepcopy(model)
    torch.nn.functional.mse_loss(fp32(x), target).backward()

    gm = _mixed(copy.deepcopy(model), x, mode="train")
    assert gm.amp_report["rescaled"]
    amp = AmpOptimizer(torch.optim.SGD(gm.parameters(), lr=0.0), model=gm)
    for _ in range(32):  # W_down's gradient is ~1e3: the first loss scales overflow fp16
        amp.backward(torch.nn.functional.mse_loss(gm(x).float(), target))
        if amp.step():  # unscaled, finite: the step FP32 would take
            break
        amp.zero_grad()
    else:
        raise AssertionError("no finite step")
    want = dict(fp32.named_parameters())
    for name, p in gm.named_parameters():
        assert _relative_error(want[name].grad, p.grad) < 1e-2, name
