"""FP8 GEMMs (``core/fp8.py``, ``fx/fp8.py``; decision 0029).

Oracles: hand-derived roofline times; fp32 matmuls of the dequantized operands; the FP32
module's outputs and gradients; the bf16 rewrite (graph and training losses); the original
module's ``state_dict``.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import amp_rewrite
from amp_rewrite.arguments import ArgumentError
from amp_rewrite.core.fp8 import Fp8Policy, Gemm, plan_fp8, should_fp8, step_seconds
from amp_rewrite.fx import fp8 as fx_fp8
from amp_rewrite.fx import rewrite_graph
from amp_rewrite.fx.capture import capture
from amp_rewrite.fx.fp8 import E4M3, E5M2, fp8_linear, quantize

H100 = Fp8Policy()
BW = 3.35e12  # bytes/s, and the Tensor-Core peaks, as documented in decision 0029
BF16, FP8 = 989.4e12, 1978.9e12
KERNEL = 4e-6


# ----------------------------------------------------------------------------- cost model


def test_inference_step_of_a_compute_bound_gemm_matches_the_hand_roofline():
    m = n = k = 8192
    bf16, fp8 = step_seconds(Gemm("g", "g", m, n, k, "x", training=False), H100)
    # bf16: the GEMM (compute bound) + the fp32 -> bf16 weight cast (read 4, write 2 bytes)
    want_bf16 = 2 * m * n * k / BF16 + KERNEL + 6 * n * k / BW + KERNEL
    # FP8: the GEMM at twice the rate + amax and cast of X (bf16: 2+2+1 bytes) and of the
    # fp32 weight (4+4+1 bytes), two kernels each
    want_fp8 = (2 * m * n * k / FP8 + KERNEL + (5 * m * k / BW + 2 * KERNEL)
                + (9 * n * k / BW + 2 * KERNEL))
    assert bf16 == pytest.approx(want_bf16, rel=1e-12)
    assert fp8 == pytest.approx(want_fp8, rel=1e-12)


def test_fp8_costs_are_those_of_the_dims_padded_to_16():
    aligned = step_seconds(Gemm("g", "g", 4096, 4096, 4096, "x"), H100)[1]
    padded = step_seconds(Gemm("g", "g", 4081, 4083, 4095, "x"), H100)[1]
    assert padded == aligned


def test_tiny_gemm_stays_bf16_and_a_llama_projection_goes_fp8():
    tiny = should_fp8(Gemm("t", "t", 32, 64, 64, "x"), H100)
    assert not tiny.fp8 and "cost model" in tiny.reason
    q_proj = should_fp8(Gemm("q", "q", 8 * 2048, 4096, 4096, "x"), H100)
    assert q_proj.fp8 and q_proj.bf16_us >= H100.min_gain * q_proj.fp8_us


def test_a_shared_quantization_makes_grouped_attention_projections_pay():
    q, k, v = (Gemm(name, name, 16384, n, 4096, "x_norm")
               for name, n in (("q", 4096), ("k", 1024), ("v", 1024)))
    alone = plan_fp8([k], H100)
    assert not alone["k"].fp8  # X's quantization costs nearly all that FP8 saves
    together = plan_fp8([q, k, v], H100)
    assert all(c.fp8 for c in together.values())
    assert "shared by 3 GEMMs" in together["k"].reason


def test_a_gemm_that_falls_back_to_bf16_is_not_counted_as_a_sharer():
    big = Gemm("big", "big", 16384, 4096, 4096, "x")
    small = Gemm("small", "small", 64, 64, 4096, "x")
    choices = plan_fp8([big, small], H100)
    assert choices["big"].fp8 and not choices["small"].fp8
    assert choices["big"] == should_fp8(big, H100, 1)


def test_min_size_replaces_the_cost_model():
    tiny = Gemm("t", "t", 32, 64, 64, "x")
    assert should_fp8(tiny, Fp8Policy(min_size=0)).fp8
    assert not should_fp8(tiny, Fp8Policy(min_size=32 * 64 * 64 + 1)).fp8


# ----------------------------------------------------------------------------- runtime


def test_quantize_maps_the_amax_to_the_fp8_maximum_and_pads_with_zeros():
    torch.manual_seed(0)
    t = torch.randn(20, 37)
    values, scale = quantize(t, E4M3, rowwise=False)
    assert values.shape == (32, 48) and values.is_contiguous() and scale.dtype == torch.float32
    assert values.float().abs().max() == torch.finfo(E4M3).max
    assert not values[20:].float().any() and not values[:, 37:].float().any()
    assert (values.float()[:20, :37] * scale - t).abs().max() <= t.abs().max() / 16
    rows, row_scale = quantize(t, E5M2, rowwise=True)
    assert row_scale.shape == (32, 1)
    top = rows.float()[:20].abs().amax(dim=1)
    assert torch.equal(top, torch.full_like(top, torch.finfo(E5M2).max))


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("a_dtype", [E4M3, E5M2])
def test_kernel_and_emulation_give_the_fp32_product_of_the_dequantized_operands(
        monkeypatch, rowwise, a_dtype):
    torch.manual_seed(0)
    a = quantize(torch.randn(48, 64), a_dtype, rowwise)
    b = quantize(torch.randn(32, 64), E4M3, rowwise)
    ref = ((a[0].float() * a[1]) @ (b[0].float() * b[1]).t())[:40, :30]
    emulated = fx_fp8._mm(a, b, 40, 30)
    monkeypatch.setattr(fx_fp8, "EMULATED_DEVICES", frozenset())  # CPU's own _scaled_mm
    kernel = fx_fp8._mm(a, b, 40, 30)
    for out in (emulated, kernel):
        assert out.dtype == torch.bfloat16 and out.shape == (40, 30)
        torch.testing.assert_close(out, ref.bfloat16(), rtol=1e-2, atol=1e-2)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("transposed", [False, True])
def test_fp8_linear_forward_and_gradients_follow_the_fp32_linear(scaling, transposed):
    torch.manual_seed(0)
    x = torch.randn(3, 7, 20, requires_grad=True)
    w = torch.randn(20, 37) if transposed else torch.randn(37, 20)
    w.requires_grad_(True)
    bias = torch.randn(37)
    ref = F.linear(x, w.t() if transposed else w, bias)
    ref.backward(torch.cos(ref.detach()))
    ref_dx, ref_dw = x.grad, w.grad
    x.grad = w.grad = None
    out = fp8_linear(x.bfloat16(), w, bias.bfloat16(), transposed=transposed, scaling=scaling)
    out.backward(torch.cos(ref.detach()).bfloat16())
    assert out.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(out, ref) < 0.08
    assert _rel(x.grad, ref_dx) < 0.15 and _rel(w.grad, ref_dw) < 0.15


def test_weight_is_quantized_once_per_version():
    torch.manual_seed(0)
    w, x = nn.Parameter(torch.randn(32, 16)), torch.randn(4, 16)
    fp8_linear(x.bfloat16(), w)
    first = fx_fp8._MEMO[w][("nk", False, False)]
    fp8_linear(torch.randn(4, 16).bfloat16(), w)
    assert fx_fp8._MEMO[w][("nk", False, False)] is first
    with torch.no_grad():
        w.mul_(2)  # an optimizer step: a new version
    fp8_linear(x.bfloat16(), w)
    again = fx_fp8._MEMO[w][("nk", False, False)]
    assert again[0] == w._version and torch.equal(again[1][1], first[1][1] * 2)


# ----------------------------------------------------------------------------- the pass


def _config(name: str):
    import transformers as tf

    if name == "gpt2":  # n_embd 40: K and N padded to 48
        return tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=40, n_layer=2, n_head=2, vocab_size=100, n_positions=32, use_cache=False,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=100, use_cache=False))
    return tf.BertForMaskedLM(tf.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


class _Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, return_dict=False)[0]


def _lm(name: str) -> nn.Module:
    """A tiny LM, seeded, without dropout (outputs comparable across rewrites)."""
    torch.manual_seed(0)
    return _Logits(_config(name)).train()


def _ids(batch: int = 4, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(0))


def _gemm_names(gm: torch.fx.GraphModule) -> list[str]:
    return [r["name"] for r in gm.amp_report["fp8"]["gemms"]]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_tiny_gemms_stay_bf16_by_the_cost_model(name):
    ids = _ids()
    bf16 = amp_rewrite.rewrite(_lm(name), (ids,), dtype=torch.bfloat16)
    gm = amp_rewrite.rewrite(_lm(name), (ids,), dtype=torch.bfloat16, fp8="tensorwise")
    records = gm.amp_report["fp8"]["gemms"]
    assert records and all(r["dtype"] == "bf16" and "cost model" in r["reason"]
                           for r in records)
    assert gm.code == bf16.code and not gm.amp_report["fp8"]["counts"].get("fp8")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_forced_fp8_runs_every_gemm_keeps_the_state_dict_and_trains(name):
    ids, module = _ids(), _lm(name)
    gm = amp_rewrite.rewrite(module, (ids,), dtype=torch.bfloat16, fp8="tensorwise",
                             fp8_min_size=0)
    # the plan's bf16 GEMMs, before any is lowered to an fp32 kernel that times faster here
    bf16 = amp_rewrite.rewrite(module, (ids,), dtype=torch.bfloat16, emulate_gemms=False)
    gemms = [n for n in bf16.graph.nodes if n.target in fx_fp8._GEMMS
             and n.meta["val"].dtype == torch.bfloat16]
    assert gm.amp_report["fp8"]["counts"] == {"fp8": len(gemms)} and gemms
    assert all(n.target is fp8_linear for n in gm.graph.nodes if n.name in _gemm_names(gm))
    want = {k: (v.shape, v.dtype) for k, v in module.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in gm.state_dict().items()} == want
    out = gm(ids)
    out.float().square().mean().backward()
    with torch.no_grad():
        assert _rel(out, module(ids)) < 0.1
    grads = [p.grad for p in gm.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)


@pytest.mark.slow
def test_second_rewrite_changes_nothing_and_explain_names_the_fp8_gemm():
    ids = _ids()
    options = {"dtype": torch.bfloat16, "fp8": "rowwise", "fp8_min_size": 0}
    gm = amp_rewrite.rewrite(_lm("gpt2"), (ids,), **options)
    again = amp_rewrite.rewrite(gm, (ids,), **options)
    assert again.code == gm.code and again.amp_report["casts_inserted"] == 0
    assert again.amp_report["fp8"]["gemms"] == gm.amp_report["fp8"]["gemms"]
    record = gm.amp_report["fp8"]["gemms"][0]
    lines = amp_rewrite.explain(gm, record["name"])
    assert f"fp8 GEMM (M, N, K) = ({record['m']}, {record['n']}, {record['k']})" in lines[-1]
    plain = amp_rewrite.rewrite(gm, (ids,), dtype=torch.bfloat16)  # FP8 off: back to bf16
    assert not any(n.target is fp8_linear for n in plain.graph.nodes)


@pytest.mark.slow
def test_rewrite_graph_takes_the_fp8_options_as_rewrite_does():
    ids = _ids()
    options = {"dtype": torch.bfloat16, "fp8": "tensorwise", "fp8_min_size": 0}
    expected = amp_rewrite.rewrite(_lm("llama"), (ids,), **options)
    captured = capture(_lm("llama"), (ids,), {})
    gm = rewrite_graph(captured, **options)
    assert gm.amp_report["fp8"]["counts"] == expected.amp_report["fp8"]["counts"]
    assert gm.amp_report["fp8"]["counts"].get("fp8", 0) > 0


@pytest.mark.slow
def test_a_cuda_plan_runs_on_cpu_tensors_and_keep_bf16_holds():
    ids = _ids()
    gm = amp_rewrite.rewrite(_lm("llama"), (ids,), dtype=torch.bfloat16, device="cuda",
                             fp8="tensorwise", fp8_min_size=0, keep_bf16=["linear_1*"])
    records = {r["name"]: r for r in gm.amp_report["fp8"]["gemms"]}
    assert records["linear_1"]["dtype"] == "bf16" and "keep_bf16" in records["linear_1"]["reason"]
    assert records["linear"]["dtype"] == "fp8"
    gm(ids).float().mean().backward()


def test_the_compile_backend_runs_fp8_gemms_on_the_users_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 8))
    x = torch.randn(6, 24)
    compiled = amp_rewrite.compile(model, dtype="bf16", inner="eager", fp8="tensorwise",
                                   fp8_min_size=0)
    out = compiled(x)
    out.float().square().mean().backward()
    (report,) = amp_rewrite.report(compiled)
    assert report["report"]["fp8"]["counts"] == {"fp8": 2}
    with torch.no_grad():
        assert _rel(out, model(x)) < 0.1
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
               for p in model.parameters())


@pytest.mark.parametrize("kwargs", [
    {"fp8": "tensorwise", "dtype": torch.float16},
    {"fp8": "blockwise"},
    {"keep_bf16": ["lm_head"]},
    {"fp8": "rowwise", "fp8_grad_dtype": torch.bfloat16},
    {"fp8": "rowwise", "fp8_min_size": -1},
])
def test_wrong_fp8_options_fail_at_the_call(kwargs):
    options = {"dtype": torch.bfloat16, **kwargs}
    with pytest.raises(ArgumentError):
        amp_rewrite.rewrite(nn.Linear(16, 16), (torch.randn(2, 16),), **options)


# ----------------------------------------------------------------------------- training


def _markov_batches(steps: int, batch: int = 8, seq: int = 16) -> list[torch.Tensor]:
    """Tokens from a fixed random Markov chain: a loss floor above zero, reached by learning."""
    g = torch.Generator().manual_seed(0)
    transitions = torch.softmax(3 * torch.randn(100, 100, generator=g), dim=-1)
    batches = []
    for _ in range(steps):
        ids = [torch.randint(0, 100, (batch,), generator=g)]
        for _ in range(seq - 1):
            ids.append(torch.multinomial(transitions[ids[-1]], 1, generator=g).squeeze(1))
        batches.append(torch.stack(ids, dim=1))
    return batches


def _train(name: str, batches: list[torch.Tensor], **options) -> list[float]:
    gm = amp_rewrite.rewrite(_lm(name), (batches[0],), dtype=torch.bfloat16, **options)
    optimizer = amp_rewrite.AmpOptimizer(torch.optim.AdamW(gm.parameters(), lr=3e-3),
                                         dtype=torch.bfloat16)
    losses = []
    for ids in batches:
        if name == "bert":  # masked LM: 15% of the positions, predicted from the rest
            mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(len(losses)))
            mask = mask < 0.15
            logits = gm(torch.where(mask, torch.full_like(ids, 99), ids))
            loss = F.cross_entropy(logits[mask].float(), ids[mask])
        else:
            logits = gm(ids)
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, 100),
                                   ids[:, 1:].reshape(-1))
        optimizer.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_200_fp8_training_steps_end_within_2_percent_of_the_bf16_rewrite(name):
    batches = _markov_batches(200)
    bf16 = _train(name, batches)
    fp8 = _train(name, batches, fp8="tensorwise", fp8_min_size=0)
    final = {k: sum(v[-20:]) / 20 for k, v in (("bf16", bf16), ("fp8", fp8))}
    assert all(math.isfinite(x) for x in fp8)
    assert final["bf16"] < sum(bf16[:5]) / 5 - 0.1  # it learned something (nats)
    assert abs(final["fp8"] - final["bf16"]) <= 0.02 * final["bf16"], final


def _train_torchao(name: str, batches: list[torch.Tensor]) -> list[float]:
    """The peer: torchao's tensor-wise float8 recipe on the same LM, under bf16 autocast."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _lm(name)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=lambda m, _: m.in_features % 16 == 0
                               and m.out_features % 16 == 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for ids in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, 100), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_200_fp8_training_steps_end_within_2_percent_of_torchaos_float8(name):
    pytest.importorskip("torchao.float8")  # not a test dependency: runs where it is installed
    batches = _markov_batches(200)
    ours = _train(name, batches, fp8="tensorwise", fp8_min_size=0)
    peer = _train_torchao(name, batches)
    mean = lambda losses: sum(losses[-10:]) / 10  # noqa: E731
    assert abs(mean(ours) - mean(peer)) <= 0.02 * mean(peer)
