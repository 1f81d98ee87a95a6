"""A step the user measures with ``remat.measure_peak_bytes`` is measured by the closed loop too (remat/measure_host.py).

On the CPU the loop's window needs a profiler session, and a thread records one at a time. Until session 49 a user
who checked every step with ``measure_peak_bytes`` (docs/design.md's way) kept the loop from ever measuring: a model
with a graph break and an eager cross-entropy ran 1.25x its budget on every step, with no event and no warning. The
suite's own steps left the first step unmeasured so that the loop could measure it. Now the window is hosted by the
user's session and reads its events off it when the measured call returns.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from remat.measure_host import HOSTED_PREFIX, window_slice
from remat.step_eager import FIRST_STEP_ACTION
from remat.testing.steps import assert_grads_close, grads_of

OPEN, END, CLOSE = (f"{HOSTED_PREFIX}{what}" for what in ("open", "end", "close"))


def test_a_hosted_window_reads_only_its_own_span_of_the_session():
    allocations = [(1, 100, 1), (3, 40, 2), (5, -40, 2), (7, 500, 3), (9, 8, 4)]
    marks = [(2, OPEN + "#0"), (4, "remat::step_phase::fwd-exit:g"), (6, END + "#0"), (8, CLOSE + "#0"),
             (8, OPEN + "#1"), (10, CLOSE + "#1")]
    events, times, inside = window_slice(allocations, marks, "#0")
    assert events == [(3, 40, 2), (5, -40, 2), (7, 500, 3)], "what was allocated before it opened is the baseline"
    assert times["end"] == 6 and times["remat::step_phase::fwd-exit:g"] == 4
    assert [name for _, name in inside] == [OPEN + "#0", "remat::step_phase::fwd-exit:g", END + "#0", CLOSE + "#0",
                                            OPEN + "#1"]
    second = window_slice(allocations, marks, "#1")
    assert second is not None and second[0] == [(9, 8, 4)] and "end" not in second[1], "never marked: no end"
    assert window_slice(allocations, marks[:3], "#0") is None, "a window whose close the session did not record"


def test_a_window_inside_measure_peak_bytes_reports_when_the_measured_call_returns():
    """Opened inside ``measure_peak_bytes``, a window reads its own allocations off that session when the call
    returns; once one closed, no other opens in the same call (it would report a step run before the first's
    measurement was heard)."""
    from remat.measure import StepWindow

    heard, cpu = [], torch.device("cpu")

    def measured() -> list:
        before = torch.zeros(5000)     # allocated before the window opens: the user's, not the window's
        window = StepWindow(cpu, lambda peak, why_not: heard.append((peak, why_not)))
        assert window.open() and window.hosted_by is not None
        kept = [torch.zeros(1000)]
        del before
        window.end_now()
        assert heard == [], "heard when the measured call returns, not before"
        assert not StepWindow(cpu, lambda peak, why_not: heard.append(("second", why_not))).open()
        return kept

    result = remat.measure_peak_bytes(measured)
    assert result.peak_bytes >= 24000
    assert heard == [(4000, "")], heard


class BrokenHead(nn.Module):
    """Two residual MLP blocks with a graph break between them and a 2,048-class head: the loss, a cross-entropy
    outside the model, holds three logits-sized tensors (4.2 MB each at a batch of 512) that no graph states."""

    def __init__(self, width: int = 128, hidden: int = 512, classes: int = 2048) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                   nn.Linear(hidden, width))
        self.second = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                    nn.Linear(hidden, width))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x) + x
        torch._dynamo.graph_break()
        return self.head(self.second(x) + x)


@pytest.mark.e2e
def test_every_step_measured_by_the_user_is_measured_by_the_loop_and_fits():
    """Every step inside ``measure_peak_bytes``, the first included: the loop measures the first step whole (its
    event), re-plans next to the eager loss it found, and every later step fits. The first step fits too: the head's
    graph, whose outputs the eager loss reads, takes its leanest plan in the first step (``step_fit.eager_code_follows``;
    before, 1.006x: it was planned with all the room the first graph left). Before session 49: steps 2 and 3 1.25x,
    no event."""
    torch.manual_seed(0)
    model, x = BrokenHead(), torch.randn(512, 128)
    y = torch.randint(0, 2048, (512,), generator=torch.Generator().manual_seed(1))

    def step(compiled) -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(compiled(x), y).backward()

    torch._dynamo.reset()
    plain = torch.compile(model, backend="inductor")
    plain_peak = max(remat.measure_peak_bytes(lambda: step(plain)).peak_bytes for _ in range(2))
    plain_grads = grads_of(model)
    budget = int(0.8 * plain_peak)
    torch._dynamo.reset()
    backend = remat.backend(budget / 1e9)
    compiled = torch.compile(model, backend=backend)
    peaks = [remat.measure_peak_bytes(lambda: step(compiled)).peak_bytes for _ in range(3)]
    print(f"plain {plain_peak} B, budget {budget} B: steps {peaks}, events {[e.action for e in backend.feedback_events]}")
    first = [e for e in backend.feedback_events if str(e.action).startswith(FIRST_STEP_ACTION)]
    assert first and first[0].measured_peak_bytes == pytest.approx(peaks[0], rel=0.01), backend.feedback_events
    assert max(peaks) <= budget, (peaks, budget)
    assert any(e.step >= 1 and e.action == "within budget" for e in backend.feedback_events), backend.feedback_events
    assert_grads_close(grads_of(model), plain_grads)


def test_a_profiler_of_the_users_own_still_keeps_the_loop_from_measuring():
    """Inside a ``torch.profiler`` the user started, the loop cannot measure and says so (the warning); the step
    runs, and the next step run without it is measured."""
    from remat.measure import PROFILER_RUNNING_WARNING, StepWindow

    heard = []
    window = StepWindow(torch.device("cpu"), lambda peak, why_not: heard.append((peak, why_not)))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True):
        with pytest.warns(UserWarning, match="closed loop cannot measure"):
            assert not window.open()
    assert heard == [] and PROFILER_RUNNING_WARNING.startswith("remat:")
