"""Capture an ``nn.Module`` as a ``torch.fx.GraphModule`` whose nodes carry ``meta['val']``.

``torch.export`` (default), ``torch.fx.symbolic_trace``, or an existing ``GraphModule`` as is
(docs/design.md §1). The module is deep-copied first, so the user's module is never mutated.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io
import logging
import os
import re
import sys
import traceback
import types
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from amp_rewrite.errors import CaptureError, UsageError, described

log = logging.getLogger(__name__)

CAPTURE_MODES = ("export", "symbolic_trace")
STATIC = "static"  # dynamic_shapes= value for a graph specialised to the example shapes
_MAX_SEQUENCE_RANK = 3  # inputs of higher rank get a dynamic batch dimension only
_DATA_DEPENDENT_FIX = ("it returns a Python value computed from tensor contents (torch.equal, "
                       ".item(), .tolist()), which no captured graph can hold; compute it as a "
                       "tensor instead (torch.equal(x, y) -> (x == y).all())")

# export's message names the user's line after this header (torch >= 2.5).
_USER_FRAME = re.compile(
    r"The following call raised this error:\s*\n\s*File \"([^\"]+)\", line (\d+), in (\w+)\n\s*(.*)")
_CAUSED_BY = re.compile(r"Caused by: \((.+?):(\d+) in (\w+)\)")


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


def _forward_signature(module: torch.nn.Module) -> inspect.Signature | None:
    """``module.forward``'s signature; None for builtins and C++ modules."""
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


def check_signature(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Raise UsageError when the example inputs cannot bind to ``module.forward``."""
    sig = _forward_signature(module)
    if sig is None:  # let the tracer decide
        return
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        raise UsageError(f"example inputs do not match {type(module).__name__}.forward{sig}: "
                         f"{e}{_positional_landing(module, args)}") from None


def _positional_landing(module: torch.nn.Module, args: tuple) -> str:
    """Where positional example inputs went, for errors: a tensor meant as the attention mask
    that lands in GPT-2's second parameter (its cache) fails far from the call."""
    sig = _forward_signature(module)
    if len(args) < 2 or sig is None:
        return ""
    landed = [f"#{i + 1} -> {name!r}" for i, name in enumerate(list(sig.parameters)[:len(args)])]
    return (f" (positional example inputs bind in forward's order: {', '.join(landed)}; pass "
            "the others by keyword, example_kwargs={'attention_mask': ...})")


# torch.export cannot return a transformers DynamicCache, and training needs none
_CACHE_KEYWORD = "use_cache"
_ANNOUNCED: set[type] = set()


def _without_cache_output(module: torch.nn.Module, kwargs: dict) -> dict:
    """``kwargs`` plus ``use_cache=False`` where the model would return a cache object and
    the caller did not choose; one log line says so. Passing ``use_cache`` opts out."""
    if _CACHE_KEYWORD in kwargs or not getattr(getattr(module, "config", None),
                                               _CACHE_KEYWORD, False):
        return kwargs
    sig = _forward_signature(module)
    if sig is None or _CACHE_KEYWORD not in sig.parameters:  # encoders: only via **kwargs
        return kwargs
    if type(module) not in _ANNOUNCED:  # once, not per capture (mode="both" makes two)
        _ANNOUNCED.add(type(module))
        log.info("capturing %s with use_cache=False: torch.export cannot return its "
                 "key/value cache object; pass example_kwargs={'use_cache': ...} to choose",
                 type(module).__name__)
    return {**kwargs, _CACHE_KEYWORD: False}


def _warn_if_checkpointing(module: torch.nn.Module) -> None:
    """torch.export traces through ``torch.utils.checkpoint``: the graph it returns recomputes
    nothing, so a model trained with activation checkpointing on (``transformers``'
    ``gradient_checkpointing`` flag) would silently keep every activation; one warning."""
    if module.training and any(getattr(m, "gradient_checkpointing", False) is True
                               for m in module.modules()):
        log.warning("%s has activation checkpointing on, which torch.export does not keep: the "
                    "rewritten graph stores every activation for the backward; "
                    "amp_rewrite.compile(model) recomputes checkpointed regions",
                    type(module).__name__)


class _CapturedKeywords:
    """Forward pre-hook of an exported graph: a non-tensor keyword left out takes its
    captured value; any other difference from the captured keywords is a one-line
    ``UsageError`` naming it (torch's own error gives no hint)."""

    def __init__(self, captured: dict) -> None:
        self.constants = {k: v for k, v in captured.items() if not _holds_tensor(v)}
        self.tensors = [k for k in captured if k not in self.constants]

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict
                 ) -> tuple[tuple, dict]:
        missing = [k for k in self.tensors if k not in kwargs]
        if missing:
            raise UsageError(
                f"this graph was captured with {', '.join(f'{k}=' for k in missing)} and needs "
                "it on every call (torch.export fixes a graph's inputs); pass it, or capture "
                "a second graph without it")
        unknown = [k for k in kwargs if k not in self.constants and k not in self.tensors]
        if unknown:
            raise UsageError(
                f"this graph was captured without {', '.join(f'{k}=' for k in unknown)} "
                "(torch.export fixes a graph's inputs); capture with it in example_kwargs")
        for key, value in self.constants.items():
            if key in kwargs and kwargs[key] != value:
                raise UsageError(f"{key}={kwargs[key]!r}: this graph was captured with "
                                 f"{key}={value!r}, and a non-tensor argument is fixed at "
                                 "capture; capture again with the value you need")
        return args, {**self.constants, **kwargs}


def _holds_tensor(value: Any) -> bool:
    return any(isinstance(leaf, torch.Tensor)
               for leaf in torch.utils._pytree.tree_leaves(value))


def capture(model: torch.nn.Module, example_inputs: Any,
            example_kwargs: Mapping[str, Any] | None = None, *, mode: str = "export",
            dynamic_shapes: Any = None) -> torch.fx.GraphModule:
    """A GraphModule for ``model`` with fake-tensor ``meta['val']`` on every node.

    ``dynamic_shapes``: None (default) makes export keep every dimension it can symbolic
    (``export_dynamic_shapes``), ``"static"`` specialises to the example shapes, anything else
    goes to ``torch.export.export`` as is.
    """
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
    if mode != "export" and dynamic_shapes not in (None, STATIC):
        raise UsageError("dynamic_shapes needs capture='export'")
    module = copy.deepcopy(model)
    with quiet_torch_logs():
        if mode == "export":
            _warn_if_checkpointing(module)
            kwargs = _without_cache_output(module, kwargs)
            gm = _export(module, args, kwargs, export_dynamic_shapes(module, args, kwargs,
                                                                     dynamic_shapes))
            gm.register_forward_pre_hook(_CapturedKeywords(kwargs), with_kwargs=True,
                                        prepend=True)  # before export's own check
            return gm
        return _symbolic_trace(module, args, kwargs)


@contextlib.contextmanager
def quiet_torch_logs() -> Iterator[None]:
    """Drop torch's log records (tracebacks, partial graphs) while capturing: our one error
    says it all. A filter on the handlers, as many torch loggers do not propagate."""
    loggers = [logger for name, logger in logging.root.manager.loggerDict.items()
               if isinstance(logger, logging.Logger) and _is_torch_name(name)]
    handlers = {h for logger in [logging.getLogger(), *loggers] for h in logger.handlers}
    if logging.lastResort is not None:
        handlers.add(logging.lastResort)
    for handler in handlers:
        handler.addFilter(_drop_torch_records)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(_drop_torch_records)


def _is_torch_name(name: str) -> bool:
    return name == "torch" or name.startswith("torch.")


def _drop_torch_records(record: logging.LogRecord) -> bool:
    return not _is_torch_name(record.name)


def export_dynamic_shapes(module: torch.nn.Module, args: tuple, kwargs: dict,
                          requested: Any) -> Any:
    """What ``torch.export`` gets: the user's spec, None for ``"static"``, else ``Dim.AUTO``
    (symbolic unless the model fixes it) on the batch and sequence dims of every tensor
    input (``_auto_dims``), so a smaller last batch or longer sentence passes the guards."""
    if requested == STATIC:
        return None
    if requested is not None:
        return requested
    try:
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return {name: torch.utils._pytree.tree_map(_auto_dims, value)
            for name, value in bound.arguments.items()}


def _auto_dims(value: Any) -> Any:
    """Every dimension of a tensor of rank <= 3; only the batch of rank >= 4 (images),
    whose spatial sizes stay fixed and whose symbolic windowing is slow to export."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    dims = range(value.dim()) if value.dim() <= _MAX_SEQUENCE_RANK else range(1)
    return dict.fromkeys(dims, torch.export.Dim.AUTO)


def _copy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    with warnings.catch_warnings():  # torch deep-copies export's pytree specs with a
        warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)  # deprecated check
        return copy.deepcopy(gm)


def _export(module: torch.nn.Module, args: tuple, kwargs: dict,
            dynamic_shapes: Any) -> torch.fx.GraphModule:
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):  # export prints the partial graph on error
            program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic_shapes,
                                          strict=False)
    except Exception as e:  # noqa: BLE001 - classified and re-raised with context below
        log.debug("torch.export printed:\n%s", printed.getvalue())
        _raise_export_failure(module, args, kwargs, e)
    sys.stderr.write(printed.getvalue())  # on success, pass through what it printed
    gm = program.module()
    _fix_mode(gm, module.training)
    return gm


def _fix_mode(gm: torch.fx.GraphModule, training: bool) -> None:
    """``train()``/``eval()`` of an exported graph accept the captured mode and explain the
    other (dropout and batch norm are baked in)."""
    captured = "train" if training else "eval"

    def set_mode(self: torch.fx.GraphModule, mode: bool = True) -> torch.fx.GraphModule:
        if mode != training:
            raise UsageError(
                f"this graph was captured in {captured} mode and torch.export fixed dropout "
                f"and batch norm to it; pass mode='both' to amp_rewrite.rewrite for one "
                "module holding both graphs, or mode="
                f"'{'train' if mode else 'eval'}' for a graph of that mode")
        return self

    gm.train = types.MethodType(set_mode, gm)
    gm.eval = types.MethodType(lambda self: set_mode(self, False), gm)


def _raise_export_failure(module: torch.nn.Module, args: tuple, kwargs: dict,
                          error: Exception) -> None:
    """Bad inputs if the module fails eagerly too; otherwise a capture problem, explained."""
    eager_error = _eager_error(module, args, kwargs)
    if eager_error is not None:
        raise UsageError(f"example inputs do not fit {type(module).__name__}: "
                         f"{described(eager_error)}{_positional_landing(module, args)}"
                         ) from error
    if "in output, which is not a known type" in str(error) and "Cache" in str(error):
        raise CaptureError(
            f"torch.export cannot capture {type(module).__name__}: its output holds a "
            "transformers cache object, which an exported graph cannot return; capture with "
            "use_cache=False (what amp_rewrite does when use_cache is not given)") from error
    construct = _user_construct(error)
    if isinstance(error, DataDependentOutputException):
        raise CaptureError(f"torch.export cannot capture {type(module).__name__}: "
                           f"{described(error)} {construct}".rstrip()
                           + f"; {_DATA_DEPENDENT_FIX}") from error
    if isinstance(error, GuardOnDataDependentSymNode):
        raise CaptureError(
            f"torch.export cannot capture {type(module).__name__}: data-dependent control flow "
            f"{construct}branches on a tensor's value; rewrite the branch with torch.where / "
            "torch.cond, or pass capture='symbolic_trace' if the branch does not depend on "
            "inputs") from error
    raise CaptureError(
        f"torch.export cannot capture {type(module).__name__}: {described(error)} {construct}"
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
    if match:
        return _location(*match.groups())
    # torch >= 2.12 names the line of a guard on an unbacked size (``if idx.size(0) > 0``
    # after ``nonzero``) only as ``Caused by: (<path suffix>:LINE in FUNC)``: the frame of
    # the traceback it points at gives the full path and the code
    match = _CAUSED_BY.search(str(error))
    if match:
        suffix, line, func = match.group(1), int(match.group(2)), match.group(3)
        frame = next((f for f in reversed(traceback.extract_tb(error.__traceback__))
                      if f.filename.endswith(suffix) and f.lineno == line), None)
        if frame is not None:
            return _location(frame.filename, frame.lineno, frame.name, frame.line)
        return _location(suffix, line, func, None)
    return ""


def _location(path: str, line: object, func: str, code: str | None) -> str:
    """``at FILE:LINE in FUNC (`code`) `` for error messages."""
    return f"at {path}:{line} in {func} (`{(code or '').strip()}`) "


def _symbolic_trace(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.fx.GraphModule:
    versions = _state_versions(module)
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
            f"{described(e)} {_model_frame(e)}(the code needs concrete values, which "
            "symbolic tracing does not have); use capture='export'") from e
    _refuse_eager_state_writes(module, versions)
    try:
        propagate_fake(gm, args, kwargs)
    except UsageError as e:
        if _eager_error(module, args, kwargs) is not None:
            raise
        # The module accepts these inputs, so the traced graph lost something: name it.
        raise CaptureError(f"torch.fx.symbolic_trace cannot capture {type(module).__name__}: "
                           f"{_failed_construct(e)}") from e.__cause__
    return gm


def _failed_construct(error: UsageError) -> str:
    node = getattr(error, "node", None)
    cause = error.__cause__
    what = described(cause) if cause is not None else str(error)
    if node is None:
        return f"the traced graph fails where the module runs: {what}"
    data_dependent = isinstance(cause, (DataDependentOutputException,
                                        GuardOnDataDependentSymNode))
    because = (_DATA_DEPENDENT_FIX if data_dependent else "the traced graph lost what made it "
               "valid eagerly (e.g. a torch.no_grad() block around an in-place update); use "
               "capture='export'")
    return f"node {node.name} ({_target_name(node)}) fails: {what}; {because}"


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return f"{node.op} {target}"
    module = getattr(target, "__module__", "") or ""
    name = getattr(target, "__name__", str(target))
    return f"{module.replace('torch._C._VariableFunctions', 'torch')}.{name}".lstrip(".")


def _state_versions(module: torch.nn.Module) -> dict[str, int]:
    """Version counters of the parameters and buffers: every in-place write bumps one."""
    return {name: t._version for name, t in module.state_dict(keep_vars=True).items()}


def _refuse_eager_state_writes(module: torch.nn.Module, before: dict[str, int]) -> None:
    """symbolic_trace runs ``self.buf.mul_(0.9)`` on the real buffer instead of recording it
    (no operand is a Proxy), so the graph would silently lack the update."""
    written = [name for name, t in module.state_dict(keep_vars=True).items()
               if t._version != before.get(name, t._version)]
    if written:
        raise CaptureError(
            f"torch.fx.symbolic_trace cannot capture {type(module).__name__}: it ran the "
            f"in-place update of {', '.join(written)} during tracing instead of recording it "
            "(an in-place op on a parameter or buffer whose operands are constants); use "
            "capture='export'")


def _model_frame(error: Exception) -> str:
    """Where the model's own code failed: the innermost frame outside torch."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if f"{os.sep}torch{os.sep}" not in f.filename and f.filename != __file__]
    if not frames:
        return ""
    f = frames[-1]
    return _location(f.filename, f.lineno, f.name, f.line)


def has_fake_values(gm: torch.fx.GraphModule) -> bool:
    """True when every placeholder and function/method call carries ``meta['val']``
    (modules are left out: export's ``_guards_fn`` has no value)."""
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
    prop = _NodeTrackingFakeProp(gm, mode)
    try:
        with mode:
            prop.run(*flat, enable_io_processing=False)
    except Exception as e:  # noqa: BLE001 - shape/dtype errors mean the inputs do not fit
        error = UsageError(f"example inputs do not fit the graph: {described(e)}")
        error.node = prop.current  # the failing node, for callers that know better
        raise error from e


class _NodeTrackingFakeProp(FakeTensorProp):
    """FakeTensorProp that remembers the node it is running, to name it in errors."""

    current: torch.fx.Node | None = None

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current = n
        return super().run_node(n)


def refresh_fake_values(gm: torch.fx.GraphModule) -> None:
    """Recompute ``meta['val']`` after a rewrite under the placeholders' own fake mode, so
    symbolic sizes stay symbolic."""
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    with _graph_fake_mode(vals) as mode:
        FakeTensorProp(gm, mode).run(*vals, enable_io_processing=False)


@contextlib.contextmanager
def _graph_fake_mode(placeholder_vals: list) -> Iterator[FakeTensorMode]:
    """The fake mode of the graph's placeholders, entered, taking real tensors (parameters)."""
    mode = torch._guards.detect_fake_mode(placeholder_vals) \
        or FakeTensorMode(allow_non_fake_inputs=True)
    previous, mode.allow_non_fake_inputs = mode.allow_non_fake_inputs, True
    try:
        with mode:
            yield mode
    finally:
        mode.allow_non_fake_inputs = previous


def fill_missing_fake_values(gm: torch.fx.GraphModule) -> bool:
    """``meta['val']`` for the call_function nodes that have none (those a fusion created),
    from their inputs' fake values; downstream nodes keep theirs (a fused op has the shape
    and dtype of its chain). False, nothing changed, where an input has no fake value."""
    missing = [n for n in gm.graph.nodes if n.op == "call_function" and "val" not in n.meta]
    inputs = {a for n in missing for a in n.all_input_nodes}
    if any("val" not in a.meta and a not in missing for a in inputs):
        return False
    with _graph_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]):
        for node in missing:  # graph order: a new node's new inputs come first
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs),
                                                 lambda a: a.meta["val"])
            node.meta["val"] = node.target(*args, **kwargs)
    return True
