"""Put each recompute region of the backward right before its first use, and tag it.

The forward and backward graphs come out of graph extraction with every
recomputed node at the top of the backward (joint-graph order). ``place_recompute_regions``
rebuilds the backward in the order ``schedule.backward_order`` gives, the same
order the memory simulation walked, and tags every recomputed node with a frozen
``RecomputeTag`` under ``node.meta[REMAT_KEY]``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from ..cost_model.tensors import is_mutating_op
from ..units import format_bytes
from .joint_graph import JointGraphFacts
from .plan import Plan
from .schedule import backward_order, partition_nodes

REMAT_KEY = "remat"
_EFFECT_NAMESPACES = ("_c10d_functional", "c10d", "c10d_functional", "_dtensor")


@dataclass(frozen=True)
class RecomputeTag:
    region: int
    first_use: str          # the backward node the region is placed before
    reason: str


@dataclass(frozen=True)
class RegionSummary:
    region: int
    first_use: str
    rebuilds: tuple[str, ...]        # recomputed values a backward node reads
    nodes: tuple[str, ...]
    bytes_rebuilt: int
    reasons: tuple[str, ...]


def place_recompute_regions(bw: fx.GraphModule, facts: JointGraphFacts, plan: Plan) -> tuple[fx.GraphModule, tuple[RegionSummary, ...]]:
    """Reorder ``bw`` so regions sit before their first use; returns the new module and the regions.

    Guarantees: same nodes, same placeholders and output; every node comes after
    its inputs (checked by ``graph.lint()``).
    """
    partition = partition_nodes(facts, set(plan.saved))
    order = backward_order(facts, partition)
    region_of = {name: region for name, region in order if region >= 0}
    first_use: dict[int, str] = {}
    for index, (name, region) in enumerate(order):
        if region >= 0 and region not in first_use:
            following = next(n for n, r in order[index:] if r < 0)
            first_use[region] = following
    reasons = {d.name: d.reason for d in plan.decisions}

    old_nodes = {n.name: n for n in bw.graph.nodes}
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in bw.graph.find_nodes(op="placeholder"):
        env[node] = new_graph.node_copy(node, env.__getitem__)

    def emit(node: fx.Node, region: int) -> None:
        pending = [node]
        while pending:
            current = pending[-1]
            missing = [a for a in current.all_input_nodes if a not in env]
            if missing:
                pending.extend(missing)
                continue
            pending.pop()
            if current in env:
                continue
            copy = new_graph.node_copy(current, env.__getitem__)
            r = region_of.get(current.name, region if current.name in partition.recomputed else -1)
            if r >= 0:
                copy.meta[REMAT_KEY] = RecomputeTag(r, first_use.get(r, ""), reasons.get(current.name, ""))
            env[current] = copy

    output = next(iter(bw.graph.find_nodes(op="output")))
    live = _live_nodes(bw.graph, output)
    for name, region in order:
        if name in old_nodes and old_nodes[name] in live and old_nodes[name].op not in ("placeholder", "output"):
            emit(old_nodes[name], region)
    for node in bw.graph.nodes:  # anything live that the schedule did not name
        if node in live and node.op not in ("placeholder", "output") and node not in env:
            emit(node, -1)
    env[output] = new_graph.node_copy(output, env.__getitem__)
    new_graph.lint()
    new_bw = fx.GraphModule(bw, new_graph)
    return new_bw, _summaries(new_bw, facts)


def _live_nodes(graph: fx.Graph, output: fx.Node) -> set[fx.Node]:
    """Nodes the output needs, plus mutations and collectives (kept for their effect).

    Graph extraction keeps any node whose inputs exist in the backward, and its dead
    code elimination keeps random ops (impure): a forward op such as CPU flash
    attention (it takes a dropout probability) would otherwise be re-run, unused, at
    the end of the backward, holding its recomputed inputs alive until then.
    """
    roots = [output] + [
        n for n in graph.nodes
        if n.op == "call_function" and (is_mutating_op(n) or getattr(n.target, "namespace", "") in _EFFECT_NAMESPACES)
    ]
    live: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in live:
            continue
        live.add(node)
        stack.extend(node.all_input_nodes)
    return live


def _summaries(bw: fx.GraphModule, facts: JointGraphFacts) -> tuple[RegionSummary, ...]:
    members: dict[int, list[fx.Node]] = {}
    for node in bw.graph.nodes:
        tag = node.meta.get(REMAT_KEY)
        if isinstance(tag, RecomputeTag):
            members.setdefault(tag.region, []).append(node)
    summaries = []
    for region, nodes in sorted(members.items()):
        names = {n.name for n in nodes}
        rebuilds = tuple(n.name for n in nodes if any(u.name not in names for u in n.users))
        summaries.append(RegionSummary(
            region=region,
            first_use=nodes[0].meta[REMAT_KEY].first_use,
            rebuilds=rebuilds,
            nodes=tuple(n.name for n in nodes),
            bytes_rebuilt=sum(facts.nodes[n].alloc_bytes for n in rebuilds if n in facts.nodes),
            reasons=tuple(dict.fromkeys(nodes_reason for n in nodes if (nodes_reason := n.meta[REMAT_KEY].reason))),
        ))
    return tuple(summaries)


def describe_region(summary: RegionSummary) -> str:
    return (
        f"recompute region {summary.region}: rebuilds {', '.join(summary.rebuilds)} "
        f"({format_bytes(summary.bytes_rebuilt)}) for {summary.first_use}"
    )
