"""What the rewrite checks or adapts before planning, so it never returns a silent wrong result.

* ``refuse_non_float_gemm_inputs``: an integer tensor into a GEMM or convolution, which fake
  kernels do not check, is a ``UsageError`` naming node and input.
* ``ConvertForeignFloats``: tensors in the *other* low dtype are converted as
  ``torch.autocast`` would, through a ``_to_copy(float32)`` the plan retypes; graph outputs
  are converted back.
* ``mark_missing_low_kernels``: on CPU, an op whose kernel has no low variant, or a
  convolution whose low kernel computes wrong results for its shapes, is probed once on
  zeros (or seeded operands) and marked, and the view keeps it fp32. float64 is left alone.
"""
from __future__ import annotations

import operator
import re

import torch
from torch.fx import Node
from torch.fx.node import map_aggregate
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from amp_rewrite.core import OpClass, RuleSet
from amp_rewrite.core.metric import relative_error
from amp_rewrite.errors import UsageError
from amp_rewrite.fx import opkeys
from amp_rewrite.fx.apply import after_producer, set_arg
from amp_rewrite.fx.capture import refresh_fake_values
from amp_rewrite.fx.passes import storage_aliases
from amp_rewrite.fx.view import MISSING_LOW_KERNELS, NO_LOW_KERNEL, is_cast, tensor_args

FOREIGN_TAG = "amp_rewrite_foreign_float"  # node.meta key on the conversions this pass adds
_OTHER_LOW = {torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}
_TO_COPY = torch.ops.aten._to_copy.default


def _dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def _is_integer(dtype: torch.dtype | None) -> bool:
    return dtype is not None and not (dtype.is_floating_point or dtype.is_complex
                                      or dtype == torch.bool)


def refuse_non_float_gemm_inputs(gm: torch.fx.GraphModule, rules: RuleSet) -> None:
    """UsageError for the first allow-class op that reads an integer tensor."""
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        key = opkeys.op_key(node, gm)
        if rules.class_of(key) is not OpClass.ALLOW:
            continue
        for _, arg in tensor_args(node):
            if _is_integer(_dtype(arg)):
                raise UsageError(
                    f"node {node.name} ({key}{_module_path(node)}) reads {arg.name} as "
                    f"{_dtype(arg)}: {key} needs floating-point inputs, and the module would "
                    f"fail when called; convert it first (e.g. {arg.name}.float())")


def _module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return f" in module {next(reversed(stack.values()))[0]}" if stack else ""


class ConvertForeignFloats(PassBase):
    """Inputs, parameters and buffers in the other low dtype → fp32 conversions the plan
    retypes; outputs back to their dtype (module docstring). ``notes`` says what it did."""

    def __init__(self, low: torch.dtype, keep_io_types: bool = True) -> None:
        self.low = low
        self.keep_io_types = keep_io_types
        self.foreign = _OTHER_LOW[low]
        self.notes: list[str] = []

    def call(self, graph_module: torch.fx.GraphModule) -> PassResult:
        sources = self._foreign_sources(graph_module)
        outputs = self._foreign_outputs(graph_module) if self.keep_io_types else []
        for node in sources:
            self._convert_reads(graph_module.graph, node, torch.float32)
        for output, path_index in outputs:
            self._convert_output(graph_module.graph, output, path_index)
        changed = bool(sources or outputs)
        if changed:
            graph_module.graph.lint()
            graph_module.recompile()
            refresh_fake_values(graph_module)
        self.notes = self._describe(graph_module, sources)
        return PassResult(graph_module, changed)

    def _foreign_sources(self, gm: torch.fx.GraphModule) -> list[Node]:
        written = _written_sources(gm)
        return [n for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")
                and _dtype(n) == self.foreign and n not in written
                and any(not u.meta.get(FOREIGN_TAG) and not _is_input_guard(u)
                        for u in n.users)]

    def _foreign_outputs(self, gm: torch.fx.GraphModule) -> list[tuple[Node, int]]:
        output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        return [(output, i) for i, (_, arg) in enumerate(tensor_args(output))
                if _dtype(arg) == self.foreign and not arg.meta.get(FOREIGN_TAG)
                and arg.op != "placeholder"]

    @staticmethod
    def _convert_reads(graph: torch.fx.Graph, node: Node, dtype: torch.dtype) -> None:
        with graph.inserting_after(after_producer(graph, node)):
            conversion = graph.call_function(_TO_COPY, (node,), {"dtype": dtype})
        conversion.meta[FOREIGN_TAG] = True
        conversion.meta["val"] = node.meta["val"].to(dtype)
        node.replace_all_uses_with(conversion, delete_user_cb=lambda user: user is not conversion
                                   and not _is_input_guard(user))

    def _convert_output(self, graph: torch.fx.Graph, output: Node, index: int) -> None:
        args = list(tensor_args(output))
        path, value = args[index]
        with graph.inserting_before(output):
            conversion = graph.call_function(_TO_COPY, (value,), {"dtype": self.foreign})
        conversion.meta[FOREIGN_TAG] = True
        conversion.meta["val"] = value.meta["val"].to(self.foreign)
        set_arg(output, path, conversion)

    def _describe(self, gm: torch.fx.GraphModule, converted: list[Node]) -> list[str]:
        dtypes = {_dtype(n) for n in gm.graph.nodes if n.op in ("placeholder", "get_attr")
                  and not is_cast(n)} - {None}
        floats = {d for d in dtypes if d.is_floating_point}
        notes = []
        if converted or any(n.meta.get(FOREIGN_TAG) for n in gm.graph.nodes):
            notes.append(f"the model's {self.foreign} tensors are converted as "
                         f"torch.autocast(dtype={self.low}) converts them: to {self.low} for "
                         "ops that run low, to float32 for ops that need it"
                         + (f"; outputs keep {self.foreign}" if self.keep_io_types else ""))
        if floats == {torch.float64}:
            notes.append("the model's floating-point tensors are all float64, which "
                         "torch.autocast never casts either: returned unchanged (convert it to "
                         "float32 first to rewrite it)")
        return notes


def _is_input_guard(node: Node) -> bool:
    """export's ``_guards_fn`` checks the caller's inputs as given, before any conversion."""
    return node.op == "call_module" and node.target == "_guards_fn"


def _written_sources(gm: torch.fx.GraphModule) -> set[Node]:
    """Inputs, parameters and buffers some node writes in place (through views too)."""
    written: set[Node] = set()
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module") \
                and node.target is not operator.getitem:
            target = opkeys.mutated_argument(node, gm)
            if target is not None:
                written |= {a for a in storage_aliases(target, gm)
                            if a.op in ("placeholder", "get_attr")}
    return written


# ------------------------------------------------------------------ kernels lacking low dtypes

_MISSING_DTYPE = re.compile(r"not implemented for '(Half|BFloat16)'")
_PROBED_CLASSES = {OpClass.GRAY, OpClass.CLEAR}  # allow: CPU autocast runs them low already
_MAX_PROBE_ELEMENTS = 1 << 24  # larger inputs are not materialised; such ops stay unprobed


def mark_missing_low_kernels(gm: torch.fx.GraphModule, lows: tuple[torch.dtype, ...],
                             rules: RuleSet, device: str) -> None:
    """Mark the ops that cannot run in some of ``lows`` on ``device``: ``MISSING_LOW_KERNELS``
    maps each such dtype to the reason, and ``NO_LOW_KERNEL`` (the view keeps the op fp32)
    is set when every one is missing. A mixed plan probes fp16 and bf16 (an op with only a
    bf16 kernel may still run bf16)."""
    if device != "cpu":
        return  # CUDA kernels cover fp16/bf16 for every op its autocast lists
    for node in gm.graph.nodes:
        target = _probe_target(node, gm)
        if target is None or is_cast(node):
            continue
        key = opkeys.op_key(node, gm)
        if not any(_dtype(arg) in (torch.float32, *lows) for _, arg in tensor_args(node)):
            continue
        missing = {low: why for low in lows
                   if (why := _missing_kernel(node, target, key, rules, low)) is not None}
        if missing:
            node.meta[MISSING_LOW_KERNELS] = missing
        if missing and len(missing) == len(lows):
            node.meta[NO_LOW_KERNEL] = "; ".join(missing.values())


def _missing_kernel(node: Node, target: object, key: str, rules: RuleSet,
                    low: torch.dtype) -> str | None:
    """Why ``node`` cannot run in ``low`` on this CPU, or None."""
    op_class = rules.class_of(key)
    if op_class in _PROBED_CLASSES and _lacks_low_kernel(node, target, low):
        return f"{key} has no {low} kernel on CPU (probed), so it runs in float32"
    if op_class is OpClass.ALLOW and key.startswith("conv"):
        error = _low_conv_error(node, target, low)
        if error is not None and error > _WRONG_KERNEL_ULPS * torch.finfo(low).eps:
            return (f"{key}: this CPU's {low} kernel computes wrong results for this shape "
                    f"(probed: relative error {error:.2g} against float32 on the same "
                    "rounded operands), so it runs in float32")
    return None


# A right low kernel differs from float32 on the same rounded operands by a few units of
# the low dtype's epsilon; a wrong one (some oneDNN bf16 grouped convs) by far more.
_WRONG_KERNEL_ULPS = 8
_CONV_ERRORS: dict[tuple, float | None] = {}


def _low_conv_error(node: Node, target: object, low: torch.dtype) -> float | None:
    """The error metric (``core.metric``: max|conv_low - conv_fp32| / max|conv_fp32|, a new
    NaN/Inf infinite) on seeded random operands of the node's shapes, both computed from the
    same low-rounded operands (None if not probed)."""
    args = _probe_arguments(node, low)
    if args is None:
        return None
    (args, kwargs) = args
    key = (target, low, _shape_key((args, kwargs)))
    if key in _CONV_ERRORS:
        return _CONV_ERRORS[key]
    generator = torch.Generator().manual_seed(0)

    def draw(arg: object) -> object:
        if isinstance(arg, torch.Tensor) and arg.dtype == low:
            return torch.randn(arg.shape, generator=generator).to(low)
        return arg

    low_args, low_kwargs = map_aggregate(args, draw), map_aggregate(kwargs, draw)

    def widened(arg: object) -> object:
        return arg.float() if isinstance(arg, torch.Tensor) and arg.dtype == low else arg

    error = None
    with torch.no_grad():
        try:
            got = target(*low_args, **low_kwargs).float()
            want = target(*map_aggregate(low_args, widened), **map_aggregate(low_kwargs, widened))
        except Exception:  # noqa: BLE001 - a kernel that cannot run here says nothing
            got = want = None
    if isinstance(got, torch.Tensor) and want.numel() and want.abs().max() > 0:
        error = relative_error(want.numpy(), got.numpy())
    _CONV_ERRORS[key] = error
    return error


def _shape_key(tree: object) -> tuple:
    return tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                 for a in torch.utils._pytree.tree_leaves(tree))


def _is_torch_op(target: object) -> bool:
    """ATen overloads and torch's own functions: no side effects beyond their outputs (a
    wrapped user function in a symbolic_trace graph could do anything, so it is not run)."""
    if isinstance(target, torch._ops.OpOverload):
        return True
    module = getattr(target, "__module__", None) or ""
    return callable(target) and (module == "torch" or module.startswith("torch."))


def _probe_target(node: Node, gm: torch.fx.GraphModule) -> object | None:
    """What to run for ``node``: a torch op, or a parameter-free ``torch.nn`` module
    (``nn.AvgPool3d`` in a symbolic_trace graph); None for anything else."""
    if node.op == "call_function" and _is_torch_op(node.target):
        return node.target
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module).__module__.startswith("torch.nn.") and not any(
                True for _ in module.parameters()):
            return module
    return None


def _lacks_low_kernel(node: Node, target: object, low: torch.dtype) -> bool:
    key = (type(target) if isinstance(target, torch.nn.Module) else target, low)
    cached = _PROBES.get(key)
    if cached is not None:
        return cached
    args = _probe_arguments(node, low)
    if args is None:
        return False
    answer = _PROBES[key] = _probe(target, low, *args)
    return answer


_PROBES: dict[tuple[object, torch.dtype], bool] = {}


def _probe_arguments(node: Node, low: torch.dtype) -> tuple[tuple, dict] | None:
    """Real zero tensors shaped like the node's inputs (float ones in ``low``), or None."""
    too_big = False

    def materialise(arg: object) -> object:
        nonlocal too_big
        if not isinstance(arg, Node):
            return arg
        val = arg.meta.get("val")
        if isinstance(val, torch.SymInt | torch.SymFloat | torch.SymBool):
            return val.node.hint
        if not isinstance(val, torch.Tensor):
            return val
        shape = [int(s.node.hint) if isinstance(s, torch.SymInt) else int(s) for s in val.shape]
        if torch.Size(shape).numel() > _MAX_PROBE_ELEMENTS:
            too_big = True
            return None
        # every float32 or low input in the probed dtype: a planned group reads one dtype
        dtype = low if val.dtype in (torch.float32, torch.float16, torch.bfloat16) \
            else val.dtype
        return torch.zeros(shape, dtype=dtype)

    args = map_aggregate(node.args, materialise)
    kwargs = map_aggregate(node.kwargs, materialise)
    return None if too_big else (args, kwargs)


def _probe(target: object, low: torch.dtype, args: tuple, kwargs: dict) -> bool:
    """True when running ``target`` reports a missing ``low`` kernel (nothing else counts)."""
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            target(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            return bool(_MISSING_DTYPE.search(str(e)))
        except Exception:  # noqa: BLE001 - any other failure says nothing about dtypes
            return False
    return False
