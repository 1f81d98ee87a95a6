"""Step metrics a training loop can watch: measured next to predicted, per step.

    backend = remat.backend(budget_gb=24)
    compiled = torch.compile(model, backend=backend)
    monitor = remat.StepMonitor(backend, device="cuda",
                                options=remat.MonitorOptions(measure_peak_every=100, baseline_backward_s=0.031))
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = monitor.step(lambda: loss_fn(compiled(x), y))      # forward, then loss.backward()
        optimizer.step()
    print(monitor.last)   # StepMetrics: forward_s, backward_s, step_s, peak_bytes, predicted_*

Each ``StepMonitor.step`` times the forward, the backward and the whole step as three
separate numbers (on CUDA with CUDA events, synchronising once at the step's end; on CPU
with the host clock). Every ``measure_peak_every``-th step it also measures the peak
memory allocated above what was resident when the step began (docs/design.md's method, through
``remat.measure_peak_bytes``: CUDA allocator stats, or the CPU profiler, which slows that
step down; opt-in for that reason, and the times of such a step are not used for checks).

Next to the measured numbers each record carries what the plan of the same graph
predicted: its budget, predicted peak (the peak the plan was accepted on: Inductor's checked
peak where the check accepted it) and predicted extra (recompute) time; for a step of several
graphs (graph breaks), the step's predicted peak (``RematBackend.predicted_step_peak_bytes``:
the running plans composed, next to what the step's eager code was measured to hold). Two checks
log a warning on the ``remat.metrics`` logger, naming the graph and the numbers:

- the measured peak is over the budget;
- the backward took longer than ``baseline_backward_s`` (the backward without remat,
  measured by the user: a few steps with ``backend="inductor"`` through
  ``StepMonitor(None)``, then ``.median_s("backward_s")``) by more than the plan's
  predicted recompute time plus a margin: something else is serializing the backward
  (a device sync, a host copy, allocator fragmentation). remat's partition can also move
  cheap ops out of the forward into the backward (the forward gets faster by as much):
  compare ``forward_s`` and ``step_s`` with the baseline's before blaming the backward.

What the feedback loop did (``remat/feedback.py``: the first steps after each compile are
measured and a graph over its budget is re-planned) is in each record's ``feedback``: the
``FeedbackEvent``s of that step (the monitor closes the loop's CPU measuring window at the
end of each step, so a step's own verdict lands in its own record). A step whose peak the
monitor measures is not measured by the loop (one profiler at a time on CPU).

Steps in which remat compiled a graph are recorded (``compiled=True``) but not checked:
their times include compilation (with ``backend=None`` compiles are not detected: run a
warm-up step before recording). Units: seconds and bytes; 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence

import torch

from .feedback_verdict import accepted_peak_bytes
from .measure import close_open_window, measure_peak_bytes

log = logging.getLogger("remat.metrics")

SERIALIZING_HINT = "something else is serializing the backward: a device sync, a host copy, allocator fragmentation"


@dataclass(frozen=True)
class MonitorOptions:
    """How a ``StepMonitor`` measures and when it warns.

    ``measure_peak_every``: measure the peak every n-th step (0: never; 1: every step).
    ``baseline_backward_s``: the backward's time without remat; None skips the inflation check.
    The inflation check warns when ``backward_s - baseline_backward_s`` exceeds the predicted
    recompute time by more than ``inflation_margin_fraction * baseline_backward_s + inflation_margin_s``.
    """

    measure_peak_every: int = 0
    baseline_backward_s: Optional[float] = None
    inflation_margin_fraction: float = 0.10
    inflation_margin_s: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.measure_peak_every, bool) or not isinstance(self.measure_peak_every, int) \
                or self.measure_peak_every < 0:
            raise ValueError(f"measure_peak_every={self.measure_peak_every!r} must be an int >= 0 (0: never measure).")
        for name in ("inflation_margin_fraction", "inflation_margin_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name}={value!r} must be a finite number >= 0.")
        value = self.baseline_backward_s
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not (math.isfinite(value) and value > 0)):
            raise ValueError(f"baseline_backward_s={value!r} must be a positive number of seconds, or None.")

    def inflation_margin_for(self, baseline_backward_s: float) -> float:
        return self.inflation_margin_fraction * baseline_backward_s + self.inflation_margin_s


@dataclass(frozen=True)
class StepMetrics:
    """One step, measured and predicted. Seconds and bytes; ``None`` where not known."""

    step: int
    forward_s: float
    backward_s: float
    step_s: float                            # the whole step: forward, backward and anything between
    peak_bytes: Optional[int]                # above the bytes resident at step start; None unless measured
    compiled: bool                           # a remat graph was compiled in this step: its times include compilation
    profiled: bool                           # the CPU profiler measured the peak: its times are inflated
    graph_ids: tuple[str, ...]               # the remat graphs the predictions come from
    budget_bytes: Optional[int]
    predicted_peak_bytes: Optional[int]
    predicted_extra_s: Optional[float]       # the plans' estimated recompute time
    baseline_backward_s: Optional[float]
    warnings: tuple[str, ...] = ()
    feedback: tuple[Any, ...] = ()           # the feedback loop's FeedbackEvents of this step (remat/feedback.py)
    # the predicted peak is the whole step's across its graphs (graph breaks: RematBackend.predicted_step_peak_bytes),
    # and ``graph_ids`` are the plans its graphs run
    whole_step: bool = False

    @property
    def backward_inflation_s(self) -> Optional[float]:
        """Measured extra backward time over the baseline backward (None without a baseline)."""
        if self.baseline_backward_s is None:
            return None
        return self.backward_s - self.baseline_backward_s


def _graph_label(graph_ids: Sequence[str]) -> str:
    return "graph " + graph_ids[0] if len(graph_ids) == 1 else "graphs " + ", ".join(graph_ids)


def check_step(metrics: StepMetrics, options: MonitorOptions) -> tuple[str, ...]:
    """The warnings one step deserves (pure: numbers in, sentences out).

    The peak check needs a measured peak, a budget and exactly one graph, or a prediction of the whole step
    (``whole_step``: with several graphs in a step, their activations overlap and the step's peak is not one
    graph's).
    The inflation check needs a baseline and a step whose times are not distorted by a
    compile or the CPU profiler.
    """
    if metrics.compiled or not metrics.graph_ids:
        return ()
    out = []
    label = f"remat step {metrics.step}, {_graph_label(metrics.graph_ids)}"
    if metrics.peak_bytes is not None and metrics.budget_bytes is not None \
            and (len(metrics.graph_ids) == 1 or metrics.whole_step) and metrics.peak_bytes > metrics.budget_bytes:
        predicted = "" if metrics.predicted_peak_bytes is None else \
            f", predicted peak {metrics.predicted_peak_bytes / 1e9:.6f} GB"
        out.append(
            f"{label}: measured peak {metrics.peak_bytes / 1e9:.6f} GB is over the budget "
            f"{metrics.budget_bytes / 1e9:.6f} GB by {(metrics.peak_bytes - metrics.budget_bytes) / 1e6:.3f} MB"
            f"{predicted} (1 GB = 1e9 bytes, above the memory resident at step start)."
        )
    inflation = metrics.backward_inflation_s
    if inflation is not None and not metrics.profiled and metrics.baseline_backward_s is not None:
        predicted_s = metrics.predicted_extra_s or 0.0
        margin = options.inflation_margin_for(metrics.baseline_backward_s)
        if inflation > predicted_s + margin:
            out.append(
                f"{label}: backward took {metrics.backward_s * 1e3:.3f} ms, {inflation * 1e3:.3f} ms more than "
                f"the baseline backward {metrics.baseline_backward_s * 1e3:.3f} ms, but the plan predicted "
                f"{predicted_s * 1e3:.3f} ms of recompute (margin {margin * 1e3:.3f} ms): {SERIALIZING_HINT}."
            )
    return tuple(out)


class _Clock:
    """Marks on the host clock (CPU) or CUDA events on the current stream (CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def timed_step(forward: Callable[[], Any], backward: Callable[[Any], Any],
               device: torch.device | str = "cpu") -> tuple[Any, float, float, float]:
    """Run ``backward(forward())`` once; return (forward's result, forward_s, backward_s, step_s)."""
    clock = _Clock(torch.device(device))
    t0 = clock.mark()
    out = forward()
    t1 = clock.mark()
    backward(out)
    t2 = clock.mark()
    return out, clock.seconds(t0, t1), clock.seconds(t1, t2), clock.seconds(t0, t2)


def _backward_of(out: Any) -> None:
    out.backward()


class StepMonitor:
    """Records ``StepMetrics`` for each step of a training loop, next to remat's predictions.

    ``backend`` is the ``remat.backend(...)`` the step was compiled with (None: times and
    peaks only, e.g. to measure a baseline). The predictions come from the graphs compiled
    in the most recent step that compiled any (at construction: every graph the backend
    has), or, once a step of several graphs (graph breaks) completed, from the plans its graphs run
    (``whole_step``); pass ``graph_ids`` to pin them.
    """

    def __init__(self, backend: Any = None, device: torch.device | str = "cpu", *,
                 options: MonitorOptions = MonitorOptions(), graph_ids: Optional[Sequence[str]] = None) -> None:
        if not isinstance(options, MonitorOptions):
            raise TypeError(f"options={options!r} must be a remat.MonitorOptions.")
        if backend is not None and not hasattr(backend, "compiled_graphs"):
            raise TypeError(f"backend={backend!r} is not a remat backend (it has no compiled_graphs); pass None for a baseline.")
        self.backend = backend
        self.device = torch.device(device)
        self.options = options
        self.history: list[StepMetrics] = []
        self._pinned = tuple(graph_ids) if graph_ids is not None else None
        self._seen = len(self._graphs())
        self._active = tuple(g.graph_id for g in self._graphs())

    def _graphs(self) -> list[Any]:
        return list(self.backend.compiled_graphs) if self.backend is not None else []

    def _records(self, graph_ids: Sequence[str]) -> list[Any]:
        """The backend's records (``CompiledGraph``) of ``graph_ids``, in that order."""
        by_id = {g.graph_id: g for g in self._graphs()}
        missing = [g for g in graph_ids if g not in by_id]
        if missing:
            raise ValueError(f"graph_ids {missing} are not among this backend's graphs {sorted(by_id)}.")
        return [by_id[g] for g in graph_ids]

    @property
    def last(self) -> Optional[StepMetrics]:
        return self.history[-1] if self.history else None

    def step(self, forward: Callable[[], Any], backward: Callable[[Any], Any] = _backward_of, *,
             measure_peak: Optional[bool] = None) -> Any:
        """Run one step, ``backward(forward())`` (default backward: ``out.backward()``), record it,
        log its warnings, and return what ``forward`` returned.

        ``measure_peak`` overrides ``options.measure_peak_every`` for this step.
        """
        index = len(self.history)
        events_before = len(self._events())
        every = self.options.measure_peak_every
        measure = measure_peak if measure_peak is not None else (every > 0 and index % every == 0)
        if measure:
            measured = measure_peak_bytes(lambda: timed_step(forward, backward, self.device), self.device)
            out, forward_s, backward_s, step_s = measured.result
            peak: Optional[int] = measured.peak_bytes
            profiled = measured.method == "cpu-profiler"
        else:
            out, forward_s, backward_s, step_s = timed_step(forward, backward, self.device)
            peak, profiled = None, False
        close_open_window()     # the loop's CPU window of this step: its verdict belongs to this step
        graphs = self._graphs()
        compiled = len(graphs) != self._seen
        if compiled:
            self._active = tuple(g.graph_id for g in graphs[self._seen:])
            self._seen = len(graphs)
        step_peak = self._step_prediction()
        graph_ids = (self._pinned if self._pinned is not None else self.backend.step_account.running_graph_ids()
                     if step_peak is not None else self._active)
        records = self._records(graph_ids)
        plans = [r.plan for r in records]
        record = StepMetrics(
            step=index, forward_s=forward_s, backward_s=backward_s, step_s=step_s, peak_bytes=peak,
            compiled=compiled, profiled=profiled, graph_ids=tuple(graph_ids),
            budget_bytes=plans[0].budget_bytes if plans else None,
            predicted_peak_bytes=(step_peak if step_peak is not None else
                                  max(map(accepted_peak_bytes, records)) if records else None),
            predicted_extra_s=sum(p.est_extra_time_s for p in plans) if plans else None,
            baseline_backward_s=self.options.baseline_backward_s, whole_step=step_peak is not None,
        )
        messages = check_step(record, self.options)
        for message in messages:
            log.warning(message)
        self.history.append(replace(record, warnings=messages, feedback=tuple(self._events()[events_before:])))
        return out

    def _step_prediction(self) -> Optional[int]:
        """The backend's predicted peak of a step of several graphs (``predicted_step_peak_bytes``), unless the
        monitor was pinned to graphs (``graph_ids``) or the last complete step had one graph."""
        predict = getattr(self.backend, "predicted_step_peak_bytes", None)
        return predict() if self._pinned is None and callable(predict) else None

    def _events(self) -> list[Any]:
        return list(getattr(self.backend, "feedback_events", ())) if self.backend is not None else []

    def median_s(self, field: str, *, include_compiling: bool = False) -> float:
        """Median of ``forward_s``, ``backward_s`` or ``step_s`` over the recorded steps whose times are
        clean (no remat compile unless ``include_compiling``, no CPU profiler). NaN if there are none."""
        if field not in ("forward_s", "backward_s", "step_s"):
            raise ValueError(f"field={field!r} must be 'forward_s', 'backward_s' or 'step_s'.")
        values = [getattr(m, field) for m in self.history if not m.profiled and (include_compiling or not m.compiled)]
        return statistics.median(values) if values else math.nan

