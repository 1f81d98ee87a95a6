"""Gradients a step already holds when a graph's forward enters: gradient accumulation.

A step that accumulates gradients over micro-batches (``for x in micro_batches: loss(model(x)).backward()``,
then ``optimizer.step()``) runs each compiled graph several times, each forward and backward after the earlier
ones' backwards. From the second micro-batch on, the parameters' ``.grad`` hold what the earlier backwards
produced: memory made in this step, which the budget counts (docs/budget.md), live through the whole forward
and backward, where a window opened at the forward's entry takes it for its baseline. Measured before this
module (session 35): a corpus net (rand-1437) accumulating over two micro-batches at 70% of plain Inductor's
peak ran 1.05x its budget on every step, and the loop, which measured only the first micro-batch, said
nothing.

Which gradients are the step's: those no optimizer step has seen. ``GradientLedger`` registers torch's global
optimizer step post-hook and keeps, weakly, the gradients present at the last ``optimizer.step()``: a gradient
still there was resident when the step began (``zero_grad(set_to_none=False)`` zeroes gradients in place and
keeps them: they are the step's baseline, as the parameters are). Where no torch.optim optimizer ever steps (a
hand-written update), every gradient present at a forward's entry counts: a loop that zeroes its gradients in
place by hand is planned as though they were made in the step (more recomputation than needed, never over the
budget).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Optional

import torch

# calls of a graph after its compile that are looked at for accumulated gradients, when no optimizer step comes
# first (a hand-written update): micro-batches past this many in one step are not looked for
ACCUMULATION_WATCH_CALLS = 1024     # (a block compiled once and run per layer calls its graph once per layer)


class GradientLedger:
    """The gradients an optimizer step has seen (``seen``), and how many optimizer steps ran
    (``optimizer_steps``), from torch's global optimizer step post-hook; the hook is removed when the ledger
    is collected. One per backend (``RematBackend``); thread-safe enough for the hook (a dict replaced whole)."""

    def __init__(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._seen: dict[int, weakref.ref] = {}     # id -> the gradient, weakly (a WeakSet would compare tensors)
        self.optimizer_steps = 0
        ledger = weakref.ref(self)

        def stepped(optimizer: Any, *_: Any) -> None:
            alive = ledger()
            if alive is not None:
                alive.note_step(p for group in optimizer.param_groups for p in group["params"])

        handle = register_optimizer_step_post_hook(stepped)
        weakref.finalize(self, handle.remove)

    def note_step(self, params: Iterable[Any]) -> None:
        """An optimizer stepped ``params``: the gradients they hold now are resident from here on."""
        self._seen = {id(g): weakref.ref(g) for p in params if isinstance(p, torch.Tensor) and (g := p.grad) is not None}
        self.optimizer_steps += 1

    def seen(self, grad: torch.Tensor) -> bool:
        ref = self._seen.get(id(grad))
        return ref is not None and ref() is grad

    def accumulated_bytes(self, tensors: Iterable[Any]) -> int:
        """The bytes of the gradients that the leaf tensors among ``tensors`` (a graph's parameters and inputs
        requiring gradients) hold and no optimizer step has seen: what earlier backwards of this step left;
        each storage counted once (tied parameters share one gradient)."""
        counted: dict[int, int] = {}
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or not (tensor.requires_grad and tensor.is_leaf):
                continue
            grad = tensor.grad
            if grad is None or grad.layout != torch.strided or self.seen(grad):
                continue
            storage = grad.untyped_storage()
            counted[storage.data_ptr()] = storage.nbytes()
        return sum(counted.values())


class AccumulationWatch:
    """When a measured window or step looks for accumulated gradients (``look``): on the calls it is measured
    anyway, and on a plan's first step (``restart`` after each compile or re-plan) until the first optimizer step
    or ``ACCUMULATION_WATCH_CALLS`` calls, or until a window holding the gradients a call found was measured (the
    owner calls ``stop``; that call is measured too: gradient accumulation's second micro-batch, whose peak is the
    step's). Found and not measured (a window cannot open inside the user's profiler), it goes on looking past
    those limits: a first step profiled by the user leaves the discovery to a later step. With no ledger (the loop
    off) it never looks."""

    def __init__(self, ledger: Optional[GradientLedger]) -> None:
        self._ledger = ledger
        self._left = 0
        self._steps = 0
        self._found_unmeasured = False
        self._carried_bytes = 0     # what the step's measured windows left live (note_window), until it ends
        self.restart()

    def restart(self) -> None:
        if self._ledger is not None:
            self._left, self._steps = ACCUMULATION_WATCH_CALLS, self._ledger.optimizer_steps
        self._found_unmeasured = False

    def stop(self) -> None:
        """Look no more (until ``restart``): a window holding the gradients found was measured, or the loop stopped."""
        self._left, self._found_unmeasured, self._carried_bytes = 0, False, 0

    def note_window(self, retained_bytes: Optional[int]) -> None:
        """A window of this step's owner closed, leaving ``retained_bytes`` it allocated live
        (``StepWindow.retained_bytes``; None: not known): the step holds them from here on (``look``)."""
        self._carried_bytes += max(retained_bytes or 0, 0)

    def count_call(self) -> bool:
        """Count a call of the graph (or a step's first entry) against ``ACCUMULATION_WATCH_CALLS``, every call,
        whether ``look`` is asked or not; returns whether it is watched (``watching`` before counting)."""
        watched = self.watching
        self._left = max(self._left - 1, 0)
        return watched

    @property
    def watching(self) -> bool:
        """Whether the calls now are still looked at (before ``look`` says otherwise)."""
        return self._ledger is not None and (self._found_unmeasured or (
            self._left > 0 and self._ledger.optimizer_steps <= self._steps))

    def look(self, tensors: Callable[[], Iterable[Any]], measured_anyway: bool) -> int:
        """The step's gradients ``tensors()`` hold now (``GradientLedger.accumulated_bytes``), where this call
        is looked at (the call counted by ``count_call`` first); else 0. Where they hold some, at least what the
        step's earlier windows left live (``note_window``): the gradients of parameters no graph of this owner
        reads (layers run eagerly between graphs, another backend's) and whatever else earlier passes left. Measured
        (session 37): a Hugging Face Qwen2 whose layers Hugging Face checkpoints ran eagerly between three graphs,
        accumulating over two micro-batches, held 2,605,056 B of gradients of which its graphs' parameters had
        262,656 B: the loop counted those, judged the second pass within budget, and the step measured 1.17x its
        budget. Where they hold none (a step's first pass), what was carried is dropped: a new step began."""
        ledger = self._ledger
        if ledger is None:
            return 0
        if ledger.optimizer_steps > self._steps:
            self._left = 0          # the plan's first step is over
        if self._left <= 0 and not measured_anyway and not self._found_unmeasured:
            return 0
        accumulated = ledger.accumulated_bytes(tensors())
        self._found_unmeasured = self._found_unmeasured or accumulated > 0
        if not accumulated:
            self._carried_bytes = 0
            return 0
        return max(accumulated, self._carried_bytes)


__all__ = ["ACCUMULATION_WATCH_CALLS", "AccumulationWatch", "GradientLedger"]
