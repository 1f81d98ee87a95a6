"""A dynamic-shape graph of a step at graph breaks, re-planned at the sizes its call ran at (remat/size_dispatch.py).

Dynamo compiles a block's forward on its own when the block ends in a graph break, and again with dynamic shapes
when the next block meets it at other sizes. Before, such a graph kept the plan it was first given (unchecked by
Inductor, made before the step was known) and a step over its budget could not be fixed in place: the corpus's
rand-brk-1522 ran 1.13x over at 90% of plain Inductor's peak and was refused naming a budget above plain Inductor's.
"""

from __future__ import annotations

import torch

import remat
from remat.measure import close_open_window
from remat.size_dispatch import SizeDispatch, at_call_sizes
from remat.step_budget import slot_of
from remat.testing import corpus
from remat.testing.steps import assert_grads_close, grads_of

DYNAMIC_BLOCKS_SEED = 29   # a CNN whose blocks 1 and 2 end in a graph break; Dynamo compiles them with dynamic shapes
FRACTION = 0.8


def _called(name: str, calls: list) -> object:
    def fn(*args):
        calls.append(name)
        return name
    return fn


def test_a_call_runs_the_code_compiled_for_exactly_its_sizes():
    calls: list = []
    x, size = torch.zeros(4, 8), 3
    dispatch = at_call_sizes(_called("dynamic", calls), [x, size], _called("static", calls))
    assert dispatch(torch.ones(4, 8), 3) == "static"                 # same sizes, strides, dtype: its values differ
    assert dispatch(torch.zeros(4, 9), 3) == "dynamic"               # another size
    assert dispatch(torch.zeros(8, 4).t(), 3) == "dynamic"           # same sizes, other strides
    assert dispatch(torch.zeros(4, 8, dtype=torch.float64), 3) == "dynamic"
    assert dispatch(torch.zeros(4, 8), 5) == "dynamic"               # another size input
    again = at_call_sizes(dispatch, [torch.zeros(4, 9), size], _called("static again", calls))
    assert isinstance(again, SizeDispatch) and again.general is dispatch.general   # re-planned: still one dynamic code
    assert again(torch.zeros(4, 8), 3) == "dynamic" and again(torch.zeros(4, 9), 3) == "static again"


def _steps_within(entry, budget_bytes: int) -> tuple[list[int], remat.RematBackend, dict]:
    """Four steps the closed loop measures (the re-plans are made in them), then two the test measures: their peaks,
    the backend and the gradients."""
    torch._dynamo.reset()
    built = entry.build()
    backend = remat.backend(budget_bytes / 1e9)
    compiled = torch.compile(built.model, backend=backend)
    for _ in range(4):
        corpus.loss_step(built, compiled)
    close_open_window()
    peaks = [remat.measure_peak_bytes(lambda: corpus.loss_step(built, compiled)).peak_bytes for _ in range(2)]
    return peaks, backend, grads_of(built.model)


def test_a_steps_dynamic_graphs_are_re_planned_checked_and_the_step_fits():
    """Plain Inductor's peak, then remat at 80% of it (or, refused, at the budget the refusal names): the dynamic
    graphs' final plans are Inductor-checked re-plans, the measured steps fit, the gradients are plain Inductor's."""
    entry = corpus.random_entry(DYNAMIC_BLOCKS_SEED, graph_breaks=True)
    plain_peak, expected = corpus.plain_inductor_peak(entry)
    budget = int(FRACTION * plain_peak)
    try:
        peaks, backend, grads = _steps_within(entry, budget)
    except remat.BudgetInfeasibleError as refused:
        assert refused.min_budget_bytes is not None and budget < refused.min_budget_bytes <= plain_peak
        budget = refused.min_budget_bytes
        peaks, backend, grads = _steps_within(entry, budget)
    assert max(peaks) <= budget, (peaks, budget, [(e.step, e.measured_peak_bytes, e.action[:80])
                                                  for e in backend.feedback_events])
    assert_grads_close(grads, expected)
    first = {slot_of(r.graph_id): r for r in reversed(backend.compiled_graphs)}
    last = {slot_of(r.graph_id): r for r in backend.compiled_graphs}
    dynamic = [slot for slot, record in first.items() if record.judgement is None]   # Inductor cannot check them
    assert dynamic, [(r.graph_id, r.judgement) for r in backend.compiled_graphs]
    for slot in dynamic:
        assert last[slot].graph_id != slot and last[slot].judgement is not None, last[slot].graph_id
        assert last[slot].judgement.checked_peak_bytes is not None, last[slot].judgement
