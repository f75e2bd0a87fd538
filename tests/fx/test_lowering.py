"""Low kernels as fp32 kernels on low-rounded operands where those measure faster on this CPU
(``amp_rewrite/fx/lowering.py``, ``amp_rewrite/fx/kernel_timing.py``).

Each test compares against something the emulation did not compute: the FP32 model, the
rewrite that keeps PyTorch's low kernel (``emulate_gemms=False``), or the eager region.
"""
from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.fx import kernel_timing, lowering, pointwise
from amp_rewrite.fx.lowering import LOWERED_TAG, native_low_gemm

F = nn.functional


class _Block(nn.Module):
    """Linear, bmm, SDPA and conv: every kernel family the emulation rewrites."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 96)
        self.conv = nn.Conv1d(32, 32, 3, padding=1)
        self.out = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).chunk(3, dim=-1)
        attn = F.scaled_dot_product_attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1))
        mixed = torch.bmm(attn.squeeze(1), k.transpose(1, 2)) @ v
        return self.out(self.conv(mixed.transpose(1, 2)).transpose(1, 2) + x)


def _rms_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_gemms_are_no_less_accurate_than_the_low_kernels_and_still_round(dtype):
    errors = {True: [], False: []}
    for seed in range(3):
        torch.manual_seed(seed)
        block, x = _Block().eval(), torch.randn(4, 16, 32)
        with torch.no_grad():
            ref = block(x)
            for emulate in (True, False):
                gm = amp_rewrite.rewrite(block, (x,), dtype=dtype, emulate_gemms=emulate)
                errors[emulate].append(_rms_error(gm(x), ref))
    emulated, native = sum(errors[True]), sum(errors[False])
    assert emulated <= 1.05 * native, errors
    # the same numerics class, not fp32: operands and results are still rounded
    assert emulated >= 0.7 * native, errors  # fp32 math on rounded inputs: ~0.4x


def test_emulation_tags_every_low_kernel_and_explains_it():
    torch.manual_seed(0)
    block, x = _Block().eval(), torch.randn(4, 16, 32)
    gm = amp_rewrite.rewrite(block, (x,), dtype=torch.bfloat16, emulate_gemms=True)
    report = gm.amp_report["emulated_gemms"]
    kernels = [n for n in gm.graph.nodes if n.meta.get(LOWERED_TAG) == "kernel"]
    assert report["enabled"] and sum(report["kernels"].values()) == len(kernels) >= 5
    assert {str(n.target).split(".")[1] for n in kernels} >= {
        "linear", "scaled_dot_product_attention", "bmm", "conv1d"}
    assert all(n.meta["val"].dtype == torch.float32 for n in kernels)
    assert "emulated bf16 kernel" in amp_rewrite.explain(gm, kernels[0].name)[-1]


def test_default_follows_the_measurement_and_stays_off_without_fusion():
    torch.manual_seed(0)
    block, x = _Block().eval(), torch.randn(2, 8, 32)
    default = amp_rewrite.rewrite(block, (x,), dtype=torch.bfloat16)
    plain = amp_rewrite.rewrite(block, (x,), dtype=torch.bfloat16, emulate_gemms=False)
    unfused = amp_rewrite.rewrite(block, (x,), dtype=torch.bfloat16, fuse=False)
    section = default.amp_report["emulated_gemms"]
    lowered = {n.name for n in default.graph.nodes if n.meta.get(LOWERED_TAG) == "kernel"}
    low_kernels = [n for n in plain.graph.nodes if n.target in lowering.KERNELS
                   and n.meta["val"].dtype == torch.bfloat16]
    assert len(low_kernels) >= 5
    # every low kernel was timed (trainable parameters: forward and backward), and the graph
    # runs the kernel its timing chose
    reported = {c["shape_class"]: c["chosen"] for c in section["timings"]}
    for node in low_kernels:
        choice = lowering.kernel_choice(node, train=True)
        assert reported[choice.shape_class] == choice.chosen
        assert (node.name in lowered) is (choice.chosen == "fp32")
        assert choice.chosen == "low" or (
            choice.ms["fp32"] * kernel_timing.MARGIN < choice.ms["low"])
    assert section["cpu"] == kernel_timing.cpu_model()
    assert unfused.amp_report["emulated_gemms"]["enabled"] is False
    assert native_low_gemm(torch.float16, "cuda") and native_low_gemm(torch.bfloat16, "cuda")


@pytest.mark.slow
def test_gemms_run_in_fp32_where_this_cpu_has_no_low_gemm_units():
    """An independent fact about the CPU (oneDNN's capability check) against the measurement:
    without bf16 units a bf16 GEMM is ~100x slower, far beyond any noise."""
    if native_low_gemm(torch.bfloat16, "cpu"):
        pytest.skip("this CPU has bf16 GEMM units: either kernel may win by shape")
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)), \
        torch.randn(64, 256)
    gm = amp_rewrite.rewrite(model, (x,), dtype=torch.bfloat16)
    assert gm.amp_report["emulated_gemms"]["kernels"].get("linear") == 2


def test_a_kernel_is_timed_on_a_cut_down_call_of_its_own_shape_class():
    """One layer at two batch sizes shares one timing: 2*8192*256*512 FLOPs is 9 proxies'
    worth (PROXY_FLOPS 2.5e8), so 8192 rows are cut to 8192 // 9 = 910, and 16384 rows (18
    proxies) to 910 as well; every dim but the leading one is kept."""
    kernel_timing.forget()

    def linear_node(rows: int) -> torch.fx.Node:
        graph = torch.fx.Graph()
        x, w = graph.placeholder("x"), graph.placeholder("w")
        node = graph.call_function(torch.ops.aten.linear.default, (x, w))
        x.meta["val"] = torch.empty(rows, 256, dtype=torch.bfloat16)
        w.meta["val"] = torch.empty(512, 256, dtype=torch.bfloat16)
        node.meta["val"] = torch.empty(rows, 512, dtype=torch.bfloat16)
        return node
    assert lowering.PROXY_FLOPS == 2.5e8
    first = lowering.kernel_choice(linear_node(8192), train=False)
    assert lowering.kernel_choice(linear_node(16384), train=False) is first
    assert "(910, 256)" in first.shape_class and "(512, 256)" in first.shape_class
    assert first.rounds >= 1 and set(first.ms) == {"low", "fp32"}


def test_a_weight_and_bias_as_wide_as_the_batch_are_not_cut():
    """GPT-2's FFN at 8 x 128 tokens: addmm(bias[1024], x[1024, 1024], w[1024, 1024]) has as
    many weight rows and bias elements as token rows. 2*1024^3 FLOPs is 9 proxies, so only x's
    rows are cut, to 1024 // 9 = 113; the timing must run (finite times), not fail."""
    kernel_timing.forget()
    graph = torch.fx.Graph()
    bias, x, w = graph.placeholder("bias"), graph.placeholder("x"), graph.placeholder("w")
    node = graph.call_function(torch.ops.aten.addmm.default, (bias, x, w))
    bias.meta["val"] = torch.empty(1024, dtype=torch.bfloat16)
    x.meta["val"] = torch.empty(1024, 1024, dtype=torch.bfloat16)
    w.meta["val"] = torch.empty(1024, 1024, dtype=torch.bfloat16)
    node.meta["val"] = torch.empty(1024, 1024, dtype=torch.bfloat16)
    choice = lowering.kernel_choice(node, train=True)
    assert "((1024,)" in choice.shape_class and "(113, 1024)" in choice.shape_class
    assert "(1024, 1024)" in choice.shape_class  # the weight
    assert all(ms == ms for ms in choice.ms.values()) and choice.rounds >= 1  # no NaN


class _Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _train_ms(run) -> float:
    run()
    times = []
    for _ in range(15):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8, 4, 128, 16), (1, 2, 16, 8)])
def test_attention_runs_in_fp32_only_where_that_kernel_is_clearly_faster(shape):
    """The choice agrees with an independent timing of both kernels, except on near ties
    (within the margin and this test's own noise), where either answer is right."""
    q, k, v = (torch.randn(shape, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    gm = amp_rewrite.rewrite(_Attention(), (q, k, v), dtype=torch.bfloat16, keep_io_types=False)
    sdpa = [n for n in gm.graph.nodes if n.target is lowering.SDPA]
    chose_fp32 = sdpa[0].meta.get(LOWERED_TAG) == "kernel"

    def low() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def fp32() -> None:
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        out.to(torch.bfloat16).sum().backward()
    low_ms, fp32_ms = _train_ms(low), _train_ms(fp32)
    ratio = low_ms / fp32_ms
    if min(low_ms, fp32_ms) > 0.5:  # sub-millisecond calls: timer noise decides, not the test
        if ratio > 2 * kernel_timing.MARGIN:
            assert chose_fp32, ratio
        elif ratio < 1 / (2 * kernel_timing.MARGIN):
            assert not chose_fp32, ratio
    with torch.no_grad():  # either way the values are the low kernel's class
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        assert _rms_error(gm(q, k, v), ref) < 1e-2


def test_second_rewrite_of_an_emulated_graph_gives_the_same_code_and_values():
    torch.manual_seed(0)
    block, x = _Block().eval(), torch.randn(2, 8, 32)
    gm = amp_rewrite.rewrite(block, (x,), dtype=torch.bfloat16, emulate_gemms=True)
    again = amp_rewrite.rewrite(gm, (x,), dtype=torch.bfloat16, emulate_gemms=True)
    assert again.code == gm.code and again.amp_report["casts_inserted"] == 0
    with torch.no_grad():
        torch.testing.assert_close(again(x), gm(x), rtol=0, atol=0)


def test_emulated_training_gradients_match_the_low_kernels_class():
    torch.manual_seed(0)
    block, x = _Block().train(), torch.randn(4, 16, 32)
    block(x).square().mean().backward()
    ref = {k: p.grad.clone() for k, p in block.named_parameters()}
    grads = {}
    for emulate in (True, False):
        gm = amp_rewrite.rewrite(block, (x,), dtype=torch.bfloat16, emulate_gemms=emulate)
        gm(x).float().square().mean().backward()
        grads[emulate] = dict(gm.named_parameters())
    for name, expected in ref.items():
        emulated = _rms_error(grads[True][name].grad, expected)
        native = _rms_error(grads[False][name].grad, expected)
        assert emulated <= 1.5 * native + 1e-3, (name, emulated, native)


@pytest.mark.slow
def test_compiled_region_keeps_the_rounding_of_a_cast_round_trip():
    """Inductor by default computes x.to(bf16).to(fp32) without rounding; the regions must
    round as the plan (and the eager region) does, or emulated GEMMs would read fp32."""
    aten = torch.ops.aten

    def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        low = aten._to_copy.default(aten.add.Tensor(x, y), dtype=torch.bfloat16)
        return aten.mul.Tensor(aten._to_copy.default(low, dtype=torch.float32), y)

    x, y = torch.randn(4096), torch.randn(4096)
    # the compiled callable itself: on a CPU the region may measure faster eager and run that
    compiled = pointwise._compile(torch.fx.symbolic_trace(chain), [x, y])(x, y)
    torch.testing.assert_close(compiled, chain(x, y), rtol=0, atol=0)
    assert not torch.equal(compiled, (x + y) * y)  # the rounding is visible at all


def test_an_attention_call_that_cannot_be_timed_keeps_its_low_kernel(monkeypatch):
    def fail(node, train):
        raise RuntimeError("no such kernel")
    monkeypatch.setattr(lowering, "_proxy_call", fail)
    kernel_timing.forget()
    q, k, v = (torch.randn(2, 2, 8, 8, dtype=torch.bfloat16) for _ in range(3))
    gm = amp_rewrite.rewrite(_Attention(), (q, k, v), dtype=torch.bfloat16, keep_io_types=False)
    sdpa = [n for n in gm.graph.nodes if n.target is lowering.SDPA]
    assert sdpa and sdpa[0].meta.get(LOWERED_TAG) is None
    with torch.no_grad():
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        assert _rms_error(gm(q, k, v), ref) < 1e-2


@pytest.mark.slow
def test_a_graph_with_lowered_attention_still_exports_compiles_and_trains(monkeypatch):
    monkeypatch.setattr(lowering, "kernel_choice", measured_faster_in_fp32({lowering.SDPA}))
    torch.manual_seed(0)
    block, x = _Block().train(), torch.randn(2, 8, 32)
    gm = amp_rewrite.rewrite(block, (x,), dtype=torch.bfloat16)
    assert gm.amp_report["emulated_gemms"]["kernels"].get("scaled_dot_product_attention") == 1
    torch.export.export(gm, (x,))
    compiled = torch.compile(gm, backend="aot_eager")
    torch.testing.assert_close(compiled(x), gm(x), rtol=0, atol=0)
    gm(x).float().square().mean().backward()
    grads = [p.grad for p in gm.parameters()]
    assert all(g is not None and g.dtype == torch.float32 and g.isfinite().all() for g in grads)


def test_retyped_shares_one_fake_value_per_layout():
    """``apply.retyped`` (used by the retyping and this lowering) gives ``.to``'s value, one
    per (shape, strides, device, requires_grad) within a memo, and a fresh one without."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from amp_rewrite.fx.apply import retyped

    with FakeTensorMode():
        a, b, c = torch.empty(4, 8), torch.empty(4, 8), torch.empty(8, 4)
        d = torch.empty(4, 8).t()  # c's shape, other strides
        e = torch.empty(4, 8, requires_grad=True)
    memo: dict = {}
    ra, rb, rc, rd, re = (retyped(x, torch.float16, memo) for x in (a, b, c, d, e))
    assert ra is rb
    assert len({id(ra), id(rc), id(rd), id(re)}) == 4
    for x, r in ((a, ra), (c, rc), (d, rd), (e, re)):
        want = x.to(torch.float16)
        assert (r.dtype, r.shape, r.stride(), r.requires_grad) == (
            want.dtype, want.shape, want.stride(), want.requires_grad)
    assert retyped(a, torch.float16) is not retyped(b, torch.float16)


def measured_faster_in_fp32(targets) -> callable:
    """A ``lowering.kernel_choice`` as on a CPU where the fp32 kernels of ``targets`` win."""
    def choice(node, train):
        chosen = "fp32" if node.target in targets else "low"
        return kernel_timing.Choice("kernel", node.name, chosen, "low",
                                    {"low": 2.0, "fp32": 1.0}, 5)
    return choice
