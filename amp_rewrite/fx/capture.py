"""Capture an ``nn.Module`` as a ``torch.fx.GraphModule`` whose nodes carry ``meta['val']``.

Three ways in (DESIGN §1): ``torch.export`` (the default; it handles real ``transformers``
models), ``torch.fx.symbolic_trace`` (simple modules), or an existing ``GraphModule`` taken as
is. The user's module is never mutated: the module is deep-copied before capture, so the
returned graph owns its parameters (training it leaves the original alone).
"""
from __future__ import annotations

import copy
import inspect
import logging
import os
import re
import traceback
import types
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from amp_rewrite.errors import CaptureError, UsageError

log = logging.getLogger(__name__)

CAPTURE_MODES = ("export", "symbolic_trace")

# export's message names the user's line after this header (torch >= 2.5).
_USER_FRAME = re.compile(
    r"The following call raised this error:\s*\n\s*File \"([^\"]+)\", line (\d+), in (\w+)\n\s*(.*)")


def normalize_inputs(example_inputs: Any, example_kwargs: Mapping[str, Any] | None
                     ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` from what the user passed; a lone tensor counts as one argument."""
    if example_inputs is None:
        raise UsageError("example_inputs is required: pass a tuple of the forward's arguments")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, Sequence) or isinstance(example_inputs, str):
        raise UsageError(f"example_inputs must be a tuple of arguments, got "
                         f"{type(example_inputs).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise UsageError(f"example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    return tuple(example_inputs), dict(example_kwargs or {})


def check_signature(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise UsageError when the example inputs cannot bind to ``module.forward``."""
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # builtins or C++ modules: let the tracer decide
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise UsageError(f"example inputs do not match {type(module).__name__}.forward{sig}: "
                         f"{e}") from None


def capture(model: torch.nn.Module, example_inputs: Any,
            example_kwargs: Mapping[str, Any] | None = None, *, mode: str = "export",
            dynamic_shapes: Any = None) -> torch.fx.GraphModule:
    """A GraphModule for ``model`` with fake-tensor ``meta['val']`` on every node."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"expected a torch.nn.Module or GraphModule, got {type(model).__name__}")
    args, kwargs = normalize_inputs(example_inputs, example_kwargs)
    if isinstance(model, torch.fx.GraphModule):
        gm = _copy_graph_module(model)
        if not has_fake_values(gm):
            propagate_fake(gm, args, kwargs)
        return gm
    if mode not in CAPTURE_MODES:
        raise UsageError(f"capture={mode!r}: expected one of {CAPTURE_MODES}")
    check_signature(model, args, kwargs)
    module = copy.deepcopy(model)
    if mode == "export":
        return _export(module, args, kwargs, dynamic_shapes)
    if dynamic_shapes is not None:
        raise UsageError("dynamic_shapes needs capture='export'")
    return _symbolic_trace(module, args, kwargs)


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    with warnings.catch_warnings():  # torch deep-copies export's pytree specs with a
        warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)  # deprecated check
        return copy.deepcopy(gm)


def _export(module: torch.nn.Module, args: tuple, kwargs: dict,
            dynamic_shapes: Any) -> torch.fx.GraphModule:
    try:
        program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes,
                                      strict=False)
    except Exception as e:  # noqa: BLE001 - classified and re-raised with context below
        _raise_export_failure(module, args, kwargs, e)
    gm = program.module()
    _fix_mode(gm, module.training)
    return gm


def _fix_mode(gm: torch.fx.GraphModule, training: bool) -> None:
    """An exported graph has dropout/batch-norm behaviour baked in: ``train()``/``eval()``
    accept the captured mode (so training loops that call them keep working) and explain
    the others (torch's own message only says it is not supported)."""
    captured = "train" if training else "eval"

    def set_mode(self: torch.fx.GraphModule, mode: bool = True) -> torch.fx.GraphModule:
        if mode != training:
            raise UsageError(
                f"this graph was captured in {captured} mode and torch.export fixed dropout "
                f"and batch norm to it; call module.{'train' if mode else 'eval'}() before "
                "amp_rewrite.rewrite(module, ...) to get a graph for that mode")
        return self

    gm.train = types.MethodType(set_mode, gm)
    gm.eval = types.MethodType(lambda self: set_mode(self, False), gm)


def _raise_export_failure(module: torch.nn.Module, args: tuple, kwargs: dict,
                          error: Exception) -> None:
    """Bad inputs if the module fails eagerly too; otherwise a capture problem, explained."""
    eager_error = _eager_error(module, args, kwargs)
    if eager_error is not None:
        raise UsageError(f"example inputs do not fit {type(module).__name__}: "
                         f"{_first_line(eager_error)}") from error
    construct = _user_construct(error)
    if isinstance(error, GuardOnDataDependentSymNode):
        raise CaptureError(
            f"torch.export cannot capture {type(module).__name__}: data-dependent control flow "
            f"{construct}branches on a tensor's value; rewrite the branch with torch.where / "
            "torch.cond, or pass capture='symbolic_trace' if the branch does not depend on "
            "inputs") from error
    raise CaptureError(
        f"torch.export cannot capture {type(module).__name__}: {_first_line(error)} {construct}"
        "(try capture='symbolic_trace', or fix the construct)") from error


def _eager_error(module: torch.nn.Module, args: tuple, kwargs: dict) -> Exception | None:
    try:
        with torch.no_grad():
            module(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - any failure means the inputs do not fit
        return e
    return None


def _user_construct(error: Exception) -> str:
    match = _USER_FRAME.search(str(error))
    if not match:
        return ""
    return _location(*match.groups())


def _location(path: str, line: object, func: str, code: str | None) -> str:
    """``at FILE:LINE in FUNC (`code`) `` for error messages."""
    return f"at {path}:{line} in {func} (`{(code or '').strip()}`) "


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _symbolic_trace(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    try:
        gm = torch.fx.symbolic_trace(module)
    except torch.fx.proxy.TraceError as e:
        raise CaptureError(
            f"torch.fx.symbolic_trace cannot capture {type(module).__name__}: {e}; use "
            "capture='export', or replace the Python branch on a tensor with torch.where"
        ) from e
    except Exception as e:  # noqa: BLE001 - Python code that needs real values, e.g. x[:n]
        raise CaptureError(
            f"torch.fx.symbolic_trace cannot capture {type(module).__name__}: "
            f"{_first_line(e)} {_model_frame(e)}(the code needs concrete values, which "
            "symbolic tracing does not have); use capture='export'") from e
    propagate_fake(gm, args, kwargs)
    return gm


def _model_frame(error: Exception) -> str:
    """Where the model's own code failed: the innermost frame outside torch."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f"{os.sep}torch{os.sep}" not in f.filename and f.filename != __file__]
    if not frames:
        return ""
    f = frames[-1]
    return _location(f.filename, f.lineno, f.name, f.line)


def has_fake_values(gm: torch.fx.GraphModule) -> bool:
    """True when every placeholder and function/method call carries ``meta['val']``.

    (Modules are left out: export's ``_guards_fn`` returns nothing and has no value.)
    """
    ops = ("placeholder", "call_function", "call_method")
    return all("val" in n.meta for n in gm.graph.nodes if n.op in ops)


def flat_inputs(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> list[Any]:
    """The example inputs in placeholder order (pytree-flattened for exported modules)."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is not None and info.in_spec is not None:
        return list(torch.fx._pytree.tree_flatten_spec((args, kwargs), info.in_spec))
    sig = inspect.signature(gm.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise UsageError(f"example inputs do not match the graph's forward{sig}: {e}") from None
    bound.apply_defaults()
    return list(bound.arguments.values())


def propagate_fake(gm: torch.fx.GraphModule, args: tuple, kwargs: dict) -> None:
    """Annotate every node with ``meta['val']`` by running the graph on fake tensors."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    flat = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
            for a in flat_inputs(gm, args, kwargs)]
    try:
        with mode:
            FakeTensorProp(gm, mode).run(*flat, enable_io_processing=False)
    except Exception as e:  # noqa: BLE001 - shape/dtype errors mean the inputs do not fit
        raise UsageError(f"example inputs do not fit the graph: {_first_line(e)}") from e


def refresh_fake_values(gm: torch.fx.GraphModule) -> None:
    """Recompute ``meta['val']`` after a rewrite, from the placeholders' own fake values.

    Reusing the placeholders' fake mode keeps symbolic (``torch.export.Dim``) sizes symbolic.
    """
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = torch._guards.detect_fake_mode(vals) or FakeTensorMode(allow_non_fake_inputs=True)
    previous, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True  # real parameters
    try:
        with mode:
            FakeTensorProp(gm, mode).run(*vals, enable_io_processing=False)
    finally:
        mode.allow_non_fake_inputs = previous
