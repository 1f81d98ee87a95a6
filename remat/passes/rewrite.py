"""Put each recompute region of the backward right before the node it is for, and tag it.

The forward and backward graphs come out of graph extraction with every
recomputed node once, at the top of the backward (joint-graph order).
``place_recompute_regions`` rebuilds the backward in the order the plan carries
(``Plan.backward_order``: ``schedule.backward_order``'s answer when the plan was simulated), the
order the memory simulation walked:
a value the schedule recomputes several times gets one copy per instance, and
every copy reads the instances the schedule names. Every recomputed copy is
tagged with a frozen ``RecomputeTag`` under ``node.meta[REMAT_KEY]``.

An add whose matrix product the simulator keeps apart from Inductor's addmm fusion
(``kernel_steps.adds_kept_apart``) is written ``sub(a, neg(b))``: the same sum, exactly,
in a form Inductor's pattern does not fuse, so the product runs where the schedule puts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from ..cost_model.tensors import is_mutating_op
from ..units import format_bytes
from .joint_graph import JointGraphFacts, is_collective
from .plan import Plan
from ..simulator.kernel_steps import adds_kept_apart
from ..simulator.schedule import Scheduled

REMAT_KEY = "remat"
KEPT_APART_KEY = "remat_kept_apart"    # node.meta of a sum written apart from its product, with the reason


@dataclass(frozen=True)
class RecomputeTag:
    region: int
    first_use: str          # the backward node the region is placed before
    reason: str
    source: str = ""        # the forward node this copy recomputes
    instance: int = 0       # which recomputation of it (0 for the first)


@dataclass(frozen=True)
class RegionSummary:
    region: int
    first_use: str
    rebuilds: tuple[str, ...]        # recomputed values a backward node reads (names in the backward graph)
    nodes: tuple[str, ...]
    bytes_rebuilt: int
    reasons: tuple[str, ...]


def _first_uses(order: list[Scheduled]) -> dict[int, str]:
    """Region id -> the backward node right after it."""
    first_use: dict[int, str] = {}
    following = ""
    for entry in reversed(order):
        if entry.region < 0:
            following = entry.name
        else:
            first_use[entry.region] = following
    return first_use


def place_recompute_regions(bw: fx.GraphModule, facts: JointGraphFacts, plan: Plan) -> tuple[fx.GraphModule, tuple[RegionSummary, ...]]:
    """Rebuild ``bw`` in the order of the plan's backward schedule (``Plan.backward_order``, the one its
    peak was simulated on); returns the new module and the regions.

    Guarantees: the same placeholders and output; one copy of each live backward node;
    one copy of a recomputed node per instance of it in the schedule (copies after
    the first get fresh names), each reading the instances the schedule names; every
    node comes after its inputs (checked by ``graph.lint()``).
    """
    order = list(plan.backward_order)
    if not order and any(node.op == "call_function" for node in bw.graph.nodes):
        raise ValueError(f"the plan ({plan.solver}) carries no backward schedule for a backward with ops: "
                         "plans come from passes/plan.py, which records the schedule they were simulated on")
    stale = sorted({entry.name for entry in order if entry.region >= 0} - set(plan.recomputed))
    if stale:
        raise ValueError(f"the plan's backward schedule recomputes {stale[:5]}, which the plan does not: it was "
                         "simulated for another saved set (a plan edited after planning needs its schedule again, "
                         "simulator.evaluate(facts, saved).backward_order)")
    kept_apart = adds_kept_apart(facts, order)
    first_use = _first_uses(order)
    reasons = {d.name: d.reason for d in plan.decisions}

    old_nodes = {n.name: n for n in bw.graph.nodes}
    new_graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}            # the backward's own nodes, placeholders
    instances: dict[str, fx.Node] = {}          # instance name -> its copy
    latest: dict[str, fx.Node] = {}             # recomputed node name -> its latest copy
    for node in bw.graph.find_nodes(op="placeholder"):
        env[node] = new_graph.node_copy(node, env.__getitem__)

    def lookup(reads: dict[str, str]) -> Callable[[fx.Node], fx.Node]:
        def arg(node: fx.Node) -> fx.Node:
            if node.name in reads:
                return instances[reads[node.name]]
            if node not in env and node.name in latest:
                return latest[node.name]
            if node not in env:
                emit_unscheduled(node)
            return env[node]
        return arg

    def emit_unscheduled(node: fx.Node) -> None:
        """A node the schedule does not name (not in the facts): copied once, after its inputs."""
        pending = [node]
        while pending:
            current = pending[-1]
            missing = [a for a in current.all_input_nodes if a not in env and a.name not in latest]
            if missing:
                pending.extend(missing)
                continue
            pending.pop()
            if current not in env:
                env[current] = new_graph.node_copy(current, lookup({}))

    output = next(iter(bw.graph.find_nodes(op="output")))
    live = _live_nodes(bw.graph, output)
    counts: dict[str, int] = {}
    for entry in order:
        old = old_nodes.get(entry.name)
        if old is None or old not in live or old.op in ("placeholder", "output"):
            continue
        k = counts.get(entry.name, 0) if entry.region >= 0 else 0
        copy = _copy_node(new_graph, old, lookup(dict(entry.reads)), f"{old.name}_r{k}" if k else None,
                          apart=entry.instance in kept_apart)
        if entry.region >= 0:
            counts[entry.name] = k + 1
            copy.meta[REMAT_KEY] = RecomputeTag(entry.region, first_use.get(entry.region, ""),
                                                reasons.get(entry.name, ""), entry.name, k)
            instances[entry.instance] = copy
            latest[entry.name] = copy
        else:
            env[old] = copy
    for node in bw.graph.nodes:  # anything live that the schedule did not name
        if node in live and node.op not in ("placeholder", "output") and node not in env and node.name not in latest:
            emit_unscheduled(node)
    env[output] = new_graph.node_copy(output, lookup({}))
    new_graph.lint()
    new_bw = fx.GraphModule(bw, new_graph)
    return new_bw, _summaries(new_bw, facts)


def _copy_node(graph: fx.Graph, node: fx.Node, arg: Callable[[fx.Node], fx.Node], name: str | None,
               apart: bool = False) -> fx.Node:
    """``graph.node_copy``, under ``name`` when given (a second recomputation of a node);
    ``apart``: an add written as ``sub(a, neg(b))`` (the module docstring)."""
    if apart:
        return _sum_apart(graph, node, arg, name or node.name)
    if name is None:
        return graph.node_copy(node, arg)
    copy = graph.create_node(node.op, node.target, fx.map_arg(node.args, arg), fx.map_arg(node.kwargs, arg),
                             name, node.type)
    copy.meta = dict(node.meta)
    return copy


def _sum_apart(graph: fx.Graph, node: fx.Node, arg: Callable[[fx.Node], fx.Node], name: str) -> fx.Node:
    """``add(a, b, alpha=k)`` as ``sub(a, neg(b), alpha=k)``: ``a - k*(-b)`` is ``a + k*b`` exactly
    (negation is exact), and no addmm pattern matches a ``sub``."""
    a, b = fx.map_arg(node.args, arg)
    negated = graph.create_node("call_function", torch.ops.aten.neg.default, (b,), {}, f"{name}_neg")
    negated.meta = {key: b.meta[key] for key in ("val", "tensor_meta") if key in b.meta}
    total = graph.create_node("call_function", torch.ops.aten.sub.Tensor, (a, negated),
                              fx.map_arg(node.kwargs, arg), name, node.type)
    total.meta = dict(node.meta)
    total.meta[KEPT_APART_KEY] = ("its matrix product runs at its own place: fused into this sum by "
                                  "Inductor's addmm pattern it would hold more until here than its result")
    return total


def _live_nodes(graph: fx.Graph, output: fx.Node) -> set[fx.Node]:
    """Nodes the output needs, plus mutations and collectives (kept for their effect).

    Graph extraction keeps any node whose inputs exist in the backward, and its dead
    code elimination keeps random ops (impure): a forward op such as CPU flash
    attention (it takes a dropout probability) would otherwise be re-run, unused, at
    the end of the backward, holding its recomputed inputs alive until then.
    """
    roots = [output] + [
        n for n in graph.nodes
        if n.op == "call_function" and (is_mutating_op(n) or is_collective(n))
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
            bytes_rebuilt=sum(facts.nodes[n.meta[REMAT_KEY].source].alloc_bytes for n in nodes
                              if n.name in rebuilds and n.meta[REMAT_KEY].source in facts.nodes),
            reasons=tuple(dict.fromkeys(nodes_reason for n in nodes if (nodes_reason := n.meta[REMAT_KEY].reason))),
        ))
    return tuple(summaries)


def describe_region(summary: RegionSummary) -> str:
    return (
        f"recompute region {summary.region}: rebuilds {', '.join(summary.rebuilds)} "
        f"({format_bytes(summary.bytes_rebuilt)}) for {summary.first_use}"
    )
