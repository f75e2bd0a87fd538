"""Every benchmark command (``python -m benchmarks ...``) answers ``--help`` with exit status 0
(and a wrong name with 2)."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.__main__ import SUBCOMMANDS, main


def _status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:  # argparse's --help
        return stop.code or 0


def _commands() -> list[list[str]]:
    commands = [[]]
    for name, module in SUBCOMMANDS.items():
        commands.append([name])
        modes = getattr(importlib.import_module(module), "MODES", None)
        if isinstance(modes, dict):
            commands += [[name, mode] for mode in modes]
    return commands


@pytest.mark.parametrize("command", _commands(), ids=lambda c: " ".join(c) or "benchmarks")
def test_help_exits_0(command, capsys):
    assert _status([*command, "--help"]) == 0
    assert "usage" in capsys.readouterr().out.lower()


def test_an_unknown_subcommand_exits_2(capsys):
    assert _status(["no-such-benchmark"]) == 2
    assert "usage" in capsys.readouterr().err


def test_python_m_benchmarks_runs_from_the_checkout():
    done = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m benchmarks")
