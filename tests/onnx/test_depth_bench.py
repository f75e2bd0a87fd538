"""python -m benchmarks speed deep runs end to end on a shallow export; its figures are in README."""
from __future__ import annotations

import json

import pytest

from benchmarks import deep_speed

pytestmark = pytest.mark.slow  # exports a zoo model and runs every converter on it


@pytest.fixture()
def depth_bench():
    return deep_speed


def test_depth_bench_times_every_converter_on_a_valid_export(depth_bench, tmp_path, capsys):
    out = tmp_path / "depth.json"
    assert depth_bench.main(["--models", "bert", "--layers", "2", "--repeats", "1",
                             "--cache", str(tmp_path / "cache"), "--json", str(out)]) == 0
    rows = {r["converter"]: r for r in json.loads(out.read_text())["rows"]}
    # onnxconverter-common is a bench extra; onnxruntime (and its converter) is always here
    assert {"amp_rewrite", "amp_rewrite --no-fuse", "ort_transformers"} <= set(rows)
    assert any(c.startswith("ort_optimizer[") for c in rows), "ORT's optimizer fits BERT"
    ours, plain = rows["amp_rewrite"], rows["amp_rewrite --no-fuse"]
    assert ours["layers"] == 2 and ours["vs_amp_rewrite"] == 1.0
    for row in (ours, plain):  # against the FP32 export, computed by onnxruntime
        assert not row["invalid"] and not row["new_nonfinite"] and row["max_rel"] <= 1e-2
    # fusion replaced chains by onnxruntime's fused ops; without it there are none
    assert ours["fused"] > 0 == plain["fused"]
    assert "amp_rewrite --no-fuse" in capsys.readouterr().out
