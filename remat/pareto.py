"""The memory/time trade-off of a model: ``pareto(model, example_inputs)``.

Traces the model once (no code generation, no recompilation per point), plans every joint
graph at a range of budgets and returns one ``ParetoCurve`` per graph
(``remat/pareto_curve.py``: the curve of one graph's facts, its knee, its table and plot).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from .pareto_curve import ParetoCurve, ParetoPoint, curve_for_graph
from .pipeline import trace_joint_facts
from .units import gb_to_bytes


def pareto(model: Callable[..., Any], example_inputs: Sequence[Any], *, budgets_gb: Optional[Sequence[float]] = None,
           n_points: int = 8, hardware: str = "auto") -> list[ParetoCurve]:
    """Trace ``model`` once and return, per joint graph, predicted peak vs extra time over budgets.

    ``budgets_gb`` (decimal GB) defaults to ``n_points`` budgets spanning each graph's
    smallest reachable peak to the peak of its free min-cut plan. Points are predictions (simulated peak,
    estimated time on the hardware profile), not measurements.
    """
    budgets = None if budgets_gb is None else [gb_to_bytes(b) for b in budgets_gb]
    graphs = trace_joint_facts(model, example_inputs, hardware=hardware)
    return [curve_for_graph(facts, i, budgets, n_points) for i, facts in enumerate(graphs)
            if any(n.role == "backward" for n in facts.nodes.values())]


__all__ = ["ParetoCurve", "ParetoPoint", "pareto"]
