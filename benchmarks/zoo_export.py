"""Export every zoo model to ONNX and check it against torch.

For each model: torch.export (strict=False) succeeds?, ONNX export time, node count, op types,
and the maximum relative error of onnxruntime (CPUExecutionProvider) against the torch FP32
forward.  Relative error of an output is max|ort - torch| / max|torch|; the row reports the
worst output.  Prints a table and writes JSON.

    python -m benchmarks zoo --out-dir /tmp/zoo [--names bert gpt2]
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from tests.models import zoo

log = logging.getLogger("export_zoo_onnx")


def _torch_outputs(model: zoo.ZooModel) -> list[np.ndarray]:
    out = model.run()
    outs = out if isinstance(out, tuple) else (out,)
    return [o.detach().numpy() for o in outs]


def _check_torch_export(model: zoo.ZooModel) -> str:
    """'ok' or the first line of the error: torch.export is what the fx adapter captures."""
    import torch

    try:
        torch.export.export(model.module, model.args, model.kwargs, strict=False)
    except Exception as e:  # report, do not stop: the table shows which models fail
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "ok"


def _max_rel_err(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    errs = []
    for g, w in zip(got, want, strict=True):
        scale = float(np.max(np.abs(w))) or 1.0
        errs.append(float(np.max(np.abs(g.astype(np.float64) - w))) / scale)
    return max(errs)


def _ort_outputs(path: Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def check_model(name: str, out_dir: Path, opset: int) -> dict[str, Any]:
    """Export one model and return its row of the table."""
    import onnx

    model = zoo.build(name)
    row: dict[str, Any] = {"name": name, "torch_export": _check_torch_export(model)}
    path = out_dir / f"{name}.onnx"
    start = time.perf_counter()
    zoo.export_model(model, path, opset=opset)
    row["export_s"] = round(time.perf_counter() - start, 2)
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    ops = collections.Counter(n.op_type for n in proto.graph.node)
    feeds = zoo.onnx_inputs(model, proto)
    row.update(
        nodes=len(proto.graph.node),
        ops=dict(sorted(ops.items())),
        size_kb=round(path.stat().st_size / 1024, 1),
        inputs=list(feeds),
    )
    got = _ort_outputs(path, feeds)
    row["ort_max_rel_err"] = _max_rel_err(got, _torch_outputs(model))
    return row


def _print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'model':<16} {'torch.export':<12} {'export s':>8} {'nodes':>6} {'KB':>7} " \
           f"{'ORT rel err':>11}  ops"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['name']:<16} FAILED: {r['error']}")
            continue
        te = "ok" if r["torch_export"] == "ok" else "FAIL"
        print(f"{r['name']:<16} {te:<12} {r['export_s']:>8.2f} {r['nodes']:>6} "
              f"{r['size_kb']:>7.1f} {r['ort_max_rel_err']:>11.2e}  {' '.join(r['ops'])}")


def _quiet_exporter() -> None:
    """Silence the exporter's known, harmless noise so the table stays readable."""
    import torch  # noqa: F401  (torch sets its loggers' levels on import; override after)

    logging.basicConfig(level=logging.WARNING)
    # Missing optional torchvision ops; constant folding that gives up on a shape.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger("onnxscript").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*LeafSpec", category=FutureWarning)
    # The optimizer's constant folding evaluates T5's log(0) bucket guard with numpy.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="onnx.reference")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=Path("results/zoo_onnx"),
                        help="where the .onnx files go (default: results/zoo_onnx)")
    parser.add_argument("--names", nargs="+", choices=zoo.NAMES, default=list(zoo.NAMES))
    parser.add_argument("--opset", type=int, default=zoo.DEFAULT_OPSET)
    parser.add_argument("--json", type=Path, default=Path("results/export_zoo_onnx.json"),
                        help="JSON results (default: results/export_zoo_onnx.json)")
    parser.add_argument("--tol", type=float, default=1e-4,
                        help="ORT relative error above which the exit status is 1")
    args = parser.parse_args(argv)
    _quiet_exporter()

    rows = []
    total = time.perf_counter()
    for name in args.names:
        try:
            rows.append(check_model(name, args.out_dir, args.opset))
        except Exception as e:  # keep going: one broken model should not hide the others
            log.exception("model %s failed", name)
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"})
    total_s = time.perf_counter() - total
    _print_table(rows)
    print(f"total {total_s:.1f} s for {len(rows)} models")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"opset": args.opset, "total_s": round(total_s, 1),
                                    "models": rows}, indent=1))
    bad = [r["name"] for r in rows if "error" in r or r["ort_max_rel_err"] > args.tol
           or r["torch_export"] != "ok"]
    if bad:
        print(f"problems: {', '.join(bad)}")
    return 1 if bad else 0
