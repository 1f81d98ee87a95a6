"""Where a matrix product that feeds one add runs: Inductor's post-grad ``addmm`` fusion.

Before lowering, Inductor's post-grad pattern pass (torch 2.13.0, ``torch/_inductor/
fx_passes/post_grad.py``: ``addmm`` in ``pass_patterns[2]``) rewrites ``add(c, mm(a, b))`` and
``add(mm(a, b), c)`` into one ``addmm(c, a, b)`` placed where the add was, when

- the mm has no other reader (the pattern's intermediate node has one user; a graph output
  counts as one),
- ``c`` is a tensor that broadcasts to the product's shape, with the dtype of ``a`` and ``b``
  (``is_valid_addmm_fusion``), and
- on a GPU, some reader of the sum is not pointwise (``should_prefer_unfused_addmm`` keeps the
  add apart when every reader is: it fuses into them instead). On a CPU it always applies.

The product then runs at the add's place, as the add: one library call that reads the product's
operands and the add's other operand and writes the sum, with no buffer for the product (the
simulator drops the product and runs the add as that call: ``without_fused_products``; until
session 19 it moved the product next to the add and counted its buffer too, 7.8% over on a tied-head
corpus net). Its operands stay live until the add's other operand exists. This moves memory when the two are far apart: a weight read twice gets its
gradient as the sum of two products, and a tied LM head's weight (also the token embedding's)
gets ``add(mm(grad_logits^T, h), embedding_grad)``: the logits' gradient (batch x tokens x
vocab), dead after the head's products at the start of the backward, stays live until the
embedding's gradient at its end (HF BERT at benchmark size: 2,621,440 B of checked peak the
simulator missed).

remat keeps a product apart from its add where the fusion would hold more than it saves
(``products_kept_apart``, backward graphs only): the rewrite writes that sum as ``sub(c, neg(mm))``,
which no pattern fuses (exact: ``c - (-p)`` is ``c + p`` in IEEE arithmetic), so the product runs at its
own place in remat's schedule and its operands die there. Measured on a T5 (tied head, 3+3 layers):
the smallest budget remat names went 1.738 -> 1.523 MB with Inductor's addmm patterns off.

Inductor tries ``add(c, mm)`` first (the pattern registered first), so when both operands are
fusible products the second one is the one fused. dtypes are compared by item size (the joint
graph's facts keep that; an add of float16 and bfloat16 products, which promotes, is taken as fused).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from ..passes.joint_graph import JointGraphFacts
from .kernel_facts import has_op_tag, kernel_facts_of, op_short_name


_ADD, _MM = "aten.add.", "aten.mm."


def _expandable_to(shape: Sequence[int], desired: Sequence[int]) -> bool:
    """``torch._prims_common.is_expandable_to``: ``shape`` broadcasts to ``desired``."""
    if len(shape) > len(desired):
        return False
    return all(shape[-i - 1] in (desired[-i - 1], 1) for i in range(len(shape)))


def _all_pointwise(facts: JointGraphFacts, inst: str, node_of: Mapping[str, str],
                   readers: Mapping[str, Sequence[str]], outputs: set[str]) -> bool:
    """``is_pointwise_use`` over every reader of ``inst``: views pass it on to their readers; the
    graph's output is not pointwise."""
    if inst in outputs:
        return False
    for reader in readers.get(inst, ()):
        node = facts.nodes[node_of[reader]]
        if node.is_view or node.is_getitem:
            if not _all_pointwise(facts, reader, node_of, readers, outputs):
                return False
        elif not has_op_tag(node.op, torch.Tag.pointwise):
            return False
    return True


def addmm_fusions(facts: JointGraphFacts, instances: Sequence[tuple[str, str]],
                  inputs_of: Mapping[str, Sequence[str]], outputs: set[str]) -> dict[str, tuple[str, str]]:
    """Per mm instance Inductor fuses into an add: (the add's instance, the add's other operand).

    ``instances``: (node name, instance name) of one compiled graph in its order; ``inputs_of``: the
    tensor inputs each instance reads (instances of this graph or the graph's inputs); ``outputs``:
    the instances the graph returns. Pure: the same graph gives the same answer."""
    node_of = {inst: name for name, inst in instances}
    nodes = facts.nodes
    candidates = [inst for name, inst in instances
                  if nodes[name].op.startswith(_ADD) and len(inputs_of[inst]) == 2
                  and any(nodes[node_of[i]].op.startswith(_MM) for i in inputs_of[inst] if i in node_of)]
    if not candidates:
        return {}
    readers: dict[str, list[str]] = {}
    for _, inst in instances:
        for i in inputs_of[inst]:
            if i in node_of:
                readers.setdefault(i, []).append(inst)
    fused: dict[str, tuple[str, str]] = {}
    for inst in candidates:
        operands = inputs_of[inst]
        for product, other in ((operands[1], operands[0]), (operands[0], operands[1])):
            if product in fused or not _fusible(facts, product, other, inst, node_of, readers, outputs, inputs_of):
                continue
            fused[product] = (inst, other)
            break
    return fused


def _fusible(facts: JointGraphFacts, product: str, other: str, add: str, node_of: Mapping[str, str],
             readers: Mapping[str, Sequence[str]], outputs: set[str], inputs_of: Mapping[str, Sequence[str]]) -> bool:
    """Whether ``add(other, product)`` matches Inductor's pattern with ``product`` as the mm."""
    if product not in node_of or product in outputs or list(readers.get(product, ())) != [add]:
        return False
    mm = facts.nodes[node_of[product]]
    if op_short_name(mm) != "mm" or len(mm.shape) != 2:
        return False
    operand = facts.nodes[node_of.get(other, other)]
    if not operand.is_tensor or not _expandable_to(operand.shape, mm.shape):
        return False
    mats = [facts.nodes[node_of.get(i, i)] for i in inputs_of[product]]
    if any(m.itemsize != operand.itemsize for m in mats):
        return False
    add_node = facts.nodes[node_of[add]]
    return add_node.device == "cpu" or not _all_pointwise(facts, add, node_of, readers, outputs)


def products_kept_apart(facts: JointGraphFacts, instances: Sequence[tuple[str, str]],
                        inputs_of: Mapping[str, Sequence[str]], outputs: set[str],
                        fused: Mapping[str, tuple[str, str]]) -> frozenset[str]:
    """The adds (instances) of ``fused`` (``addmm_fusions``' answer) whose product remat keeps at its
    own place: something runs between the product and the add, and the product's operands whose
    storages would die before the add if the product ran at its own place (no other reader from
    the add on; not a parameter's, not a graph output's) are more bytes than the product's. Fused,
    those operands live until the add; apart, the product's result does. A tie keeps the fusion.
    Pure, like ``addmm_fusions``: the simulator and the rewrite (``rewrite.place_recompute_regions``)
    ask it the same question and get the same answer."""
    if not fused:
        return frozenset()
    node_of = {inst: name for name, inst in instances}
    position = {inst: k for k, (_, inst) in enumerate(instances)}
    nodes = facts.nodes
    cache = kernel_facts_of(facts)     # per-graph constants: storage sizes, which storages the step made
    freeable = cache.owned | {sid for sid, _ in cache.tangent_allocs}     # not a parameter's

    memo: dict[str, tuple[tuple[str, str], ...]] = {}

    def storages(inst: str) -> tuple[tuple[str, str], ...]:
        """(storage id, the owning instance's suffix): a recomputed copy's storages are its own; a
        view's are those of the instance it views."""
        if inst not in memo:
            name = node_of.get(inst, inst)
            node = nodes[name]
            if inst in node_of and node.is_view and inputs_of[inst]:
                memo[inst] = storages(inputs_of[inst][0])
            else:
                memo[inst] = tuple((sid, inst[len(name):]) for sid in node.value_storages)
        return memo[inst]

    read_at: dict[tuple[str, str], list[int]] = {}
    for _, inst in instances:
        for i in inputs_of[inst]:
            for sid in storages(i):
                read_at.setdefault(sid, []).append(position[inst])
    never_freed = {sid for o in outputs for sid in storages(o)}
    kept = set()
    for product, (add, _) in fused.items():
        at, until = position[product], position[add]
        if all(nodes[name].is_view or nodes[name].is_getitem for name, _ in instances[at + 1:until]):
            continue        # nothing runs between the two: the fusion moves nothing
        # fused, the product's operands live until the add; apart, each dies at its last other reader
        operands = {sid for i in inputs_of[product] for sid in storages(i)}
        freed = sum(cache.storage_bytes.get(sid, 0) for sid, suffix in operands
                    if sid in freeable and (sid, suffix) not in never_freed
                    and max((k for k in read_at[sid, suffix] if k != at), default=-1) < until)
        if freed > nodes[node_of[product]].alloc_bytes:
            kept.add(add)
    return frozenset(kept)


def without_fused_products(instances: Sequence[tuple[str, str]], addmm_of: Mapping[str, str]) -> list[tuple[str, str]]:
    """``instances`` less the products fused into an add (``addmm_of``: add -> product): the add is
    the one call that computes both (``addmm(other, a, b)``, where the add was), so the product has
    no buffer and no place of its own, and its operands live until the add."""
    fused = set(addmm_of.values())
    return [(name, inst) for name, inst in instances if inst not in fused]


__all__ = ["addmm_fusions", "products_kept_apart", "without_fused_products"]
