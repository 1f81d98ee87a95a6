"""One budget per step across graph breaks: the step's account of remat's graphs.

Dynamo splits a step at graph breaks into graphs g_0 .. g_{n-1} and compiles them lazily, in
forward order: g_k is compiled (and planned) after g_0 .. g_{k-1} ran their forward in the same
step. Their backwards run in the reverse order. While g_k runs (forward or backward), besides what
its own plan simulates (its peak ``p_k``: saved values, temporaries, its parameters' gradients):

- ``held_j`` of every earlier graph j < k: what j's forward keeps for j's backward (its saved
  values and activation inputs, ``distributed_fit.held_bytes_of``), whose backward has not run;
- ``a_k``: g_k's activation inputs (g_{k-1}'s outputs; 0 for g_0, whose inputs are the batch,
  resident at step start as for a single graph);
- ``G_>k``: the parameter gradients the later graphs' backwards produced before g_k's backward.

The step fits when ``sum_{j<k} held_j + a_k + G_>k + p_k <= T`` for every k (T: the budget less
headroom). That is the DDP ledger's condition (``remat/distributed.py``), and the graphs are planned
by its rules: ``piece_target`` for the share, ``distributed_fit.fit_plan`` for the plan (kind
``"break"``). What this module adds is where the numbers come from: the ``VerifiedGraph`` wrappers
report at run time which graphs entered their forward and which finished their backward
(``forward_entered`` / ``backward_done``), so the held bytes counted are those of the graphs whose
backward is really pending, and a complete step (nothing pending any more) gives the sequence.

When each step may run over the budget (the simulator's error aside, which the feedback loop
corrects; measured figures in docs/budget.md):

- step 1 (the sequence is unknown): a graph Dynamo compiled at a graph break (more of its frame
  runs after it, ``_torch_graph_breaks.graph_break_follows``; or a compiled caller of its frame has a
  resume function still to run, ``caller_resumes_after``; or a caller runs eagerly inside the compiled
  call, ``called_from_eager_code``) takes its leanest plan (``leanest_plan``,
  kind "break-smallest"), since the later graphs and their gradients ``G_>k`` are unknown; so does a graph no
  break follows whose outputs eager code reads (a loss on them, ``step_fit.eager_code_follows``) while earlier
  graphs are pending, since what that code holds is unknown too; any other graph no break follows (the frame's last)
  is planned next to what the pending graphs hold (kind "break-partial"); one whose plan, next to what is live before it, is over the budget itself refuses the budget
  at once (``step_fit.runs_over_next_to_live``). Step 1 then fits unless the budget is below what the leanest plans
  compose, the
  step's graphs come from modules compiled one by one (no break tells the first that the second follows),
  or the leanest plan's assumption (the later graphs are like this one, ``copies_admitted``) is far off. A step an earlier
  process settled is planned at once at the shares it gave (``step_memory.py``): no provisional plans;
- at the end of step 1 the sequence is known (``backward_done`` returns it): every graph planned
  provisionally (``StepGraph.provisional``) and every graph whose plan breaks the condition above
  is marked for a re-plan under ``piece_target``'s share with the later graphs' gradients and a
  reserve for them. The re-plans are made at the first graph's next forward entry, before anything
  of step 2 runs, in forward order (each share sees the earlier graphs' new plans), on fake inputs
  (``remat/step_loop.py``), so none compiles next to what earlier graphs hold. At each forward entry
  a graph whose plan no longer fits next to the pending graphs is still re-planned before it runs
  (``check_entry``). A re-plan no plan meets raises ``BudgetInfeasibleError`` at step 2's first
  forward, naming a budget; step 1 may have run over then;
- a graph that enters its forward again right after itself, before its backward ran (a compiled block
  run once per layer), is a run of it: the sequence holds each run, and its share counts its consecutive
  runs as stacking (``share_in_step(runs=...)``, ``GraphShare.runs_peak_bytes``). A step of one graph's runs
  alone is the graph's own window's (``window_runs.py``), not a sequence. A graph entering again after
  another graph ran (its runs interleaved with another's, or a forward whose backward never ran) ends the
  accounting of that step: it is not used as a sequence; graphs planned provisionally in such steps keep
  those plans (slower, not larger);
- the simulator's error on the composed step: once the sequence is known, whole steps are measured
  (``remat/step_loop.py``); a step over the budget re-plans every graph at its target divided by
  ``measured / predicted`` step peak, so that step and the next one measured may run over.

The run-time side (the wrappers' hooks, the re-plans, the step window) is ``remat/step_loop.py``.
Memory eager code between and around the graphs holds (beyond the graphs' inputs) is not known before a
step ran; the step's window measures it by phase, from the first step on, and the re-plans are made next to it
(``step_eager.eager_by_graph``: a share's ``outside_bytes``, a graph's eager-loss reserve).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .distributed import GraphShare, piece_target
from .options import target_for_budget
from .runs_share import runs_share
from .step_graph import StepGraph, later_demand_bytes, with_check_error, with_eager
from .step_memory import recall_share
from .units import format_bytes

if TYPE_CHECKING:
    from torch import fx

    from .feedback_store import Correction

log = logging.getLogger("remat")

MAX_STEP_RUNS = 1024   # graph runs one step's account holds before it stops taking the step as a sequence


def step_totals(terms: Sequence[tuple[int, int, int, int]]) -> tuple[int, ...]:
    """What a step split at graph breaks holds at each graph's peak: for the graphs of its sequence
    (forward order), each bringing ``(held, inputs, grads, peak)`` bytes (``StepGraph``'s
    ``held_bytes``, ``input_activation_bytes``, ``param_grad_bytes`` and a peak), the k-th total is
    ``sum_{j<k} held_j + a_k + G_>k + p_k`` (``a_0`` taken as 0: the batch is resident). Pure; the
    step's predicted peak is the largest (``composed_peak_bytes``)."""
    return tuple(sum(t[0] for t in terms[:k]) + (term[1] if k else 0) + sum(t[2] for t in terms[k + 1:]) + term[3]
                 for k, term in enumerate(terms))


def composed_peak_bytes(terms: Sequence[tuple[int, int, int, int]]) -> int:
    """The predicted peak of a step whose graphs bring ``terms`` (``step_totals``); 0 for no graphs."""
    return max(step_totals(terms), default=0)


def _terms(graphs: Sequence[StepGraph], accepted: bool = False) -> list[tuple[int, int, int, int]]:
    """``step_totals``' terms of ``graphs``, each at its simulated peak, or with ``accepted`` the peak it stands on."""
    return [(g.held_bytes, g.input_activation_bytes, g.param_grad_bytes,
             g.accepted_peak_bytes if accepted else g.predicted_peak_bytes) for g in graphs]


def step_overruns(graphs: tuple[StepGraph, ...]) -> tuple[int, ...]:
    """The positions k in a step's sequence (forward order) whose graph breaks
    ``sum_{j<k} held_j + a_k + G_>k + p_k <= T_k`` (``step_totals``; ``p_k`` the peak its plan stands on,
    ``StepGraph.accepted_peak_bytes``: a plan Inductor's check read under its simulated peak is not re-planned for the
    simulated one). Pure: records in, positions out."""
    totals = step_totals(_terms(graphs, accepted=True))
    return tuple(k for k, total in enumerate(totals) if total > graphs[k].step_target_bytes)


def share_in_step(earlier: tuple[StepGraph, ...], later: tuple[StepGraph, ...], step_target_bytes: int,
                  input_activation_bytes: int, param_grad_bytes: int, need_bytes: int,
                  sequence_known: bool, own_floor_bytes: int = 0, smallest: bool = False, runs: int = 1,
                  outside_bytes: int = 0) -> GraphShare:
    """The share of the step for a graph planned after ``earlier`` (their backward pending) and
    before ``later`` (known once a step completed): ``piece_target``'s rule with kind "break".
    The first graph's inputs count 0 (see the module docstring). Kind "break-partial" when the
    sequence is not known yet (step 1: ``later`` is empty and nothing is reserved for later graphs).
    The reserve for later graphs is ``later_demand_bytes`` (at their smallest plans, capped at their
    plans saving everything) plus their part, by need, of what is left once this graph's floor
    ``own_floor_bytes`` (its smallest peak and inputs) is met. ``smallest`` (sequence unknown, a graph
    break follows): kind "break-smallest", the graph takes its smallest-peak plan (``fit_in_step``). ``runs``:
    the graph's consecutive runs in the known sequence (a block compiled once and run once per layer), which
    stack as ``runs_share``'s do (``earlier``/``later``: the graphs before its first run and after its last).
    ``outside_bytes``: held through the whole step outside the graphs (accumulated gradients)."""
    graphs = earlier + (None,) + later
    needs = tuple(need_bytes if g is None else g.need_bytes for g in graphs)
    grads_before, later_grads = sum(g.param_grad_bytes for g in earlier), sum(g.param_grad_bytes for g in later)
    return piece_target(
        step_target_bytes=step_target_bytes, index=len(earlier), needs=needs,
        held_before_bytes=sum(g.held_bytes for g in earlier),
        input_activation_bytes=input_activation_bytes if earlier else 0,
        total_grad_bytes=grads_before + param_grad_bytes + later_grads,
        grads_so_far_bytes=grads_before + param_grad_bytes,
        kind="break" if sequence_known else "break-smallest" if smallest else "break-partial",
        own_grad_bytes=param_grad_bytes, later_estimate_bytes=later_demand_bytes(later) if later else None,
        repeats=runs, later_run_bytes=param_grad_bytes if runs > 1 else 0,
        own_floor_bytes=own_floor_bytes, later_ceiling_bytes=later_demand_bytes(later, floor=False) if later else None,
        outside_bytes=outside_bytes,
    )


class StepAccount:
    """The graphs of one backend's steps: each plan's numbers (``note_plan``), which plan each
    graph runs, and, at run time, which graphs' backward is pending. Thread-safe (a CUDA backward
    hook runs on the autograd engine's device thread). Lives on the backend: one per backend,
    nothing per module."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._plans: dict[str, StepGraph] = {}      # by graph id
        self._running: dict[str, str] = {}          # slot -> graph id of the plan it runs now
        self._floors: dict[str, tuple[int, int]] = {}   # slot -> (smallest peak, what that plan holds)
        # slot -> the most a measured step's eager code held (during its run, after its forward; step_eager.py)
        self._eager: dict[str, tuple[int, int]] = {}
        self._prelude_bytes = 0      # the most of it that eager code made before the step's first graph (in every phase)
        self._pending: list[str] = []               # slots whose forward ran this step, backward not yet
        self._order: list[str] = []                 # forward order of this step so far
        self._spoiled = False                       # this step is not a sequence (a graph ran twice)
        self.interleaved_runs = 0                   # steps spoiled so: a graph entered again after another graph
        self.sequence: tuple[str, ...] = ()         # the slots of the last complete step, forward order

    def note_plan(self, graph: StepGraph) -> None:
        """A plan was made; its graph (``graph.slot``) runs it from now on (the last plan made for a
        graph is the one it runs: a plan Inductor's check rejects is followed by its re-plan)."""
        with self._lock:
            self._plans[graph.graph_id] = graph
            self._running[graph.slot] = graph.graph_id

    def note_checked(self, graph_id: str, checked_peak_bytes: int) -> None:
        """Inductor's check read plan ``graph_id``'s (noted) peak as ``checked_peak_bytes`` (``with_check_error``)."""
        with self._lock:
            graph = self._plans.get(graph_id)
            if graph is not None:
                self._plans[graph_id] = replace(graph, checked_peak_bytes=checked_peak_bytes)

    def running_graph_ids(self) -> tuple[str, ...]:
        """The ids of the plans the graphs of the last complete step (``sequence``) run now, in forward order, once
        each."""
        with self._lock:
            return tuple(self._running[s] for s in dict.fromkeys(self.sequence) if s in self._running)

    def plan_of(self, graph_id: str) -> Optional[StepGraph]:
        """The numbers noted for plan ``graph_id`` (``note_plan``), or None."""
        with self._lock:
            return self._plans.get(graph_id)

    def _graph(self, slot: str) -> Optional[StepGraph]:
        graph_id = self._running.get(slot)
        return None if graph_id is None else self._plans.get(graph_id)

    def share_for(self, slot: str, step_target_bytes: int, input_activation_bytes: int, param_grad_bytes: int,
                  need_bytes: int, follows: bool = False, graph_key: str = "", runs: int = 1,
                  accumulated_grad_bytes: int = 0, eager_step_bytes: int = 0,
                  eager_follows: bool = False) -> Optional[GraphShare]:
        """The share of the step for graph ``slot`` about to be planned, or None when it is alone in
        its step (nothing pending, no graph break after it and no known sequence with other graphs:
        the whole budget, as for one graph). In a known sequence: its earlier and later graphs'
        running plans; else the share a settled step of an earlier process gave the graph ``graph_key``
        after the graphs pending now (``step_memory.recall_share``), else those pending graphs, and when
        a graph break ``follows`` it, or (``eager_follows``) eager code reads its outputs and graphs are pending,
        kind "break-smallest" (its leanest plan: what later graphs or that code need is unknown). Alone in its step and measured running ``runs`` > 1 times before their backwards,
        or next to ``accumulated_grad_bytes`` of the step's gradients (a feedback correction says so): ``runs_share``.
        In a step of several graphs both the accumulated gradients and ``eager_step_bytes`` (what the measured step held
        outside the graphs' plans, ``step_loop.StepHooks``) are held outside the graphs (the share's ``outside_bytes``)."""
        with self._lock:
            floor = self._floors.get(slot)
            own_floor = 0 if floor is None else floor[0] + input_activation_bytes
            if slot in self.sequence and len(self.sequence) > 1:
                first, last = self.sequence.index(slot), len(self.sequence) - 1 - self.sequence[::-1].index(slot)
                earlier = tuple(g for s in self.sequence[:first] if (g := self._graph(s)) is not None)
                # the prelude is in every graph's eager bytes: held outside this graph's plan (its outside bytes,
                # through the whole step), it is not reserved again in the later graphs' (rand-brk-1522: 524 kB twice)
                prelude = min(self._prelude_bytes, eager_step_bytes)
                later = tuple(with_eager(with_check_error(g), *(max(b - prelude, 0) for b in self._eager.get(s, (0, 0))))
                              for s in self.sequence[last + 1:] if (g := self._graph(s)) is not None)
                known, group_runs = True, last - first + 1
            else:
                earlier = tuple(g for s in self._pending if s != slot and (g := self._graph(s)) is not None)
                later, known, group_runs = (), False, 1
        recalled = None if known or not graph_key else recall_share(earlier, graph_key, step_target_bytes,
                                                                     input_activation_bytes, param_grad_bytes)
        if recalled is not None:
            return recalled
        # eager code after it (a loss on its outputs, ``step_fit.eager_code_follows``) is as unknown in a step's first run
        # as the graphs after a break: next to pending graphs it takes the least room too (tests/test_hosted_windows.py's
        # head after a break took all the room left, and its eager cross-entropy put the first step 1.006x its budget)
        smallest = (follows or eager_follows and bool(earlier)) and not known
        if not earlier and not later and not smallest:
            return runs_share(step_target_bytes, input_activation_bytes, param_grad_bytes, need_bytes, runs,
                              accumulated_grad_bytes) if runs > 1 or accumulated_grad_bytes > 0 else None
        return share_in_step(earlier, later, step_target_bytes, input_activation_bytes, param_grad_bytes,
                             need_bytes, known, own_floor, smallest, group_runs, accumulated_grad_bytes + eager_step_bytes)

    def share_for_joint(self, slot: str, step_target_bytes: int, joint: "fx.GraphModule", need_bytes: int,
                        num_fwd_outputs: int, static_indices: Optional[Sequence[int]],
                        follows: bool = False, graph_key: str = "", made_for: Optional["Correction"] = None,
                        headroom_fraction: float = 0.0, eager_follows: bool = False) -> Optional[GraphShare]:
        """``share_for`` with the inputs and gradients read off the joint graph (``io_bytes``), and the runs,
        accumulated gradients and step's eager bytes the feedback correction ``made_for`` measured (none: one run,
        none). The gradients and eager bytes count at ``1 - headroom_fraction`` of their bytes, in the step target's
        units: measured exactly, they take no headroom, so a plan next to them gets ``target_for_budget(budget -
        gradients)`` (a floor named is the graph's at its headroom plus them)."""
        inputs, grads = self.io_bytes(slot, joint, num_fwd_outputs, static_indices)
        runs, accumulated, eager = (1, 0, 0) if made_for is None else (
            made_for.runs, target_for_budget(made_for.accumulated_grad_bytes, headroom_fraction),
            target_for_budget(made_for.eager_step_bytes, headroom_fraction))
        return self.share_for(slot, step_target_bytes, inputs, grads, need_bytes, follows, graph_key, runs, accumulated,
                              eager, eager_follows)

    def note_eager(self, slot: str, during_bytes: int, after_bytes: int, prelude_bytes: int = 0) -> None:
        """What a measured step's eager code held next to graph ``slot``, during its run and after its forward
        (``step_eager.eager_by_graph``, each with the ``prelude_bytes`` eager code made before the first graph), kept as
        the most measured so far (``eager_of``): the graph's re-plans are made next to it, and the earlier graphs' shares
        reserve it for that graph from now on, less the prelude where their own outside bytes count it already."""
        with self._lock:
            before = self._eager.get(slot, (0, 0))
            self._eager[slot] = (max(before[0], during_bytes), max(before[1], after_bytes))
            self._prelude_bytes = max(self._prelude_bytes, prelude_bytes)

    def eager_of(self, slot: str) -> tuple[int, int]:
        """``note_eager``'s most for graph ``slot`` (during its run, after its forward), (0, 0) if none."""
        with self._lock:
            return self._eager.get(slot, (0, 0))

    def io_bytes(self, slot: str, joint: "fx.GraphModule", num_fwd_outputs: int,
                 static_indices: Optional[Sequence[int]]) -> tuple[int, int]:
        """(activation input bytes, parameter-gradient bytes) of graph ``slot``: as its first plan read
        them off the graph Dynamo compiled (a re-plan compiles a copy outside Dynamo, where parameters
        are not marked as static inputs), else off ``joint`` (``graph_io_bytes``)."""
        with self._lock:
            first = self._plans.get(slot)
        if first is not None:
            return first.input_activation_bytes, first.param_grad_bytes
        return graph_io_bytes(joint, num_fwd_outputs, static_indices)

    def floor_of(self, slot: str) -> Optional[tuple[int, int]]:
        """(smallest simulated peak, what that plan holds) of graph ``slot``, once known."""
        with self._lock:
            return self._floors.get(slot)

    def set_floor(self, slot: str, peak_bytes: int, held_bytes: int) -> tuple[int, int]:
        with self._lock:
            self._floors[slot] = (peak_bytes, held_bytes)
            return self._floors[slot]

    def held_of(self, slot: str, joint: "fx.GraphModule", num_fwd_outputs: int,
                static_indices: Optional[Sequence[int]]) -> "Callable[[Any], int]":
        """What a plan of graph ``slot`` holds for its backward: its saved bytes and its activation
        inputs (``distributed_fit.held_bytes_of``'s rule, with the inputs of ``io_bytes``)."""
        inputs = self.io_bytes(slot, joint, num_fwd_outputs, static_indices)[0]
        return lambda plan: plan.saved_bytes + inputs

    def pending_graphs(self) -> tuple[tuple[str, StepGraph], ...]:
        """(slot, running plan) of each graph whose forward ran in this step and whose backward has not, in order."""
        with self._lock:
            return tuple((s, g) for s in self._pending if (g := self._graph(s)) is not None)

    def pending_runs(self) -> int:
        """How many graph runs of this step entered their forward and have not finished their backward."""
        with self._lock:
            return len(self._pending)

    def forward_entered(self, slot: str) -> None:
        """Graph ``slot`` enters its forward (before any re-plan it runs now)."""
        with self._lock:
            again = slot in self._pending
            if again and (self._order[-1:] != [slot] or len(self._order) >= MAX_STEP_RUNS):
                # again after another graph (or past any real stack of runs: a forward whose backward never
                # ran stays pending, and each step would add to it): not a sequence
                self.interleaved_runs += self._order[-1:] != [slot]
                self._pending, self._order, self._spoiled = [], [], True
            elif not self._pending:
                self._order, self._spoiled = [], False
            self._pending.append(slot)
            self._order.append(slot)

    def check_entry(self, slot: str) -> Optional[str]:
        """Why graph ``slot``'s running plan does not fit next to what the graphs pending now hold
        (their held bytes, its earlier runs' among them, its inputs, the later graphs' gradients when the
        sequence is known), or None when it fits or is not accounted (the sequence is not known yet: in the
        first step each graph was just planned next to these pending graphs). Call it after ``forward_entered``."""
        with self._lock:
            if slot not in self.sequence:
                return None
            position = len(self._order) - 1     # where this step is in the sequence, if it follows it
            if tuple(self._order) != self.sequence[:position + 1]:
                position = self.sequence.index(slot)
            graph = self._graph(slot)
            earlier = [g for s in self._pending[:-1] if (g := self._graph(s)) is not None]
            later = tuple(g for s in self.sequence[position + 1:] if (g := self._graph(s)))
        if graph is None or not earlier:
            return None
        held = sum(g.held_bytes for g in earlier)
        grads = sum(g.param_grad_bytes for g in later)
        total = held + graph.input_activation_bytes + grads + graph.accepted_peak_bytes
        if total <= graph.step_target_bytes:
            return None
        return (f"{graph.graph_id} peaks at {format_bytes(graph.accepted_peak_bytes)} next to "
                f"{format_bytes(held)} held by {len(earlier)} earlier graph(s) of the step, its inputs "
                f"{format_bytes(graph.input_activation_bytes)} and later graphs' gradients {format_bytes(grads)}: "
                f"{format_bytes(total)}, over the step target {format_bytes(graph.step_target_bytes)}")

    def at_step_start(self) -> bool:
        """Whether the graph that entered its forward last is the step's first (call after ``forward_entered``)."""
        with self._lock:
            return len(self._order) == 1

    def backward_done(self, slot: str) -> Optional[tuple[str, ...]]:
        """Graph ``slot``'s backward finished. Returns the step's graphs in forward order when this
        completes a step (nothing pending any more; a step in which a graph ran twice is none), else
        None; a step of several graphs becomes the known ``sequence``."""
        with self._lock:
            if slot in self._pending:
                self._pending.remove(slot)
            if self._pending or not self._order or self._spoiled:
                return None
            order, self._order = tuple(self._order), []
            if len(set(order)) < 2 <= len(order):   # one graph's runs: its own window measures them (window_runs.py)
                return None
            if len(set(order)) > 1:
                self.sequence = order
            return order

    def provisional(self, order: tuple[str, ...]) -> tuple[str, ...]:
        """The slots of ``order`` whose running plans were made before their step's graphs were known."""
        with self._lock:
            return tuple(s for s in order if (g := self._graph(s)) is not None and g.provisional)

    def step_peak_bytes(self, sequence: tuple[str, ...]) -> int:
        """The step's predicted peak from the running plans of ``sequence`` (``composed_peak_bytes``),
        the peak the condition bounds."""
        return composed_peak_bytes(self.step_terms(sequence))

    def step_terms(self, sequence: tuple[str, ...], peaks: Optional[dict[str, int]] = None) -> list[tuple[int, int, int, int]]:
        """(held, inputs, gradients, peak) bytes of the running plan of each graph of ``sequence`` (``step_totals``'
        terms; a graph with no plan is left out); with ``peaks`` (slot -> bytes, every slot of ``sequence``), those
        peaks in place of the plans' simulated ones (the Inductor-checked peaks they were accepted on)."""
        with self._lock:
            graphs = [(s, g) for s in sequence if (g := self._graph(s)) is not None]
        terms = _terms([g for _, g in graphs])
        if peaks is not None:
            terms = [(held, inputs, grads, peaks[s]) for (s, _), (held, inputs, grads, _) in zip(graphs, terms)]
        return terms

    def overruns(self, sequence: tuple[str, ...]) -> dict[str, str]:
        """The slots of ``sequence`` whose running plans break the step's condition
        (``step_overruns``), each with why."""
        with self._lock:
            graphs = tuple(self._graph(s) for s in sequence)
        if any(g is None for g in graphs):
            return {}
        known = tuple(g for g in graphs if g is not None)
        out = {}
        for k in step_overruns(known):
            g = known[k]
            held, grads = sum(h.held_bytes for h in known[:k]), sum(h.param_grad_bytes for h in known[k + 1:])
            out[g.slot] = (f"{g.graph_id} (graph {k + 1} of {len(known)} in the step) peaks at "
                           f"{format_bytes(g.accepted_peak_bytes)} next to {format_bytes(held)} held by earlier "
                           f"graphs and {format_bytes(grads)} of later graphs' gradients, over the step target "
                           f"{format_bytes(g.step_target_bytes)}")
        return out


def slot_of(graph_id: str) -> str:
    """The graph a plan id belongs to across its re-plans (``graph_001_r2`` -> ``graph_001``)."""
    return graph_id.split("_r")[0]


def graph_io_bytes(joint: "fx.GraphModule", num_fwd_outputs: int,
                   static_indices: Optional[Sequence[int]]) -> tuple[int, int]:
    """(activation input bytes, parameter-gradient bytes) of a joint graph (the DDP ledger's reads)."""
    from .distributed_fit import _param_grad_bytes, _primal_bytes

    sizes, activations = _primal_bytes(joint, static_indices)
    return sum(sizes[name] for name in activations), _param_grad_bytes(joint, num_fwd_outputs, static_indices)
