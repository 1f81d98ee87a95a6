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

import math

import networkx as nx

from .joint_graph import JointGraphFacts
from .schedule import why_not_recomputable


def saved_cost_bytes(facts: JointGraphFacts, name: str) -> int:
    """Bytes that saving ``name`` keeps alive: its storages, except resident (primal) ones."""
    total = 0
    for sid in facts.nodes[name].value_storages:
        owner = facts.nodes.get(sid.split("#")[0])
        if owner is None or owner.role == "primal":
            continue
        total += dict(owner.allocs).get(sid, 0)
    return total


def min_cut_saved(facts: JointGraphFacts) -> frozenset[str]:
    """Names of the forward values the free min-cut saves (primals excluded)."""
    graph = nx.DiGraph()
    relevant: set[str] = set()
    stack = list(facts.needed_by_backward)
    while stack:
        name = stack.pop()
        if name in relevant:
            continue
        relevant.add(name)
        if facts.nodes[name].role == "forward":
            stack.extend(facts.nodes[name].inputs)
    for name in relevant:
        node = facts.nodes[name]
        if node.role == "primal":
            graph.add_edge("source", name + "_out", capacity=math.inf)
            continue
        if node.role != "forward":
            continue
        capacity = math.inf if node.is_multi_output else saved_cost_bytes(facts, name)
        graph.add_edge(name + "_in", name + "_out", capacity=capacity)
        must_run_in_forward = why_not_recomputable(facts, name) is not None or not node.free_to_recompute
        if must_run_in_forward:
            graph.add_edge("source", name + "_in", capacity=math.inf)
        for inp in node.inputs:
            if inp in relevant:
                graph.add_edge(inp + "_out", name + "_in", capacity=math.inf)
        if any(facts.nodes[u].role == "backward" for u in facts.users[name]):
            graph.add_edge(name + "_out", "sink", capacity=math.inf)
    if "sink" not in graph or "source" not in graph:
        return frozenset()
    _, (reachable, _) = nx.minimum_cut(graph, "source", "sink")
    return frozenset(
        name for name in relevant
        if facts.nodes[name].role == "forward" and name + "_in" in reachable and name + "_out" not in reachable
    )
