"""The exceptions remat raises.

    RematError                      base of everything remat raises on purpose
    └── BudgetInfeasibleError       no plan's simulated peak fits the budget

Bad arguments at the API boundary raise the builtin ``ValueError`` / ``TypeError``
before any tracing, so they read like any other Python argument error.
"""

from __future__ import annotations

from typing import Any

from .units import format_gb_up


class RematError(RuntimeError):
    """Base class for errors raised by remat while planning or rewriting."""


class BudgetInfeasibleError(RematError):
    """The budget is below the smallest budget any plan is accepted at.

    - ``budget_bytes``: the budget that was refused.
    - ``min_budget_bytes``: the budget to pass: the smallest budget (whole bytes) at which the
      refused graph is accepted, by the same rule that refused it (the planning target of a
      budget is the budget less its headroom, and under DDP / FSDP2 the graph's share of it).
      ``min_budget_gb`` is the same figure in decimal GB, rounded up as the message prints it:
      ``remat.backend(budget_gb=error.min_budget_gb)`` plans that graph. (Under DDP a later
      piece, not yet compiled when the error is raised, may still ask for more.)
    - ``min_feasible_bytes``: the smallest simulated peak the planner reached for that graph
      (what the plan peaks at, not a budget: the budget must add the headroom on top).
    - ``reasons``: the largest contributors to that peak, each a sentence.
    - ``best_effort_plan``: the plan ``best_effort=True`` runs at this budget (the smallest-peak plan,
      ``fits_budget`` False), where the planner that refused made it; else None.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int, min_budget_bytes: int,
                 reasons: tuple[str, ...], best_effort_plan: Any = None) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.min_budget_bytes = min_budget_bytes
        self.reasons = reasons
        self.best_effort_plan = best_effort_plan

    @property
    def min_budget_gb(self) -> float:
        """``min_budget_bytes`` in decimal GB, rounded up as printed in the message."""
        return float(format_gb_up(self.min_budget_bytes))


def raise_budget_hint(min_budget_bytes: int) -> str:
    """The sentence an infeasibility message ends with; the GB figure is rounded up
    (``units.format_gb_up``), so passing it back as ``budget_gb`` is accepted."""
    return (f"Raise the budget to at least {format_gb_up(min_budget_bytes)} GB (1 GB = 1e9 bytes; "
            f"{min_budget_bytes:,} bytes), or pass best_effort=True to run the smallest-peak plan anyway.")

