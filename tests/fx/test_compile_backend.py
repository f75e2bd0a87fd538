"""amp_rewrite as a torch.compile backend (``amp_rewrite/fx/backend.py``).

Oracles: the FP32 module's outputs, ``torch.autocast`` + ``GradScaler`` training losses, the
module's own ``state_dict`` before compiling."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import UsageError
from amp_rewrite.fx.pointwise import BACKEND_ENV

EAGER = {"inner": "eager"}
# one fp16/bf16 rounding of the GEMM operands, relative to outputs of size ~1 (unit roundoff
# 2**-11 / 2**-8, a 16- and 64-term dot product, LayerNorm in between)
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 5e-2}


class Block(nn.Module):
    """Linear → GELU | graph break | LayerNorm → Linear: two dynamo graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(x))
        torch._dynamo.graph_break()
        return self.down(self.norm(h))


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sum(-1, keepdim=True) + 0.1 * torch.randn(32, 1, generator=g)


def _block(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    return Block()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_outputs_within_low_precision_of_fp32_with_low_nodes_in_every_graph(dtype):
    model, (x, _) = _block(), _data()
    compiled = torch.compile(model, backend="amp_rewrite", options={"dtype": dtype, **EAGER})
    out = compiled(x)
    assert out.dtype == torch.float32
    assert (out - model(x)).abs().max().item() < TOLERANCE[dtype]
    reports = amp_rewrite.report(compiled)
    assert [r["graph"] for r in reports] == [0, 1]  # the graph break made two graphs
    assert all(r["report"]["precision_counts"]["low"] >= 1 for r in reports)
    assert all(r["report"]["dtype"] == str(dtype).removeprefix("torch.") for r in reports)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_keep_io_types_false_returns_outputs_in_the_dtype_autocast_returns(dtype):
    model, (x, _) = _block(), _data()
    with torch.autocast("cpu", dtype=dtype):
        autocast_dtype = model(x).dtype
    compiled = amp_rewrite.compile(model, dtype=dtype, keep_io_types=False, **EAGER)
    out = compiled(x)
    assert out.dtype == autocast_dtype == dtype
    assert (out.float() - model(x)).abs().max().item() < TOLERANCE[dtype]


def test_gradients_land_fp32_on_the_users_parameters():
    model, (x, y) = _block(), _data()
    keys = {k: v.dtype for k, v in model.state_dict().items()}
    compiled = amp_rewrite.compile(model, dtype="fp16", **EAGER)
    nn.functional.mse_loss(compiled(x), y).backward()
    reference = _block()
    nn.functional.mse_loss(reference(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.allclose(p.grad, q.grad, rtol=0.05, atol=2e-3), name
    assert {k: v.dtype for k, v in model.state_dict().items()} == keys
    assert compiled._orig_mod is model  # save the user's module, as with torch.compile


def _train(step, model: nn.Module, steps: int = 15) -> list[float]:
    x, y = _data()
    return [step(model, x, y) for _ in range(steps)]


def _scaler_step(compiled, optimizer, scaler):
    def step(model, x, y):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(compiled(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.item()
    return step


def _autocast_losses() -> list[float]:
    model = _block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")

    def autocast(x):
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x).float()
    return _train(_scaler_step(autocast, optimizer, scaler), model)


def _close_to_autocast(losses: list[float], reference: list[float]) -> None:
    # same seed, data and SGD: the runs differ only in which ops round to fp16 (autocast:
    # GEMMs; the plan: GEMMs and the cheap ops between them), a few 1e-3 relative per step
    assert losses[-1] < 0.5 * losses[0]
    for ours, theirs in zip(losses, reference):
        assert abs(ours - theirs) <= 0.03 * theirs + 1e-3


def test_training_with_torch_gradscaler_matches_autocast():
    model = _block()
    compiled = amp_rewrite.compile(model, dtype="fp16", **EAGER)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = _train(_scaler_step(compiled, optimizer, torch.amp.GradScaler("cpu")), model)
    _close_to_autocast(losses, _autocast_losses())


def test_training_with_amp_optimizer_matches_autocast():
    model = _block()
    compiled = amp_rewrite.compile(model, dtype="fp16", **EAGER)
    optimizer = amp_rewrite.AmpOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                         dtype="fp16")

    def step(_, x, y):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(compiled(x), y)
        optimizer.backward(loss)
        optimizer.step()
        return loss.item()
    _close_to_autocast(_train(step, model), _autocast_losses())


def test_explain_searches_every_graph_and_names_unknown_nodes():
    compiled = amp_rewrite.compile(_block(), dtype="bf16", **EAGER)
    compiled(_data()[0])
    lines = amp_rewrite.explain(compiled, "linear")
    assert lines[0] == "graph 0:" and "graph 1:" in lines
    with pytest.raises(UsageError, match="no_such_node"):
        amp_rewrite.explain(compiled, "no_such_node")


@pytest.mark.parametrize("options", [{"dtype": "fp8"}, {"inner": "tvm"}, {"keep_fp32": 3},
                                     {"capture": "export"}])
def test_a_wrong_option_is_a_one_line_usage_error(options):
    with pytest.raises(UsageError) as error:  # amp_rewrite.compile checks before dynamo runs
        amp_rewrite.compile(_block(), **options)
    assert len(str(error.value).splitlines()) == 1
    # the backend name: dynamo wraps what a backend raises, the UsageError is its cause
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as wrapped:
        torch.compile(_block(), backend="amp_rewrite", options=options)(_data()[0])
    assert isinstance(wrapped.value.inner_exception, UsageError)


def test_report_of_an_uncompiled_model_says_to_run_it():
    with pytest.raises(UsageError, match="run it once"):
        amp_rewrite.report(amp_rewrite.compile(_block(), **EAGER))


@pytest.mark.slow
def test_inductor_inner_compiles_the_rewritten_graph():
    model, (x, y) = _block(), _data()
    compiled = torch.compile(model, backend="amp_rewrite", options={"dtype": "bf16"})
    out = compiled(x)
    assert (out - model(x)).abs().max().item() < TOLERANCE[torch.bfloat16]
    nn.functional.mse_loss(out, y).backward()
    assert model.up.weight.grad.dtype == torch.float32
    assert len(amp_rewrite.report(compiled)) == 2


@pytest.mark.slow
def test_backend_name_works_without_importing_amp_rewrite():
    script = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        assert "amp_rewrite" not in sys.modules
        x = torch.randn(4, 8)
        y = torch.compile(m, backend="amp_rewrite", options={"dtype": "bf16", "inner": "eager"})(x)
        print(float((y - m(x)).abs().max()))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, BACKEND_ENV: "eager"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip().splitlines()[-1]) < TOLERANCE[torch.bfloat16]


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [("bert", "fp16"), ("llama", "bf16"), ("t5", "bf16")])
def test_zoo_model_trains_through_the_backend_like_autocast(name, dtype):
    """Oracles: the FP32 model and ``torch.autocast`` on the same inputs (``bench fx backend``
    runs this on all 21 zoo models)."""
    from benchmarks.fx_backend import measure

    row = measure(name, dtype, inner="eager")
    assert row["error"] <= 1.5 * row["autocast_error"] + 1e-6, row
    assert row["grad_error"] <= 1.5 * row["autocast_grad_error"] + 1e-6, row
    assert row["grads_finite"] and row["recompiles"] == 0, row
    assert row["graphs"] >= 2 and row["break_error"] <= 1.5 * row["autocast_error"] + 1e-6, row
