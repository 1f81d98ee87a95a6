"""A graph break inside a called module: Dynamo breaks the caller at the call and compiles the callee's frame
apart, so the callee's graph ends its own frame (``return_value``, no ``graph_break``) while the caller still
has its resume function, with the head and the loss, to run. Planned as its step's only graph, the body's
plan left no room for the head: the first step measured 1.25x the budget at 80% of plain Inductor's peak
(1.111x at 90%; a Hugging Face BERT with gradient checkpointing, 1.099x). ``_torch_graph_breaks.
caller_resumes_after`` tells the backend that more of the step follows, and the body takes its leanest plan
in the first step as a graph at its own frame's break does.

A break inside a block called from a loop: Dynamo cannot resume the caller there, runs the caller's frame
eagerly and compiles each block's frame apart, the first block's with no break at all. The embedding, head
and loss around the blocks run eagerly, and nothing Dynamo records says so: ``_torch_graph_breaks.
called_from_eager_code`` finds the eager caller on the stack (a corpus net planned its first block as the
step's only graph and ran its first step 1.546x the budget).
"""

from __future__ import annotations

import torch
from torch import nn

import remat
from remat._torch_graph_breaks import called_from_eager_code, caller_resumes_after, graph_break_follows
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


def _what_each_graph_is_told(make_model) -> list[tuple[bool, bool, bool]]:
    """Per graph Dynamo compiles in one step of ``make_model()``: (``graph_break_follows``, ``caller_resumes_after``,
    ``called_from_eager_code``), as the backend asks them at its compile."""
    seen = []

    def recording(gm, example_inputs):
        seen.append((graph_break_follows(gm), caller_resumes_after(), called_from_eager_code()))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(make_model(), backend=recording)(torch.randn(4, 256)).backward()
    torch._dynamo.reset()
    return seen


def _first_step_fits(make_model) -> None:
    """At 80% of plain Inductor's measured peak, steps 1 and 3 of ``make_model()`` measure within the budget and step
    1's gradients equal plain Inductor's."""
    inputs = (torch.randn(512, 256, generator=torch.Generator().manual_seed(0)),)
    plain_model, plain_step = compiled_loss_step(make_model, inputs, "inductor")
    plain_step()
    reference = grads_of(plain_model)
    budget_bytes = int(0.8 * remat.measure_peak_bytes(plain_step).peak_bytes)
    model, step = compiled_loss_step(make_model, inputs, remat.backend(budget_bytes / 1e9))
    first = remat.measure_peak_bytes(step).peak_bytes       # the compiling step (the loop cannot measure it)
    grads = grads_of(model)
    step()
    third = remat.measure_peak_bytes(step).peak_bytes
    torch._dynamo.reset()
    assert first <= budget_bytes, f"step 1 measured {first / budget_bytes:.3f}x the budget"
    assert third <= budget_bytes, f"step 3 measured {third / budget_bytes:.3f}x the budget"
    assert_grads_close(grads, reference)


def test_the_callees_graph_is_told_that_its_callers_resume_follows():
    seen = _what_each_graph_is_told(BodyThenHead)
    # the body's graph, then the head's (the step's last); no caller runs eagerly
    assert seen == [(False, True, False), (False, False, False)]
    assert not caller_resumes_after()                # no compiled frame on the stack
    assert not called_from_eager_code()              # no compile on the stack


def test_the_first_step_of_a_break_inside_a_called_module_fits_its_budget():
    _first_step_fits(BodyThenHead)


class Layer(nn.Module):
    """A residual GELU MLP (4x wide); ``breaks``: its ``forward`` ends in a graph break."""

    def __init__(self, breaks: bool) -> None:
        super().__init__()
        self.up, self.down, self.breaks = nn.Linear(256, 1024), nn.Linear(1024, 256), breaks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.down(torch.nn.functional.gelu(self.up(x))) + x
        if self.breaks:
            torch._dynamo.graph_break()
        return x


class LoopWithABreak(nn.Module):
    """Layers called from a loop, the last breaking; a wide head and the loss after them. Dynamo runs this
    ``forward`` eagerly and compiles each layer's frame apart (the breaking layer's and the others')."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Layer(False), Layer(False), Layer(False), Layer(True)])
        self.head = nn.Linear(256, 512)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.gelu(self.head(x)).square().mean()


def test_a_layer_compiled_apart_under_an_eager_caller_is_told_more_of_its_step_runs():
    seen = _what_each_graph_is_told(LoopWithABreak)
    assert len(seen) >= 2                            # the plain layers' graphs, the breaking layer's
    assert all(eager for _, _, eager in seen), seen
    assert seen[0][:2] == (False, False)             # the first layer's graph: nothing else tells it


def test_the_first_step_of_layers_compiled_apart_under_an_eager_caller_fits_its_budget():
    _first_step_fits(LoopWithABreak)   # refused at 60% and 80% where the first layer was planned as the step's only graph
