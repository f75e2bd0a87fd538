"""PyTorch's own autocast test lists, run through ``amp_rewrite.rewrite`` one op at a time.

``torch/testing/_internal/autocast_test_lists.py`` holds the ops and arguments PyTorch tests
autocast with: the CUDA lists (``AutocastTestLists``) and the CPU lists
(``AutocastCPUTestLists``), grouped by what autocast must do (run low, run fp32, promote).
Each entry becomes a one-op module; it is rewritten (``keep_io_types=False``, so the output
dtype shows the precision the op ran in) and compared:

* rewrite ok: capture and rewrite succeed;
* precision agrees: the output dtype equals autocast's. CPU lists: a real
  ``torch.autocast("cpu", bf16)`` run. CUDA lists: the dtype the list demands (no GPU is
  needed, nor used: the rewrite runs with ``device="cuda"`` rules and CPU kernels);
* numerics ok: max |out - fp32| / max |fp32| within twice autocast's own error (CPU lists) or
  within ``CUDA_TOLERANCE`` (CUDA lists, fp16 on CPU kernels), and no Inf/NaN where fp32 had none.

    python -m benchmarks fx autocast [--json results/autocast_lists.json]

Prints one row per list and every disagreement, and writes all entries as JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

import amp_rewrite
from amp_rewrite.core.metric import relative_error

CUDA_TOLERANCE = 2e-2  # fp16 on one op: ~20 ulp of relative error
_LOW_LISTS = ("torch_fp16", "torch_16", "nn_fp16", "nn_16", "linalg_fp16", "methods_fp16")
_FP32_LISTS = ("torch_fp32", "nn_fp32", "methods_fp32", "banned")


@dataclass
class Entry:
    """One list entry and what happened to it."""

    suite: str  # "cuda" or "cpu"
    list_name: str
    op: str
    rewrite_ok: bool = False
    ours: str = ""  # output dtype after the rewrite
    autocast: str = ""  # output dtype under autocast (or demanded by the list)
    precision_agrees: bool = False
    error: float | None = None
    autocast_error: float | None = None
    numerics_ok: bool = False
    note: str = ""


def load_lists() -> dict[str, Any]:
    """Both list classes, without importing torch's test harness (it needs ``expecttest``
    and changes global torch flags): the file's source is run with its two imports stubbed."""
    path = Path(torch.__file__).parent / "testing" / "_internal" / "autocast_test_lists.py"
    source = path.read_text()
    source = source.replace("from torch.testing._internal.common_utils import TEST_WITH_ROCM",
                            "TEST_WITH_ROCM = False")
    source = source.replace("from torch.testing._internal.common_utils import TestCase",
                            "TestCase = object")
    namespace: dict[str, Any] = {"__name__": "autocast_test_lists"}
    exec(compile(source, str(path), "exec"), namespace)  # noqa: S102 - torch's own file
    return {"cuda": namespace["AutocastTestLists"]("cpu"),
            "cpu": namespace["AutocastCPUTestLists"]("cpu")}


class OneOp(nn.Module):
    """``fn(*args, **kwargs)`` with every tensor argument a forward input."""

    def __init__(self, fn: Any, args: tuple, kwargs: dict) -> None:
        super().__init__()
        self.fn, self.kwargs = fn, kwargs
        leaves, self.spec = pytree.tree_flatten(args)
        self.is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
        self.constants = [None if t else x for x, t in zip(leaves, self.is_tensor)]

    def inputs(self, args: tuple) -> tuple[torch.Tensor, ...]:
        return tuple(x for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor))

    def forward(self, *tensors: torch.Tensor) -> Any:
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.is_tensor, self.constants)]
        return self.fn(*pytree.tree_unflatten(leaves, self.spec), **self.kwargs)


def _function(list_name: str, op: str, extra: Any) -> Any:
    if isinstance(extra, type(torch._C._nn)):
        return getattr(extra, op)
    if list_name.startswith("methods"):
        return lambda first, *rest: getattr(first, op)(*rest)
    if list_name.startswith("nn"):
        return getattr(torch._C._nn, op)
    if list_name.startswith("linalg"):
        return getattr(torch._C._linalg, op)
    return getattr(torch, op)


def _parse(suite: str, list_name: str, raw: tuple) -> tuple[str, tuple, dict, Any, Any]:
    """(op, args, kwargs, expected output dtype or None, namespace/flag) of one entry."""
    op, args, rest = raw[0], raw[1], raw[2:]
    if isinstance(args, str):  # ("einsum", "equation", operands)
        args, rest = (args, *rest[0]), rest[1:]
    if suite == "cpu" and list_name.endswith("promote") and len(rest) >= 1 \
            and isinstance(rest[0], tuple):
        rest = rest[1:]  # (op, bf16 args, fp16 args[, out]): the bf16 run
    kwargs = next((x for x in rest if isinstance(x, dict)), {})
    expected = next((x for x in rest if isinstance(x, torch.dtype)), None)
    extra = next((x for x in rest if not isinstance(x, dict | torch.dtype)), None)
    return op, args, kwargs, expected, extra


def _first_float(out: Any) -> torch.Tensor | None:
    return next((x for x in pytree.tree_leaves(out)
                 if isinstance(x, torch.Tensor) and (x.is_floating_point() or
                                                     x.dtype == torch.bool)), None)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The product's metric (``amp_rewrite.core.metric``): over the elements fp32 computes
    finitely (pow and rsqrt of negatives give NaN in every precision); inf when the output
    is not finite where fp32 is, or a bool output differs at all."""
    return relative_error(_array(ref), _array(out))


def _array(t: torch.Tensor):
    return (t.double() if t.is_floating_point() else t).detach().cpu().numpy()


def _fp32(args: tuple) -> tuple:
    return pytree.tree_map(lambda x: x.float() if isinstance(x, torch.Tensor)
                           and x.is_floating_point() else x, args)


def _expected_dtype(list_name: str, args: tuple, expected: Any, low: torch.dtype,
                    eager: torch.Tensor) -> torch.dtype:
    if expected is not None:
        return expected
    if list_name in _LOW_LISTS:
        return low
    if list_name in _FP32_LISTS:
        return torch.float32
    if list_name == "torch_need_autocast_promote":
        return torch.float32  # widest input: every entry mixes fp32 with a low dtype
    return eager.dtype  # builtin promotion: what the op itself returns


def run_entry(suite: str, list_name: str, raw: tuple) -> Entry:
    op, args, kwargs, expected, extra = _parse(suite, list_name, raw)
    entry = Entry(suite, list_name, op)
    low = torch.float16 if suite == "cuda" else torch.bfloat16
    module = OneOp(_function(list_name, op, extra), args, kwargs)
    inputs = module.inputs(args)
    try:
        reference = _first_float(module(*module.inputs(_fp32(args))))
    except Exception as e:  # noqa: BLE001 - CUDA-only ops (cudnn_*) have no CPU kernel
        entry.note = f"not runnable on CPU: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
        return entry
    eager, why = _eager(module, inputs)
    if eager is None:
        # Mixed dtypes only autocast can run, or a low dtype without a CPU kernel: the model
        # a user hands the rewrite is the FP32 one.
        inputs, eager = module.inputs(_fp32(args)), reference
        entry.note = f"inputs upcast to fp32 ({why}); "
    try:
        gm = amp_rewrite.rewrite(module, inputs, dtype=low, keep_io_types=False,
                                 dynamic_shapes="static", device=suite)
        entry.rewrite_ok = True
    except Exception as e:  # noqa: BLE001 - reported per entry
        entry.note += f"rewrite failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return entry
    _compare(entry, suite, list_name, module, inputs, gm, args, expected, low, eager, reference)
    return entry


def _eager(module: OneOp, inputs: tuple) -> tuple[torch.Tensor | None, str]:
    try:
        out = _first_float(module(*inputs))
    except Exception as e:  # noqa: BLE001 - the reason goes into the note
        return None, str(e).splitlines()[0][:70]
    return out, "" if out is not None else "it returns no tensor"


def _compare(entry: Entry, suite: str, list_name: str, module: OneOp, inputs: tuple,
             gm: torch.nn.Module, args: tuple, expected: Any, low: torch.dtype,
             eager: torch.Tensor, reference: torch.Tensor) -> None:
    try:
        ours = _first_float(gm(*inputs))
    except Exception as e:  # noqa: BLE001 - e.g. a CUDA-rules graph without a CPU fp16 kernel
        entry.note += ("rewritten graph not runnable on CPU (CUDA rules; no GPU in this "
                       f"session): {str(e).splitlines()[0][:90]}")
        return
    entry.ours = str(ours.dtype).removeprefix("torch.")
    entry.error = _relative_error(ours, reference)
    if suite == "cpu":
        autocast_out = _autocast_cpu(module, inputs, low)
        if autocast_out is None:
            entry.autocast = "error"
            entry.note += "autocast refuses the op (banned list)"
            want = torch.float32
        else:
            want = autocast_out.dtype
            entry.autocast_error = _relative_error(autocast_out, reference)
        entry.numerics_ok = entry.error <= max(2 * (entry.autocast_error or 0.0),
                                               torch.finfo(low).eps)
    else:
        want = _expected_dtype(list_name, args, expected, low, eager)
        entry.numerics_ok = entry.error <= CUDA_TOLERANCE
    entry.autocast = entry.autocast if entry.autocast == "error" else \
        str(want).removeprefix("torch.")
    entry.precision_agrees = ours.dtype == want


def _autocast_cpu(module: OneOp, inputs: tuple, low: torch.dtype) -> torch.Tensor | None:
    try:
        with torch.autocast("cpu", dtype=low):
            return _first_float(module(*inputs))
    except RuntimeError:
        return None


def run_all() -> list[Entry]:
    entries = []
    for suite, lists in load_lists().items():
        for list_name, raw_entries in vars(lists).items():
            if isinstance(raw_entries, list):
                entries += [run_entry(suite, list_name, raw) for raw in raw_entries]
    return entries


def table(entries: list[Entry]) -> str:
    rows = ["| suite | list | entries | rewrite ok | precision agrees | numerics ok |",
            "|---|---|---:|---:|---:|---:|"]
    keys = dict.fromkeys((e.suite, e.list_name) for e in entries)
    for suite, name in keys:
        group = [e for e in entries if (e.suite, e.list_name) == (suite, name)]
        rows.append(f"| {suite} | {name} | {len(group)} | {sum(e.rewrite_ok for e in group)} | "
                    f"{sum(e.precision_agrees for e in group)} | "
                    f"{sum(e.numerics_ok for e in group)} |")
    rows += ["", "| suite | list | op | ours | autocast | error | autocast error | note |",
             "|---|---|---|---|---|---|---|---|"]
    for e in entries:
        if not (e.rewrite_ok and e.precision_agrees and e.numerics_ok):
            rows.append(f"| {e.suite} | {e.list_name} | {e.op} | {e.ours} | {e.autocast} | "
                        f"{_fmt(e.error)} | {_fmt(e.autocast_error)} | {e.note} |")
    return "\n".join(rows)


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="results/autocast_lists.json")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # the rewrite's per-model notes
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    entries = run_all()
    print(table(entries))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__,
                               "entries": [asdict(e) for e in entries]}, indent=1))
    print(f"\nwrote {out}")
    return 0
