"""``dtype="mixed"`` on the torch path: fp16, bf16 or fp32 per node from one exact plan
(core/multilabel.plan_mixed, docs/design.md §3). Dtypes are read from the rewritten graph as
it runs (an interpreter over real tensors), outputs compared with the FP32 module."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import amp_rewrite
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import rewrite_graph

BF16_TOLERANCE = 2 ** -6  # a few bf16 roundings (2^-8 each) on the way to the output


class WideParameter(nn.Module):
    """Two GEMMs around a gray multiply by a parameter beyond fp16's range (|x| ~ 1e5) and a
    sum of squares (rules/torch.toml's [range] table: pow, sum) of its product."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 8)
        self.scale = nn.Parameter(torch.randn(8, 32) * 1e5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.up(x)
        g = h[:, None, :] * self.scale  # broadcast: g is 8x h, so casting g costs most
        return self.down(g * 1e-4), g.pow(2).sum(-1)


def _model_and_input():
    torch.manual_seed(0)
    return WideParameter(), torch.randn(4, 16)


def _runtime_dtypes(gm: torch.fx.GraphModule, *args) -> dict[str, torch.dtype]:
    """Node name -> dtype of the tensor it produced when the graph ran."""
    seen = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[n.name] = out.dtype
            return out

    flat = torch.fx._pytree.tree_flatten_spec((args, {}), gm._in_spec)
    with torch.no_grad():
        Recorder(gm).run(*flat, enable_io_processing=False)
    return seen


def _relative_error(want: torch.Tensor, got: torch.Tensor) -> float:
    return float((want - got.float()).abs().max() / want.abs().max())


def test_a_wide_parameter_makes_its_gray_reader_bf16_while_gemms_stay_fp16():
    model, x = _model_and_input()
    gm = amp_rewrite.rewrite(model, (x,), dtype="mixed", device="cpu", fuse=False,
                             autocast_floor=False)
    dtypes = _runtime_dtypes(gm, x)
    assert dtypes["linear"] == dtypes["linear_1"] == torch.float16  # the GEMMs
    assert dtypes["mul"] == torch.bfloat16  # reads the parameter fp16 cannot hold
    assert dtypes["mul_1"] == torch.bfloat16  # reads mul's values, up to ~1e5
    assert dtypes["pow_1"] == dtypes["sum_1"] == torch.bfloat16  # the [range] ops
    with torch.no_grad():
        want, got = model(x), gm(x)
    for w, g in zip(want, got):
        assert torch.isfinite(g).all()
        assert _relative_error(w, g) < BF16_TOLERANCE
    report = gm.amp_report
    assert report["dtype"] == "mixed"
    assert report["dtype_counts"]["bfloat16"] >= 4 and report["dtype_counts"]["float16"] >= 2
    assert report["mixed"]["solver"]["status"] == "OPTIMAL"
    assert set(report["mixed"]["flop_share"]) == {"float32", "float16", "bfloat16"}
    lines = amp_rewrite.explain(gm, "mul")
    assert "low (bfloat16)" in lines[0] and "beyond fp16's range" in lines[0]


def test_with_the_autocast_floor_the_reader_of_an_fp32_parameter_runs_fp32():
    model, x = _model_and_input()
    gm = amp_rewrite.rewrite(model, (x,), dtype="mixed", device="cpu", fuse=False)
    dtypes = _runtime_dtypes(gm, x)
    assert dtypes["mul"] == torch.float32  # autocast runs it fp32 (fx/floor.py)
    assert dtypes["linear"] == dtypes["linear_1"] == torch.float16
    assert dtypes["pow_1"] == dtypes["sum_1"] == torch.bfloat16  # the floor lets [range] run
    with torch.no_grad():
        for w, g in zip(model(x), gm(x)):
            assert _relative_error(w, g) < BF16_TOLERANCE


def test_a_sum_of_squares_beyond_fp16_runs_bf16_and_stays_finite():
    class SumOfSquares(nn.Module):
        def forward(self, x):
            return x.pow(2).sum(-1)

    x = torch.randn(4, 64) * 300  # squares ~1e5: fp16 would overflow
    gm = amp_rewrite.rewrite(SumOfSquares(), (x,), dtype="mixed", device="cpu", fuse=False)
    dtypes = _runtime_dtypes(gm, x)
    assert dtypes["pow_1"] == dtypes["sum_1"] == torch.bfloat16
    got = gm(x)
    assert got.dtype == torch.float32  # keep_io_types
    assert _relative_error(x.pow(2).sum(-1), got) < BF16_TOLERANCE


def test_a_second_rewrite_of_a_mixed_graph_changes_nothing():
    model, x = _model_and_input()
    gm = amp_rewrite.rewrite(model, (x,), dtype="mixed", device="cpu", fuse=False,
                             autocast_floor=False)
    code = gm.code
    again = rewrite_graph(gm, dtype="mixed", device="cpu", fuse=False, autocast_floor=False)
    assert again.amp_report["modified"] is False
    assert again.code == code


def test_parameters_are_cast_once_per_dtype_they_are_read_in():
    class SharedWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(16, 16) / 4)
            self.big = nn.Parameter(torch.full((16,), 1e5))

        def forward(self, x):
            a = x @ self.w  # allow: fp16
            b = (x * self.big) @ self.w  # a GEMM reading a value beyond fp16: bf16
            return a, b

    model, x = SharedWeight(), torch.randn(4, 16)
    gm = amp_rewrite.rewrite(model, (x,), dtype="mixed", device="cpu", fuse=False,
                             autocast_floor=False)
    casts = [n for n in gm.graph.nodes if n.meta.get("amp_rewrite_cast")
             and n.args[0].name == "w"]
    assert sorted(str(n.kwargs["dtype"]) for n in casts) == ["torch.bfloat16",
                                                             "torch.float16"]
    assert gm.w.dtype == torch.float32  # the FP32 master weight stays
    with torch.no_grad():
        for w, g in zip(model(x), gm(x)):
            assert _relative_error(w, g) < BF16_TOLERANCE


def test_mixed_with_fp8_is_refused_in_one_line():
    model, x = _model_and_input()
    with pytest.raises(UsageError, match="dtype='mixed'"):
        amp_rewrite.rewrite(model, (x,), dtype="mixed", fp8="tensorwise")


def test_an_unknown_dtype_names_mixed_among_the_accepted_ones():
    model, x = _model_and_input()
    with pytest.raises(UsageError, match="'mixed'"):
        amp_rewrite.rewrite(model, (x,), dtype="fp12")


def test_the_compile_backend_takes_dtype_mixed(fresh_dynamo):
    model, x = _model_and_input()
    compiled = torch.compile(model, backend="amp_rewrite",
                             options={"dtype": "mixed", "inner": "eager"})
    with torch.no_grad():
        want, got = model(x), compiled(x)
    for w, g in zip(want, got):
        assert torch.isfinite(g).all()
        assert _relative_error(w, g) < BF16_TOLERANCE
    (entry,) = amp_rewrite.report(compiled)
    assert entry["report"]["dtype"] == "mixed"
    records = {r["op_type"]: r.get("dtype") for r in entry["report"]["nodes"]}
    assert records["pow"] == records["sum"] == "bfloat16"


class _ScaledFfn(torch.nn.Module):
    """A hidden layer scaled beyond fp16's range by a buffer, scaled back before the output
    projection; the output is a [range] reduction (pow(2).sum())."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)
        self.register_buffer("scale", torch.full((64,), 1e5))

    def forward(self, x):
        return self.b(torch.relu(self.a(x) * self.scale) / 1e5).pow(2).sum(-1)


def test_the_accuracy_budget_chooses_among_three_dtypes():
    torch.manual_seed(0)
    model = _ScaledFfn().eval()
    x, data = torch.randn(8, 32), [torch.randn(8, 32) for _ in range(4)]
    loose = amp_rewrite.rewrite(model, (x,), dtype="mixed", max_error=1.0,
                                calibration_data=data, device="cpu")
    assert loose.amp_report["pinned_by_budget"] == []
    assert loose.amp_report["dtype_counts"]["bfloat16"] > 0  # the scaled value needs range
    tight = amp_rewrite.rewrite(model, (x,), dtype="mixed", max_error=0.0,
                                calibration_data=data, device="cpu")
    counts = tight.amp_report["dtype_counts"]
    assert counts["float16"] == counts["bfloat16"] == 0  # E = 0: every node pinned fp32
    with torch.no_grad():
        assert torch.equal(tight(data[-1]), model(data[-1]))
