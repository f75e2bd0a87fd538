"""s–t minimum cut of an integer flow network on a compiled max-flow (OR-Tools), exactly.

The placement needs the *sink side* (the nodes that can still reach the sink in the residual
graph): the same for every maximum flow, and what ``networkx.minimum_cut`` returns, so both
solvers give the same labels, ties included. OR-Tools' ``SimpleMaxFlow`` has int64 capacities
and reports that side directly (decision 0016). Infinite arcs get the sum of all finite
capacities plus one; a network whose sums could leave int64 is solved by networkx instead.
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger(__name__)

INFINITE = -1  # capacity marker for an arc that must never be cut
_INT64_SAFE = 1 << 61  # finite total below this: flows, excesses and residuals fit in int64


class FlowNetwork:
    """Arcs of a flow network on nodes 0..n-1, collected in flat lists (cheap to append)."""

    def __init__(self, n_nodes: int) -> None:
        self.n_nodes = n_nodes
        self.tails: list[int] = []
        self.heads: list[int] = []
        self.caps: list[int] = []  # INFINITE or a positive integer

    def new_node(self) -> int:
        self.n_nodes += 1
        return self.n_nodes - 1

    def add(self, tail: int, head: int, cap: int) -> None:
        """An arc; parallel arcs add up, as one arc with the summed capacity would."""
        if tail != head and cap:
            self.tails.append(tail)
            self.heads.append(head)
            self.caps.append(cap)


def sink_side(net: FlowNetwork, source: int, sink: int) -> np.ndarray:
    """Boolean mask of the nodes that can reach ``sink`` in the residual graph of a max flow."""
    total = sum(c for c in net.caps if c != INFINITE)  # Python ints: a cap may exceed int64
    if total >= _INT64_SAFE:
        log.debug("capacities sum to %d: solving on Python integers (networkx)", total)
        return _sink_side_networkx(net, source, sink, total + 1)
    caps = np.asarray(net.caps, dtype=np.int64)
    caps[caps == INFINITE] = total + 1
    return _sink_side_ortools(net, caps, source, sink)


def _sink_side_ortools(net: FlowNetwork, caps: np.ndarray, source: int, sink: int
                       ) -> np.ndarray:
    from ortools.graph.python import max_flow  # lazy: only graphs with a real region pay it

    flow = max_flow.SimpleMaxFlow()
    # A zero arc source→sink makes both exist for the solver even when no other arc has them.
    flow.add_arcs_with_capacity(np.asarray([*net.tails, source], np.int32),
                                np.asarray([*net.heads, sink], np.int32),
                                np.append(caps, np.int64(0)))
    status = flow.solve(source, sink)
    if status != flow.OPTIMAL:  # overflow is excluded above; anything else is a bug
        raise RuntimeError(f"OR-Tools max flow failed with status {status}")
    side = np.zeros(max(net.n_nodes, flow.num_nodes()), dtype=bool)
    side[flow.get_sink_side_min_cut()] = True
    return side[:net.n_nodes]


def _sink_side_networkx(net: FlowNetwork, source: int, sink: int, infinite: int
                        ) -> np.ndarray:
    import networkx as nx

    g = nx.DiGraph()
    g.add_nodes_from(range(net.n_nodes))
    for a, b, c in zip(net.tails, net.heads, net.caps):
        cap = infinite if c == INFINITE else c
        old = g.get_edge_data(a, b)
        g.add_edge(a, b, capacity=cap + (old["capacity"] if old else 0))
    _, (_, sink_nodes) = nx.minimum_cut(g, source, sink)
    side = np.zeros(net.n_nodes, dtype=bool)
    side[list(sink_nodes)] = True
    return side
