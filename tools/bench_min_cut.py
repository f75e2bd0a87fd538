"""Max-flow solvers on the placement's largest flow network of the residual-stream chains.

Plans a chain of ``tools/bench_onnx_speed.py`` (the ``residual`` variant is one free region),
takes the flow network ``placement._min_cut`` builds for its largest region, and times each
candidate on it: OR-Tools ``SimpleMaxFlow`` (the one used), PyMaxflow (Boykov-Kolmogorov),
``scipy.sparse.csgraph.maximum_flow`` (Dinic) and networkx (the reference). Each answer is
compared with networkx's sink side. scipy takes int32 capacities only: it runs on capacities
clipped to 2**30 (timing only) and the table says whether the real ones fit. PyMaxflow runs
on doubles (exact below 2**53) and reports BK's own segments.

    PYTHONPATH=. python tools/bench_min_cut.py [--sizes 10000 50000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import amp_rewrite
from amp_rewrite.core import maxflow
from bench_onnx_speed import build_chain, host_probe  # tools/ is on sys.path as a script

INT32_MAX = 2**31 - 1


def largest_network(n_nodes: int, variant: str
                    ) -> tuple[maxflow.FlowNetwork, int, int] | None:
    """The flow network of the largest region the plan of the chain cuts, if any."""
    networks = []

    def spy(net: maxflow.FlowNetwork, source: int, sink: int) -> np.ndarray:
        networks.append((net, source, sink))
        return real(net, source, sink)

    real, maxflow.sink_side = maxflow.sink_side, spy
    try:
        amp_rewrite.rewrite_onnx(build_chain(n_nodes, variant), check=False)
    finally:
        maxflow.sink_side = real
    return max(networks, key=lambda x: len(x[0].tails)) if networks else None


def _caps(net: maxflow.FlowNetwork) -> np.ndarray:
    caps = np.array(net.caps, dtype=np.int64)
    caps[caps == maxflow.INFINITE] = caps[caps > 0].sum() + 1
    return caps


def ortools(net, s, t) -> np.ndarray:
    return maxflow.sink_side(net, s, t)


def pymaxflow(net, s, t) -> np.ndarray:
    import maxflow as pmf

    g = pmf.GraphFloat()
    g.add_nodes(net.n_nodes)
    for a, b, c in zip(net.tails, net.heads, _caps(net).astype(np.float64).tolist()):
        if a == s:
            g.add_tedge(b, c, 0)
        elif b == t:
            g.add_tedge(a, 0, c)
        else:
            g.add_edge(a, b, c, 0)
    g.maxflow()
    side = np.array([g.get_segment(i) == 1 for i in range(net.n_nodes)])
    side[t], side[s] = True, False
    return side


def scipy_dinic(net, s, t) -> np.ndarray:
    import scipy.sparse as sp
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    n = net.n_nodes
    caps = np.minimum(_caps(net), 2**30).astype(np.int32)  # int32 only: timing, not answers
    graph = sp.csr_array((caps, (net.tails, net.heads)), shape=(n, n))
    graph.sum_duplicates()
    residual = (graph - maximum_flow(graph, s, t).flow).tocoo()
    keep = residual.data > 0  # reversed residual arcs: who reaches t
    back = sp.csr_array((np.ones(keep.sum()), (residual.col[keep], residual.row[keep])),
                        shape=(n, n))
    side = np.zeros(n, dtype=bool)
    side[breadth_first_order(back, t, return_predecessors=False)] = True
    return side


def networkx(net, s, t) -> np.ndarray:
    return maxflow._sink_side_networkx(net, s, t, int(_caps(net).max()))


SOLVERS = {"ortools": ortools, "pymaxflow": pymaxflow, "scipy-dinic": scipy_dinic,
           "networkx": networkx}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[10000, 50000])
    parser.add_argument("--variants", nargs="+", default=["residual", "residual_deny"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"host probe {host_probe():.3f} s")
    print("nodes  variant        arcs     max cap  fits int32  solver       seconds  same cut")
    for size in args.sizes:
        for variant in args.variants:
            found = largest_network(size, variant)
            if found is None:
                print(f"{size:>5}  {variant:13} no region needs a flow (all enumerated or forced)")
                continue
            net, s, t = found
            fits = max(_caps(net)) <= INT32_MAX
            reference = None
            for name, solve in reversed(SOLVERS.items()):  # networkx first: the reference
                times = []
                for _ in range(1 if name == "networkx" else args.repeats):
                    start = time.perf_counter()
                    side = solve(net, s, t)
                    times.append(time.perf_counter() - start)
                reference = side if reference is None else reference
                log2_cap = np.log2(float(max(_caps(net))))
                print(f"{size:>5}  {variant:13} {len(net.tails):>6}  2**{log2_cap:4.1f}"
                      f"  {str(fits):>10}  {name:11} {statistics.median(times):8.3f}"
                      f"  {bool((side == reference).all())}")
    print(f"host probe {host_probe():.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
