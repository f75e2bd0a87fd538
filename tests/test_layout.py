"""docs/design.md §13: the product never depends on what measures or tests it.

``benchmarks/`` and ``tests/`` (with the models in ``tests/models/``) run from a checkout; the
wheel holds ``amp_rewrite`` alone, and no module of it imports either.
"""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "amp_rewrite"
OUTSIDE_THE_PRODUCT = ("benchmarks", "tests")


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def _outside(module: str) -> bool:
    return module.split(".")[0] in OUTSIDE_THE_PRODUCT


def test_the_product_imports_neither_benchmarks_nor_tests():
    offenders = sorted(f"{path.relative_to(REPO)}: {module}"
                       for path in PACKAGE.rglob("*.py")
                       for module in _imported_modules(path) if _outside(module))
    assert offenders == []


def test_importing_the_product_loads_no_benchmark_or_test_module():
    code = ("import sys, amp_rewrite, amp_rewrite.onnx, amp_rewrite.fx, amp_rewrite.training, "
            "amp_rewrite.cli; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('benchmarks', 'tests')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_the_wheel_packages_are_the_product_only():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = setuptools["packages"]
    assert packages and all(p == "amp_rewrite" or p.startswith("amp_rewrite.") for p in packages)
    assert not any(_outside(p) or p.startswith("amp_rewrite.bench") for p in packages)
    # the source folders the packages come from lie inside amp_rewrite/ (or rules/)
    sources = [setuptools.get("package-dir", {}).get(p, p.replace(".", "/")) for p in packages]
    assert not any(_outside(s.split("/")[0]) for s in sources)
    assert not (PACKAGE / "bench").exists()
