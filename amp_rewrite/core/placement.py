"""Exact minimal cast placement by s–t minimum cut (docs/design.md §4, decisions 0001, 0004, 0016).

Labels: source side = HIGH, sink side = LOW. A value's cast is shared by all consumers that
need it, so it is paid once: p HIGH and some consumer LOW costs bytes(v) through an auxiliary
node a (p→a bytes, a→c ∞); p LOW and some consumer HIGH through b (c→b ∞, b→p bytes).

*Free reads* (PyTorch type promotion): a promoting consumer c with another anchoring input
whose producer is fixed HIGH reads v in whatever dtype it comes when c runs HIGH, so c→b is
left out; this only removes terms, so the cut stays exact. Reads anchored by undecided
groups are solved optimistically in ``plan.plan_precision`` (``promotion_candidates``,
``justified_reads``).

Groups that save memory traffic when low get an edge g→t of traffic·(β·CAST_WEIGHT + 1), so
with β = 0 traffic only breaks ties; the cut returned has the smallest LOW set, and the
remaining ties (groups that save nothing) go HIGH. Fixed groups are terminals, so the problem
splits into free *regions*, put in a canonical form so repeated layers are solved once.
"""
from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import NamedTuple


from amp_rewrite.core import maxflow
from amp_rewrite.core.graph import PrecisionGraph
from amp_rewrite.core.precision import Precision
from amp_rewrite.errors import UsageError

CAST_WEIGHT = 1 << 20  # one cast byte outweighs a MiB of saved traffic: casts first
ENUMERATE_UP_TO = 4  # free groups; 2**4 labellings are cheaper than building a flow network
_S, _T = "__amp_source__", "__amp_sink__"
MIN_CUT_SOLVER = "compiled"  # or "networkx": the reference implementation, for tests


class Region(NamedTuple):
    """Free groups connected through values, and the values touching them."""

    groups: tuple[Hashable, ...]
    values: tuple[Hashable, ...]


def constrained_regions(graph: PrecisionGraph,
                        labels: dict[Hashable, Precision]) -> list[Region]:
    """The free regions (components of free groups joined through shared values) that have
    a HIGH neighbour: only they need a cut; every other free group runs LOW at no cost.
    Groups and values are in graph order, the order ``canonical`` numbers them in."""
    producer, consumers = graph._producer, graph._consumers
    inputs, outputs = graph._inputs, graph._outputs
    assigned: set[Hashable] = set()  # free groups already in a region
    found: list[list[Hashable]] = []  # each region's values
    for group, precision in labels.items():
        if precision is not Precision.HIGH:
            continue
        for value in (*inputs[group], *outputs[group]):
            p = producer.get(value)
            for start in consumers[value] if p is None else (p, *consumers[value]):
                if start not in labels and start not in assigned:
                    assigned.add(start)
                    found.append(_component(graph, start, labels, assigned))
    if not found:
        return []
    position = {v: i for i, v in enumerate(consumers)}
    return [_ordered_region(graph, sorted(values, key=position.__getitem__), labels)
            for values in found]


def _component(graph: PrecisionGraph, start: Hashable, labels: dict[Hashable, Precision],
               assigned: set[Hashable]) -> list[Hashable]:
    """The values of ``start``'s free region (breadth-first; marks its groups assigned)."""
    producer, consumers = graph._producer, graph._consumers
    inputs, outputs = graph._inputs, graph._outputs
    groups, values, seen = [start], [], set()

    def reach(group: Hashable) -> None:
        if group not in labels and group not in assigned:
            assigned.add(group)
            groups.append(group)

    for group in groups:  # grows while it is walked
        for value in itertools.chain(inputs[group], outputs[group]):
            if value in seen:
                continue
            seen.add(value)
            values.append(value)
            p = producer.get(value)
            if p is not None:
                reach(p)
            for end in consumers[value]:
                reach(end)
    return values


def _ordered_region(graph: PrecisionGraph, values: list[Hashable],
                    labels: dict[Hashable, Precision]) -> Region:
    """The region's free groups in order of their values (producer first, then readers)."""
    producer, consumers = graph._producer, graph._consumers
    groups: dict[Hashable, None] = {}  # insertion-ordered set
    for v in values:
        p = producer.get(v)
        if p is not None and p not in labels:
            groups[p] = None
        for c in consumers[v]:
            if c not in labels:
                groups[c] = None
    return Region(tuple(groups), tuple(values))


def traffic_weight(savings_weight: float) -> int:
    """Capacity per traffic byte: β cast-bytes' worth, plus one so ties still go low."""
    if savings_weight < 0:
        raise UsageError(f"savings weight must be >= 0, got {savings_weight}")
    return round(savings_weight * CAST_WEIGHT) + 1


FreeReads = frozenset[tuple[Hashable, Hashable]]  # (value, consumer group) pairs


def promotion_candidates(graph: PrecisionGraph) -> FreeReads:
    """Every read a promoting op could take for free, whatever its anchors turn out to be."""
    free = []
    for key, group in graph._groups.items():
        if group.promotes:
            reads = graph._inputs[key]
            free.extend((v, key) for v in reads
                        if any(u != v and graph._values[u].anchors for u in reads))
    return frozenset(free)


def free_reads(graph: PrecisionGraph, fixed: dict[Hashable, Precision],
               candidates: FreeReads) -> FreeReads:
    """Reads that need no upcast when the reader runs HIGH (module docstring, *free reads*),
    of the ``promotion_candidates``.

    Only producers in ``fixed`` count as anchors: their precision is known before the cut.
    """
    return _anchored(graph, candidates,
                     lambda u: fixed.get(graph._producer.get(u)) is Precision.HIGH)


def justified_reads(graph: PrecisionGraph, labels: dict[Hashable, Precision],
                    candidates: FreeReads) -> FreeReads:
    """The candidates whose reader runs HIGH next to another anchoring input that is HIGH."""
    readers_high = [(v, g) for v, g in candidates if labels[g] is Precision.HIGH]
    return _anchored(graph, readers_high, lambda u: labels.get(
        graph._producer.get(u), Precision.HIGH) is Precision.HIGH)


def _anchored(graph: PrecisionGraph, reads, is_high) -> FreeReads:
    """The reads (v, g) where g has another anchoring input u with ``is_high(u)``."""
    return frozenset((v, g) for v, g in reads if any(
        u != v and graph._values[u].anchors and is_high(u) for u in graph._inputs[g]))


# A region in canonical form: free groups are numbered 0..n-1 and fixed neighbours appear as
# their Precision, so regions with the same structure (repeated layers) share one solution.
Ref = int | Precision
# (cast weight, producer, consumers, free-read consumers) of one value; the last read the
# value for free when HIGH, so they count only when LOW.
Term = tuple[int, Ref, tuple[Ref, ...], tuple[int, ...]]


def canonical(graph: PrecisionGraph, region: Region, fixed: dict[Hashable, Precision],
              per_traffic_byte: int = 1, free: FreeReads = frozenset()
              ) -> tuple[tuple[Term, ...], tuple[int, ...]]:
    # hot loop (a region can be the whole residual stream): the graph's dicts read directly
    index = {g: i for i, g in enumerate(region.groups)}
    producer, consumers = graph._producer, graph._consumers
    inputs, outputs, groups = graph._inputs, graph._outputs, graph._groups
    # graph.cost_units of every value the region's groups touch (all are region values)
    units = {v: graph._values[v].nbytes or 1 for v in region.values}
    low = Precision.LOW

    def ref(g: Hashable) -> Ref:
        i = index.get(g)
        return fixed[g] if i is None else i

    def term(v: Hashable, readers: list[Hashable]) -> Term:
        weight = CAST_WEIGHT * units[v]
        if not free:
            return weight, ref(producer[v]), tuple(map(ref, readers)), ()
        paid, low_only = [], []
        for c in readers:
            r = ref(c)
            if (v, c) not in free or r is low:
                paid.append(r)
            elif isinstance(r, int):
                low_only.append(r)
            # else: a fixed HIGH free reader never needs a cast of v
        return weight, ref(producer[v]), tuple(paid), tuple(low_only)

    def traffic(g: Hashable) -> int:
        """Bytes the group reads and writes (what running it low halves), weighted."""
        if not groups[g].savings:
            return 0
        return per_traffic_byte * (sum(map(units.__getitem__, inputs[g]))
                                   + sum(map(units.__getitem__, outputs[g])))

    terms = tuple(term(v, consumers[v]) for v in region.values
                  if consumers[v] and v in producer)
    return terms, tuple(map(traffic, region.groups))


def solve_canonical(terms: tuple[Term, ...], traffic: tuple[int, ...]) -> tuple[Precision, ...]:
    """Optimal labels of the numbered free groups."""
    n = len(traffic)
    if all(r is Precision.LOW for _, p, cs, _ in terms for r in (p, *cs)
           if not isinstance(r, int)):
        return (Precision.LOW,) * n  # no HIGH neighbour: all low costs nothing
    if n <= ENUMERATE_UP_TO:
        return _enumerate(terms, traffic)
    if MIN_CUT_SOLVER == "networkx":
        return _min_cut_networkx(terms, traffic)
    return _min_cut(terms, traffic)


def _enumerate(terms, traffic) -> tuple[Precision, ...]:
    """Brute force; ties go to the fewest HIGH groups, as the min cut's minimal source side."""
    best, best_bits = None, ()
    for bits in itertools.product((Precision.LOW, Precision.HIGH), repeat=len(traffic)):
        cost = sum(t for t, b in zip(traffic, bits) if b is Precision.HIGH)
        for w, p, cs, low_only in terms:
            have = bits[p] if isinstance(p, int) else p
            wanted = {bits[c] if isinstance(c, int) else c for c in cs}
            wanted.update(bits[c] for c in low_only if bits[c] is Precision.LOW)
            cost += w * len(wanted - {have})
        score = (cost, bits.count(Precision.HIGH))
        if best is None or score < best:
            best, best_bits = score, bits
    return best_bits


def _min_cut(terms: tuple[Term, ...], traffic: tuple[int, ...]) -> tuple[Precision, ...]:
    """The networkx construction below on the compiled solver, labels identical.

    An auxiliary node tied to a terminal by an infinite arc is that terminal, so infinite
    arcs never touch a terminal, which keeps int64 sums small.
    """
    n = len(traffic)
    source, sink = n, n + 1
    net = maxflow.FlowNetwork(n + 2)
    inf = maxflow.INFINITE

    def node(r: Ref) -> int:
        if isinstance(r, int):
            return r
        return source if r is Precision.HIGH else sink

    for g, t in enumerate(traffic):
        net.add(g, sink, t)
    for w, p, cs, low_only in terms:
        fixed_readers = {c for c in cs if not isinstance(c, int)}
        to_low = sink if Precision.LOW in fixed_readers else net.new_node()
        to_high = source if Precision.HIGH in fixed_readers else net.new_node()
        producer = node(p)
        # Arcs out of the sink or into the source carry no flow: left out.
        if producer != sink:
            net.add(producer, to_low, w)
        if producer != source:
            net.add(to_high, producer, w)
        free_readers = [c for c in cs if isinstance(c, int)]
        if to_low != sink:
            for c in (*free_readers, *low_only):  # low_only: read for free when HIGH
                net.add(to_low, c, inf)
        if to_high != source:
            for c in free_readers:
                net.add(c, to_high, inf)
    reaches_sink = maxflow.sink_side(net, source, sink)
    return tuple(Precision.LOW if reaches_sink[g] else Precision.HIGH for g in range(n))


def _min_cut_networkx(terms, traffic) -> tuple[Precision, ...]:
    import networkx as nx  # slow to import; only the reference path needs it

    flow = nx.DiGraph()
    flow.add_nodes_from((_S, _T, *range(len(traffic))))

    def node(r: Ref) -> Hashable:
        if isinstance(r, int):
            return r
        return _S if r is Precision.HIGH else _T

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

    for g, t in enumerate(traffic):
        if t:
            add(g, _T, t)
    for i, (w, p, cs, low_only) in enumerate(terms):
        to_low, to_high = ("to_low", i), ("to_high", i)
        add(node(p), to_low, w)
        add(to_high, node(p), w)
        for c in cs:
            add(to_low, node(c), None)
            add(node(c), to_high, None)
        for c in low_only:  # no c→to_high: reading v for free when HIGH
            add(to_low, c, None)
    _, (high_side, _) = nx.minimum_cut(flow, _S, _T)
    return tuple(Precision.HIGH if g in high_side else Precision.LOW for g in range(len(traffic)))


def settled_sources(graph: PrecisionGraph, fixed: dict[Hashable, Precision],
                    free: FreeReads = frozenset()) -> dict[Hashable, Precision]:
    """Free sources (initializers) whose readers are all fixed at one precision take it:
    exact without a flow, as a source saves no traffic and anything else costs a cast.
    Readers fixed HIGH that read the source for free want nothing."""
    settled = {}
    outputs, consumers = graph._outputs, graph._consumers
    for key, group in graph._groups.items():
        if key in fixed or group.savings or graph._inputs[key]:
            continue
        wanted = {fixed.get(c) for v in outputs[key] for c in consumers[v]
                  if (v, c) not in free or fixed.get(c) is not Precision.HIGH}
        if len(wanted) == 1 and None not in wanted:
            settled[key] = wanted.pop()
    return settled


def place(graph: PrecisionGraph, fixed: dict[Hashable, Precision], savings_weight: float,
          free: FreeReads) -> dict[Hashable, Precision]:
    """Optimal precision of every group: ``fixed`` plus the min-cut answer for the rest.

    ``savings_weight`` (β) prices one byte of memory traffic saved by running an op low
    against one byte cast: 0 (the options' default) minimises cast bytes and uses traffic
    only to break ties; 1 also runs an op low when the traffic it saves pays for its casts.
    ``free``: the free reads (``free_reads``).
    """
    labels = dict(fixed)
    labels.update(settled_sources(graph, fixed, free))
    per_byte = traffic_weight(savings_weight)
    solved: dict[tuple, tuple[Precision, ...]] = {}
    for region in constrained_regions(graph, labels):
        key = canonical(graph, region, labels, per_byte, free)
        if key not in solved:
            solved[key] = solve_canonical(*key)
        labels.update(zip(region.groups, solved[key]))
    for key in graph._groups:  # free groups of regions without a HIGH neighbour, and
        labels.setdefault(key, Precision.LOW)  # those touching no value: LOW costs nothing
    return labels
