"""Plan one graph of a distributed step under its share of the per-rank budget.

The backend's hooks, around its planner: ``share_for_graph`` (before planning: which piece
of a DDP step or which FSDP2 unit graph this is, and its share, ``remat/distributed.py``),
``fit_plan`` (the plan at the largest target the step's ledger admits) and ``record_graph``
(after: what the piece holds goes on the ledger, the split into the dump, the collectives
of the rewritten graphs listed). The torch-private reads are in ``remat/_torch_distributed.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .distributed import LOSS_OUTPUT_COPIES, REFUSAL_CHECKED_SHARE_KINDS, GraphShare, LedgerEntry, StepLedger, piece_target, write_share_to_dump
from .distributed_errors import ShareInfeasibleError, budget_for_step_target, restate_infeasible
from .distributed_record import DistributedGraphRecord, collectives_of
from .distributed_search import (  # noqa: F401 - FIT_ROUNDS, REPLAY_STEP: the search's constants, read by tests
    FIT_ROUNDS, REPLAY_STEP, NoPlan, Replay, fit_share, named_peak, refit_of, remembered, step_target_admitting,
)
from .errors import BudgetInfeasibleError, raise_budget_hint
from .units import format_bytes, format_gb_up

if TYPE_CHECKING:
    from torch import fx


def _value_bytes(value: object) -> int:
    import torch

    from .cost_model.tensors import concrete_int

    if not isinstance(value, torch.Tensor):
        return 0
    try:   # concrete_int, not int(): int() on a SymInt adds a guard that specialises a dynamic graph
        return concrete_int(value.numel()) * value.element_size()
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
        total = max(total_grads, grads_before + own_grads)
        # G_>k: the gradients of the parameters a later piece reads (a parameter several pieces read has
        # its gradient from the last one's backward on). Both numbers are lower bounds of it: the split's
        # reading misses parameters whose meta it cannot read, the gradients less those of pieces 0..k
        # miss a parameter shared with a later piece; the larger is taken.
        later = max(pieces.later_param_bytes[pieces.index], total - grads_before - own_grads)
        return piece_target(
            step_target_bytes=step_target_bytes, index=pieces.index, needs=needs, held_before_bytes=held_before,
            input_activation_bytes=activation_bytes, total_grad_bytes=total,
            grads_so_far_bytes=total - later, kind="ddp", step_output_bytes=pieces.output_bytes,
            own_grad_bytes=own_grads,
        )
    unit = tdist.fsdp_unit()
    if unit is not None:
        return piece_target(
            step_target_bytes=step_target_bytes, index=0, needs=(1,), held_before_bytes=0,
            input_activation_bytes=activation_bytes, total_grad_bytes=0, grads_so_far_bytes=0,
            outside_bytes=fsdp_outside_bytes(unit), repeats=unit.repeats, kind="fsdp2",
            later_run_bytes=unit.unit_sharded_bytes, rs_buffer_bytes=unit.unit_unsharded_bytes,
            rs_buffers=unit.reduce_scatter_buffers, prefetch_bytes=unit.unit_unsharded_bytes,
            first_prefetch_bytes=unit.other_unit_unsharded_bytes,
        )
    return None


def fsdp_outside_bytes(unit: Any) -> int:
    """FSDP2's memory next to any run of a unit graph, outside remat's graphs (bytes).

    Read from what FSDP2 (torch 2.13) keeps alive, seen in the profiler's allocation
    timeline of the 2-rank test (``benchmarks/distributed_budget.py --timeline``):

    - the running unit's all-gathered parameters (copy-out), and its all-gather output:
      freed right after the copy-out in backward, but on gloo the output is held by the
      collective's work object until its thread lets go, so a rank can keep it through the
      unit's backward (measured: 0.79 MB on one rank of two, in some runs);
    - the root's parameters (not resharded after forward: FSDP2's root keeps them for the
      whole step) and their unsharded gradients, reduced after every unit's backward (all of
      them counted: which root parameters' gradients come before a unit's is not known here).

    The unit prefetched during a run's backward, and each later run's sharded gradients and
    reduce-scatter input buffer, depend on the run: ``GraphShare.runs_peak_bytes``.
    """
    return 2 * unit.unit_unsharded_bytes + unit.root_unsharded_bytes + unit.root_grad_bytes


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


def held_bytes_of(joint: "fx.GraphModule", static_indices: Optional[Sequence[int]], saved_bytes: int,
                  saved_primals: Sequence[str]) -> int:
    """What a plan keeps from its forward for its backward: its saved activations, and every
    activation input (not parameters).

    Every activation input, not only the ones in ``saved_primals``: a plan that saves a view
    of an input keeps the input's storage alive, and ``saved_bytes`` counts no input-owned
    storage (inputs are resident for a single graph; a DDP piece's inputs are the previous
    piece's outputs, which it frees). Measured on the 4-layer zoo GPT under DDP: a piece
    kept its 2.62 MB input through a view, and the step went 0.32 MB over its budget.
    ``saved_primals`` is accepted for the caller's signature; the count no longer needs it.
    """
    del saved_primals  # every activation input is counted (see above)
    sizes, activations = _primal_bytes(joint, static_indices)
    return saved_bytes + sum(sizes[name] for name in activations)


def fit_plan(share: GraphShare, held_of: "Callable[[Any], int]", plan_at: "Callable[[int], Any]",
             budget_bytes: int, target_for_budget: "Callable[[int], int]", calibrate: bool = True,
             plan_capped: "Optional[Callable[[int, int], Any]]" = None,
             ledger: Optional[StepLedger] = None) -> tuple[Any, GraphShare]:
    """The plan for a graph under its share: the largest planning target whose plan the share
    admits (``GraphShare.admits`` on what the plan really holds and its predicted peak).

    ``plan_at(target)`` makes a plan (or raises ``BudgetInfeasibleError``); ``held_of(plan)``
    says what it holds; ``plan_capped(target, saved_cap_bytes)``, if given, makes the plan for a
    target saving at most that many bytes where it can: a plan the share refuses for what it
    holds is tried again that way (``_admitted``). Tries the loose target (nothing held) first, then bisects down to
    the safe one (``share.target_bytes``: the room less the later pieces' reserve, which any
    plan meeting it is admitted at, since what a plan holds is live at its peak). The reserve
    for later pieces is an estimate, so it is a preference, not a condition: when no plan is
    admitted next to it, the plan near the smallest peak that holds least is taken if its own
    runs fit (``reserve_met`` False; a later piece short of room then names the budget it needs).
    Returns the plan and the share with ``target_bytes`` set to the target it was made for.

    Raises ``BudgetInfeasibleError`` naming the smallest per-rank budget whose step target
    (``target_for_budget``: the backend's rule, the budget less its headroom) admits a plan. Given
    the step's ``ledger``, that budget is checked by replaying the earlier pieces at it (each
    registers how it plans, ``StepLedger.set_refit``): at a larger budget they plan at larger
    targets and hold more, so the budget named from what they hold now was refused again.
    """
    plan_at, plan_capped = remembered(plan_at), remembered(plan_capped)   # the searches ask again
    if calibrate:  # the later pieces' reserve from this piece's smallest-peak plan (else the proportional shares)
        share = calibrate_reserve(share, plan_at, budget_bytes, held_of)
    try:
        plan, fitted = fit_share(share, held_of, plan_at, plan_capped)
    except NoPlan as refused:
        error, named = _infeasible(refused.error, share, refused.candidates, held_of, budget_bytes, target_for_budget,
                                   loose=refused.loose)
        if share.kind in REFUSAL_CHECKED_SHARE_KINDS and named is not None:   # the backend has Inductor check the plan named
            raise ShareInfeasibleError(error, named) from None
        if ledger is None or share.kind != "ddp":
            raise error from None
        replay = Replay(ledger.refits_before(share.index), share, held_of, plan_at, plan_capped, target_for_budget)
        raise replay.named(error, refused.candidates) from None
    if ledger is not None and share.kind == "ddp":
        ledger.set_refit(share.index, refit_of(share, held_of, plan_at, plan_capped))
    return plan, fitted


def _infeasible(error: BudgetInfeasibleError, share: GraphShare, candidates: "list[tuple[int, Any]]",
                held_of: "Callable[[Any], int]", budget_bytes: int, target_for_budget: "Callable[[int], int]",
                loose: bool = False) -> tuple[BudgetInfeasibleError, Optional[Any]]:
    """The error for a graph no plan fits under this budget: the smallest per-rank budget at
    which one of ``candidates`` (plans near the smallest peak) is admitted, counting what it
    holds as well as its peak (a budget named from the peak alone is too small when the graph
    runs several times per step, or when what it holds squeezes the later pieces); and that
    candidate (None when there were none and the name comes from the peak alone)."""
    if not candidates:  # nothing planned near the named peak: name it from the peak alone
        return restate_infeasible(error, share, budget_bytes, target_for_budget, loose=loose), None
    needs = [(step_target_admitting(share, held_of(c), c.predicted_peak_bytes), held_of(c), c.predicted_peak_bytes, i)
             for i, (_, c) in enumerate(candidates)]
    step, held, peak, position = min(needs)
    minimum = budget_for_step_target(step, target_for_budget)
    message = (
        f"{'' if share.in_step else 'per-rank '}budget {format_bytes(budget_bytes)} is below the smallest feasible "
        f"budget {format_gb_up(minimum)} GB "
        f"for this graph ({share.explain().split('. ')[0]}): "
        f"of the plans near its smallest peak, the one that needs the least peaks at {format_bytes(peak)} and holds "
        f"{format_bytes(held)} for its backward, which with what the rest of the step needs fits a step target of "
        f"{format_bytes(step)}. Inside the smallest peak: " + "; ".join(error.reasons)
        + ". " + raise_budget_hint(minimum)
    )
    return BudgetInfeasibleError(message, budget_bytes=budget_bytes, min_feasible_bytes=peak, min_budget_bytes=minimum,
                                 reasons=error.reasons), candidates[position][1]


def calibrate_reserve(share: GraphShare, plan_at: "Callable[[int], Any]", budget_bytes: int,
                      held_of: "Optional[Callable[[Any], int]]" = None) -> GraphShare:
    """Set the reserve for later pieces to an estimate of their smallest demand, and cap it at an
    estimate of their demand with no recomputation.

    This piece's smallest-peak plan (the planner names its peak when asked for a 1-byte
    target) says how far recomputation shrinks a piece: ``rp`` = (its peak + activation inputs)
    over its need (forward tensor bytes), ``rh`` = what it holds over its need (``rp`` if
    ``held_of`` is not given: what a plan holds is live at its peak). Later piece m is estimated
    to peak at ``rp * need_m`` next to what the pieces between hold, ``rh * need_j`` each; the
    reserve is the largest such demand. (``rp`` counts this piece's own gradients, which
    ``admits`` also charges for the later pieces: taking them out, the zoo GPT's earlier pieces
    held more and its last piece was refused at 60% of plain Inductor's peak; the estimate is
    a preference, not a condition, ``fit_plan``.) The same scaling of this piece's peak without recomputation (``Plan.no_remat_peak_bytes``)
    is the ceiling: the reserve never grows past it (``piece_target``). Estimates: a later
    piece that shrinks less than this one can find too little room, and then names the budget
    it needs.
    """
    from dataclasses import replace

    if (share.reserved_later_bytes <= 0 or share.kind != "ddp" or share.later_estimate_bytes is not None
            or not share.needs or share.needs[share.index] <= 0):
        return share  # nothing reserved, or already estimated
    try:
        plan_at(1)
        return share  # a 1-byte target met: nothing to calibrate against
    except BudgetInfeasibleError as error:
        smallest_peak = named_peak(error)
    smallest = None
    try:
        smallest = plan_at(max(smallest_peak, 1))
    except BudgetInfeasibleError:
        pass  # the named peak did not plan (rounding): bound what it holds by its peak
    held = held_of(smallest) if held_of is not None and smallest is not None else None
    estimate = _later_demand(share, smallest_peak, held)
    ceiling = None if smallest is None else _later_demand(share, smallest.no_remat_peak_bytes, None)
    return replace(share, later_estimate_bytes=estimate, later_ceiling_bytes=ceiling,
                   own_floor_bytes=smallest_peak + share.input_activation_bytes).at(share.step_target_bytes)


def _later_demand(share: GraphShare, peak_bytes: int, held_bytes: Optional[int]) -> int:
    """The later pieces' largest demand, scaled from this piece's plan peaking at ``peak_bytes``
    and holding ``held_bytes`` (None: bound by its peak) by their needs (``calibrate_reserve``)."""
    need = share.needs[share.index]
    peak_ratio = (peak_bytes + share.input_activation_bytes) / need
    held_ratio = peak_ratio if held_bytes is None else held_bytes / need
    later = share.needs[share.index + 1:]
    # The last piece also holds what it keeps next to the loss's copies of the outputs, before
    # any gradient exists (``admits`` charges the later pieces' gradients to every reserve).
    loss = LOSS_OUTPUT_COPIES * share.step_output_bytes - share.later_grad_bytes
    return max(int(max(peak_ratio * later[m], held_ratio * later[m] + (loss if m == len(later) - 1 else 0))
                   + held_ratio * sum(later[:m])) for m in range(len(later)))

