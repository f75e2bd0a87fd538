"""``python -m benchmarks <subcommand>``: the one entry point of the benchmarks."""
from __future__ import annotations

import sys

SUBCOMMANDS = {
    "speed": "benchmarks.speed",
    "compare": "benchmarks.compare",
    "fx": "benchmarks.fx_bench",
    "gpu": "benchmarks.gpu",
    "padding": "benchmarks.padding",
    "mincut": "benchmarks.mincut",
    "paper": "benchmarks.paper",
    "zoo": "benchmarks.zoo_export",
    "fuzz": "benchmarks.fuzz_cli",
    "decoders": "benchmarks.deployed",
    "fp8": "benchmarks.fp8",
    "budget": "benchmarks.budget",
    "mixed": "benchmarks.mixed",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in SUBCOMMANDS:
        asked = argv[:1] in (["-h"], ["--help"])
        print(f"usage: python -m benchmarks {{{','.join(SUBCOMMANDS)}}} ...\n"
              "each subcommand's --help says what it measures",
              file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
