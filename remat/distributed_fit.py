"""Plan one graph of a distributed step under its share of the per-rank budget.

The backend's hooks, around its planner: ``share_for_graph`` (before planning: which piece
of a DDP step or which FSDP2 unit graph this is, and its share, ``remat/distributed.py``),
``fit_plan`` (the plan at the largest target the step's ledger admits) and ``record_graph``
(after: what the piece holds goes on the ledger, the split into the dump, the collectives
of the rewritten graphs listed). The torch-private reads are in ``remat/_torch_distributed.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .distributed import (
    DistributedGraphRecord, GraphShare, LedgerEntry, StepLedger, collectives_of, piece_target, restate_infeasible,
    write_share_to_dump,
)
from .errors import BudgetInfeasibleError
from .units import format_bytes

if TYPE_CHECKING:
    from torch import fx


def _value_bytes(value: object) -> int:
    import torch

    if not isinstance(value, torch.Tensor):
        return 0
    try:
        return int(value.numel()) * value.element_size()
    except (TypeError, RuntimeError):  # an unbacked symbolic size
        return 0


def _primal_bytes(joint: "fx.GraphModule", static_indices: Optional[Sequence[int]]) -> tuple[dict[str, int], set[str]]:
    """Bytes of each primal placeholder, and the names of the activation (non-static) ones."""
    static = set(static_indices or ())
    primals = [n for n in joint.graph.nodes if n.op == "placeholder" and str(n.target).startswith("primals")]
    sizes = {n.name: _value_bytes(n.meta.get("val")) for n in primals}
    return sizes, {n.name for i, n in enumerate(primals) if i not in static}


def _param_grad_bytes(joint: "fx.GraphModule", num_fwd_outputs: int, static_indices: Optional[Sequence[int]]) -> int:
    """Bytes of the gradients the joint graph returns for its parameters (static inputs):
    the joint's outputs after the forward's are the primals' gradients, in primal order."""
    from torch import fx

    static = set(static_indices or ())
    output = next(n for n in joint.graph.nodes if n.op == "output")
    grads = list(output.args[0])[num_fwd_outputs:]
    return sum(_value_bytes(g.meta.get("val")) for i, g in enumerate(grads) if i in static and isinstance(g, fx.Node))


def share_for_graph(ledger: StepLedger, step_target_bytes: Optional[int], joint: "fx.GraphModule",
                    num_fwd_outputs: int, static_indices: Optional[Sequence[int]]) -> Optional[GraphShare]:
    """The planning target of a joint graph that is a piece of a DDP step or an FSDP2 unit's
    graph, or None (no budget, or not distributed: the graph gets the whole budget).

    Call it before planning, from the partitioner: it reads the DDP optimizer's or FSDP2's
    state off the Python stack (``remat/_torch_distributed.py``).
    """
    from . import _torch_distributed as tdist

    if step_target_bytes is None:
        return None
    sizes, activations = _primal_bytes(joint, static_indices)
    activation_bytes = sum(sizes[name] for name in activations)
    pieces = tdist.ddp_pieces()
    if pieces is not None:
        own_grads = _param_grad_bytes(joint, num_fwd_outputs, static_indices)
        total_grads = tdist.ddp_param_grad_bytes() or 0
        held_before, grads_before, needs = ledger.before(pieces.split_id, pieces.index, pieces.forward_bytes)
        return piece_target(
            step_target_bytes=step_target_bytes, index=pieces.index, needs=needs, held_before_bytes=held_before,
            input_activation_bytes=activation_bytes, total_grad_bytes=max(total_grads, grads_before + own_grads),
            grads_so_far_bytes=grads_before + own_grads, kind="ddp",
        )
    unit = tdist.fsdp_unit()
    if unit is not None:
        # One unit running, the next one prefetched by its backward, and the reduce-scatter's
        # input buffer: three units' unsharded bytes; the root's parameters stay unsharded.
        outside = 3 * unit.unit_unsharded_bytes + unit.root_unsharded_bytes + unit.sharded_grad_bytes
        return piece_target(
            step_target_bytes=step_target_bytes, index=0, needs=(1,), held_before_bytes=0,
            input_activation_bytes=activation_bytes, total_grad_bytes=0, grads_so_far_bytes=0,
            outside_bytes=outside, repeats=unit.repeats, kind="fsdp2",
        )
    return None


def record_graph(ledger: StepLedger, share: Optional[GraphShare], joint: "fx.GraphModule", saved_bytes: int,
                 saved_primals: Sequence[str], fw: "fx.GraphModule", bw: "fx.GraphModule", num_fwd_outputs: int,
                 static_indices: Optional[Sequence[int]], dump_path: Optional[str]) -> Optional[DistributedGraphRecord]:
    """After planning: enter a DDP piece's held bytes in the ledger, add the split to the
    graph's dump, and list the collectives in its graphs. None outside torch.distributed."""
    import torch

    from . import _torch_distributed as tdist

    if share is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    if share is not None and share.kind == "ddp":
        pieces = tdist.ddp_pieces()
        if pieces is not None:
            held = held_bytes_of(joint, static_indices, saved_bytes, saved_primals)
            grads = _param_grad_bytes(joint, num_fwd_outputs, static_indices)
            ledger.record(pieces.split_id, LedgerEntry(pieces.index, held, grads))
    if share is not None and dump_path is not None:
        write_share_to_dump(dump_path, share)
    in_graphs, recomputed = collectives_of(fw, bw)
    return DistributedGraphRecord(share=share, collective_nodes=in_graphs, recomputed_collectives=recomputed)



FIT_ROUNDS = 4


def held_bytes_of(joint: "fx.GraphModule", static_indices: Optional[Sequence[int]], saved_bytes: int,
                  saved_primals: Sequence[str]) -> int:
    """What a plan keeps from its forward for its backward: its saved activations and the
    activation inputs (not parameters) it saves."""
    sizes, activations = _primal_bytes(joint, static_indices)
    return saved_bytes + sum(sizes.get(name, 0) for name in saved_primals if name in activations)


def fit_plan(share: GraphShare, held_of: "Callable[[Any], int]", plan_at: "Callable[[int], Any]",
             budget_bytes: int, headroom_fraction: float) -> tuple[Any, GraphShare]:
    """The plan for a graph under its share: the largest planning target whose plan the share
    admits (``GraphShare.admits`` on what the plan really holds and its predicted peak).

    ``plan_at(target)`` makes a plan (or raises ``BudgetInfeasibleError``); ``held_of(plan)``
    says what it holds. Tries the loose target (nothing held) first, then bisects down to
    the safe one (``share.target_bytes``: the room less the later pieces' reserve, which any
    plan meeting it is admitted at, since what a plan holds is live at its peak). Returns the
    plan and the share with ``target_bytes`` set to the target it was made for. Raises
    ``BudgetInfeasibleError`` naming the smallest per-rank budget (``restate_infeasible``).
    """
    from dataclasses import replace

    share = calibrate_reserve(share, plan_at, budget_bytes)
    high = share.loose_target_bytes
    try:
        plan = plan_at(max(high, 1))
    except BudgetInfeasibleError as error:  # infeasible here: infeasible at every lower target
        raise restate_infeasible(error, share, budget_bytes, headroom_fraction, loose=True) from None
    if share.admits(held_of(plan), plan.predicted_peak_bytes):
        return plan, replace(share, target_bytes=high)
    low, best = share.target_bytes, None
    for _ in range(FIT_ROUNDS):
        if high - low <= max(high // 50, 1):
            break
        middle = (low + high) // 2
        try:
            trial = plan_at(max(middle, 1))
        except BudgetInfeasibleError as error:
            # No plan peaks this low; the planner names the smallest peak it reaches.
            low = max(middle, _named_peak(error, middle, budget_bytes) - 1)
            continue
        if share.admits(held_of(trial), trial.predicted_peak_bytes):
            low, best = middle, (trial, middle)
        else:
            high = middle
    if best is not None:
        return best[0], replace(share, target_bytes=best[1])
    try:
        return plan_at(max(share.target_bytes, 1)), share
    except BudgetInfeasibleError as error:
        # Last, the smallest-peak plan (re-made at the peak the planner names): the admitted
        # targets can be a window the bisection stepped over.
        named = _named_peak(error, share.target_bytes, budget_bytes)
        try:
            smallest = plan_at(max(named, 1))
        except BudgetInfeasibleError:
            raise restate_infeasible(error, share, budget_bytes, headroom_fraction) from None
        if share.admits(held_of(smallest), smallest.predicted_peak_bytes):
            return smallest, replace(share, target_bytes=named)
        raise _smallest_admitted(error, share, held_of(smallest), smallest.predicted_peak_bytes, budget_bytes,
                                 headroom_fraction) from None


def calibrate_reserve(share: GraphShare, plan_at: "Callable[[int], Any]", budget_bytes: int) -> GraphShare:
    """Cap the reserve for later pieces at an estimate of their smallest demand.

    The proportional shares reserve for later pieces what they would get of the whole step,
    far more than they need once they recompute. This piece's smallest peak (the planner
    names it when asked for a 1-byte target) over its need (forward tensor bytes) estimates
    how far recomputation shrinks a piece; the later pieces' needs times that ratio is the
    reserve. An estimate: a later piece that shrinks less than this one can find too little
    room, and then names the budget it needs.
    """
    from dataclasses import replace

    if (share.reserved_later_bytes <= 0 or share.kind != "ddp" or share.later_estimate_bytes is not None
            or not share.needs or share.needs[share.index] <= 0):
        return share  # nothing reserved, or already estimated
    try:
        plan_at(1)
        return share  # a 1-byte target met: nothing to calibrate against
    except BudgetInfeasibleError as error:
        smallest_peak = _named_peak(error, 1, budget_bytes)
    ratio = (smallest_peak + share.input_activation_bytes) / share.needs[share.index]
    estimate = int(ratio * sum(share.needs[share.index + 1:]))
    return replace(share, later_estimate_bytes=estimate).at(share.step_target_bytes)


def _named_peak(error: BudgetInfeasibleError, target_bytes: int, budget_bytes: int) -> int:
    """The smallest simulated peak the planner reached, from the budget its error names
    (make_plan names ``ceil(peak * budget / target)``)."""
    return error.min_feasible_bytes * max(target_bytes, 1) // max(budget_bytes, 1)


def _smallest_admitted(error: BudgetInfeasibleError, share: GraphShare, held: int, peak: int, budget_bytes: int,
                       headroom_fraction: float) -> BudgetInfeasibleError:
    """No plan under this budget is admitted: name the smallest per-rank budget at which the
    smallest-peak plan the planner found (holding ``held``, peaking at ``peak``) would be."""
    low, high = 0, max(share.step_target_bytes, 1)
    while not share.at(high).admits(held, peak):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if share.at(middle).admits(held, peak):
            high = middle
        else:
            low = middle
    minimum = -(-high * 100 // round(100 * (1.0 - headroom_fraction)))
    message = (
        f"per-rank budget {format_bytes(budget_bytes)} is below the smallest feasible budget {format_bytes(minimum)} "
        f"for this graph ({share.explain().split('. ')[0]}): "
        f"its smallest-peak plan peaks at {format_bytes(peak)} and holds "
        f"{format_bytes(held)} for its backward, which with what the rest of the step needs fits a step target of "
        f"{format_bytes(high)}. Inside that peak: " + "; ".join(error.reasons)
        + f". Raise the budget to at least {minimum / 1e9:.4f} GB (1 GB = 1e9 bytes), or pass best_effort=True."
    )
    return BudgetInfeasibleError(message, budget_bytes=budget_bytes, min_feasible_bytes=minimum, reasons=error.reasons)
