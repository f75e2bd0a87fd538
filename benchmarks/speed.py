"""``python -m benchmarks speed``: how fast the ONNX rewrite is, against the peers.

Without a mode it runs the two headline measurements in one go: ``deep`` (GPT-2 48 layers,
BERT 24, Llama 32 exported from the zoo; ours against ORT's transformers optimizer + float16,
onnxconverter-common and ORT's float16 converter) and ``chains`` (synthetic 10k and 50k node
chains, including the ``softmax`` variant whose Softmax feeds the next MatMul).

    python -m benchmarks speed [--layers N] [--sizes 10000 50000] [--json-dir DIR]
    python -m benchmarks speed {deep,chains,inprocess,large} [options]
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import cli, deep_speed

MODES = {
    "all": ("benchmarks.speed:run_all", "deep, then chains (the default)"),
    "deep": ("benchmarks.deep_speed", "deep real exports against the peers"),
    "chains": ("benchmarks.chain_speed", "synthetic chains, each converter in a worker"),
    "inprocess": ("benchmarks.inprocess", "in-process rewrite time, growth 10k -> 50k"),
    "large": ("benchmarks.large_model", "a > 2 GB external-data model: time, memory"),
}


def run_all(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks speed",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(deep_speed.DEPTHS),
                   choices=list(deep_speed.DEPTHS))
    p.add_argument("--layers", type=int, help="one depth for every model (default: real depths)")
    p.add_argument("--repeats", type=int, default=3, help="rounds for the deep exports")
    p.add_argument("--sizes", nargs="+", type=int, default=[10000, 50000])
    p.add_argument("--variants", nargs="+", default=["residual", "softmax"])
    p.add_argument("--chain-repeats", nargs="+", type=int, default=[3, 1])
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per chain conversion")
    p.add_argument("--cache", type=Path, default=Path("results/deep_exports"))
    p.add_argument("--json-dir", type=Path, help="write deep.json and chains.json here")
    args = p.parse_args(argv)
    deep = ["--models", *args.models, "--repeats", str(args.repeats), "--cache", str(args.cache)]
    deep += ["--layers", str(args.layers)] if args.layers else []
    chains = ["--sizes", *map(str, args.sizes), "--variants", *args.variants,
              "--repeats", *map(str, args.chain_repeats), "--timeout", str(args.timeout)]
    if args.json_dir:
        deep += ["--json", str(args.json_dir / "deep.json")]
        chains += ["--json", str(args.json_dir / "chains.json")]
    print("== deep exports")
    status = cli.dispatch("speed", MODES, ["deep", *deep])
    print("\n== synthetic chains")
    return status or cli.dispatch("speed", MODES, ["chains", *chains])


def main(argv: list[str] | None = None) -> int:
    return cli.dispatch("speed", MODES, list(argv or []), default="all")
