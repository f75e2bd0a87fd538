"""amp_rewrite inside a Hugging Face ``Trainer``: compile the model with the amp_rewrite
backend, hand the compiled model to ``Trainer`` with its own mixed precision off.

``TrainingArguments(torch_compile_backend="amp_rewrite")`` does not work: Accelerate accepts
only the backends it lists. ``Trainer`` unwraps the compiled model to save it, so
``save_model`` writes the original class. fp16 needs loss scaling, which ``Trainer`` ties to
its own autocast: use bf16 here, or the Accelerate recipe with ``AmpOptimizer`` for fp16.
The same loop under ``Trainer(bf16=True)`` (``torch.autocast``) runs beside it for comparison.

    python examples/recipes/hf_trainer.py [--model gpt2|bert] [--steps 50] [--inner eager]
"""
from __future__ import annotations

import tempfile

import torch
import transformers

import amp_rewrite
import tiny


def train(kind: str, steps: int, compiled: bool, inner: str) -> tuple[torch.nn.Module, list]:
    model = tiny.model(kind)
    if compiled:
        model = amp_rewrite.compile(model, dtype="bf16", inner=inner)
    losses: list[float] = []

    class Losses(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as out:
        arguments = transformers.TrainingArguments(
            output_dir=out, max_steps=steps, per_device_train_batch_size=tiny.BATCH,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=0,
            use_cpu=not torch.cuda.is_available(), bf16=not compiled,
            remove_unused_columns=False, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=arguments,
                                       train_dataset=tiny.Batches(kind, steps * tiny.BATCH),
                                       callbacks=[Losses()])
        trainer.remove_callback(transformers.PrinterCallback)  # the losses print below
        trainer.train()
    return trainer.model, losses


def main() -> None:
    args = tiny.arguments(__doc__)
    ours, our_losses = train(args.model, args.steps, compiled=True, inner=args.inner)
    _, autocast_losses = train(args.model, args.steps, compiled=False, inner=args.inner)
    print(f"graphs compiled: {len(amp_rewrite.report(ours))}")
    tiny.report_agreement(tiny.mean_last(our_losses), tiny.mean_last(autocast_losses))
    tiny.check_reload(ours, tiny.Batches(args.model, tiny.BATCH, seed=99)[:])


if __name__ == "__main__":
    main()
