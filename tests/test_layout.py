"""docs/design.md §13: the product never depends on what measures it (``amp_rewrite.bench``)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "amp_rewrite"


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_adapters_and_core_never_import_bench():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.parent.name == "bench":
            continue
        if any(m.startswith("amp_rewrite.bench") for m in _imported_modules(path)):
            offenders.append(str(path.relative_to(PACKAGE)))
    assert offenders == []


def test_importing_the_product_loads_no_bench_module():
    code = ("import sys, amp_rewrite, amp_rewrite.onnx, amp_rewrite.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('amp_rewrite.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
