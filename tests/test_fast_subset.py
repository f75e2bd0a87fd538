"""The fast subset (``pytest -m "not slow"``, docs/testing.md) still reaches every product module.

Checked statically, so the answer does not depend on which xdist worker ran which test, on the
order of the tests, or on what the test process happened to import before: every module under
``amp_rewrite/`` (the product; benchmarks live outside it) must be imported,
directly or through the product's own imports, by a test file that has at least one test not
marked ``slow`` (by its own marks or by ``SLOW`` in tests/conftest.py). Imports inside
functions count; ``importlib.import_module("...")`` counts; a name of the lazy table of
``amp_rewrite/__init__.py`` counts where the file uses it (``amp_rewrite.rewrite``,
``from amp_rewrite import rewrite``), not for a bare ``import amp_rewrite``. Each module must
also import cleanly.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from tests import conftest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "amp_rewrite"
LAZY: dict[str, str] = importlib.import_module("amp_rewrite")._LAZY  # attribute -> module


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        found[_module_name(path)] = path
    return found


def imported_names(path: Path, known: set[str]) -> set[str]:
    """Modules of ``known`` that ``path`` imports anywhere (with their parent packages)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
            if node.module == "amp_rewrite" and not node.level:
                names.update(LAZY[a.name] for a in node.names if a.name in LAZY)
        elif isinstance(node, ast.Attribute) and node.attr in LAZY \
                and isinstance(node.value, ast.Name) and node.value.id == "amp_rewrite":
            names.add(LAZY[node.attr])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" \
                and node.args and isinstance(node.args[0], ast.Constant):
            names.add(str(node.args[0].value))
    reached = set()
    for name in names:
        parts = name.split(".")
        reached.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return reached & known


def _is_slow_mark(node: ast.expr) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "slow" for n in ast.walk(node))


def fast_tests(path: Path) -> list[str]:
    """The test functions of ``path`` that ``-m "not slow"`` keeps (some parameters may not)."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            if _is_slow_mark(node.value):
                return []
    if rel in conftest.SLOW:
        return []

    def tests_in(body, prefix: str, slow: bool):
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
                yield from tests_in(node.body, f"{prefix}{node.name}::",
                                    slow or any(map(_is_slow_mark, node.decorator_list)))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and node.name.startswith("test"):
                nodeid = f"{rel}::{prefix}{node.name}"
                if not (slow or any(map(_is_slow_mark, node.decorator_list))
                        or any(nodeid == s or nodeid.startswith(s + "::") for s in conftest.SLOW)):
                    yield nodeid
    return list(tests_in(tree.body, "", False))


def _helpers(path: Path) -> list[Path]:
    """The conftest files above a test file and the tests/ modules it imports (fixtures, models)."""
    tests = ROOT / "tests"
    found = [d / "conftest.py" for d in [path.parent, *path.parent.parents]
             if d.is_relative_to(tests) and (d / "conftest.py").exists()]
    local = {_module_name(p): p for p in tests.rglob("*.py")}
    queue = [path]
    while queue:
        for name in imported_names(queue.pop(), set(local)) - {_module_name(p) for p in found}:
            found.append(local[name])
            queue.append(local[name])
    return found


def reached_by_fast_tests() -> tuple[set[str], dict[str, set[str]]]:
    modules = product_modules()
    known = set(modules)
    graph = {name: imported_names(path, known) for name, path in modules.items()}
    direct: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if fast_tests(path):
            names = set().union(*(imported_names(p, known) for p in [path, *_helpers(path)]))
            direct[path.relative_to(ROOT).as_posix()] = names
    reached: set[str] = set()
    queue = list(set().union(*direct.values()))
    while queue:
        name = queue.pop()
        if name not in reached:
            reached.add(name)
            queue.extend(graph[name] - reached)
    return reached, direct


def test_every_product_module_is_imported_by_a_fast_test_file():
    modules = product_modules()
    assert len(modules) > 40  # the walk found the package
    reached, _ = reached_by_fast_tests()
    missing = sorted(set(modules) - reached)
    assert not missing, (
        f"no test file with a fast test imports {missing}: add a fast test that exercises each, "
        "or take the test that does out of tests/conftest.py's SLOW (docs/testing.md)")


@pytest.mark.parametrize("name", sorted(product_modules()))
def test_every_product_module_imports(name):
    importlib.import_module(name)
