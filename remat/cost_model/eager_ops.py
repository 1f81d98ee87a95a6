"""Families of ops that eager PyTorch runs far below the roofline, and their measured cost.

The roofline charges a loop op its bytes at the memory bandwidth. Eager kernels of
some families run at a small fraction of that, on a CPU by one or two orders of
magnitude (2-core VM, one thread, per element: a copy 0.1 ns, ``var_mean`` 5 ns,
``where`` over a mostly-true mask 1 ns, ``any`` over bools 0.6 ns, a float-to-bool
comparison 0.35 ns), factories (``full``) parse a size and four options per call, and
prims whose eager implementation is Python pay tens of microseconds per call.
Each family here has one representative op; when a profile is measured, it is
timed at two sizes (best of seven, like every profile number) and the profile
keeps a fixed cost and a cost per element, fitted through the two.

``eager_time_s`` is what the op costs run alone, eagerly: the cost model uses it
for ``unfused_time_s`` (never below the roofline). Inductor generates its own
loops for all of these ops, so the fused estimate the planner uses does not see it.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import fx

from .inductor_rules import WELFORD_OPS
from .tensors import concrete_int, iter_tensors, node_val, op_name, touched_numel

_LOW, _HIGH = 1 << 10, 1 << 16          # elements at the two sizes the families are timed
_ROW = 128                              # reductions run over rows of this many elements

_SELECT = {"where", "masked_fill"}
_BOOL_REDUCTIONS = {"any", "all"}
_CONVERTS = {"convert_element_type"}
_FACTORIES = {"full", "zeros", "ones", "empty", "scalar_tensor", "full_like", "zeros_like", "ones_like", "empty_like"}


def _representatives(device: torch.device) -> dict[str, Callable[[int], Callable[[], Any]]]:
    aten, prims = torch.ops.aten, torch.ops.prims

    def rows(n: int) -> torch.Tensor:
        return torch.randn(n // _ROW, _ROW, device=device)

    def welford(n: int) -> Callable[[], Any]:
        x = rows(n)
        return lambda: aten.var_mean.correction(x, [1], correction=0, keepdim=True)

    def compare(n: int) -> Callable[[], Any]:
        x = rows(n)
        return lambda: aten.gt.Scalar(x, 0.0)

    # masks as models have them: mostly one value (dropout keeps 90%, a causal mask is
    # structured); a 50/50 random mask mispredicts every branch and runs 5x slower
    def select(n: int) -> Callable[[], Any]:
        x, y = rows(n), rows(n)
        mask = torch.rand(n // _ROW, _ROW, device=device) > 0.1
        return lambda: aten.where.self(mask, x, y)

    def bool_reduction(n: int) -> Callable[[], Any]:
        mask = torch.zeros(n // _ROW, _ROW, dtype=torch.bool, device=device)   # no early exit: every element read
        return lambda: aten.any.dim(mask, 1)

    def convert(n: int) -> Callable[[], Any]:
        mask = rows(n) > 0
        return lambda: prims.convert_element_type.default(mask, torch.float32)

    def factory(n: int) -> Callable[[], Any]:
        return lambda: aten.full.default([n // _ROW, _ROW], 0.0, dtype=torch.float32, layout=torch.strided,
                                         device=device, pin_memory=False)

    def python_prim(n: int) -> Callable[[], Any]:
        return lambda: prims.iota.default(n, start=0, step=1, dtype=torch.int64, device=device, requires_grad=False)

    return {"welford": welford, "compare": compare, "select": select, "bool_reduction": bool_reduction,
            "convert": convert, "factory": factory, "python_prim": python_prim}


def measure_eager_classes(device: torch.device, time_best: Callable[[Callable[[], Any]], float]
                          ) -> tuple[tuple[str, float, float], ...]:
    """(family, fixed seconds, seconds per element) for each family, timed with ``time_best``.

    A family whose representative does not run on ``device`` is left out (the roofline stays).
    """
    out = []
    for name, make in _representatives(device).items():
        try:
            low, high = time_best(make(_LOW)), time_best(make(_HIGH))
        except RuntimeError:
            continue
        per_element = max(high - low, 0.0) / (_HIGH - _LOW)
        out.append((name, max(low - per_element * _LOW, 0.0), per_element))
    return tuple(out)


def eager_class(node: fx.Node) -> Optional[str]:
    """The family ``node`` belongs to, or None for an op the roofline describes."""
    if node.op != "call_function":
        return None
    name = op_name(node)
    if name in WELFORD_OPS:
        return "welford"
    if name in _SELECT:
        return "select"
    if name in _BOOL_REDUCTIONS:
        return "bool_reduction"
    if name in _CONVERTS:
        return "convert"
    if name in _FACTORIES:
        return "factory"   # parses a size, a fill value and four options before it writes anything
    if getattr(node.target, "namespace", "") == "prims":
        return "python_prim"
    outputs = list(iter_tensors(node_val(node)))
    floating_input = any(t.dtype.is_floating_point for a in node.all_input_nodes for t in iter_tensors(node_val(a)))
    if outputs and floating_input and all(t.dtype == torch.bool for t in outputs) \
            and torch.Tag.pointwise in getattr(node.target, "tags", ()):
        return "compare"   # floats in, bools out (gt, eq, isnan...); bool-to-bool logic runs at copy speed
    return None


def loop_numel(node: fx.Node) -> int:
    """Elements the op's loop runs over: the largest input or output it touches, at the size hint."""
    values = [node_val(node)] + [node_val(a) for a in node.all_input_nodes]
    return max((concrete_int(touched_numel(t)) for v in values for t in iter_tensors(v)), default=0)


def eager_time_s(classes: tuple[tuple[str, float, float], ...], node: fx.Node) -> float:
    """The fitted eager time of ``node``'s family (0.0 when it has none, or the profile has no fit for it)."""
    family = eager_class(node)
    if family is None:
        return 0.0
    for name, fixed_s, per_element_s in classes:
        if name == family:
            return fixed_s + per_element_s * loop_numel(node)
    return 0.0


__all__ = ["eager_class", "eager_time_s", "loop_numel", "measure_eager_classes"]
