"""Local search over saved sets, for small graphs: the last step of the default solver.

From a plan, the moves are: save one more value, save one and stop saving a
neighbour (its inputs, its users, and theirs), and, while the plan is over its
target, stop saving one. Each move is simulated (``evaluate``); the first that
improves is kept. When no single move improves, pairs of moves are tried. The work is bounded by a number of simulated
steps (``LOCAL_SEARCH_STEPS`` for all the searches of one solve), not by a clock, so the answer does not depend on
the machine's speed; graphs with more than ``LOCAL_SEARCH_MAX_STEPS`` steps are
left as they are.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .evaluate import Evaluated

if TYPE_CHECKING:
    from .solve_greedy import _Graph

LOCAL_SEARCH_STEPS = 8_000      # simulated steps one solve's local searches may spend, together
LOCAL_SEARCH_MAX_STEPS = 300    # graphs with more steps get no local search


def _relevant(g: _Graph) -> list[str]:
    """Forward values the backward reads, or that a recomputation of those could read; in graph order."""
    facts = g.facts
    found: set[str] = set()
    stack = [n for n in facts.needed_by_backward if facts.nodes[n].role == "forward"]
    while stack:
        name = stack.pop()
        if name in found or facts.nodes[name].role != "forward":
            continue
        found.add(name)
        stack.extend(facts.nodes[name].inputs)
    return sorted(found, key=g.position.__getitem__)


def _neighbours(g: _Graph, name: str, chosen: frozenset[str]) -> list[str]:
    """Chosen values next to ``name`` (its inputs, its users, and theirs): the drops worth pairing with saving it."""
    facts = g.facts
    near: set[str] = set()
    for first in (*facts.nodes[name].inputs, *facts.users[name]):
        near.add(first)
        near.update(facts.nodes[first].inputs)
        near.update(facts.users.get(first, ()))
    return sorted((n for n in near if n in chosen and n != name), key=g.position.__getitem__)


def _moves(g: _Graph, relevant: list[str], chosen: frozenset[str], with_drops: bool) -> list[frozenset[str]]:
    """Saved sets one step from ``chosen``: save one more value, or save one and drop a neighbour
    (and, ``with_drops``, drop one)."""
    moves: list[frozenset[str]] = []
    for name in relevant:
        if name in chosen or g.ban.get(name) is not None or g.facts.nodes[name].is_multi_output:
            continue
        moves.append(chosen | {name})
        moves.extend((chosen | {name}) - {other} for other in _neighbours(g, name, chosen))
    if with_drops:
        moves.extend(chosen - {name} for name in sorted(chosen, key=g.position.__getitem__))
    return moves


def local_search(g: _Graph, current: Evaluated, target_bytes: Optional[int]) -> Evaluated:
    """First-improvement search over the ``_moves`` of the current plan, each simulated, within
    LOCAL_SEARCH_STEPS simulated steps; when no single move improves, pairs of moves (the second
    from the plan the first makes, which may be over the target in between) are tried. With a target:
    least (bytes over the target, extra time); without (``None``): least (peak, extra time)."""
    if len(current.steps) > LOCAL_SEARCH_MAX_STEPS:
        return current
    budget = [g.local_steps_left // max(len(current.steps), 1)]
    spent_from = budget[0]
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
        return _moves(g, relevant, plan.chosen, with_drops=key(plan)[0] > 0 or target_bytes is None)

    while budget[0] > 0:
        step = None
        for chosen in moves(current):
            trial = simulated(chosen)
            if trial is not None and better(trial, current):
                step = trial
                break
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
    g.local_steps_left -= (spent_from - budget[0]) * len(current.steps)
    return current
