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
from ..simulator.schedule import backward_order, recompute_time_of
from .graph_analysis import CAP_TRIAL_ENTRIES
from .joint_graph import JointGraphFacts
from .partition import Partition
from .mincut import saved_cost_bytes
from .recompute_bans import why_not_recomputable

# Each round simulates one plan per saved value it could drop; a cap needing more rounds than
# this is left unmet (the caller sees ``saved_bytes`` over the cap and decides).
MAX_ROUNDS = 64
# ``reduce_saved_bytes``'s searches: the greedy, and one pass in its first round's order before the greedy's rounds.
SAVED_CAP_SEARCHES = ("greedy", "one-pass-first")


def saved_bytes_of(facts: JointGraphFacts, plan: Evaluated) -> int:
    """Bytes the plan's forward keeps for its backward, as ``Plan.saved_bytes`` counts them."""
    return _partition_saved_bytes(facts, plan.partition)


def _partition_saved_bytes(facts: JointGraphFacts, partition: Partition) -> int:
    return sum(saved_cost_bytes(facts, name) for name in partition.saved)


def reduce_saved_bytes(facts: JointGraphFacts, start: Evaluated, target_bytes: int, cap_bytes: int,
                       search: str = "greedy") -> Evaluated:
    """A plan saving at most ``cap_bytes`` whose simulated peak stays <= ``target_bytes``, or the
    closest to the cap this search reaches.

    Guarantees (either ``search``): the result's peak is <= ``max(target_bytes, start's peak)``; its
    saved bytes are <= ``start``'s; every step it takes lowers the saved bytes; values that may not be
    recomputed stay saved (``recompute_bans.why_not_recomputable``); the answer does not depend on hash
    seeds.

    ``search="greedy"``: each round drops the saved value with the least added recompute time per byte
    it frees (ties: fewer bytes left, then graph order). A round simulates only the drops that can still
    win (``_best_drop``): the same value as simulating every drop, for a few simulations where that took
    one per saved value. ``search="one-pass-first"``: ``_drops_in_one_pass`` first (each saved
    value tried once, in the order the greedy's first round ranks them), then the greedy's rounds from
    where it ends: the rounds start from a plan that already saves little, so there are few of them. Its
    drops are not the greedy's, so its plan may recompute more; for a plan whose recompute time counts for
    little (step 1's provisional plans at a graph break). One pass alone ends holding more: on hf-1497's
    body (a drawn GPT-2) 1.11 MB where the greedy and this search hold 0.86 MB, and that step's floor rose 10%.
    """
    if search not in SAVED_CAP_SEARCHES:
        raise ValueError(f"saved-cap search {search!r}: expected one of {SAVED_CAP_SEARCHES}")
    peak_limit = max(target_bytes, start.peak_bytes)
    current = start if search == "greedy" else _drops_in_one_pass(facts, start, peak_limit, cap_bytes)
    held = saved_bytes_of(facts, current)
    for _ in range(MAX_ROUNDS):
        if held <= cap_bytes:
            break
        simulated: dict[frozenset[str], Evaluated] = {}     # this round's trials, the winner's re-used
        best = _best_drop(facts, current, held, peak_limit, simulated)
        if best is None:
            break
        chosen = current.chosen - {best[1]}
        current, held = simulated.get(chosen) or evaluate(facts, chosen), best[0]
    return current


def _drops_in_one_pass(facts: JointGraphFacts, start: Evaluated, peak_limit_bytes: int, cap_bytes: int) -> Evaluated:
    """``reduce_saved_bytes``'s guarantees in one pass: the saved values ranked once by the greedy's
    first-round lower bound (added recompute time per byte freed, ``_drop_bounds``), each dropped from
    the plan so far if that frees bytes and keeps the simulated peak <= ``peak_limit_bytes``, until the
    saved bytes meet the cap. At most one simulation per saved value (the greedy simulates a few per
    round, one round per drop). The ranking is not refreshed after a drop, so it may stop holding more
    than the greedy would (``reduce_saved_bytes``'s ``"one-pass-first"`` goes on with the greedy's rounds)."""
    current, held = start, saved_bytes_of(facts, start)
    for _, _, _, name in _drop_bounds(facts, start, held):
        if held <= cap_bytes:
            break
        if name not in current.chosen:
            continue
        chosen, simulated = current.chosen - {name}, {}
        saved, peak, _ = _trial(facts, chosen, held, simulated)
        if saved < held and peak <= peak_limit_bytes:
            current, held = simulated.get(chosen) or evaluate(facts, chosen), saved
    return current


def _drop_bounds(facts: JointGraphFacts, current: Evaluated, held_bytes: int) -> list[tuple[float, int, int, str]]:
    """(lower bound on the added recompute time per byte freed, saved bytes after, graph position, value)
    of dropping each saved value of ``current`` that may be recomputed and whose drop frees bytes, sorted:
    the bound is the time of the backward that builds every recomputed value once and holds it
    (``schedule.backward_order(..., rebuild=False)``), which needs no simulation and never exceeds the time
    the simulation charges."""
    position = facts.position()
    bounds: list[tuple[float, int, int, str]] = []
    for name in sorted(current.chosen, key=position.__getitem__):
        if why_not_recomputable(facts, name) is not None:
            continue
        _, partition = partition_of(facts, current.chosen - {name})
        saved = _partition_saved_bytes(facts, partition)
        freed = held_bytes - saved
        if freed <= 0:
            continue
        least_time_s = recompute_time_of(facts, backward_order(facts, partition, False))
        bounds.append(((least_time_s - current.extra_time_s) / freed, saved, position[name], name))
    return sorted(bounds)


def _best_drop(facts: JointGraphFacts, current: Evaluated, held_bytes: int, peak_limit_bytes: int,
               simulated: dict[frozenset[str], Evaluated]) -> Optional[tuple[int, str]]:
    """(saved bytes after, value) of the round's drop: among the saved values whose drop frees bytes
    and keeps the simulated peak <= ``peak_limit_bytes``, the one with the least key (added recompute
    time per byte freed, then bytes left, then graph position); None when no drop qualifies.

    Exact with few simulations: a drop's added time is at least what its backward costs when every
    recomputed value is built once and held (``schedule.backward_order(..., rebuild=False)``; the
    schedule the simulation picks builds the same values, some more than once), which needs no
    simulation. Drops are simulated in the order of that lower bound's key, and the search stops at the
    first whose bound's key exceeds the best simulated key: no later drop can beat it (the keys differ
    only in the first field, and a bound never exceeds the time it bounds). The plans it simulates
    are added to ``simulated``."""
    position = facts.position()
    best: Optional[tuple[float, int, int, str]] = None
    for bound in _drop_bounds(facts, current, held_bytes):
        if best is not None and bound > best:
            break
        name = bound[3]
        saved, peak, extra_time_s = _trial(facts, current.chosen - {name}, held_bytes, simulated)
        if peak > peak_limit_bytes:
            continue
        key = ((extra_time_s - current.extra_time_s) / (held_bytes - saved), saved, position[name], name)
        if best is None or key < best:
            best = key
    return None if best is None else (best[1], best[3])


def _trial(facts: JointGraphFacts, chosen: frozenset[str], held_bytes: int,
           simulated: dict[frozenset[str], Evaluated]) -> tuple[int, int, float]:
    """(saved bytes, simulated peak, extra time s) of saving ``chosen``, as ``evaluate`` gives them;
    when it saves no less than ``held_bytes`` (the trial frees nothing: about half of them on a
    GPT-2 body), the plan is not simulated and its peak and time are reported as 0. Remembered in the
    graph's analysis: the capped plans of nearby targets (a step's share search asks for several)
    walk through many of the same saved sets. A plan simulated now is added to ``simulated``."""
    known = facts.analysis.cap_trials
    numbers = known.get(chosen)
    if numbers is None or (numbers[1] < 0 and numbers[0] < held_bytes):
        _, partition = partition_of(facts, chosen)
        saved = _partition_saved_bytes(facts, partition)
        if saved >= held_bytes:
            numbers = (saved, -1, 0.0)       # not simulated
        else:
            trial = simulated[chosen] = evaluate(facts, chosen)
            numbers = (saved, trial.peak_bytes, trial.extra_time_s)
        if len(known) >= CAP_TRIAL_ENTRIES:
            known.clear()
        known[chosen] = numbers
    return numbers[0], max(numbers[1], 0), numbers[2]


__all__ = ["MAX_ROUNDS", "SAVED_CAP_SEARCHES", "reduce_saved_bytes", "saved_bytes_of"]
