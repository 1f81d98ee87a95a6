"""The memory/time trade-off of a model: ``pareto(model, example_inputs)``.

Traces the model once (no code generation, no recompilation per point), plans every joint
graph at a range of budgets as the backend would (``pipeline.request_for``: its solver and
headroom) and returns one ``ParetoCurve`` per graph (``remat/pareto_curve.py``: the curve of one graph's facts, its knee, its table and plot).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .options import make_options
from .pareto_curve import ParetoCurve, ParetoPoint, curve_for_graph
from .pipeline import prepare_graph, request_for, trace_joint_facts
from .units import gb_to_bytes


def pareto(model: Callable[..., Any], example_inputs: Sequence[Any], *, budgets_gb: Optional[Sequence[float]] = None,
           n_points: int = 8, hardware: str = "auto", solver: str = "greedy",
           headroom_fraction: Optional[float] = 0.0) -> list[ParetoCurve]:
    """Trace ``model`` once and return, per joint graph, predicted peak vs extra time over budgets.

    ``budgets_gb`` (decimal GB) defaults to ``n_points`` budgets spanning each graph's
    smallest reachable peak to the peak of its free min-cut plan. Points are predictions (simulated peak,
    estimated time on the hardware profile), not measurements. Each budget is planned as
    ``remat.backend(budget_gb, solver=solver, headroom_fraction=headroom_fraction)`` plans it (before any
    check against Inductor or the measured step): ``headroom_fraction=0.0`` (the default) makes each
    budget its own planning target; None takes the backend's default for the graph's device (5% on the
    CPU, 15% elsewhere), so a point's budget is the ``budget_gb`` that gets its plan.
    """
    options = make_options(None, hardware=hardware, solver=solver, headroom_fraction=headroom_fraction)
    budgets = None if budgets_gb is None else [gb_to_bytes(b) for b in budgets_gb]
    graphs = trace_joint_facts(model, example_inputs, hardware=hardware,
                               read=lambda joint, inputs, n: prepare_graph(joint, inputs, n, hardware))
    return [curve_for_graph(g.facts, i, budgets, n_points, rule=request_for(options, g))
            for i, g in enumerate(graphs) if g.has_backward]


__all__ = ["ParetoCurve", "ParetoPoint", "pareto"]
