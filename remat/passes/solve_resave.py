"""Saving recomputed values again: which ones, ranked by the recompute time they would remove.

A plan found by chasing the lowest peak (``solve_greedy.smallest_peak``) can recompute far more
than its peak needs: the descent drops values for bytes and never looks back at time, and a
value rebuilt per use (``schedule.rebuilds_intermediates``) is charged once per instance. On the
Hugging Face T5 of ``benchmarks/hf_models.py`` at half of plain Inductor's peak, the smallest-peak
plan simulated 29.65 MB with 95.6 ms of estimated recompute; saving two values again (each
re-simulated) gave 28.27 MB and 23.6 ms, under the 28.57 MB target the search had refused.

- ``resave_options``: the recomputed values a plan could save again, with the bytes and the span
  of simulated steps that saving would hold them over (what the polish's estimate reads).
- ``recompute_time_removed``: for each recomputed value, the estimated recompute time its saving
  would remove: every instance of it the backward runs, and every instance of a value recomputed
  only on the way to those (read by nothing else that stays). Read off the plan's backward
  schedule (``Evaluated.backward_order``) without simulating: an estimate that assumes the rest of
  the schedule stays as it is; each candidate is then simulated before it is kept.
- ``resave_descent``: first-improvement descent over those candidates, most time removed first,
  each simulated; keeps a candidate when the peak stays within a limit and the extra time drops.
"""

from __future__ import annotations

from typing import Optional

from ..simulator import Evaluated
from ..simulator.kernel_facts import RECOMPUTE_SUFFIX
from .solve_context import SearchContext

RESAVE_STEPS = 60_000           # simulated steps one resave descent may spend (at least MIN_RESAVE_EVALUATIONS)
MIN_RESAVE_EVALUATIONS = 4
MAX_RESAVE_EVALUATIONS = 24
MAX_RESAVE_MISSES = 8           # consecutive candidates that did not help: the descent stops


def resave_options(g: SearchContext, current: Evaluated) -> list[tuple[float, str, int, int, int]]:
    """Recomputed values that could be saved again: (time saved per byte, name, bytes, first step,
    last step), most time per byte first (ties: graph position). The time is the value's own
    estimate; the step span is from where the forward makes it to its first recomputed use."""
    facts = g.facts
    forward_index = {step.name: i for i, step in enumerate(current.steps) if step.phase == "forward"}
    ordered_forward = sorted(forward_index.values())
    first_use: dict[str, int] = {}   # original storage -> first backward step touching a recomputed copy
    for index, step in enumerate(current.steps):
        if step.phase == "backward":
            for sid in (*step.uses, *(s for s, _ in step.allocs)):
                base, mark, _ = sid.rpartition(RECOMPUTE_SUFFIX)
                if mark:
                    first_use.setdefault(base, index)
    held = {s for name in current.partition.saved for s in facts.nodes[name].value_storages}
    options = []
    for name in sorted(current.partition.recomputed, key=g.position.__getitem__):
        node = facts.nodes[name]
        if node.is_multi_output:
            continue
        storages = [s for s in node.value_storages if s not in held]
        nbytes = 0
        for sid in storages:
            owner = facts.nodes.get(sid.split("#")[0])
            if owner is not None and owner.role == "forward":
                nbytes += dict(owner.allocs).get(sid, 0)
        uses = [first_use[s] for s in storages if s in first_use]
        lo = forward_index.get(name)
        if lo is None:   # not computed in this plan's forward: place it after its latest computed input
            lo = max((forward_index.get(i, 0) for i in node.inputs), default=0)
            lo = next((i for i in ordered_forward if i >= lo), lo)
        hi = min(uses) - 1 if uses else len(current.steps) - 1
        saved_s = node.cost.est_time_s
        if saved_s <= 0:
            continue
        options.append((saved_s / max(nbytes, 1), name, nbytes, lo, hi))
    options.sort(key=lambda o: (-o[0], g.position[o[1]]))
    return options


def recompute_time_removed(g: SearchContext, current: Evaluated) -> dict[str, float]:
    """Recomputed value -> estimated seconds of recomputation that saving it would remove from
    ``current``'s backward: its instances, and the instances whose every reader is removed with
    them (a chain recomputed only to build it), summed at each node's ``cost.est_time_s``.
    Guarantees: each value's figure is at most ``current.extra_time_s`` (up to rounding) and
    counts an instance at most once."""
    order = current.backward_order
    seconds = {s.instance: g.facts.nodes[s.name].cost.est_time_s for s in order if s.region >= 0}
    instances: dict[str, list[str]] = {}
    readers: dict[str, list[str]] = {}
    reads: dict[str, tuple[str, ...]] = {}
    for s in order:
        if s.region >= 0:
            instances.setdefault(s.name, []).append(s.instance)
        reads[s.instance] = tuple(instance for _, instance in s.reads)
        for instance in reads[s.instance]:
            readers.setdefault(instance, []).append(s.instance)
    removed_s: dict[str, float] = {}
    for name, own in instances.items():
        gone, stack, total = set(own), list(own), 0.0
        while stack:
            instance = stack.pop()
            total += seconds[instance]
            for read in reads.get(instance, ()):
                if read in seconds and read not in gone and all(r in gone for r in readers.get(read, ())):
                    gone.add(read)
                    stack.append(read)
        removed_s[name] = total
    return removed_s


def resave_descent(g: SearchContext, current: Evaluated, peak_limit_bytes: Optional[int] = None) -> Evaluated:
    """Save recomputed values again, one at a time, most estimated recompute time removed first
    (``recompute_time_removed``); each is simulated and kept when the simulated peak stays at or
    under ``peak_limit_bytes`` (None: under ``current``'s own peak as it goes, so the peak never
    rises) and the extra time drops. Stops after ``MAX_RESAVE_MISSES`` candidates in a row that were
    not kept, when no candidate is left, or when the simulations reach the smaller of
    ``MAX_RESAVE_EVALUATIONS`` and ``RESAVE_STEPS`` simulated steps (at least
    ``MIN_RESAVE_EVALUATIONS``). Guarantees: the plan returned was simulated, is ``current`` or
    has less extra time at a peak within the limit."""
    allowed = min(MAX_RESAVE_EVALUATIONS, max(MIN_RESAVE_EVALUATIONS, RESAVE_STEPS // max(len(current.steps), 1)))
    spent = misses = 0
    tried: set[str] = set()
    while spent < allowed and misses < MAX_RESAVE_MISSES:
        removed = recompute_time_removed(g, current)
        ranked = sorted((name for _, name, _, _, _ in resave_options(g, current)
                         if name not in tried and removed.get(name, 0.0) > 0),
                        key=lambda name: (-removed[name], g.position[name]))
        if not ranked:
            break
        limit = current.peak_bytes if peak_limit_bytes is None else peak_limit_bytes
        for name in ranked:
            if spent >= allowed or misses >= MAX_RESAVE_MISSES:
                break
            tried.add(name)
            trial = g.evaluate(current.chosen | {name})
            spent += 1
            if trial.peak_bytes <= limit and trial.extra_time_s < current.extra_time_s:
                current, misses = trial, 0
                break
            misses += 1
    return current


__all__ = ["MAX_RESAVE_EVALUATIONS", "MAX_RESAVE_MISSES", "RESAVE_STEPS", "recompute_time_removed", "resave_descent",
           "resave_options"]
