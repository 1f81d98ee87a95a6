"""Shared helpers for remat's tests.

- ``run_step``, ``grads_of``, ``assert_grads_close`` and the other step helpers live in
  ``remat/testing/steps.py`` (the benchmarks use them too) and are imported here.
- ``fresh_model``: a zoo model and its inputs, with Dynamo reset so compiles do not pile up.
- ``no_remat_peak``: a session-wide cache, per zoo model, of the run at ``budget_gb=None`` and
  of the run that saves everything (no recomputation); the measured peak of the latter is the
  base of the ~70% / ~50% budgets (issue 2's "measured peak without remat").

Inductor's RNG: tests that compare with eager must use eager's RNG and wrap the compile
in ``torch._inductor.config.patch(fallback_random=True)``; nothing here sets it globally.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch

import remat
from remat.testing.steps import (  # noqa: F401  (the tests import these from conftest too)
    GRAD_REL_TOL, LOSS_SEED, STEP_SEED, WITHIN_BUDGET_ACTIONS, ZERO_GRAD_FRACTION, assert_grads_close,
    assert_tensors_close, buffers_of,
    grads_of, loss_weights, prime_loss_weights, relative_error, run_step, zero_grads,
)
from remat.testing.zoo import ZOO

# The feedback loop's corrections (remat/feedback_store.py) go to a directory of this session's own:
# a correction a developer's runs stored under ~/.cache/remat must not change the plans tests check,
# and tests must not leave corrections behind for the next run.
os.environ["REMAT_FEEDBACK_DIR"] = tempfile.mkdtemp(prefix="remat_test_feedback_")
# remat's compile cache (remat/plan_cache.py) and AOTAutograd's are off: a test that changes the planner
# at run time (a monkeypatched simulator) must plan, not re-use a plan cached by an earlier test or run.
# tests/test_compile_cache.py turns them on in a directory of its own.
os.environ["REMAT_COMPILE_CACHE"] = "0"


def fresh_model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A new zoo model (fixed seed) after ``torch._dynamo.reset()``, so each test compiles from scratch."""
    torch._dynamo.reset()
    model, inputs = ZOO[name]()
    model.train()
    return model, inputs


@dataclass
class CompiledRun:
    """One zoo model compiled with remat and run for one step next to an eager copy.

    Everything is recorded right after the first (compiling) step, then the peak of a
    second step is measured; the compiled module itself is not kept (``torch._dynamo.reset``
    between models would invalidate it).
    """

    name: str
    budget_gb: Optional[float]
    backend: remat.RematBackend
    dump_dir: str
    compile_s: float
    grads: dict[str, torch.Tensor]
    eager_grads: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    eager_buffers: dict[str, torch.Tensor]
    measured_peak_bytes: int
    loss: float = math.nan
    eager_loss: float = math.nan
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def plans(self) -> list[remat.Plan]:
        return [g.plan for g in self.backend.compiled_graphs]


def compile_and_run(name: str, budget_gb: Optional[float], dump_dir: str, *, fallback_random: bool = True,
                    solver: str = "greedy") -> CompiledRun:
    """Compile zoo model ``name`` with ``remat.backend(budget_gb, dump_dir=...)``, run one step
    next to eager (same weights, same seed), record grads and buffers, then measure a second step."""
    import time

    model, inputs = fresh_model(name)
    eager_model = copy.deepcopy(model)
    backend = remat.backend(budget_gb, dump_dir=dump_dir, solver=solver)
    compiled = torch.compile(model, backend=backend)
    with torch._inductor.config.patch(fallback_random=fallback_random):
        # Eager first: its step makes the loss weights (``loss_weights``, kept for later steps), so the
        # compiled first step, which the feedback loop measures, does not count them.
        eager_loss = run_step(eager_model, eager_model, inputs)
        start = time.perf_counter()
        loss = run_step(compiled, model, inputs)
        compile_s = time.perf_counter() - start
        grads, buffers = grads_of(model), buffers_of(model)
        zero_grads(model)  # drop the old grads outside the measured window: the baseline has none
        measured = remat.measure_peak_bytes(lambda: run_step(compiled, model, inputs), "cpu").peak_bytes
    return CompiledRun(
        name=name, budget_gb=budget_gb, backend=backend, dump_dir=dump_dir, compile_s=compile_s,
        grads=grads, eager_grads=grads_of(eager_model), buffers=buffers, eager_buffers=buffers_of(eager_model),
        measured_peak_bytes=measured, loss=loss.item(), eager_loss=eager_loss.item(),
    )


class BaselineCache:
    """Per zoo model, made once per session (eager's RNG):

    - ``run(name)``: remat at ``budget_gb=None`` (the free min-cut), the budget-None test case;
    - ``save_all_run(name)``: remat with ``solver="save-all"``, which saves every value the
      backward reads (only values the forward keeps in registers are rebuilt by the backward's
      kernels). Its measured peak is "the measured peak without remat" (issue 2; plan.json's
      ``no_remat_peak_bytes`` is its simulated counterpart), the base of the ~70% / ~50% budgets.
    """

    def __init__(self, tmp_factory: pytest.TempPathFactory) -> None:
        self._tmp_factory = tmp_factory
        self._runs: dict[tuple[str, str], CompiledRun] = {}

    def _compiled(self, name: str, solver: str) -> CompiledRun:
        if (name, solver) not in self._runs:
            dump_dir = str(self._tmp_factory.mktemp(f"dump_{name}_{solver}"))
            self._runs[(name, solver)] = compile_and_run(name, None, dump_dir, fallback_random=True, solver=solver)
        return self._runs[(name, solver)]

    def run(self, name: str) -> CompiledRun:
        return self._compiled(name, "greedy")

    def save_all_run(self, name: str) -> CompiledRun:
        return self._compiled(name, "save-all")

    def peak_bytes(self, name: str) -> int:
        """The measured peak without remat: every value the backward reads saved, none recomputed."""
        return self.save_all_run(name).measured_peak_bytes

    def budget_gb(self, name: str, fraction: float) -> float:
        """``fraction`` of the measured no-remat peak, in decimal GB (1 GB = 1e9 bytes)."""
        return fraction * self.peak_bytes(name) / 1e9


@pytest.fixture(scope="session")
def no_remat_peak(tmp_path_factory: pytest.TempPathFactory) -> BaselineCache:
    return BaselineCache(tmp_path_factory)


def scale_simulated_peaks(monkeypatch: pytest.MonkeyPatch, scale: float) -> None:
    """Make remat's simulator wrong on purpose: every simulated peak and timeline is multiplied by
    ``scale`` (< 1: the planner believes plans use less memory than they do, as on a model it
    mis-models), for the feedback loop's, the Inductor check's and the step budget's tests."""
    import dataclasses

    from remat.simulator import schedule

    real = schedule.simulate_partition

    def scaled(facts, partition):
        run = real(facts, partition)
        sim = run.simulation
        wrong = dataclasses.replace(sim, peak_bytes=int(sim.peak_bytes * scale),
                                    timeline_bytes=tuple(int(b * scale) for b in sim.timeline_bytes))
        return dataclasses.replace(run, simulation=wrong)

    monkeypatch.setattr(schedule, "simulate_partition", scaled)
