"""Exact minimal cast placement by s–t minimum cut (DESIGN §2).

Labels: source side = HIGH, sink side = LOW. For a value v with producer p and consumers C, a
cast is shared by all consumers that need it, so its cost is paid once:

* p HIGH and some c ∈ C LOW costs bytes(v): auxiliary node a, edges p→a (bytes), a→c (∞);
* p LOW and some c ∈ C HIGH costs bytes(v): auxiliary node b, edges c→b (∞), b→p (bytes).

Each free group that would save memory traffic in low precision gets an edge g→t whose capacity
is its traffic; cast bytes are weighted by ``CAST_WEIGHT`` so traffic only breaks ties between
placements with the same cast bytes. networkx returns the source side reachable in the residual
graph, the smallest HIGH set among all minimum cuts, so remaining ties go to LOW.

Fixed groups are terminals, so the problem splits into independent free *regions*; a region
whose neighbours are all LOW is all-LOW without a flow, small regions are enumerated, and only the
rest build a flow network.
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import networkx as nx

from amp_rewrite.core.graph import PrecisionGraph
from amp_rewrite.core.precision import Precision

CAST_WEIGHT = 1 << 20  # one cast byte outweighs a MiB of saved traffic: casts first
ENUMERATE_UP_TO = 4  # free groups; 2**4 labellings are cheaper than building a flow network
_S, _T = "__amp_source__", "__amp_sink__"


@dataclass(frozen=True)
class Region:
    """Free groups connected through values, and the values touching them."""

    groups: tuple[Hashable, ...]
    values: tuple[Hashable, ...]


def free_regions(graph: PrecisionGraph, fixed: dict[Hashable, Precision]) -> list[Region]:
    """Connected components of free groups, joined through shared values."""
    parent: dict[Hashable, Hashable] = {}

    def find(x: Hashable) -> Hashable:
        root = x
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:
            parent[x], x = root, parent[x]
        return root

    touching: dict[Hashable, list[Hashable]] = {}
    for value in graph.values():
        ends = [g for g in _endpoints(graph, value.key) if g not in fixed]
        for g in ends:
            parent.setdefault(g, g)
        for a, b in itertools.pairwise(ends):
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[rb] = ra
        if ends:
            touching.setdefault(find(ends[0]), []).append(value.key)
    return _collect(parent, find, touching)


def _collect(parent, find, touching) -> list[Region]:
    groups: dict[Hashable, list[Hashable]] = {}
    for g in parent:
        groups.setdefault(find(g), []).append(g)
    values: dict[Hashable, list[Hashable]] = {}
    for root, vals in touching.items():
        values.setdefault(find(root), []).extend(vals)
    return [Region(tuple(gs), tuple(values.get(root, ()))) for root, gs in groups.items()]


def _endpoints(graph: PrecisionGraph, value: Hashable) -> list[Hashable]:
    producer = graph.producer(value)
    consumers = graph.consumers(value)
    return ([producer] if producer is not None else []) + consumers


def traffic_units(graph: PrecisionGraph, group: Hashable) -> int:
    """Bytes a group reads and writes: what running it low halves."""
    if not graph.group(group).savings:
        return 0
    return sum(graph.cost_units(v) for v in (*graph.inputs(group), *graph.outputs(group)))


def energy(graph: PrecisionGraph, values: Iterable[Hashable], groups: Iterable[Hashable],
           label: dict[Hashable, Precision]) -> int:
    """CAST_WEIGHT · cast bytes + traffic of groups left HIGH, for the given labelling."""
    total = 0
    for v in values:
        total += CAST_WEIGHT * graph.cost_units(v) * len(needed_casts(graph, v, label))
    for g in groups:
        if label[g] is Precision.HIGH:
            total += traffic_units(graph, g)
    return total


def needed_casts(graph: PrecisionGraph, value: Hashable,
                 label: dict[Hashable, Precision]) -> set[Precision]:
    """Target precisions a value must be cast to for its consumers."""
    producer = graph.producer(value)
    have = label[producer] if producer is not None else Precision.HIGH
    return {label[c] for c in graph.consumers(value) if label[c] is not have}


def solve_region(graph: PrecisionGraph, region: Region,
                 fixed: dict[Hashable, Precision]) -> dict[Hashable, Precision]:
    """Optimal labels for one region's free groups (fixed groups as given)."""
    if _all_neighbours_low(graph, region, fixed):
        return dict.fromkeys(region.groups, Precision.LOW)
    if len(region.groups) <= ENUMERATE_UP_TO:
        return _enumerate(graph, region, fixed)
    return _min_cut(graph, region, fixed)


def _all_neighbours_low(graph, region: Region, fixed) -> bool:
    for v in region.values:
        for g in _endpoints(graph, v):
            if fixed.get(g, Precision.LOW) is not Precision.LOW:
                return False
    return True


def _enumerate(graph, region: Region, fixed) -> dict[Hashable, Precision]:
    """Brute force; ties go to the fewest HIGH groups, as the min cut's minimal source side."""
    best: tuple[int, int] | None = None
    best_label: dict[Hashable, Precision] = {}
    label = dict(fixed)
    for bits in itertools.product((Precision.LOW, Precision.HIGH), repeat=len(region.groups)):
        label.update(zip(region.groups, bits))
        score = (energy(graph, region.values, region.groups, label),
                 bits.count(Precision.HIGH))
        if best is None or score < best:
            best, best_label = score, dict(zip(region.groups, bits))
    return best_label


def _min_cut(graph, region: Region, fixed) -> dict[Hashable, Precision]:
    flow = nx.DiGraph()
    flow.add_nodes_from((_S, _T))

    def node(g: Hashable) -> Hashable:
        if g in fixed:
            return _S if fixed[g] is Precision.HIGH else _T
        return g

    def add(a: Hashable, b: Hashable, cap: int | None) -> None:
        """Add capacity ``cap`` to edge a→b; None is infinite (no attribute, for networkx)."""
        if a == b:
            return
        old = flow.get_edge_data(a, b)
        if cap is None or (old is not None and "capacity" not in old):
            flow.add_edge(a, b)
            flow[a][b].pop("capacity", None)
            return
        # Accumulate: add_edge on an existing edge would overwrite its capacity.
        flow.add_edge(a, b, capacity=(old or {}).get("capacity", 0) + cap)

    for g in region.groups:
        flow.add_node(g)
        traffic = traffic_units(graph, g)
        if traffic:
            add(g, _T, traffic)
    for i, v in enumerate(region.values):
        _add_value_terms(graph, v, i, node, add)
    _, (high_side, _) = nx.minimum_cut(flow, _S, _T)
    return {g: Precision.HIGH if g in high_side else Precision.LOW for g in region.groups}


def _add_value_terms(graph, value: Hashable, index: int, node, add) -> None:
    producer = graph.producer(value)
    consumers = graph.consumers(value)
    if producer is None or not consumers:
        return
    w = CAST_WEIGHT * graph.cost_units(value)
    p = node(producer)
    to_low, to_high = ("__to_low__", index), ("__to_high__", index)
    add(p, to_low, w)
    add(to_high, p, w)
    for c in consumers:
        add(to_low, node(c), None)
        add(node(c), to_high, None)


def place(graph: PrecisionGraph, fixed: dict[Hashable, Precision]) -> dict[Hashable, Precision]:
    """Optimal precision of every group: ``fixed`` plus the min-cut answer for the rest."""
    labels = dict(fixed)
    for region in free_regions(graph, fixed):
        labels.update(solve_region(graph, region, fixed))
    return labels
