"""Options declared once (core/options.py): the keywords, the CLI flags, the checks and the
signatures all come from the option dataclasses, so they cannot drift apart."""
import dataclasses
import inspect

import pytest
import torch

import amp_rewrite
from amp_rewrite.cli import build_parser
from amp_rewrite.core import options as core_options
from amp_rewrite.fx.options import BUDGET, GRAPH, TorchOptions
from amp_rewrite.onnx.options import RewriteOptions


def test_an_unknown_keyword_names_the_nearest_option_as_a_type_error():
    with pytest.raises(TypeError, match="'keep_fp32'"):
        amp_rewrite.rewrite_onnx_model(b"", keep_fp23=["x"])
    with pytest.raises(TypeError, match="did you mean 'emulate_gemms'"):
        amp_rewrite.rewrite(torch.nn.Linear(2, 2), (torch.ones(1, 2),), emulate_gemm=True)


def test_every_onnx_option_with_a_flag_is_on_the_command_line_with_its_default():
    parser = build_parser()
    flags = {a.dest: a for a in parser._actions}
    for field in dataclasses.fields(RewriteOptions):
        if field.name == "check":  # Python only: the CLI always checks its output
            assert field.name not in flags
            continue
        action = flags[field.name]
        if isinstance(action.default, list):  # repeatable flags collect into a list
            assert tuple(action.default) == field.default
        elif field.name != "dtype":  # the CLI spells the default dtype 'fp16'
            assert action.default == field.default, field.name


def test_flags_and_keywords_give_the_same_checked_options():
    args = build_parser().parse_args(["m.onnx", "--dtype", "bf16", "--low-io", "a.*,b.*",
                                      "--keep-fp32", "x", "--no-pad", "--max-error", "0.01"])
    keywords, names = core_options.from_flags(RewriteOptions, args)
    from_cli = RewriteOptions.of(keywords, names=names)
    from_python = RewriteOptions.of(dict(dtype="bf16", low_io="a.*,b.*", keep_fp32="x",
                                         pad=False, max_error=1e-2))
    assert from_cli == from_python
    assert from_cli.low_io == ("a.*", "b.*") and from_cli.keep_fp32 == ("x",)


def test_a_bad_value_is_named_by_the_spelling_the_user_used():
    args = build_parser().parse_args(["m.onnx", "--max-evaluations", "1"])
    keywords, names = core_options.from_flags(RewriteOptions, args)
    with pytest.raises(core_options.ArgumentError, match="^--max-evaluations=1: expected"):
        RewriteOptions.of(keywords, names=names)
    with pytest.raises(core_options.ArgumentError, match="^max_evaluations=1: expected"):
        RewriteOptions.of({"max_evaluations": 1})


def test_signatures_show_each_option_once_with_its_default():
    onnx_params = inspect.signature(amp_rewrite.rewrite_onnx_model).parameters
    assert [n for n in onnx_params if n not in ("source", "progress")] == [
        f.name for f in dataclasses.fields(RewriteOptions)]
    assert onnx_params["target"].default == "ort"
    graph_params = inspect.signature(amp_rewrite.fx.rewrite_graph).parameters
    assert set(graph_params) - {"gm"} == set(core_options.option_names(
        TorchOptions, (GRAPH, BUDGET)))
    assert "``emulate_gemms`` (default None)" in amp_rewrite.rewrite.__doc__


def test_the_compile_backend_takes_the_graph_options_only():
    from amp_rewrite.fx.backend import BackendOptions

    assert BackendOptions.checked({"dtype": "bf16", "inner": "eager"}).fx.low is torch.bfloat16
    with pytest.raises(TypeError, match="'mode'"):  # capture belongs to dynamo
        BackendOptions.checked({"mode": "train"})
