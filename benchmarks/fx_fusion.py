"""Fusion on the torch path, measured on CPU: kernels per training step, step time, attention.

Four parts (each prints a table; all results go to one JSON file):

* ``accuracy``: every zoo model at bf16 and fp16, ``--seeds`` seeds (weights and inputs),
  RMS relative error vs FP32 (mean and max over seeds) of the fused rewrite (with the
  device's default GEMM emulation), the fused rewrite without emulation, the unfused rewrite
  and ``torch.autocast`` (regions run compiled unless ``AMP_REWRITE_FUSED_BACKEND=eager``;
  compiled regions keep every cast's rounding, so both give the same numbers).
* ``kernels``: compute kernels per training step (forward + loss + backward, one step after
  warm-up, ``torch.profiler`` on CPU, same inputs) of ``amp_rewrite.rewrite`` with fusion
  (Inductor-compiled regions) vs without vs ``torch.autocast`` eager, on zoo configs. A kernel
  is an ATen op event with no ATen compute op below it (allocations and views do not count),
  or one Inductor-generated C++ kernel (``cpp.enable_kernel_profile``); so autocast's own
  casts, hidden inside each op's autocast wrapper, count as the copies they are.
* ``step``: CPU training-step time (median of ``--steps`` after warm-up, all sides
  interleaved round-robin in one process; host load before/after printed) at bf16 on a
  BERT-shaped and a GPT-2-shaped stack (default BERT-base / GPT-2 small: ``--hidden 768
  --heads 12 --layers 4 --seq 128 --batch 8``): rewrite + fusion + ``AmpOptimizer`` with the
  device's default GEMM emulation (``fx/lowering.py``) AND with emulation off (fusion only,
  the same bf16 kernels as autocast), ``torch.autocast`` + ``GradScaler`` eager, FP32 eager,
  ``torch.compile`` of the autocast model; plus the one-time compile seconds of our regions
  and of ``torch.compile``. On CPUs without bf16 GEMM instructions PyTorch's bf16 GEMMs run
  ~150x slower than fp32, so the sides that use them take minutes a step at BERT-base
  shapes: pass smaller shapes, or ``--skip-low-eager`` to time only ours and FP32 there.
* ``attention``: SDPA calls per zoo model (one per attention block expected) and peak forward
  memory at seq 1024 (profiler memory events: the maximum of the running sum of
  allocations and frees)
  of ours vs autocast eager.

Usage: ``python -m benchmarks fx fusion [--parts accuracy,kernels,step,attention]
[--steps 20] [--layers 4] [--seeds 3] [--threads N] [--skip-low-eager] [--json out.json]``.
The run on a small shared machine takes minutes (``step`` dominates); keep other work off
the machine while it runs.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

import amp_rewrite
from amp_rewrite.core.metric import relative_error
from amp_rewrite.fx import pointwise
from amp_rewrite.training import AmpOptimizer
from tests.models import zoo

log = logging.getLogger("bench_fx_fusion")
DTYPE = torch.bfloat16
KERNEL_MODELS = ["bert", "gpt2", "llama", "vit", "t5"]
ATTENTION_MODELS = {"bert": 2, "gpt2": 2, "llama": 2, "vit": 2}  # zoo configs: 2 layers
_NOT_KERNELS = {  # allocations, views and metadata: no pass over memory
    "empty", "empty_like", "empty_strided", "resize_", "view", "_unsafe_view", "reshape",
    "as_strided", "transpose", "t", "permute", "expand", "unsqueeze", "squeeze", "slice",
    "select", "alias", "detach", "_reshape_alias", "unflatten", "flatten", "split",
    "split_with_sizes", "unbind", "narrow", "lift_fresh", "_assert_tensor_metadata",
    "contiguous", "to", "_to_copy", "clone", "lift_fresh_copy", "expand_as", "view_as",
    "result_type", "set_", "zeros_like", "zero_", "fill_", "ones_like", "full",
    "scalar_tensor", "_local_scalar_dense", "item", "is_nonzero", "numpy_T",
    "_has_compatible_shallow_copy_type", "sym_size", "sym_stride", "sym_numel",
    "resolve_conj", "resolve_neg", "dropout",  # dropout's kernel is native_dropout below it
}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _loss(out) -> torch.Tensor:
    return _first(out).float().square().mean()


# --- kernel counting ------------------------------------------------------------------------

def _is_compute(name: str) -> bool:
    if "cpp_fused" in name or "triton_" in name:
        return True
    return name.startswith("aten::") and name[len("aten::"):] not in _NOT_KERNELS


def _kernel_count(events) -> int:
    """Compute events with no compute event below them (see the module docstring)."""
    def has_compute_below(event) -> bool:
        return any(_is_compute(c.name) or has_compute_below(c) for c in event.cpu_children)
    return sum(1 for e in events if _is_compute(e.name) and not has_compute_below(e))


def _profile_step(step) -> int:
    step()  # warm-up: compiles regions, fills caches
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    return _kernel_count(prof.events())


def _train_step(model, args, kwargs, autocast: bool = False):
    params = [p for p in model.parameters() if p.requires_grad]

    def step() -> None:
        for p in params:
            p.grad = None
        with torch.autocast("cpu", dtype=DTYPE, enabled=autocast):
            out = model(*args, **kwargs)
        _loss(out).backward()
    return step


def kernels_part() -> list[dict]:
    import torch._inductor.config as inductor_config
    inductor_config.cpp.enable_kernel_profile = True
    rows = []
    for name in KERNEL_MODELS:
        model = zoo.build(name)
        kw = {"example_kwargs": model.kwargs, "dtype": DTYPE}
        fused = amp_rewrite.rewrite(model.module, model.args, emulate_gemms=None, **kw)
        flat = amp_rewrite.rewrite(model.module, model.args, fuse=False, **kw)
        plain = amp_rewrite.rewrite(model.module, model.args, emulate_gemms=False, **kw)
        eager = copy.deepcopy(model.module)
        row = {"model": name,
               "ours_fused": _profile_step(_train_step(fused, model.args, model.kwargs)),
               "emulated": fused.amp_report["emulated_gemms"].get("kernels", {}),
               "ours_fused_no_emulation": _profile_step(_train_step(plain, model.args,
                                                                    model.kwargs)),
               "ours_unfused": _profile_step(_train_step(flat, model.args, model.kwargs)),
               "autocast_eager": _profile_step(_train_step(eager, model.args, model.kwargs,
                                                           autocast=True)),
               "regions": fused.amp_report["fused"]}
        row["ratio"] = round(row["ours_fused"] / row["autocast_eager"], 3)
        row["ratio_no_emulation"] = round(row["ours_fused_no_emulation"]
                                          / row["autocast_eager"], 3)
        rows.append(row)
        print(f"{name:8s} fused {row['ours_fused']:5d} (no emulation "
              f"{row['ours_fused_no_emulation']:5d})  unfused {row['ours_unfused']:5d}  "
              f"autocast {row['autocast_eager']:5d}  ratio {row['ratio']:.2f} (no emulation "
              f"{row['ratio_no_emulation']:.2f})", flush=True)
    return rows


# --- training-step time ---------------------------------------------------------------------

def _stack(kind: str, shape: argparse.Namespace):
    """A BERT- or GPT-2-shaped stack (BERT-base / GPT-2 small: hidden 768, 12 heads)."""
    import transformers
    if kind == "bert":
        return transformers.BertModel(transformers.BertConfig(
            attn_implementation="eager", vocab_size=8192, hidden_size=shape.hidden,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
            intermediate_size=4 * shape.hidden), add_pooling_layer=False)
    return transformers.GPT2Model(transformers.GPT2Config(
        attn_implementation="eager", vocab_size=8192, n_embd=shape.hidden, n_layer=shape.layers,
        n_head=shape.heads, bos_token_id=0, eos_token_id=0))


class _Hidden(torch.nn.Module):
    """``input_ids`` → last hidden state (a tensor, for export and losses)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.extra = {} if "Bert" in type(model).__name__ else {"use_cache": False}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, **self.extra).last_hidden_state


def _interleaved_medians(steps: dict, count: int) -> dict[str, float]:
    """Median seconds per step of each side, measured round-robin in one process (a busy
    shared host slows every side alike), after two warm-up steps each."""
    for step in steps.values():
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(count):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _ours_step(base: torch.nn.Module, ids: torch.Tensor, emulate: bool | None):
    ours = amp_rewrite.rewrite(copy.deepcopy(base), (ids,), dtype=DTYPE, emulate_gemms=emulate)
    opt = AmpOptimizer(torch.optim.SGD(ours.parameters(), lr=1e-4), dtype=DTYPE)

    def step() -> None:
        opt.zero_grad()
        opt.backward(_loss(ours(ids)))
        opt.step()
    return ours, step


def _first_step_seconds(step) -> tuple[float, float]:
    """(first step's seconds, seconds of it spent compiling our regions)."""
    before = pointwise.compile_stats()["compile_seconds"]
    start = time.perf_counter()
    step()
    return (round(time.perf_counter() - start, 2),
            round(pointwise.compile_stats()["compile_seconds"] - before, 2))


def step_part(steps: int, shape: argparse.Namespace) -> list[dict]:
    """Ours as by default (``emulate_gemms=None``: kernels chosen for this CPU, fx/lowering.py)
    and with the low kernels only (``False``: the same bf16 kernels as autocast),
    autocast + GradScaler eager, FP32 eager,
    torch.compile(autocast): all in one process, interleaved. ``--skip-low-eager`` drops the
    sides that run PyTorch's bf16 GEMMs (autocast, fusion only, compiled autocast) where those
    take minutes a step."""
    rows = []
    for kind in ("bert", "gpt2"):
        torch.manual_seed(0)
        base = _Hidden(_stack(kind, shape)).train()
        for module in base.modules():  # dropout off: the same math on every side
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        ids = torch.randint(0, 8192, (shape.batch, shape.seq),
                            generator=torch.Generator().manual_seed(1))
        row = {"model": f"{kind} (hidden {shape.hidden}, {shape.heads} heads, {shape.layers} "
                        f"layers, seq {shape.seq}, batch {shape.batch})",
               "load_before": os.getloadavg()[0]}
        sides = {}
        ours, sides["ours_default"] = _ours_step(base, ids, None)
        row["emulated_gemms"] = ours.amp_report["emulated_gemms"]
        row["ours_regions"] = ours.amp_report["fused"]
        row["ours_first_step_s"], row["ours_region_compile_s"] = _first_step_seconds(
            sides["ours_default"])
        sides["fp32_eager"] = _eager_step(copy.deepcopy(base), ids, False)
        if not shape.skip_low_eager:
            _, sides["ours_low_kernels"] = _ours_step(base, ids, False)
            row["ours_low_kernels_first_step_s"], _ = _first_step_seconds(
                sides["ours_low_kernels"])
            sides["autocast_eager"] = _eager_step(copy.deepcopy(base), ids, True)
            compiled = _eager_step(torch.compile(copy.deepcopy(base)), ids, True)
            start = time.perf_counter()
            compiled()
            row["compile_first_step_s"] = round(time.perf_counter() - start, 2)
            sides["compiled_autocast"] = compiled
        row.update({f"{k}_s": round(v, 4) for k, v in _interleaved_medians(sides, steps).items()})
        row["load_after"] = os.getloadavg()[0]
        if "autocast_eager_s" in row:
            for side in ("ours_default", "ours_low_kernels"):
                row[f"speedup_{side}"] = round(row["autocast_eager_s"] / row[f"{side}_s"], 3)
        rows.append(row)
        print(_step_line(row), flush=True)
    return rows


def _step_line(row: dict) -> str:
    parts = [f"{k.removesuffix('_s')} {row[k]:.3f}s" for k in row
             if k.endswith("_s") and not k.endswith("first_step_s")
             and not k.endswith("compile_s")]
    ratios = [f"{k.removeprefix('speedup_')} {row[k]:.2f}x vs autocast" for k in row
              if k.startswith("speedup_")]
    return (f"{row['model']}: " + "  ".join(parts + ratios)
            + f"  (our regions compile {row['ours_region_compile_s']}s"
            + (f", torch.compile first step {row['compile_first_step_s']}s"
               if "compile_first_step_s" in row else "")
            + f"; load {row['load_before']:.1f} -> {row['load_after']:.1f})")


def _eager_step(model, ids, autocast: bool):
    sgd = torch.optim.SGD(model.parameters(), lr=1e-4)
    scaler = torch.amp.GradScaler("cpu", enabled=autocast)

    def step() -> None:
        sgd.zero_grad()
        with torch.autocast("cpu", dtype=DTYPE, enabled=autocast):
            out = model(ids)
        scaler.scale(_loss(out)).backward()
        scaler.step(sgd)
        scaler.update()
    return step


# --- attention ------------------------------------------------------------------------------

def _peak_forward_bytes(run) -> int:
    run()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        run()
    memory = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in memory:  # allocations positive, frees negative
        live += nbytes
        peak = max(peak, live)
    return peak


def _long_text_model(kind: str):
    """A small (hidden 64, 2 layers) eager-attention model that takes 1024 tokens."""
    import transformers
    small = {"attn_implementation": "eager", "hidden_size": 64, "num_attention_heads": 4,
             "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 512,
             "max_position_embeddings": 1024}
    if kind == "bert":
        model = transformers.BertModel(transformers.BertConfig(**small),
                                       add_pooling_layer=False)
    elif kind == "llama":
        model = transformers.LlamaModel(transformers.LlamaConfig(num_key_value_heads=2,
                                                                 **small))
    else:
        model = transformers.GPT2Model(transformers.GPT2Config(
            attn_implementation="eager", n_embd=64, n_head=4, n_layer=2, n_positions=1024,
            vocab_size=512, bos_token_id=0, eos_token_id=0))
    return _Hidden(model).eval()


def attention_part() -> list[dict]:
    rows = []
    for name, layers in ATTENTION_MODELS.items():
        model = zoo.build(name)
        gm = amp_rewrite.rewrite(model.module, model.args, example_kwargs=model.kwargs,
                                 dtype=DTYPE)
        sdpa = sum(1 for n in gm.graph.nodes
                   if n.target is torch.ops.aten.scaled_dot_product_attention.default)
        softmax = sum(1 for n in gm.graph.nodes if "softmax" in str(n.target))
        row = {"model": name, "attention_blocks": layers, "sdpa_calls": sdpa,
               "softmax_left": softmax}
        if name in ("bert", "gpt2", "llama"):
            long = _long_text_model(name)
            ids = torch.randint(0, 512, (2, 1024), generator=torch.Generator().manual_seed(0))
            ours = amp_rewrite.rewrite(long, (ids,), dtype=DTYPE)
            with torch.no_grad():
                row["peak_ours_mib"] = _peak_forward_bytes(lambda: ours(ids)) / 2**20

                def autocast_run() -> None:
                    with torch.autocast("cpu", dtype=DTYPE):
                        long(ids)
                row["peak_autocast_mib"] = _peak_forward_bytes(autocast_run) / 2**20
            row["peak_ratio"] = round(row["peak_ours_mib"] / row["peak_autocast_mib"], 3)
        rows.append(row)
        extra = (f"  peak fwd @seq1024 ours {row['peak_ours_mib']:.1f} MiB vs autocast "
                 f"{row['peak_autocast_mib']:.1f} MiB ({row['peak_ratio']:.2f}x)"
                 if "peak_ratio" in row else "")
        print(f"{name:6s} attention blocks {layers}  SDPA calls {sdpa}  softmax left "
              f"{softmax}{extra}", flush=True)
    return rows


# --- accuracy -------------------------------------------------------------------------------

def _relative_errors(out, ref: torch.Tensor) -> tuple[float, float]:
    """(the product's metric, ``amp_rewrite.core.metric``; ||diff|| / ||ref||) of the first
    output."""
    got = _first(out).float()
    return (relative_error(ref.detach().cpu().numpy(), got.detach().cpu().numpy()),
            ((got - ref).norm() / ref.norm()).item())


_ACCURACY_SIDES = {"fused": {"emulate_gemms": None},  # emulated where the CPU needs it
                   "fused_no_emulation": {"emulate_gemms": False},
                   "unfused": {"fuse": False}}


def _seeded(name: str, seeds: int) -> list:
    """The zoo model with weights and inputs from each seed."""
    return [zoo.build(name, seed=seed) for seed in range(seeds)]


def _errors_over_seeds(run, models) -> list[float]:
    """RMS relative error vs FP32 of ``run(model)`` for each seeded model."""
    errors = []
    for model in models:
        with torch.no_grad():
            ref = _first(model.run()).float()
            errors.append(_relative_errors(run(model), ref)[1])
    return errors


def _rewritten_runner(models, dtype: torch.dtype, options: dict):
    """One rewrite (seed 0's capture), each seed's weights loaded into it."""
    gm = amp_rewrite.rewrite(models[0].module, models[0].args,
                             example_kwargs=models[0].kwargs, dtype=dtype, **options)

    def run(model):
        gm.load_state_dict(model.module.state_dict())
        return gm(*model.args, **model.kwargs)
    return run


def accuracy_part(seeds: int, names: list[str]) -> list[dict]:
    """Every zoo model, bf16 and fp16, ``seeds`` seeds: RMS relative error vs FP32 (mean and
    max over seeds) of the fused rewrite (GEMM emulation as the device default), the fused
    rewrite without GEMM emulation, the unfused rewrite and torch.autocast."""
    rows = []
    for name in names:
        models = _seeded(name, seeds)
        for dtype in (torch.bfloat16, torch.float16):
            row = {"model": name, "dtype": str(dtype).removeprefix("torch."), "seeds": seeds}
            for label, options in _ACCURACY_SIDES.items():
                row[label] = _errors_over_seeds(_rewritten_runner(models, dtype, options),
                                                models)

            def autocast_run(model, dtype=dtype):
                with torch.autocast("cpu", dtype=dtype):
                    return model.module(*model.args, **model.kwargs)
            row["autocast"] = _errors_over_seeds(autocast_run, models)
            row["summary"] = {k: {"mean": statistics.mean(row[k]), "max": max(row[k])}
                              for k in (*_ACCURACY_SIDES, "autocast")}
            for side in ("fused", "fused_no_emulation"):
                floor = min(row["summary"]["unfused"]["mean"],
                            row["summary"]["autocast"]["mean"])
                row[f"{side}_ratio"] = round(row["summary"][side]["mean"] / floor, 3)
            rows.append(row)
            print(f"{name:16s} {row['dtype']:8s} " + "  ".join(
                f"{k} {v['mean']:.2e}/{v['max']:.2e}" for k, v in row["summary"].items())
                + f"  fused/min(unfused,autocast) {row['fused_ratio']:.3f}"
                f"  no-emulation {row['fused_no_emulation_ratio']:.3f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="kernels,step,attention")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--skip-low-eager", action="store_true",
                        help="step: only ours (fusion + GEMM emulation) and FP32 eager; for "
                             "shapes where PyTorch's bf16 GEMMs take minutes a step")
    parser.add_argument("--seeds", type=int, default=3,
                        help="accuracy: weights and inputs drawn from this many seeds")
    parser.add_argument("--models", default=",".join(zoo.NAMES),
                        help="accuracy: zoo models, comma-separated")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", default="fx_fusion.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                     "dtype": str(DTYPE), "cpus": os.cpu_count(),
                     "native_bf16_gemm": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                     "load_at_start": os.getloadavg()}
    parts = args.parts.split(",")
    if "accuracy" in parts:
        print("== RMS relative error vs FP32, mean/max over seeds: fused (+ the device's default "
              "GEMM emulation), fused without emulation, unfused, autocast ==")
        results["accuracy"] = accuracy_part(args.seeds, args.models.split(","))
    if "attention" in parts:
        print("== attention: SDPA calls and peak forward memory at seq 1024 ==")
        results["attention"] = attention_part()
    if "kernels" in parts:
        print("== kernels per training step (forward + backward), CPU profiler ==")
        results["kernels"] = kernels_part()
    if "step" in parts:
        print(f"== CPU training-step time, median of {args.steps} ==")
        results["step"] = step_part(args.steps, args)
    results["region_compiles"] = pointwise.compile_stats()
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {args.json}")
    return 0
