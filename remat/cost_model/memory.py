"""Memory over time: simulate allocations and frees along a schedule of steps.

A ``Step`` allocates storages (id, bytes) and reads storages. A storage lives
from the step that allocates it to the last step that reads it; pinned storages
(forward outputs, gradients) are never freed within the simulated window.
Storages that no step allocates (parameters, inputs: the resident baseline) are
not counted. The live total is sampled right after each step allocates, while
its inputs are still live: that is when a kernel's inputs and outputs coexist.
The exception is a step marked ``reuses_inputs`` (an Inductor pointwise kernel):
like Inductor's in-place buffer reuse, each output of it takes over an input
storage of the same size whose last use is this step, so it allocates nothing new.

The simulation is a pure function over plain records, so the planner can run it
thousands of times and the report can draw its timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass(frozen=True)
class Step:
    name: str                               # node name, with "@r" for a backward recomputation
    phase: str                              # "forward" | "backward"
    allocs: tuple[tuple[str, int], ...]
    uses: tuple[str, ...]
    region: int = -1                        # recompute region id, -1 outside regions
    reuses_inputs: bool = False             # a fused pointwise kernel: writes into a dying input of equal size


@dataclass(frozen=True)
class MemorySimulation:
    peak_bytes: int
    peak_step: int                          # index into steps
    peak_step_name: str
    live_at_peak: tuple[tuple[str, int], ...]   # (storage id, bytes), largest first
    timeline_bytes: tuple[int, ...]         # live bytes right after each step's allocations
    end_bytes: int                          # live bytes after the last step (pinned outputs)


def step_allocs_ids(step: Step) -> set[str]:
    return {sid for sid, _ in step.allocs}


def simulate_memory(steps: Sequence[Step], pinned: Iterable[str] = ()) -> MemorySimulation:
    """Walk ``steps`` in order; return the peak above baseline and the timeline.

    Guarantees: ``peak_bytes == max(timeline_bytes)`` (0 for no steps), and a
    storage is counted from its allocating step through its last reader.
    """
    pinned_set = set(pinned)
    size: dict[str, int] = {}
    last_use: dict[str, int] = {}
    for index, step in enumerate(steps):
        for sid, nbytes in step.allocs:
            size[sid] = nbytes
            last_use[sid] = max(last_use.get(sid, index), index)
        for sid in step.uses:
            if sid in size:
                last_use[sid] = index
    frees_at: dict[int, list[str]] = {}
    for sid, index in last_use.items():
        if sid not in pinned_set:
            frees_at.setdefault(index, []).append(sid)

    live = 0
    live_set: dict[str, int] = {}
    timeline: list[int] = []
    peak, peak_index, peak_live = 0, -1, ()
    for index, step in enumerate(steps):
        dying = [sid for sid in frees_at.get(index, ()) if sid in live_set] if step.reuses_inputs else []
        for sid, nbytes in step.allocs:
            if sid in live_set:
                continue
            donor = next((d for d in dying if live_set[d] == nbytes and d not in step_allocs_ids(step)), None)
            if donor is not None:
                dying.remove(donor)
                live -= live_set.pop(donor)
            live_set[sid] = nbytes
            live += nbytes
        timeline.append(live)
        if live > peak or peak_index < 0:
            peak, peak_index = live, index
            peak_live = tuple(live_set.items())
        for sid in frees_at.get(index, ()):
            live -= live_set.pop(sid, 0)
    ranked = tuple(sorted(peak_live, key=lambda item: -item[1]))
    return MemorySimulation(
        peak_bytes=peak,
        peak_step=peak_index,
        peak_step_name=steps[peak_index].name if steps else "",
        live_at_peak=ranked,
        timeline_bytes=tuple(timeline),
        end_bytes=live,
    )
