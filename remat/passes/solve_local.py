"""Local search over saved sets, for small graphs: the last step of the default solver.

From a plan, the single moves are: save one more value, save one and stop saving a
neighbour (its inputs, its users, and theirs), and stop saving one (the time is not
monotone in the saved set: a value saved only briefly can cost a second recomputation
elsewhere). Each move is simulated (``evaluate``); the first that improves is kept.
When no single move improves, three ejection chains are tried, each bounded and each
judged by simulation:

- over the goal, stop saving two values live at the simulated peak (``_drop_two_at_peak``);
- save one more value and stop saving up to two values live at the peak, each the best
  of the simulated candidates (``_save_and_repair``);
- stop saving one value, then descend by single moves from there without saving it
  again (``_drop_and_refill``);

then pairs of single moves. These chains are what the greedy's misses against the
exhaustive optimum were made of on random graphs of a dozen values (save one, drop two;
drop one large value, save the several small ones its recomputation runs through).
The work is bounded by a number of simulated steps (``LOCAL_SEARCH_STEPS`` per search),
not by a clock, so the answer does not depend on the machine's speed; graphs with more
than ``LOCAL_SEARCH_MAX_STEPS`` steps are left as they are.
"""

from __future__ import annotations

from typing import Callable, Optional

from ..simulator import Evaluated
from ..simulator.schedule import forward_ancestors
from .solve_context import SearchContext

LOCAL_SEARCH_STEPS = 8_000      # simulated steps each local search may spend
LOCAL_SEARCH_MAX_STEPS = 300    # graphs with more steps get no local search
REPAIR_DROPS = 2                # values dropped after saving one more (_save_and_repair)


def _relevant(g: SearchContext) -> list[str]:
    """Forward values the backward reads, or that a recomputation of those could read; in graph order."""
    return sorted(forward_ancestors(g.facts, g.facts.needed_by_backward), key=g.position.__getitem__)


def _neighbours(g: SearchContext, name: str, chosen: frozenset[str]) -> list[str]:
    """Chosen values next to ``name`` (its inputs, its users, and theirs): the drops worth pairing with saving it."""
    facts = g.facts
    near: set[str] = set()
    for first in (*facts.nodes[name].inputs, *facts.users[name]):
        near.add(first)
        near.update(facts.nodes[first].inputs)
        near.update(facts.users.get(first, ()))
    return sorted((n for n in near if n in chosen and n != name), key=g.position.__getitem__)


def _moves(g: SearchContext, relevant: list[str], chosen: frozenset[str]) -> list[frozenset[str]]:
    """Saved sets one step from ``chosen``: save one more value, save one and drop a neighbour,
    or drop one."""
    moves: list[frozenset[str]] = []
    for name in relevant:
        if name in chosen or g.ban.get(name) is not None or g.facts.nodes[name].is_multi_output:
            continue
        moves.append(chosen | {name})
        moves.extend((chosen | {name}) - {other} for other in _neighbours(g, name, chosen))
    moves.extend(chosen - {name} for name in sorted(chosen, key=g.position.__getitem__))
    return moves


def _save_and_repair(g: SearchContext, relevant: list[str], current: Evaluated, target_bytes: int,
                     simulated: Callable[[frozenset[str]], Optional[Evaluated]],
                     better: Callable[[Evaluated, Evaluated], bool]) -> Optional[Evaluated]:
    """The first plan better than ``current`` made by saving one more value and, when that goes
    over the target, dropping up to REPAIR_DROPS values live at the simulated peak, each drop
    chosen by simulating every candidate (an ejection chain: save one, drop what the excess needs).

    Pairs of moves cannot reach "save one, drop two" within the step budget on a graph of a
    dozen values, and the descent's estimate of what a drop frees misses values fused into
    their backward reader; those were the greedy's misses against the exhaustive optimum.
    A value is tried only if saving it lowers the extra time, and a drop only if the plan it
    makes is still faster than ``current``: every other chain cannot end better.
    """
    for name in relevant:
        if name in current.chosen or g.ban.get(name) is not None or g.facts.nodes[name].is_multi_output:
            continue
        trial = simulated(current.chosen | {name})
        for _ in range(REPAIR_DROPS):
            if trial is None or trial.peak_bytes <= target_bytes or trial.extra_time_s >= current.extra_time_s:
                break
            trial = _best_drop(g, trial, name, current.extra_time_s, target_bytes, simulated)
        if trial is not None and better(trial, current):
            return trial
    return None


def _best_drop(g: SearchContext, plan: Evaluated, keep: str, time_limit_s: float, target_bytes: int,
               simulated: Callable[[frozenset[str]], Optional[Evaluated]]) -> Optional[Evaluated]:
    """Of ``plan`` less one chosen value live at its simulated peak (never ``keep``), each
    simulated: the fastest that fits, else the most peak lowered per second added; only plans
    faster than ``time_limit_s``. None when no drop lowers the peak."""
    drops = _at_peak(g, plan, keep)
    best_fit: Optional[Evaluated] = None
    best_step: Optional[tuple[float, Evaluated]] = None
    for name in drops:
        trial = simulated(plan.chosen - {name})
        if trial is None:
            break
        if trial.extra_time_s >= time_limit_s or trial.peak_bytes >= plan.peak_bytes:
            continue
        if trial.peak_bytes <= target_bytes:
            if best_fit is None or trial.extra_time_s < best_fit.extra_time_s:
                best_fit = trial
            continue
        rate = (plan.peak_bytes - trial.peak_bytes) / max(trial.extra_time_s - plan.extra_time_s, 1e-9)
        if best_step is None or rate > best_step[0]:
            best_step = (rate, trial)
    if best_fit is not None:
        return best_fit
    return None if best_step is None else best_step[1]


def _at_peak(g: SearchContext, plan: Evaluated, keep: str = "") -> list[str]:
    """Values ``plan`` saves by choice whose storages are live at its simulated peak (not ``keep``), in graph order."""
    live = {sid for sid, _ in plan.simulation.live_at_peak}
    nodes = g.facts.nodes
    return [n for n in sorted(plan.chosen, key=g.position.__getitem__)
            if n != keep and n in plan.partition.saved and live.intersection(nodes[n].value_storages)]


def _drop_two_at_peak(g: SearchContext, current: Evaluated, simulated: Callable[[frozenset[str]], Optional[Evaluated]],
                      better: Callable[[Evaluated, Evaluated], bool]) -> Optional[Evaluated]:
    """The first plan better than ``current`` (which is over its goal) made by dropping two values live
    at its peak: when two values are held at the peak and one's drop alone moves the peak to the other,
    no single drop lowers it."""
    names = _at_peak(g, current)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            trial = simulated(current.chosen - {first, second})
            if trial is None:
                return None
            if better(trial, current):
                return trial
    return None


def _drop_and_refill(g: SearchContext, relevant: list[str], current: Evaluated,
                     simulated: Callable[[frozenset[str]], Optional[Evaluated]],
                     better: Callable[[Evaluated, Evaluated], bool]) -> Optional[Evaluated]:
    """The first plan better than ``current`` made by dropping one saved value (a kick) and then
    descending by single moves (save one more value, most recompute time first; or stop saving
    one), each kept when the simulated plan is better; the kicked value is not saved again.

    The reverse of ``_save_and_repair``: one large value out, the small values its
    recomputation runs through in. The plan after the kick may be over the target, and saving
    a value may lower the peak (per-use instances) or stopping saving one lower the time (a
    value saved only for a short while), so the descent judges each move by simulation.
    """
    nodes = g.facts.nodes
    in_relevant = set(relevant)
    for kicked in sorted(current.chosen, key=g.position.__getitem__):
        if kicked not in current.partition.saved:
            continue
        trial = simulated(current.chosen - {kicked})
        changed = True
        while trial is not None and changed:      # again after each keep: a move refused before may help now
            changed = False
            adds = sorted((n for n in trial.partition.recomputed if n != kicked and n in in_relevant
                           and g.ban.get(n) is None and not nodes[n].is_multi_output),
                          key=lambda n: (-nodes[n].cost.est_time_s, g.position[n]))
            drops = [n for n in sorted(trial.chosen, key=g.position.__getitem__) if n in trial.partition.saved]
            for chosen in [trial.chosen | {n} for n in adds] + [trial.chosen - {n} for n in drops]:
                more = simulated(chosen)
                if more is None:
                    return None
                if better(more, trial):
                    trial, changed = more, True
                    break
        if trial is None:
            return None
        if better(trial, current):
            return trial
    return None


def local_search(g: SearchContext, current: Evaluated, target_bytes: Optional[int]) -> Evaluated:
    """First-improvement search over the ``_moves`` of the current plan, each simulated, within
    ``LOCAL_SEARCH_STEPS`` simulated steps (each call its own); when no single move improves,
    the ejection chains of the module docstring, then pairs of moves (the second from the plan
    the first makes, which may be over the target in between). With a target: least (bytes over
    the target, extra time); without (``None``): least (peak, extra time), the chains aiming one
    byte under the current peak. Returns a simulated plan no worse than ``current`` by that order."""
    if len(current.steps) > LOCAL_SEARCH_MAX_STEPS:
        return current
    budget = [LOCAL_SEARCH_STEPS // max(len(current.steps), 1)]
    relevant = _relevant(g)
    cache: dict[frozenset[str], Evaluated] = {current.chosen: current}

    def key(plan: Evaluated) -> tuple[int, float]:
        over = plan.peak_bytes if target_bytes is None else max(plan.peak_bytes - target_bytes, 0)
        return over, plan.extra_time_s

    def better(plan: Evaluated, than: Evaluated) -> bool:
        new, old = key(plan), key(than)
        return new[0] < old[0] or (new[0] == old[0] and new[1] < old[1] - 1e-15)

    def simulated(chosen: frozenset[str]) -> Optional[Evaluated]:
        if chosen not in cache:
            if budget[0] <= 0:
                return None
            budget[0] -= 1
            cache[chosen] = g.evaluate(chosen)
        return cache[chosen]

    def moves(plan: Evaluated) -> list[frozenset[str]]:
        return _moves(g, relevant, plan.chosen)

    while budget[0] > 0:
        step = None
        for chosen in moves(current):
            trial = simulated(chosen)
            if trial is not None and better(trial, current):
                step = trial
                break
        goal = target_bytes if target_bytes is not None else current.peak_bytes - 1
        over = current.peak_bytes > goal
        if step is None and over:
            step = _drop_two_at_peak(g, current, simulated, better)
        if step is None:
            step = _save_and_repair(g, relevant, current, goal, simulated, better)
        if step is None and (target_bytes is None or not over):
            step = _drop_and_refill(g, relevant, current, simulated, better)
        pairs = step is None
        for first in (moves(current) if pairs else []):
            middle = simulated(first)
            for chosen in moves(middle) if middle is not None else []:
                trial = simulated(chosen)
                if trial is not None and better(trial, current):
                    step = trial
                    break
            if step is not None or budget[0] <= 0:
                break
        if step is None:
            break
        current = step
    return current
