"""Wall seconds per phase of one in-process ONNX rewrite of a synthetic chain.

Wraps the phase functions with timers: on the ModelProto path (``onnx/flat.py``, what
``rewrite_onnx`` takes for these chains) reading the proto, the checks, the types, view, plan
(regions, canonical forms, min cut) and apply; on the onnx_ir path (``--onnx-ir``; load:
``from_proto`` + inferred facts; view; plan; apply; ``to_proto``; freeing the IR). It
rewrites one chain of ``tools/bench_onnx_speed.py`` per variant after a warm-up, printing the
host probe next to each total. For a function-level profile run it under ``-m cProfile``.

    PYTHONPATH=. python tools/profile_onnx_phases.py 50000 residual residual_deny plain
        [--onnx-ir]
"""
from __future__ import annotations

import sys
import time

import onnx_ir as ir

import amp_rewrite
from amp_rewrite.core import placement
from amp_rewrite.core.runtime import Background
from amp_rewrite.onnx import api, flat, io, passes, versions
from amp_rewrite.onnx.fusion import FusionPass
from bench_onnx_speed import build_chain, host_probe  # tools/ is on sys.path as a script

PHASES = [(io, "load_model", "load"), (io, "_checked_or_repaired", "  checker"),
          (ir, "from_proto", "  onnx_ir.from_proto"), (io, "_scan_nodes", "  node scan"),
          (io, "_with_inferred_facts", "  inferred facts (shape inference)"),
          (FusionPass, "call", "fusion"), (passes, "infer_missing_types", "dtype propagation"),
          (passes, "build_view", "view"), (passes, "plan_precision", "plan"),
          (placement, "constrained_regions", "  free regions"), (placement, "canonical", "  canonical"),
          (placement, "_min_cut", "  min cut"), (passes, "apply_plan", "apply"),
          (passes, "pad_model", "padding"), (passes, "_forget_load_time_types", "forget types"),
          (versions, "set_lowest_ir_version", "IR version"),
          (io, "to_proto", "to_proto (onnx_ir)"), (io, "release", "release IR")]
FLAT_PHASES = [(flat, "_read", "read the proto"), (flat, "_why_not_nodes", "node checks"),
               (flat, "_why_not_constants", "constant range check"),
               (Background, "result", "wait for the checker + shape inference"),
               (flat, "_types", "types"),
               (flat, "_View", "view: inputs, initializers (during the wait)"),
               (flat._View, "add_nodes", "view: nodes"),
               (flat, "plan_precision", "plan"),
               (placement, "constrained_regions", "  free regions"),
               (placement, "canonical", "  canonical"), (placement, "_min_cut", "  min cut"),
               (flat._Applier, "output", "apply + write the proto")]


def timing(seconds: dict[str, float], module, name: str, label: str) -> None:
    function = getattr(module, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start

    setattr(module, name, timed)


def main(argv: list[str]) -> int:
    onnx_ir = "--onnx-ir" in argv
    argv = [a for a in argv if a != "--onnx-ir"]
    n_nodes, variants = int(argv[0]), argv[1:] or ["residual"]
    seconds: dict[str, float] = {}
    phases = PHASES if onnx_ir else FLAT_PHASES
    if onnx_ir:  # the ModelProto path declines: the onnx_ir path runs
        api._rewrite_flat = lambda *a, **k: None
    for module, name, label in phases:
        timing(seconds, module, name, label)
    for variant in variants:
        model = build_chain(n_nodes, variant)
        amp_rewrite.rewrite_onnx(build_chain(10, variant), check=False)  # warm-up
        seconds.clear()
        probe = host_probe()
        start = time.perf_counter()
        amp_rewrite.rewrite_onnx(model, check=False)
        total = time.perf_counter() - start
        print(f"{variant} {len(model.graph.node)} nodes: {total:.2f} s "
              f"(host probe {probe:.2f} s)")
        for _, _, label in phases:
            if label in seconds:
                print(f"  {label:38} {seconds[label]:6.2f} s  {seconds[label] / total:4.0%}")
        top = sum(seconds[label] for _, _, label in phases
                  if label in seconds and not label.startswith(" "))
        print(f"  {'(outside these phases)':38} {total - top:6.2f} s  {(total - top) / total:4.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
