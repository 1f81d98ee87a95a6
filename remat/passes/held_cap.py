"""Hold less for the backward at the same peak: a cap on the bytes a plan saves.

A single graph's plan only has to meet its peak target. Under DDP or FSDP2 what a graph
saves for its backward stays alive while the *later* graphs of the step run, so the step's
ledger (``remat/distributed.py``) may refuse a plan that meets its own peak but holds too
much. ``reduce_saved_bytes`` takes such a plan and stops saving values (they are recomputed
in the backward instead), the least added recompute time per byte no longer held first,
never raising the simulated peak over the target, until the saved bytes meet the cap.

Pure over the joint graph's facts and ``evaluate``: no torch, no compile.
"""

from __future__ import annotations

from typing import Optional

from ..simulator import Evaluated, evaluate, partition_of
from .graph_analysis import CAP_TRIAL_ENTRIES
from .joint_graph import JointGraphFacts
from .mincut import saved_cost_bytes
from .recompute_bans import why_not_recomputable

# Each round simulates one plan per saved value it could drop; a cap needing more rounds than
# this is left unmet (the caller sees ``saved_bytes`` over the cap and decides).
MAX_ROUNDS = 64


def saved_bytes_of(facts: JointGraphFacts, plan: Evaluated) -> int:
    """Bytes the plan's forward keeps for its backward, as ``Plan.saved_bytes`` counts them."""
    return sum(saved_cost_bytes(facts, name) for name in plan.partition.saved)


def reduce_saved_bytes(facts: JointGraphFacts, start: Evaluated, target_bytes: int, cap_bytes: int) -> Evaluated:
    """A plan saving at most ``cap_bytes`` whose simulated peak stays <= ``target_bytes``, or the
    closest to the cap this greedy reaches.

    Guarantees: the result's peak is <= ``max(target_bytes, start's peak)``; its saved bytes are
    <= ``start``'s; every step it takes lowers the saved bytes; values that may not be recomputed
    stay saved (``schedule.why_not_recomputable``). Each round drops the saved value with the least
    added recompute time per byte it frees (ties: fewer bytes left, then graph order), so the
    answer does not depend on hash seeds.
    """
    current, held = start, saved_bytes_of(facts, start)
    peak_limit = max(target_bytes, start.peak_bytes)
    position = facts.position()
    for _ in range(MAX_ROUNDS):
        if held <= cap_bytes:
            break
        best: Optional[tuple[float, int, int, str]] = None
        for name in sorted(current.chosen, key=position.__getitem__):
            if why_not_recomputable(facts, name) is not None:
                continue
            saved, peak, extra_time_s = _trial(facts, current.chosen - {name}, held)
            freed = held - saved
            if freed <= 0 or peak > peak_limit:
                continue
            key = ((extra_time_s - current.extra_time_s) / freed, held - freed, position[name])
            if best is None or key < best[:3]:
                best = (*key, name)
        if best is None:
            break
        current, held = evaluate(facts, current.chosen - {best[3]}), best[1]
    return current


def _trial(facts: JointGraphFacts, chosen: frozenset[str], held_bytes: int) -> tuple[int, int, float]:
    """(saved bytes, simulated peak, extra time s) of saving ``chosen``, as ``evaluate`` gives them;
    when it saves no less than ``held_bytes`` (the trial frees nothing: about half of them on a
    GPT-2 body), the plan is not simulated and its peak and time are reported as 0. Remembered in the
    graph's analysis: the capped plans of nearby targets (a step's share search asks for several)
    walk through many of the same saved sets."""
    known = facts.analysis.cap_trials
    numbers = known.get(chosen)
    if numbers is None or (numbers[1] < 0 and numbers[0] < held_bytes):
        _, partition = partition_of(facts, chosen)
        saved = sum(saved_cost_bytes(facts, name) for name in partition.saved)
        if saved >= held_bytes:
            numbers = (saved, -1, 0.0)       # not simulated
        else:
            trial = evaluate(facts, chosen)
            numbers = (saved, trial.peak_bytes, trial.extra_time_s)
        if len(known) >= CAP_TRIAL_ENTRIES:
            known.clear()
        known[chosen] = numbers
    return numbers[0], max(numbers[1], 0), numbers[2]


__all__ = ["MAX_ROUNDS", "reduce_saved_bytes", "saved_bytes_of"]
