"""The peak each of a few short calls allocates, measured in one session: the probes made while a graph compiles.

Split from ``measure.py`` (session 49), which measures steps: a library call's working memory is probed here
(``simulator/library_scratch.py``), by the rule ``measure.window_peak`` reads a step with.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from .measure import cpu_allocation_events, open_window, profiler_running, window_peak
from .profile_events import profiled_events


def calls_peak_bytes(calls: Sequence[Callable[[], Any]], device: torch.device | str = "cpu",
                     measured: Optional[Sequence[bool]] = None) -> Optional[list[int]]:
    """The peak bytes each of ``calls`` allocates above its own start (as ``measure_peak_bytes`` counts
    them: only allocations made inside it), run once each in order, or None, before any call runs, when
    they cannot be measured here without disturbing another measurement: a profiler is recording on this
    thread or a ``StepWindow`` is open (a re-plan inside a measured step). ``measured``: per call, whether
    to measure it (default all); an unmeasured call runs in order, unmeasured, and reports 0 (a probe's
    set-up: making the next call's inputs, dropping the last one's). On CPU all run in one profiler
    session, each measured call inside a marker whose span selects its allocation events (a session
    costs far more than a short call). Used for short probes made while a graph compiles
    (``simulator/library_scratch.py``)."""
    device = torch.device(device)
    if profiler_running() or open_window() is not None:
        return None
    measured = [True] * len(calls) if measured is None else list(measured)
    if device.type == "cuda":
        peaks = []
        for call, measure in zip(calls, measured):
            if not measure:
                call()
                peaks.append(0)
                continue
            torch.cuda.synchronize(device)
            start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            call()
            torch.cuda.synchronize(device)
            peaks.append(torch.cuda.max_memory_allocated(device) - start)
        return peaks
    from torch.profiler import ProfilerActivity, profile, record_function

    def run_all() -> None:
        for index, (call, measure) in enumerate(zip(calls, measured)):
            if not measure:
                call()
                continue
            with record_function(f"{PROBE_MARKER}{index}"):
                call()

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run_all()
    spans = _marker_spans(prof, PROBE_MARKER)
    events = sorted(cpu_allocation_events(prof))
    return [window_peak([e for e in events if spans[i][0] <= e[0] <= spans[i][1]]).peak_bytes
            if i in spans else 0 for i in range(len(calls))]


PROBE_MARKER = "remat::probe_"


def _marker_spans(prof: Any, prefix: str) -> dict[int, tuple[int, int]]:
    """``{index: (start_ns, end_ns)}`` of the ``record_function(prefix + str(index))`` events of a finished profile."""
    spans: dict[int, tuple[int, int]] = {}
    for event in profiled_events(prof):
        if event.name.startswith(prefix) and event.name[len(prefix):].isdigit():
            spans[int(event.name[len(prefix):])] = (event.start_time_ns, event.end_time_ns)
    return spans
