"""Max-flow solvers on the placement's largest flow network of the residual-stream chains.

Plans a chain of :mod:`benchmarks.chains` (the ``residual`` variant is one free region),
takes the flow network ``placement._min_cut`` builds for its largest region, and times each
candidate on it: OR-Tools ``SimpleMaxFlow`` (the one used), PyMaxflow (Boykov-Kolmogorov),
``scipy.sparse.csgraph.maximum_flow`` (Dinic) and networkx (the reference). Each answer is
compared with networkx's sink side. scipy takes int32 capacities only: it runs on capacities
clipped to 2**30 (timing only) and the table says whether the real ones fit. PyMaxflow runs
on doubles (exact below 2**53) and reports BK's own segments.

    python -m benchmarks mincut [--sizes 10000 50000] [--repeats 3] [--json FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics

import numpy as np

import amp_rewrite
from amp_rewrite.core import maxflow
from benchmarks import cli
from benchmarks.chains import VARIANTS, build_chain
from benchmarks.timing import host_probe, round_robin

INT32_MAX = 2**31 - 1
log = logging.getLogger(__name__)


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


def available(names: list[str]) -> list[str]:
    """The solvers of ``names`` whose package is installed (PyMaxflow is optional)."""
    found = []
    for name in names:
        if name == "pymaxflow" and importlib.util.find_spec("maxflow") is None:
            log.warning("pymaxflow skipped: pip install PyMaxflow")
        else:
            found.append(name)
    return found


def time_solvers(size: int, variant: str, names: list[str], repeats: int) -> list[dict]:
    """One row per solver on the chain's largest flow network; networkx first (the reference)."""
    found = largest_network(size, variant)
    if found is None:
        return []
    net, s, t = found
    caps = _caps(net)
    reference, rows = None, []
    for name in sorted(names, key=lambda n: n != "networkx"):
        runs, sides, _ = round_robin({name: lambda solve=SOLVERS[name]: solve(net, s, t)},
                                     1 if name == "networkx" else repeats)
        reference = sides[name] if reference is None else reference
        rows.append({"nodes": size, "variant": variant, "arcs": len(net.tails),
                     "log2_max_cap": float(np.log2(float(caps.max()))),
                     "fits_int32": bool(caps.max() <= INT32_MAX), "solver": name,
                     "seconds": statistics.median(runs[name]),
                     "same_cut": bool((sides[name] == reference).all())})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[10000, 50000])
    parser.add_argument("--variants", nargs="+", default=["residual", "residual_deny"],
                        choices=VARIANTS)
    parser.add_argument("--solvers", nargs="+", default=list(SOLVERS), choices=list(SOLVERS))
    parser.add_argument("--repeats", type=int, default=3)
    cli.add_json_argument(parser)
    args = parser.parse_args(argv)
    cli.setup_logging()
    names = available(args.solvers)
    probes = [host_probe()]
    rows = [r for size in args.sizes for variant in args.variants
            for r in time_solvers(size, variant, names, args.repeats)]
    probes.append(host_probe())
    print("nodes  variant        arcs     max cap  fits int32  solver       seconds  same cut")
    for r in rows:
        print(f"{r['nodes']:>5}  {r['variant']:13} {r['arcs']:>6}  2**{r['log2_max_cap']:4.1f}"
              f"  {str(r['fits_int32']):>10}  {r['solver']:11} {r['seconds']:8.3f}"
              f"  {r['same_cut']}")
    print(f"host probe before / after: {probes[0]:.3f} / {probes[1]:.3f} s")
    cli.write_json(args.json, {"rows": rows, "host_probes_s": probes})
    return 0
