"""What the recipes share: a tiny GPT-2 or BERT from its default config (random weights,
dropout on), seeded batches, and the reload check."""
from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

VOCAB, BATCH, LENGTH = 128, 8, 32


def model(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny ``kind`` ('gpt2': causal LM, 'bert': sequence classification), seeded."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                         n_positions=LENGTH)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                     intermediate_size=128, vocab_size=VOCAB,
                                     max_position_embeddings=LENGTH, num_labels=2)
    return transformers.BertForSequenceClassification(config)


class Batches(torch.utils.data.Dataset):
    """``count`` seeded examples: token ids and labels (the ids for a causal LM; for BERT,
    whether the first token is in the vocabulary's lower half, something it can learn)."""

    def __init__(self, kind: str, count: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (count, LENGTH), generator=g)
        self.labels = self.ids if kind == "gpt2" else (self.ids[:, 0] < VOCAB // 2).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def mean_last(losses: list[float], n: int = 10) -> float:
    return sum(losses[-n:]) / len(losses[-n:])


def check_reload(trained: torch.nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """``save_pretrained`` then ``from_pretrained`` into the original class: same weights,
    same eval loss in FP32."""
    trained = getattr(trained, "_orig_mod", trained).eval()
    with tempfile.TemporaryDirectory() as directory:
        trained.save_pretrained(directory)
        reloaded = type(trained).from_pretrained(directory).eval()
    assert trained.state_dict().keys() == reloaded.state_dict().keys()
    with torch.no_grad():
        expected = trained(**batch).loss
        got = reloaded(**batch).loss
    assert torch.allclose(expected, got), (expected, got)
    print(f"reloaded into {type(reloaded).__name__}: eval loss {got.item():.4f}")


def report_agreement(ours: float, autocast: float, tolerance: float = 0.02) -> None:
    print(f"mean loss of the last 10 steps: amp_rewrite {ours:.4f}, torch.autocast "
          f"{autocast:.4f} ({100 * abs(ours - autocast) / autocast:.2f}% apart)")
    assert abs(ours - autocast) <= tolerance * autocast


def arguments(description: str, dtypes: tuple[str, ...] = ("bf16",)) -> argparse.Namespace:
    """The recipes' command line: --model, --steps, --inner (and --dtype where it has a choice)."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--model", default="gpt2", choices=["gpt2", "bert"])
    parser.add_argument("--dtype", default=dtypes[0], choices=list(dtypes))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    transformers.logging.set_verbosity_error()
    return parser.parse_args()
