"""Measure the peak memory a step allocates above what was resident when it began.

DESIGN.md's method. On CUDA: reset the allocator's peak, run, and take
``max_memory_allocated() - memory_allocated()`` at start. On CPU: record the
step under ``torch.profiler`` with ``profile_memory=True``, keep the CPU
allocation events, sort them by time and running-sum their sizes (frees are
negative); the maximum is the peak above baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int       # above the bytes resident at step start
    device: str
    method: str           # "cuda-allocator" | "cpu-profiler"
    result: Any = None


def _cpu_peak_bytes(fn: Callable[[], Any]) -> tuple[int, Any]:
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
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
        events.append((event.start_time_ns, extra.alloc_size))
    events.sort(key=lambda e: e[0])
    live = peak = 0
    for _, size in events:
        live += size
        peak = max(peak, live)
    return peak, result


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> PeakMeasurement:
    """Run ``fn`` once and return the peak bytes it allocated above the starting baseline."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return PeakMeasurement(torch.cuda.max_memory_allocated(device) - start, str(device), "cuda-allocator", result)
    peak, result = _cpu_peak_bytes(fn)
    return PeakMeasurement(peak, "cpu", "cpu-profiler", result)
