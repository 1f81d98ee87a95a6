"""Facts about the tensors an FX node produces, read from ``node.meta["val"]``.

Sizes may be symbolic (``torch.SymInt``); every function here evaluates them at
their hint (the example value the graph was traced with), or, inside
``sizes_evaluated_at(values)``, at the values given for the shape symbols: the
whole cost model and the facts the planner reads then describe the graph at
that size (``remat.sizing`` searches sizes this way; ``remat.dynamic`` plans a
dynamic graph at its largest sizes). None of them adds a guard to the ShapeEnv:
sizes are read as numbers (``concrete_int``), never compared as SymInts, so
planning never specialises a dynamic graph.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Any, Iterator, Mapping, Optional

import sympy
import torch
from torch import fx

from .._torch_shapes import hint_of

try:
    from torch.fx.experimental.symbolic_shapes import optimization_hint
except ImportError:  # torch < 2.13 names it hint_int (static shapes never reach it)
    from torch.fx.experimental.symbolic_shapes import hint_int as optimization_hint

# Ops with no data of their own: they allocate nothing and move no bytes.
_FREE_TARGETS = {operator.getitem}


class _SizePoint:
    """Values for shape symbols, and the integers already worked out at them."""

    def __init__(self, values: Mapping[Any, int]) -> None:
        self.values = {str(sym): sympy.Integer(int(v)) for sym, v in values.items()}   # by name: assumptions differ
        self.cache: dict[Any, int] = {}

    def evaluate(self, value: torch.SymInt) -> int:
        expr = sympy.sympify(value.node.expr)
        if expr not in self.cache:
            result = expr.xreplace({s: self.values[s.name] for s in expr.free_symbols if s.name in self.values})
            if result.free_symbols:  # a symbol the caller gave no value for: its hint, read without a guard
                result = hint_of(value.node.shape_env, result)
            self.cache[expr] = int(result)
        return self.cache[expr]


_SIZE_POINT: contextvars.ContextVar[Optional[_SizePoint]] = contextvars.ContextVar("remat_size_point", default=None)


@contextlib.contextmanager
def sizes_evaluated_at(values: Mapping[Any, int]) -> Iterator[None]:
    """Within the block, ``concrete_int`` evaluates a SymInt with these values for its
    shape symbols (keys: sympy symbols or their names, "s0"); symbols not given take
    their hint. Outside it, sizes evaluate at their hint."""
    token = _SIZE_POINT.set(_SizePoint(values))
    try:
        yield
    finally:
        _SIZE_POINT.reset(token)


def concrete_int(value: Any) -> int:
    """An int, or a SymInt evaluated at its hint (or at ``sizes_evaluated_at``'s values)."""
    if isinstance(value, torch.SymInt):
        point = _SIZE_POINT.get()
        if point is not None:
            return point.evaluate(value)
        return int(optimization_hint(value))
    return int(value)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)


def has_symbolic_shapes(values: Any) -> bool:
    """Whether any of ``values`` (a compile's example inputs, or nodes' ``meta["val"]``) is a ``SymInt``
    or a tensor with a symbolic size: dynamic shapes, which remat plans at their planned sizes and does
    not cache; recompiled in place only in a step of several graphs, as static code for one call's sizes
    (``size_dispatch.py``)."""
    return any(isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt)
                                                                                  for d in v.shape))
               for v in values)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's elements (numel x itemsize), at the size hint."""
    return concrete_int(tensor.numel()) * tensor.element_size()


def value_nbytes(value: Any) -> int:
    return sum(tensor_nbytes(t) for t in iter_tensors(value))


def touched_numel(tensor: torch.Tensor) -> Any:
    """Distinct elements a kernel reading ``tensor`` touches: dims with stride 0 count once.

    An ``expand``-ed bias of shape (B, S, D) with strides (0, 0, 1) touches D
    elements, not B·S·D. An int, or a SymInt under dynamic shapes.
    """
    if concrete_int(tensor.numel()) == 0:   # not ``numel() == 0`` on a SymInt: that would add a guard
        return 0
    count: Any = 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        if isinstance(stride, int) and stride == 0:
            continue
        count = count * size
    return count


def touched_nbytes(tensor: torch.Tensor) -> int:
    """Bytes a kernel reads from ``tensor``'s storage (``touched_numel`` x itemsize), at the size hint."""
    return concrete_int(touched_numel(tensor)) * tensor.element_size()


def value_touched_nbytes(value: Any) -> int:
    return sum(touched_nbytes(t) for t in iter_tensors(value))


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


# Ops that return a new tensor object over the same memory but whose schema carries
# no alias annotation: ``_unsafe_view`` is the view functionalization emits after a
# fresh temporary; it copies nothing.
_NO_COPY_NAMES = {"_unsafe_view"}


def aliases_input(node: fx.Node) -> bool:
    """True when the node's tensor output is its first tensor input's memory: a view or alias
    by its schema (``is_aliasing_op``), or ``_unsafe_view``, whose schema says nothing."""
    return node.op == "call_function" and (is_aliasing_op(node) or op_name(node) in _NO_COPY_NAMES)


def is_free_op(node: fx.Node) -> bool:
    """True when running the node moves no bytes and launches no kernel.

    Placeholders, outputs, getitems, views and aliases (``is_aliasing_op``),
    ``_unsafe_view``, and ops that produce no tensor (``sym_size``, Python
    arithmetic on SymInts) are free.
    """
    if node.op != "call_function" or node.target in _FREE_TARGETS:
        return True
    if getattr(node.target, "overloadpacket", None) is None:
        return True  # a Python builtin (operator.mul on SymInts): no tensor work
    if "val" in node.meta and not is_tensor_node(node) and not is_mutating_op(node):
        return True  # sym_size, sym_numel, ...: reads metadata, computes no tensor
    return is_aliasing_op(node) or op_name(node) in _NO_COPY_NAMES


def op_name(node: fx.Node) -> str:
    """The aten op's short name ("mm", "native_layer_norm"), or the target's name."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__.split(".")[-1]
    return getattr(node.target, "__name__", str(node.target))


def is_mutating_op(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def op_tags(node: fx.Node) -> tuple:
    return tuple(getattr(node.target, "tags", ()))
