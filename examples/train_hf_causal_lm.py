"""Train a Hugging Face causal LM with amp_rewrite, evaluate it, save it, load it back.

A tiny GPT-2 with random weights and its default config (dropout on, ``use_cache`` left
alone: amp_rewrite captures with ``use_cache=False`` and says so), labels given so the loss is
computed in the graph, a train graph and an eval graph on one set of parameters
(``mode="both"``), and the result saved with ``save_pretrained`` and loaded into the original
class. Runs on CPU in about a minute (the fused regions compile on the first step; set
``AMP_REWRITE_FUSED_BACKEND=eager`` to skip that).

    python examples/train_hf_causal_lm.py [--dtype fp16|bf16] [--steps 20]
"""
from __future__ import annotations

import argparse
import logging
import tempfile

import torch
import transformers

import amp_rewrite


def batch(seed: int, size: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (size, length), generator=torch.Generator().manual_seed(seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    transformers.logging.set_verbosity_error()

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128,
                                     n_positions=64)
    model = transformers.GPT2LMHeadModel(config)  # default dropout 0.1
    ids = batch(0, 4, 16, config.vocab_size)
    # labels at capture: the graph computes the loss; every call then passes labels
    gm = amp_rewrite.rewrite(model, (ids,), example_kwargs={"labels": ids}, dtype=args.dtype,
                             mode="both")
    opt = amp_rewrite.AmpOptimizer(torch.optim.AdamW(gm.parameters(), lr=1e-3),
                                   dtype=args.dtype)

    gm.train()
    for step in range(args.steps):
        ids = batch(1 + step, 4, 16, config.vocab_size)
        loss = gm(ids, labels=ids).loss
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    gm.eval()  # dropout off; another batch size and sequence length
    ids = batch(1000, 3, 11, config.vocab_size)
    with torch.no_grad():
        ours = gm(ids, labels=ids)
    print(f"eval loss {ours.loss.item():.4f}")
    # a loss computed outside the graph from the logits gives the same number
    shifted = torch.nn.functional.cross_entropy(
        ours.logits[:, :-1].float().reshape(-1, config.vocab_size), ids[:, 1:].reshape(-1))
    assert torch.allclose(shifted, ours.loss.float(), rtol=1e-3), (shifted, ours.loss)

    # the state dict has the original model's keys, shapes and dtypes (fp32 master weights)
    model.load_state_dict(gm.state_dict())
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        reloaded = transformers.GPT2LMHeadModel.from_pretrained(directory).eval()
    with torch.no_grad():
        fp32 = reloaded(ids, labels=ids, use_cache=False)
    print(f"reloaded fp32 eval loss {fp32.loss.item():.4f}")
    assert abs(fp32.loss.item() - ours.loss.item()) < 0.02 * fp32.loss.item()
    print(f"compile: {gm.amp_report['fused']['compile']}")


if __name__ == "__main__":
    main()
