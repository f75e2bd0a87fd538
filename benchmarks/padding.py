"""Padding of GEMM/conv dims to multiples of 8: alignment, exactness, propagation.

On zoo architectures built with their real misaligned sizes (``zoo.build(real_sizes=True)``:
GPT-2's 50257-word vocabulary, BERT's 30522, ViT's 197 tokens, the convnets' 3-channel stems)
and on odd user modules (MLP 100→37→1001, CNN 3→13→7, a grouped conv, a GPT-2 block with an
odd hidden size), for the ONNX and torch paths in fp16 and bf16, it prints per model:

* ``aligned before → after``: the fraction of low GEMM/conv FLOPs whose K and N (convs: input
  and output channels per group) are multiples of 8, without and with padding;
* ``no-dw``: the same fraction without depthwise convs (not GEMMs, never on Tensor Cores);
* ``est×``: the cost model's estimated time of all low GEMMs/convs, unpadded ÷ padded;
* ``eligible``: the fraction of FLOPs of ops that ``should_pad`` accepted whose padded dims
  are aligned after the rewrite (goal 100%);
* ``max rel``: max relative difference of the padded rewrite's outputs to the unpadded
  rewrite's (same shapes asserted), and in FP32 mode (padding applied to the FP32 graph);
* ``P/S between``: Pad/Slice nodes on a path from one GEMM/conv to the next that runs only
  through ops the plan may propagate through (what propagation is meant to remove);
* ``2nd run``: whether rewriting the output again changes anything;
* torch only: state_dict unchanged, max gradient difference to pad=False, and (``--compile``)
  ``torch.export`` / ``torch.compile`` of the padded result.

Writes JSON (``--json``). No GPU timing here: a session without a device cannot measure it.

    AMP_REWRITE_CACHE=/work/cache/zoo python -m benchmarks padding [--models a,b]
        [--compute-bound]  # decide as for large shapes (memory traffic free)

FLOPs and alignment are counted at the example inputs' sizes. The summary gives the zoo's
aligned fractions (all, and without depthwise convs) and the misaligned FLOPs left by the
reason they were not padded.
"""
from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import logging
import math
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import torch
from torch import nn

import amp_rewrite
import amp_rewrite.fx
from amp_rewrite.core.padding import (PadGraph, PadKind, PadOp, PadPolicy, op_flops,
                                      plan_padding)
from amp_rewrite.onnx import pad as onnx_pad
from amp_rewrite.onnx.api import rewrite_onnx_model
from amp_rewrite.fx.pad import PadGemms, _POINTWISE as FX_POINTWISE
from tests.models import zoo

ZOO = ("gpt2", "bert", "roberta", "distilbert", "albert", "bart", "t5", "llama", "vit", "deit",
       "clip_vision", "swin", "whisper_encoder", "wav2vec2", "resnet", "convnext",
       "mobilenet_v2", "segformer")
USER = ("mlp_100_37_1001", "cnn_3_13_7", "grouped_conv", "gpt2_block_odd")
TOL = {"fp16": 5e-3, "bf16": 4e-2}


# ----------------------------------------------------------------------------- models


def user_module(name: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    if name == "mlp_100_37_1001":
        return nn.Sequential(nn.Linear(100, 37), nn.GELU(), nn.Linear(37, 1001)), (
            torch.randn(16, 100),)
    if name == "cnn_3_13_7":
        return nn.Sequential(nn.Conv2d(3, 13, 3, padding=1), nn.BatchNorm2d(13), nn.ReLU(),
                             nn.Conv2d(13, 7, 3, padding=1)).eval(), (torch.randn(2, 3, 16, 16),)
    if name == "grouped_conv":
        return nn.Sequential(nn.Conv2d(3, 26, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(26, 26, 3, padding=1, groups=2), nn.ReLU(),
                             nn.Conv2d(26, 13, 1)).eval(), (torch.randn(2, 3, 16, 16),)
    if name == "gpt2_block_odd":
        import transformers

        cfg = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=45, n_head=5,
                                      n_inner=180, n_layer=1, attn_implementation="eager")
        block = transformers.GPT2Model(cfg).eval()

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = block

            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return self.model(input_ids=input_ids, use_cache=False, return_dict=False)[0]

        return Block().eval(), (torch.randint(0, 128, (2, 16)),)
    raise SystemExit(f"unknown model {name}")


def build(name: str) -> tuple[nn.Module, tuple]:
    if name in USER:
        return user_module(name)
    model = zoo.build(name, real_sizes=True)
    return model.module, model.args


def onnx_path(name: str, module: nn.Module, args: tuple) -> Path:
    directory = zoo.default_cache_dir() / "real-sizes"
    path = directory / f"{name}-{zoo._cache_tag()}.onnx"
    if not path.is_file():
        zoo.export_model(zoo.ZooModel(name, module, args, {}, ""), path)
    return path


# ----------------------------------------------------------------------------- measures


def _dims(g: PadGraph, op: PadOp) -> tuple[int | None, int | None]:
    """(K, N) of a GEMM; (Cin, Cout) per group of a conv."""
    def dim(ref):
        shape = g.shape(ref[0])
        return shape[ref[1]] if shape is not None else None
    if op.kind is PadKind.CONV:
        cout = dim(op.n_axes[0])
        return dim(op.k_axes[1]), cout // op.groups if isinstance(cout, int) else None
    return dim(op.k_axes[0]), dim(op.n_axes[0])


def concrete(g: PadGraph) -> PadGraph:
    """``g`` with symbolic dims at their example sizes (``PadValue.hint``): FLOPs and
    alignment are counted on the sizes the example inputs run with."""
    out = PadGraph()
    for value in g.values.values():
        if value.hint is not None:
            value = value._replace(shape=tuple(
                h if isinstance(h, int) else d for d, h in zip(value.shape, value.hint)))
        out.add_value(value)
    for op in g.ops.values():
        out.add_op(op)
    return out


def _depthwise(g: PadGraph, op: PadOp) -> bool:
    """One input channel per group: not a GEMM, never on Tensor Cores."""
    return op.kind is PadKind.CONV and op.groups > 1 and _dims(g, op)[0] == 1


def alignment(g: PadGraph) -> tuple[dict[str, tuple], float, float]:
    """name -> (K, N, flops, depthwise) of every low GEMM/conv; total FLOPs; aligned FLOPs."""
    ops, total, aligned = {}, 0.0, 0.0
    for op in g.ops.values():
        if op.kind not in (PadKind.GEMM, PadKind.CONV) or not op.low:
            continue
        flops = op_flops(g, op) or 0
        k, n = _dims(g, op)
        ops[op.name] = (k, n, flops, _depthwise(g, op))
        total += flops
        if all(isinstance(d, int) and d % 8 == 0 for d in (k, n)):
            aligned += flops
    return ops, total, aligned


def aligned_fractions(before: PadGraph, after: PadGraph) -> dict[str, float]:
    """Low GEMM/conv FLOPs, all and without depthwise convs, and those on aligned shapes
    before and after padding (after: each op counted with its unpadded FLOPs, by name)."""
    ops_before, total, aligned_before = alignment(before)
    ops_after, _, _ = alignment(after)

    def aligned(name: str) -> bool:
        return all(isinstance(d, int) and d % 8 == 0
                   for d in ops_after.get(name, (None, None))[:2])

    dense = {n: v for n, v in ops_before.items() if not v[3]}
    return {"total": total, "before": aligned_before,
            "after": sum(v[2] for n, v in ops_before.items() if aligned(n)),
            "total_dense": sum(v[2] for v in dense.values()),
            "before_dense": sum(v[2] for v in dense.values()
                                if all(isinstance(d, int) and d % 8 == 0 for d in v[:2])),
            "after_dense": sum(v[2] for n, v in dense.items() if aligned(n))}


def _reference(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    from amp_rewrite.onnx.validate import reference_evaluator  # runs fused contrib ops too

    return [np.asarray(o, np.float32) for o in reference_evaluator(proto).run(None, feeds)]


def eligible_aligned(before: PadGraph, after: PadGraph, policy: PadPolicy,
                     slice_is_view: bool = False, runtime_pads: bool = False
                     ) -> tuple[float, list[str]]:
    """Fraction of FLOPs of ops should_pad accepted whose padded dims are now aligned."""
    plan = plan_padding(before, policy, slice_is_view=slice_is_view,
                        runtime_pads=runtime_pads)
    after_ops, _, _ = alignment(after)
    total = good = 0.0
    misses = []
    for p in plan.padded_ops:
        k, n, _, _ = after_ops.get(p.name, (None, None, 0, False))
        size = {"K": k, "Cin": k, "N": n, "Cout": n}
        ok = all(isinstance(size[d.role], int) and size[d.role] % 8 == 0 for d in p.dims)
        total += p.flops
        good += p.flops if ok else 0
        if not ok:
            misses.append(p.name)
    return (good / total if total else 1.0), misses


_WHY = (("cost model", "cost model"), ("tiny op", "tiny"), ("grouped conv", "grouped"),
        ("symbolic", "symbolic"), ("activations", "activation GEMMs off"),
        ("unknown", "unknown"), ("differs", "operands differ"))


def why_misaligned(plan_graph: PadGraph, before: PadGraph, after: PadGraph,
                   policy: PadPolicy, **options: bool) -> dict[str, float]:
    """FLOPs still misaligned after padding, by the reason their dims were not padded
    (``plan_graph``: the graph the rewrite planned on; FLOPs from the concrete graphs)."""
    plan = plan_padding(plan_graph, policy, **options)
    reasons = {p.name: " ".join(r for _, r in p.skipped) for p in plan.ops.values()}
    ops_before, _, _ = alignment(before)
    ops_after, _, _ = alignment(after)
    left: dict[str, float] = {}
    for name, (_, _, flops, depthwise) in ops_before.items():
        k, n = ops_after.get(name, (None, None))[:2]
        if all(isinstance(d, int) and d % 8 == 0 for d in (k, n)):
            continue
        text = reasons.get(name, "")
        why = "depthwise" if depthwise else next((c for key, c in _WHY if key in text),
                                                 "other")
        left[why] = left.get(why, 0.0) + flops
    return left


def _ratio(a: float, b: float) -> float:
    return a / b if b else 1.0


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


# ----------------------------------------------------------------------------- ONNX

_ONNX_GEMMS = ("MatMul", "Gemm", "Conv")


def _onnx_pad_graph(proto: onnx.ModelProto, feeds: dict | None = None,
                    low=onnx_pad._LOW) -> PadGraph:
    """The pad graph; with ``feeds``, the graph inputs take the example sizes first (FLOPs
    and alignment are counted on the sizes the model runs with, not symbolic dims)."""
    model = ir.from_proto(proto)
    for value in model.graph.inputs:
        if feeds is not None and value.name in feeds:
            value.shape = ir.Shape(feeds[value.name].shape)
    ir.passes.common.ShapeInferencePass(strict_mode=False)(model)
    return onnx_pad.build_pad_graph(model.graph, low)


def _propagates_onnx(node: onnx.NodeProto) -> bool:
    return node.op_type in onnx_pad._POINTWISE or node.op_type in (
        "BatchNormalization", "Pow") or (node.domain == "com.microsoft"
                                        and node.op_type in onnx_pad._CONTRIB)


def pad_slice_between_gemms_onnx(proto: onnx.ModelProto) -> int:
    producers = {o: n for n in proto.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in proto.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)

    def reaches(node, step) -> bool:
        seen, work = set(), list(step(node))
        while work:
            n = work.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            if n.op_type in _ONNX_GEMMS:
                return True
            if _propagates_onnx(n) or n.op_type in ("Pad", "Slice"):
                work.extend(step(n))
        return False

    up = lambda n: [producers[i] for i in n.input[:1] if i in producers]  # noqa: E731
    down = lambda n: [r for o in n.output for r in readers.get(o, [])]  # noqa: E731
    inserted = [n for n in proto.graph.node if n.op_type in ("Pad", "Slice") and any(
        p.key == "amp_rewrite.inserted" for p in n.metadata_props)]
    return sum(1 for n in inserted if reaches(n, up) and reaches(n, down))


def _common_columns(flops: dict[str, float], eligible: float, misses: list,
                    report: dict) -> dict:
    """The row's columns both paths compute alike: alignment and the padding report."""
    total, dense = flops["total"], flops["total_dense"]
    est_before = report["estimated_seconds_unpadded"]
    return {"gemm_flops": total, "aligned_before": _ratio(flops["before"], total),
            "aligned_after": _ratio(flops["after"], total),
            "dense_flops": dense, "dense_aligned_before": _ratio(flops["before_dense"], dense),
            "dense_aligned_after": _ratio(flops["after_dense"], dense),
            "est_speedup": _ratio(est_before, report["estimated_seconds_padded"]),
            "eligible_aligned": eligible,
            "misses": misses, "padded_ops": report["padded_ops"],
            "extra_flop_fraction": report["extra_flop_fraction"],
            "pads": report["pads_inserted"], "slices": report["slices_inserted"],
            "regions": report["regions_propagated"]}


def bench_onnx(name: str, module: nn.Module, args: tuple, dtype: str,
               policy: PadPolicy) -> dict:
    import onnxruntime as ort

    path = onnx_path(name, module, args)
    fp32 = onnx.load(str(path))
    named = dict(zip(inspect.signature(module.forward).parameters, args))
    feeds = {i.name: named[i.name].numpy() for i in fp32.graph.input}

    def run(proto):
        sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)

    plain = rewrite_onnx_model(str(path), dtype=dtype, pad=False).proto()
    result = rewrite_onnx_model(str(path), dtype=dtype, pad=policy)
    padded = result.proto()
    g_before, g_after = _onnx_pad_graph(plain, feeds), _onnx_pad_graph(padded, feeds)
    flops = aligned_fractions(g_before, g_after)
    # what should_pad accepted is judged on the graph the rewrite saw (symbolic dims kept)
    eligible, misses = eligible_aligned(_onnx_pad_graph(plain), g_after, policy,
                                        runtime_pads=True)
    left = why_misaligned(_onnx_pad_graph(plain), g_before, g_after, policy,
                          runtime_pads=True)
    if dtype == "bf16":  # onnxruntime's CPU provider has no bf16 Add/Pad/...: reference
        run = functools.partial(_reference, feeds=feeds)
    rel = max(_rel(a, b) for a, b in zip(run(padded), run(plain)))
    report = result.report["padding"]
    again = rewrite_onnx_model(padded, dtype=dtype, pad=policy)
    return {"path": "onnx", "model": name, "dtype": dtype,
            **_common_columns(flops, eligible, misses, report),
            "left_misaligned_flops": left,
            "pad_slice_between_gemms": pad_slice_between_gemms_onnx(padded),
            "max_rel_vs_unpadded": rel,
            "second_run_modified": again.pass_.modified,
            "fp32_mode_max_rel": _onnx_fp32_mode(fp32, run, policy)}


def _onnx_fp32_mode(fp32: onnx.ModelProto, run, policy: PadPolicy) -> float:
    model = ir.from_proto(fp32)
    ir.passes.common.ShapeInferencePass(strict_mode=False)(model)
    onnx_pad.pad_model(model, policy, low=(ir.DataType.FLOAT,))
    return max(_rel(a, b) for a, b in zip(run(ir.to_proto(model)), run(fp32)))


# ----------------------------------------------------------------------------- torch


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)]


def _propagates_fx(node: torch.fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    return packet in FX_POINTWISE or packet in (torch.ops.aten.batch_norm, torch.ops.aten.pow)


_FX_GEMMS = {torch.ops.aten.linear, torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.matmul,
             torch.ops.aten.bmm, torch.ops.aten.conv1d, torch.ops.aten.conv2d,
             torch.ops.aten.conv3d, torch.ops.aten.convolution}


def pad_slice_between_gemms_fx(gm: torch.fx.GraphModule) -> int:
    def is_gemm(n):
        return getattr(n.target, "overloadpacket", None) in _FX_GEMMS

    def reaches(node, step) -> bool:
        seen, work = set(), list(step(node))
        while work:
            n = work.pop()
            if n in seen:
                continue
            seen.add(n)
            if is_gemm(n):
                return True
            packet = getattr(n.target, "overloadpacket", None)
            if _propagates_fx(n) or packet in (torch.ops.aten.constant_pad_nd,
                                               torch.ops.aten.slice):
                work.extend(step(n))
        return False

    up = lambda n: [a for a in n.all_input_nodes[:1]]  # noqa: E731
    down = lambda n: list(n.users)  # noqa: E731
    marks = [n for n in gm.graph.nodes if n.target in (torch.ops.aten.constant_pad_nd.default,
                                                       torch.ops.aten.slice.Tensor)
             and not (n.args[0].op == "get_attr")]
    return sum(1 for n in marks if reaches(n, up) and reaches(n, down))


def bench_torch(name: str, module: nn.Module, args: tuple, dtype: str, compile_: bool,
                policy: PadPolicy) -> dict:
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    plain = amp_rewrite.rewrite(module, args, dtype=torch_dtype, pad=False)
    padded = amp_rewrite.rewrite(module, args, dtype=torch_dtype, pad=policy)
    pad = PadGemms(policy)
    g_before, g_after = pad.build(plain.graph), pad.build(padded.graph)
    flops = aligned_fractions(concrete(g_before), concrete(g_after))  # example sizes
    eligible, misses = eligible_aligned(g_before, g_after, policy, slice_is_view=True)
    left = why_misaligned(g_before, concrete(g_before), concrete(g_after), policy,
                          slice_is_view=True)
    out_p, out_u = _flat(padded(*args)), _flat(plain(*args))
    rel = max(_rel(a.detach().float().numpy(), b.detach().float().numpy())
              for a, b in zip(out_p, out_u))
    sum(o.float().sum() for o in out_p if o.is_floating_point()).backward()
    sum(o.float().sum() for o in out_u if o.is_floating_point()).backward()
    grad = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
               for p, q in zip(padded.parameters(), plain.parameters())
               if p.grad is not None and q.grad is not None)
    state = {k: (v.shape, v.dtype) for k, v in module.state_dict().items()}
    report = padded.amp_report["padding"]
    again = amp_rewrite.fx.rewrite_graph(copy.deepcopy(padded), dtype=torch_dtype, pad=policy)
    row = {"path": "torch", "model": name, "dtype": dtype,
           **_common_columns(flops, eligible, misses, report),
           "left_misaligned_flops": left,
           "pad_slice_between_gemms": pad_slice_between_gemms_fx(padded),
           "max_rel_vs_unpadded": rel,
           "fp32_mode_max_rel": _fx_fp32_mode(module, args, policy),
           "grad_max_rel_vs_unpadded": grad,
           "state_dict_unchanged": {k: (v.shape, v.dtype)
                                    for k, v in padded.state_dict().items()} == state,
           "second_run_modified": again.amp_report["padding"]["padded_ops"] > 0}
    if compile_:
        row.update(_export_and_compile(padded, args))
    return row


def _fx_fp32_mode(module: nn.Module, args: tuple, policy: PadPolicy) -> float:
    from amp_rewrite.fx.capture import capture

    gm = capture(copy.deepcopy(module), args, None, mode="export")
    PadGemms(policy, low=(torch.float32,))(gm)
    with torch.no_grad():
        return max(_rel(a.float().numpy(), b.float().numpy())
                   for a, b in zip(_flat(gm(*args)), _flat(module(*args))))


def _export_and_compile(gm: torch.fx.GraphModule, args: tuple) -> dict:
    with torch.no_grad():
        want = _flat(gm(*args))
        exported = _flat(torch.export.export(gm, args).module()(*args))
        compiled = _flat(torch.compile(gm)(*args))
    return {"export_max_rel": max(_rel(a.float().numpy(), b.float().numpy())
                                  for a, b in zip(exported, want)),
            "compile_max_rel": max(_rel(a.float().numpy(), b.float().numpy())
                                   for a, b in zip(compiled, want))}


# ----------------------------------------------------------------------------- main


def _row(r: dict) -> str:
    grad = f"{r['grad_max_rel_vs_unpadded']:.1e}" if "grad_max_rel_vs_unpadded" in r else "-"
    return (f"{r['model']:<17} {r['path']:<5} {r['dtype']:<4} {r['gemm_flops'] / 1e6:>9.1f} "
            f"{r['aligned_before']:>7.1%} → {r['aligned_after']:>7.1%} "
            f"{r['dense_aligned_after']:>7.1%} "
            f"{r['eligible_aligned']:>7.1%} {r['padded_ops']:>4} "
            f"{r['extra_flop_fraction']:>6.1%} {r['est_speedup']:>5.2f} "
            f"{r['pads']:>3}/{r['slices']:<3} "
            f"{r['pad_slice_between_gemms']:>4} {r['max_rel_vs_unpadded']:>8.1e} "
            f"{r['fp32_mode_max_rel']:>8.1e} {grad:>8} "
            f"{'yes' if r['second_run_modified'] else 'no':>4}")


HEADER = (f"{'model':<17} {'path':<5} {'dt':<4} {'MFLOP':>9} {'aligned before → after':>21} "
          f"{'no-dw':>7} {'elig.':>7} {'ops':>4} {'+FLOP':>6} {'est×':>5} {'P/S':>7} "
          f"{'betw':>4} {'rel':>8} {'fp32rel':>8} {'grad':>8} {'2nd':>4}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(USER + ZOO))
    parser.add_argument("--paths", default="onnx,torch")
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--compile", action="store_true",
                        help="also torch.export and torch.compile the padded user modules")
    parser.add_argument("--no-activation-gemms", action="store_true",
                        help="never pad GEMMs of two activations (attention's token dims)")
    parser.add_argument("--compute-bound", action="store_true",
                        help="cost model with free memory traffic: decide as for large, "
                             "compute-bound shapes (the zoo's widths are tiny)")
    parser.add_argument("--json", default="padding_bench.json")
    args = parser.parse_args(argv)
    policy = PadPolicy(pad_activation_gemms=not args.no_activation_gemms,
                       memory_tbps=math.inf if args.compute_bound else PadPolicy.memory_tbps)
    logging.basicConfig(level=logging.WARNING)
    rows = []
    print(HEADER)
    for name in args.models.split(","):
        module, inputs = build(name)
        for dtype in args.dtypes.split(","):
            for path in args.paths.split(","):
                start = time.perf_counter()
                try:
                    row = (bench_onnx(name, module, inputs, dtype, policy) if path == "onnx"
                           else bench_torch(name, module, inputs, dtype,
                                            args.compile and name in USER, policy))
                except Exception as e:  # noqa: BLE001 - a failed model is a row, not a crash
                    print(f"{name:<17} {path:<5} {dtype:<4} FAILED: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}")
                    rows.append({"model": name, "path": path, "dtype": dtype,
                                 "error": f"{type(e).__name__}: {e}"})
                    continue
                row["seconds"] = round(time.perf_counter() - start, 2)
                rows.append(row)
                print(_row(row), flush=True)
    _summary(rows)
    Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


def _summary(rows: list[dict]) -> None:
    ok = [r for r in rows if "error" not in r]
    for path in ("onnx", "torch"):
        zoo_rows = [r for r in ok if r["path"] == path and r["model"] in ZOO]
        if not zoo_rows:
            continue
        total = sum(r["gemm_flops"] for r in zoo_rows)
        before = sum(r["gemm_flops"] * r["aligned_before"] for r in zoo_rows)
        after = sum(r["gemm_flops"] * r["aligned_after"] for r in zoo_rows)
        dense = sum(r["dense_flops"] for r in zoo_rows)
        dense_before = sum(r["dense_flops"] * r["dense_aligned_before"] for r in zoo_rows)
        dense_after = sum(r["dense_flops"] * r["dense_aligned_after"] for r in zoo_rows)
        print(f"zoo {path}: aligned GEMM/conv FLOPs {_ratio(before, total):.2%} → "
              f"{_ratio(after, total):.2%} (all, {total / 1e6:.1f} MFLOP); without depthwise "
              f"convs {_ratio(dense_before, dense):.2%} → {_ratio(dense_after, dense):.2%} "
              f"({dense / 1e6:.1f} MFLOP); eligible aligned in every row: "
              f"{all(math.isclose(r['eligible_aligned'], 1.0) for r in zoo_rows)}; "
              f"second run changed nothing: "
              f"{not any(r['second_run_modified'] for r in zoo_rows)}")
        left: dict[str, float] = {}
        for r in zoo_rows:
            for why, flops in r["left_misaligned_flops"].items():
                left[why] = left.get(why, 0.0) + flops
        print(f"zoo {path}: misaligned after, share of all GEMM/conv FLOPs by reason: " +
              ", ".join(f"{why} {_ratio(f, total):.2%}"
                        for why, f in sorted(left.items(), key=lambda x: -x[1])))
    extra = [r for r in ok if "compile_max_rel" in r]
    for r in extra:
        print(f"{r['model']} {r['dtype']}: torch.export max rel {r['export_max_rel']:.1e}, "
              f"torch.compile max rel {r['compile_max_rel']:.1e}")
