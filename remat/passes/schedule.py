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

from dataclasses import dataclass
from typing import AbstractSet, Mapping

from ..cost_model.memory import Step
from .joint_graph import JointGraphFacts

RECOMPUTE_SUFFIX = "@r"
INLINE_FUSED = True
SINGLE_READER_ONLY = True


@dataclass(frozen=True)
class Partition:
    saved: frozenset[str]                  # forward candidates handed to the backward
    saved_primals: frozenset[str]          # inputs the backward reads (resident: cost no memory)
    recomputed: frozenset[str]             # forward candidates the backward recomputes
    forced: Mapping[str, str]              # saved although not chosen: name -> reason


_REDUCTIONS = {"sum", "mean", "var_mean", "var", "amax", "amin", "max", "min", "prod", "any", "all", "logsumexp"}


def why_not_recomputable(facts: JointGraphFacts, name: str) -> str | None:
    """The reason ``name`` must be saved rather than recomputed, or None if it may be recomputed."""
    node = facts.nodes[name]
    if node.recompute_ban is not None:
        return node.recompute_ban
    if node.is_sym:
        return "symbolic size: saved as an int"
    if node.is_getitem:
        source = node.inputs[0]
        if facts.nodes[source].is_multi_output:
            return why_not_recomputable(facts, source)  # save this output, never the tuple
    op_name = node.op.split(".")[1] if node.op.startswith("aten.") else ""
    if op_name in _REDUCTIONS and 4 * node.cost.bytes_written <= node.cost.bytes_read:
        # A reduction recomputed in another kernel may round differently (another
        # reduction order), and normalisation backwards amplify the difference; its
        # output is small, so saving it costs little.
        return "reduction: saving its small output keeps recomputation bit-identical"
    return None


def partition_nodes(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> Partition:
    """Close ``chosen_saved`` into a valid partition.

    Every value the backward reads is either saved, a primal, or recomputed from
    saved values and primals. A value that may not be recomputed (random,
    mutation, collective, symbolic size) is saved and recorded in ``forced``.
    """
    saved = set(chosen_saved)
    forced: dict[str, str] = {}
    primals: set[str] = set()
    recomputed: set[str] = set()
    stack = list(facts.needed_by_backward)
    while stack:
        name = stack.pop()
        node = facts.nodes[name]
        if node.role == "primal":
            primals.add(name)
            continue
        if name in saved or name in recomputed:
            continue
        reason = why_not_recomputable(facts, name)
        if reason is not None:
            saved.add(name)
            forced[name] = reason
            continue
        recomputed.add(name)
        stack.extend(node.inputs)
    for name in saved - set(forced):
        reason = why_not_recomputable(facts, name)
        if reason is not None:
            forced[name] = reason
    return Partition(frozenset(saved), frozenset(primals), frozenset(recomputed), forced)


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


class _Instances:
    """Storages of each node *instance*: ``(name, "f")`` in the forward, ``(name, "r")`` for
    its recomputation in the backward, ``(name, "b")`` for a backward node.

    An instance that Inductor inlines into all its consumers (a pointwise op whose
    consumers all fuse) allocates nothing; its value stands for its inputs' storages,
    so they stay live until the consumer runs. Views and getitems refer to their
    source's storages. Everything else allocates its own.
    """

    def __init__(self, facts: JointGraphFacts, partition: Partition, fw_set: set[str], bw_set: set[str]) -> None:
        self.facts = facts
        self.partition = partition
        self.phase_members = {"f": fw_set, "r": set(partition.recomputed), "b": bw_set}
        self.materialized_f = set(partition.saved) | set(facts.fwd_outputs)
        self.storages: dict[tuple[str, str], tuple[str, ...]] = {}

    def input_instance(self, name: str, phase: str) -> tuple[str, str]:
        if phase == "f" or self.facts.nodes[name].role == "primal":
            return (name, "f")
        if name in self.partition.recomputed:
            return (name, "r")
        return (name, "b") if self.facts.nodes[name].role == "backward" else (name, "f")

    def _consumers_fuse(self, name: str, phase: str) -> bool:
        """True when every consumer of this instance (looking through views) can fuse it."""
        readers = self.phase_members["f"] if phase == "f" else self.phase_members["r"] | self.phase_members["b"]
        stack = [u for u in self.facts.users[name] if u in readers]
        if SINGLE_READER_ONLY and len(stack) > 1:
            return False
        seen: set[str] = set()
        while stack:
            user = stack.pop()
            if user in seen:
                continue
            seen.add(user)
            node = self.facts.nodes[user]
            if not node.fusible_consumer:
                return False
            if node.is_view or node.is_getitem:
                if phase == "f" and user in self.materialized_f:
                    return False
                stack.extend(u for u in self.facts.users[user] if u in readers)
        return True

    def inlined(self, name: str, phase: str) -> bool:
        node = self.facts.nodes[name]
        if not node.inlinable or not INLINE_FUSED:
            return False
        if phase == "f" and name in self.materialized_f:
            return False
        if phase == "b" and name in self.facts.bwd_outputs:
            return False
        return self._consumers_fuse(name, phase)

    def add(self, name: str, phase: str) -> tuple[tuple[str, int], ...]:
        """Record the instance's storages; return what it allocates."""
        node = self.facts.nodes[name]
        inputs = [self.storages.get(self.input_instance(i, phase), self.facts.nodes[i].value_storages) for i in node.inputs]
        if node.is_getitem:
            source = inputs[0] if inputs else ()
            index = node.getitem_index
            own = (source[index],) if len(source) > 1 and index is not None and index < len(source) else source
            allocs: tuple[tuple[str, int], ...] = ()
        elif node.is_view:
            own, allocs = (inputs[0] if inputs else ()), ()
        elif self.inlined(name, phase):
            own, allocs = tuple(dict.fromkeys(s for group in inputs for s in group)), ()
        else:
            suffix = RECOMPUTE_SUFFIX if phase == "r" else ""
            allocs = tuple((sid + suffix, nbytes) for sid, nbytes in node.allocs)
            own = tuple(sid for sid, _ in allocs)
        self.storages[(name, phase)] = own
        return allocs

    def uses(self, name: str, phase: str) -> tuple[str, ...]:
        return tuple(
            s for i in self.facts.nodes[name].inputs
            for s in self.storages.get(self.input_instance(i, phase), self.facts.nodes[i].value_storages)
        )


def memory_steps(facts: JointGraphFacts, partition: Partition) -> tuple[list[Step], set[str]]:
    """The forward, then the backward, as simulator steps; and the pinned storages."""
    fw_order = forward_order(facts, partition)
    bw_order = backward_order(facts, partition)
    instances = _Instances(facts, partition, set(fw_order), {n for n, r in bw_order if r < 0})
    steps: list[Step] = []
    for name in fw_order:
        allocs = instances.add(name, "f")
        steps.append(Step(name, "forward", allocs, instances.uses(name, "f"), reuses_inputs=facts.nodes[name].inlinable))
    tangent_allocs = tuple(
        alloc for name in facts.order if facts.nodes[name].role == "tangent" for alloc in facts.nodes[name].allocs
    )
    steps.append(Step("<tangents>", "backward", tangent_allocs, ()))
    for name, region in bw_order:
        phase = "r" if region >= 0 else "b"
        allocs = instances.add(name, phase)
        step_name = name + RECOMPUTE_SUFFIX if phase == "r" else name
        steps.append(Step(step_name, "backward", allocs, instances.uses(name, phase), region, facts.nodes[name].inlinable))
    pinned = {s for o in facts.fwd_outputs for s in instances.storages.get((o, "f"), facts.nodes[o].value_storages)}
    pinned |= {s for o in facts.bwd_outputs for s in instances.storages.get((o, "b"), facts.nodes[o].value_storages)}
    return steps, pinned
