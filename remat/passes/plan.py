"""Decide what the forward saves and what the backward recomputes, under a budget.

``make_plan`` returns, with no budget, the free min-cut (``mincut.py``: the
least bytes to save for no recomputation beyond fusible ops), or PyTorch's default partition
(plain Inductor's) when its simulated peak is lower; the solvers start from both. With a budget it
asks a solver for the least estimated extra time whose simulated peak meets the
target: ``solver="greedy"`` (the default, ``solve_greedy.py``: descent from
saving everything with a covering knapsack per round, then polish), or
``solver="milp"`` (``solve_milp.py``, exact, for small graphs; it starts from the
greedy's plan and falls back to it on a time-out or failure, saying why in
``Plan.solver``). The min-cut plan is taken instead when it fits and costs less.
Every plan is read back through ``evaluate`` (the simulator): its peak is what
the plan claims. Every tie is broken by joint-graph position, so the plan does
not depend on ``PYTHONHASHSEED``.

The planned peak is non-increasing as the budget shrinks on every graph and
budget sweep the tests run (``tests/test_solvers.py``, ``tests/test_plan.py``);
for the greedy that is measured, not proven: its drops depend on how far over
the target the simulated peak is.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from dataclasses import dataclass
from typing import AbstractSet, Callable, Iterator, Optional

from ..errors import BudgetInfeasibleError, raise_budget_hint
from ..options import DEFAULT_MILP_TIME_LIMIT_S, SOLVERS, smallest_budget_bytes
from ..units import format_bytes, format_gb_up, format_seconds
from ..simulator import Evaluated, evaluate, partition_of
from .held_cap import reduce_saved_bytes
from .block_start import block_checkpoint_saved
from .joint_graph import LOSS_OUTPUT_COPIES, JointGraphFacts
from .partition import Scheduled
from ..simulator.kernel_facts import storage_owner
from ..simulator.kernel_steps import EAGER_LOSS
from ..simulator.memory_timeline import SCRATCH_SUFFIX
from .mincut import min_cut_saved, saved_cost_bytes
from ..simulator.schedule import hold_intermediates, register_only
from .solve_greedy import SmallestPeak, smallest_peak_plans, solve_greedy
from .solve_milp import solve_min_time

_Evaluated = Evaluated    # the name older callers import
SOLVER_NAMES = SOLVERS
MILP_MAX_CANDIDATES = 400       # solver="milp" refuses graphs with more forward values to decide


@dataclass(frozen=True)
class NodeDecision:
    name: str
    op: str
    flops: int
    bytes: int
    decision: str      # "save" | "recompute" | "none"
    reason: str


@dataclass(frozen=True)
class Plan:
    """A partition with its predicted costs and the backward schedule they were simulated on. Holds
    names only, so it can be saved and diffed."""

    budget_bytes: Optional[int]
    target_bytes: Optional[int]          # what the simulated peak had to meet (budget less headroom)
    solver: str
    saved: tuple[str, ...]
    recomputed: tuple[str, ...]
    saved_primals: tuple[str, ...]
    forced: tuple[tuple[str, str], ...]
    predicted_peak_bytes: int
    peak_step_name: str
    no_remat_peak_bytes: int
    mincut_peak_bytes: int
    saved_bytes: int
    recompute_flops: int
    est_extra_time_s: float
    plan_time_s: float
    decisions: tuple[NodeDecision, ...]
    fits_budget: bool
    # the backward schedule the peak was simulated on, which the rewrite emits (``passes/rewrite.py``)
    backward_order: tuple[Scheduled, ...] = ()
    # a refusal's smallest-peak plan only: the saved set of the search's lowest plan before its time
    # refinements, when it differs (``solve_greedy.SmallestPeak``; a candidate for Inductor's check)
    chase_saved: tuple[str, ...] = ()


def _save_all(facts: JointGraphFacts) -> frozenset[str]:
    return frozenset(n for n in facts.needed_by_backward if facts.nodes[n].role == "forward")


def _decisions(facts: JointGraphFacts, chosen: Evaluated, mincut: frozenset[str], dropped: tuple[str, ...],
               is_mincut: bool, is_default: bool = False) -> tuple[NodeDecision, ...]:
    part = chosen.partition
    dropped_set = set(dropped)
    in_registers = register_only(facts)
    saved_storages = {sid for n in part.saved for sid in facts.nodes[n].value_storages}
    decisions = []
    for name in facts.order:
        node = facts.nodes[name]
        if node.role != "forward":
            continue
        if name in part.forced:
            decision, reason = "save", part.forced[name]
        elif name in part.saved:
            decision = "save"
            if is_mincut and name in mincut:
                reason = "min-cut: the cheapest values to keep so the rest is free to recompute"
            elif is_default:
                reason = ("saved by PyTorch's default partition (plain Inductor's), whose simulated peak is "
                          "lower than the min-cut's")
            else:
                reason = "kept: the plan meets its target without recomputing it"
        elif name in part.recomputed:
            decision = "recompute"
            if name in dropped_set:
                reason = (f"dropped to meet the budget: frees {format_bytes(saved_cost_bytes(facts, name))} "
                          "between its last forward use and its first backward use")
            elif node.is_view and set(node.value_storages) & saved_storages:
                reason = ("a view of a saved value: rebuilt from it in the backward at no cost (each storage is "
                          "saved once: two saved aliases would both be donated to the backward)")
            elif name in in_registers:
                reason = ("kept in registers by its fused forward kernel: saving it would add a store to that "
                          "kernel; the backward rebuilds it inside its own")
            elif node.free_to_recompute:
                reason = "free to recompute: a fusible op rebuilt inside the backward's kernels"
            else:
                reason = f"recomputed on the way to a dropped value ({format_seconds(node.cost.est_time_s)})"
        else:
            decision, reason = "none", "not needed by the backward"
        decisions.append(NodeDecision(name, node.op, node.cost.flops, node.alloc_bytes, decision, reason))
    return tuple(decisions)


def _infeasible_reasons(facts: JointGraphFacts, best: _Evaluated) -> tuple[str, ...]:
    grads = {s for o in facts.bwd_outputs for s in facts.nodes[o].value_storages}
    owners = {sid: storage_owner(sid) for sid, _ in best.simulation.live_at_peak}
    by_kind: dict[str, int] = {}
    for sid, nbytes in best.simulation.live_at_peak:
        owner = owners[sid]
        node = facts.nodes.get(owner)
        if sid == EAGER_LOSS + SCRATCH_SUFFIX:
            kind = ("reserved for eager code between the forward and the backward (an eager loss on the outputs: "
                    f"{LOSS_OUTPUT_COPIES} times their bytes until a step measured what it holds, remat/eager_loss.py; in a "
                    "step split at graph breaks, what the step's eager code was measured to hold there, "
                    "remat/step_loop.py)")
        elif sid in grads:
            kind = "gradients produced so far"
        elif owner in best.partition.forced:
            kind = f"values that cannot be recomputed ({best.partition.forced[owner].split(':')[0]})"
        elif node is not None and node.role == "tangent":
            kind = "incoming gradients of the outputs (tangents)"
        elif node is not None and node.role == "forward":
            kind = "saved or recomputed activations the next backward op reads"
        else:
            kind = "backward temporaries"
        by_kind[kind] = by_kind.get(kind, 0) + nbytes
    ranked = sorted(by_kind.items(), key=lambda kv: (-kv[1], kv[0]))
    return tuple(f"{format_bytes(b)} of it is {kind}" for kind, b in ranked)


def _check_solver(facts: JointGraphFacts, solver: str, milp_time_limit_s: float) -> None:
    if solver not in SOLVER_NAMES:
        raise ValueError(f"solver={solver!r} is not one of {SOLVER_NAMES}.")
    if solver == "milp":
        candidates = sum(1 for n in facts.nodes.values() if n.role == "forward")
        if candidates > MILP_MAX_CANDIDATES:
            raise ValueError(
                f"solver='milp' is for small graphs: this joint graph has {candidates} forward values to decide, "
                f"more than {MILP_MAX_CANDIDATES}, and the exact MILP grows exponentially with them. "
                "Use solver='greedy' (the default) for this model.")
        if not milp_time_limit_s > 0:
            raise ValueError(f"milp_time_limit_s={milp_time_limit_s!r} must be a positive number of seconds.")


def solver_starts(facts: JointGraphFacts, mincut: Evaluated) -> tuple[Evaluated, ...]:
    """The plans that need no budget, the one with the lower simulated peak first (the min-cut on a
    tie): the free min-cut, and the saved set of PyTorch's default partitioner when the facts have one
    that differs from it (``JointGraphFacts.default_saved``). Plain Inductor runs the default's, so its
    partition is one known to be reachable; the default recomputes what it deems cheap, and with
    Inductor's reorder of the backward that partition measured lower than the min-cut's on corpus nets
    (rand-1101: 409,128 vs 464,424 B). The solvers start from both."""
    if facts.default_saved is None:
        return (mincut,)
    forward = {n for n in facts.default_saved if n in facts.nodes and facts.nodes[n].role == "forward"}
    default = evaluate(facts, forward)
    if default.chosen == mincut.chosen:
        return (mincut,)
    return (default, mincut) if default.peak_bytes < mincut.peak_bytes else (mincut, default)


def _solve(facts: JointGraphFacts, target: int, solver: str, milp_time_limit_s: float, starts: tuple[Evaluated, ...],
           no_remat: Evaluated) -> tuple[Optional[Evaluated], tuple[str, ...], str, Optional[SmallestPeak]]:
    """The plan meeting ``target`` (None if none found), the values dropped to get there, the
    solver's account of itself, and the smallest-peak plan if the greedy worked it out."""
    greedy = solve_greedy(facts, target, starts=starts, save_all=no_remat)
    found, dropped = greedy.plan, greedy.dropped
    chosen, dropped, used = _exact(facts, target, solver, milp_time_limit_s, starts[0], found, dropped)
    return chosen, dropped, used, greedy.smallest


def _exact(facts: JointGraphFacts, target: int, solver: str, milp_time_limit_s: float, mincut: Evaluated,
           found: Optional[Evaluated], dropped: tuple[str, ...]) -> tuple[Optional[Evaluated], tuple[str, ...], str]:
    """The min-cut instead of the greedy's plan when it fits and costs less; then, for
    ``solver="milp"``, the MILP's plan, or the fallback and why."""
    if found is not None and mincut.peak_bytes <= target and mincut.extra_time_s < found.extra_time_s:
        found, dropped = mincut, ()
    if solver != "milp":
        return found, dropped, "greedy"
    start = None if found is None else set(found.chosen) - set(found.partition.forced)
    try:
        exact = solve_min_time(facts, target, time_limit_s=milp_time_limit_s, start=start)
    except Exception as error:   # noqa: BLE001 - any failure of the MILP falls back, with its reason
        return found, dropped, f"greedy (milp failed: {type(error).__name__}: {error}; fell back to the greedy's plan)"
    if exact.status == "infeasible":
        if found is not None:   # cannot happen while the MILP's rows are sound; the simulated plan wins
            return found, dropped, "greedy (milp reported infeasible, but the greedy's simulated plan fits)"
        return None, dropped, "milp (infeasible: no plan's simulated peak meets the target)"
    if exact.chosen_saved is None:
        return found, dropped, (f"greedy (milp: time limit {milp_time_limit_s:g} s reached with no verified plan; "
                                "fell back to the greedy's plan)")
    chosen = evaluate(facts, set(exact.chosen_saved))
    if found is not None and found.extra_time_s <= chosen.extra_time_s:
        chosen = found
    dropped = tuple(n for n in dropped if n not in chosen.chosen)
    if exact.status == "optimal":
        return chosen, dropped, f"milp (optimal, {exact.solves} solves in {exact.solve_time_s:.2f} s)"
    return chosen, dropped, (f"milp (time limit {milp_time_limit_s:g} s reached: best verified plan kept, "
                             f"within {exact.est_extra_time_s - exact.lower_bound_s:.3g} s of optimal)")


def _infeasible_error(facts: JointGraphFacts, budget_bytes: int, target: int, smallest: Evaluated,
                      target_for_budget: Callable[[int], int], best_effort_plan: Plan) -> BudgetInfeasibleError:
    """The error naming the smallest budget whose planning target (``target_for_budget``, the
    rule the caller planned with) meets ``smallest``'s peak: planning at it succeeds, since a
    target that plan meets always gets a plan (``solve_greedy.smallest_peak`` is the same plan
    whatever target is asked)."""
    reasons = _infeasible_reasons(facts, smallest)
    peak = smallest.peak_bytes
    minimum = smallest_budget_bytes(lambda b: target_for_budget(b) >= peak, start_bytes=peak)
    headroom = (
        "" if target == budget_bytes
        else f" (the plan keeps its simulated peak under a target of {format_bytes(target)}, the budget less "
             "headroom)"
    )
    return BudgetInfeasibleError(
        f"budget {format_bytes(budget_bytes)} is below the smallest feasible budget "
        f"{format_gb_up(minimum)} GB{headroom}: the smallest simulated peak the planner reaches is "
        f"{format_bytes(peak)} ({peak:,} bytes), and " + "; ".join(reasons) + ". " + raise_budget_hint(minimum),
        budget_bytes=budget_bytes,
        min_feasible_bytes=peak,
        min_budget_bytes=minimum,
        reasons=reasons,
        best_effort_plan=best_effort_plan,
    )


def make_plan(
    facts: JointGraphFacts,
    budget_bytes: Optional[int],
    *,
    target_bytes: Optional[int] = None,
    best_effort: bool = False,
    solver: str = "greedy",
    milp_time_limit_s: float = DEFAULT_MILP_TIME_LIMIT_S,
    saved_cap_bytes: Optional[int] = None,
    target_for_budget: Optional[Callable[[int], int]] = None,
    saved_cap_search: str = "greedy",
) -> Plan:
    """Plan one joint graph.

    ``target_bytes`` (default: the budget) is what the simulated peak must meet;
    the backend passes the budget less its headroom.
    Guarantees: with a budget, ``predicted_peak_bytes <= target_bytes``, unless
    ``best_effort`` is set, in which case the plan is the smallest-peak plan found
    and ``fits_budget`` says whether it fits. Otherwise raises ``BudgetInfeasibleError``
    naming the smallest feasible budget (``min_budget_bytes``): the smallest budget whose
    target, by ``target_for_budget`` (the caller's rule: the backend's is the budget less its
    headroom; default: the budget itself when ``target_bytes`` is not given, else the budget
    scaled by ``target_bytes / budget_bytes``), meets the peak of
    ``solve_greedy.smallest_peak``'s plan (``min_feasible_bytes``), a plan that was simulated,
    that does not depend on the target asked, and that ``make_plan`` falls back to for any
    target it meets, so planning at the named budget succeeds. Values that may not be recomputed are never recomputed. The
    plan depends only on the graph, the target and the solver (not on hash seeds).
    ``solver="milp"``: ValueError for graphs with more than MILP_MAX_CANDIDATES
    forward values; ``Plan.solver`` says whether the MILP answered or fell back, and why.
    ``saved_cap_bytes`` (a DDP/FSDP2 graph whose saved values stay alive while later graphs
    run): once a plan meets the target, stop saving values while ``Plan.saved_bytes`` is over
    the cap, without raising the simulated peak over the target (``held_cap.reduce_saved_bytes``);
    the plan may still be over the cap, and ``Plan.saved_bytes`` says by how much.
    ``saved_cap_search`` is that pass's search (``held_cap.SAVED_CAP_SEARCHES``).
    """
    t0 = time.perf_counter()
    _check_solver(facts, solver, milp_time_limit_s)
    with _cyclic_gc_paused():
        return _make_plan(facts, budget_bytes, target_bytes, best_effort, solver, milp_time_limit_s, t0,
                          saved_cap_bytes, target_for_budget, saved_cap_search)


def _proportional_rule(budget_bytes: int, target_bytes: int) -> Callable[[int], int]:
    """``make_plan``'s default budget-to-target rule: the target is the same fraction of every
    budget as ``target_bytes`` is of ``budget_bytes`` (the budget itself when they are equal)."""
    if target_bytes == budget_bytes or budget_bytes <= 0 or target_bytes <= 0:
        return lambda b: b
    return lambda b: b * target_bytes // budget_bytes


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while planning, back as it was after (reference
    counting still frees everything without cycles, which is nearly all the planner makes).

    Why: planning allocates millions of small tuples, and every so many allocations the
    collector walks every tracked object in the process, the joint graph's facts and the
    caller's heap included, so its cost grows with the heap, not with the work: on the
    48-layer GPT graph it was 40% of make_plan's CPU time (2.0 -> 1.2 s), for about 20k
    objects in cycles that the next collection frees (RSS 358 vs 361 MB)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _make_plan(facts: JointGraphFacts, budget_bytes: Optional[int], target_bytes: Optional[int], best_effort: bool,
               solver: str, milp_time_limit_s: float, t0: float, saved_cap_bytes: Optional[int] = None,
               target_for_budget: Optional[Callable[[int], int]] = None, saved_cap_search: str = "greedy") -> Plan:
    """``make_plan``'s work, once the solver is checked (see there)."""
    target = budget_bytes if target_bytes is None else target_bytes
    no_remat = evaluate(facts, _save_all(facts))
    mincut_saved = min_cut_saved(facts)
    mincut = evaluate(facts, mincut_saved)
    starts = solver_starts(facts, mincut)
    chosen: Optional[Evaluated] = starts[0]
    dropped: tuple[str, ...] = ()
    used = "min-cut (no budget)" if chosen is mincut else (
        f"PyTorch's default partition (no budget: simulated peak {format_bytes(chosen.peak_bytes)}, "
        f"the min-cut's {format_bytes(mincut.peak_bytes)})")
    smallest: Optional[SmallestPeak] = None
    if solver == "save-all":
        # The reference without remat: every value the backward reads is saved, except
        # register-only ones (schedule.register_only), which its kernels rebuild.
        chosen, used = no_remat, "save-all (no recomputation: the reference peak without remat)"
        if target is not None and no_remat.simulation.peak_bytes > target:
            chosen, smallest = None, SmallestPeak(no_remat, no_remat)
    elif target is not None:
        chosen, dropped, used, smallest = _solve(facts, target, solver, milp_time_limit_s, starts, no_remat)
    fits = chosen is not None
    if chosen is not None and target is not None and saved_cap_bytes is not None:
        capped = reduce_saved_bytes(facts, chosen, target, saved_cap_bytes, saved_cap_search)
        no_longer_saved = chosen.chosen - capped.chosen
        dropped += tuple(n for n in facts.order if n in no_longer_saved)
        chosen = capped
    if chosen is None:
        assert budget_bytes is not None and target is not None
        if smallest is None:
            smallest, _ = smallest_peak_plans(facts, starts)
        lowest = smallest.plan
        dropped = tuple(n for n in facts.order if n in _save_all(facts) - lowest.chosen)
        fallback = _plan_record(facts, budget_bytes, target, used, lowest, no_remat, mincut, mincut_saved, dropped,
                                starts[0], False, t0)
        if smallest.chased.chosen != lowest.chosen:
            fallback = dataclasses.replace(fallback, chase_saved=tuple(sorted(smallest.chased.chosen)))
        if not best_effort:
            raise _infeasible_error(facts, budget_bytes, target, lowest,
                                    target_for_budget or _proportional_rule(budget_bytes, target), fallback)
        return fallback
    return _plan_record(facts, budget_bytes, target, used, chosen, no_remat, mincut, mincut_saved, dropped, starts[0],
                        fits, t0)


def block_checkpoint_plan(facts: JointGraphFacts, budget_bytes: Optional[int], target_bytes: Optional[int]
                          ) -> Optional[Plan]:
    """The plan of checkpointing every repeated block (``block_start.block_checkpoint_saved``) as it is,
    each recomputed value built once and held (``schedule.hold_intermediates``), with
    ``fits_budget=False``, or None when the graph has no two blocks: a candidate for Inductor's
    check at a budget the simulator refused, whatever its simulated peak (on a drawn T5 the simulator
    put it at 2.48 MB and the search's smallest-peak plan at 1.93; Inductor's code peaked at 1.72 and
    1.85 MB)."""
    saved = block_checkpoint_saved(facts)
    if saved is None:
        return None
    hold_intermediates(facts, partition_of(facts, saved)[1])   # as checkpointing runs it: each value built once
    return saved_set_plan(facts, saved, budget_bytes, target_bytes,
                          "per-block checkpointing (a candidate for Inductor's check)")


def saved_set_plan(facts: JointGraphFacts, saved: AbstractSet[str], budget_bytes: Optional[int],
                   target_bytes: Optional[int], used: str) -> Plan:
    """The plan of saving ``saved`` as it is, with ``fits_budget=False`` (a candidate for Inductor's
    check at a budget the simulator refused; ``used`` says which)."""
    t0 = time.perf_counter()
    with _cyclic_gc_paused():
        save_all, mincut_saved = _save_all(facts), min_cut_saved(facts)
        no_remat, mincut, chosen = evaluate(facts, save_all), evaluate(facts, mincut_saved), evaluate(facts, saved)
        dropped = tuple(n for n in facts.order if n in save_all - chosen.chosen)
        return _plan_record(facts, budget_bytes, target_bytes, used, chosen, no_remat, mincut, mincut_saved, dropped,
                            mincut, False, t0)


def _plan_record(facts: JointGraphFacts, budget_bytes: Optional[int], target: Optional[int], used: str,
                 chosen: Evaluated, no_remat: Evaluated, mincut: Evaluated, mincut_saved: AbstractSet[str],
                 dropped: tuple[str, ...], first_start: Evaluated, fits: bool, t0: float) -> Plan:
    """The ``Plan`` of the simulated plan ``chosen`` (``_make_plan``'s answer, or a refusal's best-effort plan)."""
    part = chosen.partition
    return Plan(
        budget_bytes=budget_bytes,
        target_bytes=target,
        solver=used,
        saved=tuple(sorted(part.saved)),
        recomputed=tuple(sorted(part.recomputed)),
        saved_primals=tuple(sorted(part.saved_primals)),
        forced=tuple(sorted(part.forced.items())),
        predicted_peak_bytes=chosen.simulation.peak_bytes,
        peak_step_name=chosen.simulation.peak_step_name,
        no_remat_peak_bytes=no_remat.simulation.peak_bytes,
        mincut_peak_bytes=mincut.simulation.peak_bytes,
        saved_bytes=sum(saved_cost_bytes(facts, n) for n in part.saved),
        recompute_flops=sum(facts.nodes[n].cost.flops for n in part.recomputed),
        est_extra_time_s=chosen.extra_time_s,
        plan_time_s=time.perf_counter() - t0,
        decisions=_decisions(facts, chosen, mincut_saved, dropped, chosen is mincut,
                             chosen is first_start and chosen is not mincut),
        fits_budget=fits,
        backward_order=chosen.backward_order,
    )
