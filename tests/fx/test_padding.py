"""The fx pad pass (fx/pad.py): padded dims inside the graph, parameters and state_dict
unchanged, outputs and gradients equal to the unpadded rewrite's, export/compile still work,
no double padding. Oracles: the unpadded rewrite (pad=False) and the FP32 module."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import amp_rewrite
from amp_rewrite.fx import rewrite_graph
from amp_rewrite.fx.capture import capture
from amp_rewrite.core.padding import PadPolicy
from amp_rewrite.fx.pad import PadGemms

aten = torch.ops.aten
# Memory traffic free: the cost model reduces to FLOPs at Tensor-Core / misaligned / fallback
# rates, so these small modules are planned as large, compute-bound ones would be.
# the 3-channel stem's padding mechanics; the default policy declines it (measured slower
# on an H200, PadPolicy docstring)
COMPUTE_BOUND = PadPolicy(memory_tbps=float("inf"), pad_small_conv_channels=True)


def mlp_100_37_1001() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(100, 37), nn.GELU(), nn.Linear(37, 1001))


def cnn_3_13_7(groups: int = 1) -> nn.Module:
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(13)
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    second = nn.Conv2d(13, 7, 3, padding=1) if groups == 1 else nn.Conv2d(13, 13, 3, groups=13)
    return nn.Sequential(nn.Conv2d(3, 13, 3, padding=1), bn, nn.ReLU(), second).eval()


def _gemms(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and n.target in (aten.linear.default, aten.conv2d.default)]


def _between(gm: torch.fx.GraphModule, first: torch.fx.Node, second: torch.fx.Node) -> list:
    nodes = list(gm.graph.nodes)
    return [n.target for n in nodes[nodes.index(first) + 1:nodes.index(second)]
            if n.op == "call_function"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def test_mlp_100_37_1001_is_padded_with_nothing_between_its_gemms():
    x = torch.randn(4, 100)
    # fuse=False: the ops between the GEMMs are inspected one by one, not inside a region
    gm = amp_rewrite.rewrite(mlp_100_37_1001(), (x,), pad=True, fuse=False)
    report = gm.amp_report["padding"]
    assert [op["dims"] for op in report["ops"]] == [{"K": "100→104", "N": "37→40"},
                                                   {"K": "37→40", "N": "1001→1008"}]
    first, second = _gemms(gm)
    assert _between(gm, first, second) == [aten.gelu.default]
    assert [tuple(w.meta["val"].shape) for w in (first.args[1], second.args[1])] == [
        (40, 104), (1008, 40)]
    # the weight's cast directly follows its pad, so a pointwise fuser takes both
    for w in (first.args[1], second.args[1]):
        assert w.target is aten._to_copy.default
        assert w.args[0].target is aten.constant_pad_nd.default and w.args[0].next is w
        assert w.args[0].args[0].op == "get_attr"


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_outputs_and_gradients_equal_the_unpadded_rewrite(dtype, tol):
    model, x = mlp_100_37_1001(), torch.randn(8, 100)
    # one kernel family on both sides: a timed choice could lower the padded GEMMs (their
    # own shape class) and not the unpadded ones, which changes the rounding, not the padding
    padded = amp_rewrite.rewrite(model, (x,), dtype=dtype, pad=True, emulate_gemms=False)
    plain = amp_rewrite.rewrite(model, (x,), dtype=dtype, pad=False, emulate_gemms=False)
    yp, yu = padded(x), plain(x)
    assert yp.shape == yu.shape == (8, 1001) and yp.dtype == yu.dtype
    assert _rel(yp, yu) <= tol and _rel(yp, model(x)) <= 10 * tol
    yp.square().sum().backward()
    yu.square().sum().backward()
    for (name, p), (_, q) in zip(padded.named_parameters(), plain.named_parameters()):
        assert p.grad.shape == p.shape and p.grad.dtype == torch.float32, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_state_dict_keys_shapes_and_dtypes_are_unchanged():
    model = mlp_100_37_1001()
    gm = amp_rewrite.rewrite(model, (torch.randn(4, 100),), pad=True)
    want = {k: (v.shape, v.dtype) for k, v in model.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in gm.state_dict().items()} == want


@pytest.mark.parametrize("make,shape", [(mlp_100_37_1001, (4, 100)), (cnn_3_13_7, (2, 3, 8, 8))])
def test_fp32_mode_padding_changes_outputs_by_at_most_1e_6(make, shape):
    model, x = make(), torch.randn(*shape)
    gm = capture(model, (x,), None, mode="export")
    pad = PadGemms(COMPUTE_BOUND, low=(torch.float32,))
    assert pad(gm).modified and pad.plan.padded_ops
    with torch.no_grad():
        assert _rel(gm(x), model(x)) <= 1e-6


def test_cnn_3_13_7_pads_channels_and_the_3_channel_stem_when_compute_bound():
    # the stem pays when compute-bound: 2.67x FLOPs on Tensor Cores vs the 7.4x slower
    # CUDA-core fallback (the old 1.5 FLOP cap refused it; replaced by the cost model)
    model, x = cnn_3_13_7(), torch.randn(2, 3, 8, 8)
    gm = amp_rewrite.rewrite(model, (x,), pad=COMPUTE_BOUND, fuse=False)  # ops one by one
    report = gm.amp_report["padding"]
    assert [op["dims"] for op in report["ops"]] == [{"Cin": "3→8", "Cout": "13→16"},
                                                   {"Cin": "13→16", "Cout": "7→8"}]
    first, second = _gemms(gm)
    assert set(_between(gm, first, second)) <= {aten.batch_norm.default, aten.relu.default}
    plain = amp_rewrite.rewrite(model, (x,), pad=False)
    with torch.no_grad():
        assert gm(x).shape == plain(x).shape
        assert _rel(gm(x), plain(x)) <= 2e-3


def test_depthwise_conv_is_not_padded():
    gm = amp_rewrite.rewrite(cnn_3_13_7(groups=13), (torch.randn(2, 3, 8, 8),), pad=True)
    reasons = [r["reasons"] for r in gm.amp_report["padding"]["not_padded"]]
    assert any("grouped conv" in r.get("Cin", "") for r in reasons)


def test_pad_none_means_on_for_cuda_off_for_cpu():
    model, x = mlp_100_37_1001(), torch.randn(4, 100)
    assert amp_rewrite.rewrite(model, (x,)).amp_report["padding"] == {"enabled": False}
    on = amp_rewrite.rewrite(model, (x,), device="cuda")
    assert on.amp_report["padding"]["padded_ops"] == 2


def test_second_rewrite_pads_nothing():
    model, x = mlp_100_37_1001(), torch.randn(4, 100)
    gm = amp_rewrite.rewrite(model, (x,), pad=True)
    before = [n.format_node() for n in gm.graph.nodes]
    again = rewrite_graph(copy.deepcopy(gm), pad=True)
    assert again.amp_report["padding"]["padded_ops"] == 0
    assert [n.format_node() for n in again.graph.nodes] == before


@pytest.mark.slow
def test_padded_result_exports_and_compiles():
    model, x = mlp_100_37_1001(), torch.randn(4, 100)
    gm = amp_rewrite.rewrite(model, (x,), pad=True)
    with torch.no_grad():
        want = gm(x)
        exported = torch.export.export(gm, (x,)).module()
        torch.testing.assert_close(exported(x), want)
        compiled = torch.compile(gm, backend="aot_eager")
        torch.testing.assert_close(compiled(x), want)


class OddDigitsNet(nn.Module):
    """load_digits MLP with misaligned widths (64→50→37→10) and a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm = nn.Linear(64, 50), nn.LayerNorm(50)
        self.fc2, self.head = nn.Linear(50, 37), nn.Linear(37, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(F.gelu(self.norm(self.fc1(x))))))


@pytest.mark.slow
def test_load_digits_training_with_padding_matches_without():
    datasets = pytest.importorskip("sklearn.datasets")
    from amp_rewrite.training import AmpOptimizer

    data = datasets.load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.int64)
    torch.manual_seed(0)
    initial = OddDigitsNet().state_dict()
    accuracy = {}
    for pad in (False, True):
        net = amp_rewrite.rewrite(OddDigitsNet(), (x[:64],), pad=pad and COMPUTE_BOUND,
                                  dynamic_shapes=({0: torch.export.Dim("batch")},))
        net.load_state_dict(initial)
        opt = AmpOptimizer(torch.optim.Adam(net.parameters(), lr=1e-2), dtype=torch.float16)
        batches = torch.Generator().manual_seed(1)
        for _ in range(40):
            idx = torch.randint(0, 1400, (64,), generator=batches)
            opt.backward(F.cross_entropy(net(x[idx]).float(), y[idx]))
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            accuracy[pad] = (net(x[1400:]).argmax(-1) == y[1400:]).float().mean().item()
        if pad:
            # fc1 N; fc2 K, N; the head (K 37→40 with N 10→16) would cost 1.73x its FLOPs
            # to save the 1.6x of misalignment, and K alone leaves N misaligned
            report = net.amp_report["padding"]
            assert report["padded_ops"] == 2
            assert all("cost model" in r for op in report["not_padded"]
                       for r in op["reasons"].values())
    assert accuracy[False] > 0.8
    assert abs(accuracy[True] - accuracy[False]) <= 0.01


class TwoOutputs(nn.Module):
    """A 3-D linear whose output is returned and also read by the next linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(100, 37), nn.Linear(37, 21)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc1(x)
        return h, self.fc2(torch.relu(h))


def test_output_also_read_by_a_gemm_keeps_its_shape_in_fp32_mode():
    torch.manual_seed(0)
    model, x = TwoOutputs(), torch.randn(2, 5, 100)
    gm = capture(model, (x,), None, mode="export")
    pad = PadGemms(COMPUTE_BOUND, low=(torch.float32,))
    assert pad(gm).modified and pad.report()["regions_propagated"] == 1
    with torch.no_grad():
        for got, want in zip(gm(x), model(x)):
            assert got.shape == want.shape
            assert _rel(got, want) <= 1e-6
