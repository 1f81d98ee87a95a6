"""Measure the peak memory a step allocates above what was resident when it began.

docs/design.md's method. On CUDA: reset the allocator's peak, run, and take
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

``StepWindow`` measures the same peak over a window that opens in one call (a compiled
forward's entry) and whose end is marked in another (a hook on that graph's backward node,
inside the autograd engine): the feedback loop's measurement (``remat/feedback.py``). On
CUDA the end mark reads the allocator's peak and the window is done. On CPU the profiler
cannot be stopped inside the autograd engine (the engine restores the thread's profiler
state after every node and final callback, so a stop there leaves a dead profiler that
refuses the next ``torch.profiler.profile()``): the end is a marker event, and the
profiler is stopped as the backward pass returns to Python (a profile function on the thread
watches the engine's entry return), keeping only the allocations before the marker.
"""

from __future__ import annotations

import atexit
import gc
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from .engine_return import when_the_engine_returns
from .measure_host import HOSTED_PREFIX, REMAT_MARK_PREFIX, current_host, hosting, window_slice
from .profile_events import allocations_and_marks, live_after_each
from .step_phases import COMPILE_ENDED, COMPILE_STARTED, STEP_PHASE_PREFIX, peaks_by_phase, phase_markers


@dataclass(frozen=True)
class PeakMeasurement:
    peak_bytes: int       # above the bytes resident at step start
    device: str
    method: str           # "cuda-allocator" | "cpu-profiler"
    result: Any = None
    foreign_freed_bytes: int = 0   # cpu-profiler: bytes freed in the window that were allocated before it


@dataclass(frozen=True)
class WindowPeak:
    """The running peak of allocations made inside a window, and what was freed there from before it;
    ``end_bytes``: what was allocated inside it and is still live at its last event."""

    peak_bytes: int
    foreign_freed_bytes: int
    end_bytes: int = 0


def window_peak(events: Iterable[tuple[int, int, int]]) -> WindowPeak:
    """Peak of the live bytes allocated inside a window, from ``(time_ns, size_bytes, address)``
    allocation events (size > 0: an allocation, size < 0: a free). A free whose address was
    not allocated inside the window (or was already freed) lowers nothing and is counted in
    ``foreign_freed_bytes``. Pure: numbers in, numbers out (the events may come unsorted)."""
    live = peak = foreign = 0
    for _, live, freed_foreign in live_after_each(events):
        peak, foreign = max(peak, live), foreign + freed_foreign
    return WindowPeak(peak, foreign, live)


def cpu_allocation_events(prof: Any, end_marker: Optional[str] = None) -> list[tuple[int, int, int]]:
    """``(time_ns, size_bytes, address)`` of the CPU allocation events a finished
    ``torch.profiler.profile(profile_memory=True)`` recorded; with ``end_marker``, only those
    before the first ``record_function(end_marker)`` event (none if it never ran)."""
    events, end_ns = allocations_and_marker(prof, end_marker)
    return events if end_marker is None else events_until(events, end_ns)


def events_until(events: list[tuple[int, int, int]], end_ns: Optional[int]) -> list[tuple[int, int, int]]:
    """The allocation events at or before ``end_ns`` (none when the end was never marked: None)."""
    return [] if end_ns is None else [e for e in events if e[0] <= end_ns]


def allocations_and_marker(prof: Any, marker: Optional[str]) -> tuple[list[tuple[int, int, int]], Optional[int]]:
    """Every CPU allocation event of a finished profile (as ``cpu_allocation_events``) and the time of the
    first ``record_function(marker)`` event (None if it never ran), in one walk of the profile."""
    events, times = allocations_and_markers(prof, () if marker is None else (marker,))
    return events, times.get(marker) if marker is not None else None


def allocations_and_markers(prof: Any, markers: Sequence[str]) -> tuple[list[tuple[int, int, int]], dict[str, int]]:
    """``allocations_and_marker`` for several markers: the time of each one's first event (absent if it never ran)."""
    events, marks = allocations_and_marks(prof, set(markers).__contains__)
    times: dict[str, int] = {}
    for time_ns, name in marks:
        times.setdefault(name, time_ns)
    return events, times


def live_between(events: Iterable[tuple[int, int, int]], start_ns: int, end_ns: int) -> tuple[int, int]:
    """(live bytes at ``start_ns``, the most live from then to ``end_ns``) of the allocations made inside a
    window, by ``window_peak``'s rule (a free of memory allocated before the window lowers nothing). Pure."""
    live, at_start, most = 0, None, 0
    for time_ns, after, _ in live_after_each(events):
        if time_ns > start_ns and at_start is None:
            at_start = most = live
        if time_ns > end_ns:
            break
        live = after
        if at_start is not None:
            most = max(most, live)
    if at_start is None:
        at_start = most = live
    return at_start, most


def _cpu_peak(fn: Callable[[], Any]) -> tuple[WindowPeak, Any]:
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    host = None
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with hosting() as host:    # the closed loop's windows opened in ``fn`` read this session (measure_host.py)
                try:
                    result = fn()
                finally:
                    window = open_window()
                    if window is not None and window.hosted_by is host:
                        window.close()     # while the profiler still records its close
    finally:
        if enabled:
            gc.enable()
        if host is not None:     # one walk of the session: this call's peak and the hosted windows' spans
            allocations, marks = allocations_and_marks(prof, lambda name: name.startswith(REMAT_MARK_PREFIX))
            host.report(allocations, marks)
    return window_peak(allocations), result


def measure_peak_bytes(fn: Callable[[], Any], device: torch.device | str = "cpu") -> PeakMeasurement:
    """Run ``fn`` once and return the peak bytes it allocated above the starting baseline.

    On CPU the peak counts only allocations made while ``fn`` runs (see the module docstring);
    on CUDA it is the allocator's peak over ``fn`` minus the bytes allocated when it began.
    On CPU the closed loop's windows that open inside ``fn`` are measured by this session and report
    when it ends (``measure_host.py``): measuring a step does not keep the loop from measuring it.
    """
    device = torch.device(device)
    close_open_window()     # a feedback window's profiler (StepWindow) would refuse ours
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return PeakMeasurement(torch.cuda.max_memory_allocated(device) - start, str(device), "cuda-allocator", result)
    window, result = _cpu_peak(fn)
    return PeakMeasurement(window.peak_bytes, "cpu", "cpu-profiler", result, window.foreign_freed_bytes)


WINDOW_END_MARKER = "remat::measured_window_end"
# where the measured graph's forward returned and its backward started (``StepWindow.mark_phase``): what eager code
# between them (a loss) holds is read off the allocations between the two
FORWARD_RETURNED_MARKER = "remat::forward_returned"
BACKWARD_STARTED_MARKER = "remat::backward_started"
PROFILER_RUNNING_WARNING = (
    "remat: a torch.profiler is recording on this thread, so remat's closed loop cannot measure this step "
    "(on the CPU its measurement needs a profiler of its own); it measures the first step run without one. "
    "Until then the plan stands on Inductor's check of its generated code (library calls' working memory "
    "is measured in a child process meanwhile).")
_OPEN = threading.local()     # the StepWindow open on this thread, if any (one profiler / CUDA peak per thread)


def profiler_running() -> bool:
    """Whether a torch profiler is recording on this thread (then no window can open here)."""
    return bool(torch._C._autograd._profiler_enabled())


class StepWindow:
    """The peak allocated above the baseline between ``open()`` and ``mark_end()``.

    ``open()`` (outside the autograd engine) starts the window: CUDA: the bytes allocated
    now and a reset of the allocator's peak; CPU: a ``torch.profiler`` session on this thread.
    ``mark_end()`` may run inside the autograd engine (a backward node's hook): CUDA: reads the
    allocator's peak, and the window is done; CPU: a marker event. ``close()`` (outside the
    engine) stops the CPU profiler; ``on_close(peak_bytes, why_not)`` is then called once, with
    the peak of the allocations made between the opening and the marker (``window_peak``'s
    rule), or with None and the reason: the end was never marked (no backward ran) or the
    window was ``spoil``-ed (something else ran inside it). At most one window is open per
    thread (``open_window()``), on any device: a second would reset the CUDA peak under the
    first, or meet the first's profiler. While a CPU window is open no other
    ``torch.profiler`` session can start on its thread, so it is closed as soon as the backward
    that marked its end returns to Python (``when_the_engine_returns``); failing that, from
    wherever the program next leaves the engine: the next compiled call, ``optimizer.step()`` (a
    global step pre-hook, removed at close), ``measure_peak_bytes`` (``close_open_window``), or
    interpreter exit.
    """

    def __init__(self, device: torch.device, on_close: Callable[[Optional[int], str], None], owner: Any = None) -> None:
        self.device = torch.device(device)
        self.owner = owner
        self._on_close = on_close
        self._prof: Any = None
        self._hook: Any = None
        self._start_bytes = 0
        self._peak: Optional[int] = None
        # bytes allocated in the window and live when it closed (CPU: every allocation the profiler recorded until
        # then, past the end mark; CUDA: at the end mark): what the step goes on holding (AccumulationWatch)
        self.retained_bytes: Optional[int] = None
        # CPU, both phases marked (``mark_phase``): (live bytes when the forward returned, the most live until the
        # backward started), allocations inside the window only
        self.between_bytes: Optional[tuple[int, int]] = None
        self.marked = False
        self.spoiled_by = ""
        self.closed = False
        # CPU: the most live in each phase (``mark_phase`` with ``STEP_PHASE_PREFIX``: "fwd-exit:graph_001", ...;
        # "" before the first: ``peaks_by_phase``); None where no phase was marked (or on CUDA: the allocator keeps
        # one peak)
        self.phase_peaks: Optional[dict[str, int]] = None
        self._phased = False
        # CPU inside ``measure_peak_bytes``: the session that records this window's events (``measure_host.py``)
        self.hosted_by: Any = None
        self._tag = ""

    def open(self) -> bool:
        """Start measuring; False (nothing started) if a window is already open on this thread,
        or, on CPU, a profiler already runs on it or torch.distributed is initialised."""
        if open_window() is not None:
            return False
        if self.device.type == "cuda":
            self._start_bytes = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            _OPEN.window = self
            return True
        if profiler_running():
            host = current_host()    # remat's own measurement hosts the window; another profiler does not
            if host is None:
                # one text, so Python's warning registry shows it once per process
                warnings.warn(PROFILER_RUNNING_WARNING, stacklevel=3)
            if host is None or _distributed_cpu() or host.one_closed():
                return False
            self.hosted_by, self._tag = host, host.add(self)
            _record(f"{HOSTED_PREFIX}open{self._tag}")
            _OPEN.window = self
            return True
        if _distributed_cpu():
            return False
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        from torch.profiler import ProfilerActivity, profile

        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        _OPEN.window = self
        self._hook = register_optimizer_step_pre_hook(lambda *_: close_open_window())
        return True

    def hand_over(self, owner: Any, on_close: Callable[[Optional[int], str], None]) -> None:
        """From now on the window is ``owner``'s and reports to ``on_close`` (a graph's window at the start of a step
        going on to measure the whole step: ``step_loop.StepHooks.adopt``)."""
        self.owner, self._on_close = owner, on_close

    def spoil(self, why: str) -> None:
        """Discard this window's measurement (e.g. another compiled graph ran inside it)."""
        self.spoiled_by = self.spoiled_by or why

    def mark_end(self) -> None:
        """Mark the window's end (safe inside the autograd engine); CUDA: the window is done."""
        if not self._mark():
            return
        if self.device.type == "cuda":
            self.close()
        else:
            when_the_engine_returns(self.close)

    def end_now(self) -> None:
        """Mark the window's end and close it (outside the autograd engine: e.g. where a backward pass
        returned, ``when_the_engine_returns``); nothing if its end was marked already."""
        if self._mark():
            self.close()

    def mark_phase(self, marker: str, phases_only: bool = False) -> None:
        """CPU: a ``FORWARD_RETURNED_MARKER`` / ``BACKWARD_STARTED_MARKER`` event (safe inside the autograd engine),
        from which ``between_bytes`` is read at close, or a step's phase (``STEP_PHASE_PREFIX``: ``phase_peaks``);
        ``phases_only``: only in a window that marks phases already; CUDA, or once the end is marked: nothing."""
        if (self._prof is not None or self.hosted_by is not None) and not self.marked and (self._phased or not phases_only):
            self._phased = self._phased or marker.startswith(STEP_PHASE_PREFIX)
            _record(marker)

    def _mark(self) -> bool:
        """Record the end (CUDA: the allocator's peak; CPU: a marker event); False if already marked or closed."""
        if self.marked or self.closed:
            return False
        self.marked = True
        if self.device.type == "cuda":
            self._peak = torch.cuda.max_memory_allocated(self.device) - self._start_bytes
            self.retained_bytes = torch.cuda.memory_allocated(self.device) - self._start_bytes
        else:
            _record(WINDOW_END_MARKER if self.hosted_by is None else f"{HOSTED_PREFIX}end{self._tag}")
        return True

    def close(self) -> None:
        """Stop measuring (outside the autograd engine) and report (see the class docstring)."""
        if self.closed:
            return
        self.closed = True
        if getattr(_OPEN, "window", None) is self:
            _OPEN.window = None
        if self.hosted_by is not None:     # read when its host's session ends (``read_hosted``)
            _record(f"{HOSTED_PREFIX}close{self._tag}")
            return
        if self._prof is not None:
            self._hook.remove()
            self._prof.__exit__(None, None, None)
            events, times = allocations_and_markers(self._prof, (WINDOW_END_MARKER, FORWARD_RETURNED_MARKER,
                                                                 BACKWARD_STARTED_MARKER))
            self._read(events, times.get(WINDOW_END_MARKER), times,
                       phase_markers(self._prof, STEP_PHASE_PREFIX) if self._phased else [])
            self._prof = None
        self._report()

    def read_hosted(self, allocations: list[tuple[int, int, int]], marks: list[tuple[int, str]]) -> None:
        """A hosted window, closed, reads its events off its host's finished session (``HostSession.report``: every
        allocation and remat mark of it, time order) and reports, as ``close`` does for a window with a session."""
        part = window_slice(allocations, marks, self._tag)
        if part is None:
            self.spoil("its host's session holds no opening or close of it")
        else:
            events, times, inside = part
            self._read(events, times.get("end"), times, [(t, name[len(STEP_PHASE_PREFIX):]) for t, name in inside
                                                          if name.startswith(STEP_PHASE_PREFIX)])
        self._report()

    def _read(self, events: list[tuple[int, int, int]], end_ns: Optional[int], times: dict[str, int],
              phases: list[tuple[int, str]]) -> None:
        """The window's numbers from its allocation events (from its opening), the time of its end mark, the first
        time of each phase marker and its step phases (``phase_markers``' form)."""
        if self.marked:
            self._peak = window_peak(events_until(events, end_ns)).peak_bytes
        if self.marked and self._phased:
            self.phase_peaks = peaks_by_phase(events_until(events, end_ns), phases)
        if self.marked and FORWARD_RETURNED_MARKER in times and BACKWARD_STARTED_MARKER in times:
            self.between_bytes = live_between(events, times[FORWARD_RETURNED_MARKER], times[BACKWARD_STARTED_MARKER])
        self.retained_bytes = window_peak(events).end_bytes

    def _report(self) -> None:
        why_not = self.spoiled_by or ("" if self.marked else "no backward ran before the window closed")
        self._on_close(None if why_not else self._peak, why_not)


def _record(marker: str) -> None:
    """A ``record_function(marker)`` event in the profiler recording on this thread (safe inside the engine)."""
    with torch.autograd.profiler.record_function(marker):
        pass


def _distributed_cpu() -> bool:
    """True under an initialised torch.distributed process group: a CPU window is not opened there.
    A profiler session spanning a DDP step's backward (gloo's all-reduce threads running inside it)
    crashed ranks with a segmentation fault (tests/test_distributed.py, torch 2.13); DDP and FSDP2
    graphs are not recompiled in place by the loop anyway, and the step ledger plans them."""
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def open_window() -> Optional[StepWindow]:
    """The ``StepWindow`` open on this thread, if any (a CUDA window closes itself at its end mark,
    possibly on the autograd engine's device thread)."""
    window = getattr(_OPEN, "window", None)
    return None if window is None or window.closed else window


def close_open_window() -> None:
    """Close the ``StepWindow`` open on this thread, if any (call outside the autograd engine)."""
    window = open_window()
    if window is not None:
        window.close()


def discard_open_window(why: str) -> None:
    """Close the ``StepWindow`` open on this thread, if any, its measurement discarded (``spoil``: its owner hears
    None and ``why``): the step it measured was abandoned (call outside the autograd engine)."""
    window = open_window()
    if window is not None:
        window.spoil(why)
        window.close()


# A window still open when the interpreter exits (a script that ends right after a measured
# step's backward, where the engine hook did not close it) is closed first: a profiler running
# into interpreter teardown crashes the process.
atexit.register(close_open_window)


def mark_compile(started: bool) -> None:
    """Mark a compile's start or end on the window open on this thread, if it marks a step's phases (``StepWindow``):
    Dynamo compiles a step's later graphs inside its first run, and the compile's allocations are not the step's."""
    window = open_window()
    if window is not None:
        window.mark_phase(STEP_PHASE_PREFIX + (COMPILE_STARTED if started else COMPILE_ENDED), phases_only=True)
