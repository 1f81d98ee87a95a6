"""Measure the peak memory a step allocates above what was resident when it began.

DESIGN.md's method. On CUDA: reset the allocator's peak, run, and take
``max_memory_allocated() - memory_allocated()`` at start. On CPU: record the
step under ``torch.profiler`` with ``profile_memory=True``, keep the CPU
allocation events, sort them by time and running-sum their sizes; the maximum
is the peak above baseline.

Only allocations made inside the window count: a free of memory allocated
before it (a previous step's gradient, an input the step releases) is not
subtracted, since that memory was part of the baseline and the allocator of a
real device could not hand it out again below the baseline. Without this rule
a step that frees 40 MB of old gradients before allocating 100 MB would read
60 MB. The bytes of such frees are reported separately (``foreign_freed_bytes``).
A garbage collection is run before the window and the collector is off inside
it, so the window does not see a collection of unrelated cycles.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int       # above the bytes resident at step start
    device: str
    method: str           # "cuda-allocator" | "cpu-profiler"
    result: Any = None
    foreign_freed_bytes: int = 0   # cpu-profiler: bytes freed in the window that were allocated before it


@dataclass(frozen=True)
class WindowPeak:
    """The running peak of allocations made inside a window, and what was freed there from before it."""

    peak_bytes: int
    foreign_freed_bytes: int


def window_peak(events: Iterable[tuple[int, int, int]]) -> WindowPeak:
    """Peak of the live bytes allocated inside a window, from ``(time_ns, size_bytes, address)``
    allocation events (size > 0: an allocation, size < 0: a free). A free whose address was
    not allocated inside the window (or was already freed) lowers nothing and is counted in
    ``foreign_freed_bytes``. Pure: numbers in, numbers out (the events may come unsorted)."""
    live = peak = foreign = 0
    mine: dict[int, int] = {}
    for _, size, address in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live -= mine.pop(address, 0)   # an address reused without a seen free: the old block is gone
            mine[address] = size
            live += size
            peak = max(peak, live)
        elif address in mine:
            live -= mine.pop(address)
        else:
            foreign -= size
    return WindowPeak(peak, foreign)


def cpu_allocation_events(prof: Any) -> list[tuple[int, int, int]]:
    """``(time_ns, size_bytes, address)`` of the CPU allocation events a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded."""
    from torch._C._profiler import _EventType

    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag != _EventType.Allocation:
            continue
        extra = event.extra_fields
        if extra.device.type != "cpu":
            continue
        events.append((event.start_time_ns, extra.alloc_size, extra.ptr))
    return events


def _cpu_peak(fn: Callable[[], Any]) -> tuple[WindowPeak, Any]:
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    finally:
        if enabled:
            gc.enable()
    return window_peak(cpu_allocation_events(prof)), result


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> PeakMeasurement:
    """Run ``fn`` once and return the peak bytes it allocated above the starting baseline.

    On CPU the peak counts only allocations made while ``fn`` runs (see the module docstring);
    on CUDA it is the allocator's peak over ``fn`` minus the bytes allocated when it began.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return PeakMeasurement(torch.cuda.max_memory_allocated(device) - start, str(device), "cuda-allocator", result)
    window, result = _cpu_peak(fn)
    return PeakMeasurement(window.peak_bytes, "cpu", "cpu-profiler", result, window.foreign_freed_bytes)
