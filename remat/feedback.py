"""The feedback loop: the measured peak, not the simulator, has the last word on a plan.

How it works. ``RematBackend`` hands Dynamo a ``VerifiedGraph`` around each training graph
it compiled (inference graphs are not wrapped). For the first ``verify_peak`` steps after each
compile (default 1; ``remat.backend(verify_peak=0)`` turns the loop off), the wrapper
measures one window, ``measure.StepWindow``: from the compiled forward's entry to the end of
this graph's compiled backward (a post-hook on AOTAutograd's backward node). Everything
allocated in between counts (the eager loss too), above what was resident at the forward's
entry, as ``remat.measure_peak_bytes`` counts it. On CUDA that is the allocator's statistics (bytes
allocated at entry, a reset of the peak, the peak at the end: no synchronisation, nothing
measurable per step); on CPU a ``torch.profiler`` session, stopped outside the autograd
engine: at the next call of a remat graph, ``optimizer.step()``, ``remat.measure_peak_bytes``
or the end of a ``StepMonitor`` step, whichever comes first. A step is not measured (the next
is) when its backward never ran, when another profiler already ran on the thread, when another
remat graph ran inside the window (a graph break: the window's peak is then not this graph's;
once the step's graphs are known, one window measures the whole step instead: remat/step_loop.py),
or when another run's backward is pending at its entry (no CPU window opens mid-step: ``_mid_step``; a forward
kept without its backward, a validation pass outside ``torch.no_grad()``, holds every later call so),
or when a DDP/FSDP2 graph is called again before its backward ran (FSDP2's units, whose ledger counts their runs:
then the window of its last call in the step is the one measured); after ``MAX_UNMEASURED`` such steps in a row the
graph stops trying ("not measured: <why>"), so such graphs cost the profiler on a few steps only.

A graph planned for one run per step that runs again before its backward (the same model called
twice in a step: contrastive views, R-Drop; one compiled block run once per layer: "regional
compilation", ``block.compile()`` on each block) stacks its runs: each keeps what it holds for its
backward while the next runs. Its window then holds all of them, from the first run's forward entry
to the end of the last of their backwards (``window_runs.WindowRuns``; up to ``MAX_RUNS_PER_WINDOW``
runs), and is judged against the plan's stacked prediction (``stacked_prediction``); over the budget,
the correction carries the runs, and the re-plan (and a later process, from the store) plans the graph
for them (``runs_share.runs_share``). A run whose backward never ran in the window (a forward whose
loss was not backpropagated) makes the window unmeasured; one whose autograd graph was freed is not
joined. An exception that leaves a call or a compile (a refusal) closes the window open on the thread,
unmeasured (``window_runs.abandon_step``): the next step, a retry's, is measured.

A step that accumulates gradients over several forward and backward passes (micro-batches) holds, from its second
pass on, the gradients the earlier passes left: the step's memory, below the window's baseline. A plan's first step
is watched for a call whose parameters hold such gradients (``accumulated_grads.AccumulationWatch``); that call is
measured too, the gradients added to its measured and predicted peaks, and over the budget the correction carries
them: the graph is re-planned next to them (``runs_share.runs_share``'s outside bytes).

Then ``feedback_verdict.judge`` compares the measured peak with the plan's budget (within it, re-planned, stored for
the next compile, or best effort: that module says when each). A graph whose outputs feed a loss outside it is also
told what that loss held between its forward and backward, measured in the same window, and re-planned for it where
its plan reserved much more, or ran over by what the loss held above the reserve (``eager_loss.py``).

Every factor is stored on disk (``feedback_store``): the next process, and any later compile of the same graph
under the same plan options in this one, plans at the corrected target first.
What it guarantees, and when a step may still run over the budget: with the loop on, a graph whose plan measures
over budget runs over on exactly one step, the measured one (the first after its compile: it is how the error is
found), plus one step per further re-plan whose new plan still measures over (at most ``MAX_REPLANS``); in a later
process a stored correction makes the first step plan right. With CPU measurement
skipped (another profiler running, no backward) the discovery moves to the next step measured. Dynamic-shape and
DDP/FSDP2 graphs keep running over until they are next compiled. With ``verify_peak=0`` nothing is measured and
only corrections already stored apply. Gradients a step's earlier backwards left (gradient accumulation) do not make
a step run over where the plan's accepted peak next to them says it would: the call that finds them is re-planned
next to them before it runs (``_replan_next_to``; a step at graph breaks at its first entry, ``step_loop``), or
refused there.

Reusing it: ``VerifiedGraph.request_replan(correction)`` re-plans that graph at its next call at
``correction.corrected_target(base target)``, or earlier through ``replan_ahead`` (on fake inputs).
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
import warnings
import weakref
from typing import Any, Callable, Optional

import torch

from ._torch_graph_breaks import fake_inputs, input_specs
from .errors import BudgetInfeasibleError
from .feedback_store import Correction, write_correction
from .feedback_verdict import (FORESEEN_ACTION, FeedbackEvent, accepted_as_fitting, judge, planned_runs,
                               stacked_prediction)
from .eager_loss import STORED_ACTION, eager_loss_correction, measured_eager_loss_bytes, output_bytes
from .measure import BACKWARD_STARTED_MARKER, FORWARD_RETURNED_MARKER, StepWindow, open_window
from .accumulated_grads import AccumulationWatch
from .window_runs import RunInFlight, WindowRuns, abandon_step, runs_in_flight

log = logging.getLogger("remat")

MAX_UNMEASURED = 3  # windows in a row that measured nothing (see the module docstring) before it stops trying
# why a call that found another run's backward pending measured nothing (no CPU window may open there: _mid_step)
MID_STEP_WHY = ("another run's backward was pending at its entry (a forward kept without its backward, e.g. a "
                "validation pass outside torch.no_grad(); runs of graphs of different backends interleaved): no CPU "
                "window opens mid-step")
MAX_RUNS_PER_WINDOW = 256   # runs of one graph one window may hold (a graph run many times per step); then spoiled


Recompile = Callable[[list, Correction], tuple[Callable[..., Any], Any]]


class VerifiedGraph:
    """The callable Dynamo runs for one compiled training graph: the compiled code, measured
    on the first ``verify_peak`` steps after each compile and re-planned when over budget.

    ``record`` is the ``CompiledGraph`` now running. ``recompile(args, correction)`` (None
    where the graph cannot be recompiled in place) compiles a fresh copy of Dynamo's graph for
    ``args`` with the correction applied and returns ``(callable, record)``.
    ``watch_backward(outputs, at_end, at_start=None)`` arranges ``at_end()`` (unless None) at the end
    of the backward pass that runs this call's backward (and ``at_start()`` right before it) and returns
    the backward node it watches (``_torch_compile.watch_compiled_backward``), or a false value if no
    output leads to one.
    ``store(graph_key, correction)`` keeps a correction (default: the on-disk store) and
    returns where, or None. ``outputs_held``: ``RematOptions.outputs_held``.
    """

    def __init__(self, fn: Callable[..., Any], record: Any, *, device: torch.device, verify_peak: int,
                 events: list[FeedbackEvent], recompile: Optional[Recompile], watch_backward: Callable[..., bool],
                 store: Callable[[str, Correction], Optional[str]] = write_correction, step: Any = None,
                 runs_stack: bool = False, outputs_held: bool = False, dynamic: bool = False) -> None:
        self._fn, self._dynamic = fn, dynamic     # dynamic shapes: re-planned in place at one call's sizes, in a step
        self.record = record
        self.device = device
        self._verify_peak = self._verify_left = verify_peak
        self._events = events
        self._recompile = recompile
        self._watch_backward = watch_backward
        self._store = store
        self._step = step    # the step's account across graph breaks (remat/step_loop.StepHooks), or None
        self._calls = itertools.count()
        self._pending: Optional[Correction] = None
        self._replans = 0
        self._unmeasured = 0
        self._specs: Optional[tuple] = None    # its inputs' metadata (first call), for replan_ahead
        self._runs_stack = runs_stack
        self._window_runs = WindowRuns(None)    # the runs of this graph's last window
        self._accumulation = AccumulationWatch(getattr(step, "grads", None) if verify_peak > 0 else None)  # its ledger
        self._grad_leaves: dict[int, weakref.ref] = {}     # id -> an input that is a leaf requiring gradients
        # what the forward measured last returned for the loss (``eager_loss.output_bytes``), unless the caller holds its
        # outputs through the backward (``outputs_held``: they are the plan's to count, not the loss's)
        self._returned_bytes, self._outputs_held = 0, outputs_held
        self._lock = threading.Lock()

    @property
    def can_replan(self) -> bool:
        """Whether ``request_replan`` can re-plan this graph in place: a dynamic-shape graph only in a step of
        several graphs, at the sizes of the call that re-plans it (``size_dispatch.py``)."""
        return self._recompile is not None and (not self._dynamic or self._step is not None and self._step.measures(self))

    @property
    def step_hooks(self) -> Any:
        """The step's account across graph breaks this graph reports to (``step_loop.StepHooks``), or None."""
        return self._step

    @property
    def replan_pending(self) -> bool:
        """Whether a re-plan was asked for and not made yet (it is made at the next call)."""
        return self._pending is not None

    @property
    def pending_correction(self) -> Optional[Correction]:
        """The correction of the re-plan asked for and not made yet, or None."""
        return self._pending

    def request_replan(self, correction: Correction) -> None:
        """Re-plan this graph at ``correction.corrected_target(base target)`` on its next call."""
        with self._lock:
            self._pending = correction

    def replan_ahead(self) -> bool:
        """Make the re-plan asked for now, before this graph's next call, on fake inputs shaped like
        its last call's (nothing of their size is allocated). Returns whether one was made: False
        when none is pending or the graph was never called. May raise ``BudgetInfeasibleError``."""
        with self._lock:
            pending, specs = self._pending, self._specs
            if pending is None or specs is None:
                return False
            self._pending = None
        self._replan(fake_inputs(specs), pending, -1)
        return True

    def __call__(self, *args: Any) -> Any:
        try:
            return self._call(*args)
        except BaseException:
            abandon_step(f"its step was abandoned: an exception left a call of {self.record.graph_id}")
            raise

    def _call(self, *args: Any) -> Any:
        joined, mid_step, own_spoiled = self._settle_open_window()
        step = next(self._calls)
        if self._specs is None and self._recompile is not None:
            self._specs = input_specs(args)
        if self._accumulation.count_call() or self._verify_left > 0:    # (every call counted: the watch ends)
            self._note_grad_leaves(args)
        if self._step is not None:
            self._step.entered(self, args)     # may ask for a re-plan of this graph, made now
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            self._replan(list(args), pending, step)
        measured_by_step = self._step is not None and self._step.measures(self)   # remat/step_loop.py
        window = joined
        if window is None and not measured_by_step:
            if not mid_step and not self._mid_step():
                accumulated = self._accumulation.look(self.grad_leaves, self._verify_left > 0)
                if accumulated:
                    self._replan_next_to(list(args), accumulated, step)
                window = self._open_window(step, accumulated) if self._verify_left > 0 or accumulated else None
            elif self._verify_left > 0 and not own_spoiled:     # (a spoiled window of its own counted as it closed)
                self._on_measured(self.record, step, None, MID_STEP_WHY)
        if self._step is not None:
            self._step.phase(self, "fwd-enter")
        out = self._fn(*args)
        if self._step is not None:
            self._step.phase(self, "fwd-exit")
        if self.device.type == "cpu" and (self._verify_left > 0 or self._accumulation.watching):   # (_mid_step)
            # out of flight when its own backward node starts: the end ``watch_backward`` reports is the start of the
            # next node, which a parameter's gradient node shared with every other run of the graph can be (a later
            # run's backward then ended a forward kept without its backward: a window opened with it pending)
            in_flight = RunInFlight()
            in_flight.track(self._watch_backward(out, None, at_start=in_flight.finish))
        if step == 0:
            # its compile ran inside this step (Dynamo compiles a graph when the step first reaches
            # it): the frames the compile left in reference cycles keep the calling frames, and with
            # them the step's tensors, alive until a collection, which is made when its backward
            # starts (the forward's frames have returned by then). Measured: HF GPT-2's first step
            # held its logits (524 kB) through the backward, 1.02x the budget; the next steps 0.93x
            self._watch_backward(out, None, at_start=gc.collect)
        if self._step is not None:
            step_hooks = self._step
            self._watch_backward(out, lambda: (step_hooks.phase(self, "bwd-exit"), step_hooks.backward_done(self)),
                                 at_start=lambda: step_hooks.phase(self, "bwd-enter"))
        if window is not None:
            window.mark_phase(FORWARD_RETURNED_MARKER)     # what an eager loss holds: until the backward starts
            self._returned_bytes = 0 if self._outputs_held else output_bytes(out)
            index, began, finished = self._window_runs.start()
            node = self._watch_backward(out, finished,
                                        at_start=lambda: (window.mark_phase(BACKWARD_STARTED_MARKER), began()))
            if not node:
                # no backward to wait for: nothing measured (a run joining the window spoils it)
                window.spoil("a run of the graph in the window has no backward")
                window.close()
            else:
                self._window_runs.track(index, node)
        return out

    def _settle_open_window(self) -> tuple[Optional[StepWindow], bool, bool]:
        """The CPU window open on this thread, if any: a finished one, or this graph's own from an
        earlier step, is closed now (its result may ask for a re-plan before this call runs);
        another graph's unfinished one now holds this graph's run too, so it is spoiled. This graph's
        own unfinished window, where its plan was made for one run per step (``runs_stack``), is
        returned: the call joins it (its runs stack in one step: each keeps what it holds for its
        backward while the next runs), and the window ends when the last of their backwards does,
        up to ``MAX_RUNS_PER_WINDOW`` runs. Also returns whether this call is in the middle of a step: it
        found a window unfinished (a run's backward pending) and did not join it (``_mid_step``), and whether that
        window was its own (spoiled now: its close counts the step as unmeasured)."""
        window = open_window()
        if window is None:
            return None, False, False
        if self._step is not None and self._step.owns(window):   # the step's window: it holds every graph
            if window.marked:
                window.close()
            return None, False, False
        if window.owner is self and not window.marked:
            runs = self._window_runs
            if (self._runs_stack and not window.spoiled_by and not runs.orphaned()
                    and runs.started < MAX_RUNS_PER_WINDOW):
                return window, False, False
            window.spoil("called again before its backward ran (a graph run several times per step: "
                         "its peak is not one call's)")
        mid_step, own = not window.marked, window.owner is self
        if mid_step and not own and self._step is not None and self._step.adopt(window):
            return None, True, False    # the first step's: the window goes on, measuring the whole step
        if window.marked or own:
            window.close()
        else:
            window.spoil(f"{self.record.graph_id} ran inside the window (a graph break: its peak is not one graph's)")
        return None, mid_step, mid_step and own

    def _mid_step(self) -> bool:
        """Whether another run's backward is pending as this one enters a CPU forward (a run tracked on this thread,
        ``window_runs.runs_in_flight``, budget or not; or one the step's account holds): a graph-break model called
        twice per step runs A, B, A, B. No CPU window opens then: one opened there (its profiler started with
        earlier runs' autograd graphs pending) corrupted memory (hf-1454 of the corpus, a Hugging Face GPT-2 split
        at a graph break, called twice per step with no budget: gradients 1e6-6e35x off in its second step, or a
        segmentation fault in the backward's garbage collection; none without the windows); it measured nothing
        anyway. A CUDA window reads the allocator (FSDP2's units still measure their last run per step)."""
        return self.device.type == "cpu" and (
            runs_in_flight() > 0 or (self._step is not None and self._step.account.pending_runs() > 1))

    def _note_grad_leaves(self, args: tuple) -> None:
        """Keep (weakly) this call's inputs that are leaves requiring gradients: its parameters, every run's (a
        block compiled once and run per layer gets each layer's)."""
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.is_leaf and arg.requires_grad:
                known = self._grad_leaves.get(id(arg))
                if known is None or known() is not arg:
                    self._grad_leaves[id(arg)] = weakref.ref(arg)

    def grad_leaves(self) -> list:
        """The leaves requiring gradients its calls were given while the loop looked (``_note_grad_leaves``), those
        still alive: whose gradients ``AccumulationWatch.look`` counts."""
        return [t for ref in list(self._grad_leaves.values()) if (t := ref()) is not None]

    def _open_window(self, step: int, accumulated_grad_bytes: int = 0) -> Optional[StepWindow]:
        record = self.record
        def closed(peak: Optional[int], why_not: str) -> None:
            self._accumulation.note_window(window.retained_bytes)
            eager = measured_eager_loss_bytes(window.between_bytes, self._returned_bytes) if runs.started == 1 else None
            self._on_measured(record, step, *runs.measured(peak, why_not), accumulated_grad_bytes=accumulated_grad_bytes,
                              eager_loss_bytes=None if accumulated_grad_bytes else eager)
        window = StepWindow(self.device, owner=self, on_close=closed)
        runs = self._window_runs = WindowRuns(window)
        return window if window.open() else None

    def _replan(self, args: list, correction: Correction, step: int) -> None:
        """Recompile now. Runs inside the step's forward (Dynamo's frame is executing), so the
        frames the compile leaves in reference cycles (exceptions it caught) are collected before the
        step goes on: their ``f_back`` links kept the calling frames, and with them the step's
        outputs, alive until a garbage collection (measured: one forward output per graph of the
        step, live through the backward, 1.10x the budget where the next step measured 0.95x)."""
        assert self._recompile is not None
        try:
            self._fn, self.record = self._recompile(args, correction)
        except BudgetInfeasibleError:
            self._event_for(correction, step, "infeasible")
            raise
        except Exception as error:    # e.g. a graph compile_fx cannot take back outside Dynamo: keep running
            self._event_for(correction, step, "re-plan failed")
            self._verify_left = 0
            self._accumulation.stop()
            warnings.warn(f"remat {correction.graph_id}: re-planning it failed ({type(error).__name__}: {error}); "
                          "it keeps its plan, and its next compile plans with the stored correction.", stacklevel=2)
            return
        finally:
            gc.collect()
        self._replans += 1
        self._verify_left = self._verify_peak
        self._accumulation.restart()

    def _replan_next_to(self, args: list, accumulated_grad_bytes: int, step: int) -> None:
        """Re-plan before this call runs when its parameters hold gradients earlier backwards of the step left
        (``AccumulationWatch.look``) that its plan was not made next to, and its accepted peak next to them is over
        the budget: the call that finds them then fits, where measuring it first ran it over (gradient
        accumulation's second micro-batch in a plan's first step; before session 36 that step always ran over).
        The window that follows measures the new plan with them, as any call that finds them. No budget, a
        best-effort plan, no re-plan in place, or a plan made next to as much: nothing. May raise
        ``BudgetInfeasibleError`` (before the call runs)."""
        record = self.record
        budget, made_for = record.plan.budget_bytes, getattr(record, "correction", None)
        if (budget is None or not self.can_replan or not accepted_as_fitting(record)
                or (made_for is not None and made_for.accumulated_grad_bytes >= accumulated_grad_bytes)):
            return
        predicted = stacked_prediction(record, planned_runs(record), accepted=True) + accumulated_grad_bytes
        if predicted <= budget:
            return
        factor = made_for.factor if made_for is not None and not made_for.loosens else 1.0
        correction = Correction(factor, budget, predicted, predicted, record.graph_id,
                                f"foreseen: {record.graph_id} call {step} found {accumulated_grad_bytes} bytes of the "
                                "step's gradients in its parameters", runs=planned_runs(record),
                                accumulated_grad_bytes=accumulated_grad_bytes, foreseen=True).keeping_step_use(made_for)
        self._replan(args, correction, step)
        self._store(record.graph_key, correction)      # a later process plans next to them from its first call
        self._events.append(FeedbackEvent(record.graph_id, step, budget, predicted, None, None, FORESEEN_ACTION,
                                          accumulated_grad_bytes=accumulated_grad_bytes))
        log.info("remat %s: call %d found %d bytes of the step's gradients in its parameters; its plan predicted %d "
                 "bytes next to them, over the budget %d: re-planned next to them before running", record.graph_id,
                 step, accumulated_grad_bytes, predicted, budget)

    def _event_for(self, correction: Correction, step: int, action: str) -> None:
        """The event of a re-plan at ``correction`` that ended in ``action``; its measured peak is the one the
        correction was measured at, None for a foreseen correction (nothing ran: ``Correction.foreseen``)."""
        measured = None if correction.foreseen else correction.measured_peak_bytes
        self._events.append(FeedbackEvent(correction.graph_id, step, correction.budget_bytes,
                                          correction.predicted_peak_bytes, measured,
                                          correction.factor, action, runs=correction.runs,
                                          accumulated_grad_bytes=correction.accumulated_grad_bytes))

    def _on_measured(self, record: Any, step: int, peak_bytes: Optional[int], why_not: str, runs: int = 1,
                     accumulated_grad_bytes: int = 0, eager_loss_bytes: Optional[int] = None) -> None:
        """A window closed: judge it, record the event, warn and re-plan when over budget. ``runs``: the
        graph's runs the window held (several when they stack in one step, ``_settle_open_window``).
        ``accumulated_grad_bytes``: the step's gradients held at the window's entry (``AccumulationWatch``),
        below the window's baseline but part of the step's peak: added to the measured and predicted peaks.
        ``eager_loss_bytes``: what an eager loss held between the forward and the backward (``eager_loss.py``):
        within the budget and under the plan's reserve, the graph is re-planned for it."""
        if record is not self.record:
            return      # a window of a plan already replaced
        plan = record.plan
        if peak_bytes is None:
            self._unmeasured += 1
            if self._unmeasured >= MAX_UNMEASURED:
                self._verify_left = 0
                self._accumulation.stop()
                self._events.append(FeedbackEvent(record.graph_id, step, plan.budget_bytes, plan.predicted_peak_bytes,
                                                  None, None, f"not measured: {why_not}"))
            return
        self._unmeasured = 0
        self._verify_left = max(self._verify_left - 1, 0)
        if accumulated_grad_bytes:
            self._accumulation.stop()     # measured with them: the watch has done its job
        own_predicted, own_peak = stacked_prediction(record, runs), peak_bytes
        predicted, peak_bytes = own_predicted + accumulated_grad_bytes, peak_bytes + accumulated_grad_bytes
        verdict = judge(plan.budget_bytes, record.base_target_bytes, predicted, peak_bytes,
                        accepted_as_fitting(record), self._replans, self.can_replan)
        eager = eager_loss_correction(record, eager_loss_bytes, peak_bytes, step) \
            if self.can_replan and verdict.action in ("within budget", "re-planned") else None
        self._events.append(FeedbackEvent(record.graph_id, step, plan.budget_bytes, predicted, peak_bytes,
                                          verdict.factor, eager[0] if eager else verdict.action,
                                          None if eager else verdict.new_target_bytes, runs, accumulated_grad_bytes))
        if eager is not None:    # for what the loss held (remat/eager_loss.py); measured again after the re-plan
            if eager[0] != STORED_ACTION:
                self.request_replan(eager[1])
            path = self._store(record.graph_key, eager[1])
            if peak_bytes > plan.budget_bytes:
                warnings.warn(f"remat {record.graph_id}: step {step} measured a peak of {peak_bytes / 1e9:.6f} GB, over "
                              f"the budget {plan.budget_bytes / 1e9:.6f} GB: its eager loss held {eager_loss_bytes} bytes "
                              f"between the forward and the backward where {record.eager_loss_bytes} were reserved; "
                              f"re-planning it for them from its next call (correction stored in {path}).", stacklevel=2)
            return
        if verdict.action == "within budget":
            return
        self._verify_left = 0
        self._accumulation.stop()
        stacked = (f" over {runs} runs of the graph before their backwards (each earlier run keeps what it holds for "
                   f"its backward while the next runs)" if runs > 1 else "")
        made_for = "" if runs <= 1 else (f" for {runs} stacked runs (its plan was made for {planned_runs(record)} "
                                         f"run(s) per step: it is re-planned for {runs})")
        if accumulated_grad_bytes:
            stacked += (f", counting the {accumulated_grad_bytes / 1e9:.6f} GB of gradients earlier backwards of the "
                        "step had left in its parameters (gradient accumulation: the graph is re-planned next to them)")
        message = (f"remat {record.graph_id}: step {step} measured a peak of {peak_bytes / 1e9:.6f} GB{stacked}, over "
                   f"the budget {plan.budget_bytes / 1e9:.6f} GB; the plan predicted {predicted / 1e9:.6f} GB"
                   f"{made_for} (measured / predicted = {verdict.factor:.3f}; 1 GB = 1e9 bytes)")
        if verdict.new_target_bytes is None:
            warnings.warn(f"{message}: {verdict.action}, the graph keeps its plan.", stacklevel=2)
            return
        # stacked runs, accumulated gradients: the factor is the simulator's error on the graph's own peak (under 1
        # where the stacked prediction is conservative), the correction re-plans for the runs and gradients
        stepped = runs > 1 or accumulated_grad_bytes > 0
        correction = Correction(max(own_peak / max(own_predicted, 1), 1.0) if stepped else verdict.factor,
                                plan.budget_bytes, predicted, peak_bytes, record.graph_id,
                                f"measured in this process: {record.graph_id} step {step}", runs=runs,
                                accumulated_grad_bytes=accumulated_grad_bytes,   # and the eager loss, as measured
                                eager_loss_bytes=eager_loss_bytes if getattr(record, "eager_loss_bytes", 0) else None)
        path = self._store(record.graph_key, correction)
        stored = f"stored in {path}" if path else "not stored (the feedback store is not writable)"
        if verdict.action == "re-planned":
            self.request_replan(correction)
            what = f"re-planning it at a target of {verdict.new_target_bytes / 1e9:.6f} GB from its next call"
        else:
            what = f"its next compile plans at {verdict.new_target_bytes / 1e9:.6f} GB"
        warnings.warn(f"{message}: {what}; correction {stored}.", stacklevel=2)
