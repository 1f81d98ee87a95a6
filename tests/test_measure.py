"""remat.measure: the CPU peak counts only allocations made inside the measured window."""

from __future__ import annotations

import torch

import remat
from remat.measure import WindowPeak, window_peak

MIB = 1 << 20


def test_window_peak_table():
    # (time, size, address): allocations positive, frees negative
    assert window_peak([]) == WindowPeak(0, 0)
    assert window_peak([(0, 100, 1), (1, 50, 2), (2, -100, 1), (3, 30, 3)]) == WindowPeak(150, 0, 80)  # 80 live at the end
    # a free of a block allocated before the window does not lower the running sum
    assert window_peak([(0, -40, 9), (1, 100, 1)]) == WindowPeak(100, 40, 100)
    # events out of order are sorted by time
    assert window_peak([(3, 30, 3), (2, -100, 1), (0, 100, 1), (1, 50, 2)]) == WindowPeak(150, 0, 80)
    # a block freed twice (or freed from before and re-freed) counts once
    assert window_peak([(0, 10, 1), (1, -10, 1), (2, -10, 1)]) == WindowPeak(10, 10)


def test_free_of_pre_window_tensor_does_not_lower_the_peak():
    # Allocated during an earlier measurement (like the previous step's gradients): the CPU
    # allocator knows its size, so the profiler reports its free inside the next window. A
    # block allocated with no profiler running is freed without an event on torch 2.13.
    old = remat.measure_peak_bytes(lambda: [torch.ones(4 * MIB // 4)], "cpu").result   # 4 MiB resident

    def step():
        old.pop()                                    # freed inside the window
        new = torch.ones(2 * MIB // 4)               # 2 MiB allocated inside it
        return new.sum()

    measured = remat.measure_peak_bytes(step, "cpu")
    assert measured.method == "cpu-profiler"
    assert measured.peak_bytes >= 2 * MIB, measured
    assert measured.peak_bytes < 2 * MIB + 64 * 1024, measured   # a scalar result and profiler noise, not more
    assert measured.foreign_freed_bytes >= 4 * MIB, measured


def test_peak_counts_temporaries_freed_inside_the_window():
    def step():
        a = torch.ones(MIB // 4)
        b = torch.ones(MIB // 4)
        del a, b
        return torch.ones(MIB // 4).sum()

    measured = remat.measure_peak_bytes(step, "cpu")
    assert 2 * MIB <= measured.peak_bytes < 2 * MIB + 64 * 1024, measured
    assert measured.foreign_freed_bytes == 0


def test_a_primed_first_step_measures_what_every_later_step_does(monkeypatch):
    """``run_step`` keeps its loss weights once made: unprimed, the first step of a process counts them (an
    output-sized fp32 tensor) where later steps find them resident; primed, the first step is as any other."""
    from remat.testing import steps
    from remat.testing.zoo import MLP

    torch.manual_seed(0)
    model, inputs = MLP(d_in=16, d_hidden=32, n_layers=2), (torch.randn(64, 16),)
    monkeypatch.setattr(steps, "_LOSS_WEIGHTS", {})

    def step_peak() -> int:
        return remat.measure_peak_bytes(lambda: steps.run_step(model, model, inputs)).peak_bytes
    first, later = step_peak(), step_peak()
    assert first - later == 64 * 16 * 4, (first, later)
    monkeypatch.setattr(steps, "_LOSS_WEIGHTS", {})
    weights = steps.prime_loss_weights(model.train(), inputs)
    assert model.training and weights.shape == (64, 16)
    first, later = step_peak(), step_peak()
    assert first == later, (first, later)
