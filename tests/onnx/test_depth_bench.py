"""tools/bench_onnx_depth.py runs end to end on a shallow export; its figures are in README."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture()
def depth_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(_TOOLS))  # it imports bench_onnx_speed as a script does
    spec = importlib.util.spec_from_file_location("bench_onnx_depth", _TOOLS / "bench_onnx_depth.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_onnx_depth", module)
    spec.loader.exec_module(module)
    return module


def test_depth_bench_times_every_converter_on_a_valid_export(depth_bench, tmp_path, capsys):
    out = tmp_path / "depth.json"
    assert depth_bench.main(["--models", "bert", "--layers", "2", "--repeats", "1",
                             "--cache", str(tmp_path / "cache"), "--out", str(out)]) == 0
    rows = {r["converter"]: r for r in json.loads(out.read_text())}
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
