"""``python -m amp_rewrite.bench <subcommand>``: the one entry point of the benchmarks."""
from __future__ import annotations

import sys

SUBCOMMANDS = {
    "speed": "amp_rewrite.bench.speed",
    "compare": "amp_rewrite.bench.compare",
    "fx": "amp_rewrite.bench.fx_bench",
    "gpu": "amp_rewrite.bench.gpu",
    "padding": "amp_rewrite.bench.padding",
    "mincut": "amp_rewrite.bench.mincut",
    "paper": "amp_rewrite.bench.paper",
    "zoo": "amp_rewrite.bench.zoo_export",
    "fuzz": "amp_rewrite.bench.fuzz_cli",
    "decoders": "amp_rewrite.bench.deployed",
    "fp8": "amp_rewrite.bench.fp8",
    "budget": "amp_rewrite.bench.budget",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        asked = argv[:1] in (["-h"], ["--help"])
        print(f"usage: python -m amp_rewrite.bench {{{','.join(SUBCOMMANDS)}}} ...\n"
              "each subcommand's --help says what it measures",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
