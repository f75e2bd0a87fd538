"""Why fp16 training needs loss scaling, reproduced (docs/benchmarks.md §5).

Three runs of one regression MLP from the same initial weights and data stream:

* ``fp32``        — everything in float32 (the baseline);
* ``fp16``        — float16 compute (FP32 parameters cast in the forward, as amp_rewrite's fx
                    output does), no loss scaling;
* ``fp16_scaled`` — the same float16 compute with ``amp_rewrite.AmpOptimizer``'s dynamic
                    loss scaling (defaults: init 2**16, x2 per 2000 clean steps).

The task is built so that most activation gradients are smaller than 2**-24, the smallest fp16
subnormal: the loss is mean-squared error over B*D outputs with a loss weight of 2**-16 (think
of a down-weighted auxiliary term, or targets in small units); SGD's learning rate is divided by
the same weight, so the FP32 dynamics are those of the unweighted loss. In fp16 those gradients
round to zero in the backward cast and the fp16 matmuls — real float16 arithmetic on the CPU,
nothing is zeroed by hand — and training stalls; scaling moves them back into range.

Printed: final losses, the fraction of activation gradients below 2**-24 in the FP32 run and
exactly zero in the fp16 runs (what the histogram shows). Written: JSON (``--out``) and a
histogram of log2|activation gradient| as PNG (``--png``, needs matplotlib: ``pip install
amp_rewrite[bench]``).

    python -m benchmarks paper [--steps 300] [--json results/loss_scaling_paper.json]
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from amp_rewrite.training import AmpOptimizer, LossScaler

log = logging.getLogger("loss_scaling_paper")

FP16_MIN_SUBNORMAL = 2.0**-24
FP16_MIN_NORMAL = 2.0**-14
FP16_MAX = 65504.0
MODES = ("fp32", "fp16", "fp16_scaled")


@dataclass(frozen=True)
class Config:
    steps: int = 300
    batch: int = 256
    d_in: int = 32
    hidden: int = 64
    d_out: int = 8
    depth: int = 3            # hidden layers
    loss_weight: float = 2.0**-16
    lr: float = 0.05          # for the unweighted loss; the optimizer gets lr / loss_weight
    momentum: float = 0.9
    label_noise: float = 0.1
    eval_size: int = 2048
    record_every: int = 25    # steps between activation-gradient snapshots
    seed: int = 0


@dataclass
class RunResult:
    mode: str
    initial_eval_loss: float
    final_eval_loss: float
    train_losses: list[float]
    activation_grad_zero_fraction: float
    weight_grad_zero_fraction: float
    skipped_steps: int
    final_scale: float
    seconds: float
    activation_grads: torch.Tensor = field(repr=False)  # FP32 copies of the snapshots


class CastMLP(nn.Module):
    """ReLU MLP with FP32 parameters whose forward runs in ``compute_dtype`` via casts."""

    def __init__(self, config: Config, compute_dtype: torch.dtype) -> None:
        super().__init__()
        sizes = [config.d_in] + [config.hidden] * config.depth + [config.d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.compute_dtype = compute_dtype
        self.recorded: list[torch.Tensor] | None = None

    def _record(self, value: torch.Tensor) -> None:
        if self.recorded is not None and value.requires_grad:
            store = self.recorded
            value.register_hook(lambda g: store.append(g.detach().flatten().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.compute_dtype)
        for i, layer in enumerate(self.layers):
            h = F.linear(h, layer.weight.to(self.compute_dtype), layer.bias.to(self.compute_dtype))
            if i < len(self.layers) - 1:
                h = F.relu(h)
            # Gradients of post-ReLU activations and of the output carry no structural zeros,
            # so in FP32 they are never exactly 0: every zero in fp16 is an underflow.
            self._record(h)
        return h.float()


class Task:
    """Teacher-generated regression data, identical for every run."""

    def __init__(self, config: Config) -> None:
        gen = torch.Generator().manual_seed(config.seed + 1)
        d_in, hidden, d_out = config.d_in, config.hidden, config.d_out
        self.teacher_w1 = torch.randn(d_in, hidden, generator=gen) / d_in**0.5
        self.teacher_w2 = torch.randn(hidden, d_out, generator=gen) / hidden**0.5
        self.config = config
        self.eval_x, self.eval_y = self.sample(config.eval_size, config.seed + 2)

    def sample(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, self.config.d_in, generator=gen)
        y = torch.tanh(x @ self.teacher_w1) @ self.teacher_w2
        return x, y + self.config.label_noise * torch.randn(y.shape, generator=gen)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(self.config.batch, 10_000 + step)


def _eval_loss(model: CastMLP, task: Task) -> float:
    """Unweighted MSE on the held-out set, computed in FP32 from the FP32 parameters."""
    saved, model.compute_dtype = model.compute_dtype, torch.float32
    try:
        with torch.no_grad():
            return F.mse_loss(model(task.eval_x), task.eval_y).item()
    finally:
        model.compute_dtype = saved


def _zero_fraction(tensors: list[torch.Tensor]) -> float:
    total = sum(t.numel() for t in tensors)
    return sum(int((t == 0).sum()) for t in tensors) / max(total, 1)


def run(config: Config, mode: str, task: Task | None = None) -> RunResult:
    """Train one of ``MODES`` and collect the statistics."""
    task = task or Task(config)
    torch.manual_seed(config.seed)
    model = CastMLP(config, torch.float32 if mode == "fp32" else torch.float16)
    sgd = torch.optim.SGD(model.parameters(), lr=config.lr / config.loss_weight,
                          momentum=config.momentum)
    scaler = LossScaler() if mode == "fp16_scaled" else LossScaler(enabled=False)
    amp = AmpOptimizer(sgd, scaler=scaler)
    initial = _eval_loss(model, task)
    snapshots: list[torch.Tensor] = []
    weight_grads: list[torch.Tensor] = []
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        recording = step % config.record_every == 0
        model.recorded = [] if recording else None
        x, y = task.batch(step)
        loss = F.mse_loss(model(x), y)
        amp.backward(config.loss_weight * loss)
        if recording:
            scale = amp.get_scale()
            # Divided by the loss scale in float32 (exact: a power of two, far from float32's
            # limits), so zeros are exactly the fp16 ones and magnitudes compare across runs.
            snapshots.extend(g.float() / scale for g in model.recorded)
            weight_grads.extend(p.grad.clone() for p in model.parameters())
        amp.step()
        amp.zero_grad()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    return RunResult(mode, initial, _eval_loss(model, task), losses, _zero_fraction(snapshots),
                     _zero_fraction(weight_grads), amp.skipped_steps, amp.get_scale(), seconds,
                     torch.cat(snapshots))


def summarize(results: dict[str, RunResult]) -> dict[str, object]:
    """The numbers the result is about."""
    fp32, fp16, scaled = (results[m] for m in MODES)
    g = fp32.activation_grads.abs()
    gap = fp32.initial_eval_loss - fp32.final_eval_loss
    return {
        "fp32_activation_grads_below_2^-24": float((g < FP16_MIN_SUBNORMAL).double().mean()),
        "fp32_activation_grads_below_2^-25_(round_to_0)": float(
            (g < FP16_MIN_SUBNORMAL / 2).double().mean()),
        "fp32_activation_grads_in_fp16_normal_range": float(
            ((g >= FP16_MIN_NORMAL) & (g <= FP16_MAX)).double().mean()),
        "activation_grad_zero_fraction": {m: results[m].activation_grad_zero_fraction
                                          for m in MODES},
        "weight_grad_zero_fraction": {m: results[m].weight_grad_zero_fraction for m in MODES},
        "initial_eval_loss": fp32.initial_eval_loss,
        "final_eval_loss": {m: results[m].final_eval_loss for m in MODES},
        "fp16_scaled_vs_fp32_relative_gap": abs(scaled.final_eval_loss - fp32.final_eval_loss)
        / fp32.final_eval_loss,
        "fp16_unscaled_progress_vs_fp32": (fp16.initial_eval_loss - fp16.final_eval_loss) / gap,
        "fp16_scaled_skipped_steps": scaled.skipped_steps,
        "fp16_scaled_final_scale": scaled.final_scale,
        "seconds": {m: results[m].seconds for m in MODES},
    }


def compare(config: Config) -> tuple[dict[str, RunResult], dict[str, object]]:
    task = Task(config)
    results = {mode: run(config, mode, task) for mode in MODES}
    return results, summarize(results)


def write_histogram(path: Path, results: dict[str, RunResult], summary: dict[str, object],
                    scale: float) -> bool:
    """The histogram of log2|activation gradient| in the FP32 run."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install amp_rewrite[bench]): no PNG")
        return False
    g = results["fp32"].activation_grads.abs()
    logs = torch.log2(g[g > 0]).numpy()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.hist(logs, bins=80, color="tab:blue", alpha=0.75, label="FP32 run (unscaled values)")
    ax.hist(logs + math.log2(scale), bins=80, color="tab:green", alpha=0.45,
            label=f"same values x loss scale 2^{int(math.log2(scale))}")
    ax.axvspan(logs.min() - 2, -24, color="tab:red", alpha=0.12,
               label="below fp16 min subnormal 2^-24: become 0")
    ax.axvspan(-24, -14, color="orange", alpha=0.12, label="fp16 subnormal range")
    ax.axvline(math.log2(FP16_MAX), color="black", lw=0.8, ls="--", label="fp16 max 65504")
    zeros = summary["activation_grad_zero_fraction"]
    ax.set_title("Activation gradients in the FP32 run\n"
                 f"below 2^-24 in FP32: {summary['fp32_activation_grads_below_2^-24']:.1%} | "
                 f"zero in fp16: {zeros['fp16']:.1%} unscaled, {zeros['fp16_scaled']:.1%} "
                 "scaled", fontsize=9)
    ax.set_xlabel("log2 |activation gradient|")
    ax.set_ylabel("count")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _print_table(summary: dict[str, object]) -> None:
    losses, zeros = summary["final_eval_loss"], summary["activation_grad_zero_fraction"]
    wzeros = summary["weight_grad_zero_fraction"]
    print(f"initial eval loss: {summary['initial_eval_loss']:.5f}")
    print(f"FP32 activation gradients below 2^-24: "
          f"{summary['fp32_activation_grads_below_2^-24']:.1%} "
          f"(below 2^-25, i.e. rounding to 0: "
          f"{summary['fp32_activation_grads_below_2^-25_(round_to_0)']:.1%})")
    print(f"{'run':<12} {'final eval loss':>16} {'act. grads = 0':>15} {'weight grads = 0':>17}")
    for mode in MODES:
        print(f"{mode:<12} {losses[mode]:>16.5f} {zeros[mode]:>15.1%} {wzeros[mode]:>17.1%}")
    gap = summary["fp16_scaled_vs_fp32_relative_gap"]
    progress = summary["fp16_unscaled_progress_vs_fp32"]
    print(f"fp16 scaled vs FP32 final loss: {gap:.3%} apart "
          f"({'within' if gap <= 0.02 else 'NOT within'} 2%); "
          f"scale {summary['fp16_scaled_final_scale']:.0f}, "
          f"{summary['fp16_scaled_skipped_steps']} skipped steps")
    print(f"fp16 unscaled made {progress:.1%} of FP32's loss reduction")


def sweep(config: Config, exponents: list[int]) -> list[dict[str, float]]:
    """Loss weight 2**-e for each e: where does unscaled fp16 start to fail?"""
    rows = []
    for e in exponents:
        _, summary = compare(Config(**{**asdict(config), "loss_weight": 2.0**-e}))
        losses = summary["final_eval_loss"]
        rows.append({"loss_weight_exp": -e,
                     "fp32_below_2^-24": summary["fp32_activation_grads_below_2^-24"],
                     "fp16_zero_fraction": summary["activation_grad_zero_fraction"]["fp16"],
                     **{f"final_{m}": losses[m] for m in MODES}})
    print(f"{'weight':>7} {'FP32 <2^-24':>12} {'fp16 zeros':>11} "
          + " ".join(f"{m:>12}" for m in MODES))
    for r in rows:
        print(f"2^{r['loss_weight_exp']:<5} {r['fp32_below_2^-24']:>12.1%} "
              f"{r['fp16_zero_fraction']:>11.1%} "
              + " ".join(f"{r['final_' + m]:>12.5f}" for m in MODES))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Config.steps)
    parser.add_argument("--loss-weight", type=float, default=Config.loss_weight)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (tiny matrices: 1 is fastest)")
    parser.add_argument("--sweep", action="store_true",
                        help="also sweep the loss weight 2^-10 ... 2^-16 (about a minute)")
    parser.add_argument("--json", type=Path, default=Path("results/loss_scaling_paper.json"))
    parser.add_argument("--png", type=Path, default=Path("results/loss_scaling_paper.png"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    config = Config(steps=args.steps, loss_weight=args.loss_weight)
    results, summary = compare(config)
    _print_table(summary)
    rows = sweep(config, list(range(10, 17))) if args.sweep else None
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": asdict(config), "summary": summary,
                                    "sweep": rows,
                                    "train_losses": {m: r.train_losses
                                                     for m, r in results.items()}}, indent=1))
    print(f"wrote {args.json}")
    if write_histogram(args.png, results, summary, 2.0**16):
        print(f"wrote {args.png}")
    return 0
