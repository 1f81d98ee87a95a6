"""The eager loss on a compiled model's outputs (``remat/eager_loss.py``): reserved before any step ran, measured
by the feedback loop, and the graph re-planned for what it held.

The usual training loop compiles the model and computes the loss outside it; between the compiled forward and
backward a cross-entropy holds three logits-sized tensors next to everything the forward saved. Before the reserve,
a step on such a model ran over its budget on its first step (the zoo GPT at 70% of plain Inductor's peak: 1.078x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import remat
from conftest import assert_grads_close, grads_of, zero_grads
from remat.eager_loss import LOOSEN_FRACTION, LOOSENED_ACTION, STORED_ACTION, TIGHTENED_ACTION, eager_loss_correction
from remat.measure import close_open_window, live_between
from remat.passes.joint_graph import LOSS_OUTPUT_COPIES, eager_loss_reserve_bytes
from remat.pipeline import trace_joint_facts
from test_output_lifetime import D_MODEL, LOGIT_BYTES, TOKENS, VOCAB, TinyLMHead as TinyLM   # logits dwarf the rest


class WithLoss(TinyLM):
    """The same, computing its own loss: returns ``(loss, logits)`` as a Hugging Face model given labels does."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:   # type: ignore[override]
        logits = super().forward(x)
        return logits.logsumexp(-1).mean(), logits


def make(cls: type = TinyLM) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return cls(), torch.randn(TOKENS, D_MODEL), torch.randint(0, VOCAB, (TOKENS,))


def cross_entropy_step(compiled: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    zero_grads(model)
    F.cross_entropy(compiled(x), y).backward()


def exp_chain_step(compiled: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A loss holding more than a cross-entropy: four logits-sized tensors each kept for its own backward."""
    zero_grads(model)
    out = compiled(x)
    loss = (out * 1e-3).exp().exp().exp().exp().mean()
    del out
    loss.backward()


def test_the_reserve_is_three_outputs_unless_the_graph_returns_its_loss():
    (facts,) = trace_joint_facts(TinyLM(), (torch.randn(TOKENS, D_MODEL),), hardware="cpu")
    assert eager_loss_reserve_bytes(facts) == LOSS_OUTPUT_COPIES * LOGIT_BYTES
    (own,) = trace_joint_facts(WithLoss(), (torch.randn(TOKENS, D_MODEL),), hardware="cpu")
    assert eager_loss_reserve_bytes(own) == 0     # its logits' gradient is zeros: no eager loss reads them


def test_live_between_reads_the_window_between_two_marks():
    events = [(1, 100, 1), (2, 50, 2), (3, -100, 1), (4, 300, 3), (5, -300, 3), (6, 70, 4), (7, 999, 5)]
    assert live_between(events, 2, 6) == (150, 350)      # at 2: 150 live; most until 6: 50 + 300
    assert live_between([(1, -64, 9)], 0, 5) == (0, 0)   # a free of memory from before the window lowers nothing


@dataclass(frozen=True)
class _Plan:
    budget_bytes: Optional[int]
    predicted_peak_bytes: int = 900
    fits_budget: bool = True


@dataclass(frozen=True)
class _Record:
    plan: _Plan
    eager_loss_bytes: int
    graph_id: str = "graph_000"
    correction: Any = None


def test_the_correction_follows_what_the_loss_held():
    budget = 1000
    record = _Record(_Plan(budget), eager_loss_bytes=300)
    loose = 300 - int(LOOSEN_FRACTION * budget)
    action, correction = eager_loss_correction(record, loose, 950, 0)
    assert action == LOOSENED_ACTION and correction.eager_loss_bytes == loose and correction.factor == 1.0
    assert eager_loss_correction(record, loose + 1, 950, 0) is None          # not worth a re-plan
    overruled = _Record(_Plan(budget, fits_budget=False), eager_loss_bytes=300)    # accepted on Inductor's check
    assert eager_loss_correction(overruled, loose, 950, 0)[0] == STORED_ACTION
    action, correction = eager_loss_correction(record, 400, 1100, 1)          # over by 100: the loss held 100 more
    assert action == TIGHTENED_ACTION and correction.eager_loss_bytes == 400
    assert eager_loss_correction(record, 400, 1101, 1) is None               # more than the loss explains
    assert eager_loss_correction(record, None, 950, 0) is None               # not measured


@pytest.mark.e2e
@pytest.mark.parametrize("step", [cross_entropy_step, exp_chain_step], ids=["cross-entropy", "held-more"])
def test_a_compiled_model_with_an_eager_loss_fits_its_budget(tmp_path, monkeypatch, step):
    """At 70% of plain Inductor's peak, or the budget a refusal names, retried in a new backend as a user would: an
    eager cross-entropy fits from the first step, Inductor's check of the plan equal to the measured step. A loss
    holding more than the reserve runs over once, by no more than what it held above it, and is re-planned for what
    it held (additively), or refused naming the budget that fits it; that correction is stored, so the backend
    retried plans for it from its first step. Gradients equal plain Inductor's."""
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    model, x, y = make()
    plain = torch.compile(model, backend="inductor")
    plain_peak = remat.measure_peak_bytes(lambda: step(plain, model, x, y)).peak_bytes
    plain_grads = grads_of(model)
    budget_gb, events = 0.7 * plain_peak / 1e9, []
    for _ in range(3):
        torch._dynamo.reset()
        model, x, y = make()
        backend = remat.backend(budget_gb)
        compiled = torch.compile(model, backend=backend)
        try:
            for _ in range(2):
                step(compiled, model, x, y)
                close_open_window()
            break
        except remat.BudgetInfeasibleError as refused:
            budget_gb = refused.min_budget_gb
        finally:
            events.append(list(backend.feedback_events))
    first = events[-1][0]
    assert first.action == "within budget", events
    assert abs(first.measured_peak_bytes - first.predicted_peak_bytes) <= 0.01 * first.measured_peak_bytes, first
    if step is exp_chain_step:
        assert events[0][0].action == TIGHTENED_ACTION, events
        assert len(events) == 2     # refused at the re-plan, naming a budget the retried backend meets
    measured = remat.measure_peak_bytes(lambda: step(compiled, model, x, y)).peak_bytes
    assert measured <= backend.options.budget_bytes
    checked = backend.compiled_graphs[-1].judgement.checked_peak_bytes
    assert abs(checked - measured) <= 0.01 * measured, (checked, measured)
    assert_grads_close(grads_of(model), plain_grads)
