"""The step's closed loop across graph breaks: what the ``VerifiedGraph`` wrappers call at run time.

``StepHooks`` keeps the step's account (``remat/step_budget.py``) from the wrappers' calls, asks
for the re-plans the account's condition needs, and measures whole steps:

- **Re-plans.** A graph whose plan breaks the step's condition is re-planned
  (``VerifiedGraph.request_replan``): at its forward entry, when it does not fit next to what the
  graphs pending now hold; at the end of a step, every graph planned before its step's graphs were
  known (``StepGraph.provisional``: its leanest plan, or the first step's partial share) and
  every graph of the sequence before the last one over (they hold what it runs next to; it is
  re-planned at its entry if it still does not fit), or the first graph if it alone is over. The
  re-plans the end of a step asks for are made at the first graph's next forward entry, before it
  runs, all of them in forward order on fake inputs (``VerifiedGraph.replan_ahead``): a compile
  inside the step, next to what earlier graphs hold, measured over the budget (objects of the
  step it keeps alive until a garbage collection). At most ``MAX_STEP_REPLANS`` per graph, then
  one warning.
- **The measured step.** Once the sequence is known (several graphs), the wrappers' own windows
  give way to one window per step, ``measure.StepWindow``: from the first graph's forward entry to
  the end of the step's last backward (nothing pending any more), the first ``verify_peak`` steps
  after each re-plan. A step in which a graph is re-planned is not measured (the compile's
  allocations would count). Over the budget, every graph of the step is re-planned with the same
  factor ``measured / predicted`` step peak (the composed peak ``step_peak_bytes``): the
  correction is proportional, each graph's target scaled by it, since the step's peak is where the
  graphs' simulated peaks compose and the simulator's error cannot be told apart by graph there.
  At most ``MAX_STEP_CORRECTIONS`` such rounds; each is a ``FeedbackEvent`` with graph id
  ``step:<first>..<last>``. Not stored on disk (the per-graph store keys one graph's error). A step whose
  graphs' parameters hold gradients an earlier pass of the step left (gradient accumulation:
  ``accumulated_grads.py``) is measured too, on a plan's first step, with them added to both peaks; over the
  budget every graph is re-planned next to them (each share holds them outside the graphs), and the settled
  step a later process recalls carries them.
- **Eager code between and around the graphs.** The window marks each graph's phases (``phase``: forward entry
  and return, backward start and end), and the first step is measured whole too (``adopt``: the window the first
  graph opened, which the second graph's entry spoiled before). Where every plan was accepted on its
  Inductor-checked peak, what was live in each phase beyond what the plans hold there (``eager_by_graph``) is
  what each graph's re-plans are made next to: from the first step, in the re-plans its provisional plans get;
  from a later step over the budget, in a round of its own (additive: ``Correction.eager_step_bytes`` and
  ``eager_loss_bytes``, not a factor). A graph that no plan fits next to it refuses the budget before the next
  step runs, naming one (``ShareInfeasibleError``).
- **A step no plan fits** (``judge_step``). A step measured over its budget after a round of re-plans that
  lowered its measured peak by less than ``MIN_CORRECTION_GAIN`` (or after ``MAX_STEP_CORRECTIONS`` rounds)
  is over by memory remat's plans do not hold: eager code between or inside the graphs (a Hugging
  Face model with gradient checkpointing runs its checkpointed layers' recomputation eagerly: a
  1-layer Qwen2 measured 2,080,456 B at budgets of 1.87, 1.46 and 1.32 MB, its graphs' plans composing
  1.19 MB). The next step's first forward entry raises ``BudgetInfeasibleError`` naming the largest step
  peak measured (rounded up) as the budget to pass, where before it ran over on every step after one
  warning. That figure is empirical: the plans a higher budget gets are looser, and on that Qwen2 the
  lowest peak measured (2.08 MB, refused again at that budget with 2.21) was not enough where the largest
  (2.21 MB) was accepted and measured 2,211,784 B. Under ``best_effort=True`` the step warns and runs on.
"""

from __future__ import annotations

import logging
import threading
import warnings
from dataclasses import replace
from typing import Any, Optional, Sequence

import torch

from ._torch_dynamo import passthrough_error_class
from .accumulated_grads import AccumulationWatch, GradientLedger
from .compile_cache import StepKey, step_key_of
from .errors import BudgetInfeasibleError, raise_budget_hint
from .feedback_store import Correction
from .measure import STEP_PHASE_PREFIX, StepWindow, open_window
from .step_budget import StepAccount, slot_of, step_totals
from .step_memory import RememberedStep, expected_share, remember_step, settled
from .units import format_bytes

log = logging.getLogger("remat")

MAX_STEP_REPLANS = 2       # re-plans of one graph the step's condition asks for; then it warns and stops
MAX_STEP_CORRECTIONS = 3   # rounds of re-plans a measured step over its budget asks for
MIN_CORRECTION_GAIN = 0.01  # a round lowering the measured step peak by less than this fraction: the step is refused
FIRST_STEP_ACTION = "the first step, measured whole: "
# eager memory a step measured under this fraction of its budget is left to the headroom (Inductor's check keeps 1% on
# CPU): an eager loss's scalar, the 8 bytes of a sum, are no reason to re-plan, and a re-plan next to eager memory
# is not keyed in AOTAutograd's cache (``key_at_replan``)
EAGER_NOISE_FRACTION = 0.005
INTERLEAVED_RUNS_WARNING = (
    "remat: {graph} ran again after another graph, before its backward (a model with graph breaks called several "
    "times per step, or a forward whose loss was not backpropagated): remat cannot account such a step across its "
    "graphs, and does not measure it; its peak may exceed the budget (docs/budget.md, \"A graph that runs several "
    "times before its backwards\"). Once per backend.")


def judge_step(budget_bytes: int, peak_bytes: int, over_before: Sequence[int], corrections: int,
               refuses: bool = True, stuck: bool = False) -> str:
    """The step loop's decision on one measured step (pure: numbers in, a verdict out): "within budget";
    "re-plan"; "refuse" when re-planning does not bring the step lower (the last round lowered the measured
    peak by less than ``MIN_CORRECTION_GAIN``, or ``MAX_STEP_CORRECTIONS`` rounds were made, or, where a graph of
    the step cannot be re-planned in place (``stuck``: dynamic shapes), one round was made: the graphs that can were
    re-planned and the step is still over); "run over" in that case when the backend does not refuse
    (``best_effort=True``). ``over_before``: the step peaks measured over the budget before this one, in order;
    ``corrections``: the re-plan rounds made so far."""
    if peak_bytes <= budget_bytes:
        return "within budget"
    no_gain = bool(over_before) and peak_bytes > over_before[-1] * (1 - MIN_CORRECTION_GAIN)
    if corrections >= MAX_STEP_CORRECTIONS or no_gain or (stuck and corrections >= 1):
        return "refuse" if refuses else "run over"
    return "re-plan"


class StepHooks:
    """The run-time side of the step's account (see the module docstring). One per backend."""

    def __init__(self, account: StepAccount, verify_peak: int = 1, events: Optional[list] = None,
                 context: str = "", refuses: bool = True) -> None:
        self.account = account
        self._refuses = refuses                 # False under best_effort: a step no plan fits warns and runs
        self._context = context                 # the backend's options (RematOptions.cache_key): remembered steps' key
        self._identities: dict[str, str] = {}   # slot -> its graph's call identity (compile_cache.graph_identity)
        self._verify_peak = self._verify_left = verify_peak
        self._events = events if events is not None else []
        self._wrappers: dict[str, Any] = {}     # slot -> its wrapper
        self._replans: dict[str, int] = {}
        self._corrections = 0
        self._over_bytes: list[int] = []            # the measured step peaks over the budget, in order
        # what eager code made in the step before its first graph and handed to it (``prelude_bytes``): live before any
        # window of the step opens, so no window sees it
        self._prelude_bytes = 0
        # slot -> (during its run, after its forward): the most a measured step's eager code held there (eager_by_graph)
        self._eager: dict[str, tuple[int, int]] = {}
        self._refusal: Optional[BudgetInfeasibleError] = None   # raised at the next step's first forward entry
        # the last re-plan round asked for: (the step measured, its composed prediction, each graph's saved set then);
        # its measured peak is the last of _over_bytes
        self._round: Optional[tuple[int, int, dict[str, Any]]] = None
        self._steps = 0
        self._window: Optional[StepWindow] = None
        self._remembered: Optional[RememberedStep] = None    # the settled step last stored (step_memory.py)
        # which gradients are the step's (gradient accumulation: accumulated_grads.py), and when a step looks for them
        self.grads = GradientLedger() if verify_peak > 0 else None
        self._accumulation = AccumulationWatch(self.grads)
        self._lock = threading.Lock()

    def register(self, wrapper: Any, identity: str = "") -> None:
        """Account for ``wrapper`` (a ``VerifiedGraph``) from now on; ``identity``: its graph's call identity."""
        with self._lock:
            self._wrappers[slot_of(wrapper.record.graph_id)] = wrapper
            self._identities[slot_of(wrapper.record.graph_id)] = identity
        self._accumulation.restart()     # a graph compiled: its first step is looked at for accumulated gradients

    def key_at_compile(self, identity: str) -> Optional[StepKey]:
        """The ``StepKey`` of the graph of call identity ``identity`` Dynamo compiles now, after the graphs
        pending in this step: the share a remembered step gives it (``step_memory.expected_share``), with the
        pending graphs; None when no remembered step does."""
        earlier = [(self._identities.get(slot, ""), graph) for slot, graph in self.account.pending_graphs()]
        share = expected_share([g for _, g in earlier], [i for i, _ in earlier], identity, self._context)
        return step_key_of(share, earlier)

    def key_at_replan(self, wrapper: Any, correction: Correction) -> Optional[StepKey]:
        """The ``StepKey`` of a re-plan of ``wrapper``'s graph with ``correction``, made under its share of the
        known sequence: the share ``StepAccount.share_for`` gives it now, at the step target its running plan
        was made at (so None unless ``correction`` keeps that plan's factor), with the graphs before it in the
        sequence. The share is what the next process's graph is planned at once the step settles
        (``key_at_compile``), so the re-plan is stored under the key that process computes."""
        slot, sequence = slot_of(wrapper.record.graph_id), self.account.sequence
        running, first = self.account.plan_of(wrapper.record.graph_id), self.account.plan_of(slot)
        own = wrapper.record.correction.factor if wrapper.record.correction is not None else 1.0
        if (slot not in sequence or len(sequence) < 2 or running is None or first is None or correction.factor != own
                or correction.accumulated_grad_bytes or correction.eager_step_bytes):
            return None   # planned next to accumulated gradients or eager memory a step measured: not keyed
        earlier = []
        for before in sequence[:sequence.index(slot)]:
            found = self._wrapper(before)
            graph = None if found is None else self.account.plan_of(found.record.graph_id)
            if graph is None:
                return None
            earlier.append((self._identities.get(before, ""), graph))
        share = self.account.share_for(slot, running.step_target_bytes, first.input_activation_bytes,
                                       first.param_grad_bytes, running.need_bytes, False, running.graph_key)
        return step_key_of(share, earlier)

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
        each graph's forward (``eager_by_graph``), where every graph's plan was accepted on its Inductor-checked peak,
        is what each re-plan of the step is made next to (the provisional plans' re-plans at the next step's entry,
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
        eager = self._note_eager(wrappers, sequence, peak_bytes, phase_peaks, budget)
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

    def _note_eager(self, wrappers: Sequence[Any], sequence: tuple[str, ...], peak_bytes: int,
                    phase_peaks: Optional[dict[str, int]], budget_bytes: int) -> dict[str, tuple[int, int]]:
        """What a measured step's eager code held by graph (``eager_by_graph``; nothing unless every plan was accepted
        on its Inductor-checked peak; under ``EAGER_NOISE_FRACTION`` of the budget, nothing), kept as the most
        measured so far per graph; returns this step's."""
        checked = checked_peaks(wrappers)
        if checked is None:
            return {}
        noise = EAGER_NOISE_FRACTION * budget_bytes
        measured = eager_by_graph(sequence, self.account.step_terms(sequence, checked), peak_bytes - self._prelude_bytes,
                                  phase_peaks)
        measured = {slot: (during + self._prelude_bytes, after) for slot, (during, after) in measured.items()}
        eager = {slot: tuple(b if b >= noise else 0 for b in held) for slot, held in measured.items()}
        for slot, (during, after) in eager.items():
            before = self._eager.get(slot, (0, 0))
            self._eager[slot] = (max(before[0], during), max(before[1], after))
            self.account.note_eager(slot, sum(self._eager[slot]))
        return eager

    def _request_next_to_eager(self, wrapper: Any, asked: Correction) -> None:
        """Re-plan ``wrapper``'s graph with ``asked``, next to what the step's eager code was measured to hold during its
        run (its share's outside bytes) and after its forward (its eager-loss reserve)."""
        during, after = self._eager.get(slot_of(wrapper.record.graph_id), (0, 0))
        wrapper.request_replan(replace(asked, eager_step_bytes=max(asked.eager_step_bytes, during),
                                       eager_loss_bytes=max(asked.eager_loss_bytes or 0, after) or asked.eager_loss_bytes))

    def measures(self, wrapper: Any) -> bool:
        """Whether the step window, not ``wrapper``'s own, measures it (its sequence has several graphs)."""
        return slot_of(wrapper.record.graph_id) in self.account.sequence and len(self.account.sequence) > 1

    def owns(self, window: Any) -> bool:
        return window is not None and window.owner is self

    def entered(self, wrapper: Any, args: Sequence[Any] = ()) -> None:
        slot = slot_of(wrapper.record.graph_id)
        if self._refusal is not None and slot == self.account.sequence[0]:
            raise passthrough_error_class(BudgetInfeasibleError)(self._refusal)
        spoiled = self.account.interleaved_runs
        self.account.forward_entered(slot)
        if self.account.at_step_start():
            self._prelude_bytes = prelude_bytes(args)
        if self.account.interleaved_runs > spoiled == 0:
            warnings.warn(INTERLEAVED_RUNS_WARNING.format(graph=wrapper.record.graph_id), stacklevel=3)
        why = self.account.check_entry(slot)
        if why is not None:
            self._replan(wrapper, why)
        first = self.account.sequence[:1] == (slot,) and self.account.at_step_start()   # not a later run of it
        if not self.measures(wrapper):
            return
        accumulated = 0
        if first and open_window() is None:
            self._accumulation.count_call()
            accumulated = self._accumulation.look(self._grad_leaves, self._verify_left > 0)
            if accumulated:
                self._replan_next_to(self.account.sequence, accumulated)
        if first:
            self._replan_ahead(self.account.sequence)
            self._round_changed_nothing(self.account.sequence)
        window = open_window()
        if wrapper.replan_pending and self.owns(window):
            window.spoil(f"{wrapper.record.graph_id} was re-planned inside the step (its compile's allocations count)")
        elif first and window is None and not wrapper.replan_pending:
            if self._verify_left > 0 or accumulated:
                self._open(wrapper.device, self.account.sequence, accumulated)

    def _replan_next_to(self, sequence: tuple[str, ...], accumulated_grad_bytes: int) -> None:
        """At the step's first entry, before anything runs: the step's gradients earlier backwards left in its graphs'
        parameters (gradient accumulation) that their plans were not made next to, next to which the step's composed
        prediction is over the budget: every graph is re-planned next to them now (``_replan_ahead``), so the pass
        that finds them fits (``feedback.VerifiedGraph._replan_next_to`` for a graph alone). A re-plan already asked
        for is made next to them in any case."""
        from .feedback import FeedbackEvent
        from .feedback_verdict import FORESEEN_ACTION

        wrappers = [w for slot in dict.fromkeys(sequence) if (w := self._wrapper(slot)) is not None]
        budgets = [w.record.plan.budget_bytes for w in wrappers if w.record.plan.budget_bytes is not None]
        made_next_to = [getattr(w.record.correction, "accumulated_grad_bytes", 0) for w in wrappers]
        if not budgets or min(made_next_to, default=0) >= accumulated_grad_bytes:
            return
        predicted = self.account.step_peak_bytes(sequence) + accumulated_grad_bytes
        # the running plans' prediction, over the budget next to them; a re-plan already asked for (step 1's
        # provisional plans, made at this entry) is made next to them whatever the running plans predict: its
        # plan is not the running one (hf-1469, a GPT-2 split at a break: its provisional plans predicted under the
        # budget next to the gradients, their re-plans made without them measured 1.13-1.25x in step 1)
        over = predicted > min(budgets)
        why = f"the step's parameters hold {format_bytes(accumulated_grad_bytes)} of its gradients (gradient accumulation)"
        for wrapper in wrappers:
            if wrapper.can_replan and (over or wrapper.pending_correction is not None):   # (keeps a measured factor)
                asked = wrapper.pending_correction or step_correction(wrapper.record, why)
                wrapper.request_replan(replace(asked, accumulated_grad_bytes=max(accumulated_grad_bytes,
                                                                                 asked.accumulated_grad_bytes)))
        if not over:
            return
        self._events.append(FeedbackEvent(step_name(sequence), self._steps + 1, min(budgets), predicted,
                                          None, None, FORESEEN_ACTION, accumulated_grad_bytes=accumulated_grad_bytes))
        log.info("remat: %s; the step's plans predict %d bytes next to them, over the budget: re-planning every graph "
                 "next to them before the step runs", why, predicted)

    def _grad_leaves(self) -> list:
        """The parameters (leaves requiring gradients) of every graph of the step (``VerifiedGraph.grad_leaves``)."""
        with self._lock:
            wrappers = list(self._wrappers.values())
        return [t for w in wrappers for t in w.grad_leaves()]

    def _open(self, device: Any, sequence: tuple[str, ...], accumulated_grad_bytes: int = 0) -> None:
        with self._lock:
            self._steps += 1
            number = self._steps
        def closed(peak: Optional[int], why_not: str) -> None:
            self._accumulation.note_window(window.retained_bytes)
            self._on_measured(sequence, number, peak, why_not, accumulated_grad_bytes, window.phase_peaks)
        window = StepWindow(device, closed, owner=self)
        if window.open():
            self._window = window

    def _replan_ahead(self, sequence: tuple[str, ...]) -> None:
        """At the first graph's forward entry, before it runs: every re-plan the graphs of
        ``sequence`` wait for is made now, in forward order (each graph's share sees the earlier
        graphs' new plans), so that none compiles inside the step next to what earlier graphs hold."""
        for slot in dict.fromkeys(sequence):      # a graph run several times: once
            found = self._wrapper(slot)
            if found is not None and found.replan_pending:
                found.replan_ahead()

    def backward_done(self, wrapper: Any) -> None:
        order = self.account.backward_done(slot_of(wrapper.record.graph_id))
        if order is None:
            return
        replans = {slot: ("planned before its step's graphs were known (its leanest plan, or a share next to the "
                          f"pending graphs only); the step is now known ({len(order)} graph(s))")
                   for slot in self.account.provisional(order)}
        if len(order) > 1:
            window = self._window
            if window is not None and not window.closed:
                window.mark_end()
            over = self.account.overruns(order)
            last = max((order.index(slot) for slot in over), default=-1)
            for slot in order[:max(last, 1)] if over else ():
                replans[slot] = over.get(slot) or (f"what it holds is live under {order[last]}, over the step "
                                                   f"target: {over[order[last]]}")
        for slot in dict.fromkeys(order):
            found = self._wrapper(slot) if slot in replans else None
            if found is not None:
                self._replan(found, replans[slot])
        if not replans:
            self._remember(order)

    def _remember(self, order: tuple[str, ...]) -> None:
        """A step completed with nothing to re-plan: if it is settled (``step_memory.settled``), store it
        for later processes, once per set of running plans."""
        wrappers = [self._wrapper(slot) for slot in order]
        step = settled([None if w is None else self.account.plan_of(w.record.graph_id) for w in wrappers],
                       [self._identities.get(slot, "") for slot in order])
        if step is not None and step != self._remembered:
            self._remembered = step
            remember_step(step, self._context)

    def _wrapper(self, slot: str) -> Any:
        with self._lock:
            return self._wrappers.get(slot)

    def _replan(self, wrapper: Any, why: str) -> None:
        slot = slot_of(wrapper.record.graph_id)
        with self._lock:
            done = self._replans.get(slot, 0)
            self._replans[slot] = done + 1
        if not wrapper.can_replan or done >= MAX_STEP_REPLANS:
            if done == (MAX_STEP_REPLANS if wrapper.can_replan else 0):    # once per graph
                warnings.warn(f"remat: the step may run over its budget: {why}; "
                              + ("it cannot be re-planned in place (dynamic shapes, or a graph that cannot be copied)."
                                 if not wrapper.can_replan else f"{MAX_STEP_REPLANS} re-plans did not fix it."),
                              stacklevel=3)
            return
        log.info("remat: re-planning %s under its share of the step: %s", wrapper.record.graph_id, why)
        wrapper.request_replan(step_correction(wrapper.record, why))
        self._verify_left = self._verify_peak
        self._accumulation.restart()

    def _on_measured(self, sequence: tuple[str, ...], number: int, peak_bytes: Optional[int], why_not: str,
                     accumulated_grad_bytes: int = 0, phase_peaks: Optional[dict[str, int]] = None) -> None:
        """A step window closed: compare the step's peak with the budget; over it, re-plan every
        graph of the step at its target divided by ``measured / predicted`` step peak. ``accumulated_grad_bytes``:
        the step's gradients held at the window's start (gradient accumulation), added to both peaks; over the
        budget, every graph is re-planned next to them (``StepAccount.share_for``) at its target divided by the
        graphs' own ``measured / predicted`` (at least 1)."""
        from .feedback import FeedbackEvent

        wrappers = [self._wrapper(slot) for slot in dict.fromkeys(sequence)]
        if peak_bytes is None or any(w is None for w in wrappers):
            return
        self._verify_left = max(self._verify_left - 1, 0)
        if accumulated_grad_bytes:
            self._accumulation.stop()     # measured with them: the watch has done its job
        peak_bytes += self._prelude_bytes      # made before the window opened, live through the step
        budget = min(w.record.plan.budget_bytes for w in wrappers)
        own_predicted, own_peak = self.account.step_peak_bytes(sequence), peak_bytes
        predicted, peak_bytes = own_predicted + accumulated_grad_bytes, peak_bytes + accumulated_grad_bytes
        name = step_name(sequence)
        if peak_bytes <= budget:
            self._events.append(FeedbackEvent(name, number, budget, predicted, peak_bytes, None, "within budget",
                                              accumulated_grad_bytes=accumulated_grad_bytes))
            return
        factor = peak_bytes / max(predicted, 1)
        last = self._over_bytes[-1] if self._over_bytes else None
        stuck = any(not w.can_replan for w in wrappers)     # (dynamic shapes: its plan is kept)
        verdict = judge_step(budget, peak_bytes, self._over_bytes, self._corrections, self._refuses, stuck)
        self._over_bytes.append(peak_bytes)
        if verdict == "run over":
            self._events.append(FeedbackEvent(name, number, budget, predicted, peak_bytes, factor,
                                              f"over budget after {self._corrections} step corrections (best effort)"))
            warnings.warn(f"remat: a step of {len(sequence)} graphs measured {format_bytes(peak_bytes)}, over the "
                          f"budget {format_bytes(budget)}, and re-planning does not lower it; best_effort=True: it "
                          "runs on.", stacklevel=2)
            return
        if verdict == "refuse":
            action = (f"infeasible: over budget after {self._corrections} step correction(s), the last lowering the "
                      f"measured peak from {last} to {peak_bytes} bytes")
            self._events.append(FeedbackEvent(name, number, budget, predicted, peak_bytes, factor, action))
            self._refuse(sequence, number, budget, predicted, peak_bytes,
                         f", the last taking it from {format_bytes(last)}" if last is not None else "", stuck)
            return
        self._corrections += 1
        self._round = (number, predicted, {slot_of(w.record.graph_id): w.record.plan.saved for w in wrappers})
        eager = self._note_eager(wrappers, sequence, own_peak, phase_peaks, budget)
        if any(max(e) for e in eager.values()):
            self._events.append(FeedbackEvent(name, number, budget, predicted, peak_bytes, factor,
                                              f"re-planned next to what eager code held: {eager_summary(eager)}",
                                              accumulated_grad_bytes=accumulated_grad_bytes))
            warnings.warn(f"remat: a step of {len(sequence)} graphs measured a peak of {format_bytes(peak_bytes)}, over "
                          f"the budget {format_bytes(budget)}, with eager code (between or around its graphs, which no "
                          f"generated code states) holding {eager_summary(eager)}; re-planning each graph next to it "
                          "from its next call.", stacklevel=2)
            for wrapper in wrappers:
                if wrapper.can_replan:
                    self._request_next_to_eager(wrapper, replace(
                        step_correction(wrapper.record, ""), budget_bytes=budget, predicted_peak_bytes=predicted,
                        measured_peak_bytes=peak_bytes, source=f"measured step {number} of {name}", foreseen=False,
                        accumulated_grad_bytes=accumulated_grad_bytes))
            self._verify_left = self._verify_peak
            self._accumulation.restart()
            return
        self._events.append(FeedbackEvent(name, number, budget, predicted, peak_bytes, factor, "re-planned",
                                          accumulated_grad_bytes=accumulated_grad_bytes))
        if accumulated_grad_bytes:    # the simulator's error is the graphs' own; the gradients are planned next to
            factor = max(own_peak / max(own_predicted, 1), 1.0)
        accumulated = (f", counting {format_bytes(accumulated_grad_bytes)} of gradients earlier backwards of the step "
                       "had left in the parameters (gradient accumulation: each graph is re-planned next to them)"
                       if accumulated_grad_bytes else "")
        warnings.warn(f"remat: a step of {len(sequence)} graphs measured a peak of {format_bytes(peak_bytes)}{accumulated}, "
                      f"over the budget {format_bytes(budget)}; the plans composed predicted {format_bytes(predicted)} "
                      f"(measured / predicted = {peak_bytes / max(predicted, 1):.3f}): re-planning each graph at its "
                      f"target / {factor:.3f} from its next call.", stacklevel=2)
        for wrapper in wrappers:
            record = wrapper.record
            if wrapper.can_replan:
                wrapper.request_replan(Correction(factor, budget, predicted, peak_bytes, record.graph_id,
                                                  f"measured step {number} of {name}",
                                                  accumulated_grad_bytes=accumulated_grad_bytes))
        self._verify_left = self._verify_peak
        self._accumulation.restart()

    def _refuse(self, sequence: tuple[str, ...], number: int, budget: int, predicted: int, peak_bytes: int,
                last: str, stuck: bool = False) -> None:
        """Refuse the budget at the step's next first entry, naming the largest step peak measured over it
        (``peak_bytes``: step ``number``'s, the last measured); ``stuck``: a graph of the step cannot be re-planned
        in place (the message says so)."""
        named = max(self._over_bytes)
        why = ("a graph of the step cannot be re-planned in place (dynamic shapes: a block compiled on its own and "
               "called on inputs of different shapes), and the others' re-plans did not bring the step under it"
               if stuck else "the rest is memory the plans do not hold (eager code between or inside the graphs)")
        self._refusal = BudgetInfeasibleError(
            f"budget {format_bytes(budget)} is below what this step of {len(sequence)} graphs measures: "
            f"{format_bytes(peak_bytes)} (step {number} measured, its plans composing a predicted {format_bytes(predicted)}) after "
            f"{self._corrections} round(s) of re-planning every graph{last}: {why}. The budget named is the largest step peak measured here "
            f"({len(self._over_bytes)} step(s)): plans made for it have at least the room every plan tried had. "
            + raise_budget_hint(named), budget_bytes=budget, min_feasible_bytes=min(self._over_bytes),
            min_budget_bytes=named, reasons=(f"{format_bytes(peak_bytes - predicted)} of the measured step is not in "
                                             "the plans' composed prediction",))

    def _round_changed_nothing(self, sequence: tuple[str, ...]) -> None:
        """After a round's re-plans were made (``_replan_ahead``): where none changed a graph's saved set, the step
        runs the code that measured over the budget again, and would measure the same: refuse now, not after
        running it (hf-1481, a Qwen2 whose checkpointed layers run eagerly between its graphs, accumulating: its
        second round re-made the first round's plans, and the step ran 1.11x over once more before the refusal)."""
        wrappers = [self._wrapper(slot) for slot in dict.fromkeys(sequence)]
        if self._round is None or any(w is None or w.replan_pending for w in wrappers):
            return
        (number, predicted, saved), self._round = self._round, None
        if self._refuses and all(w.record.plan.saved == saved.get(slot_of(w.record.graph_id)) for w in wrappers):
            from .feedback import FeedbackEvent

            budget = min(w.record.plan.budget_bytes for w in wrappers)
            self._events.append(FeedbackEvent(step_name(sequence), number, budget, predicted, None, None,
                                              "infeasible: the last round of re-plans changed no graph's plan"))
            self._refuse(sequence, number, budget, predicted, self._over_bytes[-1], ", the last changing no graph's plan")
            raise passthrough_error_class(BudgetInfeasibleError)(self._refusal)


def prelude_bytes(args: Sequence[Any]) -> int:
    """Bytes of the storages of a step's first graph's tensor inputs that autograd-tracked code made (a ``grad_fn``):
    memory eager code allocated in the step before its first compiled graph (an eager embedding or stem, where
    Dynamo compiled only a model's blocks), live when the step's window opens and so never in it, and live through
    the step while eager code holds it for its backward. The batch and the parameters have none. Each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in args if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    return sum(storages.values())


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
    # what each graph holds for its backward, as the window sees it: the first graph's inputs (counted in what it
    # holds) are the step's batch, resident before the window opened (if eager code made them in the step, they are
    # eager memory, and counted as such)
    held = [max(t[0] - (t[1] if k == 0 else 0), 0) for k, t in enumerate(terms)]
    for k, slot in enumerate(sequence):
        during = max(phase_peaks.get(f"fwd-enter:{slot}", 0), phase_peaks.get(f"bwd-enter:{slot}", 0)) - totals[k]
        after = phase_peaks.get(f"fwd-exit:{slot}", 0) - sum(held[:k + 1])
        eager[slot][0], eager[slot][1] = max(eager[slot][0], during), max(eager[slot][1], after)
        if k > 0:    # between its backward and the next: the graph before it is between its forward and backward
            after_backward = phase_peaks.get(f"bwd-exit:{slot}", 0) - sum(held[:k]) - sum(t[2] for t in terms[k:])
            previous = sequence[k - 1]
            eager[previous][1] = max(eager[previous][1], after_backward)
    return {slot: (during, after) for slot, (during, after) in eager.items()}


def eager_summary(eager: dict[str, tuple[int, int]]) -> str:
    """``eager_by_graph``'s answer in words: "x during graph_000's run, y after graph_001's forward, ..."."""
    parts = [f"{format_bytes(b)} {where} {slot}'s {what}" for slot, (during, after) in eager.items()
             for b, where, what in ((during, "during", "run"), (after, "after", "forward")) if b > 0]
    return ", ".join(parts) or "nothing"


def step_name(sequence: tuple[str, ...]) -> str:
    """The name a step's feedback events carry: ``step:<first graph>..<last graph>``."""
    return f"step:{sequence[0]}..{sequence[-1]}"


def step_correction(record: Any, why: str) -> Correction:
    """The correction a step re-plan of the plan ``record`` (a ``CompiledGraph``) is made with: its
    own feedback correction if it has one (the simulator's known error on it stays), else factor 1."""
    old = record.correction
    if old is not None:
        return replace(old, graph_id=record.graph_id)
    plan = record.plan
    return Correction(1.0, plan.budget_bytes, plan.predicted_peak_bytes, plan.predicted_peak_bytes, record.graph_id,
                      f"step budget: {why}", foreseen=True)
