"""Training-step time and peak memory on a GPU: FP32 vs torch.autocast + GradScaler vs
amp_rewrite (rewritten graph + AmpOptimizer), each with and without ``torch.compile``.

Models (random weights from ``transformers`` configs, no download), trained on random data:
* BERT-base sequence classification, batch 32 x 128 tokens;
* GPT-2 small language modelling, batch 8 x 512 tokens;
* ResNet-50 image classification, batch 64 x 3 x 224 x 224.

Every variant starts from the same weights and uses ``AdamW`` (fused where the device has it).
A step is forward, loss, backward and optimizer step; the time is the median over ``--steps``
steps after ``--warmup`` steps (compilation happens in the warm-up), with a device
synchronisation around each step. Peak memory is ``torch.cuda.max_memory_allocated`` over the
measured steps.

Without CUDA it says so and exits 0. ``--device cpu --tiny`` runs the same code on tiny
configs (a smoke test of the script, not a benchmark).

    PYTHONPATH=. python tools/bench_gpu_training.py [--models bert gpt2 resnet50]
        [--dtype fp16|bf16] [--steps 20] [--warmup 5] [--no-compile]
        [--out results/bench_gpu_training.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F  # noqa: N812

import amp_rewrite
from amp_rewrite.training import AmpOptimizer

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
VARIANTS = ("fp32", "autocast", "amp_rewrite")


@dataclass
class Workload:
    """A model returning logits, its example inputs, and the loss on those logits."""

    name: str
    module: torch.nn.Module
    inputs: tuple
    loss: Callable[[torch.Tensor], torch.Tensor]


class _Logits(torch.nn.Module):
    """Calls a transformers model with return_dict=False and returns its logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, return_dict=False)[0]


def build(name: str, tiny: bool, device: torch.device) -> Workload:
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "bert":
        cfg = tf.BertConfig(num_labels=2, **(_TINY_TEXT if tiny else {}))
        batch, seq = (2, 16) if tiny else (32, 128)
        module = tf.BertForSequenceClassification(cfg)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        labels = torch.randint(0, 2, (batch,), generator=g).to(device)
        loss = lambda logits: F.cross_entropy(logits.float(), labels)  # noqa: E731
    elif name == "gpt2":
        cfg = tf.GPT2Config(use_cache=False, **(_TINY_GPT2 if tiny else {}))
        batch, seq = (2, 16) if tiny else (8, 512)
        module = tf.GPT2LMHeadModel(cfg)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        targets = x[:, 1:].to(device)
        loss = lambda logits: F.cross_entropy(  # noqa: E731
            logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    elif name == "resnet50":
        cfg = tf.ResNetConfig(**(_TINY_RESNET if tiny else {}))  # defaults: ResNet-50
        batch, size = (2, 32) if tiny else (64, 224)
        module = tf.ResNetForImageClassification(cfg)
        x = torch.randn(batch, 3, size, size, generator=g)
        labels = torch.randint(0, cfg.num_labels, (batch,), generator=g).to(device)
        loss = lambda logits: F.cross_entropy(logits.float(), labels)  # noqa: E731
    else:
        raise ValueError(name)
    return Workload(name, _Logits(module).to(device).train(), (x.to(device),), loss)


_TINY_TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "vocab_size": 128}
_TINY_GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 64}
_TINY_RESNET = {"embedding_size": 8, "hidden_sizes": [16, 32], "depths": [1, 1],
                "num_labels": 10}


def make_step(variant: str, work: Workload, dtype: torch.dtype, compile_: bool,
              device: torch.device, fuse: bool = True) -> Callable[[], None]:
    """One training step of ``variant`` on its own copy of the model and optimizer."""
    module = copy.deepcopy(work.module)
    if variant == "amp_rewrite":
        module = amp_rewrite.rewrite(module, work.inputs, dtype=dtype, fuse=fuse)
    model = torch.compile(module) if compile_ else module
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=fused)
    if variant == "fp32":
        def step() -> None:
            work.loss(model(*work.inputs)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    elif variant == "autocast":
        scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

        def step() -> None:
            with torch.autocast(device.type, dtype=dtype):
                logits = model(*work.inputs)
            scaler.scale(work.loss(logits)).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    else:
        amp = AmpOptimizer(optimizer, dtype=dtype)

        def step() -> None:
            amp.backward(work.loss(model(*work.inputs)))
            amp.step()
            amp.zero_grad()
    return step


def measure(step: Callable[[], None], device: torch.device, warmup: int,
            steps: int) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    sync()
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"step_ms": 1000 * statistics.median(times), "peak_mib": peak and peak / 2**20,
            "warmup_s": warmup_s}


def run_all(args: argparse.Namespace, device: torch.device) -> list[dict]:
    rows = []
    compiles = [False] if args.no_compile else [False, True]
    for name in args.models:
        work = build(name, args.tiny, device)
        for compile_ in compiles:
            for variant in VARIANTS:
                row = {"model": name, "variant": variant, "compile": compile_,
                       "dtype": args.dtype, "fuse": args.fuse == "on"}
                try:
                    step = make_step(variant, work, DTYPES[args.dtype], compile_, device,
                                     fuse=args.fuse == "on")
                    row.update(measure(step, device, args.warmup, args.steps))
                except torch.cuda.OutOfMemoryError:
                    row["error"] = "out of memory"
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                rows.append(row)
                print(_format(row), flush=True)
    return rows


def _format(row: dict) -> str:
    head = f"{row['model']:9s} {row['variant']:12s} {'compiled' if row['compile'] else 'eager':9s}"
    if "error" in row:
        return f"{head} {row['error']}"
    peak = f"{row['peak_mib']:10.0f}" if row["peak_mib"] is not None else f"{'n/a':>10s}"
    return f"{head} {row['step_ms']:10.2f} {peak}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2", "resnet50"],
                        choices=["bert", "gpt2", "resnet50"])
    parser.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--fuse", default="on", choices=["on", "off"],
                        help="amp_rewrite.rewrite(fuse=...): pattern and pointwise fusion")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny configs (smoke test)")
    parser.add_argument("--out", default="results/bench_gpu_training.json")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: this benchmark needs a GPU; nothing was measured.")
        return 0
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    device = torch.device(args.device)
    print(f"{'model':9s} {'variant':12s} {'mode':9s} {'step ms':>10s} {'peak MiB':>10s}")
    rows = run_all(args, device)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else platform.processor() or platform.machine(),
            "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
