"""Issue 18: the torch path gives no silent wrong results, checks its arguments, follows CPU
autocast on CPU, and fits real training loops (dynamic batch, train and eval).

Every test compares against something the rewrite did not compute: the eager FP32 module,
CPU autocast, or a hand-derived value.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import CaptureError, UsageError
from amp_rewrite.fx import rewrite_graph

# ------------------------------------------------------------------ in-place chains


class _BufferChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ema", torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.mul_(0.9).add_(x.mean(0))
        return self.lin(x) + self.ema


class _BufferViewChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("stats", torch.ones(2, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stats[0].mul_(0.5).add_(x.sum(0)).clamp_(max=100.0)
        self.stats[1:].add_(1.0).mul_(2.0)
        return self.lin(x) * self.stats[1]


class _ParameterChainNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.lin.bias.mul_(0.5).add_(0.25)
        return self.lin(x)


class _IntermediateChain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        y.mul_(2.0).add_(1.0)
        return torch.relu(y)


_CHAINS = [_BufferChain, _BufferViewChain, _ParameterChainNoGrad, _IntermediateChain]


@pytest.mark.parametrize("module_type", _CHAINS)
def test_chained_inplace_updates_match_eager(module_type, capture="export"):
    """``buf.mul_(0.9).add_(x)`` kept 0.9 instead of 1.9: the add_ was made out of place."""
    torch.manual_seed(0)
    eager = module_type()
    x = torch.randn(3, 4)
    gm = amp_rewrite.rewrite(copy.deepcopy(eager), (x,), dtype=torch.bfloat16, capture=capture)
    for _ in range(3):  # the state evolves: each call must update it as eager does
        want, got = eager(x), gm(x)
        torch.testing.assert_close(got, want, rtol=2e-2, atol=5e-2)
    for name, tensor in eager.state_dict().items():
        torch.testing.assert_close(gm.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_chain_on_buffer_stays_inplace_and_exact_by_hand():
    gm = amp_rewrite.rewrite(_BufferChain(), (torch.ones(2, 4),), dtype=torch.float16)
    gm(torch.ones(2, 4))
    assert gm.ema.tolist() == pytest.approx([1.9] * 4)  # 1 * 0.9 + mean(1, 1)


def test_chained_inplace_on_intermediate_matches_eager_under_symbolic_trace():
    test_chained_inplace_updates_match_eager(_IntermediateChain, capture="symbolic_trace")


@pytest.mark.parametrize("module_type", [_BufferChain, _BufferViewChain])
def test_symbolic_trace_refuses_state_updates_it_would_run_eagerly(module_type):
    """symbolic_trace runs ``self.ema.mul_(0.9)`` (constant operands) instead of recording it."""
    with pytest.raises(CaptureError, match="capture='export'") as err:
        amp_rewrite.rewrite(module_type(), (torch.ones(2, 4),), capture="symbolic_trace")
    assert "during tracing" in str(err.value)


class _EqualGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.equal(x, y)


@pytest.mark.parametrize("capture", ["export", "symbolic_trace"])
def test_torch_equal_capture_failure_names_the_construct(capture):
    """The symbolic_trace retry said 'example inputs do not fit the graph' (they do)."""
    x = torch.ones(2, 4)
    _EqualGate()(x, x + 1)  # the inputs fit the module eagerly
    with pytest.raises(CaptureError) as err:
        amp_rewrite.rewrite(_EqualGate(), (x, x + 1), capture=capture)
    message = str(err.value)
    assert "aten.equal" in message and "(x == y).all()" in message
    assert "do not fit" not in message


def test_symbolic_trace_losing_no_grad_is_a_capture_error_not_bad_inputs():
    x = torch.ones(2, 4)
    _ParameterChainNoGrad()(x)
    with pytest.raises(CaptureError, match="node mul_ .*no_grad"):
        amp_rewrite.rewrite(_ParameterChainNoGrad(), (x,), capture="symbolic_trace")


# ------------------------------------------------------------------ models not held in fp32


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


# ------------------------------------------------------------------ argument checks


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


# ------------------------------------------------------------------ training loops


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.bn(self.conv(x))))
        return self.head(h.mean(-1))


def test_dynamic_batch_and_sequence_by_default_so_the_last_smaller_batch_runs():
    """A graph captured with batch 4 refused batch 9 (Guard failed: input.size()[0] == 4)."""
    torch.manual_seed(0)
    model = _Net().eval()
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (torch.randn(4, 4, 16),),
                             dtype=torch.bfloat16)
    for shape in ((9, 4, 16), (3, 4, 5), (2, 4, 33)):  # other batch and sequence lengths
        x = torch.randn(*shape)
        torch.testing.assert_close(gm(x), model(x), rtol=3e-2, atol=3e-2)


def test_dynamic_shapes_static_on_request_and_explicit_spec_overrides():
    model, x = _Net().eval(), torch.randn(4, 4, 16)
    static = amp_rewrite.rewrite(model, (x,), dynamic_shapes="static")
    with pytest.raises(Exception, match="4"):  # export's guard names the captured size
        static(torch.randn(9, 4, 16))
    batch = torch.export.Dim("batch", min=2, max=64)
    only_batch = amp_rewrite.rewrite(model, (x,), dynamic_shapes=({0: batch},))
    assert only_batch(torch.randn(9, 4, 16)).shape == (9, 3)
    with pytest.raises(Exception, match="16"):  # the sequence stayed static under this spec
        only_batch(torch.randn(9, 4, 5))


def test_train_then_evaluate_with_dropout_and_batchnorm():
    """A train-mode capture refused .eval(); mode='both' gives one module for the loop."""
    torch.manual_seed(0)
    reference = _Net()
    model = amp_rewrite.rewrite(copy.deepcopy(reference), (torch.randn(8, 4, 16),),
                                dtype=torch.bfloat16, mode="both")
    assert model.training and set(model.state_dict()) == set(reference.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, 16, generator=gen), torch.randint(0, 3, (8,), generator=gen))
            for _ in range(4)] + [(torch.randn(5, 4, 16, generator=gen),  # smaller last batch
                                   torch.randint(0, 3, (5,), generator=gen))]
    for net, optimizer in ((model, opt), (reference, ref_opt)):
        torch.manual_seed(1)  # same dropout masks in both loops
        net.train()
        for x, y in data:
            nn.functional.cross_entropy(net(x).float(), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    # BatchNorm statistics were updated by the train graph and are read by the eval graph.
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean,
                               rtol=5e-2, atol=2e-2)
    assert model.bn.num_batches_tracked.item() == 5
    model.eval()
    reference.eval()
    x = torch.randn(6, 4, 16, generator=gen)
    first = model(x)
    torch.testing.assert_close(model(x), first, rtol=0, atol=0)  # no dropout in eval
    torch.testing.assert_close(first.float(), reference(x), rtol=5e-2, atol=5e-2)
    model.train()
    assert not torch.equal(model(x), first)  # dropout and batch statistics again


def test_single_mode_capture_explains_how_to_get_the_other_mode():
    gm = amp_rewrite.rewrite(_Net(), (torch.randn(4, 4, 16),), mode="eval")
    with pytest.raises(UsageError, match="captured in eval mode.*mode='both'"):
        gm.train()


def test_mode_on_a_graph_module_is_a_usage_error():
    gm = amp_rewrite.rewrite(_Net(), (torch.randn(4, 4, 16),))
    with pytest.raises(UsageError, match="mode= needs an nn.Module"):
        amp_rewrite.rewrite(gm, mode="both")


def test_mode_leaves_the_users_module_flags_alone():
    model = _Net()
    model.bn.eval()  # mixed flags on purpose
    amp_rewrite.rewrite(model, (torch.randn(4, 4, 16),), mode="eval")
    assert model.training and model.conv.training and not model.bn.training


# ------------------------------------------------------------------ export noise


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y * 2
        return y


@pytest.mark.parametrize(("model", "x", "error"), [
    (nn.Linear(4, 4), torch.randn(2, 5), UsageError),  # wrong shape: fake-tensor traceback
    (_DataDependent(), torch.randn(2, 4), CaptureError),  # partial graph printed twice
])
def test_failed_capture_prints_nothing_but_raises_one_error(model, x, error, capfd):
    import logging

    logging.getLogger("torch").setLevel(logging.WARNING)  # torch's default, whatever ran before
    with pytest.raises(error):
        amp_rewrite.rewrite(model, (x,))
    out, err = capfd.readouterr()
    assert out == "" and err == "", err[:500]


# ------------------------------------------------------------------ CPU autocast parity

_CPU_LISTS_JUSTIFIED = {
    # CPU autocast fp32 list, not deny here: the kernel probe keeps it fp32 on CPU (tested
    # below) and on CUDA it has low kernels and stays in range (an average).
    "avg_pool3d": "gray",
    # CPU autocast fp32 list: mirror padding copies values, no arithmetic: identical results.
    "reflection_pad1d": "clear",
}


def _autocast_cpu_list_names() -> dict[str, list[str]]:
    """Op names of PyTorch's CPU autocast test lists, read from the file (importing it pulls
    torch's test harness)."""
    import re
    from pathlib import Path

    text = (Path(torch.__file__).parent / "testing" / "_internal"
            / "autocast_test_lists.py").read_text()
    cpu = text[text.index("class AutocastCPUTestLists"):text.index("class TestAutocast")]
    lists = {}
    for match in re.finditer(r"self\.(\w+) = \[(.*?)\n        \]", cpu, re.S):
        lists[match.group(1)] = re.findall(r"^\s{12}\(\"(\w+)\"", match.group(2), re.M)
    return lists


def test_every_autocast_cpu_list_op_has_its_class_under_the_cpu_rules():
    """_addmm_activation and _native_multi_head_attention were in no rule file."""
    from amp_rewrite.core import load_rules
    from amp_rewrite.core.rules import default_rules_path

    rules = load_rules("torch", extra_files=[default_rules_path("torch_cpu")], env={})
    lists = _autocast_cpu_list_names()
    expected = {"torch_16": "allow", "nn_16": "allow", "torch_fp32": "deny", "nn_fp32": "deny"}
    assert set(expected) <= set(lists) and all(lists[name] for name in expected)
    for list_name, want in expected.items():
        for op in lists[list_name]:
            assert rules.class_of(op).value == _CPU_LISTS_JUSTIFIED.get(op, want), (list_name, op)
    for op in lists["torch_need_autocast_promote"] + lists["torch_expect_builtin_promote"]:
        assert rules.class_of(op).value in ("gray", "clear"), op


class _Pool3d(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.avg_pool3d(torch.relu(x * 2.0), 2)


class _Pool3dModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AvgPool3d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(x * 2.0))


def test_modules_without_a_low_cpu_kernel_stay_fp32_under_symbolic_trace():
    x = torch.randn(2, 3, 4, 4, 4)
    gm = amp_rewrite.rewrite(_Pool3dModule(), (x,), dtype=torch.bfloat16,
                             capture="symbolic_trace", keep_io_types=False)
    torch.testing.assert_close(gm(x), _Pool3dModule()(x), rtol=1e-2, atol=1e-2)
    assert "no torch.bfloat16 kernel" in " ".join(amp_rewrite.explain(gm, "pool"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ops_without_a_low_cpu_kernel_stay_fp32_on_cpu(dtype):
    """avg_pool3d was planned low and the rewritten graph could not run on CPU."""
    x = torch.randn(2, 3, 4, 4, 4)
    with pytest.raises(RuntimeError, match="not implemented for"):
        nn.functional.avg_pool3d(x.to(dtype), 2)  # the fact the probe must find
    gm = amp_rewrite.rewrite(_Pool3d(), (x,), dtype=dtype)
    torch.testing.assert_close(gm(x), _Pool3d()(x), rtol=1e-2, atol=1e-2)
    record = next(r for r in gm.amp_report["nodes"] if r["op_type"] == "avg_pool3d")
    assert record["precision"] == "high" and "no" in record["reason"]
    cuda = amp_rewrite.rewrite(_Pool3d(), (x,), dtype=dtype, device="cuda")
    assert "kernel" not in next(r for r in cuda.amp_report["nodes"]  # CUDA has the kernel
                                if r["op_type"] == "avg_pool3d")["reason"]


class _WarpNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.flow = nn.Linear(2, 2)  # the grid comes out of a low op too

    def forward(self, x: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        return nn.functional.grid_sample(self.conv(x), self.flow(grid), align_corners=False)


def test_grid_sample_runs_fp32_on_cpu_like_cpu_autocast():
    """grid_sampler ran low on CPU: bf16 rel. error 0.13 where autocast's is 1.8e-3."""
    gen = torch.Generator().manual_seed(0)
    x, grid = torch.randn(2, 3, 16, 16, generator=gen), torch.rand(2, 8, 8, 2, generator=gen) * 2 - 1
    torch.manual_seed(0)
    model = _WarpNet()
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (x, grid), dtype=torch.bfloat16)
    record = next(r for r in gm.amp_report["nodes"] if r["op_type"].startswith("grid_sampler"))
    assert record["precision"] == "high"
    want = model(x, grid)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_out = model(x, grid)
    ours = (gm(x, grid) - want).abs().max().item()
    theirs = (autocast_out.float() - want).abs().max().item()
    assert ours <= theirs * 1.5 + 1e-6
    cuda_rules = amp_rewrite.rewrite(copy.deepcopy(model), (x, grid), dtype=torch.bfloat16,
                                     device="cuda")  # grid_sampler follows its low inputs
    assert (cuda_rules(x, grid) - want).abs().max().item() > 1.5 * ours


def test_lstm_cell_on_cpu_is_no_less_precise_than_cpu_autocast():
    """lstm_cell ran low on CPU where CPU autocast keeps fp32: 1.9x its error after 50 steps."""
    torch.manual_seed(0)

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.LSTMCell(8, 8)

        def forward(self, xs: torch.Tensor) -> torch.Tensor:
            h = c = torch.zeros(xs.shape[1], 8)
            for x in xs.unbind(0):
                h, c = self.cell(x, (h, c))
            return h

    model = Loop()
    xs = torch.randn(50, 4, 8)
    gm = amp_rewrite.rewrite(copy.deepcopy(model), (xs,), dtype=torch.bfloat16,
                             dynamic_shapes="static")
    want = model(xs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_error = (model(xs).float() - want).abs().max().item()
    assert (gm(xs) - want).abs().max().item() <= autocast_error + 1e-6


# ------------------------------------------------------------------ CLI


@pytest.mark.parametrize(("device", "grid_sampler"), [("cuda", "gray"), ("cpu", "deny")])
def test_cli_lists_torch_rules_with_their_sources(device, grid_sampler, capsys):
    """`amp-rewrite --list-rules` listed only the ONNX rules."""
    from amp_rewrite.cli import main

    assert main(["--list-rules", "--torch", device]) == 0
    lines = capsys.readouterr().out.splitlines()
    linear = next(line for line in lines if line.split()[1] == "linear")
    assert linear.startswith("allow") and linear.endswith("torch.toml]")
    grid = next(line for line in lines if line.split()[1] == "grid_sampler")
    assert grid.startswith(grid_sampler)
    assert grid.endswith("torch_cpu.toml]" if device == "cpu" else "torch.toml]")
    assert not any(line.split()[1] == "MatMul" for line in lines)  # no ONNX rules


def test_pytorch_cpu_autocast_lists_through_the_rewrite_agree_except_justified():
    """``python -m amp_rewrite.bench fx autocast`` on the CPU lists: every entry rewrites, runs
    in autocast's precision and within twice autocast's error; the one exception is justified
    above."""
    from amp_rewrite.bench import autocast_lists as tool

    lists = tool.load_lists()["cpu"]
    entries = [tool.run_entry("cpu", name, raw) for name, raws in vars(lists).items()
               if isinstance(raws, list) for raw in raws]
    assert len(entries) >= 50
    assert all(e.rewrite_ok and e.numerics_ok for e in entries), [
        (e.op, e.note, e.error, e.autocast_error) for e in entries
        if not (e.rewrite_ok and e.numerics_ok)]
    disagreements = {e.op for e in entries if not e.precision_agrees}
    assert disagreements <= {op for op, cls in _CPU_LISTS_JUSTIFIED.items() if cls == "clear"}
