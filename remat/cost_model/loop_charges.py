"""Which node of a fused graph pays which of the generated-loop costs ``loop_costs.py`` measures.

``loop_extra_s`` charges, per loop node, the seconds Inductor's CPU loops pay
beyond the roofline (random numbers, bool masks stored and loaded, long Welford
chains); ``split_kernel_loads`` names the values a kernel split into loop nests
by a reduction loads a second time. ``costs._fused_costs`` adds the first to a
kernel's compute time and the bytes of the second to its memory time.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Mapping, Optional

import torch
from torch import fx

from .flops import node_special_ops
from .fusion import FusionGroups, is_loop_op
from .inductor_rules import REDUCTION_OPS, WELFORD_OPS
from .loop_costs import LONG_REDUCTION
from .tensors import concrete_int, is_free_op, iter_tensors, node_val, op_name, op_tags

if TYPE_CHECKING:   # hardware imports loop_costs, which must not import hardware back
    from .hardware import HardwareProfile


def _numel(value: object) -> int:
    return sum(concrete_int(t.numel()) for t in iter_tensors(value))


def _storage_source(node: fx.Node) -> fx.Node:
    """The node whose memory ``node``'s value lives in (through views and getitems)."""
    while node.op == "call_function" and (is_free_op(node) or node.target is operator.getitem) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def loop_extra_s(graph: fx.Graph, groups: FusionGroups, profile: HardwareProfile,
                 split_loads: Optional[Mapping[str, tuple[str, ...]]] = None) -> dict[str, float]:
    """Per loop node, what Inductor's generated loop pays beyond the roofline (``loop_costs.py``), in seconds.

    - random numbers at the loop's Philox cost (in place of eager's rate, which the roofline charges);
    - a bool output that reaches memory, per element written;
    - a bool input loaded from memory, per element the loop reads (a broadcast mask is read per element),
      and each bool value a kernel split by a reduction loads again (``split_loads``, from ``split_kernel_loads``);
    - a Welford reduction of at least ``LONG_REDUCTION`` elements per output, per element reduced.
    A profile without measured loop costs (datasheet GPUs) gets an empty mapping.
    """
    if not profile.loop_costs_s:
        return {}
    nodes = {n.name: n for n in graph.nodes}
    extra: dict[str, float] = {}
    loaded: dict[str, set[str]] = {}
    for name, gid in groups.group_of.items():
        node = nodes[name]
        if not is_loop_op(node):
            continue
        _, random_values = node_special_ops(node)
        seconds = 0.0
        if random_values and "random_value" in profile.loop_costs_s:
            seconds += profile.loop_cost_s("random_value", random_values) - profile.special_ops_s(0, random_values)
        outputs = list(iter_tensors(node_val(node)))
        if outputs and all(t.dtype == torch.bool for t in outputs):
            seconds += profile.loop_cost_s("bool_store", groups.bytes_written.get(name, 0))   # 1 byte per element
        out_numel = _numel(node_val(node))
        seen = loaded.setdefault(gid, set())
        for arg in node.all_input_nodes:
            source = _storage_source(arg)
            if groups.group_of.get(source.name) == gid or arg.name in seen:
                continue   # computed in this kernel, or already loaded by it
            seen.add(arg.name)
            for tensor in iter_tensors(node_val(arg)):
                if tensor.dtype == torch.bool:
                    seconds += profile.loop_cost_s("bool_load", max(concrete_int(tensor.numel()), out_numel))
        if op_name(node) in WELFORD_OPS:
            reduced = max((_numel(node_val(a)) for a in node.all_input_nodes), default=0)
            outputs_numel = max((concrete_int(t.numel()) for t in outputs), default=1)
            if reduced >= LONG_REDUCTION * max(outputs_numel, 1):
                seconds += profile.loop_cost_s("welford_long", reduced)
        for value in (split_loads or {}).get(name, ()):
            for tensor in iter_tensors(node_val(nodes[value])):
                if tensor.dtype == torch.bool:
                    seconds += profile.loop_cost_s("bool_load", concrete_int(tensor.numel()))
        if seconds:
            extra[name] = seconds
    return extra


def _is_reduction(node: fx.Node) -> bool:
    return op_name(node) in REDUCTION_OPS or torch.Tag.reduction in op_tags(node)


def split_kernel_loads(graph: fx.Graph, groups: FusionGroups) -> dict[str, tuple[str, ...]]:
    """Per loop node, the full-size values its kernel loads beyond one load per outside input, by name,
    once per load: what a reduction splitting the kernel into loop nests makes it load again.

    Inductor computes a kernel with a full-size reduction and a full-size loop over
    its result (layer norm, batch norm's backward, softmax) as loop nests: the
    reduction's, then the epilogue's. The epilogue reloads every full-size input it
    needs that the first nest already read (its inlined producers are recomputed,
    not stored), and a value the kernel stores from random numbers (a dropout mask
    the backward needs) is loaded back by each later nest that reads it. Charged to the kernel's first
    epilogue node (its first reduction when it has none).
    """
    nodes = {n.name: n for n in graph.nodes}
    loads: dict[str, tuple[str, ...]] = {}
    for gid, member_names in groups.members.items():
        members = [nodes[name] for name in member_names]
        if len(members) < 2 or not all(is_loop_op(m) for m in members):
            continue
        inside = set(member_names)
        # Inductor realizes random numbers (two reads of one draw must agree): the first value the kernel
        # stores from them (the dropout mask) is loaded back by later nests; anything else, stored or not,
        # is recomputed from its inputs where a later nest reads it
        written = {name for name in member_names if groups.bytes_written.get(name, 0) > 0}
        from_random: set[str] = set()
        for m in members:
            if node_special_ops(m)[1] or any(
                    (source := _storage_source(a).name) in from_random and source not in written
                    for a in m.all_input_nodes):
                from_random.add(m.name)
        stored = written & from_random
        full = max(_numel(node_val(m)) for m in members)

        def full_loads(node: fx.Node, seen: set) -> set:
            """Full-size values computing ``node`` loads: outside inputs and values the kernel stored."""
            found = set()
            for arg in node.all_input_nodes:
                source = _storage_source(arg)
                if source.name in stored and _numel(node_val(source)) == full:
                    found.add(source.name)
                elif source.name in inside:
                    if source not in seen and not _is_reduction(source):
                        seen.add(source)
                        found |= full_loads(source, seen)
                elif _numel(node_val(arg)) == full:
                    found.add(source.name)
            return found

        reductions = [m for m in members if _is_reduction(m) and _numel(node_val(m)) < full]
        if not reductions:
            continue
        first = set().union(*(full_loads(r, set()) for r in reductions))
        after = set(reductions)
        epilogue = []
        for m in members:   # graph order: a member after a reduction it reads (through the kernel) is in pass two
            if m not in after and any(_storage_source(a) in after for a in m.all_input_nodes):
                after.add(m)
                if not _is_reduction(m) and _numel(node_val(m)) == full:
                    epilogue.append(m)
        second = set().union(*(full_loads(e, set()) for e in epilogue)) if epilogue else set()
        loaded = sorted(first & inside) + sorted(second & inside) + sorted((first & second) - inside)
        if loaded:
            loads[(epilogue or reductions)[0].name] = tuple(loaded)
    return loads


__all__ = ["loop_extra_s", "split_kernel_loads"]
