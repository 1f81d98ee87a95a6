"""A step's phases in the window that measures it: each graph's forward entry and return, its backward's start and
end, and the compiles inside the window (``measure.StepWindow.mark_phase``, ``measure.mark_compile``; ``step_eager.StepEagerHooks.phase``), and how
much was live in each phase (``peaks_by_phase``, read by ``StepWindow.close`` into ``phase_peaks``): where a step of
several graphs held memory no generated code states (``step_eager.eager_by_graph``).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from .profile_events import live_after_each, profiled_events

# the phases of a step of several graphs a window marks (``StepWindow.mark_phase``): each graph's forward entry and
# return, its backward's start and end ("fwd-enter:<graph>", "fwd-exit:", "bwd-enter:", "bwd-exit:"), which say
# how much was live in each (``StepWindow.phase_peaks``)
STEP_PHASE_PREFIX = "remat::step::"
COMPILE_STARTED, COMPILE_ENDED = "compile-start", "compile-end"     # (``mark_compile``)


def phase_markers(prof: Any, prefix: str) -> list[tuple[int, str]]:
    """``(time_ns, name without prefix)`` of every ``record_function`` event of a finished profile whose name starts
    with ``prefix``, in time order."""
    return sorted((e.start_time_ns, e.name[len(prefix):]) for e in profiled_events(prof) if e.name.startswith(prefix))


def peaks_by_phase(events: Iterable[tuple[int, int, int]], phases: Sequence[tuple[int, str]]) -> dict[str, int]:
    """The most live (``window_peak``'s rule) in each phase: from each of ``phases`` (``(time_ns, name)``, time order)
    to the next, by name (a name marked several times: the most over its intervals), the level it began at
    included; "" for before the first. A compile inside the window (from a ``COMPILE_STARTED`` phase to the next
    ``COMPILE_ENDED``) is no phase of its own and its allocations and frees are left out (memory it keeps is then
    never counted, memory from before it that it frees lowers nothing): what the step's own code held. Pure."""
    compiling, kept, boundaries = None, [], []
    for time_ns, name in phases:
        if name == COMPILE_STARTED:
            compiling = time_ns if compiling is None else compiling
        elif name == COMPILE_ENDED:
            if compiling is not None:
                boundaries.append((compiling, time_ns))
            compiling = None
        else:
            kept.append((time_ns, name))
    if compiling is not None:
        boundaries.append((compiling, float("inf")))
    events = [e for e in events if not any(start <= e[0] <= end for start, end in boundaries)]
    times, names = [t for t, _ in kept], [""] + [name for _, name in kept]
    peaks: dict[str, int] = {"": 0}
    index, live = 0, 0

    def enter_phases_until(time_ns: float) -> None:
        nonlocal index
        while index < len(times) and times[index] <= time_ns:
            index += 1
            peaks[names[index]] = max(peaks.get(names[index], 0), live)

    for time_ns, after, _ in live_after_each(events):
        enter_phases_until(time_ns)
        peaks[names[index]] = max(peaks[names[index]], after)
        live = after
    enter_phases_until(float("inf"))
    return peaks
