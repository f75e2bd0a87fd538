"""The ``torch.compile`` backend on every zoo architecture (CPU): accuracy, gradients,
recompiles and graph breaks, beside ``torch.autocast``.

For each zoo model (tiny configs, random weights) and low dtype:

* eval mode (deterministic): forward and backward of ``loss = Σ mean(out²)`` through the FP32
  model, the FP32 model under ``torch.autocast`` and ``amp_rewrite.compile(model)``; ``error``
  is the existing metric (max |out - fp32| / max |fp32|), ``grad_error`` the same over all
  parameter gradients as one vector (a per-tensor scale would divide by gradients that are zero
  in exact arithmetic, such as a bias right before a LayerNorm);
* train mode (dropout on): 20 forward+backward steps of the compiled model; ``recompiles``
  counts graphs dynamo compiled after the first 3 steps; ``grads_finite`` that every gradient
  of every step was finite;
* a forced graph break (a forward pre-hook calling ``.item()`` on the middle layer's input):
  ``graphs`` is the number of graphs ``amp_rewrite.report`` lists (≥ 2 when it broke).

``--inner inductor`` compiles each rewritten graph with Inductor (slow on CPU), ``eager`` (the
default here) runs it as planned: the planning and the numerics of the low kernels are the same.

    python -m benchmarks fx backend [--models bert gpt2] [--dtypes bf16 fp16]
        [--inner eager|inductor] [--json results/fx_backend.json]
"""
from __future__ import annotations

import argparse
import copy
import logging
import platform
import time
import warnings
from pathlib import Path

import torch

import amp_rewrite
from benchmarks import cli
from tests.models import zoo
from tests.models.measure import float_outputs, relative_error

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TRAIN_STEPS, WARM_STEPS = 20, 3


def _loss(out: object) -> torch.Tensor:
    return sum(o.float().square().mean() for o in float_outputs(out))


def _forward_backward(module: torch.nn.Module, call: object, model: zoo.ZooModel,
                      autocast: torch.dtype | None = None) -> tuple[object, list]:
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        out = call(*model.args, **model.kwargs)
    _loss(out).backward()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for p in module.parameters()]
    return [o.detach() for o in float_outputs(out)], grads


def _vector_error(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    flat = torch.cat([g.float().flatten() for g in grads])
    ref = torch.cat([g.float().flatten() for g in reference])
    return relative_error([flat], [ref])


def _middle_layer(module: torch.nn.Module) -> torch.nn.Module:
    """A module near the middle of the model that owns parameters (the graph-break site)."""
    owners = [m for m in module.modules()
              if any(True for _ in m.parameters(recurse=False)) and m is not module]
    return owners[len(owners) // 2]


def measure(name: str, key: str, inner: str) -> dict:
    dtype = DTYPES[key]
    model = zoo.build(name)
    reference = model.module
    row: dict = {"model": name, "dtype": key}
    start = time.perf_counter()
    ref_out, ref_grads = _forward_backward(reference, reference, model)
    auto_out, auto_grads = _forward_backward(reference, reference, model, autocast=dtype)
    ours_module = copy.deepcopy(reference)
    compiled = amp_rewrite.compile(ours_module, dtype=dtype, inner=inner)
    ours_out, ours_grads = _forward_backward(ours_module, compiled, model)
    row.update(error=relative_error(ours_out, ref_out),
               autocast_error=relative_error(auto_out, ref_out),
               grad_error=_vector_error(ours_grads, ref_grads),
               autocast_grad_error=_vector_error(auto_grads, ref_grads))

    torch._dynamo.reset()
    train_module = copy.deepcopy(reference).train()
    compiled = amp_rewrite.compile(train_module, dtype=dtype, inner=inner)
    finite, graphs_after_warmup = True, 0
    for step in range(TRAIN_STEPS):
        _, grads = _forward_backward(train_module, compiled, model)
        finite &= all(bool(torch.isfinite(g).all()) for g in grads)
        if step == WARM_STEPS - 1:
            graphs_after_warmup = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    row.update(grads_finite=finite, recompiles=torch._dynamo.utils.counters["stats"][
        "unique_graphs"] - graphs_after_warmup)

    torch._dynamo.reset()
    broken = copy.deepcopy(reference)
    _middle_layer(broken).register_forward_pre_hook(
        lambda _module, args: [a.sum().item() for a in args[:1] if isinstance(a, torch.Tensor)]
        and None)
    compiled = amp_rewrite.compile(broken, dtype=dtype, inner=inner)
    broken_out, _ = _forward_backward(broken, compiled, model)
    row.update(graphs=len(amp_rewrite.report(compiled)),
               break_error=relative_error(broken_out, ref_out),
               seconds=round(time.perf_counter() - start, 1))
    torch._dynamo.reset()
    return row


def _ok(row: dict) -> bool:
    return (row["error"] <= 1.5 * row["autocast_error"] + 1e-6
            and row["grad_error"] <= 1.5 * row["autocast_grad_error"] + 1e-6
            and row["grads_finite"]
            and row["recompiles"] == 0 and row["graphs"] >= 2)


def print_table(rows: list[dict]) -> None:
    header = (f"{'model':16s} {'dtype':5s} {'err ours':>9s} {'autocast':>9s} {'grad ours':>9s} "
              f"{'autocast':>9s} {'finite':>6s} {'reco':>4s} {'graphs':>6s} {'s':>6s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        if "failed" in r:
            print(f"{r['model']:16s} {r['dtype']:5s} FAILED {r['failed']}")
            continue
        print(f"{r['model']:16s} {r['dtype']:5s} {r['error']:9.2e} {r['autocast_error']:9.2e} "
              f"{r['grad_error']:9.2e} {r['autocast_grad_error']:9.2e} "
              f"{str(r['grads_finite']):>6s} {r['recompiles']:4d} {r['graphs']:6d} "
              f"{r['seconds']:6.1f}{'' if _ok(r) else '  <-'}")
    good = sum("failed" not in r and _ok(r) for r in rows)
    print(f"\nerror and gradient error <= 1.5x autocast's, finite gradients, no recompiles, "
          f"graph break listed: {good}/{len(rows)} rows")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(zoo.NAMES), choices=zoo.NAMES)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    parser.add_argument("--json", type=Path, default=Path("results/fx_backend.json"))
    args = parser.parse_args(argv)
    cli.setup_logging(logging.ERROR)
    warnings.filterwarnings("ignore")
    rows = []
    for name in args.models:
        for key in args.dtypes:
            try:
                row = measure(name, key, args.inner)
            except Exception as error:  # noqa: BLE001 - a row records any failure
                row = {"model": name, "dtype": key,
                       "failed": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            rows.append(row)
            print(rows[-1], flush=True)
    print_table(rows)
    meta = {"torch": torch.__version__, "machine": platform.processor() or platform.machine(),
            "inner": args.inner, "train_steps": TRAIN_STEPS, "warm_steps": WARM_STEPS}
    cli.write_json(args.json, {"meta": meta, "rows": rows})
    return 0
