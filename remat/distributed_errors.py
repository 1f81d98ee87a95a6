"""A graph's infeasible budget restated for the whole distributed step: the smallest per-rank budget
whose share for that graph holds the smallest peak the planner reached (``restate_infeasible``), and
the budget that gives a step target (``budget_for_step_target``), and the refusal of a graph's share
of a step at graph breaks with the plan its named budget rests on (``ShareInfeasibleError``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from .errors import BudgetInfeasibleError, raise_budget_hint
from .options import smallest_budget_bytes
from .units import format_bytes, format_gb_up

if TYPE_CHECKING:
    from .distributed import GraphShare


class ShareInfeasibleError(BudgetInfeasibleError):
    """No plan is admitted under a graph's share of its process's step (``distributed.JUDGED_SHARE_KINDS``): the
    error the user sees, plus ``named_plan``, the plan of the near-smallest candidates whose
    admission the named budget rests on (what it holds is the caller's ``held_of(named_plan)``).
    The backend compiles that plan so Inductor's check can name the budget from its generated
    code's peak instead of the simulated one (``inductor_verdict.named_budget_after_check``)."""

    def __init__(self, error: BudgetInfeasibleError, named_plan: Any) -> None:
        super().__init__(str(error), budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes,
                         min_budget_bytes=error.min_budget_bytes, reasons=error.reasons)
        self.named_plan = named_plan


def budget_for_step_target(step_target_bytes: int, target_for_budget: Callable[[int], int]) -> int:
    """The smallest budget (bytes) whose step target by ``target_for_budget`` (the backend's rule:
    ``RematOptions.planning_target_for``, the budget less its headroom) is at least
    ``step_target_bytes``: the budget a user passes to get that step target."""
    return smallest_budget_bytes(lambda b: target_for_budget(b) >= step_target_bytes, start_bytes=step_target_bytes)


def restate_infeasible(error: BudgetInfeasibleError, share: Optional["GraphShare"], budget_bytes: Optional[int],
                       target_for_budget: Callable[[int], int], loose: bool = False) -> BudgetInfeasibleError:
    """The planner's infeasibility error for a graph planned under a share, restated for the
    whole step: the smallest per-rank budget whose share for this graph holds the smallest
    peak the planner reached (``error`` itself if the graph had no share).

    A share is an affine function of the step target, which ``target_for_budget`` makes of a
    budget, so both are solved here (bisections). Later pieces may need more: a budget this
    error names can still fail at a later piece.
    """
    if share is None or budget_bytes is None or share.target_bytes <= 0:
        return error
    peak = error.min_feasible_bytes
    step_target = share.smallest_step_target_bytes(peak, loose=loose)
    minimum = budget_for_step_target(step_target, target_for_budget)
    message = (
        f"{'' if share.in_step else 'per-rank '}budget {format_bytes(budget_bytes)} is below the smallest feasible "
        f"budget {format_gb_up(minimum)} GB "
        f"for this graph ({share.explain().split('. ')[0]}): "
        f"its smallest simulated peak is {format_bytes(peak)}, "
        f"and its share of a budget grows as {format_bytes(share.target_bytes)} does at {format_bytes(budget_bytes)}. "
        "Inside that peak: " + "; ".join(error.reasons) + ". " + raise_budget_hint(minimum)
    )
    return BudgetInfeasibleError(message, budget_bytes=budget_bytes, min_feasible_bytes=peak, min_budget_bytes=minimum,
                                 reasons=error.reasons)


__all__ = ["ShareInfeasibleError", "budget_for_step_target", "restate_infeasible"]
