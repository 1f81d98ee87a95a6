"""remat.pareto: one trace, a plan per budget, the knee marked."""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat.pareto_curve import render_table


class Tanh8(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_pareto_traces_once_and_orders_points():
    torch.manual_seed(0)
    model = Tanh8()
    x = torch.randn(2048, 128)
    curves = remat.pareto(model, (x,), n_points=6, hardware="h100")
    assert len(curves) == 1
    curve = curves[0]
    points = curve.points
    assert len(points) >= 3
    peaks = [p.predicted_peak_bytes for p in points]
    times = [p.est_extra_time_s for p in points]
    assert peaks == sorted(peaks, reverse=True), "points run from the largest budget down"
    assert all(p.predicted_peak_bytes <= p.budget_bytes for p in points)
    assert times[-1] > times[0], "the smallest peak costs more recompute time than the largest"
    assert sum(p.is_knee for p in points) == 1
    assert curve.min_feasible_bytes <= peaks[-1] or curve.min_feasible_bytes <= points[-1].budget_bytes
    table = render_table(curve)
    assert "knee" in table and "predicted, not measured" in table
    # The trace leaves no gradients behind.
    assert all(p.grad is None for p in model.parameters())


def test_pareto_plans_each_budget_with_the_backends_headroom_when_asked():
    """headroom_fraction=None: a point's budget is what remat.backend is passed, its plan meets the
    budget less the device's headroom (5% on the CPU); the default (0.0) plans each budget as its target."""
    from remat.options import DEFAULT_HEADROOM_BY_DEVICE, target_for_budget

    torch.manual_seed(0)
    model = Tanh8()
    x = torch.randn(2048, 128)
    plain = remat.pareto(model, (x,), n_points=4, hardware="h100")[0]
    held = remat.pareto(model, (x,), n_points=4, hardware="h100", headroom_fraction=None)[0]
    headroom = DEFAULT_HEADROOM_BY_DEVICE["cpu"]
    assert all(p.predicted_peak_bytes <= target_for_budget(p.budget_bytes, headroom) for p in held.points)
    # the same targets, so the same plans: each budget is the smallest whose target is plain's budget
    assert [p.predicted_peak_bytes for p in held.points] == [p.predicted_peak_bytes for p in plain.points]
    assert [target_for_budget(p.budget_bytes, headroom) for p in held.points] == [p.budget_bytes for p in plain.points]
    assert min(p.budget_bytes for p in held.points) > min(p.predicted_peak_bytes for p in held.points)
