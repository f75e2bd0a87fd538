"""The framework-neutral precision graph (DESIGN §1, "View").

A bipartite ``networkx.DiGraph`` of *groups* and *values*. A group is the unit of painting: one
(node, type-variable set) pair of an op, e.g. BatchNormalization's ``T`` ports, or its ``T2``
ports. Values are tensors; an edge group→value means the group produces it, value→group that the
group reads it. Graph inputs, initializers and outputs are groups too (sources and sinks), so
every value has exactly one producer and casts are planned the same way everywhere.

Adapters build this view; the core never imports torch or onnx.
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field

import networkx as nx

from amp_rewrite.core.precision import OpClass, Precision

SOURCE_OP = "<source>"
SINK_OP = "<sink>"


@dataclass(frozen=True)
class ValueInfo:
    """A floating-point tensor that may be stored high or low."""

    key: Hashable
    name: str
    nbytes: int | None  # size in the HIGH dtype; None when unknown (costs one unit)


@dataclass(frozen=True)
class GroupInfo:
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


@dataclass
class PrecisionGraph:
    """Groups and values in a networkx DiGraph; see the module docstring."""

    nx_graph: nx.DiGraph = field(default_factory=nx.DiGraph)

    def add_value(self, key: Hashable, *, name: str = "", nbytes: int | None = None) -> None:
        self.nx_graph.add_node(key, value=ValueInfo(key, name or str(key), nbytes))

    def add_group(self, group: GroupInfo, inputs: Iterable[Hashable] = (),
                  outputs: Iterable[Hashable] = ()) -> None:
        """Add a group reading ``inputs`` and producing ``outputs`` (values added before)."""
        g = self.nx_graph
        g.add_node(group.key, group=group)
        for value in inputs:
            g.add_edge(value, group.key)
        for value in outputs:
            if g.pred[value]:
                raise ValueError(f"value {value!r} already has a producer")
            g.add_edge(group.key, value)

    def add_source(self, key: Hashable, value: Hashable, *, name: str,
                   fixed: Precision | None, reason: str = "") -> None:
        """A graph input (usually fixed) or an initializer/constant (usually free)."""
        info = GroupInfo(key, key, name, SOURCE_OP, fixed=fixed, reason=reason,
                         op_class=OpClass.CLEAR, savings=False)
        self.add_group(info, outputs=[value])

    def add_sink(self, key: Hashable, value: Hashable, *, name: str,
                 fixed: Precision | None, reason: str = "") -> None:
        """A graph output: fixed when its dtype is kept (keep_io_types), else free."""
        info = GroupInfo(key, key, name, SINK_OP, fixed=fixed, reason=reason,
                         op_class=OpClass.CLEAR, savings=False)
        self.add_group(info, inputs=[value])

    # -- queries -------------------------------------------------------------------------
    def groups(self) -> Iterator[GroupInfo]:
        for _, data in self.nx_graph.nodes(data="group"):
            if data is not None:
                yield data

    def values(self) -> Iterator[ValueInfo]:
        for _, data in self.nx_graph.nodes(data="value"):
            if data is not None:
                yield data

    def group(self, key: Hashable) -> GroupInfo:
        return self.nx_graph.nodes[key]["group"]

    def value(self, key: Hashable) -> ValueInfo:
        return self.nx_graph.nodes[key]["value"]

    def producer(self, value: Hashable) -> Hashable | None:
        pred = self.nx_graph.pred[value]
        return next(iter(pred), None)

    def consumers(self, value: Hashable) -> list[Hashable]:
        return list(self.nx_graph.succ[value])

    def inputs(self, group: Hashable) -> list[Hashable]:
        return list(self.nx_graph.pred[group])

    def outputs(self, group: Hashable) -> list[Hashable]:
        return list(self.nx_graph.succ[group])

    def successor_groups(self, group: Hashable) -> Iterator[Hashable]:
        succ = self.nx_graph.succ
        for value in succ[group]:
            yield from succ[value]

    def predecessor_groups(self, group: Hashable) -> Iterator[Hashable]:
        pred = self.nx_graph.pred
        for value in pred[group]:
            yield from pred[value]

    def cost_units(self, value: Hashable) -> int:
        """Bytes of a value in the high dtype; unknown sizes cost one unit (DESIGN §2)."""
        nbytes = self.value(value).nbytes
        return nbytes if nbytes else 1

    def __len__(self) -> int:
        return self.nx_graph.number_of_nodes()
