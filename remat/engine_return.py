"""Calling back when the autograd engine's backward pass returns to Python (a CPU window's profiler cannot stop inside
the engine: ``measure.StepWindow``, ``window_runs.WindowRuns``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch


def _engine_entry_code() -> Any:
    """The code object of the Python function every ``backward()`` / ``autograd.grad()`` runs the
    C++ engine from (``torch.autograd.graph._engine_run_backward``, torch 2.11-2.13), or None."""
    entry = getattr(getattr(torch.autograd, "graph", None), "_engine_run_backward", None)
    return getattr(entry, "__code__", None)


def when_the_engine_returns(callback: Callable[[], None]) -> None:
    """Call ``callback`` as soon as the backward pass running now (or the next one) returns to Python.

    Why (a window's ``close``): a CPU window's profiler cannot stop inside the engine, and one left running
    across the user's code (the optimizer, logging, the next compile, interpreter exit) crashed the process
    (heap corruption at exit after a single compiled step). A profile function on this thread
    (the engine runs CPU backward work on the calling thread) sees the engine's Python entry
    return and calls ``callback`` there; any profile function already installed keeps running.
    Without that entry point nothing is called (a window then stays open until the next close point:
    the class docstring)."""
    code = _engine_entry_code()
    if code is None:
        return
    previous = sys.getprofile()

    def watch(frame: Any, event: str, arg: Any) -> None:
        if previous is not None:
            previous(frame, event, arg)
        if event == "return" and frame.f_code is code:
            sys.setprofile(previous)
            callback()

    sys.setprofile(watch)
