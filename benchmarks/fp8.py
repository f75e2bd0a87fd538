"""FP8 GEMM training step on a GPU: our bf16 rewrite vs our FP8 rewrite vs autocast vs torchao.

Workloads (random weights from ``transformers`` configs, seeded random tokens, LM loss):
* ``llama``: 2 Llama decoder layers, hidden 4096, FFN 14336, 32 heads / 8 KV heads, vocabulary
  32000, batch 8 x 2048 tokens;
* ``gpt2``: GPT-2 small, batch 8 x 512 tokens.

Variants, each compiled with ``torch.compile`` and stepped with fused ``AdamW`` on FP32
weights: ``bf16_rewrite`` (``amp_rewrite.rewrite(dtype=bf16)`` + ``AmpOptimizer``),
``fp8_tensorwise`` / ``fp8_rowwise`` (the same with ``fp8=...``), ``autocast_bf16_compiled``,
``torchao_tensorwise`` / ``torchao_rowwise`` (``torchao.float8.convert_to_float8_training``
with that recipe under bf16 autocast, Linear layers whose dims are multiples of 16; skipped,
with the reason, without torchao). A step is forward, loss, backward and optimizer step; ``ms``
is the median over ``--steps`` steps after ``--warmup`` (compilation happens there),
``peak_mib`` ``torch.cuda.max_memory_allocated`` over them, ``loss0`` the first step's loss
(same weights and data everywhere). FP8 rows list every GEMM's choice from the report.

Rows are appended to ``--json`` as they finish; a variant that fails records its error and
the run goes on. ``--device cpu --tiny`` runs tiny configs with ``fp8_min_size=0`` (every GEMM
in FP8): a smoke test of the script, not a benchmark.

    python -m benchmarks fp8 [--models llama gpt2] [--variants ...] [--steps 10]
        [--warmup 3] [--device cuda|cpu] [--tiny] [--json results/bench_fp8.json]
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

import amp_rewrite
from amp_rewrite.training import AmpOptimizer
from benchmarks.gpu_training import _Logits, measure
from benchmarks.timing import add_same_process_flag, rows_in_fresh_process

MODELS = ("llama", "gpt2")
VARIANTS = ("bf16_rewrite", "fp8_tensorwise", "fp8_rowwise", "autocast_bf16_compiled",
            "torchao_tensorwise", "torchao_rowwise")
_OURS = {"bf16_rewrite": None, "fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise"}
_SHAPES = {  # (config, batch, tokens); tiny: the same architectures, a few hundred weights
    "llama": ({"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
               "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000},
              8, 2048),
    "gpt2": ({}, 8, 512),
}
_TINY = {"llama": ({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128},
                   2, 16),
         "gpt2": ({"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128,
                   "n_positions": 64}, 2, 16)}


def build(name: str, tiny: bool, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    """The LM with seeded random weights and a batch of seeded random tokens."""
    import transformers as tf

    config, batch, tokens = (_TINY if tiny else _SHAPES)[name]
    torch.manual_seed(0)
    if name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(use_cache=False, **config))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(use_cache=False, **config))
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens),
                        generator=torch.Generator().manual_seed(0))
    return _Logits(model).to(device).train(), ids.to(device)


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                           ids[:, 1:].reshape(-1))


def _torchao(module: torch.nn.Module, recipe: str) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def aligned(mod: torch.nn.Module, fqn: str) -> bool:
        return mod.in_features % 16 == 0 and mod.out_features % 16 == 0
    return convert_to_float8_training(
        module, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=aligned)


def prepare(variant: str, module: torch.nn.Module, ids: torch.Tensor, tiny: bool
            ) -> tuple[Callable[[], torch.Tensor], dict]:
    """``variant``'s training step on its own copy of ``module``, and what to record."""
    module, info = copy.deepcopy(module), {}
    start = time.perf_counter()
    if variant in _OURS:
        fp8 = _OURS[variant]
        options = {"fp8": fp8, "fp8_min_size": 0 if tiny else None} if fp8 else {}
        module = amp_rewrite.rewrite(module, (ids,), dtype=torch.bfloat16, **options)
        info["fp8"] = module.amp_report["fp8"]
    elif variant.startswith("torchao_"):
        module = _torchao(module, variant.removeprefix("torchao_"))
    info["prep_s"] = round(time.perf_counter() - start, 3)
    model = torch.compile(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4,
                                  fused=ids.device.type == "cuda")
    autocast = variant not in _OURS
    amp = None if autocast else AmpOptimizer(optimizer, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids)
        loss = lm_loss(logits, ids)
        if amp is None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            amp.backward(loss)
            amp.step()
            amp.zero_grad()
        return loss
    return step, info


def run_variant(name: str, variant: str, module: torch.nn.Module, ids: torch.Tensor,
                args: argparse.Namespace) -> dict:
    row = {"model": name, "variant": variant, "tokens": ids.numel()}
    if variant.startswith("torchao_"):
        try:
            import torchao.float8  # noqa: F401
        except ImportError as e:
            return {**row, "skipped": f"torchao not importable: {e}"}
    try:
        step, info = prepare(variant, module, ids, args.tiny)
        torch.manual_seed(0)  # the same dropout masks in every variant's first step
        loss0 = step().item()
        row.update(loss0=round(loss0, 5), **measure(step, ids.device, args.warmup, args.steps),
                   **info)
    except Exception as e:  # noqa: BLE001 - the run goes on; the row says what failed
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        step = None
        gc.collect()
        torch._dynamo.reset()
        if ids.device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _format(row: dict, base: float | None) -> str:
    head = f"{row['model']:6} {row['variant']:24}"
    if "ms" not in row:
        return f"{head} {row.get('skipped') or row.get('error')}"
    counts = row.get("fp8", {}).get("counts", {})
    peak = f"{row['peak_mib']:9.0f}" if row.get("peak_mib") else f"{'-':>9}"
    speedup = f"{base / row['ms']:6.2f}x" if base else f"{'-':>7}"
    return (f"{head} {row['ms']:9.2f} {speedup} {peak} {row['loss0']:9.4f}  "
            f"{' '.join(f'{k}={v}' for k, v in sorted(counts.items()))}")


def _save(path: Path | None, rows: list[dict], args: argparse.Namespace,
          device: torch.device) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks fp8",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (smoke test)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the rows here")
    add_same_process_flag(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing measured (--device cpu --tiny for a smoke test)")
        return 0
    rows: list[dict] = []
    print(f"{'model':6} {'variant':24} {'step ms':>9} {'vs bf16':>7} {'peak MiB':>9} "
          f"{'loss0':>9}  GEMMs")
    for name in args.models:
        module, ids = build(name, args.tiny, device) if args.same_process else (None, None)
        base = None
        for variant in args.variants:
            if args.same_process:
                row = run_variant(name, variant, module, ids, args)
            else:
                row, = rows_in_fresh_process(
                    ["fp8", "--same-process", "--models", name, "--variants", variant,
                     "--steps", str(args.steps), "--warmup", str(args.warmup),
                     "--device", args.device, *(["--tiny"] if args.tiny else [])],
                    {"model": name, "variant": variant})
            rows.append(row)
            if variant == "bf16_rewrite" and "ms" in row:
                base = row["ms"]
            elif base and "ms" in row:
                row["speedup_vs_bf16_rewrite"] = round(base / row["ms"], 3)
            print(_format(row, base if variant != "bf16_rewrite" else None), flush=True)
            _save(args.json, rows, args, device)
        del module
    return 0
