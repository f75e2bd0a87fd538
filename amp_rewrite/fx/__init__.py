"""The torch adapter: ``rewrite(module, example_inputs)`` → a mixed-precision GraphModule.

Capture (``torch.export`` by default, ``symbolic_trace`` on request, or a GraphModule as is),
then the passes of :mod:`amp_rewrite.fx.passes` on the shared core (DESIGN §1-2). The result
keeps FP32 parameters (cast in-graph once per forward), the original ``state_dict`` keys, shapes
and dtypes, and carries ``gm.amp_report`` (the ONNX ``--report`` schema).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from amp_rewrite.core import LowDtype, load_rules
from amp_rewrite.core.rules import default_rules_path
from amp_rewrite.core.runtime import gc_paused, listed
from amp_rewrite.errors import UsageError
from amp_rewrite.fx.capture import capture as capture_module
from amp_rewrite.fx.capture import refresh_fake_values
from amp_rewrite.fx.fusion import FUSED_FROM, FUSED_TAG, FuseAttention, FuseNorms, FuseTanhGelu
from amp_rewrite.fx.passes import (FunctionalizeInPlace, InlineModules, MixedPrecisionOptions,
                                   MixedPrecisionPass)
from amp_rewrite.fx.pointwise import FusePointwise, UnfuseRegions
from amp_rewrite.fx.view import is_cast

__all__ = ["explain", "rewrite", "rewrite_graph"]

log = logging.getLogger(__name__)

_TORCH_DTYPES = {LowDtype.FLOAT16: torch.float16, LowDtype.BFLOAT16: torch.bfloat16}
EXPLAIN_KEY = "amp_rewrite_explain"  # gm.meta key: node name -> reasons, for explain()


def rewrite(model: torch.nn.Module, example_inputs: Any = None, *,
            example_kwargs: Mapping[str, Any] | None = None,
            dtype: torch.dtype | str = torch.float16, capture: str = "export",
            dynamic_shapes: Any = None, rules: Iterable[str] = (),
            keep_fp32: Iterable[str] = (), keep_io_types: bool = True,
            device: str | None = None, autocast_floor: bool = True,
            fuse: bool = True) -> torch.fx.GraphModule:
    """Capture ``model`` and return a trainable mixed-precision ``GraphModule``.

    ``dtype``: torch.float16 / torch.bfloat16 (or 'fp16' / 'bf16'). ``capture``: 'export'
    (default) or 'symbolic_trace'; a GraphModule is taken as is (``example_inputs`` only needed
    when its nodes carry no ``meta['val']``). ``dynamic_shapes``: passed to
    ``torch.export.export``. ``rules``: extra rule files. ``keep_fp32``: fnmatch patterns on node
    names or module paths kept fp32. ``keep_io_types``: outputs keep their dtypes. ``device``:
    device type the result will run on ('cuda', 'cpu'); default: that of the example values.
    On 'cpu' the packaged ``torch_cpu.toml`` overlay applies (see ``rewrite_graph``).
    ``autocast_floor``: never run an op lower than ``torch.autocast`` would (``fx/floor.py``);
    False leaves those ops to the min cut alone (fewer cast bytes, larger error).
    ``fuse``: fuse attention, norms and GELU into ATen kernels before the plan and pointwise
    regions (casts included) into Inductor-compiled submodules after it (``fx/fusion.py``,
    ``fx/pointwise.py``); False gives the unfused graph.
    The user's module is never mutated; the result owns copies of its parameters.
    """
    if example_inputs is None and not isinstance(model, torch.fx.GraphModule):
        raise UsageError("example_inputs is required to capture an nn.Module")
    start = time.perf_counter()
    gm = capture_module(model, () if example_inputs is None else example_inputs,
                        example_kwargs, mode=capture, dynamic_shapes=dynamic_shapes)
    captured = time.perf_counter()
    gm = rewrite_graph(gm, dtype=dtype, rules=rules, keep_fp32=keep_fp32,
                       keep_io_types=keep_io_types, device=device,
                       autocast_floor=autocast_floor, fuse=fuse)
    gm.amp_report["capture_seconds"] = round(captured - start, 4)
    return gm


def rewrite_graph(gm: torch.fx.GraphModule, *, dtype: torch.dtype | str = torch.float16,
                  rules: Iterable[str] = (), keep_fp32: Iterable[str] = (),
                  keep_io_types: bool = True, device: str | None = None,
                  autocast_floor: bool = True, fuse: bool = True) -> torch.fx.GraphModule:
    """Run the passes on a captured GraphModule (``meta['val']`` on its nodes), in place.

    ``device`` (default: the device type of the graph's example values) selects kernel facts:
    on 'cpu' the ``torch_cpu.toml`` overlay moves to gray the ops CPU kernels compute in fp32
    internally (norms, softmax, interpolation: CPU autocast runs them low too), norms read
    fp32 weights with low data, and ``softmax(dtype=float32)`` counts its input conversion.
    """
    low = LowDtype.parse(dtype)
    device = device or graph_device(gm)
    overlays = [default_rules_path("torch_cpu")] if device == "cpu" else []
    rule_set = load_rules("torch", extra_files=[*overlays, *listed(rules)])
    options = MixedPrecisionOptions(rule_set, _TORCH_DTYPES[low], low.max_finite,
                                    listed(keep_fp32), keep_io_types, device, autocast_floor)
    start = time.perf_counter()
    with gc_paused():
        inlined = UnfuseRegions()(gm).modified | InlineModules()(gm).modified
        fused = any([p(gm).modified for p in _pattern_passes(fuse)])
        if inlined or fused:
            refresh_fake_values(gm)
        FunctionalizeInPlace()(gm)
        amp = MixedPrecisionPass(options)
        amp(gm)
        pointwise = FusePointwise()
        if fuse:
            pointwise(gm)
    gm.meta[EXPLAIN_KEY] = _with_fusions(gm, amp.explanations())
    gm.amp_report = {**amp.report(), "device": device,
                     "fused": _fused_summary(gm, pointwise),
                     "seconds": round(time.perf_counter() - start, 4)}
    for note in gm.amp_report["notes"]:
        log.warning("%s", note)
    return gm


def _pattern_passes(fuse: bool) -> list:
    """Pattern fusion before the plan; without ``fuse`` only the ATen tanh-GELU, as before."""
    if not fuse:
        return [FuseTanhGelu(traced=False)]
    return [FuseTanhGelu(), FuseAttention(), FuseNorms()]


def _fused_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    nodes = list(gm.graph.nodes)
    for module in gm.children():
        region = getattr(module, "region", None)
        if isinstance(region, torch.fx.GraphModule):
            nodes.extend(region.graph.nodes)
    # casts and region outputs copy their producer's meta: only the fused ops themselves
    return [n for n in nodes if n.meta.get(FUSED_TAG) and not is_cast(n)
            and isinstance(n.target, torch._ops.OpOverload)]


def _fused_summary(gm: torch.fx.GraphModule, pointwise: FusePointwise) -> dict:
    patterns: dict[str, int] = {}
    for node in _fused_nodes(gm):
        patterns[node.meta[FUSED_TAG]] = patterns.get(node.meta[FUSED_TAG], 0) + 1
    return {"patterns": patterns, **pointwise.summary()}


def _with_fusions(gm: torch.fx.GraphModule,
                  explanations: dict[str, list[str]]) -> dict[str, list[str]]:
    """Explanations of fused nodes start with what the fusion replaced."""
    for node in _fused_nodes(gm):
        line = (f"{node.name}: fused {node.meta[FUSED_TAG]} pattern (replaced "
                f"{node.meta[FUSED_FROM]})")
        explanations[node.name] = [line, *explanations.get(node.name, [])]
    return explanations


def graph_device(gm: torch.fx.GraphModule) -> str:
    """Device type of the first tensor among the graph's example values, else of its params."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return next((p.device.type for p in gm.parameters()), "cpu")


def explain(gm: torch.fx.GraphModule, node_name: str) -> list[str]:
    """Print and return why node ``node_name`` of a rewritten module runs low or high."""
    explanations = getattr(gm, "meta", {}).get(EXPLAIN_KEY)
    if explanations is None:
        raise UsageError("this GraphModule was not produced by amp_rewrite.rewrite")
    lines = explanations.get(node_name)
    if not lines:
        raise UsageError(f"no node named {node_name!r} with floating-point ports in this graph")
    print("\n".join(lines))
    return lines
