"""The exceptions remat raises.

    RematError                      base of everything remat raises on purpose
    ├── BudgetInfeasibleError       no plan's simulated peak fits the budget
    └── UnsupportedGraphError       the joint graph holds something remat cannot plan

Bad arguments at the API boundary raise the builtin ``ValueError`` / ``TypeError``
before any tracing, so they read like any other Python argument error.
"""

from __future__ import annotations


class RematError(RuntimeError):
    """Base class for errors raised by remat while planning or rewriting."""


class BudgetInfeasibleError(RematError):
    """The budget is below the smallest peak any plan reaches.

    ``min_feasible_bytes`` is the smallest simulated peak the solver found and
    ``reasons`` the largest contributors to it, each a sentence.
    """

    def __init__(self, message: str, *, budget_bytes: int, min_feasible_bytes: int, reasons: tuple[str, ...]) -> None:
        super().__init__(message)
        self.budget_bytes = budget_bytes
        self.min_feasible_bytes = min_feasible_bytes
        self.reasons = reasons


class UnsupportedGraphError(RematError):
    """The joint graph contains a construct the planner does not handle."""
