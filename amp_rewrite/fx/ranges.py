"""What a mixed plan (``dtype="mixed"``) needs to know about magnitudes: the values fp16
cannot hold, so their readers and writers run bf16 (or fp32) instead (core/multilabel.py).

* Stored tensors (parameters, buffers, constants read through ``get_attr``) are screened
  from their values: a finite |x| beyond fp16's largest value makes the tensor
  ``fp16_wide``, beyond bf16's ``wide``. ``±finfo(float32).max`` entries are mask sentinels,
  not magnitudes (``view.is_sentinel``), and do not count.
* Activations are known from data only: ``record_ranges`` runs the prepared FP32 graph once
  on the example inputs and stores max|x| in each float32 value node's meta
  (``RANGE_META``), so a second rewrite of the result, which has no inputs to run, plans
  the same. A value above ``ACTIVATION_HEADROOM`` (1/16 of fp16's range, as the ONNX
  calibration: room for inputs the example did not show) is fp16-wide; its producer needs range too, as the reader does.
"""
from __future__ import annotations

import operator
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import Node

from amp_rewrite.core.precision import LowDtype
from amp_rewrite.fx.capture import flat_inputs
from amp_rewrite.fx.view import CAST_TAG, FP16_MAX, FP32_SENTINEL, FxView

RANGE_META = "amp_rewrite_max_abs"  # node.meta key: max|x| of the value on the example inputs
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
# the thresholds calibration uses on the ONNX path (core/precision.LowDtype.range_threshold)
ACTIVATION_HEADROOM = LowDtype.FLOAT16.range_threshold
BF16_HEADROOM = LowDtype.BFLOAT16.range_threshold


@dataclass
class Ranges:
    """The mixed plan's range inputs (``core.multilabel.plan_mixed``'s keywords)."""

    fp16_wide_values: dict[Hashable, str] = field(default_factory=dict)
    wide_values: dict[Hashable, str] = field(default_factory=dict)
    range_groups: dict[Hashable, str] = field(default_factory=dict)


def screen(gm: torch.fx.GraphModule, view: FxView) -> Ranges:
    """Stored tensors and recorded activations beyond fp16's (or bf16's) range, as the view's
    value keys, and the groups that need range themselves (module docstring)."""
    ranges = Ranges(range_groups=dict(view.range_groups))
    for node, producer in view.values.items():
        if node.op == "get_attr":
            _screen_stored(gm, node, ranges)
        elif RANGE_META in node.meta:
            _screen_activation(view, node, producer, ranges)
    return ranges


def _screen_stored(gm: torch.fx.GraphModule, node: Node, ranges: Ranges) -> None:
    tensor = operator.attrgetter(node.target)(gm)
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.float32:
        return
    largest = max_finite_magnitude(tensor)
    if largest > BF16_MAX:
        ranges.wide_values[node] = f"{node.name} (|x| up to {largest:.3g}, beyond bf16's range)"
    elif largest > FP16_MAX:
        ranges.fp16_wide_values[node] = (f"{node.name} (|x| up to {largest:.3g}, beyond "
                                         "fp16's range)")


def _screen_activation(view: FxView, node: Node, producer: Hashable, ranges: Ranges) -> None:
    largest = node.meta[RANGE_META]
    where = f"{node.name} (|x| up to {largest:.3g} on the example inputs"
    if largest > BF16_HEADROOM:
        ranges.wide_values[node] = f"{where}, beyond bf16's range)"
    elif largest > ACTIVATION_HEADROOM:
        ranges.fp16_wide_values[node] = f"{where}, beyond 1/16 of fp16's range)"
        if view.graph.group(producer).fixed is None:
            ranges.range_groups.setdefault(producer, f"writes {where}, beyond 1/16 of fp16's "
                                                     "range): runs bf16 or fp32")


def max_finite_magnitude(tensor: torch.Tensor) -> float:
    """max |x| over the finite entries that are not ``±finfo(float32).max`` sentinels."""
    with torch.no_grad():
        magnitude = tensor.detach().abs()
        if magnitude.numel() == 0:
            return 0.0
        largest = float(magnitude.max())
        if largest <= FP16_MAX:  # the common case: one reduction, no mask
            return largest
        kept = magnitude[torch.isfinite(magnitude) & (magnitude != FP32_SENTINEL)]
        return float(kept.max()) if kept.numel() else 0.0


def record_ranges(gm: torch.fx.GraphModule, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Run the FP32 graph once on the example inputs and store max|x| of every float32 value
    in its node's meta (``RANGE_META``). A graph amp_rewrite already rewrote keeps what its
    first rewrite recorded (its values are no longer the FP32 ones). Returns whether it ran."""
    if any(n.meta.get(CAST_TAG) for n in gm.graph.nodes):
        return False
    recorder = _Recorder(gm)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        recorder.run(*flat_inputs(gm, args, kwargs), enable_io_processing=False)
    return True


class _Recorder(torch.fx.Interpreter):
    def run_node(self, n: Node) -> Any:
        result = super().run_node(n)
        if n.op in ("call_function", "call_method", "call_module", "placeholder") \
                and isinstance(result, torch.Tensor) and result.dtype == torch.float32:
            n.meta[RANGE_META] = max_finite_magnitude(result)
        return result
