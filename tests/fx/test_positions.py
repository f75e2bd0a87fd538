"""Angles built from positions (RoPE, sinusoidal timestep embeddings) stay fp32 up to their
cos/sin, whose bounded outputs then go low: ``cos``/``sin`` are deny with a bounded output.

At position 3000 a bf16 angle is off by up to 8 rad, so a plan that lowers ``positions ·
frequency`` rotates queries and keys at random; the references here are FP32 and autocast's
error on the same inputs."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_rewrite

transformers = pytest.importorskip("transformers")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# RoPE families as transformers builds them (name -> config, model, extra config)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"num_key_value_heads": 2}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"num_key_value_heads": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", {"pad_token_id": 0}),
}
_QK_WEIGHTS = ("q_proj.weight", "k_proj.weight", "query_key_value.weight", "qkv_proj.weight")


class _Decoder(nn.Module):
    """A tiny decoder called with explicit position ids (a decode step deep into a context),
    queries and keys scaled up so that attention is sharp and follows the rotation."""

    def __init__(self, family: str = "llama") -> None:
        super().__init__()
        torch.manual_seed(0)
        config, model, extra = FAMILIES[family]
        cfg = getattr(transformers, config)(hidden_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, intermediate_size=128,
                                            vocab_size=128, max_position_embeddings=8192,
                                            use_cache=False, **extra)
        self.model = getattr(transformers, model)(cfg)
        with torch.no_grad():
            for name, weight in self.model.named_parameters():
                if name.endswith(_QK_WEIGHTS):
                    weight.mul_(8)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, position_ids=positions, return_dict=False)[0]


class _TimestepEmbedding(nn.Module):
    """Diffusion models' sinusoidal embedding of integer timesteps, then a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("freqs", torch.exp(-torch.arange(32) * (9.2 / 32)))
        self.proj = nn.Linear(64, 64)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        angles = t.float()[:, None] * self.freqs[None]
        return self.proj(torch.cat([angles.cos(), angles.sin()], dim=-1))


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _autocast_error(module: nn.Module, inputs: tuple, dtype: torch.dtype,
                    ref: torch.Tensor) -> float:
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        return _error(module(*inputs), ref)


def _decoder_case(family: str = "llama") -> tuple[nn.Module, tuple]:
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(1))
    return _Decoder(family).eval(), (ids, 3000 + torch.arange(32)[None])


def _timestep_case() -> tuple[nn.Module, tuple]:
    return _TimestepEmbedding().eval(), (torch.tensor([0, 17, 500, 999, 2999]),)


def _rewritten_within_autocasts_error(module: nn.Module, inputs: tuple,
                                      dtype: str) -> torch.fx.GraphModule:
    with torch.no_grad():
        ref = module(*inputs)
    bound = 1.5 * _autocast_error(module, inputs, DTYPES[dtype], ref)
    rewritten = amp_rewrite.rewrite(copy.deepcopy(module), inputs, dtype=dtype)
    with torch.no_grad():
        err = _error(rewritten(*inputs), ref)
    assert err <= bound, (err, bound)
    return rewritten


@pytest.mark.parametrize("case", [_decoder_case, _timestep_case], ids=["llama", "timesteps"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_position_angles_within_autocasts_error(case, dtype: str) -> None:
    rewritten = _rewritten_within_autocasts_error(*case(), dtype)
    # the angles (positions · frequencies, the graph's first mul) and their cos run fp32
    assert amp_rewrite.explain(rewritten, "mul")[0].startswith("mul (mul/T): high")
    assert amp_rewrite.explain(rewritten, "cos")[0].startswith("cos (cos/T): high — deny")


def test_backend_keeps_rope_angles_fp32() -> None:
    module, inputs = _decoder_case()
    with torch.no_grad():
        ref = module(*inputs)
        compiled = amp_rewrite.compile(copy.deepcopy(module), dtype="bf16", inner="eager")
        err = _error(compiled(*inputs), ref)
    assert err <= 1.5 * _autocast_error(module, inputs, torch.bfloat16, ref)
    assert any("deny" in line for line in amp_rewrite.explain(compiled, "cos"))


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"llama"}))
def test_rope_families_within_autocasts_error(family: str) -> None:
    _rewritten_within_autocasts_error(*_decoder_case(family), "bf16")


class _OuterAngles(nn.Module):
    """RoPE angles as older code writes them, t ⊗ inv_freq as a GEMM (einsum, matmul with a
    summed dim of 1, a Linear(1, d)), with t a float position ramp starting at 3000."""

    def __init__(self, form: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16))
        self.to_angles = nn.Linear(1, 8, bias=False)
        with torch.no_grad():
            self.to_angles.weight.copy_(self.inv_freq[:, None])
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        t = torch.arange(x.shape[1], dtype=torch.float32) + start.float()
        if self.form == "einsum":
            angles = torch.einsum("i,j->ij", t, self.inv_freq)
        elif self.form == "matmul":
            angles = t[:, None] @ self.inv_freq[None, :]
        else:
            angles = self.to_angles(t[:, None])
        emb = torch.cat([angles, angles], dim=-1)
        return self.proj(x) * emb.cos() + self.proj(x) * emb.sin()


@pytest.mark.parametrize("form", ["einsum", "matmul", "linear"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_outer_product_angles_stay_fp32(form: str, dtype: str) -> None:
    """A GEMM summing over a dim of 1 is gray (a broadcast multiply), so the positions feeding
    it are never rounded; autocast casts the matmul form to low (its error is ~1 here)."""
    module = _OuterAngles(form).eval()
    inputs = (torch.randn(1, 32, 16, generator=torch.Generator().manual_seed(2)),
              torch.tensor(3000))
    with torch.no_grad():
        ref = module(*inputs)
    rewritten = amp_rewrite.rewrite(copy.deepcopy(module), inputs, dtype=dtype)
    with torch.no_grad():
        err = _error(rewritten(*inputs), ref)
    assert err <= {"bf16": 2e-2, "fp16": 5e-3}[dtype], err
