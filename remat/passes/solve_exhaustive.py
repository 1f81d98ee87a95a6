"""Ground truth for tiny graphs: simulate every saved set.

The candidates are the forward values the backward can reach through forward
values that a plan may choose to save: not forced (random ops, mutations,
symbolic sizes are saved whenever needed), not tuple-valued, and holding bytes
(a value aliasing a parameter costs nothing to save or to recompute, so it is
left to the closure). Every subset of the candidates is closed into a partition
and simulated with ``evaluate.evaluate``; ``2**n`` simulations, so ``n`` is capped.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Optional, Sequence

from .joint_graph import JointGraphFacts
from .mincut import saved_cost_bytes
from ..simulator import evaluate
from .recompute_bans import why_not_recomputable
from .solve_milp import relevant_forward

MAX_CANDIDATES = 16


@dataclass(frozen=True)
class PlanPoint:
    chosen_saved: tuple[str, ...]
    est_extra_time_s: float
    simulated_peak_bytes: int
    recomputed: tuple[str, ...]


def exhaustive_candidates(facts: JointGraphFacts) -> tuple[str, ...]:
    return tuple(
        name for name in relevant_forward(facts)
        if why_not_recomputable(facts, name) is None
        and not facts.nodes[name].is_multi_output
        and saved_cost_bytes(facts, name) > 0
    )


def enumerate_plans(facts: JointGraphFacts, *, max_candidates: int = MAX_CANDIDATES) -> tuple[PlanPoint, ...]:
    """Every saved set over the candidates, simulated. Raises ValueError above ``max_candidates``."""
    candidates = exhaustive_candidates(facts)
    if len(candidates) > max_candidates:
        raise ValueError(
            f"{len(candidates)} candidates is too many to enumerate (2**{len(candidates)} simulations); "
            f"the limit is max_candidates={max_candidates}"
        )
    points = []
    for mask in itertools.product((False, True), repeat=len(candidates)):
        chosen = frozenset(name for name, keep in zip(candidates, mask) if keep)
        trial = evaluate(facts, chosen)
        points.append(PlanPoint(
            chosen_saved=tuple(sorted(chosen)),
            est_extra_time_s=trial.extra_time_s,
            simulated_peak_bytes=trial.simulation.peak_bytes,
            recomputed=tuple(sorted(trial.partition.recomputed)),
        ))
    return tuple(points)


def best_under(points: Sequence[PlanPoint], target_bytes: int) -> Optional[PlanPoint]:
    """The least-extra-time point whose peak meets the target (lower peak breaks ties); None if none."""
    feasible = [p for p in points if p.simulated_peak_bytes <= target_bytes]
    if not feasible:
        return None
    return min(feasible, key=lambda p: (p.est_extra_time_s, p.simulated_peak_bytes, p.chosen_saved))


@dataclass(frozen=True)
class ExhaustiveResult:
    status: str                       # "optimal" | "infeasible"
    best: Optional[PlanPoint]
    min_peak_bytes: int               # the smallest simulated peak any saved set reaches
    plans_simulated: int
    solve_time_s: float


def solve_exhaustive(
    facts: JointGraphFacts, target_bytes: int, *, max_candidates: int = MAX_CANDIDATES
) -> ExhaustiveResult:
    """Least estimated extra time over every saved set whose simulated peak is <= ``target_bytes``."""
    t0 = time.perf_counter()
    points = enumerate_plans(facts, max_candidates=max_candidates)
    best = best_under(points, target_bytes)
    return ExhaustiveResult(
        status="optimal" if best is not None else "infeasible",
        best=best,
        min_peak_bytes=min(p.simulated_peak_bytes for p in points),
        plans_simulated=len(points),
        solve_time_s=time.perf_counter() - t0,
    )
