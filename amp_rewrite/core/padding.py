"""Padding plan: GEMM K/N and conv channel dims to multiples of 8 (docs/design.md §8), pure.

On a framework-neutral *pad graph* (``GEMM``, ``CONV``, ``POINTWISE``, ``OPAQUE`` ops) built by
an adapter after the precision plan, decide which dims of which low GEMM/conv are padded
(``can_pad`` legality apart from ``should_pad``'s roofline cost model, as in Inductor's
``pad_mm``) and how far the padded layout travels through finite-safe pointwise ops. The plan
is the adapter's contract: ``produced[v]`` is the padded layout of every value a region op
writes, ``reads[(op, v)]`` the layout in which a region op reads ``v``; every other read is
unpadded. Semantics in docs/design.md §8; why a cost model (decisions 0008, 0019).
"""
from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NamedTuple

from amp_rewrite.core.flops import conv_flops, gemm_flops

Dim = int | str | None


class PadKind(enum.Enum):
    GEMM = "gemm"
    CONV = "conv"
    POINTWISE = "pointwise"
    OPAQUE = "opaque"

    __hash__ = object.__hash__  # see precision.Precision


class AxisPad(NamedTuple):
    """Pad ``axis`` from ``size`` to ``padded`` with ``fill``."""

    axis: int
    size: int
    padded: int
    fill: float = 0.0


class PadInput(NamedTuple):
    """An input of a POINTWISE op: input axis = output axis − ``offset`` (numpy broadcasting
    gives out_rank − in_rank; BatchNorm's 1-D parameters give 1 for the channel axis)."""

    value: Hashable
    offset: int = 0
    fill: float = 0.0  # what its padding holds (BatchNorm's var: 1)
    may_vary: bool = True  # False: the op only stays finite if this input is not padded


class PadValue(NamedTuple):
    key: Hashable
    name: str
    shape: tuple[Dim, ...] | None
    constant: bool = False  # a weight: padded once (ONNX) or fused with its cast (fx)
    itemsize: int = 2
    hint: tuple[int | None, ...] | None = None  # example sizes of symbolic dims (estimates)


class PadOp(NamedTuple):
    """One op of the pad graph; see the module docstring for the kinds.

    GEMM: ``k_axes``/``n_axes`` map each operand (and the output, for N) to its K / N axis;
    ``bias`` (if any) is padded along ``bias_axis`` with N. CONV: ``k_axes`` map x and w to
    their input-channel axes, ``n_axes`` w, y (and bias) to their output-channel axes.
    """

    key: Hashable
    name: str
    kind: PadKind
    inputs: tuple[Hashable, ...]
    outputs: tuple[Hashable, ...]
    low: bool = True
    k_axes: tuple[tuple[Hashable, int], ...] = ()
    n_axes: tuple[tuple[Hashable, int], ...] = ()
    groups: int = 1
    pointwise: tuple[PadInput, ...] = ()
    finite_safe: bool = False


@dataclass(frozen=True)
class PadPolicy:
    """Knobs of ``should_pad``'s cost model; defaults model an H100 SXM5 (decisions 0019, 0023).

    * ``tensor_core_tflops``: dense FP16/BF16 Tensor-Core peak.
    * ``fallback_tflops``: the non-Tensor-Core peak, the rate of an op with a dim below
      ``multiple``.
    * ``misaligned_slowdown``: time of a misaligned GEMM over the same GEMM padded, applied to
      the whole roofline time.
    * ``pad_small_conv_channels``: pad convs with fewer than ``multiple`` input channels.
    * ``memory_tbps``: memory bandwidth.
    * ``symbolic_dim_size``: size assumed for a symbolic dim without an example size.
    * ``min_weight_elements``: ops below it are launch-bound and never padded.
    * ``pad_activation_gemms``: let the cost model consider GEMMs whose operands are both
      activations (attention); False refuses them outright.
    """

    multiple: int = 8
    min_weight_elements: int = 256
    pad_activation_gemms: bool = True
    pad_small_conv_channels: bool = False
    tensor_core_tflops: float = 989.4
    fallback_tflops: float = 133.8
    misaligned_slowdown: float = 1.6
    memory_tbps: float = 3.35
    symbolic_dim_size: int = 512

    def op_seconds(self, flops: float, traffic: float, misaligned: Iterable[int]) -> float:
        """Roofline time of one GEMM/conv with the given misaligned dim sizes."""
        misaligned = list(misaligned)
        rate = self.tensor_core_tflops
        if misaligned:
            traffic *= self.misaligned_slowdown
            rate = (self.fallback_tflops if min(misaligned) < self.multiple
                    else self.tensor_core_tflops / self.misaligned_slowdown)
        return max(flops / (rate * 1e12), traffic / (self.memory_tbps * 1e12))


class DimPad(NamedTuple):
    """A padded dim; symbolic: ``size`` is the symbol, ``padded`` ``padded_symbol(size)``,
    and ``est_*`` the sizes the cost model assumes (example size, or a mean pad)."""

    role: str  # 'K' | 'N' | 'Cin' | 'Cout'
    size: int | str
    padded: int | str
    est_size: float = 0.0
    est_padded: float = 0.0

    @property
    def ratio(self) -> float:
        if isinstance(self.size, int):
            return self.padded / self.size
        return self.est_padded / self.est_size


class OpPadding(NamedTuple):
    """What happens to one GEMM/conv: padded dims and why the others are not."""

    op: Hashable
    name: str
    dims: tuple[DimPad, ...]
    skipped: tuple[tuple[str, str], ...]  # (role, reason)
    flops: int
    padded_flops: int
    extra_weight_bytes: int
    est_seconds: float = 0.0  # cost model, unpadded
    est_padded_seconds: float = 0.0  # cost model, with ``dims`` padded (copies included)


class PadGraph:
    """Ops and values for padding; the adapter adds values before the ops that use them."""

    def __init__(self) -> None:
        self.values: dict[Hashable, PadValue] = {}
        self.ops: dict[Hashable, PadOp] = {}
        self.producer: dict[Hashable, Hashable] = {}
        self.consumers: dict[Hashable, list[Hashable]] = {}

    def add_value(self, value: PadValue) -> None:
        self.values[value.key] = value
        self.consumers.setdefault(value.key, [])

    def add_op(self, op: PadOp) -> None:
        self.ops[op.key] = op
        for v in dict.fromkeys(op.inputs):
            self.consumers.setdefault(v, []).append(op.key)
        for v in op.outputs:
            self.producer[v] = op.key

    def shape(self, value: Hashable) -> tuple[Dim, ...] | None:
        info = self.values.get(value)
        return info.shape if info is not None else None

    def is_constant(self, value: Hashable) -> bool:
        info = self.values.get(value)
        return info is not None and info.constant


@dataclass(frozen=True)
class PaddingPlan:
    """The adapter contract (module docstring) and the report."""

    produced: Mapping[Hashable, AxisPad]
    reads: Mapping[tuple[Hashable, Hashable], tuple[AxisPad, ...]]
    ops: Mapping[Hashable, OpPadding]  # every low GEMM/conv considered
    propagated: frozenset  # POINTWISE ops that run on the padded layout
    regions: int  # padded K reads that take a padded producer's output as is
    policy: PadPolicy = field(default_factory=PadPolicy)

    @property
    def padded_ops(self) -> list[OpPadding]:
        return [p for p in self.ops.values() if p.dims]

    def is_empty(self) -> bool:
        return not self.reads and not self.produced

    @classmethod
    def empty(cls, policy: PadPolicy | None = None) -> PaddingPlan:
        """The plan of a graph with nothing to pad."""
        none = MappingProxyType({})
        return cls(none, none, none, frozenset(), 0, policy or PadPolicy())


def round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def padded_symbol(symbol: str, multiple: int) -> str:
    """The name of a symbolic dim rounded up at runtime (a multiple by construction)."""
    return f"ceil{multiple}({symbol})"


def is_aligned(size: Dim, multiple: int) -> bool:
    if isinstance(size, int):
        return size % multiple == 0
    return isinstance(size, str) and size.startswith(f"ceil{multiple}(")


# ----------------------------------------------------------------------------- legality


def _numel(shape: Iterable[Dim]) -> int | None:
    dims = list(shape)
    return math.prod(dims) if all(isinstance(d, int) for d in dims) else None


def op_flops(graph: PadGraph, op: PadOp) -> int | None:
    """2·(output elements)·(reduction length) for GEMM/conv; None with unknown shapes."""
    out = graph.shape(op.outputs[0])
    if out is None:
        return None
    known = [d if isinstance(d, int) else 1 for d in out]  # symbolic dims count once
    if op.kind is PadKind.GEMM:
        k = _dim(graph, op.k_axes[0])
        return gemm_flops(known, k) if isinstance(k, int) else None
    w, cout_axis = op.n_axes[0]
    wshape = graph.shape(w)
    if wshape is None or _numel(wshape) is None:
        return None
    return conv_flops(known, wshape, cout_axis)


def _dim(graph: PadGraph, ref: tuple[Hashable, int]) -> Dim:
    shape = graph.shape(ref[0])
    if shape is None or not -len(shape) <= ref[1] < len(shape):
        return None
    return shape[ref[1]]


def _roles(op: PadOp) -> dict[str, tuple[tuple[Hashable, int], ...]]:
    names = ("K", "N") if op.kind is PadKind.GEMM else ("Cin", "Cout")
    return {names[0]: op.k_axes, names[1]: op.n_axes}


def can_pad(graph: PadGraph, op: PadOp, role: str, multiple: int,
            runtime_pads: bool = False) -> str | None:
    """None if ``role`` of ``op`` may be padded, else why not (legality only).

    ``runtime_pads``: the adapter can pad a symbolic dim by a runtime amount (ONNX's
    Shape/Mod arithmetic); without it symbolic dims are not padded.
    """
    if not op.low:
        return "runs high: only low-precision GEMMs/convs are padded"
    if op.kind is PadKind.CONV and op.groups != 1:
        return (f"grouped conv (groups={op.groups}): per-group padding would interleave zero "
                "channels between groups; not padded")
    refs = _roles(op)[role]
    if len(set(op.inputs)) < len(op.inputs):
        return f"{role}: one value is read as two operands (x·xᵀ); its layouts would clash"
    dims = {_dim(graph, r) for r in refs}
    if len(dims) != 1:
        return f"{role} differs between operands {sorted(map(str, dims))}"
    (size,) = dims
    if size is None:
        return f"{role} unknown"
    if is_aligned(size, multiple):
        return f"{role}={size} already aligned"
    if isinstance(size, str) and not runtime_pads:
        return (f"{role} is symbolic ({size}): this adapter pads static sizes only (no "
                "runtime pad amounts)")
    return None  # symbolic: a runtime pad amount, (multiple − d % multiple) % multiple


# ----------------------------------------------------------------------------- profitability


def _weight_elements(graph: PadGraph, op: PadOp) -> int | None:
    if op.kind is PadKind.CONV:
        return _numel(graph.shape(op.k_axes[1][0]) or (None,))
    k = _dim(graph, op.k_axes[0])
    n = _dim(graph, op.n_axes[-1])
    return k * n if isinstance(k, int) and isinstance(n, int) else None


def _all_activation(graph: PadGraph, op: PadOp) -> bool:
    return op.kind is PadKind.GEMM and not any(graph.is_constant(v) for v, _ in op.k_axes)


def should_pad(graph: PadGraph, op: PadOp, candidates: Mapping[str, DimPad],
               policy: PadPolicy, slice_is_view: bool = False,
               unpadded_n: frozenset = frozenset()
               ) -> tuple[dict[str, DimPad], dict[str, str]]:
    """Which legal dims to pad and why not the rest: the cost model's fastest subset.

    ``slice_is_view``: the adapter's slice at a region end is a view (torch), not a copy.
    ``unpadded_n``: GEMMs/convs known not to pad their N/Cout, so an input they produce
    needs a runtime Pad. A larger subset must be strictly faster, so ties keep fewer dims
    and a second run pads nothing more.
    """
    refused: dict[str, str] = {}
    if not candidates:
        return {}, refused
    elements = _weight_elements(graph, op)
    if elements is not None and elements < policy.min_weight_elements:
        return {}, {r: f"tiny op ({elements} weight elements < "
                       f"{policy.min_weight_elements})" for r in candidates}
    if _all_activation(graph, op) and not policy.pad_activation_gemms:
        return {}, {r: "both operands are activations (pad_activation_gemms=False)"
                    for r in candidates}
    cost = _Cost(graph, op, policy, slice_is_view, unpadded_n)
    allowed = dict(candidates)
    for role, dim in candidates.items():
        if _small_conv_channels(role, dim, policy):
            del allowed[role]
            refused[role] = (f"Cin {dim.size}→{dim.padded}: few-channel convs run faster "
                             "unpadded (pad_small_conv_channels=False)")
    base = cost.seconds({})
    best, best_time = {}, base
    for size in range(1, len(allowed) + 1):
        for roles in itertools.combinations(allowed, size):
            subset = {r: allowed[r] for r in roles}
            seconds = cost.seconds(subset)
            if seconds < best_time:
                best, best_time = subset, seconds
    for role, dim in allowed.items():
        if role not in best:
            alone = cost.seconds({role: dim})
            refused[role] = (f"{role} {dim.size}→{dim.padded}: cost model "
                             f"{alone * 1e6:.3g} µs padded vs {base * 1e6:.3g} µs unpadded")
    return best, refused


def _small_conv_channels(role: str, dim: DimPad, policy: PadPolicy) -> bool:
    return (role == "Cin" and not policy.pad_small_conv_channels
            and isinstance(dim.size, int) and dim.size < policy.multiple)


class _Cost:
    """The cost model of one op (module docstring): roofline time plus runtime copies."""

    def __init__(self, graph: PadGraph, op: PadOp, policy: PadPolicy,
                 slice_is_view: bool, unpadded_n: frozenset = frozenset()) -> None:
        self.graph, self.op, self.policy, self.slice_is_view = graph, op, policy, slice_is_view
        self.unpadded_n = unpadded_n
        self.roles = _roles(op)
        self.misaligned = {r: _estimate_dim(graph, refs[0], policy)
                           for r, refs in self.roles.items()
                           if _maybe_misaligned(graph, refs[0], policy.multiple)}
        self.flops = _estimated_flops(graph, op, policy)
        operands = [v for v, _ in op.k_axes] + [v for v in op.outputs[:1]]
        self.operands = list(dict.fromkeys(operands))

    def seconds(self, pads: Mapping[str, DimPad]) -> float:
        ratio = {r: d.ratio for r, d in pads.items()}
        flops = self.flops * math.prod(ratio.values())
        traffic = sum(self._bytes(v) * math.prod(ratio[r] for r in ratio
                                                 if self._on(v, r)) for v in self.operands)
        misaligned = [size for role, size in self.misaligned.items() if role not in pads]
        copies = sum(self._copy_bytes(r, d) for r, d in pads.items())
        return (self.policy.op_seconds(flops, traffic, misaligned)
                + copies / (self.policy.memory_tbps * 1e12))

    def _on(self, value: Hashable, role: str) -> bool:
        return any(v == value for v, _ in self.roles[role])

    def _bytes(self, value: Hashable) -> float:
        shape = _estimate_shape(self.graph, value, self.policy)
        return math.prod(shape) * self.graph.values[value].itemsize if shape else 0.0

    def _copy_bytes(self, role: str, dim: DimPad) -> float:
        """Traffic of the runtime Pad/Slice copies padding ``role`` needs."""
        ratio, total = dim.ratio, 0.0
        for value, axis in self.roles[role]:
            if self.graph.is_constant(value) or self.graph.values.get(value) is None:
                continue  # weights: padded once, or fused with their cast
            if value in self.op.outputs:
                if not self.slice_is_view and not _flows_into_k_reads(self.graph, value, axis):
                    total += self._bytes(value) * (ratio + 1)  # read padded, write unpadded
            elif not _padded_upstream(self.graph, value, axis, dim.size, self.unpadded_n):
                total += self._bytes(value) * (1 + ratio)  # read, write padded
        return total


def _estimate_shape(graph: PadGraph, value: Hashable, policy: PadPolicy) -> tuple | None:
    info = graph.values.get(value)
    if info is None or info.shape is None:
        return None
    hint = info.hint or (None,) * len(info.shape)
    return tuple(d if isinstance(d, int) else h if isinstance(h, int) else
                 policy.symbolic_dim_size for d, h in zip(info.shape, hint))


def _maybe_misaligned(graph: PadGraph, ref: tuple[Hashable, int], multiple: int) -> bool:
    """Static: not a multiple; symbolic: its example size is not one, or (no example)
    7 of 8 runtime sizes are not."""
    info = graph.values.get(ref[0])
    size = _dim(graph, ref)
    if isinstance(size, int) or is_aligned(size, multiple):
        return not is_aligned(size, multiple)
    hint = info.hint[ref[1]] if info is not None and info.hint else None
    return not isinstance(hint, int) or hint % multiple != 0


def _estimate_dim(graph: PadGraph, ref: tuple[Hashable, int], policy: PadPolicy) -> int:
    shape = _estimate_shape(graph, ref[0], policy)
    return shape[ref[1]] if shape is not None and -len(shape) <= ref[1] < len(shape) else 0


def _estimated_flops(graph: PadGraph, op: PadOp, policy: PadPolicy) -> float:
    """``op_flops`` with symbolic dims at their example (or assumed) size."""
    out = _estimate_shape(graph, op.outputs[0], policy)
    if out is None:
        return 0.0
    if op.kind is PadKind.GEMM:
        return float(gemm_flops(out, _estimate_dim(graph, op.k_axes[0], policy)))
    w, cout_axis = op.n_axes[0]
    wshape = _estimate_shape(graph, w, policy)
    if not wshape:
        return 0.0
    return float(conv_flops(out, wshape, cout_axis))


def _flows_into_k_reads(graph: PadGraph, value: Hashable, axis: int) -> bool:
    """Whether every reader of ``value`` (through finite-safe pointwise ops) is a GEMM/conv
    reading ``axis`` as its K: then a region carries the padded layout and no slice is
    needed. A value without readers is a graph output: it needs one."""
    work, seen = [(value, axis % len(graph.shape(value)))], set()
    while work:
        v, ax = work.pop()
        if (v, ax) in seen:
            continue
        seen.add((v, ax))
        readers = graph.consumers.get(v, [])
        if not readers:
            return False
        for key in readers:
            op = graph.ops[key]
            rank = len(graph.shape(v))
            if op.kind in (PadKind.GEMM, PadKind.CONV):
                if not any(r == v and a % rank == ax for r, a in op.k_axes):
                    return False
                continue
            spec = next((p for p in op.pointwise if p.value == v), None)
            if (op.kind is not PadKind.POINTWISE or not op.finite_safe or spec is None
                    or not spec.may_vary or len(op.outputs) != 1
                    or graph.shape(op.outputs[0]) is None):
                return False
            work.append((op.outputs[0], ax + spec.offset))
    return True


def _padded_upstream(graph: PadGraph, value: Hashable, axis: int, size: Dim,
                     unpadded_n: frozenset = frozenset(), depth: int = 8) -> bool:
    """Whether ``value`` is (a finite-safe pointwise function of) a GEMM/conv output whose N
    is this dim and which is not in ``unpadded_n``, so a region may deliver it padded
    without a runtime Pad."""
    shape = graph.shape(value)
    if shape is None or depth == 0:
        return False
    axis %= len(shape)
    op = graph.ops.get(graph.producer.get(value))
    if op is None:
        return False
    if op.kind in (PadKind.GEMM, PadKind.CONV):
        return op.low and op.key not in unpadded_n and any(
            v == value and a % len(shape) == axis for v, a in op.n_axes)
    if op.kind is not PadKind.POINTWISE or not op.finite_safe:
        return False
    found = False
    for spec in op.pointwise:
        in_shape = graph.shape(spec.value)
        in_axis = axis - spec.offset
        if in_shape is None or not 0 <= in_axis < len(in_shape) or in_shape[in_axis] == 1:
            continue  # broadcast along the dim
        if graph.is_constant(spec.value):
            continue
        if in_shape[in_axis] != size or not _padded_upstream(
                graph, spec.value, in_axis, size, unpadded_n, depth - 1):
            return False
        found = True
    return found


# ----------------------------------------------------------------------------- planning


def _plan_op(graph: PadGraph, op: PadOp, policy: PadPolicy, slice_is_view: bool = False,
             runtime_pads: bool = False, unpadded_n: frozenset = frozenset()) -> OpPadding:
    candidates, skipped = {}, {}
    for role in _roles(op):
        why = can_pad(graph, op, role, policy.multiple, runtime_pads)
        if why is None:
            candidates[role] = _candidate(graph, op, role, policy)
        else:
            skipped[role] = why
    chosen, refused = should_pad(graph, op, candidates, policy, slice_is_view, unpadded_n)
    skipped.update(refused)
    flops = op_flops(graph, op) or 0
    ratio = math.prod(d.ratio for d in chosen.values())
    elements = _weight_elements(graph, op) or 0
    itemsize = graph.values[op.k_axes[-1][0]].itemsize if op.k_axes else 2
    dims = tuple(chosen[r] for r in _roles(op) if r in chosen)
    cost = _Cost(graph, op, policy, slice_is_view, unpadded_n)
    return OpPadding(op.key, op.name, dims, tuple(skipped.items()), flops,
                     round(flops * ratio), int(round(elements * (ratio - 1)) * itemsize),
                     cost.seconds({}), cost.seconds(chosen))


def _candidate(graph: PadGraph, op: PadOp, role: str, policy: PadPolicy) -> DimPad:
    ref = _roles(op)[role][0]
    size, multiple = _dim(graph, ref), policy.multiple
    if isinstance(size, int):
        return DimPad(role, size, round_up(size, multiple), size, round_up(size, multiple))
    est = _estimate_dim(graph, ref, policy)
    hinted = graph.values[ref[0]].hint is not None
    # with an example size its exact pad; without one the mean pad over runtime sizes
    est_padded = round_up(est, multiple) if hinted else est + (multiple - 1) / 2
    return DimPad(role, size, padded_symbol(size, multiple), est, est_padded)


def _op_demands(op: PadOp, padding: OpPadding) -> tuple[dict, dict]:
    """reads[(op, v)] axes and produced[v] of one padded GEMM/conv."""
    reads: dict[Hashable, list[AxisPad]] = {}
    produced: dict[Hashable, AxisPad] = {}
    roles = _roles(op)
    for dim in padding.dims:
        for value, axis in roles[dim.role]:
            pad = AxisPad(axis, dim.size, dim.padded)
            if dim.role in ("N", "Cout") and value in op.outputs:
                produced[value] = pad
            else:
                reads.setdefault(value, []).append(pad)
    return reads, produced


def _normalise(pad: AxisPad, rank: int) -> AxisPad:
    return pad._replace(axis=pad.axis % rank)


class _Planner:
    """Seeds from padded GEMMs/convs, forward propagation, pruning (module docstring)."""

    def __init__(self, graph: PadGraph, policy: PadPolicy, slice_is_view: bool,
                 runtime_pads: bool) -> None:
        self.graph, self.policy, self.slice_is_view = graph, policy, slice_is_view
        self.runtime_pads = runtime_pads
        self.reads: dict[tuple[Hashable, Hashable], tuple[AxisPad, ...]] = {}
        self.produced: dict[Hashable, AxisPad] = {}
        self.ops: dict[Hashable, OpPadding] = {}

    def seed(self) -> None:
        """Plan every low GEMM/conv, repeated until the set of producers that do not pad N
        (whose readers need a runtime Pad) stops growing."""
        gemms = [op for op in self.graph.ops.values()
                 if op.kind in (PadKind.GEMM, PadKind.CONV) and op.low]
        unpadded_n: frozenset = frozenset()
        while True:
            plans = {op.key: _plan_op(self.graph, op, self.policy, self.slice_is_view,
                                      self.runtime_pads, unpadded_n) for op in gemms}
            now = unpadded_n | {key for key, p in plans.items()
                                if not any(d.role in ("N", "Cout") for d in p.dims)}
            if now == unpadded_n:
                break
            unpadded_n = frozenset(now)
        for op in gemms:
            padding = plans[op.key]
            self.ops[op.key] = padding
            reads, produced = _op_demands(op, padding)
            for value, pads in reads.items():
                rank = len(self.graph.shape(value))
                self.reads[(op.key, value)] = tuple(_normalise(p, rank) for p in pads)
            for value, pad in produced.items():
                self.produced[value] = _normalise(pad, len(self.graph.shape(value)))

    def _output_pad(self, op: PadOp, value: Hashable, pad: AxisPad) -> AxisPad | None:
        """The layout of ``op``'s output if it propagates ``value``'s padded ``pad``."""
        if op.kind is not PadKind.POINTWISE or not op.finite_safe or len(op.outputs) != 1:
            return None
        out_shape = self.graph.shape(op.outputs[0])
        spec = next((p for p in op.pointwise if p.value == value), None)
        if out_shape is None or spec is None or not spec.may_vary:
            return None
        axis = pad.axis + spec.offset
        if not 0 <= axis < len(out_shape) or out_shape[axis] != pad.size:
            return None
        return pad._replace(axis=axis, fill=0.0)

    def _side_reads(self, op: PadOp, pad: AxisPad) -> dict | None:
        """Padded layouts of every input of ``op`` that varies along the output's ``pad``."""
        reads = {}
        for spec in op.pointwise:
            shape = self.graph.shape(spec.value)
            if shape is None:
                return None
            axis = pad.axis - spec.offset
            if not 0 <= axis < len(shape) or shape[axis] == 1:
                continue  # broadcast along the padded dim: nothing to pad
            if shape[axis] != pad.size or not spec.may_vary:
                return None
            reads[spec.value] = (AxisPad(axis, pad.size, pad.padded, spec.fill),)
        return reads

    def propagate(self) -> set[Hashable]:
        """Tentative forward propagation; returns the POINTWISE ops taken."""
        taken: set[Hashable] = set()
        work = list(self.produced)
        while work:
            value = work.pop()
            pad = self.produced[value]
            for key in self.graph.consumers.get(value, []):
                op = self.graph.ops[key]
                if key in taken:
                    continue
                out_pad = self._output_pad(op, value, pad)
                if out_pad is None or op.outputs[0] in self.produced:
                    continue
                sides = self._side_reads(op, out_pad)
                if sides is None:
                    continue
                taken.add(key)
                for v, pads in sides.items():
                    self.reads[(key, v)] = pads
                self.produced[op.outputs[0]] = out_pad
                work.append(op.outputs[0])
        return taken

    def prune(self, taken: set[Hashable]) -> set[Hashable]:
        """Keep propagated ops whose output reaches a padded K read through kept ops."""
        useful: set[Hashable] = set()
        work = [v for (op, v) in self.reads if op not in taken and self._reads_as_produced(op, v)]
        seen = set(work)
        while work:
            producer = self.graph.producer.get(work.pop())
            if producer in taken and producer not in useful:
                useful.add(producer)
                for v in self.graph.ops[producer].inputs:
                    if v not in seen and self._reads_as_produced(producer, v):
                        seen.add(v)
                        work.append(v)
        for key in taken - useful:
            self.produced.pop(self.graph.ops[key].outputs[0])
            for v in self.graph.ops[key].inputs:
                self.reads.pop((key, v), None)
        return useful

    def _reads_as_produced(self, op: Hashable, value: Hashable) -> bool:
        return self.reads.get((op, value)) == (self.produced.get(value),)

    def regions(self) -> int:
        """Padded layouts handed from one GEMM/conv to another without a slice and a pad."""
        return sum(1 for (op, v) in self.reads
                   if op in self.ops and self._reads_as_produced(op, v))


def plan_padding(graph: PadGraph, policy: PadPolicy | None = None,
                 slice_is_view: bool = False, runtime_pads: bool = False) -> PaddingPlan:
    """The padding plan of every low GEMM/conv in ``graph`` (module docstring).

    ``slice_is_view``: the adapter's slices are views (torch's ``aten.slice``), so the cost
    model charges no copy for a padded output read unpadded; ONNX's Slice is a copy.
    ``runtime_pads``: the adapter pads symbolic dims by runtime amounts (ONNX); then an
    ``AxisPad`` may carry a symbol as ``size`` and ``padded_symbol(size)`` as ``padded``.
    """
    policy = policy or PadPolicy()
    planner = _Planner(graph, policy, slice_is_view, runtime_pads)
    planner.seed()
    kept = planner.prune(planner.propagate())
    return PaddingPlan(MappingProxyType(dict(planner.produced)),
                       MappingProxyType(dict(planner.reads)),
                       MappingProxyType(planner.ops), frozenset(kept),
                       planner.regions(), policy)


# ----------------------------------------------------------------------------- report


def padding_report(plan: PaddingPlan) -> dict:
    """The report's ``padding`` section: padded ops with dims before → after, totals."""
    padded = plan.padded_ops
    flops = sum(p.flops for p in padded)
    extra = sum(p.padded_flops - p.flops for p in padded)
    return {
        "padded_ops": len(padded),
        "ops": [{"name": p.name, "dims": {d.role: f"{d.size}→{d.padded}" for d in p.dims},
                 "extra_flops": p.padded_flops - p.flops,
                 "extra_weight_bytes": p.extra_weight_bytes} for p in padded],
        "not_padded": [{"name": p.name, "reasons": dict(p.skipped)}
                       for p in plan.ops.values() if p.skipped
                       and not all(r.endswith("already aligned") for _, r in p.skipped)],
        "extra_flops": extra,
        "extra_flop_fraction": round(extra / flops, 4) if flops else 0.0,
        "extra_weight_bytes": sum(p.extra_weight_bytes for p in padded),
        "regions_propagated": plan.regions,
        "ops_propagated": len(plan.propagated),
        # the cost model's estimate over every low GEMM/conv (seconds on the modelled GPU)
        "estimated_seconds_unpadded": sum(p.est_seconds for p in plan.ops.values()),
        "estimated_seconds_padded": sum(p.est_padded_seconds if p.dims else p.est_seconds
                                        for p in plan.ops.values()),
    }
