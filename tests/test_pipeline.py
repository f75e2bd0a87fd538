"""Both adapters run their pipeline as named passes on the core's contract
(core/pipeline.py): the report's ``steps`` name every pass in stage order, and a second run
of the pipeline on its own output changes nothing."""
from pathlib import Path

import pytest
import torch

import amp_rewrite
from amp_rewrite.core import pipeline as core_pipeline

EXAMPLE = Path(__file__).parent.parent / "examples" / "transformer_block.onnx"


def _stage_order(steps: list[dict]) -> list[str]:
    stages = [s["stage"] for s in steps]
    return sorted(set(stages), key=stages.index)


def test_the_core_runner_records_each_pass_in_order_and_refuses_unknown_stages():
    record = core_pipeline.Record()
    seen = []
    passes = [core_pipeline.Pass("a", lambda m: seen.append("a") or False),
              core_pipeline.Pass("b", lambda m: seen.append("b") or True)]
    assert core_pipeline.run(object(), "prepare", passes, record) is True
    assert seen == ["a", "b"]
    assert [(p["name"], p["modified"]) for p in record.passes] == [("a", False), ("b", True)]
    assert record.modified("b") and not record.modified("a")
    with pytest.raises(ValueError, match="unknown stage"):
        core_pipeline.run(object(), "emit", [], record)


def test_onnx_steps_are_the_pass_list_and_a_second_run_changes_nothing():
    first = amp_rewrite.rewrite_onnx_model(str(EXAMPLE))
    steps = first.report["steps"]
    assert _stage_order(steps) == ["prepare", "plan", "lower"]
    assert [s["name"] for s in steps] == ["fuse patterns", "infer missing types",
                                          "build precision view", "plan", "pad gemms"]
    assert next(s for s in steps if s["name"] == "plan")["modified"]
    again = amp_rewrite.rewrite_onnx_model(first.proto())
    assert not any(s["modified"] for s in again.report["steps"]), again.report["steps"]


def test_torch_steps_are_the_pass_list_and_a_second_run_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    x = torch.randn(4, 16)
    gm = amp_rewrite.rewrite(model, (x,), device="cuda", emulate_gemms=False)
    steps = gm.amp_report["steps"]
    assert _stage_order(steps) == ["prepare", "plan", "lower"]
    names = [s["name"] for s in steps]
    assert names.index("inline modules") < names.index("plan") < names.index("pad gemms")
    assert names[-1] == "fuse pointwise"
    assert next(s for s in steps if s["name"] == "plan")["modified"]
    amp_rewrite.fx.rewrite_graph(gm, device="cuda", emulate_gemms=False)
    changed = {s["name"] for s in gm.amp_report["steps"] if s["modified"]}
    # a second run first undoes its own fusion and low kernels, then redoes them: the plan
    # itself finds nothing to change
    assert "plan" not in changed, gm.amp_report["steps"]
