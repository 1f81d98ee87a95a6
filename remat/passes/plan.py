"""Decide what the forward saves and what the backward recomputes, under a budget.

``make_plan`` starts from the free min-cut (``mincut.py``). If its simulated
peak is over the budget, a greedy pass drops saved values one at a time: among
the saved values live at the simulated peak, it tries them in order of least
added recompute time per byte freed, and keeps the first drop that lowers the
simulated peak. It stops when the peak fits, or raises ``BudgetInfeasibleError``
when no drop lowers the peak any more. The sequence of drops does not depend on
the budget (only where it stops does), so the planned peak is monotone in the
budget.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import AbstractSet, Optional

from ..cost_model.memory import MemorySimulation, Step, simulate_memory
from ..errors import BudgetInfeasibleError
from ..units import format_bytes, format_seconds
from .joint_graph import JointGraphFacts
from .mincut import saved_cost_bytes, min_cut_saved
from .schedule import Partition, memory_steps, partition_nodes, recompute_time_s, why_not_recomputable

MAX_TRIES_PER_DROP = 12
RECOMPUTE_FLOOR_S = 5e-6


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
    """A partition with its predicted costs. Holds names only, so it can be saved and diffed."""

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


@dataclass(frozen=True)
class _Evaluated:
    chosen: frozenset[str]
    partition: Partition
    simulation: MemorySimulation
    extra_time_s: float
    steps: tuple[Step, ...]


def evaluate(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> _Evaluated:
    partition = partition_nodes(facts, chosen_saved)
    steps, pinned = memory_steps(facts, partition)
    extra = recompute_time_s(facts, partition)
    return _Evaluated(frozenset(chosen_saved), partition, simulate_memory(steps, pinned), extra, tuple(steps))


def _held_only_by_saving(current: _Evaluated, storages: tuple[str, ...]) -> bool:
    """True when these storages are live at the peak only because they are saved: in the
    forward, every forward reader ran before the peak; in the backward, the first
    backward reader runs after it. Dropping such a value can lower the peak."""
    peak = current.simulation.peak_step
    in_backward = current.steps[peak].phase == "backward"
    wanted = set(storages)
    for index, step in enumerate(current.steps):
        if not wanted.intersection(step.uses):
            continue
        if in_backward and step.phase == "backward" and index <= peak:
            return False
        if not in_backward and step.phase == "forward" and index >= peak:
            return False
    return True


def _droppable_at_peak(facts: JointGraphFacts, current: _Evaluated) -> list[str]:
    live = {sid for sid, _ in current.simulation.live_at_peak}
    forced = set(current.partition.forced)
    return [
        name for name in current.partition.saved
        if name not in forced and why_not_recomputable(facts, name) is None
        and any(sid in live for sid in facts.nodes[name].value_storages)
        and saved_cost_bytes(facts, name) > 0
        and _held_only_by_saving(current, facts.nodes[name].value_storages)
    ]


def excess_bytes(simulation: MemorySimulation, target_bytes: int) -> int:
    """Bytes above the target summed over every step: 0 exactly when the peak fits.

    The greedy minimises this rather than the peak alone: repeated layers make
    many steps peak at the same height, and a single drop lowers only one of them.
    """
    return sum(live - target_bytes for live in simulation.timeline_bytes if live > target_bytes)


def greedy_reduce_peak(facts: JointGraphFacts, start: _Evaluated, budget_bytes: int) -> tuple[_Evaluated, list[str]]:
    """Drop saved values until the simulated peak fits ``budget_bytes`` or no drop helps.

    Each round ranks the saved values held live at the peak only by being saved,
    by added recompute time per byte freed, and keeps the first drop that lowers
    the bytes above the budget (``excess_bytes``). Then it re-adds dropped values,
    last dropped first, wherever the plan still fits: that returns time the drops
    no longer need. Returns the plan and the values it dropped; the plan's peak is
    <= budget_bytes, or no single drop lowered the excess.
    """
    current = start
    dropped: list[str] = []
    excess = excess_bytes(current.simulation, budget_bytes)
    while excess > 0:
        ranked = []
        for name in _droppable_at_peak(facts, current):
            added_s = evaluate_partition_only(facts, current.chosen - {name}) - current.extra_time_s
            # Every recomputation costs at least a kernel launch: without that floor, values
            # of a few bytes that recompute "for free" would rank first and free nothing.
            ranked.append(((max(added_s, 0.0) + RECOMPUTE_FLOOR_S) / max(saved_cost_bytes(facts, name), 1), name))
        ranked.sort()
        for _, name in ranked[:MAX_TRIES_PER_DROP]:
            trial = evaluate(facts, current.chosen - {name})
            trial_excess = excess_bytes(trial.simulation, budget_bytes)
            if trial_excess < excess:
                current, excess = trial, trial_excess
                dropped.append(name)
                break
        else:
            break
    if excess == 0:
        for name in reversed(list(dropped)):
            trial = evaluate(facts, current.chosen | {name})
            if trial.simulation.peak_bytes <= budget_bytes and trial.extra_time_s < current.extra_time_s:
                current = trial
                dropped.remove(name)
    return current, dropped


def evaluate_partition_only(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> float:
    """Estimated recompute time of the partition ``chosen_saved`` closes into (no simulation)."""
    return recompute_time_s(facts, partition_nodes(facts, chosen_saved))


def _save_all(facts: JointGraphFacts) -> frozenset[str]:
    return frozenset(n for n in facts.needed_by_backward if facts.nodes[n].role == "forward")


def _decisions(facts: JointGraphFacts, chosen: _Evaluated, mincut: frozenset[str], dropped: list[str]) -> tuple[NodeDecision, ...]:
    part = chosen.partition
    dropped_set = set(dropped)
    decisions = []
    for name in facts.order:
        node = facts.nodes[name]
        if node.role != "forward":
            continue
        if name in part.forced:
            decision, reason = "save", part.forced[name]
        elif name in part.saved:
            decision = "save"
            reason = "min-cut: the cheapest values to keep so the rest is free to recompute" if name in mincut else \
                "kept: recomputing it would cost more time per byte than the values dropped"
        elif name in part.recomputed:
            decision = "recompute"
            if name in dropped_set:
                reason = f"dropped to meet the budget: frees {format_bytes(saved_cost_bytes(facts, name))} at the peak"
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
    owners = {sid: sid.split("#")[0].removesuffix("@r") for sid, _ in best.simulation.live_at_peak}
    by_kind: dict[str, int] = {}
    for sid, nbytes in best.simulation.live_at_peak:
        owner = owners[sid]
        node = facts.nodes.get(owner)
        if sid in grads:
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
    ranked = sorted(by_kind.items(), key=lambda kv: -kv[1])
    return tuple(f"{format_bytes(b)} of it is {kind}" for kind, b in ranked)


BISECTION_ROUNDS = 4


def _smallest_feasible(facts: JointGraphFacts, start: _Evaluated, infeasible_target: int, stuck: _Evaluated) -> _Evaluated:
    """The smallest-peak plan the greedy reaches, found by bisecting its target.

    The greedy's path depends on its target, so the plan it is stuck at for an
    infeasible target is not the smallest it can reach. Every plan returned was
    reached by the greedy for a target it meets, so the budget it names is feasible.
    """
    low, best = infeasible_target, stuck
    high = stuck.simulation.peak_bytes
    for _ in range(BISECTION_ROUNDS):
        if high - low <= max(high // 200, 1):
            break
        middle = (low + high) // 2
        trial, _ = greedy_reduce_peak(facts, start, middle)
        if trial.simulation.peak_bytes <= middle:
            best, high = trial, trial.simulation.peak_bytes
        else:
            low = middle
    return best


def make_plan(
    facts: JointGraphFacts,
    budget_bytes: Optional[int],
    *,
    target_bytes: Optional[int] = None,
    best_effort: bool = False,
    solver: str = "greedy",
) -> Plan:
    """Plan one joint graph.

    ``target_bytes`` (default: the budget) is what the simulated peak must meet;
    the backend passes the budget less its headroom.
    Guarantees: with a budget, ``predicted_peak_bytes <= target_bytes``, unless
    ``best_effort`` is set, in which case the plan is the smallest-peak plan found
    and ``fits_budget`` says whether it fits. Raises ``BudgetInfeasibleError``
    naming the smallest feasible budget otherwise.
    """
    t0 = time.perf_counter()
    target = budget_bytes if target_bytes is None else target_bytes
    no_remat = evaluate(facts, _save_all(facts))
    mincut_saved = min_cut_saved(facts)
    mincut = evaluate(facts, mincut_saved)
    chosen, dropped = mincut, []
    if target is not None and mincut.simulation.peak_bytes > target:
        chosen, dropped = greedy_reduce_peak(facts, mincut, target)
    fits = target is None or chosen.simulation.peak_bytes <= target
    if not fits:
        assert target is not None
        chosen = _smallest_feasible(facts, mincut, target, chosen)
    if not fits and not best_effort:
        assert budget_bytes is not None and target is not None
        reasons = _infeasible_reasons(facts, chosen)
        peak = chosen.simulation.peak_bytes
        minimum = -(-peak * budget_bytes // max(target, 1))  # the budget whose target is this peak
        headroom = (
            "" if target == budget_bytes
            else f" (the plan keeps its simulated peak {100 * (1 - target / budget_bytes):.0f}% under the budget as headroom)"
        )
        raise BudgetInfeasibleError(
            f"budget {format_bytes(budget_bytes)} is below the smallest feasible budget "
            f"{format_bytes(minimum)}{headroom}: the smallest simulated peak any plan reaches is "
            f"{format_bytes(peak)}, and " + "; ".join(reasons)
            + f". Raise the budget to at least {minimum / 1e9:.4f} GB (1 GB = 1e9 bytes), "
            "or pass best_effort=True to run the smallest-peak plan anyway.",
            budget_bytes=budget_bytes,
            min_feasible_bytes=minimum,
            reasons=reasons,
        )
    part = chosen.partition
    return Plan(
        budget_bytes=budget_bytes,
        target_bytes=target,
        solver=solver,
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
        decisions=_decisions(facts, chosen, mincut_saved, dropped),
        fits_budget=fits,
    )
