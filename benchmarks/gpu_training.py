"""Training-step and forward time and peak memory on a GPU: FP32 vs torch.autocast + GradScaler
vs amp_rewrite (rewritten graph + AmpOptimizer), eager and under ``torch.compile``.

Models (random weights from ``transformers`` configs, no download), on random data:
* ``bert``: BERT-base sequence classification, batch 32 x 128 tokens;
* ``bert_4l``: the same with 4 layers, batch 8 x 128 tokens (the CPU step);
* ``gpt2``: GPT-2 small language modelling, batch 8 x 512 tokens (vocabulary 50257: the LM
  head's N is misaligned);
* ``llama``: a Llama-shaped decoder of ~100M parameters (hidden 768, 12 layers, 12 heads,
  FFN 2048, vocabulary 32000), language modelling, batch 8 x 512 tokens;
* ``resnet50``: ResNet-50 image classification, batch 64 x 3 x 224 x 224 (3-channel stem);
* ``mlp_odd``: Linear 4095 -> 11007 -> GELU -> 4095 on 16 x 512 tokens (every GEMM dim
  misaligned; the padding workload);
* ``t5_hot``: the zoo's small T5 (tests/models/hot.py ``hot_variant("t5", 3e5)``) whose FFN
  intermediates reach 3e5, as trained T5 checkpoints' do, beyond fp16's range; dropout off,
  the copy task of tests/training/test_mixed_training.py on batch 8 x 16 tokens (decoder 8).
  It is small either way, so ``--tiny`` builds the same model.

Variants: ``fp32``; ``autocast`` (+ GradScaler for fp16); ``autocast_fp16`` (autocast fp16 +
GradScaler whatever ``--dtype`` says: the fp16 peer of ``--dtype mixed``); ``amp_rewrite``
(the defaults: fusion on, padding on for CUDA); ``amp_rewrite_nofuse`` (``fuse=False``);
``amp_rewrite_nopad`` (``pad=False``); ``backend`` (``amp_rewrite.compile``: the
``torch.compile`` backend on the user's module, with ``AmpOptimizer``) and
``backend_gradscaler`` (the backend with ``torch.amp.GradScaler``) and ``backend_low_io`` (the
backend with ``keep_io_types=False``: the logits come back low, as autocast returns them), which
are always compiled and compare with ``autocast`` compiled. Every variant starts from the same weights and uses
``AdamW(fused=True)`` (CUDA and CPU kernels). A training step is forward, loss, backward and
optimizer step; a forward is one call under ``torch.no_grad()``. Times are medians over
``--steps`` calls after ``--warmup`` calls (compilation happens in the warm-up), with a device
synchronisation around each. Peak memory is ``torch.cuda.max_memory_allocated`` over the
measured calls. ``prep_s`` is the rewrite time (amp_rewrite) before any warm-up; ``loss0`` the
first step's loss (same weights and data in every variant: a sanity check against FP32).
``sync_free`` says whether the optimizer update (``AmpOptimizer.step()`` or
``GradScaler.step`` + ``update``) ran under ``torch.cuda.set_sync_debug_mode("error")`` without a
host synchronisation; ``recompiles`` counts graphs dynamo compiled after warm-up.
``inductor_mb`` is Inductor's own estimate of the bytes its kernels read and write in one
training step (``GraphLowering.count_bytes``, summed over the forward and backward graphs
compiled in the first step, with Inductor's caches off so nothing is loaded instead of
compiled): a device-independent count of memory traffic. It covers compiled code only, not
eager code around it (the loss, and autocast's eager ``.float()`` copy of the logits).

``--dtype mixed``: the amp_rewrite variants rewrite with ``dtype="mixed"`` (each node fp16,
bf16 or fp32; ``AmpOptimizer`` scales the loss where fp16 nodes exist), while ``autocast`` runs
bf16, the peer that trains such a model at all; ``autocast_fp16`` is there for its skipped steps
(on ``t5_hot`` its forward overflows: every step is skipped and its time is not comparable).
``skipped`` counts the optimizer steps skipped for Inf/NaN gradients over every step of the
variant (the first, warm-up and measured ones, and on CUDA the sync check's), out of
``updates``: ``AmpOptimizer``'s counter, or for GradScaler the steps whose inf checks found
Inf/NaN (the optimizer step skipped).

Rows are appended to ``--out`` as they finish (a killed run keeps what it measured). Without
CUDA it says so and exits 0; ``--device cpu --tiny`` runs the same code on tiny configs (a
smoke test of the script, not a benchmark).

    python -m benchmarks gpu train [--models bert gpt2 resnet50 mlp_odd]
        [--variants ...] [--dtype fp16|bf16|mixed] [--compile off|on|both]
        [--phases train forward] [--steps 20] [--warmup 5]
        [--json results/bench_gpu_training.json]
"""
from __future__ import annotations

import argparse
import contextlib
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
from amp_rewrite.fx import kernel_timing
from amp_rewrite.training import AmpOptimizer
from benchmarks.timing import add_same_process_flag, rows_in_fresh_process

# "mixed" is no torch dtype: amp_rewrite takes it as it is; autocast runs bf16 then
# (_autocast_dtype)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "mixed": "mixed"}
VARIANTS = ("fp32", "autocast", "autocast_fp16", "amp_rewrite", "amp_rewrite_nofuse",
            "amp_rewrite_nopad", "backend", "backend_gradscaler", "backend_low_io")
BACKEND_OPTIONS = {"backend": {}, "backend_gradscaler": {},
                   "backend_low_io": {"keep_io_types": False}}
# CPU shapes: 4 layers, batch 8 x 128 tokens (ViT: 8 images of 224 x 224, 197 tokens), at
# two widths: the models users fine-tune on CPUs, and where per-kernel overhead differs most
CPU_FAMILIES = ("bert", "gpt2", "llama", "vit")
CPU_WIDTHS = (256, 768)
CPU_MODELS = tuple(f"{family}_4l_h{width}" for family in CPU_FAMILIES for width in CPU_WIDTHS)
MODELS = ("bert", "bert_4l", "gpt2", "llama", "resnet50", "mlp_odd", "t5_hot", *CPU_MODELS)
AUTOCAST_VARIANTS = ("autocast", "autocast_fp16")
# autocast_fp16 only matters with --dtype mixed (with fp16 it repeats autocast): asked for
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "autocast_fp16")
REWRITE_OPTIONS = {"amp_rewrite": {}, "amp_rewrite_nofuse": {"fuse": False},
                   "amp_rewrite_nopad": {"pad": False}}


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


def _text(name: str, tiny: bool, g: torch.Generator, device: torch.device
          ) -> tuple[torch.nn.Module, torch.Tensor, Callable]:
    import transformers as tf

    if name in ("bert", "bert_4l"):
        layers = {"num_hidden_layers": 4} if name == "bert_4l" else {}
        cfg = tf.BertConfig(num_labels=2, **(_TINY_TEXT if tiny else layers))
        batch, seq = (2, 16) if tiny else (8 if name == "bert_4l" else 32, 128)
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
        labels = torch.randint(0, 2, (batch,), generator=g).to(device)
        return (_Logits(tf.BertForSequenceClassification(cfg)), x,
                lambda logits: F.cross_entropy(logits.float(), labels))
    if name == "llama":
        cfg = tf.LlamaConfig(use_cache=False, **(_TINY_LLAMA if tiny else _LLAMA_100M))
        model = tf.LlamaForCausalLM(cfg)
    else:
        cfg = tf.GPT2Config(use_cache=False, **(_TINY_GPT2 if tiny else {}))
        model = tf.GPT2LMHeadModel(cfg)
    batch, seq = (2, 16) if tiny else (8, 512)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    targets = x[:, 1:].to(device)
    return (_Logits(model), x, lambda logits: F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1)))


def _cpu_model(name: str, tiny: bool, g: torch.Generator, device: torch.device
               ) -> tuple[torch.nn.Module, torch.Tensor, Callable]:
    """``{family}_4l_h{width}``: a default-config model of that family (dropout on), 4
    layers of that width, heads of 64, FFN 4x (Llama: its own ~8/3x, 688 or 2048)."""
    import transformers as tf

    family, _, width = name.split("_")
    hidden = 32 if tiny else int(width.removeprefix("h"))
    heads, layers = max(1, hidden // 64), 2 if tiny else 4
    ffn = {256: 688, 768: 2048}.get(hidden, 2 * hidden) if family == "llama" else 4 * hidden
    batch = 2 if tiny else 8
    if family == "vit":
        cfg = tf.ViTConfig(hidden_size=hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, intermediate_size=ffn, num_labels=1000,
                           image_size=32 if tiny else 224, patch_size=16)
        x = torch.randn(batch, 3, cfg.image_size, cfg.image_size, generator=g)
        labels = torch.randint(0, cfg.num_labels, (batch,), generator=g).to(device)
        return (_Logits(tf.ViTForImageClassification(cfg)), x,
                lambda logits: F.cross_entropy(logits.float(), labels))
    if family == "bert":
        cfg = tf.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_labels=2,
                            num_attention_heads=heads, intermediate_size=ffn)
        model = tf.BertForSequenceClassification(cfg)
    elif family == "gpt2":
        cfg = tf.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, n_inner=ffn,
                            use_cache=False)
        model = tf.GPT2LMHeadModel(cfg)
    else:
        cfg = tf.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, use_cache=False,
                             num_attention_heads=heads, intermediate_size=ffn)
        model = tf.LlamaForCausalLM(cfg)
    x = torch.randint(0, cfg.vocab_size, (batch, 16 if tiny else 128), generator=g)
    if family == "bert":
        labels = torch.randint(0, 2, (batch,), generator=g).to(device)
        return _Logits(model), x, lambda logits: F.cross_entropy(logits.float(), labels)
    targets = x[:, 1:].to(device)
    return (_Logits(model), x, lambda logits: F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1)))


def _resnet(tiny: bool, g: torch.Generator, device: torch.device
            ) -> tuple[torch.nn.Module, torch.Tensor, Callable]:
    import transformers as tf

    cfg = tf.ResNetConfig(**(_TINY_RESNET if tiny else {}))  # defaults: ResNet-50
    batch, size = (2, 32) if tiny else (64, 224)
    x = torch.randn(batch, 3, size, size, generator=g)
    labels = torch.randint(0, cfg.num_labels, (batch,), generator=g).to(device)
    return (_Logits(tf.ResNetForImageClassification(cfg)), x,
            lambda logits: F.cross_entropy(logits.float(), labels))


def _mlp_odd(tiny: bool, g: torch.Generator) -> tuple[torch.nn.Module, torch.Tensor, Callable]:
    width, hidden, tokens = (15, 37, 8) if tiny else (4095, 11007, 16 * 512)
    module = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                 torch.nn.Linear(hidden, width))
    x = torch.randn(tokens, width, generator=g)
    return module, x, lambda out: out.float().square().mean()


def _t5_hot(device: torch.device) -> tuple[torch.nn.Module, tuple, Callable]:
    """The hot T5 of tests/training/test_mixed_training.py, its first batch and its loss."""
    from tests.models.hot import hot_variant

    module = hot_variant("t5", target=3e5).module
    for m in module.modules():  # dropout off, as in the test: every variant, one function
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    gen = torch.Generator().manual_seed(1)  # the test's first batch: decoder copies 8 tokens
    ids = torch.randint(1, 128, (8, 16), generator=gen)
    decoder_ids = torch.randint(1, 128, (8, 8), generator=gen)
    labels = ids[:, :8].to(device)
    inputs = (ids, torch.ones(8, 16, dtype=torch.long), decoder_ids)
    return module, inputs, lambda logits: F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


def build(name: str, tiny: bool, device: torch.device) -> Workload:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "t5_hot":  # several inputs; small at any setting
        module, inputs, loss = _t5_hot(device)
        return Workload(name, module.to(device).train(),
                        tuple(x.to(device) for x in inputs), loss)
    if name in ("bert", "bert_4l", "gpt2", "llama"):
        module, x, loss = _text(name, tiny, g, device)
    elif name == "resnet50":
        module, x, loss = _resnet(tiny, g, device)
    elif name == "mlp_odd":
        module, x, loss = _mlp_odd(tiny, g)
    elif name in CPU_MODELS:
        module, x, loss = _cpu_model(name, tiny, g, device)
    else:
        raise ValueError(name)
    return Workload(name, module.to(device).train(), (x.to(device),), loss)


_TINY_TEXT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "vocab_size": 128}
_TINY_GPT2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "vocab_size": 128, "n_positions": 64}
_TINY_LLAMA = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
               "intermediate_size": 64, "vocab_size": 128}
_LLAMA_100M = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
               "intermediate_size": 2048, "vocab_size": 32000}
_TINY_RESNET = {"embedding_size": 8, "hidden_sizes": [16, 32], "depths": [1, 1],
                "num_labels": 10}


@dataclass
class Prepared:
    """One variant's model, its training step (``backward`` then ``update``) and its forward."""

    model: Callable[..., torch.Tensor]
    backward: Callable[[], torch.Tensor]  # forward, loss, backward; returns the loss
    update: Callable[[], None]  # optimizer step (unscale, skip, scale update) and zero_grad
    forward: Callable[[], torch.Tensor]
    prep_s: float
    skips: Callable[[], dict]  # {"skipped": ..., "updates": ...} so far; {} without scaling

    def step(self) -> torch.Tensor:
        loss = self.backward()
        self.update()
        return loss


def prepare(variant: str, work: Workload, dtype: torch.dtype, compile_: bool,
            device: torch.device) -> Prepared:
    """``variant`` on its own copy of the model and optimizer."""
    module = copy.deepcopy(work.module)
    start = time.perf_counter()
    if variant in REWRITE_OPTIONS:
        module = amp_rewrite.rewrite(module, work.inputs, dtype=dtype,
                                     **REWRITE_OPTIONS[variant])
    prep_s = time.perf_counter() - start
    if variant in BACKEND_OPTIONS:
        model = amp_rewrite.compile(module, dtype=dtype, **BACKEND_OPTIONS[variant])
    else:
        model = torch.compile(module) if compile_ else module
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=True)
    backward, update, skips = _train_step(variant, model, module, work, dtype, device,
                                          optimizer)

    @torch.no_grad()
    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=_autocast_dtype(variant, dtype),
                            enabled=variant in AUTOCAST_VARIANTS):
            return model(*work.inputs)
    return Prepared(model, backward, update, forward, prep_s, skips)


def _autocast_dtype(variant: str, dtype: torch.dtype | str) -> torch.dtype:
    """autocast has no mixed: bf16 is the peer that trains a hot model (fp16 overflows);
    ``autocast_fp16`` is fp16 whatever ``--dtype`` says."""
    if variant == "autocast_fp16":
        return torch.float16
    return torch.bfloat16 if dtype == "mixed" else dtype


def _train_step(variant: str, model: Callable, module: torch.nn.Module, work: Workload,
                dtype: torch.dtype | str, device: torch.device,
                optimizer: torch.optim.Optimizer
                ) -> tuple[Callable[[], torch.Tensor], Callable[[], None], Callable[[], dict]]:
    if variant == "fp32":
        def backward() -> torch.Tensor:
            loss = work.loss(model(*work.inputs))
            loss.backward()
            return loss

        def update() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def skips() -> dict:
            return {}  # nothing scaled, nothing skipped
    elif variant in (*AUTOCAST_VARIANTS, "backend_gradscaler"):
        # the backend's mixed plan may run fp16 nodes: scaled, as AmpOptimizer would
        low = dtype if variant == "backend_gradscaler" else _autocast_dtype(variant, dtype)
        scaler = torch.amp.GradScaler(device.type, enabled=low in (torch.float16, "mixed"))
        # steps skipped (Inf/NaN found), counted on the device: a host read every step would
        # synchronise it. Not the scale's drops: once it backs off to 0 it drops no more
        skipped, updates = torch.zeros((), device=device), [0]

        def backward() -> torch.Tensor:
            with torch.autocast(device.type, dtype=_autocast_dtype(variant, dtype),
                                enabled=variant in AUTOCAST_VARIANTS):
                logits = model(*work.inputs)
            loss = work.loss(logits)
            scaler.scale(loss).backward()
            return loss

        def update() -> None:
            scaler.step(optimizer)
            if scaler.is_enabled():  # the inf checks of this step; update() clears them
                found = scaler._found_inf_per_device(optimizer).values()
                skipped.add_(sum(found) > 0)
                updates[0] += 1
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

        def skips() -> dict:
            if not updates[0]:
                return {}  # disabled
            return {"skipped": int(skipped), "updates": updates[0],
                    "scale": scaler.get_scale()}
    else:
        # a mixed rewrite scales where it runs fp16 nodes (its report says); the backend
        # knows its nodes only after a call: 'mixed' scales
        rewritten = dtype == "mixed" and variant in REWRITE_OPTIONS
        amp = AmpOptimizer(optimizer, model=module) if rewritten else \
            AmpOptimizer(optimizer, dtype=dtype)

        def backward() -> torch.Tensor:
            loss = work.loss(model(*work.inputs))
            amp.backward(loss)
            return loss

        def update() -> None:
            amp.step()
            amp.zero_grad()

        def skips() -> dict:
            if not amp.scaler.scaling:
                return {}
            return {"skipped": amp.skipped_steps, "updates": amp.optimizer_steps}
    return backward, update, skips


def measure(call: Callable[[], object], device: torch.device, warmup: int,
            steps: int) -> dict:
    """Median time of ``steps`` calls after ``warmup`` calls; ``recompiles``: graphs dynamo
    compiled during the measured calls (0 when warm-up reached a steady state)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        call()
    sync()
    warmup_s = time.perf_counter() - start
    graphs = _compiled_graphs()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        call()
        sync()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"ms": 1000 * statistics.median(times), "peak_mib": peak and peak / 2**20,
            "warmup_s": warmup_s, "recompiles": _compiled_graphs() - graphs}


@contextlib.contextmanager
def inductor_traffic(row: dict):
    """Sets ``row["inductor_mb"]`` to the bytes Inductor's kernels compiled in the block read
    and write. Inductor counts them only while its metrics log is on; that log's output (a
    dump of every scheduler node) is kept off the console."""
    from torch._inductor import config, metrics

    log = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")
    saved = config.fx_graph_cache, torch._functorch.config.enable_autograd_cache
    config.fx_graph_cache = torch._functorch.config.enable_autograd_cache = False
    torch._logging.set_logs(inductor_metrics=True)
    log.addFilter(_drop)
    metrics.reset()
    try:
        yield
        row["inductor_mb"] = round(metrics.num_bytes_accessed / 1e6, 1)
    finally:
        log.removeFilter(_drop)
        torch._logging.set_logs()
        config.fx_graph_cache, torch._functorch.config.enable_autograd_cache = saved


def _drop(record: logging.LogRecord) -> bool:
    return False


def _compiled_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def sync_free_step(prepared: Prepared, device: torch.device) -> bool | str:
    """Whether the optimizer update (unscale, inf check, step, scale update) runs without a
    host synchronisation, under CUDA's sync debug mode."""
    if device.type != "cuda":
        return "n/a"
    prepared.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prepared.update()
        return True
    except RuntimeError as error:
        return f"synchronised: {str(error).splitlines()[0]}"
    finally:
        torch.cuda.set_sync_debug_mode("default")


def run_all(args: argparse.Namespace, device: torch.device) -> list[dict]:
    out = Path(args.json)
    earlier = json.loads(out.read_text())["rows"] if out.exists() else []
    rows = []
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    for name in args.models:
        work = build(name, args.tiny, device) if args.same_process else None
        for compile_ in compiles:
            for variant in args.variants:
                if args.same_process:
                    rows.extend(_run_variant(args, work, variant, compile_, device))
                else:
                    rows.extend(_run_in_fresh_process(args, name, variant, compile_))
                _save(out, [*earlier, *rows], args, device)
    return rows


def _run_in_fresh_process(args: argparse.Namespace, name: str, variant: str,
                          compile_: bool) -> list[dict]:
    argv = ["gpu", "train", "--same-process", "--models", name, "--variants", variant,
            "--compile", "on" if compile_ else "off", "--dtype", args.dtype,
            "--phases", *args.phases, "--steps", str(args.steps), "--warmup",
            str(args.warmup), "--device", args.device, *(["--tiny"] if args.tiny else [])]
    head = {"model": name, "variant": variant, "compile": compile_, "dtype": args.dtype}
    rows = rows_in_fresh_process(argv, head)
    for row in rows:
        print(_format(row), flush=True)
    return rows


def _run_variant(args: argparse.Namespace, work: Workload, variant: str, compile_: bool,
                 device: torch.device) -> list[dict]:
    head = {"model": work.name, "variant": variant, "compile": compile_, "dtype": args.dtype}
    rows = []
    if variant in BACKEND_OPTIONS and not compile_:
        return rows  # a torch.compile backend: compiled rows only
    try:
        prepared = prepare(variant, work, DTYPES[args.dtype], compile_, device)
        for phase in args.phases:
            row = {**head, "phase": phase, "prep_s": round(prepared.prep_s, 3)}
            if phase == "train":
                with inductor_traffic(row) if compile_ else contextlib.nullcontext():
                    row["loss0"] = float(prepared.step().detach())
                row.update(measure(prepared.step, device, args.warmup, args.steps))
                row["sync_free"] = sync_free_step(prepared, device)
                row.update(prepared.skips())
            else:
                row.update(measure(prepared.forward, device, args.warmup, args.steps))
            row["kernel_choices"] = kernel_choice_counts()
            rows.append(row)
            print(_format(row), flush=True)
    except Exception as error:  # noqa: BLE001 - a benchmark row records any failure and goes on
        row = {**head, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        rows.append(row)
        print(_format(row), flush=True)
    finally:
        if compile_:  # every _Logits shares one forward code object: no stale guards
            torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def kernel_choice_counts() -> dict[str, dict[str, int]]:
    """How many of this process's measured kernel choices (``fx/kernel_timing.py``) went each
    way, per kind: e.g. ``{"kernel": {"low": 5, "fp32": 1}, "pointwise": {"eager": 3}}``."""
    counts: dict[str, dict[str, int]] = {}
    for choice in kernel_timing.choices():
        kind = counts.setdefault(choice["kind"], {})
        kind[choice["chosen"]] = kind.get(choice["chosen"], 0) + 1
    return counts


def _format(row: dict) -> str:
    head = (f"{row['model']:9s} {row['variant']:19s} "
            f"{'compiled' if row['compile'] else 'eager':9s} {row.get('phase', ''):8s}")
    if "error" in row:
        return f"{head} {row['error']}"
    peak = f"{row['peak_mib']:10.0f}" if row["peak_mib"] is not None else f"{'n/a':>10s}"
    return (f"{head} {row['ms']:10.2f} {peak} {row['prep_s']:7.1f} {row['warmup_s']:7.1f}"
            f" {row.get('loss0', float('nan')):9.4f} {row.get('recompiles', ''):>4}"
            f" {row.get('inductor_mb', ''):>9} {row.get('sync_free', '')}"
            + (f" skipped {row['skipped']}/{row['updates']}" if "skipped" in row else ""))


def _save(out: Path, rows: list[dict], args: argparse.Namespace, device: torch.device) -> None:
    """Written after every variant (a killed run keeps its rows); rows of earlier runs into
    the same file are kept, so runs of one model each can share it."""
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device)
            if device.type == "cuda" else platform.processor() or platform.machine(),
            "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny,
            "cpu_flags": cpu_flags()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    tmp.replace(out)


def cpu_flags() -> list[str]:
    """The CPU's bf16-relevant instruction sets (``lscpu`` flags): AMX and AVX512-BF16 give
    native bf16 GEMMs; AVX2 alone does not."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set(next((line for line in text.splitlines() if line.startswith("flags")),
                     "").split())
    return sorted(flags & {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS,
                        default=list(DEFAULT_VARIANTS))
    parser.add_argument("--dtype", default="fp16", choices=list(DTYPES))
    parser.add_argument("--phases", nargs="+", default=["train"], choices=["train", "forward"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--compile", default="both", choices=["off", "on", "both"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="tiny configs (smoke test)")
    parser.add_argument("--json", default="results/bench_gpu_training.json")
    add_same_process_flag(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available: this benchmark needs a GPU; nothing was measured.")
        return 0
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    device = torch.device(args.device)
    print(f"{'model':9s} {'variant':19s} {'mode':9s} {'phase':8s} {'ms':>10s} {'peak MiB':>10s}"
          f" {'prep s':>7s} {'warm s':>7s} {'loss0':>9s} {'reco':>4s} {'ind. MB':>9s} sync-free")
    run_all(args, device)
    print(f"wrote {args.json}")
    return 0
