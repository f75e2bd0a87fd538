"""Train and eval from one rewrite: ``rewrite(model, x, mode="both")``.

``torch.export`` bakes dropout and batch norm into the graph in the capture's mode.
``TrainEvalModule`` holds both rewritten captures on the *same* submodules, parameters and
buffers (its ``_modules``, ``_parameters``, ``_buffers`` are the train graph's, so
``state_dict()`` keys are the model's) and runs the one that matches ``self.training``.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

# Submodules every exported GraphModule owns separately (its input guards).
_PER_GRAPH = frozenset({"_guards_fn"})


def _holds_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` owns parameters or buffers, the only things the two graphs share.

    Code-only submodules (fused regions, guards) belong to the graph that calls them: the two
    captures number their regions independently, so ``fused_0`` of the eval graph is not the
    train graph's ``fused_0``, and taking it by name would run the wrong code.
    """
    return next(module.parameters(), None) is not None or next(module.buffers(), None) \
        is not None


@contextlib.contextmanager
def in_mode(model: torch.nn.Module, mode: str) -> Iterator[None]:
    """Put ``model`` in train or eval mode for the block, then restore every submodule's flag."""
    flags = {module: module.training for module in model.modules()}
    model.train(mode == "train")
    try:
        yield
    finally:
        for module, training in flags.items():
            module.training = training


class TrainEvalModule(torch.nn.Module):
    """Two rewritten captures of one model (train, eval) on one shared set of tensors."""

    def __init__(self, train_graph: torch.fx.GraphModule, eval_graph: torch.fx.GraphModule,
                 *, training: bool = True) -> None:
        super().__init__()
        _share_state(train_graph, eval_graph)
        self._modules = train_graph._modules
        self._parameters = train_graph._parameters
        self._buffers = train_graph._buffers
        # Plain attributes, not submodules: each graph's tensors are already listed once.
        object.__setattr__(self, "_graphs", {True: train_graph, False: eval_graph})
        self.training = training

    @property
    def train_graph(self) -> torch.fx.GraphModule:
        return self._graphs[True]

    @property
    def eval_graph(self) -> torch.fx.GraphModule:
        return self._graphs[False]

    @property
    def amp_report(self) -> dict:
        """The train graph's report (the eval graph's is ``eval_graph.amp_report``)."""
        return self.train_graph.amp_report

    @property
    def meta(self) -> dict:  # for amp_rewrite.explain: the train graph's reasons
        return self.train_graph.meta

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._graphs[self.training](*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> TrainEvalModule:
        super()._apply(fn, recurse)
        _share_state(self.train_graph, self.eval_graph)  # buffers are new tensors after .to()
        return self


def _share_state(owner: torch.fx.GraphModule, other: torch.fx.GraphModule) -> None:
    """Make ``other`` read ``owner``'s submodules, parameters and buffers (same objects)."""
    for name, module in owner._modules.items():
        if name not in _PER_GRAPH and name in other._modules and _holds_state(module):
            other._modules[name] = module
    for mine, theirs in ((owner._parameters, other._parameters),
                         (owner._buffers, other._buffers)):
        for name, tensor in theirs.items():  # tensors only one capture has stay reachable
            mine.setdefault(name, tensor)
    other._parameters = owner._parameters
    other._buffers = owner._buffers
