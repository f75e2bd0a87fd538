"""Where does a fused fp16 model gain or lose accuracy against the unfused one?

Rewrites a zoo model to fp16 with and without fusion, exposes every value both outputs and
the FP32 model compute (the fused chains keep their boundary values' names), runs all three
on several input draws, and prints per value, in graph order, the rms and max relative error
against FP32 of each rewrite (mean over draws) and their ratio fused/unfused.

    AMP_REWRITE_CACHE=... python tools/fusion_error_trace.py vit [--draws 6] [--runtime ort]

``--runtime reference`` (default): onnx.reference, true fp16 rounding at every op.
``--runtime ort``: onnxruntime CPU, which runs most fp16 ops in float32 behind casts it
inserts (see tools/ort_fp16_kernels.py) — the difference between the two is the provider's.
"""
from __future__ import annotations

import argparse
import logging
import sys
import warnings
from collections import defaultdict

import numpy as np
import onnx

import amp_rewrite
from amp_rewrite.bench import zoo
from amp_rewrite.onnx import validate

SKIP = {"Constant", "Shape", "Reshape", "Transpose", "Cast", "Gather", "Unsqueeze", "Squeeze",
        "Concat", "Slice", "Expand", "Equal", "Where", "Range"}


def exposed(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    present = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.helper.make_empty_tensor_value_info(n) for n in names
                              if n not in present)
    return model


def run(model: onnx.ModelProto, feeds: dict, runtime: str) -> dict:
    feeds = validate.as_declared(model, feeds)
    names = [o.name for o in model.graph.output]
    if runtime == "ort":
        return dict(zip(names, validate.session(model).run(None, feeds)))
    return dict(zip(names, validate.reference_evaluator(model).run(None, feeds)))


def errors(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(rms relative, max relative) of ``got`` against ``ref``."""
    ref64, diff = ref.astype(np.float64), got.astype(np.float64) - ref.astype(np.float64)
    scale_rms = max(float(np.sqrt(np.mean(ref64 ** 2))), 1e-30)
    scale_max = max(float(np.abs(ref64).max()), 1e-30)
    return float(np.sqrt(np.mean(diff ** 2))) / scale_rms, float(np.abs(diff).max()) / scale_max


def trace(name: str, draws: int, runtime: str) -> list[tuple[str, str, np.ndarray]]:
    path = zoo.cached_onnx(name)
    fp32 = onnx.load(path)
    fused = amp_rewrite.rewrite_onnx(onnx.load(path), dtype="float16")
    unfused = amp_rewrite.rewrite_onnx(onnx.load(path), dtype="float16", fuse=False)
    in_fp32 = {o for n in fp32.graph.node for o in n.output}
    in_unfused = {o for n in unfused.graph.node for o in n.output}
    producer = {o: n.op_type for n in fused.graph.node for o in n.output}
    shared = [o for n in fused.graph.node for o in n.output
              if n.op_type not in SKIP and o in in_fp32 and o in in_unfused]
    shared += [o.name for o in fp32.graph.output]
    models = [exposed(m, shared) for m in (fp32, fused, unfused)]
    per_value: dict[str, list] = defaultdict(list)
    for seed in range(draws):
        feeds = zoo.onnx_inputs(zoo.build(name, seed=seed), path)
        ref, mine, theirs = (run(m, feeds, runtime) for m in models)
        for value in shared:
            if np.issubdtype(np.asarray(ref[value]).dtype, np.floating):
                per_value[value].append((*errors(mine[value], ref[value]),
                                         *errors(theirs[value], ref[value])))
    return [(producer.get(v, "output"), v, np.mean(per_value[v], axis=0))
            for v in shared if per_value[v]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help="zoo model")
    p.add_argument("--draws", type=int, default=6)
    p.add_argument("--runtime", choices=["reference", "ort"], default="reference")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.basicConfig(level=logging.WARNING)
    print(f"{'op':34} {'value':30} {'rms fused':>10} {'unfused':>10} {'ratio':>6} "
          f"{'max fused':>10} {'unfused':>10} {'ratio':>6}")
    for op, value, (rms_f, max_f, rms_u, max_u) in trace(args.name, args.draws, args.runtime):
        print(f"{op:34} {value[:30]:30} {rms_f:10.3g} {rms_u:10.3g} "
              f"{rms_f / max(rms_u, 1e-30):6.2f} {max_f:10.3g} {max_u:10.3g} "
              f"{max_f / max(max_u, 1e-30):6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
