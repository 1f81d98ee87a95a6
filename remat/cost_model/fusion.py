"""Which nodes Inductor fuses into one kernel, and so which tensors reach memory.

Inductor turns pointwise ops, reductions and the composites it decomposes into
loops, inlines pointwise producers into their consumers and fuses loops that
feed each other into one kernel. An intermediate whose every reader is in the
same kernel never reaches memory; matmuls, convolutions and attention run as
library calls ("extern" kernels) that read and write memory in full.

``find_fusion_groups`` approximates that with one greedy pass in graph order,
the way Inductor's scheduler fuses producer into consumer:

- A *loop* node (``is_loop_op``) joins the group of each loop producer it reads
  when (a) both are in the same phase (forward and backward are separate
  graphs), (b) the producer is pointwise, or both iterate over the same number
  of elements, or the producer is a reduction and the node loops over its
  result (batch norm's running-stat update over channels, in the reduction's
  outer loop),
  (c) the merged group would not depend on itself through an outside node
  (that would be a cycle: Inductor cannot fuse across an extern kernel that
  sits between them) and (d) it stays within Inductor's ``max_fusion_size``
  nodes (its config, read when the graph is grouped).
- A loop node also joins the groups of earlier loop nodes that read the same
  full-size tensor over the same number of elements, where that makes no cycle
  (horizontal fusion: q and k scaled in one kernel, both reading the qkv matmul).
- Views, getitems and ``_unsafe_view`` are transparent: a reader of a view
  reads the tensor under it.
- A node's output is *materialized* (written) when a reader is outside its
  group or it is a graph output. A group reads each outside tensor once.
- Each group, and each extern node, is one kernel launch, charged to its last node.

Not modelled: horizontal fusion of kernels that share no input (Inductor bumps
all of batch norm's ``num_batches_tracked`` counters in one kernel), so the
kernel count errs high by a few tiny kernels.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import fx

from .._torch_inductor import inductor_config
from .flops import COMPOSITE_FLOPS_PER_ELEMENT, DATA_MOVEMENT_OPS
from .inductor_rules import ALWAYS_STORED_LOOPS, LOOP_OPS, MUTATIONS, REDUCTION_OPS, SCATTER_OPS
from .phases import node_phases
from .tensors import concrete_int, is_free_op, iter_tensors, node_val, op_name, op_tags, tensor_nbytes, touched_nbytes

# Plain copies the time model charges as kernels of their own (``lift_fresh_copy`` of a constant,
# ``copy`` into a fresh tensor).
_COPIES_CHARGED_ALONE = frozenset({"copy", "lift_fresh_copy"})


def is_loop_op(node: fx.Node) -> bool:
    """True when Inductor computes the node in a generated loop it can fuse with others."""
    if node.op != "call_function" or is_free_op(node):
        return False
    name = op_name(node)
    # MUTATIONS (copy_) are loops in Inductor too (``lowering.copy_`` -> ``mutate_to``) and in the
    # memory model, but here a loop's value is charged a store only when something reads it, and a
    # mutation's value is read by nobody: charged as a kernel of its own, its store is counted.
    # (As a loop the zoo's plans hash the same; functionalized joint graphs rarely hold a copy_.)
    if name in SCATTER_OPS or name in MUTATIONS or name in _COPIES_CHARGED_ALONE:
        return False
    return (
        torch.Tag.pointwise in op_tags(node)
        or name in REDUCTION_OPS
        or name in COMPOSITE_FLOPS_PER_ELEMENT     # composites Inductor decomposes into loops
        or name in LOOP_OPS
        or name in ALWAYS_STORED_LOOPS
        or name in DATA_MOVEMENT_OPS
    )


def _is_pointwise_like(node: fx.Node) -> bool:
    return is_loop_op(node) and op_name(node) not in REDUCTION_OPS and torch.Tag.reduction not in op_tags(node)


def _loop_numel(node: fx.Node) -> int:
    """Elements the node's loop runs over: its output's for pointwise-like ops (inputs broadcast
    or are gathered into it), the largest tensor it touches for reductions and the rest."""
    values = [node_val(node)]
    if not _is_pointwise_like(node):
        values += [node_val(a) for a in node.all_input_nodes]
    return max((concrete_int(t.numel()) for v in values for t in iter_tensors(v)), default=0)


@dataclass(frozen=True)
class FusionGroups:
    """The result of ``find_fusion_groups``; every mapping is keyed by node name."""

    group_of: Mapping[str, str]               # kernel node -> its group's id (the name of its first node)
    members: Mapping[str, tuple[str, ...]]    # group id -> member names in graph order
    bytes_read: Mapping[str, int]             # kernel node -> bytes it reads from memory once fused
    bytes_written: Mapping[str, int]          # kernel node -> bytes of its outputs that reach memory
    launches: Mapping[str, int]               # kernel node -> 1 for the last node of each kernel, else 0

    def kernel_count(self) -> int:
        return sum(self.launches.values())


class _Kinds:
    """What each node of one graph is, computed once: the grouping asks many times."""

    def __init__(self, graph: fx.Graph) -> None:
        nodes = list(graph.nodes)
        self.free = {n: n.op != "call_function" or is_free_op(n) for n in nodes}
        self.loop = {n: not self.free[n] and is_loop_op(n) for n in nodes}
        self.pointwise = {n: self.loop[n] and _is_pointwise_like(n) for n in nodes}
        self.loop_numel = {n: _loop_numel(n) for n in nodes if self.loop[n]}

    def source(self, node: fx.Node) -> fx.Node:
        """The node that produced the memory ``node``'s value lives in (through views and getitems)."""
        while node.op == "call_function" and self.free[node] and node.all_input_nodes:
            node = node.all_input_nodes[0]
        return node

    def readers(self, node: fx.Node) -> list[fx.Node]:
        """Nodes that read ``node``'s value, looking through views and getitems of it."""
        found: list[fx.Node] = []
        for user in node.users:
            if user.op == "call_function" and self.free[user] and user.all_input_nodes and user.all_input_nodes[0] is node:
                found.extend(self.readers(user))
            else:
                found.append(user)
        return found


class _Grouper:
    def __init__(self, graph: fx.Graph, max_group_size: int) -> None:
        self.max_group_size = max_group_size
        self.nodes = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self.phase = node_phases(graph)
        self.kinds = _Kinds(graph)
        self.group: dict[fx.Node, int] = {}       # kernel node -> group id (index of its first node)
        self.members: dict[int, list[fx.Node]] = {}

    def _creates_cycle(self, merged: list[fx.Node]) -> bool:
        """True when an outside node that a member reads depends on a member: fusing would need a cycle."""
        inside = set(merged)
        lowest = min(self.index[m] for m in merged)
        outside_inputs = {self.kinds.source(arg) for m in merged for arg in m.all_input_nodes} - inside
        # Walk back from those inputs, only through nodes after the earliest member: nothing
        # earlier in graph order can depend on a member.
        seen: set[fx.Node] = set()
        stack = [q for q in outside_inputs if self.index[q] > lowest]
        while stack:
            node = stack.pop()
            if node in inside:
                return True
            if node in seen:
                continue
            seen.add(node)
            stack.extend(a for a in node.all_input_nodes if self.index[a] >= lowest)
        return False

    def _can_join(self, producer: fx.Node, node: fx.Node) -> bool:
        kinds = self.kinds
        if producer not in self.group or not kinds.loop[producer]:
            return False
        if self.phase[producer.name] != self.phase[node.name]:
            return False
        if kinds.pointwise[producer] or kinds.loop_numel[producer] == kinds.loop_numel[node]:
            return True
        # a reduction's epilogue: a loop over the reduced result runs in the reduction's outer loop
        return kinds.loop_numel[node] in {concrete_int(t.numel()) for t in iter_tensors(node_val(producer))}

    def add(self, node: fx.Node) -> None:
        if self.kinds.free[node]:
            return
        candidates: list[int] = []
        if self.kinds.loop[node]:
            for arg in node.all_input_nodes:
                producer = self.kinds.source(arg)
                if self._can_join(producer, node) and self.group[producer] not in candidates:
                    candidates.append(self.group[producer])
        chosen = self._choose(candidates, node)
        if self.kinds.loop[node]:
            chosen += self._siblings(node, chosen)
        gid = min(chosen) if chosen else self.index[node]
        merged = [m for g in chosen for m in self.members.pop(g)] + [node]
        merged.sort(key=self.index.__getitem__)
        self.members[gid] = merged
        for member in merged:
            self.group[member] = gid

    def _siblings(self, node: fx.Node, chosen: list[int]) -> list[int]:
        """Groups of earlier loop nodes that read the same tensor over the same loop (horizontal fusion)."""
        extra: list[int] = []
        kinds = self.kinds
        loop = kinds.loop_numel[node]
        if loop <= 1:
            return extra  # a scalar (a seed lookup) is inlined into each reader, not gathered into one kernel
        for arg in node.all_input_nodes:
            if sum(concrete_int(t.numel()) for t in iter_tensors(node_val(arg))) < loop:
                continue  # sharing a scalar (a seed, a count) is no reason to fuse
            for reader in kinds.readers(kinds.source(arg)):
                gid = self.group.get(reader)
                if (gid is None or gid in chosen or gid in extra or not kinds.loop[reader]
                        or self.phase[reader.name] != self.phase[node.name] or kinds.loop_numel[reader] != loop):
                    continue
                merged = [m for g in chosen + extra + [gid] for m in self.members[g]] + [node]
                if len(merged) <= self.max_group_size and not self._creates_cycle(merged):
                    extra.append(gid)
        return extra

    def _choose(self, candidates: list[int], node: fx.Node) -> list[int]:
        """All candidate groups if they merge without a cycle, else the largest single one that does."""
        def fits(groups: list[int]) -> bool:
            merged = [m for g in groups for m in self.members[g]] + [node]
            return len(merged) <= self.max_group_size and not self._creates_cycle(merged)

        if candidates and fits(candidates):
            return candidates
        for gid in sorted(candidates, key=lambda g: -len(self.members[g])):
            if fits([gid]):
                return [gid]
        return []


def _output_slots(node: fx.Node, kinds: _Kinds) -> list[tuple[Any, list[fx.Node]]]:
    """(tensor, readers) per output of ``node``; a tuple-valued node has one slot per getitem index."""
    value = node_val(node)
    if isinstance(value, torch.Tensor):
        return [(value, kinds.readers(node))]
    slots: dict[int, list[fx.Node]] = {}
    for user in node.users:
        if user.target is operator.getitem:
            slots.setdefault(int(user.args[1]), []).extend(kinds.readers(user))
        else:
            slots.setdefault(-1, []).append(user)
    out: list[tuple[Any, list[fx.Node]]] = []
    if isinstance(value, (list, tuple)):
        for index, readers in slots.items():
            if index >= 0 and index < len(value) and isinstance(value[index], torch.Tensor):
                out.append((value[index], readers))
            elif index == -1:
                out.extend((t, readers) for t in iter_tensors(value))
    return out


def find_fusion_groups(graph: fx.Graph, max_group_size: int | None = None) -> FusionGroups:
    """Group the graph's kernel nodes as Inductor would fuse them; see the module docstring.

    ``max_group_size``: the most nodes in one group; None reads Inductor's ``max_fusion_size`` now.
    """
    if max_group_size is None:
        max_group_size = inductor_config().max_fusion_size
    grouper = _Grouper(graph, max_group_size)
    for node in graph.nodes:
        grouper.add(node)
    group = {n.name: grouper.members[gid][0].name for n, gid in grouper.group.items()}
    members = {grouper.members[gid][0].name: tuple(m.name for m in ms) for gid, ms in grouper.members.items()}
    bytes_read: dict[str, int] = {}
    bytes_written: dict[str, int] = {}
    launches: dict[str, int] = {}
    seen_reads: dict[str, set[str]] = {}
    for node in graph.nodes:
        if node not in grouper.group:
            continue
        gid = group[node.name]
        seen = seen_reads.setdefault(gid, set())
        read = 0
        for arg in node.all_input_nodes:
            source = grouper.kinds.source(arg)
            if source in grouper.group and group[source.name] == gid:
                continue  # computed in this kernel: never loaded
            if arg.name in seen:
                continue  # this kernel already loaded it
            seen.add(arg.name)
            read += sum(touched_nbytes(t) for t in iter_tensors(node_val(arg)))
        bytes_read[node.name] = read
        written = 0
        for tensor, readers in _output_slots(node, grouper.kinds):
            if any(r not in grouper.group or group[r.name] != gid for r in readers):
                written += tensor_nbytes(tensor)
        bytes_written[node.name] = written
        launches[node.name] = int(members[gid][-1] == node.name)
    return FusionGroups(group, members, bytes_read, bytes_written, launches)


__all__ = ["FusionGroups", "find_fusion_groups", "is_loop_op"]
