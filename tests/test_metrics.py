"""Step metrics (remat.metrics): the checks as tables on plain numbers, then one tiny MLP
compiled once with remat and stepped through a StepMonitor."""

from __future__ import annotations

import logging
import math
import statistics
import time

import pytest
import torch

import remat
from remat.feedback_verdict import accepted_peak_bytes
from remat.metrics import MonitorOptions, StepMetrics, StepMonitor, check_step
from remat.testing.zoo import MLP

BUDGET_GB = 0.05            # the tiny MLP's whole step is ~2 MB: this budget is always feasible
EXTRA_BYTES = 60_000_000    # a tensor the "user" keeps alive across the backward: pushes the step over 0.05 GB
STALL_S = 0.2               # a host stall inside the backward


def record(**overrides) -> StepMetrics:
    base = dict(step=3, forward_s=0.010, backward_s=0.020, step_s=0.030, peak_bytes=None, compiled=False,
                profiled=False, graph_ids=("graph_000",), budget_bytes=1_000_000, predicted_peak_bytes=900_000,
                predicted_extra_s=0.002, baseline_backward_s=0.018)
    base.update(overrides)
    return StepMetrics(**base)


# ---- check_step on plain numbers -------------------------------------------------------------

OPTS = MonitorOptions(inflation_margin_fraction=0.10, inflation_margin_s=0.0)   # margin = 1.8 ms on 18 ms

CHECK_TABLE = [
    # (overrides, expected warning kinds)
    (dict(), ()),                                                         # inflation 2.0 ms <= 2.0 + 1.8 ms
    (dict(backward_s=0.0217), ()),                                        # 3.7 ms: just under 3.8 ms
    (dict(backward_s=0.0219), ("backward",)),                            # 3.9 ms > 3.8 ms
    (dict(backward_s=0.0219, baseline_backward_s=None), ()),              # no baseline: no inflation check
    (dict(backward_s=0.0219, compiled=True), ()),                         # compiling step: not checked
    (dict(backward_s=0.0219, profiled=True), ()),                         # profiler-inflated times: not checked
    (dict(backward_s=0.0219, graph_ids=()), ()),                          # not a remat step
    (dict(peak_bytes=1_000_000), ()),                                     # at the budget
    (dict(peak_bytes=1_000_001), ("peak",)),                              # over it
    (dict(peak_bytes=1_000_001, budget_bytes=None), ()),                  # no budget
    (dict(peak_bytes=1_000_001, graph_ids=("graph_000", "graph_001")), ()),   # several graphs: no one-graph peak
    (dict(peak_bytes=2_000_000, backward_s=0.05, profiled=True), ("peak",)),  # a profiled step still checks its peak
    (dict(peak_bytes=2_000_000, backward_s=0.05), ("peak", "backward")),
]


@pytest.mark.parametrize(("overrides", "kinds"), CHECK_TABLE)
def test_check_step_table(overrides, kinds):
    messages = check_step(record(**overrides), OPTS)
    got = tuple("peak" if "measured peak" in m else "backward" for m in messages)
    assert got == kinds, messages


def test_check_step_messages_name_the_graph_and_numbers():
    peak, backward = check_step(record(peak_bytes=2_000_000, backward_s=0.05), OPTS)
    assert peak == (
        "remat step 3, graph graph_000: measured peak 0.002000 GB is over the budget 0.001000 GB by 1.000 MB, "
        "predicted peak 0.000900 GB (1 GB = 1e9 bytes, above the memory resident at step start)."
    )
    assert backward == (
        "remat step 3, graph graph_000: backward took 50.000 ms, 32.000 ms more than the baseline backward "
        "18.000 ms, but the plan predicted 2.000 ms of recompute (margin 1.800 ms): something else is "
        "serializing the backward: a device sync, a host copy, allocator fragmentation."
    )


def test_backward_inflation_property():
    assert record().backward_inflation_s == pytest.approx(0.002)
    assert record(baseline_backward_s=None).backward_inflation_s is None


@pytest.mark.parametrize("kwargs", [
    dict(measure_peak_every=-1), dict(measure_peak_every=1.5), dict(measure_peak_every=True),
    dict(baseline_backward_s=0.0), dict(baseline_backward_s=math.nan), dict(baseline_backward_s="0.1"),
    dict(inflation_margin_fraction=-0.1), dict(inflation_margin_s=math.inf),
])
def test_bad_options_fail_with_the_value(kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=name):
        MonitorOptions(**kwargs)


def test_monitor_rejects_a_non_remat_backend():
    with pytest.raises(TypeError, match="not a remat backend"):
        StepMonitor("inductor")
    with pytest.raises(TypeError, match="MonitorOptions"):
        StepMonitor(None, options={"measure_peak_every": 1})


# ---- one tiny compiled model -----------------------------------------------------------------


def step(tiny, monitor, forward=None, backward=None, **kwargs):
    """One monitored step with the gradients set to None first, outside the measured window
    (the budget's baseline holds no gradients: the backward allocates them inside the step)."""
    tiny["model"].zero_grad(set_to_none=True)
    args = (forward or tiny["forward"],) + ((backward,) if backward is not None else ())
    return monitor.step(*args, **kwargs)


@pytest.fixture(scope="module")
def tiny():
    """A 3-layer MLP compiled once with remat (budget 0.05 GB), and the record of its compiling step."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MLP(d_in=64, d_hidden=128, n_layers=3)
    x = torch.randn(256, 64)
    backend = remat.backend(BUDGET_GB)
    compiled = torch.compile(model, backend=backend)
    monitor = StepMonitor(backend)

    def forward():
        return compiled(x).square().mean()

    model.zero_grad(set_to_none=True)
    monitor.step(forward)
    return dict(model=model, x=x, backend=backend, forward=forward, first=monitor.last)


def test_the_compiling_step_is_flagged_and_names_its_graph(tiny):
    first = tiny["first"]
    graphs = tiny["backend"].compiled_graphs
    assert len(graphs) == 1
    assert first.compiled and first.graph_ids == (graphs[0].graph_id,)
    assert first.peak_bytes is None and first.warnings == ()


def test_the_feedback_loop_verdict_is_in_the_compiling_step(tiny):
    """The loop measures the first step after the compile (verify_peak=1) from the compiled
    forward's entry to the end of its backward: here, all of the step that allocates, so it
    measures what remat.measure_peak_bytes measures around the whole step. Later steps: none."""
    graph_id = tiny["backend"].compiled_graphs[0].graph_id
    (event,) = tiny["first"].feedback
    assert (event.graph_id, event.step, event.action, event.budget_bytes) == (graph_id, 0, "within budget", 50_000_000)
    monitor = StepMonitor(tiny["backend"])
    step(tiny, monitor)
    assert monitor.last.feedback == ()
    tiny["model"].zero_grad(set_to_none=True)
    direct = remat.measure_peak_bytes(lambda: tiny["forward"]().backward()).peak_bytes
    assert event.measured_peak_bytes == direct


def test_times_are_separate_and_predictions_come_from_the_plan(tiny):
    plan = tiny["backend"].compiled_graphs[0].plan
    monitor = StepMonitor(tiny["backend"])
    loss = step(tiny, monitor)
    assert loss.ndim == 0 and tiny["model"].layers[0].weight.grad is not None
    m = monitor.last
    assert not m.compiled and m.graph_ids == (tiny["backend"].compiled_graphs[0].graph_id,)
    assert m.forward_s > 0 and m.backward_s > 0
    assert m.step_s == pytest.approx(m.forward_s + m.backward_s, abs=1e-9)
    assert m.budget_bytes == plan.budget_bytes == 50_000_000
    assert m.predicted_peak_bytes == accepted_peak_bytes(tiny["backend"].compiled_graphs[0])   # the number it stands on
    assert m.predicted_extra_s == plan.est_extra_time_s
    assert m.peak_bytes is None and not m.profiled


def test_peak_is_measured_only_when_asked(tiny):
    monitor = StepMonitor(tiny["backend"], options=MonitorOptions(measure_peak_every=2))
    for _ in range(4):
        step(tiny, monitor)
    measured = [m.peak_bytes is not None for m in monitor.history]
    assert measured == [True, False, True, False]
    assert all(m.profiled == (m.peak_bytes is not None) for m in monitor.history)
    tiny["model"].zero_grad(set_to_none=True)
    direct = remat.measure_peak_bytes(lambda: tiny["forward"]().backward()).peak_bytes
    peaks = {m.peak_bytes for m in monitor.history if m.peak_bytes is not None}
    assert peaks == {direct}, f"monitor peaks {peaks} vs measure_peak_bytes {direct} (bytes)"
    assert 0 < direct < 50_000_000
    clean = [m.step_s for m in monitor.history if not m.profiled]
    assert monitor.median_s("step_s") == pytest.approx(statistics.median(clean))


def test_a_clean_step_under_budget_warns_nothing(tiny, caplog):
    monitor = StepMonitor(tiny["backend"], options=MonitorOptions(baseline_backward_s=10.0))
    with caplog.at_level(logging.WARNING, logger="remat.metrics"):
        step(tiny, monitor, measure_peak=True)
        step(tiny, monitor)
    assert [m.warnings for m in monitor.history] == [(), ()]
    assert not caplog.records


def test_a_step_over_the_budget_warns_with_the_graph_and_numbers(tiny, caplog):
    """The user keeps a 60 MB tensor alive across the backward: the step's peak passes 0.05 GB."""
    graph_id = tiny["backend"].compiled_graphs[0].graph_id
    monitor = StepMonitor(tiny["backend"])
    held = []

    def forward_with_host_copy():
        loss = tiny["forward"]()
        held.append(torch.ones(EXTRA_BYTES // 4))
        return loss

    with caplog.at_level(logging.WARNING, logger="remat.metrics"):
        step(tiny, monitor, forward_with_host_copy, measure_peak=True)
    m = monitor.last
    assert m.peak_bytes > EXTRA_BYTES > m.budget_bytes
    assert len(m.warnings) == 1 and m.warnings[0].startswith(f"remat step 0, graph {graph_id}: measured peak ")
    assert f"over the budget {m.budget_bytes / 1e9:.6f} GB" in m.warnings[0]
    assert [r.getMessage() for r in caplog.records] == list(m.warnings)


def test_a_serialized_backward_warns_with_the_graph_and_numbers(tiny, caplog):
    """A 0.2 s host stall in the backward is far more than the plan's predicted recompute time.
    The baseline is the fastest of five clean backwards: on a shared CPU a median can be
    inflated by other processes, and the stall must stand out whatever the noise."""
    graph_id = tiny["backend"].compiled_graphs[0].graph_id
    probe = StepMonitor(tiny["backend"])
    for _ in range(5):
        step(tiny, probe)
    baseline = min(m.backward_s for m in probe.history)
    monitor = StepMonitor(tiny["backend"], options=MonitorOptions(baseline_backward_s=baseline))

    def stalled_backward(loss):
        loss.backward()
        time.sleep(STALL_S)

    with caplog.at_level(logging.WARNING, logger="remat.metrics"):
        step(tiny, monitor, backward=stalled_backward)
    m = monitor.last
    assert m.backward_s >= STALL_S and m.backward_inflation_s > STALL_S - baseline
    assert len(m.warnings) == 1
    assert m.warnings[0].startswith(f"remat step 0, graph {graph_id}: backward took {m.backward_s * 1e3:.3f} ms")
    assert f"the baseline backward {baseline * 1e3:.3f} ms" in m.warnings[0]
    assert "serializing the backward" in m.warnings[0]
    assert [r.getMessage() for r in caplog.records] == list(m.warnings)


# ---- CUDA: events for the times, the allocator for the peak (no compile) ----------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_times_and_peak_without_a_backend():
    """A 1 MiB tensor made in the forward and kept through the backward, whose gradient
    (1 MiB) the backward allocates: the allocator's peak above the start is 2 MiB plus the
    loss scalars; the three times come from CUDA events and add up."""
    x = torch.ones(512, 512, device="cuda", requires_grad=True)      # 512 x 512 fp32 = 1 MiB, resident
    monitor = StepMonitor(None, "cuda")
    held = []

    def forward():
        y = x * 2.0
        held.append(y)
        return y.sum()

    monitor.step(forward, measure_peak=True)
    m = monitor.last
    assert m.graph_ids == () and m.predicted_peak_bytes is None and m.warnings == ()
    assert not m.profiled
    assert 2 * (1 << 20) <= m.peak_bytes < 2 * (1 << 20) + 64 * 1024
    assert m.forward_s > 0 and m.backward_s > 0
    assert m.step_s == pytest.approx(m.forward_s + m.backward_s, rel=1e-3, abs=1e-5)
