"""Speed of the fx pass on a BERT-base or a 48-layer GPT-2-shaped graph (capture reported apart).

``--model bert``: BERT-base (12 layers, hidden 768, 12 heads, random weights from
``BertConfig()``, eager attention), batch 8 x 128 tokens with an attention mask.
``--model gpt2-48``: GPT-2 with 48 layers (GPT-2 XL's depth; the graph has its node count)
but hidden 256 and 8 heads, so the random weights fit a shared host; the fx graph and the
pass's work do not depend on the width. Batch 2 x 128 tokens. Capture (``torch.export``) runs once
per repeat on the module; the rewrite (inline, functionalize, view, plan, apply) runs on a fresh
deep copy of the captured graph each time. Medians over ``--repeat`` runs after one warm-up.

    python -m benchmarks fx speed [--model bert|gpt2-48] [--repeat 5] [--dtype fp16]
        [--json results/bench_fx_speed.json]
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
from benchmarks.timing import PROBE_ITERATIONS, host_probe

BUDGET_S = {"bert": 2.0, "gpt2-48": 3.0}  # rewrite-time targets (docs/benchmarks.md §2)


def bert_base(attn: str = "eager") -> tuple[torch.nn.Module, tuple]:
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(attn_implementation=attn)).eval()
    ids = torch.randint(0, model.config.vocab_size, (8, 128))
    mask = torch.ones(8, 128, dtype=torch.int64)
    return model, (ids, mask)


def gpt2_48(attn: str = "eager") -> tuple[torch.nn.Module, tuple]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=48, n_embd=256, n_head=8, use_cache=False,
                                     attn_implementation=attn)
    model = transformers.GPT2Model(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 128))
    return model, (ids,)


MODELS = {"bert": (bert_base, "bert-base ({attn} attention), batch 8 x 128"),
          "gpt2-48": (gpt2_48, "gpt2 48 layers, hidden 256 ({attn} attention), batch 2 x 128")}


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="bert", choices=list(MODELS))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
    parser.add_argument("--json", default=None, help="default results/bench_fx_speed_MODEL.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    build, label = MODELS[args.model]
    model, inputs = build(args.attn)
    budget = BUDGET_S[args.model]
    captures, rewrites, probes, gm = [], [], [], None
    for i in range(args.repeat + 1):  # the first of each is a warm-up
        probes.append(host_probe())
        seconds, captured = timed(lambda: capture(model, inputs))
        fresh = copy.deepcopy(captured)
        rewrite_s, gm = timed(lambda: rewrite_graph(fresh, dtype=args.dtype))
        if i:
            captures.append(seconds)
            rewrites.append(rewrite_s)
    result = {
        "model": label.format(attn=args.attn),
        "dtype": args.dtype, "fx_nodes": len(gm.graph.nodes),
        "casts": gm.amp_report["casts_inserted"],
        "capture_s_median": statistics.median(captures),
        "rewrite_s_median": statistics.median(rewrites),
        "rewrite_s_all": rewrites, "capture_s_all": captures, "budget_s": budget,
        "host_probes_s": probes, "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    print(f"{result['model']}: {result['fx_nodes']} fx nodes, {result['casts']} casts")
    print(f"capture (torch.export) median {result['capture_s_median']:.2f} s")
    print(f"rewrite median {result['rewrite_s_median']:.3f} s over {args.repeat} runs "
          f"(budget {budget} s): {'ok' if result['rewrite_s_median'] < budget else 'OVER'}")
    print(f"host probe ({PROBE_ITERATIONS:,}-step Python loop, per run): "
          f"{min(probes):.3f} to {max(probes):.3f} s")
    out = Path(args.json or f"results/bench_fx_speed_{args.model}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0
