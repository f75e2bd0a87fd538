"""Speed of the fx pass on a BERT-base graph (capture reported apart).

BERT-base (12 layers, hidden 768, 12 heads, random weights from ``BertConfig()``, eager
attention), batch 8 x 128 tokens with an attention mask. Capture (``torch.export``) runs once
per repeat on the module; the rewrite (inline, functionalize, view, plan, apply) runs on a fresh
deep copy of the captured graph each time. Medians over ``--repeat`` runs after one warm-up.

    PYTHONPATH=. python tools/bench_fx_speed.py [--repeat 5] [--dtype fp16]
        [--out results/bench_fx_speed.json]
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
from pathlib import Path

import torch

from amp_rewrite.fx import rewrite_graph
from amp_rewrite.fx.capture import capture

BUDGET_S = 2.0  # the target for the rewrite of a BERT-base graph


def bert_base(attn: str = "eager") -> tuple[torch.nn.Module, tuple]:
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(attn_implementation=attn)).eval()
    ids = torch.randint(0, model.config.vocab_size, (8, 128))
    mask = torch.ones(8, 128, dtype=torch.int64)
    return model, (ids, mask)


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--out", default="results/bench_fx_speed.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    model, inputs = bert_base(args.attn)
    captures, rewrites, gm = [], [], None
    for i in range(args.repeat + 1):  # the first of each is a warm-up
        seconds, captured = timed(lambda: capture(model, inputs))
        fresh = copy.deepcopy(captured)
        rewrite_s, gm = timed(lambda: rewrite_graph(fresh, dtype=args.dtype))
        if i:
            captures.append(seconds)
            rewrites.append(rewrite_s)
    result = {
        "model": f"bert-base ({args.attn} attention), batch 8 x 128",
        "dtype": args.dtype, "fx_nodes": len(gm.graph.nodes),
        "casts": gm.amp_report["casts_inserted"],
        "capture_s_median": statistics.median(captures),
        "rewrite_s_median": statistics.median(rewrites),
        "rewrite_s_all": rewrites, "budget_s": BUDGET_S,
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
    }
    print(f"{result['model']}: {result['fx_nodes']} fx nodes, {result['casts']} casts")
    print(f"capture (torch.export) median {result['capture_s_median']:.2f} s")
    print(f"rewrite median {result['rewrite_s_median']:.3f} s over {args.repeat} runs "
          f"(budget {BUDGET_S} s): {'ok' if result['rewrite_s_median'] < BUDGET_S else 'OVER'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
