"""Views a graph returns that Inductor copies: a saved view of a loop value laid out unlike eager.

Inductor gives a graph output the strides the traced (eager) value had (torch 2.13.0,
``GraphLowering.run_node``: an output that is a view gets ``require_stride_order`` with the order of
its traced strides; ``ir.ExternKernel.require_strides``). A loop value's buffer has a
``FlexibleLayout``, frozen row-major when a view of it is turned into a strided view
(``convert_to_reinterpret_view``). So when the loop value's traced layout is not row-major (it
follows a permuted input: a rotary embedding of the keys ``(q @ w).view(b, t, h, d).transpose(1, 2)``),
a returned view of it (repeat_kv's ``k[:, :, None].expand(...)``) has a stride order its buffer cannot
give, and Inductor copies the view into a dense buffer of the view's own size: an expanded view
costs its expanded size (HF Llama with GQA: 2x the keys per layer), not its base's.

The copy is not made when the loop value itself is returned too (it then gets its traced strides
first) or when its buffer is laid out channels-last (``kernel_facts._layouts``); a view of a
library call's output or of a graph input is a strided view of a fixed layout. Which views the
forward returns depends on the partition: ``view_copies`` names the candidates, and
``kernel_steps.forward_steps`` applies them to the values a partition saves.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ..cost_model.inductor_rules import CPU_CONCAT_OPS
from ..passes.joint_graph import JointGraphFacts
from .kernel_lowering import ALIAS, POINTWISE, REDUCTION


def row_major(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether ``strides`` order the dims of ``shape`` longer than 1 outermost first, as a row-major
    (contiguous) layout does: the order Inductor freezes a loop value's ``FlexibleLayout`` in."""
    kept = [stride for size, stride in zip(shape, strides) if size > 1]
    return all(a > b for a, b in zip(kept, kept[1:]))


def view_copies(facts: JointGraphFacts, kinds: Mapping[str, str], layouts: Mapping[str, str],
                base_of: Mapping[str, str]) -> dict[str, tuple[str, int]]:
    """Per forward view Inductor copies when the forward returns it while not returning its base:
    (the base node, the copy's bytes). ``kinds``: ``kernel_facts.kernel_kind`` of every node;
    ``layouts``: the channels-last values; ``base_of``: the node whose storage a view's value is."""
    copies: dict[str, tuple[str, int]] = {}
    for name in facts.order:
        node = facts.nodes[name]
        if not (node.is_view and node.is_tensor and node.role == "forward") or node.is_getitem or kinds.get(name) != ALIAS:
            continue
        base = base_of.get(name)
        if base is None or base == name or base not in facts.nodes:
            continue
        source = facts.nodes[base]
        if kinds.get(base) not in (POINTWISE, REDUCTION) or layouts.get(base) or layouts.get(name):
            continue
        if source.op.count(".") == 2 and source.op.split(".")[1] in CPU_CONCAT_OPS:
            continue    # a CPU cat's buffer is its ConcatKernel's
        if not source.strides or row_major(source.shape, source.strides):
            continue
        copies[name] = (base, node.numel * node.itemsize)
    return copies


__all__ = ["row_major", "view_copies"]
