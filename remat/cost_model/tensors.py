"""Facts about the tensors an FX node produces, read from ``node.meta["val"]``.

Sizes may be symbolic (``torch.SymInt``); every function here evaluates them at
their hint (the example value the graph was traced with).
"""

from __future__ import annotations

import operator
from typing import Any, Iterator

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import optimization_hint

# Ops with no data of their own: they allocate nothing and move no bytes.
_FREE_TARGETS = {operator.getitem}


def concrete_int(value: Any) -> int:
    """An int, or a SymInt evaluated at its hint."""
    if isinstance(value, torch.SymInt):
        return int(optimization_hint(value))
    return int(value)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (numel x itemsize), at the size hint."""
    return concrete_int(tensor.numel()) * tensor.element_size()


def value_nbytes(value: Any) -> int:
    return sum(tensor_nbytes(t) for t in iter_tensors(value))


def node_val(node: fx.Node) -> Any:
    return node.meta.get("val")


def is_tensor_node(node: fx.Node) -> bool:
    return any(True for _ in iter_tensors(node_val(node)))


def is_sym_node(node: fx.Node) -> bool:
    return isinstance(node_val(node), (torch.SymInt, torch.SymFloat, torch.SymBool))


def is_aliasing_op(node: fx.Node) -> bool:
    """True when the node's output shares storage with an input (views, getitem of views).

    Read from the op schema's alias annotations, so every view op is covered.
    """
    if node.op != "call_function":
        return False
    target = node.target
    if target in _FREE_TARGETS:
        return False  # getitem: handled by its producer
    schema = getattr(target, "_schema", None)
    if schema is None:
        return False
    return any(ret.alias_info is not None and not ret.alias_info.is_write for ret in schema.returns)


def is_mutating_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def op_tags(node: fx.Node) -> tuple:
    return tuple(getattr(node.target, "tags", ()))
