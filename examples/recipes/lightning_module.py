"""amp_rewrite with PyTorch Lightning: compile the LightningModule with the amp_rewrite
backend and train it with ``precision="32-true"`` (the rewritten graphs carry their own
precision; Lightning's mixed precision would add autocast on top).

bf16 needs no loss scaling. For fp16, step with ``AmpOptimizer`` under manual optimization,
as the Accelerate recipe does. The same loop under ``precision="bf16-mixed"``
(``torch.autocast``) runs beside it for comparison.

    python examples/recipes/lightning_module.py [--model gpt2|bert] [--steps 50] [--inner eager]
"""
from __future__ import annotations

import logging
import warnings

import lightning
import torch

import amp_rewrite
import tiny


class LanguageModel(lightning.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.model = tiny.model(kind)
        self.losses: list[float] = []

    def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
        return self.model(**batch).loss

    def on_train_batch_end(self, outputs: dict, batch: dict, index: int) -> None:
        # outside the compiled step: .item() there would break the graph every step
        self.losses.append(outputs["loss"].item())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def train(kind: str, steps: int, compiled: bool, inner: str) -> LanguageModel:
    lightning.seed_everything(0, verbose=False)
    module = LanguageModel(kind)
    trainer = lightning.Trainer(
        max_steps=steps, precision="32-true" if compiled else "bf16-mixed",
        accelerator="auto", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(tiny.Batches(kind, steps * tiny.BATCH),
                                         batch_size=tiny.BATCH)
    trainer.fit(amp_rewrite.compile(module, dtype="bf16", inner=inner) if compiled else module,
                loader)
    return module


def main() -> None:
    args = tiny.arguments(__doc__)
    logging.getLogger("lightning").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", module="lightning")  # its "few workers" hints
    ours = train(args.model, args.steps, compiled=True, inner=args.inner)
    autocast = train(args.model, args.steps, compiled=False, inner=args.inner)
    print(f"graphs compiled: {len(amp_rewrite.report(ours))}")
    tiny.report_agreement(tiny.mean_last(ours.losses), tiny.mean_last(autocast.losses))
    tiny.check_reload(ours.model, tiny.Batches(args.model, tiny.BATCH, seed=99)[:])


if __name__ == "__main__":
    main()
