from __future__ import annotations

import copy
import functools

import pytest
import torch

from amp_rewrite.fx.view import is_cast


@functools.cache
def _captured(name: str):
    from tests.models import zoo
    from amp_rewrite.fx.capture import capture

    model = zoo.build(name)
    return model, capture(model.module, model.args, model.kwargs)


@pytest.fixture(scope="session")
def zoo_capture():
    """``zoo_capture(name) -> (ZooModel, fresh copy of its captured GraphModule)``, cached."""
    def get(name: str):
        model, gm = _captured(name)
        return model, copy.deepcopy(gm)
    return get


def casts(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The casts amp_rewrite inserted."""
    return [n for n in gm.graph.nodes if is_cast(n)]


def node(gm: torch.fx.GraphModule, name: str) -> torch.fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def out_dtype(n: torch.fx.Node) -> torch.dtype:
    return n.meta["val"].dtype


@pytest.fixture(autouse=True)
def _fused_regions_run_eager(monkeypatch):
    """Fused pointwise regions run eager in tests unless a test asks for Inductor (each
    compilation takes seconds; tests/fx/test_fusion.py covers the compiled path)."""
    import os

    from amp_rewrite.fx.pointwise import BACKEND_ENV
    if BACKEND_ENV not in os.environ:
        monkeypatch.setenv(BACKEND_ENV, "eager")


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """Dynamo reset around a test that compiles (no guards or graphs from an earlier test),
    with amp_rewrite's pointwise regions uncompiled."""
    from amp_rewrite.fx.pointwise import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "eager")
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
