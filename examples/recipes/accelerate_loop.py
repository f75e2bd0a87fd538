"""amp_rewrite in an Accelerate training loop: compile the model with the amp_rewrite backend,
prepare it with an ``Accelerator`` whose own mixed precision is off, and step with
``AmpOptimizer`` (dynamic loss scaling for fp16 without a host sync, FP32 master weights).

The same loop under ``Accelerator(mixed_precision=...)`` (``torch.autocast``, plus
``GradScaler`` for fp16) runs beside it for comparison.

    python examples/recipes/accelerate_loop.py [--model gpt2|bert] [--dtype bf16|fp16]
        [--steps 50] [--inner eager]
"""
from __future__ import annotations


import accelerate
import torch

import amp_rewrite
import tiny


def train(kind: str, steps: int, dtype: str, compiled: bool, inner: str
          ) -> tuple[torch.nn.Module, list[float]]:
    # one process runs both loops, and Accelerate keeps one precision per process
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = accelerate.Accelerator(
        cpu=not torch.cuda.is_available(), mixed_precision="no" if compiled else dtype)
    accelerate.utils.set_seed(0)
    model = tiny.model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if compiled:
        model = amp_rewrite.compile(model, dtype=dtype, inner=inner)
    loader = torch.utils.data.DataLoader(tiny.Batches(kind, steps * tiny.BATCH),
                                         batch_size=tiny.BATCH)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    amp = amp_rewrite.AmpOptimizer(optimizer, dtype=dtype) if compiled else None
    losses = []
    model.train()
    for batch in loader:
        loss = model(**batch).loss
        if compiled:
            amp.backward(loss)
            amp.step()
            amp.zero_grad()
        else:
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator.unwrap_model(model, keep_torch_compile=False), losses


def main() -> None:
    args = tiny.arguments(__doc__, ("bf16", "fp16"))
    ours, our_losses = train(args.model, args.steps, args.dtype, True, args.inner)
    _, autocast_losses = train(args.model, args.steps, args.dtype, False, args.inner)
    print(f"graphs compiled: {len(amp_rewrite.report(ours))}")
    tiny.report_agreement(tiny.mean_last(our_losses), tiny.mean_last(autocast_losses))
    tiny.check_reload(ours, tiny.Batches(args.model, tiny.BATCH, seed=99)[:])


if __name__ == "__main__":
    main()
