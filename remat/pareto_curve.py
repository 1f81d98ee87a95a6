"""A graph's memory/time trade-off: predicted peak vs predicted extra time per budget.

``curve_for_graph(facts, graph_index)`` plans one joint graph's facts at a range of budgets
and returns its ``ParetoCurve``, with the knee marked: the point farthest from the straight
line between the cheapest and the smallest-peak plan, in coordinates normalised to each axis's
range. ``render_table`` and ``plot_curve`` are what the dump writes. Pure over the facts and
the planner (``pipeline.plan_graph``): no tracing (``remat.pareto`` traces a model and calls this per graph).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .errors import BudgetInfeasibleError
from .passes.joint_graph import JointGraphFacts
from .options import smallest_budget_bytes
from .pipeline import PlanningRequest, budget_request, plan_graph
from .units import format_bytes, format_seconds


@dataclass(frozen=True)
class ParetoPoint:
    budget_bytes: int
    predicted_peak_bytes: int
    est_extra_time_s: float
    recompute_flops: int
    is_knee: bool = False


@dataclass(frozen=True)
class ParetoCurve:
    graph_index: int
    no_remat_peak_bytes: int
    min_feasible_bytes: int
    points: tuple[ParetoPoint, ...]       # largest budget first

    @property
    def knee(self) -> Optional[ParetoPoint]:
        return next((p for p in self.points if p.is_knee), None)


def _mark_knee(points: list[ParetoPoint]) -> list[ParetoPoint]:
    if len(points) < 3:
        return points
    peaks = [p.predicted_peak_bytes for p in points]
    times = [p.est_extra_time_s for p in points]
    span_m = (max(peaks) - min(peaks)) or 1
    span_t = (max(times) - min(times)) or 1.0
    xs = [(m - min(peaks)) / span_m for m in peaks]
    ys = [(t - min(times)) / span_t for t in times]
    (x0, y0), (x1, y1) = (xs[0], ys[0]), (xs[-1], ys[-1])
    norm = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5 or 1.0
    distance = [abs((y1 - y0) * x - (x1 - x0) * y + x1 * y0 - y1 * x0) / norm for x, y in zip(xs, ys)]
    knee = max(range(1, len(points) - 1), key=distance.__getitem__)
    return [ParetoPoint(**{**p.__dict__, "is_knee": i == knee}) for i, p in enumerate(points)]


def curve_for_graph(facts: JointGraphFacts, graph_index: int, budgets_bytes: Optional[Sequence[int]] = None,
                    n_points: int = 8, rule: Optional[PlanningRequest] = None) -> ParetoCurve:
    """Plan ``facts`` at each budget (default: ``n_points`` budgets whose targets run evenly from the
    smallest peak the planner reaches to the peak of the free min-cut, above which every budget gets
    the same plan); budgets no plan meets are left out. ``rule`` says how a budget is planned: its
    solver, and its headroom (``PlanningRequest.target_for``); default: greedy, each budget its own
    planning target (``pipeline.budget_request``)."""
    rule = rule or budget_request(None)

    def at(budget_bytes: int, best_effort: bool = False) -> PlanningRequest:
        return dataclasses.replace(rule, budget_bytes=budget_bytes, target_bytes=rule.target_for(budget_bytes),
                                   best_effort=best_effort)

    smallest = plan_graph(facts, at(1, best_effort=True))
    low, high = smallest.predicted_peak_bytes, smallest.mincut_peak_bytes
    if budgets_bytes is None:
        steps = max(n_points - 1, 1)
        targets = [int(high - (high - low) * i / steps) for i in range(n_points)]
        budgets_bytes = [smallest_budget_bytes(lambda b, t=t: rule.target_for(b) >= t, start_bytes=max(t, 1))
                         for t in targets]
    points = []
    seen_peaks: set[tuple[int, float]] = set()
    for budget in sorted(set(budgets_bytes), reverse=True):
        try:
            plan = plan_graph(facts, at(budget))
        except BudgetInfeasibleError:
            continue
        key = (plan.predicted_peak_bytes, plan.est_extra_time_s)
        if key in seen_peaks:
            continue
        seen_peaks.add(key)
        points.append(ParetoPoint(budget, plan.predicted_peak_bytes, plan.est_extra_time_s, plan.recompute_flops))
    return ParetoCurve(graph_index, smallest.no_remat_peak_bytes, low, tuple(_mark_knee(points)))


def render_table(curve: ParetoCurve, graph_name: Optional[str] = None) -> str:
    """The curve as a markdown table, titled with ``graph_name`` (default: "graph <graph_index>")."""
    name = graph_name or f"graph {curve.graph_index}"
    lines = [
        f"Pareto curve of {name}: no-remat peak {format_bytes(curve.no_remat_peak_bytes)}, "
        f"smallest feasible peak {format_bytes(curve.min_feasible_bytes)} (1 GB = 1e9 bytes; predicted, not measured)",
        "",
        "| budget | predicted peak | est. extra time | recompute FLOPs | |",
        "|---:|---:|---:|---:|---|",
    ]
    for p in curve.points:
        lines.append(f"| {format_bytes(p.budget_bytes)} | {format_bytes(p.predicted_peak_bytes)} | "
                     f"{format_seconds(p.est_extra_time_s)} | {p.recompute_flops:,} | {'knee' if p.is_knee else ''} |")
    return "\n".join(lines) + "\n"


def plot_curve(curve: ParetoCurve, path: Path, graph_name: Optional[str] = None) -> Optional[Path]:
    """Write a PNG of the curve (titled with ``graph_name``, default "graph <graph_index>") if matplotlib
    is installed; return its path, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p.predicted_peak_bytes / 1e6 for p in curve.points], [p.est_extra_time_s * 1e3 for p in curve.points], "o-")
    knee = curve.knee
    if knee is not None:
        ax.plot([knee.predicted_peak_bytes / 1e6], [knee.est_extra_time_s * 1e3], "r*", markersize=14, label="knee")
        ax.legend()
    ax.set_xlabel("predicted peak (MB, 1 MB = 1e6 bytes)")
    ax.set_ylabel("estimated extra time (ms)")
    ax.set_title(f"remat: {graph_name or f'graph {curve.graph_index}'}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["ParetoCurve", "ParetoPoint", "curve_for_graph", "plot_curve", "render_table"]
