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
- **Eager code between and around the graphs** (``step_eager.py``): measured by phase from the first step (measured
  whole), and what each graph's re-plans are made next to.
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

from ._torch_dynamo import passthrough_error_class
from .accumulated_grads import AccumulationWatch, GradientLedger
from .compile_cache import StepKey, step_key_of
from .errors import BudgetInfeasibleError, raise_budget_hint
from .feedback_store import Correction
from .measure import StepWindow, open_window
from .step_budget import StepAccount, slot_of
from .step_eager import StepEagerHooks, eager_summary, prelude_bytes, step_correction, step_name
from .step_memory import RememberedStep, expected_share, remember_step, settled
from .units import format_bytes

log = logging.getLogger("remat")

MAX_STEP_REPLANS = 2       # re-plans of one graph the step's condition asks for; then it warns and stops
MAX_STEP_CORRECTIONS = 3   # rounds of re-plans a measured step over its budget asks for
MIN_CORRECTION_GAIN = 0.01  # a round lowering the measured step peak by less than this fraction: the step is refused
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


class StepHooks(StepEagerHooks):
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
