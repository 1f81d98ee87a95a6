"""Eager code between and around a step's graphs: measured by phase, and what each graph's re-plans are made next to.

No generated code states what eager code holds between a step's graphs (a loss after the last one, a function
Dynamo does not compile, the model's own forward where Dynamo compiled only its blocks). ``StepEagerHooks`` (the
part of ``step_loop.StepHooks`` that deals with it) marks each graph's phases on the window measuring the step
(``phase``: ``step_phases``), measures the first step whole (``adopt``: the window its first graph opened), and,
where every plan was accepted on its Inductor-checked peak (or the first step is over its budget), reads what was
live in each phase beyond what the plans hold there (``eager_by_graph``): during a graph's run it becomes its
share's outside bytes, after its forward its eager-loss reserve (``Correction.eager_step_bytes``,
``eager_loss_bytes``); what eager code made before the first graph and handed to it (``prelude_bytes``) is live
before any window opens. docs/budget.md, "Eager code between and around the graphs".
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any, Callable, Optional, Sequence

import torch

from .eager_loss import storage_bytes
from .feedback_store import CHECK_SOURCE, Correction
from .feedback_verdict import accepted_peak_bytes
from .measure import open_window
from .step_budget import slot_of, step_totals
from .step_phases import STEP_PHASE_PREFIX
from .units import format_bytes

FIRST_STEP_ACTION = "the first step, measured whole: "
# eager memory a step measured under this fraction of its budget is left to the headroom (Inductor's check keeps 1% on
# CPU): an eager loss's scalar, the 8 bytes of a sum, are no reason to re-plan, and a re-plan next to eager memory
# is not keyed in AOTAutograd's cache (``key_at_replan``)
EAGER_NOISE_FRACTION = 0.005


class StepEagerHooks:
    """What ``step_loop.StepHooks`` does about eager code (see the module docstring); its state lives on the hooks
    (``_prelude_bytes``, set in ``StepHooks.__init__``) and on its account (``StepAccount.note_eager``)."""

    def phase(self, wrapper: Any, what: str) -> None:
        """Mark ``what`` ("fwd-enter", "fwd-exit", "bwd-enter", "bwd-exit") of ``wrapper``'s graph on the window
        measuring the step, if one is open (``measure.StepWindow.phase_peaks``: how much was live in each)."""
        window = open_window()
        if window is not None and (window.owner is self or getattr(window.owner, "step_hooks", None) is self):
            window.mark_phase(f"{STEP_PHASE_PREFIX}{what}:{slot_of(wrapper.record.graph_id)}")

    def adopt(self, window: Any) -> bool:
        """Whether the step takes over ``window``, which a graph of its own opened at its forward entry and which
        another graph of the step now entered: in the step's first run (no sequence known yet), the window then
        measures the whole step (the first graph's backward ends it, after every later graph's) for
        ``_first_step_measured``, where it was spoiled before (the first step was measured by nothing)."""
        owner = window.owner
        if self.account.sequence or window.spoiled_by or getattr(owner, "step_hooks", None) is not self:
            return False
        window.hand_over(self, lambda peak, why_not: self._first_step_measured(peak, why_not, window.phase_peaks))
        return True

    def _first_step_measured(self, peak_bytes: Optional[int], why_not: str,
                             phase_peaks: Optional[dict[str, int]]) -> None:
        """The first step, measured whole (``adopt``): what its eager code held during each graph's run and after
        each graph's forward (``eager_by_graph``; where a plan stands on its simulated peak, only if the step was over
        its budget: ``_note_eager``) is what each re-plan of the step is made next to (the provisional plans' re-plans at the next step's entry,
        and any graph the step then runs over with), so that the next step, whose plans are looser than the first
        step's leanest ones, fits. Nothing else is corrected: the first step's plans are provisional, and their
        composed prediction is not the next step's."""
        from .feedback import FeedbackEvent

        sequence = self.account.sequence
        wrappers = [self._wrapper(slot) for slot in dict.fromkeys(sequence)]
        if peak_bytes is None or len(sequence) < 2 or any(w is None for w in wrappers):
            return
        peak_bytes += self._prelude_bytes      # made before the window opened, live through the step
        budgets = [w.record.plan.budget_bytes for w in wrappers if w.record.plan.budget_bytes is not None]
        budget, predicted = min(budgets, default=None), self.account.step_peak_bytes(sequence)
        if budget is None:     # no budget: measured (what the first step peaked at), nothing to re-plan
            self._events.append(FeedbackEvent(step_name(sequence), 0, None, predicted, peak_bytes, None,
                                              FIRST_STEP_ACTION + "no budget"))
            return
        eager = self._note_eager(wrappers, sequence, peak_bytes, phase_peaks, budget, first_step=True)
        name, held = step_name(sequence), sum(max(e) for e in eager.values())
        self._events.append(FeedbackEvent(name, 0, budget, predicted, peak_bytes, None, FIRST_STEP_ACTION + (
            eager_summary(eager) + ": every re-plan of the step is made next to it" if held else
            "within budget" if peak_bytes <= budget else "over budget, nothing held outside the graphs")))
        if not held:
            return
        why = f"the first step's eager code held {eager_summary(eager)}"
        for wrapper in wrappers:
            asked = wrapper.pending_correction
            if asked is None and peak_bytes <= budget or not wrapper.can_replan:
                continue     # no re-plan asked for, and the step fitted with what eager code held: kept
            self._request_next_to_eager(wrapper, asked or step_correction(wrapper.record, why))
        if peak_bytes > budget:
            warnings.warn(f"remat: the first step of {len(sequence)} graphs measured {format_bytes(peak_bytes)}, over "
                          f"the budget {format_bytes(budget)}, with eager code holding {eager_summary(eager)}; every "
                          "re-plan of the step is made next to it.", stacklevel=2)

    def predicted_step_peak_bytes(self) -> Optional[int]:
        """The predicted peak of the last complete step of several graphs (``account.sequence``), from the plans its
        graphs run now, each at the peak it was accepted on (``accepted_peak_bytes``: Inductor's checked peak where the
        check accepted it), composed (``step_totals``) next to the most its eager code was measured to hold by graph
        (``predicted_with_eager``). Gradients an earlier pass left in the parameters (gradient accumulation) are not
        in it. None for a step of one graph (its plan's own peak is the prediction) or a graph with no plan yet."""
        composition = self._composition()
        return None if composition is None else predicted_with_eager(*composition[1:])

    def _composition(self) -> Optional[tuple[tuple[str, ...], list[tuple[int, int, int, int]], list[tuple[int, int]]]]:
        """What ``predicted_step_peak_bytes`` composes: the last complete step's sequence, each graph's terms
        (``StepAccount.step_terms``) at the peak its running plan was accepted on, and what eager code held by graph;
        None for a step of one graph or a graph with no plan yet."""
        sequence = self.account.sequence
        wrappers = [self._wrapper(slot) for slot in dict.fromkeys(sequence)]
        if len(sequence) < 2 or any(w is None for w in wrappers):
            return None
        terms = self.account.step_terms(sequence, accepted_peaks(wrappers))
        if len(terms) != len(sequence):
            return None
        return sequence, terms, [self.account.eager_of(slot) for slot in sequence]

    def step_peak_with(self, slot: str) -> Optional[Callable[[int, int, int], int]]:
        """The last complete step of several graphs (``account.sequence``) with graph ``slot`` running another plan:
        ``peak_with(held_bytes, peak_bytes, outside_bytes)`` is its predicted peak (``predicted_with_eager``) had
        ``slot``'s plan held ``held_bytes`` for its backward and peaked at ``peak_bytes``, each other graph at the
        plan it runs now (at the peak it was accepted on), next to what eager code was measured to hold by graph,
        plus what ``outside_bytes`` (``slot``'s share's: accumulated gradients and the eager code during its run)
        holds beyond that eager code, through the whole step: with ``slot``'s running plan, exactly
        ``predicted_step_peak_bytes`` (the same ``_composition``). The plans and eager bytes are read once, here.
        None when no such step ran ``slot`` or a graph of it has no plan."""
        composition = self._composition()
        if composition is None or slot not in composition[0]:
            return None
        sequence, terms, eager = composition
        during = eager[sequence.index(slot)][0]

        def peak_with(held_bytes: int, peak_bytes: int, outside_bytes: int) -> int:
            swapped = [(held_bytes, t[1], t[2], peak_bytes) if s == slot else t for s, t in zip(sequence, terms)]
            return predicted_with_eager(swapped, eager) + max(outside_bytes - during, 0)

        return peak_with

    def _note_eager(self, wrappers: Sequence[Any], sequence: tuple[str, ...], peak_bytes: int,
                    phase_peaks: Optional[dict[str, int]], budget_bytes: int,
                    first_step: bool = False) -> dict[str, tuple[int, int]]:
        """What a measured step's eager code held by graph (``eager_by_graph``; where a plan was not accepted on its
        Inductor-checked peak, nothing, unless it is the ``first_step`` and over its budget: then read against the
        simulated peak; under ``EAGER_NOISE_FRACTION`` of the budget, nothing), kept on the account as the
        most measured so far per graph (``StepAccount.note_eager``); returns this step's."""
        checked = checked_peaks(wrappers)
        if checked is None and not (first_step and peak_bytes > budget_bytes):
            return {}
        if checked is None:
            # the first step, over its budget, a plan standing on its simulated peak (a dynamic-shape graph's first plan
            # is not checked): what it measured above the plans may be the simulator's error, but the step is over by it
            # either way, and the re-plans its provisional plans get are made next to it (rand-brk-1522 at 50% of plain
            # Inductor's peak: its first step measured 1.237x, nothing was attributed, its later steps ran 1.294x). A
            # later step over its budget is corrected by the factor measured / predicted instead (``_on_measured``).
            checked = accepted_peaks(wrappers)
        noise = EAGER_NOISE_FRACTION * budget_bytes
        measured = eager_by_graph(sequence, self.account.step_terms(sequence, checked), peak_bytes - self._prelude_bytes,
                                  phase_peaks)
        # what eager code made before the first graph is live in every phase (the window never saw it)
        measured = {slot: (during + self._prelude_bytes, after + self._prelude_bytes)
                    for slot, (during, after) in measured.items()}
        eager = {slot: tuple(b if b >= noise else 0 for b in held) for slot, held in measured.items()}
        for slot, (during, after) in eager.items():
            self.account.note_eager(slot, during, after, self._prelude_bytes)
        return eager

    def _request_next_to_eager(self, wrapper: Any, asked: "Correction") -> None:
        """Re-plan ``wrapper``'s graph with ``asked``, next to what the step's eager code was measured to hold during its
        run (its share's outside bytes) and after its forward (its eager-loss reserve: what that phase held beyond
        what the share already counts there, ``after_forward_reserve``)."""
        slot = slot_of(wrapper.record.graph_id)
        during, after = self.account.eager_of(slot)
        graph, sequence = self.account.plan_of(wrapper.record.graph_id), self.account.sequence
        inputs = graph.input_activation_bytes if graph is not None and sequence[:1] != (slot,) else 0   # (step_totals)
        reserve = after_forward_reserve(during, after, inputs)
        wrapper.request_replan(replace(asked, eager_step_bytes=max(asked.eager_step_bytes, during),
                                       eager_loss_bytes=max(asked.eager_loss_bytes or 0, reserve) or asked.eager_loss_bytes))


def prelude_bytes(args: Sequence[Any]) -> int:
    """Bytes of the storages of a step's first graph's tensor inputs that autograd-tracked code made (a ``grad_fn``):
    memory eager code allocated in the step before its first compiled graph (an eager embedding or stem, where
    Dynamo compiled only a model's blocks), live when the step's window opens and so never in it, and live through
    the step while eager code holds it for its backward. The batch and the parameters have none. Each storage once."""
    return storage_bytes(t for t in args if isinstance(t, torch.Tensor) and t.grad_fn is not None)


def checked_peaks(wrappers: Sequence[Any]) -> Optional[dict[str, int]]:
    """Slot -> the Inductor-checked peak each of ``wrappers``' plans was accepted on; None where one was not
    (its simulated peak stood: then what a step measured above the plans may be the simulator's error)."""
    checked = {}
    for wrapper in wrappers:
        judgement = wrapper.record.judgement
        if judgement is None or judgement.checked_peak_bytes is None:
            return None
        checked[slot_of(wrapper.record.graph_id)] = judgement.checked_peak_bytes
    return checked


def accepted_peaks(wrappers: Sequence[Any]) -> dict[str, int]:
    """Slot -> the peak each of ``wrappers``' plans was accepted on (``accepted_peak_bytes``: checked where the check
    accepted it, else simulated)."""
    return {slot_of(w.record.graph_id): accepted_peak_bytes(w.record) for w in wrappers}


def eager_by_graph(sequence: tuple[str, ...], terms: Sequence[tuple[int, int, int, int]], peak_bytes: int,
                   phase_peaks: Optional[dict[str, int]]) -> dict[str, tuple[int, int]]:
    """What a measured step's eager code held, by graph: slot -> (during its run, after its forward returned), bytes.
    ``terms``: each graph's (held, inputs, gradients, accepted peak) in ``sequence`` order (``StepAccount.step_terms``,
    with the Inductor-checked peaks: the code a graph runs states what it allocates, so what was live beyond it is
    eager code's: a loss, a function Dynamo does not compile, the model's own forward where Dynamo compiled only its
    blocks). ``phase_peaks``: the most live in each phase of the step (``measure.StepWindow.phase_peaks``):
    during graph k's forward or backward, beyond the step's prediction there (``step_totals``); after graph k's
    forward returned, beyond what graphs 0..k hold for their backwards (its outputs included: a graph's simulated
    timeline frees them as its forward returns, so the eager-loss reserve the excess becomes must hold them); after
    graph k's backward, beyond what the graphs before it hold and the gradients of k and the graphs after it (the
    gradient k hands back included, which the graph before it counts only once its backward starts), charged to
    the graph before it as after its forward (its forward ran, its backward not yet: the eager code runs next to
    what it holds, as an eager loss does next to a graph alone in its step). Without phases (CUDA: the allocator keeps one peak), the step's peak
    beyond the composed one, during every graph's run. A slot run several times: the most over its runs. Pure."""
    totals = step_totals(terms)
    if phase_peaks is None:
        excess = max(peak_bytes - max(totals, default=0), 0)
        return {slot: (excess, 0) for slot in sequence}
    eager: dict[str, list[int]] = {slot: [0, 0] for slot in sequence}
    held = held_for_backward(terms)
    for k, slot in enumerate(sequence):
        during = max(phase_peaks.get(f"fwd-enter:{slot}", 0), phase_peaks.get(f"bwd-enter:{slot}", 0)) - totals[k]
        after = phase_peaks.get(f"fwd-exit:{slot}", 0) - sum(held[:k + 1])
        eager[slot][0], eager[slot][1] = max(eager[slot][0], during), max(eager[slot][1], after)
        if k > 0:    # between its backward and the next: the graph before it is between its forward and backward
            after_backward = phase_peaks.get(f"bwd-exit:{slot}", 0) - sum(held[:k]) - sum(t[2] for t in terms[k:])
            previous = sequence[k - 1]
            eager[previous][1] = max(eager[previous][1], after_backward)
    return {slot: (during, after) for slot, (during, after) in eager.items()}


def held_for_backward(terms: Sequence[tuple[int, int, int, int]]) -> list[int]:
    """What each graph of a step (``terms``: ``step_totals``') holds for its backward as a step's window sees it:
    its held bytes, less the first graph's inputs (the step's batch, resident before the window opens; made by eager
    code in the step, they are eager memory and counted as such). Pure."""
    return [max(t[0] - (t[1] if k == 0 else 0), 0) for k, t in enumerate(terms)]


def predicted_with_eager(terms: Sequence[tuple[int, int, int, int]], eager: Sequence[tuple[int, int]]) -> int:
    """The predicted peak of a step whose graphs bring ``terms`` (forward order: held, inputs, gradients and the peak
    each plan was accepted on, ``StepAccount.step_terms``) next to what its eager code was measured to hold by graph,
    ``eager[k]`` = (during graph k's run, after its forward; ``StepAccount.eager_of``, what eager code made before
    the first graph included): the largest, over graph k, of ``step_totals``' k-th total plus what eager code held
    during k's run, and of what graphs 0..k hold for their backwards (``held_for_backward``) plus what it held after
    k's forward. These are the phases ``eager_by_graph`` reads a measured step by, so each phase it measured is
    predicted at what it measured, except what it rounds off (``EAGER_NOISE_FRACTION``) and, for the phase between
    a graph's backward and the next one's (charged to the earlier graph's "after its forward"), the gradients the
    later backwards made. A graph's plan made next to its eager-loss reserve has that reserve in its peak, so the
    second form is then within the first. With no eager memory noted, ``composed_peak_bytes``. Pure."""
    totals, held = step_totals(terms), held_for_backward(terms)
    return max((max(total + during, sum(held[:k + 1]) + after)
                for k, (total, (during, after)) in enumerate(zip(totals, eager))), default=0)


def after_forward_reserve(during_bytes: int, after_bytes: int, input_bytes: int) -> int:
    """The eager-loss reserve of a graph of a step whose eager code held ``after_bytes`` after its forward (beyond what
    the graphs up to it hold for their backwards) and ``during_bytes`` during its run: a share counts the graph's
    outside bytes (``during_bytes``) and its activation inputs (``input_bytes``, as ``step_totals`` counts them: 0 for
    the step's first graph) through its whole run, the phase after its forward included, and its plan counts the
    reserve next to what it holds there; so the reserve is what that phase held beyond those two (both measured with
    what eager code made before the first graph, ``prelude_bytes``, which is live in every phase). The eager code's
    tensors that live through several phases (an eager function's saved input and output, an eager stem's output)
    were counted in both before session 45. Pure."""
    return max(after_bytes - during_bytes - input_bytes, 0)


def eager_summary(eager: dict[str, tuple[int, int]]) -> str:
    """``eager_by_graph``'s answer in words: "x during graph_000's run, y after graph_001's forward, ..."."""
    parts = [f"{format_bytes(b)} {where} {slot}'s {what}" for slot, (during, after) in eager.items()
             for b, where, what in ((during, "during", "run"), (after, "after", "forward")) if b > 0]
    return ", ".join(parts) or "nothing"


def step_name(sequence: tuple[str, ...]) -> str:
    """The name a step's feedback events carry: ``step:<first graph>..<last graph>``."""
    return f"step:{sequence[0]}..{sequence[-1]}"


CHECK_EXACT_FRACTION = 0.01   # a plan Inductor's check read within this fraction of its simulated peak: no error to keep


def step_correction(record: Any, why: str) -> Correction:
    """The correction a step re-plan of the plan ``record`` (a ``CompiledGraph``) is made with: its
    own feedback correction if it has one (the simulator's known error on it stays), else factor 1. Except a
    correction Inductor's check made for another plan (``CHECK_SOURCE``: a plan it rejected) where the check read the
    plan that runs at its simulated peak (within ``CHECK_EXACT_FRACTION``): that error is not this plan's, and its
    factor (under a share, the whole step target's) is dropped; what else it carries (runs, gradients, eager bytes)
    stays. The re-plan is judged by the check again. (rand-brk-1522 at 70% of plain Inductor's peak, session 46: a
    rejected plan checked 1.44x its simulation, the smallest plan that replaced it checked exactly, and every later
    re-plan of the step still divided the step target by 1.468: refused, naming 3.24 MB.)"""
    old = record.correction
    if old is not None and old.source.startswith(CHECK_SOURCE) and not _check_error_on(record):
        return replace(old, factor=1.0, graph_id=record.graph_id, source=f"step budget: {why}", foreseen=True)
    if old is not None:
        return replace(old, graph_id=record.graph_id)
    plan = record.plan
    return Correction(1.0, plan.budget_bytes, plan.predicted_peak_bytes, plan.predicted_peak_bytes, record.graph_id,
                      f"step budget: {why}", foreseen=True)


def _check_error_on(record: Any) -> bool:
    """Whether Inductor's check read ``record``'s own plan more than ``CHECK_EXACT_FRACTION`` over its simulated peak
    (no check: assumed so)."""
    judgement = record.judgement
    if judgement is None or judgement.checked_peak_bytes is None:
        return True
    return judgement.checked_peak_bytes > (1 + CHECK_EXACT_FRACTION) * record.plan.predicted_peak_bytes
