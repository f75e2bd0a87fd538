"""The torch adapter: ``rewrite(module, example_inputs)`` → a mixed-precision GraphModule.

Capture (``torch.export`` by default, ``symbolic_trace`` on request, or a GraphModule as is),
then the passes of :mod:`amp_rewrite.fx.passes` on the shared core (DESIGN §1-2). The result
keeps FP32 parameters (cast in-graph once per forward), the original ``state_dict`` keys, shapes
and dtypes, and carries ``gm.amp_report`` (the ONNX ``--report`` schema).
"""
from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from amp_rewrite import arguments
from amp_rewrite.core import LowDtype, PadPolicy, RuleSet, load_rules
from amp_rewrite.core.rules import close_match, default_rules_path
from amp_rewrite.runtime import gc_paused, listed
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import guards, lowering
from amp_rewrite.fx.capture import capture as capture_module
from amp_rewrite.fx.capture import fill_missing_fake_values, refresh_fake_values
from amp_rewrite.fx.fusion import FUSED_FROM, FUSED_TAG, FuseAttention, FuseNorms, FuseTanhGelu
from amp_rewrite.fx.lowering import (LOWERED_TAG, EmulateLowKernels, RestoreLowKernels,
                                     native_low_gemm)
from amp_rewrite.fx.lowering import explanation as lowering_explanation
from amp_rewrite.fx.modes import TrainEvalModule, in_mode
from amp_rewrite.fx.pad import PadGemms
from amp_rewrite.fx.passes import (FunctionalizeInPlace, InlineModules, MixedPrecisionOptions,
                                   MixedPrecisionPass)
from amp_rewrite.fx.masks import DropTrivialAttentionMasks
from amp_rewrite.fx.pointwise import CUDA_MIN_SAVED_BYTES, FusePointwise, UnfuseRegions
from amp_rewrite.fx.view import is_cast

__all__ = ["TrainEvalModule", "explain", "rewrite", "rewrite_graph"]

log = logging.getLogger(__name__)

_TORCH_DTYPES = {LowDtype.FLOAT16: torch.float16, LowDtype.BFLOAT16: torch.bfloat16}
EXPLAIN_KEY = "amp_rewrite_explain"  # gm.meta key: node name -> reasons, for explain()


def rewrite(model: torch.nn.Module, example_inputs: Any = None, *,
            example_kwargs: Mapping[str, Any] | None = None,
            dtype: torch.dtype | str = torch.float16, capture: str = "export",
            dynamic_shapes: Any = None, rules: Iterable[str] = (),
            keep_fp32: Iterable[str] = (), keep_io_types: bool = True,
            device: str | None = None, autocast_floor: bool = True,
            mode: str | None = None, pad: bool | PadPolicy | None = None,
            fuse: bool = True, emulate_gemms: bool | None = None
            ) -> torch.fx.GraphModule | TrainEvalModule:
    """Capture ``model`` and return a trainable mixed-precision ``GraphModule``.

    ``dtype``: torch.float16 / torch.bfloat16 (or 'fp16' / 'bf16'). ``capture``: 'export'
    (default) or 'symbolic_trace'; a GraphModule is taken as is (``example_inputs`` only needed
    when its nodes carry no ``meta['val']``). ``dynamic_shapes``: default every dimension
    export can keep symbolic (batch, sequence: a smaller last batch runs), ``"static"`` for
    the example shapes only, or a ``torch.export`` spec. ``rules``: extra rule files.
    ``keep_fp32``: fnmatch patterns on node names or module paths kept fp32.
    ``keep_io_types``: outputs keep their dtypes. ``device``: device type the result will run
    on ('cuda', 'cpu'); default: that of the example values. On 'cpu' the packaged
    ``torch_cpu.toml`` overlay applies (see ``rewrite_graph``). ``autocast_floor``: never run
    an op lower than ``torch.autocast`` of that device would (``fx/floor.py``); False leaves
    those ops to the min cut alone (fewer cast bytes, larger error). ``mode``: None (the
    module's current train/eval mode), 'train', 'eval', or 'both': a ``TrainEvalModule``
    holding both captures on shared parameters, switched by ``.train()`` / ``.eval()``.
    ``pad``: pad low GEMM/conv dims to multiples of 8 in the graph (``fx/pad.py``); None: on
    for device 'cuda' (Tensor Cores), off elsewhere (padding buys nothing on CPU); a
    ``PadPolicy`` pads with that policy.
    ``fuse``: fuse attention, norms and GELU into ATen kernels before the plan and pointwise
    regions (casts included) into Inductor-compiled submodules after it (``fx/fusion.py``,
    ``fx/pointwise.py``); False gives the unfused graph.
    ``emulate_gemms``: run the GEMMs, convolutions and attention the plan makes low as fp32
    kernels on low-rounded operands, output rounded to the low dtype (``fx/lowering.py``: the
    low kernel's numerics class at fp32 speed). None (default): follow the device, and only
    with ``fuse``: on a CPU, GEMMs and convolutions when it has no native bf16/fp16 GEMM
    instructions (100x+ faster there), attention calls the fp32 kernel runs faster here
    (timed once per distinct call); never on CUDA. True: every low kernel; False: none.
    The user's module is never mutated; the result owns copies of its parameters.
    """
    _check_rewrite_arguments(dtype=dtype, keep_fp32=keep_fp32, keep_io_types=keep_io_types,
                             device=device, autocast_floor=autocast_floor, mode=mode)
    if example_inputs is None and not isinstance(model, torch.fx.GraphModule):
        raise UsageError("example_inputs is required to capture an nn.Module")
    if mode is not None and isinstance(model, torch.fx.GraphModule):
        raise UsageError("mode= needs an nn.Module to capture; a GraphModule is taken as it "
                         "is, in the mode it was captured in")
    if mode == "both":
        return _rewrite_train_and_eval(
            model, example_inputs, example_kwargs=example_kwargs, dtype=dtype, capture=capture,
            dynamic_shapes=dynamic_shapes, rules=rules, keep_fp32=keep_fp32,
            keep_io_types=keep_io_types, device=device, autocast_floor=autocast_floor, pad=pad,
            fuse=fuse, emulate_gemms=emulate_gemms)
    if mode is not None:
        with in_mode(model, mode):
            return rewrite(model, example_inputs, example_kwargs=example_kwargs, dtype=dtype,
                           capture=capture, dynamic_shapes=dynamic_shapes, rules=rules,
                           keep_fp32=keep_fp32, keep_io_types=keep_io_types, device=device,
                           autocast_floor=autocast_floor, pad=pad, fuse=fuse,
                           emulate_gemms=emulate_gemms)
    start = time.perf_counter()
    gm = capture_module(model, () if example_inputs is None else example_inputs,
                        example_kwargs, mode=capture, dynamic_shapes=dynamic_shapes)
    captured = time.perf_counter()
    gm = rewrite_graph(gm, dtype=dtype, rules=rules, keep_fp32=keep_fp32,
                       keep_io_types=keep_io_types, device=device,
                       autocast_floor=autocast_floor, pad=pad, fuse=fuse,
                       emulate_gemms=emulate_gemms)
    gm.amp_report["capture_seconds"] = round(captured - start, 4)
    return gm


def rewrite_graph(gm: torch.fx.GraphModule, *, dtype: torch.dtype | str = torch.float16,
                  rules: Iterable[str] = (), keep_fp32: Iterable[str] = (),
                  keep_io_types: bool = True, device: str | None = None,
                  autocast_floor: bool = True, pad: bool | PadPolicy | None = None,
                  fuse: bool = True, emulate_gemms: bool | None = None
                  ) -> torch.fx.GraphModule:
    """Run the passes on a captured GraphModule (``meta['val']`` on its nodes), in place.

    ``device`` (default: the device type of the graph's example values) selects kernel facts:
    on 'cpu' the ``torch_cpu.toml`` overlay moves to gray the ops CPU kernels compute in fp32
    internally (norms, softmax, interpolation: CPU autocast runs them low too), norms read
    fp32 weights with low data, and ``softmax(dtype=float32)`` counts its input conversion.
    ``emulate_gemms``: as in ``rewrite`` (CPU GEMM emulation, ``fx/lowering.py``).
    """
    _check_rewrite_arguments(dtype=dtype, keep_fp32=keep_fp32, keep_io_types=keep_io_types,
                             device=device, autocast_floor=autocast_floor)
    low = LowDtype.parse(dtype)
    device = arguments.device_type(device) or graph_device(gm)
    overlays = [default_rules_path("torch_cpu")] if device == "cpu" else []
    rule_set = load_rules("torch", extra_files=[*overlays, *listed(rules)])
    # a second rewrite plans on the flat graph with its low kernels
    unfused = UnfuseRegions()(gm).modified | RestoreLowKernels()(gm).modified
    foreign_notes = _prepare_dtypes(gm, _TORCH_DTYPES[low], rule_set, keep_io_types, device)
    options = MixedPrecisionOptions(rule_set, _TORCH_DTYPES[low], low.max_finite,
                                    listed(keep_fp32), keep_io_types, device, autocast_floor)
    start = time.perf_counter()
    with gc_paused():
        inlined = unfused | InlineModules()(gm).modified
        # the GELU fusion keeps meta['val'] (re-propagating was 63% of GPT-2's rewrite)
        FuseTanhGelu(traced=fuse)(gm)
        fused = any([p(gm).modified for p in _pattern_passes(fuse)])
        if inlined or (fused and not fill_missing_fake_values(gm)):
            refresh_fake_values(gm)
        FunctionalizeInPlace()(gm)
        masks = DropTrivialAttentionMasks()
        masks(gm)
        amp = MixedPrecisionPass(options)
        amp(gm)
        padding = _pad(gm, device == "cuda" if pad is None else pad)  # a policy is truthy
        emulated = _emulate_gemms(gm, _TORCH_DTYPES[low], device, fuse, emulate_gemms)
        pointwise = FusePointwise(CUDA_MIN_SAVED_BYTES if device == "cuda" else 0)
        if fuse:  # DESIGN §4: pointwise fusion last, casts and pads included
            pointwise(gm)
    gm.meta[EXPLAIN_KEY] = _for_device(_with_fusions(gm, amp.explanations()), device)
    gm.amp_report = {**amp.report(), "device": device, "padding": padding,
                     "emulated_gemms": emulated,
                     "attention_masks_dropped": masks.dropped,
                     "fused": _fused_summary(gm, pointwise),
                     "seconds": round(time.perf_counter() - start, 4)}
    _true_notes(gm.amp_report, foreign_notes)
    for note in gm.amp_report["notes"]:
        log.warning("%s", note)
    return gm


# ------------------------------------------------- issue 18: arguments, dtypes, modes


def _check_rewrite_arguments(*, dtype: object, keep_fp32: object, keep_io_types: object,
                             device: object, autocast_floor: object,
                             mode: object = None) -> None:
    """Wrong types fail here, in one line, not deep inside the passes (``arguments``)."""
    arguments.low_dtype(dtype)
    arguments.patterns(keep_fp32, name="keep_fp32")
    arguments.flag(keep_io_types, name="keep_io_types")
    arguments.flag(autocast_floor, name="autocast_floor")
    arguments.device_type(device)
    if mode is not None:
        arguments.choice(mode, arguments.MODES, name="mode")


def _prepare_dtypes(gm: torch.fx.GraphModule, low: torch.dtype, rules: RuleSet,
                    keep_io_types: bool, device: str) -> list[str]:
    """Refuse integer data into GEMMs; mark ops without a low kernel on ``device``; adapt
    bf16/fp16/fp64-held models (``fx/guards.py``)."""
    guards.refuse_non_float_gemm_inputs(gm, rules)
    guards.mark_missing_low_kernels(gm, low, rules, device)
    convert = guards.ConvertForeignFloats(low, keep_io_types)
    convert(gm)
    return convert.notes


def _true_notes(report: dict, foreign_notes: list[str]) -> None:
    """Replace the generic 'no floating-point tensors' note when the model had some."""
    if foreign_notes:
        report["notes"] = [n for n in report["notes"] if "no floating-point tensors" not in n]
        report["notes"][:0] = foreign_notes


def _rewrite_train_and_eval(model: torch.nn.Module, example_inputs: Any,
                            **options: Any) -> TrainEvalModule:
    """Both captures, sharing one set of parameters and buffers (``fx/modes.py``)."""
    graphs = {mode: rewrite(model, example_inputs, mode=mode, **options)
              for mode in ("train", "eval")}
    return TrainEvalModule(graphs["train"], graphs["eval"], training=model.training)


def _pad(gm: torch.fx.GraphModule, enabled: bool | PadPolicy) -> dict:
    """Pad low GEMM/conv dims to multiples of 8 (``fx/pad.py``); the report's section."""
    if not enabled:
        return {"enabled": False}
    pad = PadGemms(enabled if isinstance(enabled, PadPolicy) else None)
    if pad(gm).modified:
        refresh_fake_values(gm)
    return pad.report()


def _emulate_gemms(gm: torch.fx.GraphModule, low: torch.dtype, device: str, fuse: bool,
                   requested: bool | None) -> dict:
    """Low GEMMs/convs/SDPA as fp32 kernels on low-rounded operands (``fx/lowering.py``)
    where the device has no fast low kernels; the report's section."""
    native = native_low_gemm(low, device)
    if requested is False or (requested is None and (not fuse or device != "cpu")):
        return {"enabled": False, "native_low_gemm": native}
    # time the backward too where gradients flow: trainable parameters or inputs needing grad
    trained = any(p.requires_grad for p in gm.parameters()) or any(
        getattr(n.meta.get("val"), "requires_grad", False)
        for n in gm.graph.nodes if n.op == "placeholder")
    select = None if requested else lowering.device_choice(low, native, trained)
    emulate = EmulateLowKernels(select)
    emulate(gm)
    return {"enabled": bool(emulate.lowered), "native_low_gemm": native,
            "kernels": emulate.lowered,
            "why": "fp32 kernels on low-rounded operands: " + (
                "requested" if requested else
                f"GEMMs: {'native' if native else 'no native'} "
                f"{str(low).removeprefix('torch.')} GEMM on this CPU; attention: measured")}


def _pattern_passes(fuse: bool) -> list:
    """Pattern fusion before the plan beside the GELU one (which runs either way, as before)."""
    return [FuseAttention(), FuseNorms()] if fuse else []


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
    for node in gm.graph.nodes:
        if node.meta.get(LOWERED_TAG) == "kernel":
            explanations.setdefault(node.name, []).append(lowering_explanation(node))
    return explanations


def graph_device(gm: torch.fx.GraphModule) -> str:
    """Device type of the first tensor among the graph's example values, else of its params."""
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device.type
    return next((p.device.type for p in gm.parameters()), "cpu")


# The torch rules' reasons describe the CUDA kernels (autocast's CUDA lists are their base);
# on another device the same decision holds for that device's kernels, named here.
_CUDA_WORDING = ((re.compile(r"\bon Tensor Cores\b"), "in the device's low-precision GEMM"),
                 (re.compile(r"\bTensor Cores?\b"), "low-precision GEMM units"),
                 (re.compile(r"\bcu(BLAS|DNN|BLASLt)\b"), "oneDNN"))


def _for_device(explanations: dict[str, list[str]], device: str) -> dict[str, list[str]]:
    if device == "cuda":
        return explanations
    def true(line: str) -> str:
        for pattern, wording in _CUDA_WORDING:
            line = pattern.sub(wording, line)
        return line
    return {name: [true(line) for line in lines] for name, lines in explanations.items()}


def explain(gm: torch.fx.GraphModule, node_name: str) -> list[str]:
    """Why node ``node_name`` of a rewritten module runs low or high (the lines; the CLI
    prints them). An unknown name is a ``UsageError`` with the nearest names, including
    fused nodes that replaced an op of that name (``softmax`` inside attention)."""
    explanations = getattr(gm, "meta", {}).get(EXPLAIN_KEY)
    if explanations is None:
        raise UsageError("this GraphModule was not produced by amp_rewrite.rewrite")
    lines = explanations.get(node_name)
    if not lines:
        raise UsageError(f"no node named {node_name!r} with floating-point ports in this "
                         f"graph{_near_names(explanations, node_name)}")
    return list(lines)


def _near_names(explanations: dict[str, list[str]], wanted: str) -> str:
    """" (did you mean X?)", or the fused nodes that replaced an op called ``wanted``."""
    fused_into = [name for name, lines in explanations.items()
                  if re.search(rf"\(replaced [^)]*\b{re.escape(wanted)}\b", lines[0])]
    if fused_into:
        return (f"; {wanted} was fused into {', '.join(fused_into[:3])}"
                f"{' ...' if len(fused_into) > 3 else ''}: explain that node")
    prefixed = sorted((n for n in explanations if n.startswith(wanted)), key=len)
    if prefixed:
        return f" (did you mean {prefixed[0]}?)"
    return close_match(wanted, explanations)
