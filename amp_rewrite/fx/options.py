"""The torch path's options, declared once (``core/options.py``): ``rewrite`` takes them all,
``rewrite_graph`` those of the graph and the budget, the compile backend's ``options=`` those
of the graph; each is checked here, at the call, in one line."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from amp_rewrite import arguments
from amp_rewrite.core import PadPolicy
from amp_rewrite.core import options as o
from amp_rewrite.fx.capture import normalize_inputs

# scopes: which entry points take an option
GRAPH = "graph"  # a captured graph's rewrite: rewrite, rewrite_graph, the compile backend
BUDGET = "budget"  # the accuracy budget: rewrite, rewrite_graph
CAPTURE = "capture"  # capturing an nn.Module: rewrite only

CAPTURES = ("export", "symbolic_trace")


def _plan_dtype(value: Any, name: str) -> torch.dtype | str:
    return arguments.plan_dtype(value, name=name)


def _device(value: Any, name: str) -> str | None:
    return arguments.device_type(value, name=name)


def _optional_flag(value: Any, name: str) -> bool | None:
    return None if value is None else o.flag(value, name)


def _pad(value: Any, name: str) -> bool | PadPolicy | None:
    if value is not None and not isinstance(value, (bool, PadPolicy)):
        raise o.ArgumentError(f"{name}={value!r}: expected None, True, False or a PadPolicy")
    return value


def _batches(value: Any, name: str) -> list[tuple] | None:
    return None if value is None else arguments.batches(value, name=name)


def _mode(value: Any, name: str) -> str | None:
    return None if value is None else arguments.choice(value, arguments.MODES, name=name)


def _kwargs(value: Any, name: str) -> Mapping[str, Any] | None:
    if value is not None and not isinstance(value, Mapping):
        raise o.ArgumentError(f"{name}={value!r}: expected a dict of keyword arguments")
    return value


@dataclass(frozen=True)
class TorchOptions:
    """What a user can ask of the torch rewrite, by scope (module constants)."""

    dtype: torch.dtype | str = o.option(
        torch.float16, check=_plan_dtype, scope=GRAPH,
        help="torch.float16 / torch.bfloat16 (or 'fp16' / 'bf16'), or 'mixed': fp16, bf16 "
             "or fp32 per node from one exact plan, bf16 where values exceed fp16's range")
    rules: tuple[str, ...] = o.option((), check=o.paths, scope=GRAPH,
                                      help="extra rule files (TOML overlays; later win)")
    keep_fp32: tuple[str, ...] = o.option(
        (), check=o.patterns, scope=GRAPH,
        help="fnmatch patterns on node names or module paths kept fp32")
    keep_io_types: bool = o.option(True, check=o.flag, scope=GRAPH,
                                   help="outputs keep their dtypes")
    device: str | None = o.option(
        None, check=_device, scope=GRAPH,
        help="device type the result will run on ('cuda', 'cpu'); default: that of the "
             "example values. On 'cpu' the packaged torch_cpu.toml overlay applies: ops CPU "
             "kernels compute in fp32 internally (norms, softmax) move to gray")
    autocast_floor: bool = o.option(
        True, check=o.flag, scope=GRAPH,
        help="never run an op lower than torch.autocast of that device would (fx/floor.py); "
             "False leaves those ops to the min cut alone (fewer cast bytes, larger error)")
    pad: bool | PadPolicy | None = o.option(
        None, check=_pad, scope=GRAPH,
        help="pad low GEMM/conv dims to multiples of 8 in the graph (fx/pad.py); None: on "
             "for device 'cuda' (Tensor Cores), off elsewhere; a PadPolicy pads with it")
    fuse: bool = o.option(
        True, check=o.flag, scope=GRAPH,
        help="fuse attention, norms and GELU into ATen kernels before the plan and pointwise "
             "regions (casts included) after it; False gives the unfused graph")
    emulate_gemms: bool | None = o.option(
        None, check=_optional_flag, scope=GRAPH,
        help="run the GEMMs, convolutions and attention the plan makes low as fp32 kernels "
             "on low-rounded operands (fx/lowering.py). None: only with fuse, on a CPU, each "
             "call whose fp32 kernel measures faster there; never on CUDA. True: every low "
             "kernel; False: none")
    fp8: str | None = o.option(
        None, scope=GRAPH,
        help="None, 'tensorwise' or 'rowwise' (needs dtype=torch.bfloat16): the bf16 GEMMs an "
             "H100 cost model says gain run as torch._scaled_mm with dynamic scales, forward "
             "and backward (fx/fp8.py; checked with the FP8 options below)")
    fp8_grad_dtype: torch.dtype | str | None = o.option(
        None, scope=GRAPH,
        help="the gradients' FP8 dtype (default E5M2 tensor-wise, E4M3 row-wise)")
    fp8_min_size: int | None = o.option(
        None, scope=GRAPH,
        help="FP8 for every GEMM with M*N*K at least this instead of the cost model (0: all)")
    keep_bf16: tuple[str, ...] = o.option(
        (), scope=GRAPH, help="fnmatch patterns on node names kept bf16 (not FP8)")
    max_error: float | None = o.option(
        None, check=o.max_error, scope=BUDGET,
        help="plan against an accuracy budget (fx/budget.py): the most low-precision FLOPs "
             "whose relative output error stays within it, measured with the rewritten "
             "graph's own kernels on this device")
    calibration_data: list | None = o.option(
        None, check=_batches, scope=BUDGET,
        help="with max_error: a list of batches (each a tensor or a tuple of the forward's "
             "positional arguments); the first half is searched, the rest held out")
    max_evaluations: int = o.option(25, check=o.max_evaluations, scope=BUDGET,
                                    help="with max_error: plans measured at most")
    emit_rules: str | os.PathLike | None = o.option(
        None, check=o.file_path, scope=BUDGET,
        help="with max_error: write a rule overlay that reproduces the plan")
    example_kwargs: Mapping[str, Any] | None = o.option(
        None, check=_kwargs, scope=CAPTURE,
        help="keyword arguments of the forward, with example_inputs")
    capture: str = o.option(
        "export", check=o.choice(CAPTURES), scope=CAPTURE,
        help="'export' (torch.export, default) or 'symbolic_trace'; a GraphModule is taken "
             "as it is")
    dynamic_shapes: Any = o.option(
        None, scope=CAPTURE,
        help="default: every dimension export can keep symbolic (batch, sequence); 'static' "
             "for the example shapes only, or a torch.export spec")
    mode: str | None = o.option(
        None, check=_mode, scope=CAPTURE,
        help="None (the module's current train/eval mode), 'train', 'eval', or 'both': a "
             "TrainEvalModule holding both captures on shared parameters")

    @classmethod
    def of(cls, keywords: Mapping[str, Any], where: str,
           scopes: tuple[str, ...] = (GRAPH, BUDGET, CAPTURE)) -> TorchOptions:
        return o.checked(cls, keywords, where=where, scopes=scopes)


# ----------------------------------------------------------------------------- the budget's


@dataclass(frozen=True)
class BudgetRequest:
    """What the user asked: the budget and the batches, split into searched and held out."""

    max_error: float
    max_evaluations: int
    search: list[tuple]
    held: list[tuple]  # empty: nothing held out
    inputs: str  # where the search batches came from, for the report
    held_out_inputs: str
    kwargs: dict = field(default_factory=dict)  # example_kwargs, passed with every batch
    emit_rules: str | os.PathLike | None = None


def budget_request(max_error: float | None, *, calibration_data: list[tuple] | None,
            max_evaluations: int, emit_rules: str | os.PathLike | None,
            example_inputs: Any = None, example_kwargs: Mapping[str, Any] | None = None
            ) -> BudgetRequest | None:
    """What the budget options ask for (None without ``max_error``), after ``TorchOptions``
    checked each. Batches: the first half of ``calibration_data`` searched, the rest held out;
    one batch: ``example_inputs`` searched and the batch held out; no batch, or one without
    examples: nothing held out."""
    if max_error is None:
        for name, value in (("calibration_data", calibration_data), ("emit_rules", emit_rules)):
            if value is not None:
                raise o.ArgumentError(f"{name}= needs max_error=: it feeds the "
                                              "accuracy-budget search")
        return None
    examples = None
    kwargs: dict = {}
    if example_inputs is not None and (not isinstance(example_inputs, Sequence)
                                       or len(example_inputs)):
        examples, kwargs = normalize_inputs(example_inputs, example_kwargs)
    search, held, inputs, held_inputs = _split(calibration_data, examples)
    return BudgetRequest(max_error, max_evaluations, search, held, inputs, held_inputs, kwargs,
                         emit_rules)


def _split(data: list[tuple] | None, examples: tuple | None
           ) -> tuple[list, list, str, str]:
    nothing = "none: pass calibration_data with two batches or more to hold some out"
    if data is None:
        if examples is None:
            raise o.ArgumentError("max_error= needs example_inputs or calibration_data "
                                          "to measure the error on")
        return [examples], [], "example_inputs", nothing
    if len(data) == 1:
        if examples is None:
            return data, [], "calibration_data[0]", nothing
        return [examples], data, "example_inputs", "calibration_data[0]"
    half = (len(data) + 1) // 2
    return (data[:half], data[half:], _span(0, half), _span(half, len(data)))


def _span(start: int, stop: int) -> str:
    return (f"calibration_data[{start}]" if stop - start == 1
            else f"calibration_data[{start}:{stop}]")
