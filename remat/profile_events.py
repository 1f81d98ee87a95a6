"""Reading a finished ``torch.profiler`` session: its events, nested ones included, and the live bytes after each
allocation event by the measuring rule (only allocations made inside the window count: ``measure.window_peak``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator


def profiled_events(prof: Any) -> Iterator[Any]:
    """Every event of a finished ``torch.profiler.profile``, nested ones included (no order)."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        yield event


def allocations_and_marks(prof: Any, is_mark: Callable[[str], bool]
                          ) -> tuple[list[tuple[int, int, int]], list[tuple[int, str]]]:
    """One walk of a finished profile: its CPU allocation events ``(time_ns, size_bytes, address)`` (size < 0: a free;
    in no order), and ``(time_ns, name)`` of each event whose name ``is_mark`` accepts, in time order."""
    from torch._C._profiler import _EventType

    allocations, marks = [], []
    for event in profiled_events(prof):
        if is_mark(event.name):
            marks.append((event.start_time_ns, event.name))
        if event.tag != _EventType.Allocation:
            continue
        extra = event.extra_fields
        if extra.device.type != "cpu":
            continue
        allocations.append((event.start_time_ns, extra.alloc_size, extra.ptr))
    return allocations, sorted(marks)


def live_after_each(events: Iterable[tuple[int, int, int]]) -> Iterator[tuple[int, int, int]]:
    """(time_ns, live bytes after it, bytes of memory from before the window it freed) for each event in time
    order, by ``window_peak``'s rule: only allocations made inside the window count."""
    live = 0
    mine: dict[int, int] = {}
    for time_ns, size, address in sorted(events, key=lambda e: e[0]):
        foreign = 0
        if size > 0:
            live -= mine.pop(address, 0)   # an address reused without a seen free: the old block is gone
            mine[address] = size
            live += size
        elif address in mine:
            live -= mine.pop(address)
        else:
            foreign = -size
        yield time_ns, live, foreign
