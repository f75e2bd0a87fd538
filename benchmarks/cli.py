"""Pieces every ``python -m benchmarks`` subcommand shares: ``--json``, logging, modes.

A subcommand with several measurements (``speed``, ``compare``, ``fx``, ``gpu``) names them as
modes, ``python -m benchmarks speed deep ...``; :func:`dispatch` imports the mode's
module lazily (torch, transformers and onnxruntime are heavy) and calls its ``main(argv)``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/ and tests/models/


def child_env() -> dict[str, str]:
    """The environment for a ``python -m benchmarks ...`` child process: this one's, with the
    checkout's root appended to ``PYTHONPATH``, so that the child finds ``benchmarks`` and
    ``tests.models`` from any working directory (appended: an installed ``amp_rewrite``
    earlier on the path stays the one imported)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(REPO_ROOT)]))
    return env


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")


def setup_logging(level: int = logging.WARNING) -> None:
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def write_json(path: Path | None, report: Any) -> None:
    """Write ``report`` to ``path`` (nothing when ``path`` is None)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")


def dispatch(prog: str, modes: Mapping[str, tuple[str, str]], argv: list[str],
             default: str | None = None) -> int:
    """Run the mode ``argv[0]`` of ``modes`` (name -> (``module`` or ``module:function``,
    one-line help)) on ``argv[1:]``; without a mode name, ``default`` on all of ``argv``. The
    function (``main`` unless named) takes the arguments and returns the exit status."""
    if argv and argv[0] in modes:
        mode, argv = argv[0], argv[1:]
    elif default is not None and (not argv or argv[0].startswith("-")) \
            and argv[:1] not in (["-h"], ["--help"]):
        mode = default
    else:
        lines = [f"usage: python -m benchmarks {prog} {{{','.join(modes)}}} ..."]
        lines += [f"  {name:12} {help_}" for name, (_, help_) in modes.items()]
        if default:
            lines.append(f"without a mode: {default}")
        print("\n".join(lines), file=sys.stdout if argv[:1] in (["-h"], ["--help"])
              else sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    module, _, function = modes[mode][0].partition(":")
    return getattr(importlib.import_module(module), function or "main")(argv)
