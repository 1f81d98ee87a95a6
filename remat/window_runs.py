"""The runs of one compiled graph that one measured window holds (``feedback.VerifiedGraph``).

A graph planned for one run per step may run again before its backward (one model called twice in a
step; one compiled block run once per layer): its runs stack, each keeping what it holds for its backward
while the next runs, and one window measures them all, from the first run's forward entry to the end of
the last of their backwards. ``WindowRuns`` keeps, per run, its backward node (weakly) and whether its
backward began and finished, and ends the window. ``runs_in_flight`` says whether a forward enters in the middle
of a step (another run's backward pending), where no window may open (``VerifiedGraph._mid_step``).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

from .engine_return import when_the_engine_returns
from .measure import StepWindow, discard_open_window


class WindowRuns:
    """The runs of one graph one window holds (``VerifiedGraph._settle_open_window``): each run's backward
    node, weakly (``track``), whether its backward began and whether it finished. The window's end is marked
    when every run's backward finished, or, failing that, where the first backward pass that finished any
    of them returns (``engine_return.when_the_engine_returns``): a run whose backward did not run in it (a forward
    whose loss was never backpropagated) does not hold the window open. A run's end counts only after its
    backward began: the end is seen when the engine reaches the node after it (``_after``), and a forward
    that never ran backward shares those nodes (its parameters' gradient accumulation) with the one that
    did. ``stacked``: the runs whose backward ran."""

    def __init__(self, window: Optional[StepWindow]) -> None:
        self.window = window
        self._nodes: list[Optional[weakref.ref]] = []
        self._began: list[bool] = []
        self._finished: list[bool] = []
        self._armed = False

    @property
    def started(self) -> int:
        return len(self._nodes)

    @property
    def stacked(self) -> int:
        return sum(self._finished)

    def start(self) -> tuple[int, Callable[[], None], Callable[[], None]]:
        """A new run: its index and the callbacks for the start and the end of its backward."""
        index = len(self._nodes)
        self._nodes.append(None)
        self._began.append(False)
        self._finished.append(False)
        return index, lambda: self._began.__setitem__(index, True), lambda: self._done(index)

    def track(self, index: int, node: Any) -> None:
        """Run ``index``'s backward node (``watch_backward``'s answer), held weakly (an object without weak
        references is taken to live until its backward)."""
        try:
            self._nodes[index] = weakref.ref(node)
        except TypeError:
            pass

    def measured(self, peak_bytes: Optional[int], why_not: str) -> tuple[Optional[int], str, int]:
        """The window's result as the loop judges it: (peak, why not, runs stacked). A window in which a run
        never ran its backward measured that run's forward too, which is not part of the step: not measured."""
        if peak_bytes is not None and self.stacked < self.started:
            return None, ("a run of the graph in the window never ran its backward (a forward whose loss was not "
                          "backpropagated): the window's peak is not the step's"), max(self.stacked, 1)
        return peak_bytes, why_not, max(self.stacked, 1)

    def orphaned(self) -> bool:
        """Whether a run's backward can no longer run: its node (its autograd graph) was freed unrun."""
        return any(ref is not None and ref() is None and not done for ref, done in zip(self._nodes, self._finished))

    def _done(self, index: int) -> None:
        """Run ``index``'s backward finished (its hook: may run inside the autograd engine)."""
        if not self._began[index] or self._finished[index]:
            return
        self._finished[index] = True
        if self.window is None:
            return
        if all(self._finished):
            self.window.mark_end()
        elif not self._armed:
            self._armed = True
            when_the_engine_returns(self.window.end_now)


class RunInFlight:
    """One compiled run whose backward has not finished, on this thread's list (``runs_in_flight``) while the loop
    may open a window: ``track`` its backward node (weakly: a run whose autograd graph was freed unrun is not in
    flight), ``finish`` when its backward ends."""

    __slots__ = ("node", "done")

    def __init__(self) -> None:
        self.node: Optional[weakref.ref] = None
        self.done = False

    def finish(self) -> None:
        self.done = True

    def track(self, node: Any) -> None:
        if not node:
            return
        try:
            self.node = weakref.ref(node)
        except TypeError:
            return
        runs_in_flight()         # drops the finished ones: the list holds only runs in flight, whoever asks
        _THREAD.runs.append(self)


_THREAD = threading.local()     # this thread's runs in flight, as ``measure``'s open window is this thread's


def runs_in_flight() -> int:
    """How many tracked runs on this thread still wait for their backward (their autograd graph alive, their
    backward not finished): where it is not 0, a forward entering now is in the middle of a step."""
    runs = getattr(_THREAD, "runs", None) or []
    alive = _THREAD.runs = [run for run in runs if not run.done and run.node is not None and run.node() is not None]
    return len(alive)


def abandon_step(why: str) -> None:
    """An exception left a step on this thread in its forward (a refusal raised at a graph's compile or re-plan, an
    error in compiled code; not Dynamo's own exceptions raised from inside a compile, which it retries): the window
    open on this thread is closed with its measurement discarded (``why``), and the runs in flight are forgotten, so
    that the next step, a retry's in the same process, is measured. Before
    session 46 the window stayed open and every later window on the thread was refused: in the corpus's floor retries,
    run in one process after a refusal in the first step, two budgets measured 1.062x and 1.079x at step 3 with
    nothing noticing. An exception raised in eager code between a step's graphs leaves the window open until the
    next ``optimizer.step()`` or ``measure_peak_bytes``, as before."""
    discard_open_window(why)
    _THREAD.runs = []


__all__ = ["RunInFlight", "WindowRuns", "abandon_step", "runs_in_flight"]
