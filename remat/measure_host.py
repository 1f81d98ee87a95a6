"""``measure_peak_bytes`` hosts the closed loop's windows: a step the user measures is measured by the loop too.

On the CPU a ``measure.StepWindow`` needs a profiler session, and a thread records one session at a time: inside
a profiler the user started the loop cannot measure (``measure.PROFILER_RUNNING_WARNING``). Until session 49 that
held inside remat's own ``measure_peak_bytes`` too, the way docs/design.md checks a step: a user who checked every
step with it turned the loop off on every step, silently. A model with a graph break and an eager cross-entropy
(two MLP blocks, a 2,048-class head, at 80% of plain Inductor's peak) ran 1.25x its budget on every measured step:
the loop never measured the first step, so the eager loss's 12.6 MB were never planned next to.

Inside ``measure_peak_bytes`` a window is now *hosted* by the session that measures the call: it marks where it
opened, its phases, its end and where it closed as ``record_function`` events of that session, and when the session
ends its allocations are read off it, the window's own events only (those between its opening and its close), by
the rules a window with a session of its own reads them (``StepWindow.read_hosted``). The owner hears the
measurement when the call the user measured returns (not when the backward returns): a call holding several steps
delivers its first step's measurement after its last step, and no window opens after the first closed
(``HostSession.one_closed``).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

_HOST = threading.local()     # the measure_peak_bytes session recording on this thread, if any
REMAT_MARK_PREFIX = "remat::"    # every mark a window makes (its own, its phases, its forward's return) starts so
HOSTED_PREFIX = f"{REMAT_MARK_PREFIX}hosted_window_"   # + "open#3", "end#3", "close#3": window 3's marks in the host's session


class HostSession:
    """The windows opened inside one ``measure_peak_bytes`` session on this thread, in the order they opened."""

    def __init__(self) -> None:
        self.windows: list[Any] = []

    def add(self, window: Any) -> str:
        """Host ``window`` (a ``StepWindow`` opening now); its tag, which names its marks in the session."""
        self.windows.append(window)
        return f"#{len(self.windows) - 1}"

    def one_closed(self) -> bool:
        """Whether a window it hosts has closed: no other opens then (``StepWindow.open``), so that a call measured
        with several steps in it delivers one measurement, its first step's, after its last step, as one window of
        its own would have reported it before the next step (a second would report a step run without its re-plans)."""
        return any(window.closed for window in self.windows)

    def report(self, allocations: list[tuple[int, int, int]], marks: list[tuple[int, str]]) -> None:
        """After the session's profiler stopped: each hosted window reads its span of the session's allocation events
        and ``REMAT_MARK_PREFIX`` marks (time order: ``profile_events.allocations_and_marks``) and reports to its owner
        (``StepWindow.read_hosted``), in the order the windows opened."""
        for window in self.windows:
            window.read_hosted(allocations, marks)


def current_host() -> Optional[HostSession]:
    """The ``measure_peak_bytes`` session recording on this thread, if any."""
    return getattr(_HOST, "session", None)


@contextmanager
def hosting() -> Iterator[HostSession]:
    """Host the windows that open on this thread while the block runs (inside ``measure_peak_bytes``'s profiler;
    the block closes a hosted window still open at its end, while the profiler still records the close)."""
    host = HostSession()
    outer, _HOST.session = current_host(), host
    try:
        yield host
    finally:
        _HOST.session = outer


def window_slice(allocations: list[tuple[int, int, int]], marks: list[tuple[int, str]], tag: str
                 ) -> Optional[tuple[list[tuple[int, int, int]], dict[str, int], list[tuple[int, str]]]]:
    """A hosted window's part of its host's session: (its allocation events, from its opening to its close; the time
    of the first of each other mark in that span, by name, its own end mark as ``end``; every mark in it), or None
    when the session holds no opening or close of the window ``tag`` names. Pure."""
    times = {name: t for t, name in reversed(marks)}
    start, close = times.get(f"{HOSTED_PREFIX}open{tag}"), times.get(f"{HOSTED_PREFIX}close{tag}")
    if start is None or close is None:
        return None
    inside = [(t, name) for t, name in marks if start <= t <= close]
    first = {name: t for t, name in reversed(inside)}
    if f"{HOSTED_PREFIX}end{tag}" in first:
        first["end"] = first[f"{HOSTED_PREFIX}end{tag}"]
    return [e for e in allocations if start <= e[0] <= close], first, inside
