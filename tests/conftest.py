"""Shared helpers for remat's tests.

- ``run_step``: one training step (grads set to None, ``compiled(*inputs).float().sum().backward()``).
- ``grads_of`` / ``assert_grads_close``: compare each parameter's gradient by relative error.
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
from typing import Any, Callable, Optional, Sequence

import pytest
import torch

import remat
from models import ZOO

# The feedback loop's corrections (remat/feedback_store.py) go to a directory of this session's own:
# a correction a developer's runs stored under ~/.cache/remat must not change the plans tests check,
# and tests must not leave corrections behind for the next run.
os.environ["REMAT_FEEDBACK_DIR"] = tempfile.mkdtemp(prefix="remat_test_feedback_")

STEP_SEED = 1234          # torch.manual_seed before every step, so dropout draws the same masks
GRAD_REL_TOL = 1e-4       # issue 2: gradients equal eager's within relative error 1e-4
# A gradient whose reference norm is below this fraction of the model's largest gradient norm
# is mathematically zero (a conv bias right before BatchNorm: ~1e-15 in float64, ~5e-6 in
# float32 next to a largest norm of ~20): its float32 value is rounding noise, which differs
# between eager and Inductor (plain Inductor and remat agree bit for bit on the zoo CNN), so
# its error is measured against the model's largest gradient norm instead of its own norm.
ZERO_GRAD_FRACTION = 1e-5
LOSS_SEED = 4321
_LOSS_WEIGHTS: dict[tuple[int, ...], torch.Tensor] = {}


def zero_grads(model: torch.nn.Module) -> None:
    model.zero_grad(set_to_none=True)


def loss_weights(shape: torch.Size) -> torch.Tensor:
    """Fixed pseudo-random weights for the output (own generator: the global RNG is untouched)."""
    key = tuple(shape)
    if key not in _LOSS_WEIGHTS:
        generator = torch.Generator().manual_seed(LOSS_SEED)
        _LOSS_WEIGHTS[key] = torch.randn(key, generator=generator)
    return _LOSS_WEIGHTS[key]


def run_step(compiled: Callable[..., torch.Tensor], model: torch.nn.Module, inputs: Sequence[torch.Tensor],
             seed: Optional[int] = STEP_SEED) -> torch.Tensor:
    """One forward + backward of ``compiled`` (the model or its compiled wrapper); returns the loss.

    The loss is ``(out.float() * w).sum()`` (as a dot product) with fixed random weights ``w``, not a plain
    ``sum()``: a plain sum sends the same gradient to every position of a channel, and
    BatchNorm's backward then subtracts nearly equal numbers, so the gradients of every
    layer below it are rounding noise that even plain Inductor does not match to 1e-4.
    Gradients are set to None first, so the backward allocates them inside the step (the
    budget covers them). ``seed`` reseeds the global generator so random ops draw the same
    numbers in every run that is compared.
    """
    zero_grads(model)
    if seed is not None:
        torch.manual_seed(seed)
    out = compiled(*inputs).float()
    # dot, not (out * w).sum(): no output-sized temporary outside the compiled graph
    loss = torch.dot(out.reshape(-1), loss_weights(out.shape).to(out.device).reshape(-1))
    del out
    loss.backward()
    return loss.detach()


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter's gradient, by parameter name."""
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def buffers_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def relative_error(actual: torch.Tensor, expected: torch.Tensor, floor: float = 0.0) -> float:
    """||actual - expected|| / max(||expected||, floor) (absolute error if both are 0)."""
    diff = (actual.double() - expected.double()).norm().item()
    scale = max(expected.double().norm().item(), floor)
    return diff / scale if scale > 0 else diff


def assert_grads_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                       rel_tol: float = GRAD_REL_TOL, what: str = "gradient") -> None:
    """Every parameter has a gradient in both, and each one's relative error is below ``rel_tol``."""
    assert actual.keys() == expected.keys(), (
        f"parameters with a {what}: only in actual {sorted(actual.keys() - expected.keys())}, "
        f"only in expected {sorted(expected.keys() - actual.keys())}"
    )
    assert expected, f"no parameter has a {what}"
    largest = max(t.double().norm().item() for t in expected.values())
    errors = {
        name: relative_error(actual[name], expected[name],
                             largest if expected[name].double().norm().item() < ZERO_GRAD_FRACTION * largest else 0.0)
        for name in expected
    }
    bad = {name: err for name, err in errors.items() if not err < rel_tol}
    assert not bad, f"{what} relative error >= {rel_tol:g} for {len(bad)}/{len(errors)} tensors: " + ", ".join(
        f"{name}={err:.3g}" for name, err in sorted(bad.items(), key=lambda kv: -kv[1])[:8]
    )


def assert_tensors_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                         rel_tol: float = GRAD_REL_TOL, what: str = "buffer") -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        if expected[name].is_floating_point():
            err = relative_error(actual[name], expected[name])
            assert err < rel_tol, f"{what} {name}: relative error {err:.3g} >= {rel_tol:g}"
        else:
            assert torch.equal(actual[name], expected[name]), f"{what} {name}: {actual[name]} != {expected[name]}"


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
        start = time.perf_counter()
        loss = run_step(compiled, model, inputs)
        compile_s = time.perf_counter() - start
        grads, buffers = grads_of(model), buffers_of(model)
        eager_loss = run_step(eager_model, eager_model, inputs)
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

    from remat.passes import schedule

    real = schedule.simulate_partition

    def scaled(facts, partition):
        run = real(facts, partition)
        sim = run.simulation
        wrong = dataclasses.replace(sim, peak_bytes=int(sim.peak_bytes * scale),
                                    timeline_bytes=tuple(int(b * scale) for b in sim.timeline_bytes))
        return dataclasses.replace(run, simulation=wrong)

    monkeypatch.setattr(schedule, "simulate_partition", scaled)
