"""The eager loss on a graph's outputs: reserved before any step ran, then measured.

Most training loops compile the model and compute the loss outside it (``F.cross_entropy(model(x), y)``): between
the compiled forward and the compiled backward, eager code holds the loss's tensors next to everything the forward
kept for the backward. A graph alone in its step plans for ``LOSS_OUTPUT_COPIES`` times its outputs there before
anything was measured (``passes.joint_graph.eager_loss_reserve_bytes``: a cross-entropy's log-softmax, its
gradient, and the logits' gradient), counted by the simulator and by Inductor's check alike. Measured on the zoo
GPT with an eager cross-entropy at 70% of plain Inductor's peak: without the reserve its first step measured 1.078x
the budget (the check saw 42.19 MB, the loss held 6.29 MB more); with it, 40,597,640 B against 40,597,632 B checked.

A loss that holds less (a weighted sum, a mean squared error: one copy, the outputs' gradient) then costs
recomputation for nothing, so the feedback loop measures what it held: its window marks where the forward returned
and where the backward started (``measure.StepWindow.mark_phase``, CPU), and what the loss held is the most the
window held between the two less what the graph held there (what was live when the forward returned, less the
outputs it returned: ``measured_eager_loss_bytes``). A plan measured within its budget whose loss held less than
its reserve by ``LOOSEN_FRACTION`` of the budget or more is re-planned for what the loss held (a plan Inductor's check
accepted where the simulator refused the budget keeps running, and the measurement is only stored: re-planned, the
simulator would refuse the budget again); a plan measured over
its budget by no more than its loss held above the reserve is re-planned for what the loss held too (an additive
correction: the excess is a fixed amount, which the loop's ``measured / predicted`` factor, scaling the whole plan,
under-corrects near the floor and over-corrects above it). Both corrections are stored (``eager_loss_correction``):
a later process plans for what the loss held from its first step. Any other excess is corrected as before
(``feedback_verdict.judge``). Not measured on CUDA (the reserve stands), nor in a window holding several runs of the
graph or next to accumulated gradients.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Iterable, Optional

import torch

from .feedback_store import Correction

# a plan whose loss held less than its reserve by this fraction of the budget or more is re-planned for what it held
LOOSEN_FRACTION = Fraction(2, 100)   # (exact: any budget, 1e308 included)
LOOSENED_ACTION = "re-planned: its eager loss held less than reserved"
TIGHTENED_ACTION = "re-planned: its eager loss held more than reserved"
# within the budget on a plan Inductor's check accepted where the simulator refused the budget: re-planned in this
# process, the simulator would refuse it again (its plan keeps running); a later process plans for what the loss held
STORED_ACTION = "within budget: its eager loss held less than reserved, stored for the next compile"


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage once (a tensor and its views count once)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def output_bytes(out: Any) -> int:
    """Bytes of the storages of the tensors requiring gradients among a compiled forward's outputs (a tensor, or
    a tuple or list of values), each storage once: what the forward handed its caller for the loss."""
    values = out if isinstance(out, (tuple, list)) else (out,)
    return storage_bytes(t for t in values if isinstance(t, torch.Tensor) and t.requires_grad)


def measured_eager_loss_bytes(between_bytes: Optional[tuple[int, int]], returned_bytes: int) -> Optional[int]:
    """What eager code held between the forward's return and the backward's start, above what the graph kept for
    its backward: the most live then (``StepWindow.between_bytes``) less what was live at the return without the
    outputs it returned (``returned_bytes``). None when the window did not mark both."""
    if between_bytes is None:
        return None
    at_return, most = between_bytes
    return max(most - (at_return - returned_bytes), 0)


def eager_loss_correction(record: Any, measured_bytes: Optional[int], peak_bytes: int,
                          step: int) -> Optional[tuple[str, Correction]]:
    """(action, correction) re-planning ``record``'s graph for the eager loss it measured (``measured_bytes``), or
    None. For a graph with a reserve (one alone in its step whose outputs feed a loss outside it), where its step
    (``peak_bytes``) measured within the budget and the loss held less than the reserve by ``LOOSEN_FRACTION`` of
    the budget or more (``LOOSENED_ACTION``; ``STORED_ACTION`` for a plan Inductor's check accepted where the
    simulator refused the budget: it keeps running, and the correction is for the next compile), or over the
    budget by no more than the loss held above the reserve
    (``TIGHTENED_ACTION``: what the loss held explains the whole excess). The correction keeps the factor and the
    step's use of the correction the plan was made under."""
    reserved, budget = getattr(record, "eager_loss_bytes", 0), record.plan.budget_bytes
    if measured_bytes is None or budget is None or not reserved:
        return None     # no reserve: a graph that computes its loss (what eager code holds is not a loss's)
    if peak_bytes <= budget and reserved - measured_bytes >= LOOSEN_FRACTION * budget:
        # the simulator's own plan: with less reserved its saved set still fits
        action = LOOSENED_ACTION if record.plan.fits_budget else STORED_ACTION
    elif budget < peak_bytes <= budget + measured_bytes - reserved:
        action = TIGHTENED_ACTION
    else:
        return None
    made_for = getattr(record, "correction", None)
    factor = made_for.factor if made_for is not None and not made_for.loosens else 1.0
    return action, Correction(factor, budget, record.plan.predicted_peak_bytes, peak_bytes, record.graph_id,
                              f"measured in this process: {record.graph_id} step {step}, whose eager loss held "
                              f"{measured_bytes} bytes where {reserved} were reserved", eager_loss_bytes=measured_bytes
                              ).keeping_step_use(made_for)


__all__ = ["LOOSEN_FRACTION", "LOOSENED_ACTION", "STORED_ACTION", "TIGHTENED_ACTION", "eager_loss_correction", "measured_eager_loss_bytes",
           "output_bytes"]
