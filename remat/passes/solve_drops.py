"""What stopping saving a value frees, for the greedy's descent (``solve_greedy.py``).

``drop_options(ctx, plan)`` lists the groups of saved values a plan can stop saving (values that
share a storage go together: a view keeps its base alive) with, for each storage they hold, the
steps of the plan's simulated timeline it stops being live on: from after the last forward step
that touches it to before the first backward step that reads it. Values that may not be
recomputed, multi-output values, and storages the plan pins are never offered.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..simulator import Evaluated
from .solve_context import SearchContext


@dataclass(frozen=True)
class DropOption:
    """Dropping ``members`` (saved values sharing storages) frees ``spans``: (first step, last step, bytes)."""

    members: tuple[str, ...]
    spans: tuple[tuple[int, int, int], ...]
    position: int

    def freed_at(self, step: int) -> int:
        return sum(nbytes for lo, hi, nbytes in self.spans if lo <= step <= hi)


def storage_steps(current: Evaluated) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Per storage: its bytes, the last forward step that touches it, the first backward step that reads it."""
    nbytes: dict[str, int] = {}
    last_forward: dict[str, int] = {}
    first_backward: dict[str, int] = {}
    for index, step in enumerate(current.steps):
        if step.phase == "forward":
            for sid, size in step.allocs:
                nbytes[sid] = size
                last_forward[sid] = index
            for sid in step.uses:
                last_forward[sid] = index
        else:
            for sid, size in step.allocs:
                nbytes.setdefault(sid, size)
                first_backward.setdefault(sid, index)
            for sid in step.uses:
                first_backward.setdefault(sid, index)
    return nbytes, last_forward, first_backward


def drop_options(g: SearchContext, current: Evaluated) -> list[DropOption]:
    """Groups of chosen values that can stop being saved, with the bytes that frees and where."""
    facts, part = g.facts, current.partition
    holders: dict[str, list[str]] = {}
    for name in sorted(part.saved, key=g.position.__getitem__):
        for sid in facts.nodes[name].value_storages:
            holders.setdefault(sid, []).append(name)
    # saved values that share a storage are dropped together (a view keeps its base alive)
    group_of: dict[str, str] = {}

    def find(name: str) -> str:
        while group_of.get(name, name) != name:
            name = group_of[name]
        return name

    for names in holders.values():
        root = find(names[0])
        for other in names[1:]:
            other_root = find(other)
            if other_root != root:
                group_of[other_root] = root
    groups: dict[str, list[str]] = {}
    for name in sorted(part.saved, key=g.position.__getitem__):
        groups.setdefault(find(name), []).append(name)
    nbytes, last_forward, first_backward = storage_steps(current)
    options = []
    for members in groups.values():
        if any(m not in current.chosen or g.ban.get(m) is not None or facts.nodes[m].is_multi_output for m in members):
            continue
        spans = []
        for sid in sorted({s for m in members for s in facts.nodes[m].value_storages}):
            owner = facts.nodes.get(sid.split("#")[0])
            if owner is None or owner.role != "forward" or sid in current.pinned or sid not in nbytes:
                continue
            lo, hi = last_forward.get(sid, -1) + 1, first_backward.get(sid, len(current.steps)) - 1
            if lo <= hi and nbytes[sid] > 0:
                spans.append((lo, hi, nbytes[sid]))
        if spans:
            options.append(DropOption(tuple(members), tuple(spans), g.position[members[0]]))
    return options


__all__ = ["DropOption", "drop_options", "storage_steps"]
