"""Costs as formulas in the shape symbols, for graphs traced with dynamic shapes.

Under ``torch._dynamo.mark_dynamic`` sizes in ``node.meta["val"]`` are SymInts
(``s0``, ``s1``, ...). The functions here return the same FLOPs and bytes as
``flops.py`` / ``costs.py`` (op alone, unfused), as sympy expressions in those
symbols instead of numbers at the hint; ``evaluate`` turns one back into the
number the solver uses, and ``format_expr`` prints it for a person::

    >>> format_expr(node_bytes_written_expr(node), "bytes")
    '1536·s0·s1 bytes'

``largest_value_that_fits`` answers "how large may s0 get before this exceeds
the budget", for an expression that grows with the symbol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Union

import sympy
import torch
from torch import fx

from .. import _torch_shapes
from .flops import node_flops_value
from .tensors import is_free_op, iter_tensors, node_val, touched_numel

Number = Union[int, sympy.Expr]


def to_sympy(value: Any) -> sympy.Expr:
    """A SymInt's expression, or a plain number as a sympy Integer."""
    if isinstance(value, (torch.SymInt, torch.SymFloat)):
        return sympy.sympify(value.node.expr)
    return sympy.Integer(int(value))


def _tensor_bytes(tensors, numel: Callable[[torch.Tensor], Any]) -> sympy.Expr:
    total = sympy.Integer(0)
    for tensor in tensors:
        total += to_sympy(numel(tensor)) * tensor.element_size()
    return sympy.expand(total)


def node_flops_expr(node: fx.Node) -> sympy.Expr:
    """FLOPs of ``node`` as a formula (the same rule ``node_flops`` uses)."""
    return sympy.expand(to_sympy(node_flops_value(node).value))


def node_bytes_written_expr(node: fx.Node) -> sympy.Expr:
    """Bytes of ``node``'s outputs (0 for views and other free nodes)."""
    if is_free_op(node):
        return sympy.Integer(0)
    return _tensor_bytes(iter_tensors(node_val(node)), lambda t: t.numel())


def node_bytes_read_expr(node: fx.Node) -> sympy.Expr:
    """Distinct input bytes ``node`` touches when run alone (0 for free nodes)."""
    if is_free_op(node):
        return sympy.Integer(0)
    return _tensor_bytes((t for arg in node.all_input_nodes for t in iter_tensors(node_val(arg))), touched_numel)


@dataclass(frozen=True)
class SymbolicCost:
    flops: sympy.Expr
    bytes_read: sympy.Expr
    bytes_written: sympy.Expr


def node_cost_exprs(node: fx.Node) -> SymbolicCost:
    return SymbolicCost(node_flops_expr(node), node_bytes_read_expr(node), node_bytes_written_expr(node))


def shape_hints(graph: fx.Graph) -> dict[sympy.Symbol, int]:
    """Each shape symbol of the graph and the value it was traced with (read without a guard)."""
    shape_env = _torch_shapes.shape_env_of(graph)
    return _torch_shapes.traced_values(shape_env) if shape_env is not None else {}


def symbol_sources(graph: fx.Graph) -> dict[str, str]:
    """Each shape symbol and where it came from ("s0" -> "L['x'].size()[0]")."""
    shape_env = _torch_shapes.shape_env_of(graph)
    return _torch_shapes.source_names(shape_env) if shape_env is not None else {}


def evaluate(expr: Number, hints: Mapping[sympy.Symbol, int]) -> int:
    """The integer value of ``expr`` with every symbol replaced by its hint."""
    value = sympy.sympify(expr).subs(dict(hints))
    if value.free_symbols:
        raise ValueError(f"no hint for {sorted(map(str, value.free_symbols))} in {expr}")
    return int(value)


def _format_term(term: sympy.Expr) -> str:
    coefficient, factors = term.as_coeff_mul()
    parts = [] if coefficient == 1 else [str(coefficient)]
    for factor in sorted(factors, key=str):
        base, exp = factor.as_base_exp()
        if exp != 1 and base.is_Symbol:
            parts.append(f"{base}^{exp}")
        else:
            parts.append(str(factor).replace("*", "·"))
    return "·".join(parts) or "1"


def format_expr(expr: Number, unit: str = "") -> str:
    """A formula for a report: ``768*s0*s1`` -> "768·s0·s1", highest degree first, with ``unit`` appended."""
    expr = sympy.expand(sympy.sympify(expr))
    if expr.is_Add:
        def degree(term: sympy.Expr) -> tuple:
            return (-sum(sympy.degree_list(term)) if term.is_polynomial() and term.free_symbols else 0, str(term))
        terms = sorted(expr.args, key=degree)
        text = ""
        for i, term in enumerate(terms):
            negative = term.could_extract_minus_sign()
            body = _format_term(-term if negative else term)
            text += (("-" if negative else "") + body) if i == 0 else ((" - " if negative else " + ") + body)
    else:
        negative = expr.could_extract_minus_sign() and expr != 0
        text = ("-" if negative else "") + _format_term(-expr if negative else expr)
    return f"{text} {unit}".rstrip()


def largest_value_that_fits(expr: Number, symbol: sympy.Symbol, limit: float,
                            hints: Optional[Mapping[sympy.Symbol, int]] = None, *,
                            lowest: int = 1, highest: int = 1 << 40) -> Optional[int]:
    """The largest integer ``v`` in [lowest, highest] with ``expr(symbol=v) <= limit``.

    Other symbols take their ``hints``. Assumes ``expr`` does not decrease as
    ``symbol`` grows (sizes, bytes and FLOPs don't); returns None when even
    ``lowest`` does not fit.
    """
    others = {s: v for s, v in (hints or {}).items() if s != symbol}
    fn = sympy.lambdify(symbol, sympy.sympify(expr).subs(others), "math")

    def fits(v: int) -> bool:
        return float(fn(v)) <= limit

    if not fits(lowest):
        return None
    low, high = lowest, lowest
    while high < highest and fits(high):
        low, high = high, min(highest, high * 2)
    if fits(high):
        return high
    while high - low > 1:   # fits(low) and not fits(high)
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


__all__ = [
    "SymbolicCost", "evaluate", "format_expr", "largest_value_that_fits", "node_bytes_read_expr",
    "node_bytes_written_expr", "node_cost_exprs", "node_flops_expr", "shape_hints", "symbol_sources", "to_sympy",
]
