"""The min-cut that finds the free savings.

Build a flow network over the forward candidates: each value ``v`` is an edge
``v_in -> v_out`` whose capacity is the bytes saving ``v`` keeps alive, data
edges ``u_out -> v_in`` are infinite, every value a backward node reads gets
``v_out -> sink`` (infinite), and every value that must be computed in the
forward (not free to recompute, or never recomputable) gets ``source -> v_in``
(infinite). Primals are resident, so ``source -> p_out`` is infinite and saving
them is free. A minimum ``source``/``sink`` cut then cuts ``v_in -> v_out``
edges only: those values are saved, everything between the cut and the backward
is recomputed, and every recomputed value is free to recompute. The cut is the
least bytes to save for no extra compute.
"""

from __future__ import annotations

import numpy as np

from .joint_graph import JointGraphFacts
from .recompute_bans import why_not_recomputable


def saved_cost_bytes(facts: JointGraphFacts, name: str) -> int:
    """Bytes that saving ``name`` keeps alive: its storages, except resident (primal) ones."""
    total = 0
    for sid in facts.nodes[name].value_storages:
        owner = facts.nodes.get(sid.split("#")[0])
        if owner is None or owner.role == "primal":
            continue
        total += dict(owner.allocs).get(sid, 0)
    return total


_INF = np.int32(2**31 - 1)
_FINITE_TOTAL = 2**30          # finite capacities are scaled to sum to at most this (int32 flows)


def _relevant(facts: JointGraphFacts) -> list[str]:
    """Forward values and primals the backward reads or a recomputation could read, in graph order."""
    found: set[str] = set()
    stack = list(facts.needed_by_backward)
    while stack:
        name = stack.pop()
        if name in found:
            continue
        found.add(name)
        if facts.nodes[name].role == "forward":
            stack.extend(facts.nodes[name].inputs)
    return [name for name in facts.order if name in found]


def min_cut_saved(facts: JointGraphFacts) -> frozenset[str]:
    """Names of the forward values the free min-cut saves (primals excluded).

    Solved with scipy's max-flow (Dinic) on int32 capacities: when the bytes of all
    values exceed 2**30, they are scaled down (rounded up) to fit, so the cut is
    least up to that rounding. The network is built in graph order and the cut is
    read from the residual graph (the least cut nearest the backward), so the same
    graph gives the same cut whatever the hash seed. Worked out once per joint graph
    (``facts`` is immutable; the planner and ``schedule.register_only`` both ask), kept in its
    ``GraphAnalysis``.
    """
    analysis = facts.analysis
    if analysis.min_cut_saved is None:
        analysis.min_cut_saved = _min_cut_saved_uncached(facts)
    return analysis.min_cut_saved


def _min_cut_saved_uncached(facts: JointGraphFacts) -> frozenset[str]:
    relevant = _relevant(facts)
    index = {"source": 0, "sink": 1}
    edges: list[tuple[int, int, int]] = []      # (from, to, capacity); -1 = infinite

    def node(key: str) -> int:
        return index.setdefault(key, len(index))

    inside = set(relevant)
    for name in relevant:
        info = facts.nodes[name]
        if info.role == "primal":
            edges.append((0, node(name + "_out"), -1))
            continue
        if info.role != "forward":
            continue
        capacity = -1 if info.is_multi_output else saved_cost_bytes(facts, name)
        edges.append((node(name + "_in"), node(name + "_out"), capacity))
        if why_not_recomputable(facts, name) is not None or not info.free_to_recompute:
            edges.append((0, node(name + "_in"), -1))
        for inp in info.inputs:
            if inp in inside:
                edges.append((node(inp + "_out"), node(name + "_in"), -1))
        if any(facts.nodes[u].role == "backward" for u in facts.users[name]):
            edges.append((node(name + "_out"), 1, -1))
    if not any(a == 0 for a, _, _ in edges) or not any(b == 1 for _, b, _ in edges):
        return frozenset()
    total = sum(c for _, _, c in edges if c > 0)
    scale = max(1, -(-total // _FINITE_TOTAL))
    size = len(index)
    capacity: dict[tuple[int, int], int] = {}
    for a, b, c in edges:
        value = int(_INF) if c < 0 else -(-c // scale)
        capacity[(a, b)] = min(int(_INF), capacity.get((a, b), 0) + value)
    # scipy is imported here, not with the module: a warm run (AOTAutograd's cache hit) plans
    # nothing, and importing scipy.sparse.csgraph cost ~0.5 s of ``import remat``
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import breadth_first_order, maximum_flow

    rows = np.array([a for a, _ in capacity], dtype=np.int32)
    cols = np.array([b for _, b in capacity], dtype=np.int32)
    data = np.array(list(capacity.values()), dtype=np.int32)
    graph = csr_matrix((data, (rows, cols)), shape=(size, size))
    flow = maximum_flow(graph, 0, 1, method="dinic").flow
    residual = (graph - flow).tocsr()
    residual.data[residual.data < 0] = 0
    residual.eliminate_zeros()
    # Of the least cuts, the one nearest the backward (the source side is everything that cannot
    # reach the sink in the residual graph): it recomputes the fewest values.
    reaching = set(breadth_first_order(residual.T.tocsr(), 1, directed=True, return_predecessors=False).tolist())
    reachable = set(range(size)) - reaching
    return frozenset(
        name for name in relevant
        if facts.nodes[name].role == "forward"
        and index[name + "_in"] in reachable and index[name + "_out"] not in reachable
    )
