"""A graph break inside a called module: Dynamo breaks the caller at the call and compiles the callee's frame
apart, so the callee's graph ends its own frame (``return_value``, no ``graph_break``) while the caller still
has its resume function, with the head and the loss, to run. Planned as its step's only graph, the body's
plan left no room for the head: the first step measured 1.25x the budget at 80% of plain Inductor's peak
(1.111x at 90%; a Hugging Face BERT with gradient checkpointing, 1.099x). ``_torch_graph_breaks.
caller_resumes_after`` tells the backend that more of the step follows, and the body takes its leanest plan
in the first step as a graph at its own frame's break does.
"""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat._torch_graph_breaks import caller_resumes_after, graph_break_follows
from remat.testing.steps import assert_grads_close, compiled_loss_step, grads_of


class Body(nn.Module):
    """Residual GELU layers whose ``forward`` breaks at its start."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        for layer in self.layers:
            x = torch.nn.functional.gelu(layer(x)) + x
        return x


class BodyThenHead(nn.Module):
    """The body, then a wide head and a loss in the caller's frame (its resume function, after the break)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Body(), nn.Linear(256, 2048)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.head(self.body(x))).square().mean()


def test_the_callees_graph_is_told_that_its_callers_resume_follows():
    seen = []

    def recording(gm, example_inputs):
        seen.append((graph_break_follows(gm), caller_resumes_after()))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(BodyThenHead(), backend=recording)(torch.randn(4, 256)).backward()
    torch._dynamo.reset()
    assert seen == [(False, True), (False, False)]   # the body's graph, then the head's (the step's last)
    assert not caller_resumes_after()                # no compiled frame on the stack


def test_the_first_step_of_a_break_inside_a_called_module_fits_its_budget():
    inputs = (torch.randn(512, 256, generator=torch.Generator().manual_seed(0)),)
    plain_model, plain_step = compiled_loss_step(BodyThenHead, inputs, "inductor")
    plain_step()
    reference = grads_of(plain_model)
    budget_bytes = int(0.8 * remat.measure_peak_bytes(plain_step).peak_bytes)
    model, step = compiled_loss_step(BodyThenHead, inputs, remat.backend(budget_bytes / 1e9))
    first = remat.measure_peak_bytes(step).peak_bytes       # the compiling step (the loop cannot measure it)
    grads = grads_of(model)
    step()
    third = remat.measure_peak_bytes(step).peak_bytes
    torch._dynamo.reset()
    assert first <= budget_bytes, f"step 1 measured {first / budget_bytes:.3f}x the budget"
    assert third <= budget_bytes, f"step 3 measured {third / budget_bytes:.3f}x the budget"
    assert_grads_close(grads, reference)
