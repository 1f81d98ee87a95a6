"""A gradient added to a scatter into zeros is scattered into instead.

An embedding's backward (the ``embedding_dense_backward`` decomposition) scatters its rows into a
fresh zero buffer: ``s = _unsafe_masked_index_put_accumulate(zeros, mask, [index], rows)``. A weight
read at several places (a tied LM head and token embedding; a T5's shared embedding, read by the
encoder, the decoder and the head) gets its gradient as the sum of its parts, ``add(a, s)``, and
Inductor computes a pointwise add whose one reader is pointwise inside that reader's kernel: along
a chain of such sums no partial sum is stored until the last one, at the end of the backward, so
every part stays live until then. On a drawn one-layer T5 (hf-1372) the head's product and the
decoder embedding's scatter (131 kB each) were both live through the whole encoder backward, where
its peak was; with Hugging Face's checkpointing, which splits that model at graph breaks, eager
autograd adds each part into ``.grad`` as it comes.

``accumulate_into_scatters`` rewrites ``add(a, s)`` (either order) into the same scatter with ``a``
in place of the zeros, ``_unsafe_masked_index_put_accumulate(a, mask, [index], rows)``: the sum is
made where the scatter's rows are, and the zero buffer is never made. Inductor lowers the
accumulating scatter as a copy of its first operand and a scatter into the copy (``lowering.
_unsafe_index_put``), so the copy can take ``a``'s buffer when ``a`` dies there.

Only in the backward (``joint_graph.backward_closure``, the facts' own rule), and only where nothing
else changes: ``s``'s zeros are a ``full`` of 0 read by ``s`` alone; ``a`` is computed in the graph
(not an input), read by the add alone, with the sum's shape and dtype, as ``s`` is; the add has no
``alpha``; and ``a`` comes before ``s`` in the graph's order. The new scatter takes ``s``'s place,
so it runs where ``s`` did: had ``a`` come after ``s``, the scatter would wait for it and hold its
rows (an embedding's gradient rows are batch x tokens x width, which can outweigh the weight)
instead of ``s``. The values are the same sum in another order: ``a + (0 + r1 + r2)`` becomes
``(a + r1) + r2`` per element, equal up to floating-point rounding (the gradients are compared with
plain Inductor's within the tests' tolerance, as recomputation's are).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import fx

from .._torch_shapes import sizes_known_equal
from .joint_graph import backward_closure

_aten = torch.ops.aten
_ADD = _aten.add.Tensor
_FULL = _aten.full.default
# accumulating scatters whose first operand is the buffer they add into
_MASKED_ACCUMULATE = _aten._unsafe_masked_index_put_accumulate.default
_INDEX_PUTS = (_aten.index_put.default, _aten._unsafe_index_put.default)


def _accumulates_into_first_operand(node: fx.Node) -> bool:
    if node.target is _MASKED_ACCUMULATE:
        return True
    if node.target in _INDEX_PUTS:
        accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
        return accumulate is True
    return False


def _val(node: object) -> Optional[torch.Tensor]:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _same_tensor_type(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, device and shape; a symbolic size counts as equal only when it is known to be (no
    guard is added to the graph's shape environment)."""
    return a.dtype == b.dtype and a.device == b.device and sizes_known_equal(a.shape, b.shape)


def _is_zeros_read_once(node: object) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is _FULL
            and len(node.args) > 1 and node.args[1] == 0 and len(node.users) == 1)


def _zero_scatter(node: object, total: torch.Tensor) -> bool:
    """``node`` is an accumulating scatter into zeros made for it, read by the add alone, of the sum's type."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and _accumulates_into_first_operand(node)):
        return False
    value = _val(node)
    return (value is not None and len(node.users) == 1 and _same_tensor_type(value, total)
            and _is_zeros_read_once(node.args[0]))


def _addend(node: object, total: torch.Tensor) -> bool:
    """``node`` can be scattered into: computed in the graph, read by the add alone, of the sum's type."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1):
        return False
    value = _val(node)
    return value is not None and _same_tensor_type(value, total)


def accumulate_into_scatters(graph: fx.Graph) -> int:
    """Rewrite each backward ``add(a, s)`` of an accumulating scatter ``s`` into zeros as the
    scatter into ``a`` (module docstring); return how many adds were rewritten.

    Requires a functional (AOTAutograd) joint graph; guarantees the graph still lints and computes
    the same sums up to rounding. A chain of sums is rewritten link by link: each rewritten
    scatter can be the ``a`` of the next add."""
    backward = backward_closure(graph)
    position = {node: i for i, node in enumerate(graph.nodes)}
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _ADD or node.name not in backward or node.kwargs:
            continue
        total = _val(node)
        if total is None or len(node.args) != 2:
            continue
        first, second = node.args
        for scatter, addend in ((second, first), (first, second)):
            if _zero_scatter(scatter, total) and _addend(addend, total) and position[addend] < position[scatter]:
                break
        else:
            continue
        zeros = scatter.args[0]
        with graph.inserting_before(scatter):
            summed = graph.call_function(scatter.target, (addend, *scatter.args[1:]), dict(scatter.kwargs))
        summed.meta.update(scatter.meta)
        summed.meta["val"] = total
        node.replace_all_uses_with(summed)
        graph.erase_node(node)
        graph.erase_node(scatter)
        graph.erase_node(zeros)
        backward.add(summed.name)
        position[summed] = position[scatter]
        changed += 1
    if changed:
        graph.lint()
    return changed


__all__ = ["accumulate_into_scatters"]
