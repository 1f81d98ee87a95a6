"""Memory over time: simulate allocations and frees along a schedule of steps.

A ``Step`` allocates storages (id, bytes) and reads storages. A storage lives
from the step that allocates it to the last step that reads it; pinned storages
(forward outputs, gradients) are never freed within the simulated window.
Storages that no step allocates (parameters, inputs: the resident baseline) are
not counted. The live total is sampled right after each step allocates, while
its inputs are still live: that is when a kernel's inputs and outputs coexist.

Two Inductor mechanisms change when memory is really returned:

- In-place reuse (``config.inplace_buffers``): a storage a step lists in
  ``inplace`` is written over the input storage paired with it when that input
  dies at this step and has the same size, so it allocates nothing new. (A step
  marked ``reuses_inputs`` lets any output take over any such input.)
- Buffer reuse (``config.allow_buffer_reuse``, ``reuse_freed=True``): when a
  later allocation of the same size in the same graph can take a freed buffer
  over, Inductor renames the buffer instead of freeing it, so its memory stays
  held from the free to that allocation. It offers the most recently freed
  buffer of the size, and takes it only when holding it keeps Inductor's *own
  estimate* of the graph's memory under that estimate's peak (always when the
  allocation is in the very next kernel). That estimate knows no in-place reuse,
  counts buffers codegen later removes, and counts the backward's inputs that
  are views of the step's inputs (a saved transposed weight) until their last
  reader (both in ``Step.phantom_bytes``), so it can sit well above the real
  curve, and held buffers fill the gap: in the zoo's Llama under a tight plan
  this adds 40% to the backward's real peak. Storages
  of a step marked ``external`` (the autograd engine's incoming gradients) or
  not ``pooled`` (the tuple outputs of a library call), and storages made by the
  other graph, are never held. Nor, on CPU, is a storage written in place over a
  graph input (a saved value the backward overwrites), or over such a storage:
  the reuse key has an alignment bit (``codegen/wrapper.py: buffer_reuse_key``),
  every graph input is unaligned off GPU (``utils.should_assume_input_aligned``),
  an in-place output inherits its input's bit (``codegen/common.py:
  KernelArgs.make_inplace``) and a fresh allocation is aligned, so none takes it
  over (``aligned_inputs=False``; on the zoo's Llama two 698 kB silu gradients
  written over saved values were held 120 steps the generated code frees them in).

The simulation is a pure function over plain records, so the planner can run it
thousands of times and the report can draw its timeline.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Iterable, Sequence


SCRATCH_SUFFIX = "#scratch"   # the pseudo storage of a library call's working memory in ``live_at_peak``


@dataclass(frozen=True)
class Step:
    name: str                               # node name; "<node>@r<k>" for its k-th recomputation in the backward
    phase: str                              # "forward" | "backward": one compiled graph each
    allocs: tuple[tuple[str, int], ...]
    uses: tuple[str, ...]
    region: int = -1                        # recompute region id, -1 outside regions
    reuses_inputs: bool = False             # any output may take over any dying input of equal size
    phantom_bytes: int = 0                  # bytes only Inductor's estimate counts here (removed buffers, inputs outside the window)
    external: bool = False                  # allocated outside the compiled graph: freed, never pooled
    inplace: tuple[tuple[str, str], ...] = ()   # (storage allocated, input storage it may overwrite)
    pooled: bool = True                     # its storages wait in the reuse pool when freed (not a call's tuple outputs)
    scratch_bytes: int = 0                  # a library call's working memory, live only during this step


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


def _lifetimes(steps: Sequence[Step], pinned: set[str]) -> dict[int, list[str]]:
    """Storages to free after each step: after their last reader (or their allocation)."""
    allocated: set[str] = set()
    last_use: dict[str, int] = {}
    for index, step in enumerate(steps):
        for sid, _ in step.allocs:
            allocated.add(sid)
            last_use[sid] = max(last_use.get(sid, index), index)
        for sid in step.uses:
            if sid in allocated:
                last_use[sid] = index
    frees_at: dict[int, list[str]] = {}
    for sid, index in last_use.items():
        if sid not in pinned:
            frees_at.setdefault(index, []).append(sid)
    return frees_at


def _inductor_estimate(steps: Sequence[Step], frees_at: dict[int, list[str]]) -> list[int]:
    """Inductor's own estimate after each step's allocations: no in-place reuse, removed
    buffers counted, incoming gradients not counted. Each graph's estimate knows only its own
    buffers and its inputs (an earlier graph's storage is counted from the graph's start to its
    last reader there, and not at all if it reads none of it: e.g. the forward's outputs,
    alive during the backward, are not in the backward's estimate)."""
    used_in: dict[str, set[str]] = {}
    for step in steps:
        used_in.setdefault(step.phase, set()).update(step.uses)
    live = 0
    size: dict[str, int] = {}
    estimate = []
    phase = steps[0].phase if steps else ""
    for index, step in enumerate(steps):
        if step.phase != phase:
            phase = step.phase
            size = {sid: n for sid, n in size.items() if sid in used_in[phase]}
            live = sum(size.values())
        for sid, nbytes in step.allocs:
            if sid not in size and not step.external:
                size[sid] = nbytes
                live += nbytes
        estimate.append(live + step.phantom_bytes)
        for sid in frees_at.get(index, ()):
            live -= size.pop(sid, 0)
    return estimate


class _ReusePool:
    """Freed buffers of the running graph, and the estimate that gates taking one back."""

    def __init__(self, steps: Sequence[Step], estimate: list[int]) -> None:
        # Kernels are the steps that allocate or read; marker steps are not kernels.
        self.kernel_steps = [i for i, s in enumerate(steps) if s.allocs or s.uses]
        self.estimate = [estimate[i] for i in self.kernel_steps]
        self.graph_peak: dict[str, int] = {}
        for i, value in zip(self.kernel_steps, self.estimate):
            phase = steps[i].phase
            self.graph_peak[phase] = max(self.graph_peak.get(phase, 0), value)
        self.free: dict[int, list[tuple[str, int]]] = {}   # size -> [(storage, step freed after)]

    def put(self, sid: str, nbytes: int, index: int) -> None:
        self.free.setdefault(nbytes, []).append((sid, index))

    def take(self, nbytes: int, index: int, phase: str) -> str | None:
        """A pooled storage of this size to reuse at step ``index``, or None."""
        waiting = self.free.get(nbytes)
        if not waiting:
            return None
        sid, freed_after = waiting[-1]
        lo = bisect_right(self.kernel_steps, freed_after)
        hi = bisect_left(self.kernel_steps, index)
        if lo < hi and max(self.estimate[lo:hi]) + nbytes > self.graph_peak.get(phase, 0):
            return None
        waiting.pop()
        for k in range(lo, hi):
            self.estimate[k] += nbytes
        return sid

    def drain(self) -> None:
        self.free.clear()


def simulate_memory(steps: Sequence[Step], pinned: Iterable[str] = (), *, reuse_freed: bool = True,
                    aligned_inputs: bool = False) -> MemorySimulation:
    """Walk ``steps`` in order; return the peak above baseline and the timeline.

    ``reuse_freed``: model Inductor's ``allow_buffer_reuse`` (its default). ``aligned_inputs``:
    graph inputs count as aligned for buffer reuse (a GPU graph's); off, a storage written in
    place over one is never reused (see the module docstring).
    Guarantees: ``peak_bytes == max(timeline_bytes)`` (0 for no steps); a storage
    is counted from its allocating step through its last reader, and longer only
    while it waits in its graph's reuse pool for the allocation that takes it; a step's
    ``scratch_bytes`` count at that step alone, on top of what is live there.
    """
    pinned_set = set(pinned)
    frees_at = _lifetimes(steps, pinned_set)
    pool = _ReusePool(steps, _inductor_estimate(steps, frees_at)) if reuse_freed else None
    count = len(steps)
    start: dict[str, int] = {}
    end: dict[str, int] = {}                # last step the storage's bytes are counted at
    nbytes_of: dict[str, int] = {}
    alive: set[str] = set()
    poolable: set[str] = set()
    unaligned: set[str] = set()             # written in place over a graph input, or over such a storage
    phase = steps[0].phase if steps else ""
    for index, step in enumerate(steps):
        if pool is not None and step.phase != phase:
            pool.drain()                    # a graph's pool dies with it
        phase = step.phase
        # storages that die at this step, including ones an earlier output of it just allocated
        dying = set(frees_at.get(index, ())) if (step.reuses_inputs or step.inplace) else set()
        own = step_allocs_ids(step) if dying else set()
        over = dict(step.inplace)
        for sid, nbytes in step.allocs:
            if sid in alive or sid in start:
                continue
            if step.inplace:
                donor = over.get(sid)
                donor = donor if donor in dying and donor in alive and nbytes_of[donor] == nbytes else None
            else:
                donor = next((d for d in sorted(dying & alive, key=start.__getitem__)
                              if nbytes_of[d] == nbytes and d not in own), None)
            if donor is not None:           # written over an input that dies here
                dying.discard(donor)
                alive.discard(donor)
                end[donor] = index - 1
                if not aligned_inputs and (donor in unaligned or steps[start[donor]].phase != step.phase
                                           or steps[start[donor]].external):
                    unaligned.add(sid)
            elif pool is not None and step.pooled and not step.external:
                held = pool.take(nbytes, index, step.phase)
                if held is not None:        # a freed buffer held until now, renamed
                    end[held] = index - 1
            start[sid], end[sid], nbytes_of[sid] = index, count, nbytes
            alive.add(sid)
            if step.pooled and not step.external and sid not in unaligned:
                poolable.add(sid)
        for sid in frees_at.get(index, ()):
            if sid in alive:
                alive.discard(sid)
                end[sid] = index
                if pool is not None and sid in poolable and steps[start[sid]].phase == step.phase:
                    pool.put(sid, nbytes_of[sid], index)
    delta = [0] * (count + 1)
    for sid, first in start.items():
        if end[sid] >= first:
            delta[first] += nbytes_of[sid]
            delta[min(end[sid], count - 1) + 1] -= nbytes_of[sid]
    timeline: list[int] = []
    live = 0
    for index in range(count):
        live += delta[index]
        timeline.append(live + steps[index].scratch_bytes)
    peak_index = max(range(count), key=timeline.__getitem__) if count else -1
    peak_live = tuple((sid, nbytes_of[sid]) for sid in start if start[sid] <= peak_index <= end[sid]) if count else ()
    if count and steps[peak_index].scratch_bytes:
        peak_live += ((steps[peak_index].name + SCRATCH_SUFFIX, steps[peak_index].scratch_bytes),)
    return MemorySimulation(
        peak_bytes=timeline[peak_index] if count else 0,
        peak_step=peak_index,
        peak_step_name=steps[peak_index].name if count else "",
        live_at_peak=tuple(sorted(peak_live, key=lambda item: -item[1])),
        timeline_bytes=tuple(timeline),
        end_bytes=sum(nbytes_of[sid] for sid in start if end[sid] >= count),
    )
