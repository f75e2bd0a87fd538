"""Rule files: packaged defaults, overlays, environment variables, and clear errors."""
from __future__ import annotations

import os

import pytest

from amp_rewrite.core import OpClass, load_rules, parse_rule_file
from amp_rewrite.errors import RuleFileError


def write(tmp_path, text, name="r.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_packaged_onnx_rules_load():
    rules = load_rules("onnx", env={})
    assert rules.class_of("MatMul") is OpClass.ALLOW
    assert rules.class_of("Exp") is OpClass.DENY
    assert rules.classify("MatMul").source.endswith("onnx.toml")


def test_overlay_file_moves_op_to_its_class(tmp_path):
    path = write(tmp_path, 'schema = 1\n[deny]\nMatMul = "test: keep GEMMs fp32"\n')
    rules = load_rules("onnx", [path], env={})
    assert rules.class_of("MatMul") is OpClass.DENY
    assert rules.classify("MatMul").source == str(path)


def test_env_file_list_and_add_remove(tmp_path):
    a = write(tmp_path, 'schema = 1\n[allow]\n"my::op" = "fast"\n', "a.toml")
    b = write(tmp_path, 'schema = 1\n[gray]\n"my::op" = "later file wins"\n', "b.toml")
    env = {"AMP_REWRITE_RULES": os.pathsep.join([str(a), str(b)]),
           "AMP_REWRITE_ALLOW_ADD": "MyOp, Other",
           "AMP_REWRITE_ALLOW_REMOVE": "Other",
           "AMP_REWRITE_DENY_REMOVE": "Exp"}
    rules = load_rules("onnx", env=env)
    assert rules.class_of("my::op") is OpClass.GRAY
    assert rules.class_of("MyOp") is OpClass.ALLOW
    assert rules.classify("MyOp").source == "$AMP_REWRITE_ALLOW_ADD"
    assert rules.class_of("Other") is OpClass.UNLISTED  # ADD then REMOVE
    assert rules.class_of("Exp") is OpClass.UNLISTED


def test_remove_only_touches_its_own_class():
    rules = load_rules("onnx", env={"AMP_REWRITE_GRAY_REMOVE": "MatMul"})
    assert rules.class_of("MatMul") is OpClass.ALLOW


@pytest.mark.parametrize("text, needle", [
    ('schema = 1\n[allow]\nA = "x"\n[deny]\nA = "y"\n', "both [allow] and [deny]"),
    ('schema = 1\n[fast]\nA = "x"\n', "unknown class [fast]"),
    ('schema = 1\n[allow]\nA = 3\n', "non-empty reason"),
    ('[allow]\nA = "x"\n', "'schema' must be 1"),
    ('schema = 1\n[allow\nA = "x"\n', "not valid TOML"),
])
def test_malformed_rule_files_name_file_and_key(tmp_path, text, needle):
    path = write(tmp_path, text)
    with pytest.raises(RuleFileError) as info:
        parse_rule_file(path)
    assert needle in str(info.value) and str(path) in str(info.value)


def test_missing_rule_file(tmp_path):
    with pytest.raises(RuleFileError, match="not found"):
        load_rules("onnx", [tmp_path / "nope.toml"], env={})


def test_every_variable_the_package_reads_is_known():
    """A variable the package reads (found in its source) is never warned as misspelt."""
    import re
    from pathlib import Path

    import amp_rewrite
    from amp_rewrite.core.rules import ENV_PREFIX, known_env_vars

    root = Path(amp_rewrite.__file__).parent
    read = {name for path in root.rglob("*.py")
            for name in re.findall(r'"(AMP_REWRITE_[A-Z_]+)"', path.read_text())
            if not name.endswith("_") and name != ENV_PREFIX}
    assert "AMP_REWRITE_FORK" in read  # the scan finds the variables it is meant to find
    assert read - set(known_env_vars()) == set()


def test_pin_tables_fix_named_groups_with_their_reasons(tmp_path):
    from amp_rewrite.core import GroupInfo, Precision, PrecisionGraph, plan_precision

    overlay = tmp_path / "pins.toml"
    overlay.write_text('schema = 1\n[keep_fp32]\n"mm[*]" = "budget said so"\n'
                       '[keep_low]\n"exp_1" = "measured fine"\n')
    rules = load_rules("onnx", [overlay], env={})
    g = PrecisionGraph()
    for v in "xyz":
        g.add_value(v, nbytes=64)
    g.add_source("in", "x", name="x", fixed=Precision.HIGH)
    g.add_group(GroupInfo("mm", "mm", "mm*", "MatMul"), ["x"], ["y"])  # allow: low by class
    g.add_group(GroupInfo("exp", "exp", "exp_1", "Exp"), ["y"], ["z"])  # deny: high by class
    g.add_sink("out", "z", name="out", fixed=Precision.HIGH)
    plan = plan_precision(g, rules)
    assert plan.precision("mm") is Precision.HIGH and "budget said so" in plan.decisions["mm"].reason
    assert plan.precision("exp") is Precision.LOW and "measured fine" in plan.decisions["exp"].reason


@pytest.mark.parametrize("table", ["keep_fp32", "keep_low"])
def test_pin_tables_need_reason_strings(tmp_path, table):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'schema = 1\n[{table}]\n"node_1" = 3\n')
    with pytest.raises(RuleFileError, match=f"{table}.*node_1"):
        load_rules("onnx", [bad], env={})
