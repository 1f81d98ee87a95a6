"""The closed loop's decision on one measured step of one graph (pure: numbers in, a verdict out),
and what a graph's plan predicts for the runs a window held. ``feedback.VerifiedGraph`` measures;
this module judges.

``judge`` compares the measured peak with the plan's budget:

- at or under it: "within budget";
- over it: the simulator's error on this plan is ``factor = measured / predicted``. The graph is
  re-planned at ``base target / factor`` (the target without correction, i.e. the budget less
  its headroom), which is always below the target the plan was made at (the plan's predicted
  peak was at most that target and its measured peak over the budget), and recompiled from a
  copy of Dynamo's graph at its next call ("re-planned"). A warning gives the budget, the
  predicted and measured peaks, the factor and the new target. The new plan is measured again
  on its next step, for up to ``MAX_REPLANS`` re-plans ("over budget after N re-plans" then).
  If no plan meets the corrected target, that next call raises ``BudgetInfeasibleError`` naming
  the budget that would pass under the correction, or with ``best_effort=True`` warns and runs
  the smallest-peak plan;
- over it with a best-effort plan (already the smallest peak found): nothing smaller to try. A plan
  Inductor's check accepted where the simulator refused (``inductor_verdict.overrule_refusal``) is not
  best effort: it was accepted as meeting the budget, and a measured overshoot re-plans it like any
  other (measured on a drawn LM under bf16 autocast, rand-1385, whose eager loss allocates 1.5 MB the
  graphs cannot see: 2.3x its budget on every step while the loop took it for best effort);
- over it on a graph with dynamic shapes, or one planned under DDP/FSDP2's step ledger: the
  correction is stored and applies from the next compile of that graph ("stored for the next
  compile"), since recompiling in place would bypass Dynamo's guards or the step's ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

MAX_REPLANS = 3     # re-plans of one graph by the loop before it gives up and warns
# the event of a re-plan made before a call (or a step) whose parameters held gradients its plans were not made next to
FORESEEN_ACTION = "re-planned next to accumulated gradients before running"


@dataclass(frozen=True)
class FeedbackEvent:
    """What the loop concluded from one measured step of one graph (bytes; 1 GB = 1e9 bytes).

    ``step`` counts the calls of this compiled graph from 0 (re-plans included). ``action``:
    "within budget", "re-planned", "infeasible", "over budget: best-effort plan",
    "over budget after N re-plans", "stored for the next compile", "re-plan failed", "not measured: <why>",
    "re-planned: its eager loss held less than reserved" / "... more than reserved", "within budget: its eager loss
    held less than reserved, stored for the next compile" (``eager_loss.eager_loss_correction``)
    (``measured_peak_bytes`` None; None too for "infeasible" when the refusal was foreseen before the call ran:
    ``Correction.foreseen``). ``factor`` is
    ``measured / predicted`` when over budget; ``new_target_bytes`` the target it re-plans at.
    """

    graph_id: str
    step: int
    budget_bytes: Optional[int]
    predicted_peak_bytes: int
    measured_peak_bytes: Optional[int]
    factor: Optional[float]
    action: str
    new_target_bytes: Optional[int] = None
    runs: int = 1      # the graph's runs the measured window held (several: they stacked in one step)
    # gradients of the step its parameters held at the window's entry (gradient accumulation): counted in both peaks
    accumulated_grad_bytes: int = 0


@dataclass(frozen=True)
class Verdict:
    action: str
    factor: Optional[float] = None
    new_target_bytes: Optional[int] = None


def judge(budget_bytes: Optional[int], base_target_bytes: Optional[int], predicted_peak_bytes: int,
          measured_peak_bytes: int, fits_budget: bool, replans_done: int, can_recompile: bool) -> Verdict:
    """The loop's decision on one measured step (pure: numbers in, a verdict out).

    Over budget, ``factor = measured / predicted`` and the new target is ``base_target / factor``;
    it is below any target a plan that met its target and measured over the budget was made at."""
    if budget_bytes is None or measured_peak_bytes <= budget_bytes:
        return Verdict("within budget")
    factor = measured_peak_bytes / max(predicted_peak_bytes, 1)
    assert base_target_bytes is not None
    new_target = min(base_target_bytes, int(base_target_bytes / factor))
    if not fits_budget:
        return Verdict("over budget: best-effort plan", factor)
    if not can_recompile:
        return Verdict("stored for the next compile", factor, new_target)
    if replans_done >= MAX_REPLANS:
        return Verdict(f"over budget after {replans_done} re-plans", factor)
    return Verdict("re-planned", factor, new_target)


def planned_runs(record: Any) -> int:
    """The runs per step ``record``'s plan was made for (its share of kind "runs", ``runs_share.runs_share``)."""
    share = getattr(record, "step_share", None)
    return share.repeats if share is not None and share.kind == "runs" else 1


def stacked_prediction(record: Any, runs: int, accepted: bool = False) -> int:
    """The predicted peak of ``runs`` runs of ``record``'s plan stacked in one step (each earlier run holding its
    saved values and activation inputs: ``runs_share.stacked_peak_bytes``); its plan's peak for one run. With
    ``accepted``, from the peak the plan was accepted on (``accepted_peak_bytes``), else its simulated one."""
    from .runs_share import stacked_peak_bytes

    plan = record.plan
    peak = accepted_peak_bytes(record) if accepted else plan.predicted_peak_bytes
    if runs <= 1:
        return peak
    inputs, grads = getattr(record, "input_activation_bytes", 0), getattr(record, "param_grad_bytes", 0)
    return stacked_peak_bytes(plan.saved_bytes + inputs, inputs, grads, peak, runs)


def accepted_peak_bytes(record: Any) -> int:
    """The peak ``record``'s plan was accepted on: Inductor's checked peak where the check accepted it, else the
    simulated one."""
    judgement = getattr(record, "judgement", None)
    if judgement is not None and judgement.action.startswith("accepted") and judgement.checked_peak_bytes is not None:
        return judgement.checked_peak_bytes
    return record.plan.predicted_peak_bytes


def accepted_as_fitting(record: Any) -> bool:
    """Whether the graph's plan was accepted as meeting its budget: by the simulator (``fits_budget``) or
    by Inductor's check (a ``Judgement`` whose action starts with "accepted", an overruled refusal
    among them); else it runs as best effort."""
    judgement = getattr(record, "judgement", None)
    return record.plan.fits_budget or (judgement is not None and judgement.action.startswith("accepted"))
