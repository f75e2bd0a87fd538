"""Present a GraphModule to the core as a PrecisionGraph (docs/design.md §2-3).

Values are the fx nodes that hold one float32 or low-dtype tensor (a tuple-producing node's
tensors are its ``getitem`` users). A call node with floating ports is normally one *group*
(an ATen op computes in the dtype of its floating arguments). Exceptions:

* conversions and factories with a ``dtype`` argument: the input is a free clear group, the
  output fixed to the dtype the model asked for; ``type_as``: output and second tensor share
  a group;
* batch norm (and layer/group norm on CPU): affine parameters and statistics stay fp32;
* type promotion: an op in ``opkeys.PROMOTING`` ``promotes`` and a value with a dimension
  ``anchors`` (free reads, decision 0004);
* non-inlined modules with parameters, float scalars outside the low range, tensors written
  in place, ops without a low kernel on the device (``NO_LOW_KERNEL``): fixed at their
  original precision, except the ``±finfo(float32).max`` mask sentinel, which an op planned
  low gets as the low dtype's sentinel.

Integer, boolean and float64 tensors are never values. Casts this package inserted earlier are
transparent, so a second run sees the original graph and changes nothing.
"""
from __future__ import annotations

import fnmatch
import math
import operator
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch.fx import Node
from torch.fx.passes.infra.pass_base import PassResult

from amp_rewrite.core import CastPlan, GroupInfo, OpClass, Precision, PrecisionGraph, PrecisionPlan
from amp_rewrite.core.precision import Label
from amp_rewrite.core.precision import einsum_sums_over_nothing, integer_conversion_reason
from amp_rewrite.fx import opkeys

CAST_TAG = "amp_rewrite_cast"  # node.meta key on the casts this package inserts
IO_DTYPES = "amp_rewrite_output_dtypes"  # output-node meta key: dtypes before the first run
NO_LOW_KERNEL = "amp_rewrite_no_low_kernel"  # node meta key: the target device lacks one
# node meta key: {low dtype: why} for each low dtype the device lacks a kernel for (fx/guards.py)
MISSING_LOW_KERNELS = "amp_rewrite_missing_low_kernels"
FP16_MAX = 65504.0
ArgPath = tuple  # ("args", i[, j]) or ("kwargs", name[, j])
_BATCH_NORMS = frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit",
                          "_native_batch_norm_legit_no_training",
                          "_native_batch_norm_legit_functional"})
# Ops whose CPU kernels convert a low input to their dtype argument with a separate kernel
# (on CUDA, softmax's half_to_float path reads it in place).
_CPU_CONVERTS_INPUT = frozenset({"softmax", "log_softmax"})
# Norms whose CPU kernels accept fp32 weight/bias with low data ("mixed type"); single output.
_CPU_MIXED_NORMS = frozenset({"layer_norm", "group_norm"})


def _wide_integer_source(node: Node) -> torch.dtype | None:
    """The dtype of a conversion's integer input wider than 8 bits (8-bit integers are exact in
    bf16 and fp16), else None."""
    source = node.args[0] if node.args else None
    val = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype.is_complex \
            or val.dtype == torch.bool or val.dtype.itemsize == 1:
        return None
    return val.dtype


# GEMM op keys -> the argument whose last dim is the summed one (einsum: its equation)
_GEMM_SUMMED_ARG = {"mm": 0, "bmm": 0, "matmul": 0, "linear": 0, "addmm": 1, "baddbmm": 1,
                    "addbmm": 1}


def _is_outer_product(node: Node, key: str) -> bool:
    """A GEMM whose summed dimension is 1, or an einsum that sums over no index."""
    if key == "einsum":
        equation = node.args[0] if node.args else None
        return isinstance(equation, str) and einsum_sums_over_nothing(equation)
    index = _GEMM_SUMMED_ARG.get(key)
    if index is None or node.op != "call_function" or len(node.args) <= index:
        return False
    operand = node.args[index]
    val = operand.meta.get("val") if isinstance(operand, Node) else None
    return isinstance(val, torch.Tensor) and val.dim() > 0 and type(val.shape[-1]) is int \
        and val.shape[-1] == 1


@dataclass(frozen=True)
class Port:
    """One floating tensor argument of a node: where it sits and which value it reads."""

    node: Node
    path: ArgPath
    value: Node


@dataclass
class _GroupSpec:
    """A group under construction (GroupInfo is frozen; fixes arrive in several steps)."""

    node: Node
    tvar: str
    op_key: str
    ports: list[Port] = field(default_factory=list)
    outputs: list[Node] = field(default_factory=list)
    fixed: Precision | None = None
    reason: str = ""
    op_class: OpClass | None = None
    fixed_dtype: torch.dtype | None = None  # a LOW fix's dtype where it may not be the view's

    @property
    def key(self) -> Hashable:
        return group_key(self.node, self.tvar)

    def fix(self, precision: Precision, reason: str, dtype: torch.dtype | None = None) -> None:
        if self.fixed is None:
            self.fixed, self.reason, self.fixed_dtype = precision, reason, dtype


@dataclass
class FxView:
    """The PrecisionGraph plus what apply needs to map decisions back onto the fx graph."""

    graph: PrecisionGraph
    low: torch.dtype  # fp16 in a mixed view: a group's dtype is then its plan's label
    ports: dict[Hashable, list[Port]]  # group key -> its floating input ports
    values: dict[Node, Hashable]  # value node -> its producer (group or source key)
    fixed_dtypes: dict[Hashable, torch.dtype] = field(default_factory=dict)  # fixed groups
    # mixed views: groups computing with a scalar beyond fp16 (but not bf16) -> why
    range_groups: dict[Hashable, str] = field(default_factory=dict)

    @property
    def low_label(self) -> Label:
        return LABELS[self.low]

    def dtype(self, plan: PrecisionPlan, group: Hashable) -> torch.dtype:
        """The dtype ``group`` runs in under ``plan`` (two-label or mixed alike)."""
        return DTYPES[plan.label(group, self.low_label)]

    def cast_dtype(self, plan: PrecisionPlan, cast: CastPlan) -> torch.dtype:
        return DTYPES[plan.cast_label(cast, self.low_label)]


LABELS = {torch.float16: Label.FP16, torch.bfloat16: Label.BF16, torch.float32: Label.FP32}
DTYPES = {label: dtype for dtype, label in LABELS.items()}


# ------------------------------------------------------------------------- small helpers


def group_key(node: Node, tvar: str = "T") -> Hashable:
    """The PrecisionGraph key of a node's port group ``tvar``."""
    return ("g", node, tvar)


def _dtype(node: Node) -> torch.dtype | None:
    val = node.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) else None


def is_cast(node: Node) -> bool:
    return bool(node.meta.get(CAST_TAG))


def finished(gm: torch.fx.GraphModule, changed: bool) -> PassResult:
    """A pass's result; a changed graph is linted and recompiled first."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


def resolve(arg: Node) -> Node:
    """The value an argument reads, seeing through casts this package inserted."""
    while is_cast(arg):
        arg = arg.args[0]
    return arg


def tensor_args(node: Node) -> Iterator[tuple[ArgPath, Node]]:
    """Every Node argument of ``node`` with its path (lists and tuples are walked)."""
    def walk(arg: object, path: ArgPath) -> Iterator[tuple[ArgPath, Node]]:
        if isinstance(arg, Node):
            yield path, arg
        elif isinstance(arg, list | tuple):
            for j, item in enumerate(arg):
                yield from walk(item, (*path, j))

    for i, arg in enumerate(node.args):
        yield from walk(arg, ("args", i))
    for name, arg in node.kwargs.items():
        yield from walk(arg, ("kwargs", name))


def _has_tensor(val: object) -> bool:
    if isinstance(val, list | tuple):
        return any(_has_tensor(v) for v in val)
    return isinstance(val, torch.Tensor)


FP32_SENTINEL = torch.finfo(torch.float32).max


def is_sentinel(x: float) -> bool:
    """``±finfo(float32).max``: a dtype's extreme value, not a magnitude (module docstring)."""
    return abs(x) == FP32_SENTINEL


def float_scalars(node: Node) -> Iterator[float]:
    def walk(arg: object) -> Iterator[float]:
        if isinstance(arg, float):
            yield arg
        elif isinstance(arg, list | tuple):
            for item in arg:
                yield from walk(item)

    for arg in (*node.args, *node.kwargs.values()):
        yield from walk(arg)


def static_numel(val: torch.Tensor) -> int | None:
    """Element count, using the example size for symbolic (dynamic) dimensions."""
    total = 1
    for size in val.shape:
        if isinstance(size, torch.SymInt):
            hint = size.node.hint
            if hint is None:
                return None
            size = hint
        total *= int(size)
    return total


class _Builder:
    """Builds an FxView; one instance per view, steps as methods."""

    def __init__(self, gm: torch.fx.GraphModule, low: torch.dtype, max_finite: float,
                 keep_io_types: bool, keep_fp32_modules: list[str],
                 kept_conversions: Mapping[Node, str], device: str, mixed: bool) -> None:
        self.gm, self.low, self.mixed = gm, low, mixed
        self.on_cpu = device == "cpu"  # kernel facts differ between CPU and CUDA
        self.kept_conversions = kept_conversions
        self.max_finite = max_finite
        self.keep_io_types = keep_io_types
        self.module_patterns = keep_fp32_modules
        self.precisions = {torch.float32: Precision.HIGH, low: Precision.LOW}
        if mixed:  # a rewritten mixed graph holds both low dtypes
            self.precisions[torch.bfloat16] = Precision.LOW
        self.range_groups: dict[Hashable, str] = {}
        self.fixed_dtypes: dict[Hashable, torch.dtype] = {}
        self.values: dict[Node, Hashable] = {}
        self.specs: list[_GroupSpec] = []
        self.params = {id(p) for p in gm.parameters()}

    # -- values ----------------------------------------------------------------------
    def precision_of(self, node: Node) -> Precision | None:
        """Precision of a value node's tensor, None if it is not a float32/low tensor."""
        if is_cast(node) or node.op == "output":
            return None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        return self.precisions.get(val.dtype)

    def outputs_of(self, node: Node) -> list[Node]:
        if self.precision_of(node) is not None:
            return [node]
        return [u for u in node.users
                if u.op == "call_function" and u.target is operator.getitem and self.is_value(u)]

    def is_value(self, node: Node) -> bool:
        return self.precision_of(node) is not None

    # -- groups ----------------------------------------------------------------------
    def node_groups(self, node: Node) -> list[_GroupSpec]:
        """The groups of one call node (see the module docstring)."""
        key = opkeys.op_key(node, self.gm)
        ports = [Port(node, path, resolve(arg)) for path, arg in tensor_args(node)
                 if self.is_value(resolve(arg))]
        outputs = self.outputs_of(node)
        if not ports and not outputs:
            return []
        if not outputs and not _has_tensor(node.meta.get("val")):
            return []  # reads only metadata (sizes, export's guards) or returns a scalar
        dtype = opkeys.explicit_dtype(node)
        if dtype is not None:
            return self._conversion(node, key, ports, outputs, dtype)
        if opkeys.follows_other_dtype(node):
            return [_GroupSpec(node, "in", key, ports[:1], op_class=OpClass.CLEAR),
                    _GroupSpec(node, "out", key, ports[1:], outputs)]
        if key in _BATCH_NORMS and len(ports) > 1:
            return self._norm_with_fp32_params(node, key, ports, outputs, "batch norm")
        if key in _CPU_MIXED_NORMS and len(ports) > 1 and self.on_cpu:
            return self._norm_with_fp32_params(node, key, ports, outputs, f"{key} on CPU")
        # An outer product (a GEMM summing over nothing) is a broadcast multiply, memory-bound
        # like one, and its operands are often positions (RoPE's t ⊗ inv_freq): gray, as mul.
        op_class = OpClass.GRAY if _is_outer_product(node, key) else None
        spec = _GroupSpec(node, "T", key, ports, outputs, op_class=op_class)
        if not ports:  # where(mask, 0.0, -1e4): nothing to follow, and no dtype to retype
            spec.fix(self.precision_of(outputs[0]), "no floating-point tensor input and no "
                                                    "dtype argument: torch's default decides",
                     _dtype(outputs[0]))
        self._fix_special(spec)
        return [spec]

    def _conversion(self, node: Node, key: str, ports: list[Port], outputs: list[Node],
                    dtype: torch.dtype) -> list[_GroupSpec]:
        specs = []
        if ports:
            spec = _GroupSpec(node, "in", key, ports, op_class=OpClass.CLEAR)
            if key in _CPU_CONVERTS_INPUT and dtype in self.precisions and self.on_cpu:
                spec.fix(self.precisions[dtype], f"{key} on CPU converts its input to {dtype} "
                                                 "with a separate kernel", dtype)
            specs.append(spec)
        if outputs:
            out = _GroupSpec(node, "out", key, outputs=outputs, op_class=OpClass.CLEAR)
            if node in self.kept_conversions:
                # The model computed this in fp32 on purpose and a reader needs it so: a deny
                # source, so that gray math after it (a residual add) stays fp32 too.
                out.fix(Precision.HIGH, self.kept_conversions[node])
                out.op_class = OpClass.DENY
            elif dtype == torch.float32 and (source := _wide_integer_source(node)) is not None:
                # Positions and timesteps: rounded here, the angles read from them would be
                # wrong; a deny source, so the gray math up to cos/sin stays fp32 too.
                out.fix(Precision.HIGH, integer_conversion_reason(key, str(source)))
                out.op_class = OpClass.DENY
            elif not (key in opkeys.RETYPABLE and dtype == torch.float32):
                out.fix(self.precisions[dtype],
                        f"{key}: the model's own dtype argument {dtype} is kept", dtype)
            specs.append(out)
        return specs

    def _norm_with_fp32_params(self, node: Node, key: str, ports: list[Port],
                               outputs: list[Node], kernel: str) -> list[_GroupSpec]:
        """Data in either precision; parameters (and running statistics) fixed fp32."""
        data = _GroupSpec(node, "T", key, ports[:1], outputs)
        params = _GroupSpec(node, "params", key, ports[1:], op_class=OpClass.CLEAR)
        params.fix(Precision.HIGH, f"{kernel} takes fp32 affine parameters (and running "
                                   "statistics) with data in either precision")
        self._fix_special(data)
        return [data, params]

    def _fix_special(self, spec: _GroupSpec) -> None:
        node = spec.node
        if node.op == "call_module":
            self._fix_module(spec)
        if NO_LOW_KERNEL in node.meta:  # found by probing the kernel (fx/guards.py)
            spec.fix(Precision.HIGH, node.meta[NO_LOW_KERNEL])
        for x in float_scalars(node):
            if self.mixed and math.isfinite(x) and FP16_MAX < abs(x) <= self.max_finite:
                # bf16 holds it: the group needs range, not fp32 (core/multilabel.py)
                self.range_groups[spec.key] = (f"scalar argument {x:g} is beyond fp16's "
                                               "range, and so may be its output")
            if (math.isfinite(x) and abs(x) > self.max_finite and not is_sentinel(x)
                    and spec.fixed is None):
                # Its output may hold the scalar too: a deny source, so following gray/clear
                # ops keep it high as well (docs/design.md §3).
                spec.fix(Precision.HIGH, f"scalar argument {x:g} is outside the "
                                         f"{torch.bfloat16 if self.mixed else self.low} "
                                         "range, and so may be its output")
                spec.op_class = OpClass.DENY
        stack = node.meta.get("nn_module_stack") or {}
        path = next(reversed(stack.values()))[0] if stack else ""
        for pattern in self.module_patterns:
            if path and fnmatch.fnmatchcase(path, pattern):
                spec.fix(Precision.HIGH, f"pinned to fp32 by keep_fp32 pattern {pattern!r} "
                                         f"(module {path})")
        tuple_used_whole = (self.precision_of(node) is None and isinstance(
            node.meta.get("val"), list | tuple) and any(u.target is not operator.getitem
                                                         for u in node.users))
        if tuple_used_whole:
            spec.fix(Precision.HIGH, "its tuple output is used whole, so it cannot be cast")

    def _fix_module(self, spec: _GroupSpec) -> None:
        module = self.gm.get_submodule(spec.node.target)
        params = [p for p in module.parameters() if p.is_floating_point()]
        if params:
            precision = self.precisions.get(params[0].dtype, Precision.HIGH)
            spec.fix(precision, f"module {type(module).__name__} runs with its own "
                                f"{params[0].dtype} parameters (not inlined)", params[0].dtype)

    # -- mutation ----------------------------------------------------------------------
    def fix_mutations(self) -> None:
        """Groups touching a tensor written in place keep its precision: a cast would copy it."""
        by_value: dict[Node, list[_GroupSpec]] = {}
        for spec in self.specs:
            for v in [p.value for p in spec.ports] + spec.outputs:
                by_value.setdefault(v, []).append(spec)
        for node in self.gm.graph.nodes:
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            target = opkeys.mutated_argument(node, self.gm)
            if target is None or not self.is_value(resolve(target)):
                continue
            aliases = alias_set(resolve(target), self.gm)
            precision = self.precision_of(resolve(target))
            dtype = _dtype(resolve(target))
            for v in aliases:
                for spec in by_value.get(v, ()):
                    spec.fix(precision, f"reads or writes a tensor that {node.name} mutates "
                                        "in place", dtype)

    # -- assembly ------------------------------------------------------------------------
    def build(self) -> FxView:
        graph = PrecisionGraph()
        nodes = list(self.gm.graph.nodes)
        for node in nodes:
            if self.is_value(node):
                val = node.meta["val"]
                numel = static_numel(val)
                # A 0-dim tensor does not promote a dimensioned one of another float dtype.
                graph.add_value(node, name=node.name, nbytes=None if numel is None else 4 * numel,
                                anchors=val.dim() > 0)
        for node in nodes:
            if node.op in ("placeholder", "get_attr") and self.is_value(node):
                self._add_source(graph, node)
            elif node.op in ("call_function", "call_method", "call_module") and not is_cast(node):
                if not (node.target is operator.getitem and self._is_tuple_getitem(node)):
                    self.specs.extend(self.node_groups(node))
        self.fix_mutations()
        ports = {}
        for spec in self.specs:
            info = GroupInfo(spec.key, spec.node, spec.node.name, spec.op_key, fixed=spec.fixed,
                             reason=spec.reason, op_class=spec.op_class, tvar=spec.tvar,
                             promotes=spec.tvar == "T" and spec.op_key in opkeys.PROMOTING)
            graph.add_group(info, inputs=list(dict.fromkeys(p.value for p in spec.ports)),
                            outputs=spec.outputs)
            ports[spec.key] = spec.ports
            if spec.fixed is not None:
                self.fixed_dtypes[spec.key] = spec.fixed_dtype or (
                    torch.float32 if spec.fixed is Precision.HIGH else self.low)
            for v in spec.outputs:
                self.values[v] = spec.key
        self._add_sinks(graph, ports)
        return FxView(graph, self.low, ports, self.values, self.fixed_dtypes, self.range_groups)

    def _is_tuple_getitem(self, node: Node) -> bool:
        source = node.args[0]
        return isinstance(source, Node) and not isinstance(source.meta.get("val"), torch.Tensor)

    def _add_source(self, graph: PrecisionGraph, node: Node) -> None:
        precision = self.precision_of(node)
        if node.op == "placeholder":
            reason = "graph input: its dtype is the caller's"
        elif id(operator.attrgetter(node.target)(self.gm)) in self.params:
            reason = "parameter: the FP32 master weight stays; it is cast in-graph per forward"
        else:
            reason = "buffer or constant: stored as is"
        key = ("src", node)
        graph.add_source(key, node, name=node.name, fixed=precision, reason=reason)
        self.fixed_dtypes[key] = _dtype(node)
        self.values[node] = key

    def _add_sinks(self, graph: PrecisionGraph, ports: dict[Hashable, list[Port]]) -> None:
        output = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        args = list(tensor_args(output))
        # The original output dtypes, recorded on the first run: a rewritten value's
        # meta['val'] has its new dtype, and keep_io_types means the caller's dtypes.
        original = output.meta.setdefault(IO_DTYPES, [_dtype(resolve(a)) for _, a in args])
        for i, (path, arg) in enumerate(args):
            value = resolve(arg)
            precision = self.precisions.get(original[i]) if self.is_value(value) else None
            if precision is None:
                continue
            fixed = precision if self.keep_io_types else None
            graph.add_sink(("sink", i), value, name=f"output_{i}", fixed=fixed,
                           reason="graph output: keep_io_types keeps its dtype")
            if fixed is not None:
                self.fixed_dtypes[("sink", i)] = original[i]
            ports[("sink", i)] = [Port(output, path, value)]


def alias_set(value: Node, gm: torch.fx.GraphModule) -> set[Node]:
    """Every node whose tensor may share memory with ``value``: its base and all views."""
    base = value
    while base.op not in ("placeholder", "get_attr") and opkeys.is_view(base, gm):
        parent = next((a for _, a in tensor_args(base)), None)
        if parent is None:
            break
        base = resolve(parent)
    found, stack = {base}, [base]
    while stack:
        node = stack.pop()
        for user in node.users:
            if user not in found and not is_cast(user) and opkeys.is_view(user, gm) \
                    and next((resolve(a) for _, a in tensor_args(user)), None) is node:
                found.add(user)
                stack.append(user)
    return found


def build_view(gm: torch.fx.GraphModule, low: torch.dtype, *, max_finite: float,
               keep_io_types: bool = True, keep_fp32_modules: list[str] | None = None,
               kept_conversions: Mapping[Node, str] | None = None,
               device: str = "cuda", mixed: bool = False) -> FxView:
    """The PrecisionGraph of ``gm`` for target dtype ``low`` (float16 or bfloat16).

    ``kept_conversions``: the model's own fp32 conversions to keep fp32 (node → reason);
    other fp32 conversions and factories are free, and retyped low when planned low.
    ``device``: the device type the model will run on ('cuda', 'cpu', ...). ``mixed``: a
    view for ``core.multilabel.plan_mixed`` (``low`` fp16; bf16 tensors are values too, and
    ``max_finite`` is bf16's: scalars beyond fp16 only make ``range_groups``).
    """
    return _Builder(gm, low, max_finite, keep_io_types, keep_fp32_modules or [],
                    kept_conversions or {}, device, mixed).build()
