"""The framework-neutral precision graph (docs/design.md §2).

A bipartite graph of *groups* (the unit of painting: one (node, type-variable set) pair) and
*values* (tensors). Graph inputs, initializers and outputs are groups too (sources and sinks),
so every value has exactly one producer. Storage is plain dicts, which the planner reads
directly (decision 0002); ``to_networkx()`` gives a DiGraph for analysis. The core never
imports torch or onnx.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from typing import TYPE_CHECKING, NamedTuple


from amp_rewrite.core.precision import OpClass, Precision

if TYPE_CHECKING:  # networkx costs 0.26 s to import; only analysis and tests use it
    import networkx as nx

SOURCE_OP = "<source>"
SINK_OP = "<sink>"


# Records are NamedTuples, not frozen dataclasses: a 50k-node model makes ~75k of each, and a
# frozen dataclass's __init__ (one object.__setattr__ per field) cost 6x as much.
class ValueInfo(NamedTuple):
    """A floating-point tensor that may be stored high or low."""

    key: Hashable
    name: str
    nbytes: int | None  # size in the HIGH dtype; None when unknown (costs one unit)
    # Read HIGH, it makes a promoting reader compute HIGH (False for 0-dim tensors, which do
    # not promote dimensioned ones); see ``GroupInfo.promotes``.
    anchors: bool = True


class GroupInfo(NamedTuple):
    """A (node, type variable) pair: the ports of one node that must share a dtype."""

    key: Hashable
    node: Hashable  # the adapter's node object (several groups may share one)
    name: str  # node name, for reports and --keep-fp32 patterns
    op_key: str  # rule-file key: 'MatMul', 'com.microsoft::Gelu', 'linear', ...
    fixed: Precision | None = None  # set by the adapter (I/O, unsupported port, dtype in model)
    reason: str = ""  # why it is fixed, when it is
    op_class: OpClass | None = None  # None: from the rules by op_key
    savings: bool = True  # False for sources/sinks: running them low saves no traffic
    tvar: str = ""  # type-variable name(s), for reports
    # The op computes mixed float inputs in the widest dtype without a conversion kernel
    # (PyTorch's type promotion; never set for ONNX): run HIGH with an anchoring input that
    # is fixed HIGH, it reads its other inputs LOW for free.
    promotes: bool = False


class PrecisionGraph:
    """Groups and values with producer/consumer links; see the module docstring."""

    def __init__(self) -> None:
        self._values: dict[Hashable, ValueInfo] = {}
        self._groups: dict[Hashable, GroupInfo] = {}
        self._producer: dict[Hashable, Hashable] = {}
        self._consumers: dict[Hashable, list[Hashable]] = {}
        self._inputs: dict[Hashable, list[Hashable]] = {}
        self._outputs: dict[Hashable, list[Hashable]] = {}

    def add_value(self, key: Hashable, *, name: str = "", nbytes: int | None = None,
                  anchors: bool = True) -> None:
        self._values[key] = ValueInfo(key, name or str(key), nbytes, anchors)
        self._consumers[key] = []

    def add_group(self, group: GroupInfo, inputs: Iterable[Hashable] = (),
                  outputs: Iterable[Hashable] = ()) -> None:
        """Add a group reading ``inputs`` and producing ``outputs`` (values added before).

        A value read twice by one group (``Mul(x, x)``) is one read.
        """
        key = group.key
        self._groups[key] = group
        reads = list(dict.fromkeys(inputs))
        self._inputs[key] = reads
        for value in reads:
            self._consumers[value].append(key)
        writes = list(outputs)
        self._outputs[key] = writes
        for value in writes:
            if value in self._producer:
                raise ValueError(f"value {value!r} already has a producer")
            self._producer[value] = key

    def add_source(self, key: Hashable, value: Hashable, *, name: str,
                   fixed: Precision | None, reason: str = "") -> None:
        """A graph input (usually fixed) or an initializer/constant (usually free)."""
        self.add_group(GroupInfo(key, key, name, SOURCE_OP, fixed=fixed, reason=reason,
                                 op_class=OpClass.CLEAR, savings=False), outputs=[value])

    def add_sink(self, key: Hashable, value: Hashable, *, name: str,
                 fixed: Precision | None, reason: str = "") -> None:
        """A graph output: fixed when its dtype is kept (keep_io_types), else free."""
        self.add_group(GroupInfo(key, key, name, SINK_OP, fixed=fixed, reason=reason,
                                 op_class=OpClass.CLEAR, savings=False), inputs=[value])

    # -- queries -------------------------------------------------------------------------
    def groups(self) -> Iterator[GroupInfo]:
        return iter(self._groups.values())

    def values(self) -> Iterator[ValueInfo]:
        return iter(self._values.values())

    def has_value(self, key: Hashable) -> bool:
        return key in self._values

    def group(self, key: Hashable) -> GroupInfo:
        return self._groups[key]

    def value(self, key: Hashable) -> ValueInfo:
        return self._values[key]

    def producer(self, value: Hashable) -> Hashable | None:
        return self._producer.get(value)

    def consumers(self, value: Hashable) -> list[Hashable]:
        return self._consumers[value]

    def inputs(self, group: Hashable) -> list[Hashable]:
        return self._inputs[group]

    def outputs(self, group: Hashable) -> list[Hashable]:
        return self._outputs[group]

    def successor_groups(self, group: Hashable) -> Iterator[Hashable]:
        for value in self._outputs[group]:
            yield from self._consumers[value]

    def predecessor_groups(self, group: Hashable) -> Iterator[Hashable]:
        for value in self._inputs[group]:
            producer = self._producer.get(value)
            if producer is not None:
                yield producer

    def cost_units(self, value: Hashable) -> int:
        """Bytes of a value in the high dtype; unknown sizes cost one unit (docs/design.md §4)."""
        return self._values[value].nbytes or 1

    def to_networkx(self) -> nx.DiGraph:
        """The bipartite graph as a DiGraph: group→value (produces), value→group (reads)."""
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from((k, {"value": v}) for k, v in self._values.items())
        g.add_nodes_from((k, {"group": v}) for k, v in self._groups.items())
        g.add_edges_from((p, v) for v, p in self._producer.items())
        g.add_edges_from((v, c) for v, cs in self._consumers.items() for c in cs)
        return g
