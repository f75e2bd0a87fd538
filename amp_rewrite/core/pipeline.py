"""The pipeline contract both adapters implement (docs/design.md §1).

An adapter's pipeline is a list of named passes in three stages, each pass a callable on the
model that returns a result with ``modified`` (onnx_ir's ``PassResult`` on ONNX, torch.fx's
on torch):

* ``prepare``: everything before the plan (undo a previous rewrite, inline, fuse patterns,
  functionalise); it ends with a precision view of the model;
* ``plan``: one pass: the core plans precision and casts on the view and the adapter applies
  the plan (``core/plan.plan_precision``; with an accuracy budget, ``core/budget.search``
  first chooses the pins, measuring plans through the adapter);
* ``lower``: what the plan makes possible (padding, FP8, emulated kernels, pointwise fusion).

``run`` runs one stage and records, per pass, whether it changed the model and how long it
took; the adapters put those records in the report (``steps``), so a report says which
passes did something, in the order they ran.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Model = TypeVar("Model")

STAGES = ("prepare", "plan", "lower")


@dataclass(frozen=True)
class Pass(Generic[Model]):
    """One named pass of a stage; ``run(model)`` returns something with ``modified``."""

    name: str
    run: Callable[[Model], Any]


@dataclass
class Record:
    """What each pass of a pipeline did, in the order they ran."""

    passes: list[dict] = field(default_factory=list)

    def modified(self, *names: str) -> bool:
        """Whether any of the passes ``names`` changed the model."""
        return any(p["modified"] for p in self.passes if p["name"] in names)

    def as_report(self) -> list[dict]:
        return [dict(p) for p in self.passes]


def run(model: Model, stage: str, passes: Iterable[Pass[Model]], record: Record) -> bool:
    """Run ``passes`` on ``model`` in order, recording each; whether any changed it."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: expected one of {', '.join(STAGES)}")
    changed = False
    for p in passes:
        start = time.perf_counter()
        result = p.run(model)
        modified = bool(getattr(result, "modified", result))
        record.passes.append({"stage": stage, "name": p.name, "modified": modified,
                              "seconds": round(time.perf_counter() - start, 4)})
        changed |= modified
    return changed
