"""A graph's plan under its share of a step split at graph breaks (``remat/step_budget.py``), and
the plans taken while the step's later graphs are unknown (step 1): a graph a graph break follows
takes its leanest plan, the one under which the step admits the most later graphs like it
(``copies_admitted``), and so does a graph whose outputs eager code reads while earlier graphs are
pending (``eager_code_follows``: a loss outside the model); the frame's last graph, when no plan fits
next to what the earlier graphs hold, its smallest-peak plan. Either is re-planned once the step completes. After planning, a graph's numbers go on
the step's account (``note_step_plan``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .distributed import PROVISIONAL_SHARE_KINDS, GraphShare
from .errors import BudgetInfeasibleError
from .step_budget import StepAccount, slot_of
from .step_graph import StepGraph

if TYPE_CHECKING:
    from torch import fx

log = logging.getLogger("remat")


# said by a refusal in a step's first run (``_said_provisional``)
PROVISIONAL_NOTE = (" This step's later graphs are not compiled yet (its first run has not reached them), so the budget "
                    "named is what the graphs compiled so far need: a retry at it can be refused again, naming more.")


def fit_in_step(share: GraphShare, fit: "Callable[[GraphShare], tuple[Any, GraphShare]]",
                plan_at: "Callable[..., Any]", held_of: "Callable[[Any], int]",
                budget_bytes: Optional[int] = None) -> tuple[Any, GraphShare]:
    """``fit(share)`` (``distributed_fit.fit_plan``), except while the step's graphs are unknown.
    A graph a graph break follows, or whose outputs eager code reads (kind "break-smallest"), takes
    ``leanest_plan`` outright, with ``reserve_met`` False: the later graphs or that code, what they
    hold and their gradients are unknown, so it takes the least room it can. A graph of kind "break-partial" (no break follows in its frame)
    that no plan fits next to what the earlier graphs hold takes its smallest-peak plan. Either is
    re-planned once its step completes (``StepGraph.provisional``). Elsewhere the error stands (it
    names the budget that fits).

    Except where even that plan's own run, next to what is live before it (the earlier graphs' held values,
    its activation inputs), is predicted over ``budget_bytes`` itself (``runs_over_next_to_live``): step 1 would
    run over the budget, whatever the later graphs are, so the budget is refused at once by ``fit(share)``'s
    error, before the step runs (a Hugging Face GPT-2 with a 32,000-token vocabulary, split before its loss:
    the loss graph's plan peaked at 65.5 MB next to its 65.5 MB of logits, and step 1 ran ~1.5x an 86.8 MB
    budget before the second step refused it, naming 138.3 MB). Over the step target but within the budget,
    the plan runs and the second step's re-plans decide (the earlier graphs' re-plans may hold less, and the
    budget then fits: a refusal there named a budget 0.3% over one that fits). The name such a refusal gives
    is what this graph needs next to the earlier graphs' step-1 plans; the second step's re-plan, next to the
    later graphs' gradients and its earlier graphs' re-plans, may name slightly more (docs/budget.md). The
    first graph of a step has nothing live before it: Inductor's check judges its plan against the step
    target (``judge_loop``), as any graph's."""
    if share.kind == "break-smallest":
        plan = leanest_plan(plan_at, held_of, lambda p: copies_admitted(share, held_of(p), p.predicted_peak_bytes))
        if runs_over_next_to_live(share, held_of(plan), plan.predicted_peak_bytes, budget_bytes):
            try:
                return fit(share)    # raises naming the budget the step needs; a plan it admits is taken
            except BudgetInfeasibleError as error:
                raise _said_provisional(error) from None
        log.info("remat: graph %d of the first step takes its leanest plan until the step's graphs are known "
                 "(a graph break, or eager code reading its outputs, follows it)", share.index + 1)
        return plan, replace(share, target_bytes=plan.target_bytes or 0, reserve_met=False)
    try:
        return fit(share)
    except BudgetInfeasibleError as error:
        if share.kind != "break-partial":
            raise
        refused = asked = error
    for _ in range(3):   # the smallest peak an error names plans; a rounding can ask once more
        try:
            plan = plan_at(max(asked.min_feasible_bytes, 1))
        except BudgetInfeasibleError as again:
            # raised only as ``refused``, the share's error: this search's own names a budget by a lone graph's rule
            # (rand-brk-1535's dynamic third graph: "budget 274.96 kB is below the smallest feasible budget 159.7 kB")
            asked = again
            continue
        if runs_over_next_to_live(share, held_of(plan), plan.predicted_peak_bytes, budget_bytes):
            raise _said_provisional(refused)
        log.info("remat: graph %d of the first step fits no plan next to the earlier graphs; smallest-peak plan "
                 "taken until the step's graphs are re-planned", share.index + 1)
        return plan, replace(share, target_bytes=plan.target_bytes or 0, reserve_met=False)
    raise _said_provisional(refused)


def _said_provisional(error: BudgetInfeasibleError) -> BudgetInfeasibleError:
    """``error`` (its class and numbers kept) saying that the budget it names is for the graphs compiled so far: a
    refusal in a step's first run, whose later graphs Dynamo has not reached yet (a retry at it can be refused again,
    naming more: docs/limitations.md, "Graph breaks", gap (c))."""
    if error.args and PROVISIONAL_NOTE not in str(error.args[0]):
        error.args = (f"{error.args[0]}{PROVISIONAL_NOTE}",) + error.args[1:]
    return error


def runs_over_next_to_live(share: GraphShare, held_bytes: int, peak_bytes: int, budget_bytes: Optional[int]) -> bool:
    """Whether something is live before this graph runs (earlier graphs' held values, its activation inputs) and
    a plan holding ``held_bytes`` and peaking at ``peak_bytes`` (simulated) runs over ``budget_bytes`` next to it:
    ``GraphShare.own_run_bytes`` (all its runs, with the gradients and bytes outside the step's graphs: ``admits``'
    first condition), against the budget rather than the step target.
    False with no budget (the backend passes none under ``best_effort=True``, which runs over rather than refuse),
    and for a graph with nothing live before it (the first of its step), whose plan Inductor's check judges
    against the step target."""
    if budget_bytes is None or share.held_before_bytes + share.input_activation_bytes <= 0:
        return False
    return share.own_run_bytes(held_bytes, peak_bytes) > budget_bytes


MAX_COPIES = 64   # copies_admitted stops counting here (a plan that holds nothing and has no gradients)


def copies_admitted(share: GraphShare, held_bytes: int, peak_bytes: int) -> int:
    """How many graphs like this one a step could run, this one first, with this one's plan
    (holding ``held_bytes`` for its backward, peaking at ``peak_bytes``) after the earlier graphs
    (``share``: what they hold, this graph's inputs, the step target): with ``n`` of them, this
    graph's backward runs after the ``n - 1`` later ones produced their gradients (this graph's
    ``own_grad_bytes`` each), and the last one peaks as this one does while this one and the
    ``n - 2`` between hold ``held_bytes`` each (the condition of the module docstring, at its two
    ends; the graphs between lie on the line joining them). 0 when this graph's own run alone
    breaks the step target; at most ``MAX_COPIES``. With the later graphs unknown (step 1, a graph
    break follows), this is the plan's margin: it grows as what the plan holds and its peak fall."""
    base = share.held_before_bytes + share.input_activation_bytes + peak_bytes
    n = 0
    while n < MAX_COPIES and base + n * max(share.own_grad_bytes, held_bytes) <= share.step_target_bytes:
        n += 1
    return n


def leanest_plan(plan_at: "Callable[..., Any]", held_of: "Callable[[Any], int]",
                 copies: "Callable[[Any], int]" = lambda plan: 1) -> Any:
    """The candidate plan that admits the most graphs like this one in the step (``copies``, ``copies_admitted``), then
    the least ``held + peak``. The candidates: the plans near the smallest simulated peak
    (``distributed_search.near_smallest``) and the plans saving least at the first and the last of those targets
    (cap 0 saved), searched one pass first (``saved_cap_search="one-pass-first"``,
    ``held_cap.reduce_saved_bytes``): this plan runs one step, so its recompute time counts for little, and what it
    holds decides the step's floor (hf-1497, a drawn GPT-2 split before its loss, on the 2-core VM: the greedy alone
    took 2.1 and 6.4 s for the two caps, this search 1.8 and 1.8 s, both holding 0.86 MB; one pass alone held 1.11
    MB, and the floor named rose 10%). Why both ends: at the smallest peak's target alone a lower smallest peak can
    leave only plans holding much. Why copies: the later graphs are unknown, so each is taken to be like this one
    (its plan, its gradients); the step then fits with as many of them as the plan admits, and what this graph holds
    and its peak both count (a plan whose own run breaks the step target admits none and is taken only where nothing
    else is: GPT-2's body at a 5.26 MB budget, whose least ``held + peak`` peaked 7% over the step target, measured
    1.07x the budget in step 1). The pair rule it replaces (least ``held + peak``, the next graph taken to peak like
    this one, now the tie-break) ignored the third graph: the 2-break dropout MLP of tests/test_graph_breaks.py took
    a plan holding 1.57 MB at a 2.62 MB peak in its first graph (2 such graphs fit the 5.54 MB step target) over one
    holding 0.79 MB at 3.54 MB (3 fit), and its first step measured 6.03 MB at a 5.83 MB budget (5.25 MB by copies).
    Raises ``BudgetInfeasibleError`` only when no target plans at all."""
    from .distributed_search import holding_least, near_smallest

    try:
        return plan_at(1)    # best_effort: the smallest-peak plan found, nothing to compare it with
    except BudgetInfeasibleError as error:
        near = near_smallest(error, plan_at)
        if not near:
            raise
    ends = near[:1] + near[-1:] if len(near) > 1 else near[:1]
    quick = lambda target, cap: plan_at(target, cap, saved_cap_search="one-pass-first")  # noqa: E731
    candidates = near + holding_least(ends, quick)[len(ends):]
    return min(candidates, key=lambda tc: (-copies(tc[1]), held_of(tc[1]) + tc[1].predicted_peak_bytes, tc[0]))[1]


def smallest_plan(plan_at: "Callable[[int], Any]", fallback: Any) -> Any:
    """The plan at the smallest simulated peak the planner reaches (asked for a 1-byte target, it
    names that peak), or ``fallback`` if that peak does not plan."""
    try:
        return plan_at(1)
    except BudgetInfeasibleError as error:
        refused = error
    try:
        return plan_at(max(refused.min_feasible_bytes, 1))
    except BudgetInfeasibleError:
        return fallback


def eager_code_follows(facts: Any) -> bool:
    """Whether code remat does not see reads the graph's outputs after its forward: they get gradients and none is a
    scalar, so a loss is still to be computed on them (``passes.joint_graph.eager_loss_reserve_bytes`` > 0: an eager
    loss, or a later graph). In a step's first run such a graph, with earlier graphs pending, takes its leanest plan
    (``StepAccount.share_for``'s ``eager_follows``), as a graph a graph break follows does."""
    from .passes.joint_graph import eager_loss_reserve_bytes

    return eager_loss_reserve_bytes(facts) > 0


def need_of(facts: Any) -> int:
    """A graph's need, the proxy by which later graphs' shares are split: the bytes its forward
    allocates (``JointGraphFacts``), as the DDP ledger uses forward tensor bytes."""
    return sum(node.alloc_bytes for node in facts.nodes.values() if node.role == "forward")


def note_step_plan(account: StepAccount, graph_id: str, share: Optional[GraphShare], plan: Any,
                   plan_at: "Callable[[int], Any]", joint: "fx.GraphModule", facts: Any, num_fwd_outputs: int,
                   static_indices: Optional[Sequence[int]], step_target_bytes: int, dump_path: Optional[str],
                   graph_key: str = "", asked_share: Optional[GraphShare] = None) -> None:
    """After planning a graph under a budget: its numbers go on the account (it now runs this plan),
    with its key and the share it was asked to fit (``asked_share``; ``share`` is the one it got), and
    its share of the step, if it had one, into its dump (report.md's "Step budget split").
    A graph planned under a share also records its floor (``smallest_plan``: two more plans, once per
    graph; a graph alone in its step, one without graph breaks, skips them)."""
    from .distributed import write_share_to_dump

    slot = slot_of(graph_id)
    inputs, grads = account.io_bytes(slot, joint, num_fwd_outputs, static_indices)
    held_of = account.held_of(slot, joint, num_fwd_outputs, static_indices)
    floor = account.floor_of(slot)
    provisional = share is not None and share.kind in PROVISIONAL_SHARE_KINDS
    if floor is None and share is not None:
        smallest = smallest_plan(plan_at, plan)
        floor = account.set_floor(slot, smallest.predicted_peak_bytes, held_of(smallest))
    floor_peak, floor_held = floor or (0, 0)
    room = step_target_bytes - (share.outside_bytes if share is not None else 0)    # the graphs' (accumulation)
    account.note_plan(StepGraph(graph_id, slot, held_of(plan), inputs, grads, need_of(facts), plan.predicted_peak_bytes,
                                room, floor_peak, floor_held, plan.no_remat_peak_bytes, provisional,
                                graph_key, asked_share if share is not None else None))
    if share is not None and dump_path is not None:
        write_share_to_dump(dump_path, share)
