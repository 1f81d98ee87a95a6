"""The feedback loop's CPU window closes as the backward returns, not at some later call.

A ``torch.profiler`` session left running after the measured step (until the next compiled call)
crashed the process: a script that ran one compiled step and exited died with a segmentation
fault at interpreter exit, and one that reset Dynamo and compiled again aborted with heap
corruption (``free(): invalid next size``).
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest

from conftest import EarlyProcess

SCRIPT = textwrap.dedent("""
    import torch, remat
    from remat.measure import open_window, profiler_running
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(128, 64)
    backend = remat.backend(budget_gb=0.0005, inductor_check=False)
    torch.compile(model, backend=backend)(x).sum().backward()
    print("window open after the step:", open_window() is not None, "profiler running:", profiler_running())
    print("events:", [e.action for e in backend.feedback_events])
""")


def _started(feedback_dir) -> EarlyProcess:
    return EarlyProcess([sys.executable, "-c", SCRIPT], {**os.environ, "REMAT_FEEDBACK_DIR": str(feedback_dir)})


_EARLY: dict[str, EarlyProcess] = {}


def spawned_runs_needed(item: pytest.Item) -> tuple[str, ...]:
    """The script below runs beside the suite from collection on (conftest.py's hook)."""
    return ("script",) if item.name == "test_one_measured_step_then_exit_leaves_no_profiler_and_exits_cleanly" else ()


def start_spawned_runs(keys: list[str], tmp_path_factory: pytest.TempPathFactory) -> None:
    _EARLY.setdefault("script", _started(tmp_path_factory.mktemp("window_close") / "feedback"))


@pytest.mark.e2e
def test_one_measured_step_then_exit_leaves_no_profiler_and_exits_cleanly(tmp_path):
    early = _EARLY.pop("script", None) or _started(tmp_path / "feedback")
    run = early.result(timeout_s=600)
    assert run.returncode == 0, f"exit code {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"
    assert "window open after the step: False profiler running: False" in run.stdout
    assert "events: ['within budget']" in run.stdout
