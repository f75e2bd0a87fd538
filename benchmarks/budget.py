"""The accuracy budget on ONNX models: ``--max-error`` against calibration thresholds and
ModelOpt AutoCast.

Per model × dtype × budget E, one row:

* ours: ``rewrite_onnx_model(max_error=E, calibration_data=feeds)``: the error on the
  inputs searched, on the held-out inputs under the emulation, onnxruntime (fp16) and true
  rounding (``onnx.reference`` on the rewritten model; skipped above
  ``REFERENCE_MAX_PARAMS``), the FLOP-weighted low-precision share of the output model,
  evaluations, seconds, whether E is reachable;
* the default rules with ``--calibrate`` (no budget), and the calibration threshold swept,
  keeping the plan of highest share whose error on the search inputs is within E;
* ModelOpt AutoCast given the same calibration data (in its own interpreter,
  ``peers._modelopt_python``).

Calibration data: ``ROWS`` seeded input rows on exports with a free batch dim, which the
API splits into search and held-out halves; the baselines are measured on the same halves.
The baselines' errors use true rounding (``onnx.reference``) where the model is small enough
and onnxruntime (fp16) otherwise. One share function (``low_flop_share``) serves every output
model: per main-graph node (Casts and constants aside), FLOPs from concrete shapes
(``core.flops.op_flops``, as the budget counts), low when the node's float outputs (else
inputs) are fp16/bf16.

    python -m benchmarks budget [--models ...] [--dtypes fp16,bf16]
        [--budgets 1e-2,1e-3] [--json FILE] [--quick]
"""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from benchmarks.cli import write_json
from tests.models import trained, zoo

logger = logging.getLogger(__name__)

ZOO_MODELS = ("bert", "gpt2", "llama", "t5", "vit", "resnet")
HOT_MODELS = ("t5-hot", "llama-hot")
TRAINED_LIKE = ("gpt2-offset",)
COST_MODEL = "bert-base"
DEFAULT_MODELS = (*ZOO_MODELS, *HOT_MODELS, *TRAINED_LIKE)
ROWS = 8  # calibration rows; the API searches the first half and holds out the second
FEED_SEED = 1  # the inputs' seed (the weights use seed 0)
THRESHOLDS = {"float16": (4096.0, 512.0, 64.0, 8.0, 1.0),
              "bfloat16": (1e37, 4096.0, 64.0, 8.0, 1.0)}
REFERENCE_MAX_PARAMS = 20_000_000  # onnx.reference runs above this take minutes
OFFSET = 1000.0  # gpt2-offset: the constant added to every channel of the residual stream
BERT_BASE = {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 12,
             "num_attention_heads": 12, "intermediate_size": 3072,
             "max_position_embeddings": 512}
BERT_BASE_SEQ = 128
_EXPORT_VERSION = 1  # bump when the exports below change
_DTYPES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16"}
_LOW = {onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}
_FLOAT = {onnx.TensorProto.FLOAT, *_LOW}
_NOT_COMPUTE = {"Cast", "CastLike", "Constant"}


# ----------------------------------------------------------------------------- the share


def low_flop_share(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]
                   ) -> tuple[float, float, float]:
    """(share, low FLOPs, all FLOPs) of ``model`` run on ``feeds``: main-graph nodes with a
    float input or output (Cast, CastLike and Constant aside), each weighted by
    ``core.flops.op_flops`` on concrete shapes; low when its float outputs are fp16/bf16
    (a node without float outputs: its float inputs)."""
    from amp_rewrite.core.flops import op_flops

    shapes = concrete_shapes(model, feeds)
    dtypes = value_dtypes(model)
    low = total = 0.0
    for node in model.graph.node:
        if node.op_type in _NOT_COMPUTE:
            continue
        outs = [dtypes.get(o, 0) for o in node.output if o]
        ins = [dtypes.get(i, 0) for i in node.input if i]
        float_outs = [t for t in outs if t in _FLOAT]
        decided = float_outs or [t for t in ins if t in _FLOAT]
        if not decided:
            continue
        flops = op_flops(node.op_type, [shapes.get(i) if i else None for i in node.input],
                         [shapes.get(o) for o in node.output])
        total += flops
        if all(t in _LOW for t in decided):
            low += flops
    return (low / total if total else 0.0), low, total


def value_dtypes(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every main-graph value: inputs, initializers, node outputs
    (contrib ops included: the rewrite's own type propagation)."""
    from amp_rewrite.onnx import load
    from amp_rewrite.onnx.passes import infer_missing_types

    ir_model = load.load_model(onnx.ModelProto.FromString(model.SerializeToString())).model
    infer_missing_types(ir_model)
    graph = ir_model.graph
    types = {v.name: int(v.dtype) for v in graph.inputs if v.dtype is not None}
    types.update({n: int(v.dtype) for n, v in graph.initializers.items()
                  if v.dtype is not None})
    for node in graph:
        for v in node.outputs:
            if v.dtype is not None and v.name:
                types[v.name] = int(v.dtype)
    return types


def concrete_shapes(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]
                    ) -> dict[str, tuple[int, ...]]:
    """Shape of every main-graph value of ``model`` on ``feeds``, from one onnxruntime CPU
    run of a float32 copy (every fp16/bf16 type, initializer and Cast target made float32:
    the shapes are those of the model, and the CPU provider runs it whatever the low dtype)."""
    import onnx_ir as ir

    from amp_rewrite.onnx import validate
    from amp_rewrite.onnx.passes import infer_missing_types

    ir_model = ir.from_proto(as_float32(model))
    infer_missing_types(ir_model)
    graph = ir_model.graph
    existing = {v.name for v in graph.outputs}
    extra = [v for n in graph for v in n.outputs
             if v.name and v.name not in existing and v.dtype is not None]
    graph.outputs.extend(extra)
    proto = ir.to_proto(ir_model)
    names = {i.name for i in proto.graph.input}
    run_feeds = {k: np.asarray(v) for k, v in validate.as_declared(proto, {
        k: v for k, v in feeds.items() if k in names}).items()}
    session = validate.session(proto)
    fetch = [o.name for o in session.get_outputs()]
    shapes = {n: tuple(np.shape(a)) for n, a in zip(fetch, session.run(fetch, run_feeds))}
    shapes.update({k: tuple(np.shape(v)) for k, v in run_feeds.items()})
    for init in model.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def as_float32(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` with every fp16/bf16 type made float32 (main graph)."""
    from onnx import numpy_helper

    out = onnx.ModelProto.FromString(model.SerializeToString())
    g = out.graph
    for i, t in enumerate(g.initializer):
        if t.data_type in _LOW:
            new = numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float32), t.name)
            g.initializer[i].CopyFrom(new)
    for v in (*g.input, *g.output):
        if v.type.tensor_type.elem_type in _LOW:
            v.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    del g.value_info[:]
    for node in g.node:
        for a in node.attribute:
            if a.name in ("to", "dtype") and a.type == onnx.AttributeProto.INT and a.i in _LOW:
                a.i = onnx.TensorProto.FLOAT
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in _LOW:
                a.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(a.t).astype(np.float32), a.t.name))
    return out


# ----------------------------------------------------------------------------- models


def _export_path(key: str) -> Path:
    return zoo.default_cache_dir() / f"budget{_EXPORT_VERSION}-{key}-batch-{zoo._cache_tag()}.onnx"


def _export_batch_dynamic(model: zoo.ZooModel, path: Path) -> Path:
    """Export with a symbolic batch dim on every input (the rest static: T5's two sequence
    lengths cannot share zoo's ``dynamic=True`` sequence dim), then give graph outputs that
    nodes also read an Identity of their own (``_separate_read_outputs``)."""
    import torch
    from torch.export import Dim

    from benchmarks.zoo_export import _quiet_exporter

    _quiet_exporter()
    batch = Dim("batch", min=1, max=1024)
    shapes = {name: {0: batch} for name in model.named_inputs()}
    path.parent.mkdir(parents=True, exist_ok=True)
    program = torch.onnx.export(model.module, model.args, kwargs=model.kwargs or None,
                                dynamo=True, opset_version=zoo.DEFAULT_OPSET,
                                external_data=False, verbose=False, dynamic_shapes=shapes)
    # a name of its own: two test workers may export the same model at once
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        tmp = Path(folder) / "raw.onnx"
        zoo.save_program(program, tmp)
        proto = _separate_read_outputs(onnx.load(str(tmp)))
    fd, partial = tempfile.mkstemp(suffix=".onnx.tmp", dir=path.parent)
    os.close(fd)
    onnx.save(proto, partial)
    os.replace(partial, path)
    return path


def _separate_read_outputs(proto: onnx.ModelProto) -> onnx.ModelProto:
    """Graph outputs that nodes also read (BERT's last hidden state, read by the pooler)
    become an Identity of the value: the budget's emulator fails on such outputs
    (``SerdeError: Output '<name>.low' is redeclared``)."""
    read = {i for n in proto.graph.node for i in n.input}
    for out in proto.graph.output:
        if out.name in read:
            new = f"{out.name}.output"
            proto.graph.node.append(onnx.helper.make_node(
                "Identity", [out.name], [new], name=f"{out.name}.output_identity"))
            out.name = new
    return proto


def _build(key: str) -> zoo.ZooModel:
    """The torch model of ``key`` (weights from seed 0)."""
    import torch

    from tests.models import hot

    if key.endswith("-hot"):
        return hot.hot_variant(key.removesuffix("-hot"), 3e5)
    if key == "gpt2-offset":
        return _offset_gpt2()
    if key == COST_MODEL:
        model = zoo.build("bert", config=BERT_BASE)
        ids, mask = _bert_base_inputs(torch.Generator().manual_seed(0), 2)
        model.args = (ids, mask)
        return model
    return zoo.build(key)


def _offset_gpt2() -> zoo.ZooModel:
    """GPT-2 with a residual stream of large magnitude: the weights at trained scale
    (``hot._trained_scale``, token embeddings std 1) and ``OFFSET`` added to every channel
    of the position embeddings. Every LayerNorm removes the offset (the FP32 output is the
    un-offset model's to ~1e-7), but a residual stream near 1000 stored in fp16 keeps ~0.5
    of absolute precision (0.03 in bf16 steps of 8): the O(1) signal the LayerNorms
    extract loses a percent or more. The calibration threshold (4096) never sees it."""
    import torch

    from tests.models import hot

    model = zoo.build("gpt2")
    hot._trained_scale(model.module, 0)
    gen = torch.Generator().manual_seed(0)
    transformer = model.module.model.transformer
    with torch.no_grad():
        transformer.wte.weight.copy_(torch.randn(transformer.wte.weight.shape, generator=gen))
        transformer.wpe.weight.add_(OFFSET)
    model.name = "gpt2-offset"
    return model


def _bert_base_inputs(gen, batch: int):
    import torch

    ids = torch.randint(4, BERT_BASE["vocab_size"], (batch, BERT_BASE_SEQ), generator=gen)
    mask = torch.ones(batch, BERT_BASE_SEQ, dtype=torch.int64)
    mask[-1, BERT_BASE_SEQ - BERT_BASE_SEQ // 4:] = 0
    return ids, mask


def model_path(key: str) -> Path:
    """The batch-dynamic FP32 export of ``key``, exported on first use."""
    if key in trained.MODELS:  # trained by someone else: the file its wheel ships
        return trained.path(key)
    path = _export_path(key)
    if not path.is_file():
        logger.info("exporting %s to %s", key, path)
        _export_batch_dynamic(_build(key), path)
    return path


def feeds_for(key: str, path: Path, rows: int = ROWS) -> dict[str, np.ndarray]:
    """``rows`` seeded input rows (seed ``FEED_SEED``), keyed by ONNX input name."""
    import torch

    if key in trained.MODELS:
        return trained.inputs(key, rows, FEED_SEED)
    if key == COST_MODEL:
        ids, mask = _bert_base_inputs(torch.Generator().manual_seed(FEED_SEED), rows)
        return {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    base = key.removesuffix("-hot").removesuffix("-offset")
    return zoo.onnx_inputs(zoo.build(base, seed=FEED_SEED, batch=rows), path)


def param_count(model: onnx.ModelProto) -> int:
    return sum(math.prod(t.dims) for t in model.graph.initializer)


# ----------------------------------------------------------------------------- errors


def _worst(reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray]) -> float:
    """The product's metric (``core.metric``), outputs matched by position as ``--validate``
    matches them."""
    from amp_rewrite.core.metric import worst_relative_error

    return worst_relative_error(list(reference.values()), list(got.values()))


class Measure:
    """Errors of output models against the FP32 model on one set of inputs."""

    def __init__(self, fp32: onnx.ModelProto, feeds: Mapping[str, np.ndarray],
                 true_rounding: bool) -> None:
        from amp_rewrite.onnx import validate

        self.feeds = dict(feeds)
        self.reference = validate.run(fp32, self.feeds)
        self.true_rounding = true_rounding

    def ort(self, model: onnx.ModelProto) -> float:
        from amp_rewrite.onnx import validate

        return _worst(self.reference, dict(zip(self.reference, validate.session(model).run(
            None, validate.as_declared(model, self.feeds)))))

    def rounded(self, model: onnx.ModelProto) -> float:
        """True rounding (``onnx.reference``)."""
        from amp_rewrite.onnx import validate

        return _worst(self.reference, validate.reference_run(
            model, validate.as_declared(model, self.feeds)))

    def best(self, model: onnx.ModelProto, dtype: str) -> tuple[float | None, str]:
        """(error, how): true rounding where affordable, else onnxruntime for fp16."""
        if self.true_rounding:
            return self.rounded(model), "onnx.reference"
        if dtype == "float16":
            return self.ort(model), "onnxruntime"
        return None, "none (bf16 too large for onnx.reference, no onnxruntime CPU kernels)"


# ----------------------------------------------------------------------------- converters


_MODELOPT_CHECK = "import modelopt.onnx.autocast"


def modelopt_python() -> tuple[str | None, str | None]:
    """(interpreter, None) if ModelOpt AutoCast imports there, else (None, why not)."""
    from benchmarks.peers import _modelopt_python

    python = _modelopt_python() or sys.executable
    if not Path(python).exists():
        return None, f"not installed ({python} missing)"
    done = subprocess.run([python, "-c", _MODELOPT_CHECK], capture_output=True, text=True,
                          timeout=300, check=False)
    if done.returncode:
        return None, f"not installed ({(done.stderr.strip().splitlines() or ['?'])[-1]})"
    return python, None


def convert_modelopt(python: str, path: Path, feeds: Mapping[str, np.ndarray], dtype: str
                     ) -> tuple[onnx.ModelProto, float]:
    """ModelOpt AutoCast (``deployed._MODELOPT``) calibrated on ``feeds``; (model, seconds)."""
    from benchmarks.deployed import _MODELOPT

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "feeds.npz"
        np.savez(data, **feeds)
        out = Path(tmp) / "out.onnx"
        start = time.perf_counter()
        done = subprocess.run([python, "-c", _MODELOPT, str(path), str(data), dtype, str(out)],
                              capture_output=True, text=True, timeout=900, check=False)
        seconds = time.perf_counter() - start
        if done.returncode:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            raise RuntimeError(f"modelopt failed: {last[:300]}")
        return onnx.load(str(out)), seconds


# ----------------------------------------------------------------------------- rows


def _num(x) -> float | str | None:
    if x is None:
        return None
    if isinstance(x, str):
        return x
    return "inf" if math.isinf(x) else float(f"{x:.4g}")


def _baselines(key: str, path: Path, dtype: str, feeds, search: Measure, held: Measure,
               modelopt: tuple[str | None, str | None], thresholds) -> dict[str, Any]:
    """What does not depend on E: the default plan with and without calibration, the
    threshold sweep (errors on both halves) and ModelOpt."""
    from amp_rewrite.onnx import rewrite_onnx_model

    out: dict[str, Any] = {}
    plain = rewrite_onnx_model(str(path), dtype=dtype).proto()
    out["default_no_calibration"] = {"held_out": _num(held.best(plain, dtype)[0]),
                                     "share": round(low_flop_share(plain, held.feeds)[0], 4)}
    sweep = []
    for t in thresholds:
        try:
            proto = rewrite_onnx_model(str(path), dtype=dtype, calibration_data=feeds,
                                       calibration_threshold=t).proto()
            err_search, how = search.best(proto, dtype)
            err_held, _ = held.best(proto, dtype)
            sweep.append({"threshold": t, "search": err_search, "held_out": err_held,
                          "share": low_flop_share(proto, held.feeds)[0], "metric": how})
        except Exception as e:  # noqa: BLE001 - one failing plan must not hide the others
            logger.exception("%s %s threshold %g failed", key, dtype, t)
            sweep.append({"threshold": t, "failed": f"{type(e).__name__}: {e}"[:300]})
    out["sweep"] = sweep
    python, why = modelopt
    if python is None:
        out["modelopt"] = {"status": why}
    else:
        try:
            proto, seconds = convert_modelopt(python, path, feeds, dtype)
            err, how = held.best(proto, dtype)
            out["modelopt"] = {"status": "ok", "held_out": _num(err), "metric": how,
                               "share": round(low_flop_share(proto, held.feeds)[0], 4),
                               "seconds": round(seconds, 1)}
        except Exception as e:  # noqa: BLE001 - report, keep going
            logger.warning("%s %s: ModelOpt failed: %s", key, dtype, e)
            out["modelopt"] = {"status": f"failed: {str(e)[:300]}"}
    return out


def _pick(sweep: list[dict], budget: float) -> dict | None:
    """The sweep's plan of highest share whose error on the search inputs is within E."""
    ok = [s for s in sweep if "failed" not in s and s["search"] is not None
          and s["search"] <= budget]
    return max(ok, key=lambda s: (s["share"], s["threshold"]), default=None)


def _ours(path: Path, dtype: str, feeds, budget: float, held: Measure,
          max_evaluations: int) -> dict[str, Any]:
    from amp_rewrite.onnx import rewrite_onnx_model

    start = time.perf_counter()
    result = rewrite_onnx_model(str(path), dtype=dtype, calibration_data=feeds,
                                max_error=budget, max_evaluations=max_evaluations)
    wall = time.perf_counter() - start
    b = result.report["budget"]
    proto = result.proto()
    row = {"achieved": b["achieved"], "held_out": b["held_out"],
           "held_out_onnxruntime": b.get("held_out_onnxruntime"),
           "held_out_reference": None, "reference": "skipped",
           "share": round(low_flop_share(proto, held.feeds)[0], 4),
           "search_share": b["low_flop_share"], "evaluations": b["evaluations"],
           "search_seconds": b["seconds"], "seconds": round(wall, 2),
           "reachable": b["reachable"], "default_plan_error": b["default_plan_error"],
           "all_pinned_error": b["all_pinned_error"], "pinned": len(result.pinned_by_budget),
           "inputs": b["inputs"], "held_out_inputs": b["held_out_inputs"]}
    if held.true_rounding:
        row["held_out_reference"] = _num(held.rounded(proto))
        row["reference"] = "onnx.reference"
    else:
        row["reference"] = f"skipped (> {REFERENCE_MAX_PARAMS / 1e6:.0f}M parameters)"
    return row


def model_rows(key: str, dtypes: list[str], budgets: list[float], *, peers: bool = True,
               thresholds: Mapping[str, tuple] = THRESHOLDS,
               max_evaluations: int = 25) -> list[dict[str, Any]]:
    """The rows of one model: per dtype, the baselines once, then ours per budget."""
    from amp_rewrite.onnx.budget import default_feeds

    path = model_path(key)
    fp32 = onnx.load(str(path))
    feeds = feeds_for(key, path)
    params = param_count(fp32)
    small = params <= REFERENCE_MAX_PARAMS
    search_feeds, held_feeds, _, _ = default_feeds(fp32, feeds)
    search, held = Measure(fp32, search_feeds, small), Measure(fp32, held_feeds, small)
    modelopt = modelopt_python() if peers else (None, "not run (--no-peers)")
    rows = []
    for dtype in dtypes:
        base_row = {"model": key, "dtype": dtype, "params": params}
        try:
            base = _baselines(key, path, dtype, feeds, search, held, modelopt,
                              thresholds[dtype])
        except Exception as e:  # noqa: BLE001 - report the model, keep going
            logger.exception("%s %s: baselines failed", key, dtype)
            base = {"failed": f"{type(e).__name__}: {e}"[:300]}
        default = next((s for s in base.get("sweep", ())
                        if s.get("threshold") == thresholds[dtype][0]), None)
        for budget in budgets:
            row = {**base_row, "max_error": budget}
            try:
                row["ours"] = _ours(path, dtype, feeds, budget, held, max_evaluations)
            except Exception as e:  # noqa: BLE001
                logger.exception("%s %s %g: budget failed", key, dtype, budget)
                row["ours"] = {"failed": f"{type(e).__name__}: {e}"[:300]}
            if "failed" in base:
                row["baselines"] = base
            else:
                picked = _pick(base["sweep"], budget)
                row["default_calibrated"] = _clean(default)
                row["best_threshold"] = _clean(picked) if picked else {
                    "status": "no threshold meets E on the search inputs"}
                row["default_no_calibration"] = base["default_no_calibration"]
                row["modelopt"] = base["modelopt"]
                row["sweep"] = [_clean(s) for s in base["sweep"]]
            rows.append(row)
            print(format_row(row), flush=True)
    return rows


def _clean(entry: dict | None) -> dict | None:
    if entry is None:
        return None
    return {k: (_num(v) if isinstance(v, float) else v) for k, v in entry.items()}


def cost_row(max_evaluations: int = 25, budget: float = 1e-3) -> dict[str, Any]:
    """BERT-base (12 layers, hidden 768, seq 128, random weights) at fp16 and ``budget``:
    evaluations and wall time of the search (goal: ≤ 25 and ≤ 3 minutes)."""
    from amp_rewrite.onnx import rewrite_onnx_model

    path = model_path(COST_MODEL)
    fp32 = onnx.load(str(path))
    feeds = feeds_for(COST_MODEL, path)
    start = time.perf_counter()
    result = rewrite_onnx_model(str(path), dtype="float16", calibration_data=feeds,
                                max_error=budget, max_evaluations=max_evaluations)
    wall = time.perf_counter() - start
    b = result.report["budget"]
    from amp_rewrite.onnx.budget import default_feeds

    held = default_feeds(fp32, feeds)[1]
    return {"model": COST_MODEL, "dtype": "float16", "max_error": budget,
            "params": param_count(fp32), "seq": BERT_BASE_SEQ, "rows": ROWS,
            "evaluations": b["evaluations"], "search_seconds": b["seconds"],
            "wall_seconds": round(wall, 1), "achieved": b["achieved"],
            "held_out": b["held_out"], "held_out_onnxruntime": b.get("held_out_onnxruntime"),
            "default_plan_error": b["default_plan_error"], "reachable": b["reachable"],
            "contributions": b["contributions"],
            "share": round(low_flop_share(result.proto(), held)[0], 4),
            "search_share": b["low_flop_share"],
            "meets_goal": b["evaluations"] <= 25 and wall <= 180}


# ----------------------------------------------------------------------------- the table


def _f(x, fmt: str = "{:.1e}") -> str:
    if x is None:
        return "–"
    if isinstance(x, str):
        return x
    return fmt.format(x)


HEADER = ("| model | dtype | E | ours: achieved | held-out emu | held-out ORT | held-out ref "
          "| share | evals | s | reachable | default+calib: held-out | share "
          "| best threshold | held-out | share | ModelOpt: held-out | share "
          "| no calib: held-out |")


def format_row(row: dict) -> str:
    o = row.get("ours", {})
    if "failed" in o:
        ours = f"FAILED: {o['failed'][:80]} | | | | | | | "
    else:
        ours = (f"{_f(o['achieved'])} | {_f(o['held_out'])} | {_f(o['held_out_onnxruntime'])} "
                f"| {_f(o['held_out_reference'])} | {o['share']:.3f} | {o['evaluations']} "
                f"| {o['seconds']:.1f} | {'yes' if o['reachable'] else 'no'} | ")
    if "baselines" in row:
        rest = f"baselines failed: {row['baselines']['failed'][:80]} | | | | | | | |"
    else:
        d = row["default_calibrated"] or {}
        bt = row["best_threshold"]
        mo = row["modelopt"]
        nc = row["default_no_calibration"]
        thr = ("none" if "threshold" not in bt else f"{bt['threshold']:g}")
        mo_cells = (f"{_f(mo.get('held_out'))} | {mo['share']:.3f}" if mo["status"] == "ok"
                    else f"{mo['status'][:40]} | –")
        rest = (f"{_f(d.get('held_out'))} | {_f(d.get('share'), '{:.3f}')} | {thr} "
                f"| {_f(bt.get('held_out'))} | {_f(bt.get('share'), '{:.3f}')} | {mo_cells} "
                f"| {_f(nc['held_out'])} |")
    return f"| {row['model']} | {row['dtype']} | {row['max_error']:g} | {ours}{rest}"


def format_table(rows: list[dict], cost: dict | None = None) -> str:
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [format_row(r) for r in rows]
    if cost is not None:
        lines += ["", "| cost row | dtype | E | params | evaluations | search s | wall s "
                  "| achieved | held-out | held-out ORT | share | goal met |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        if "failed" in cost:
            lines.append(f"| {COST_MODEL} | FAILED: {cost['failed'][:200]} |")
        else:
            c = cost
            lines.append(f"| {c['model']} (seq {c['seq']}, {c['rows']} rows) | fp16 "
                         f"| {c['max_error']:g} | {c['params'] / 1e6:.0f}M | {c['evaluations']} "
                         f"| {c['search_seconds']:.1f} | {c['wall_seconds']:.1f} "
                         f"| {_f(c['achieved'])} | {_f(c['held_out'])} "
                         f"| {_f(c['held_out_onnxruntime'])} | {c['share']:.3f} "
                         f"| {'yes' if c['meets_goal'] else 'no'} |")
    return "\n".join(lines)


def _machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines()
                      if ln.startswith("Model name")), platform.processor())
    except (OSError, subprocess.SubprocessError):
        model = platform.processor()
    return f"{model}, {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks budget",
                                description=__doc__.splitlines()[0])
    p.add_argument("--models", default=None,
                   help=f"comma-separated (default: {','.join(DEFAULT_MODELS)}; also "
                        f"{COST_MODEL}, any zoo model, <t5|llama>-hot)")
    p.add_argument("--dtypes", default="fp16,bf16")
    p.add_argument("--budgets", default="1e-2,1e-3")
    p.add_argument("--max-evaluations", type=int, default=25)
    p.add_argument("--no-peers", dest="peers", action="store_false",
                   help="skip ModelOpt AutoCast")
    p.add_argument("--no-cost", dest="cost", action="store_false",
                   help=f"skip the {COST_MODEL} cost row")
    p.add_argument("--quick", action="store_true",
                   help="CI-sized: bert only, fp16, E=1e-2, two thresholds, no peers or cost row")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    thresholds = dict(THRESHOLDS)
    if args.quick:
        models, dtypes, budgets = ["bert"], ["float16"], [1e-2]
        args.peers = args.cost = False
        thresholds = {k: (v[0], v[-1]) for k, v in THRESHOLDS.items()}
    else:
        models = (args.models.split(",") if args.models else list(DEFAULT_MODELS))
        dtypes = [_DTYPES[d.strip()] for d in args.dtypes.split(",")]
        budgets = [float(b) for b in args.budgets.split(",")]
    command = "python -m benchmarks budget " + " ".join(argv or sys.argv[1:])
    start = time.perf_counter()
    print(HEADER, flush=True)
    rows: list[dict] = []
    for key in models:
        if key == COST_MODEL:
            args.cost = True
            continue
        try:
            rows += model_rows(key, dtypes, budgets, peers=args.peers, thresholds=thresholds,
                               max_evaluations=args.max_evaluations)
        except Exception as e:  # noqa: BLE001 - one broken model must not stop the run
            logger.exception("%s failed", key)
            rows.append({"model": key, "failed": f"{type(e).__name__}: {e}"[:300]})
    cost = None
    if args.cost:
        try:
            cost = cost_row(args.max_evaluations)
        except Exception as e:  # noqa: BLE001
            logger.exception("cost row failed")
            cost = {"failed": f"{type(e).__name__}: {e}"[:300]}
    table = format_table([r for r in rows if "failed" not in r], cost)
    failed = [r for r in rows if "failed" in r]
    print()
    print(table)
    for r in failed:
        print(f"{r['model']}: FAILED {r['failed']}")
    report = {"command": command.strip(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": _machine(), "seconds": round(time.perf_counter() - start, 1),
              "rows_per_calibration": ROWS, "thresholds": thresholds,
              "reference_max_params": REFERENCE_MAX_PARAMS, "rows": rows, "cost": cost,
              "table": table}
    write_json(args.json, report)
    return 1 if failed or any("failed" in r.get("ours", {}) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
