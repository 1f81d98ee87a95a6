"""Which nodes run where, in what order, once the saved set is chosen.

Given the forward values the plan saves, ``partition_nodes`` finds what the
backward must recompute (and which values must be saved anyway, with the
reason), ``backward_order`` places each recompute region right before its first
backward use (not all at the start of the backward: that keeps every recomputed
value alive at once), and ``memory_steps`` turns both into the steps the memory
simulator walks. The rewrite uses the same ``backward_order``, so the graph that
runs is the graph that was simulated.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import AbstractSet, Mapping

from ..cost_model.memory import Step
from .joint_graph import JointGraphFacts
from .kernel_steps import RECOMPUTE_SUFFIX, kernel_steps

# The simulator no longer reads these: it follows Inductor's realization rules
# (cost_model/kernel_schedule.py). solve_milp's linear memory model still does.
INLINE_FUSED = True
SINGLE_READER_ONLY = True


@dataclass(frozen=True)
class Partition:
    saved: frozenset[str]                  # forward candidates handed to the backward
    saved_primals: frozenset[str]          # inputs the backward reads (resident: cost no memory)
    recomputed: frozenset[str]             # forward candidates the backward recomputes
    forced: Mapping[str, str]              # saved although not chosen: name -> reason


_REDUCTIONS = {"sum", "mean", "var_mean", "var", "amax", "amin", "max", "min", "prod", "any", "all", "logsumexp"}


def _why_not_recomputable_uncached(facts: JointGraphFacts, name: str) -> str | None:
    node = facts.nodes[name]
    if node.recompute_ban is not None:
        return node.recompute_ban
    if node.is_sym:
        return "symbolic size: saved as an int"
    if node.is_getitem:
        source = node.inputs[0]
        if facts.nodes[source].is_multi_output:
            return _why_not_recomputable_uncached(facts, source)  # save this output, never the tuple
    op_name = node.op.split(".")[1] if node.op.startswith("aten.") else ""
    if op_name in _REDUCTIONS and 4 * node.cost.bytes_written <= node.cost.bytes_read:
        # A reduction recomputed in another kernel may round differently (another
        # reduction order), and normalisation backwards amplify the difference; its
        # output is small, so saving it costs little.
        return "reduction: saving its small output keeps recomputation bit-identical"
    return None


# Per joint graph (keyed by id, checked through a weak reference): the planner asks
# about the same nodes millions of times on a large graph.
_PER_GRAPH: dict[int, tuple[weakref.ref, dict[str, str | None], dict[str, int]]] = {}


def _per_graph(facts: JointGraphFacts) -> tuple[dict[str, str | None], dict[str, int]]:
    """Every node's ``why_not_recomputable`` answer, and every node's position, for this graph."""
    entry = _PER_GRAPH.get(id(facts))
    if entry is not None and entry[0]() is facts:
        return entry[1], entry[2]
    for key in [k for k, (ref, _, _) in _PER_GRAPH.items() if ref() is None]:
        del _PER_GRAPH[key]
    bans = {name: _why_not_recomputable_uncached(facts, name) for name in facts.nodes}
    position = facts.position()
    _PER_GRAPH[id(facts)] = (weakref.ref(facts), bans, position)
    return bans, position


def why_not_recomputable(facts: JointGraphFacts, name: str) -> str | None:
    """The reason ``name`` must be saved rather than recomputed, or None if it may be recomputed.

    Worked out once per joint graph for every node (``facts`` is immutable), then looked up.
    """
    return _per_graph(facts)[0][name]


def partition_nodes(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> Partition:
    """Close ``chosen_saved`` into a valid partition.

    Every value the backward reads is either saved, a primal, or recomputed from
    saved values and primals. A value that may not be recomputed (random,
    mutation, collective, symbolic size) is saved and recorded in ``forced``
    (in joint-graph order: the result does not depend on set iteration order).
    """
    bans, position = _per_graph(facts)
    nodes = facts.nodes
    saved = set(chosen_saved)
    forced: dict[str, str] = {}
    primals: set[str] = set()
    recomputed: set[str] = set()
    stack = list(facts.needed_by_backward)
    while stack:
        name = stack.pop()
        node = nodes[name]
        if node.role == "primal":
            primals.add(name)
            continue
        if name in saved or name in recomputed:
            continue
        reason = bans[name]
        if reason is not None:
            saved.add(name)
            forced[name] = reason
            continue
        recomputed.add(name)
        stack.extend(node.inputs)
    for name in saved:
        if name not in forced and bans[name] is not None:
            forced[name] = bans[name]  # type: ignore[assignment]
    ordered = {name: forced[name] for name in sorted(forced, key=position.__getitem__)}
    return Partition(frozenset(saved), frozenset(primals), frozenset(recomputed), ordered)


def forward_order(facts: JointGraphFacts, partition: Partition) -> list[str]:
    """Forward candidates the forward graph computes, in joint-graph order."""
    roots = set(facts.forward_required) | set(partition.saved)
    needed: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in needed or facts.nodes[name].role != "forward":
            continue
        needed.add(name)
        stack.extend(facts.nodes[name].inputs)
    return [name for name in facts.order if name in needed]


def backward_order(facts: JointGraphFacts, partition: Partition) -> list[tuple[str, int]]:
    """Backward nodes in joint order, each preceded by the recompute region it first needs.

    Returns (node name, region id); region id is -1 for backward nodes. Region
    ids count up from 0 in the order regions run.
    """
    position = facts.position()
    emitted: set[str] = set()
    schedule: list[tuple[str, int]] = []
    region = 0
    for name in facts.order:
        if facts.nodes[name].role != "backward":
            continue
        pending: set[str] = set()
        stack = [i for i in facts.nodes[name].inputs if i in partition.recomputed]
        while stack:
            dep = stack.pop()
            if dep in emitted or dep in pending:
                continue
            pending.add(dep)
            stack.extend(i for i in facts.nodes[dep].inputs if i in partition.recomputed)
        if pending:
            schedule.extend((dep, region) for dep in sorted(pending, key=position.__getitem__))
            emitted |= pending
            region += 1
        schedule.append((name, -1))
    return schedule


def recompute_time_s(facts: JointGraphFacts, partition: Partition) -> float:
    """Estimated time the backward spends recomputing, for this partition.

    Every recomputation the backward runs is counted: the solvers read their
    extra time from here and nowhere else, so a schedule that recomputes a value
    more than once is charged for each time.
    """
    return sum(facts.nodes[n].cost.est_time_s for n in partition.recomputed)


def memory_steps(facts: JointGraphFacts, partition: Partition) -> tuple[list[Step], set[str]]:
    """The forward, then the backward, as simulator steps in Inductor's kernel order; and the
    pinned storages (see ``kernel_steps``)."""
    return kernel_steps(facts, partition, forward_order(facts, partition), backward_order(facts, partition))
