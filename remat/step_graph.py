"""A graph of a step split at graph breaks as the step's account records it (``StepGraph``: what one plan brings to
the step), and what an earlier graph's share reserves for the later graphs (``later_demand_bytes``, with each later
graph's check error and eager memory: ``with_check_error``, ``with_eager``). The account and the shares are
``remat/step_budget.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from .distributed import GraphShare


@dataclass(frozen=True)
class StepGraph:
    """What one plan of a graph brings to the step (bytes), recorded when it is planned."""

    graph_id: str                  # this plan's id (graph_001_r1 after a re-plan)
    slot: str                      # the graph across its re-plans: its first plan's id
    held_bytes: int                # kept by its forward for its backward (distributed_fit.held_bytes_of)
    input_activation_bytes: int    # its activation inputs (not parameters)
    param_grad_bytes: int          # its parameters' gradients, produced by its backward
    need_bytes: int                # its peak without recomputation: the proxy for what it needs
    predicted_peak_bytes: int      # its plan's simulated peak (own gradients included)
    step_target_bytes: int         # T: the budget less headroom (and any feedback correction), less what the step
                                   # holds outside the graphs (accumulated gradients)
    floor_peak_bytes: int = 0      # the graph's smallest simulated peak (any plan)
    floor_held_bytes: int = 0      # what its smallest-peak plan holds for its backward
    no_remat_peak_bytes: int = 0   # its simulated peak saving everything
    provisional: bool = False      # planned before its step's graphs were known: re-planned when a step completes
    graph_key: str = ""            # the graph's store key (feedback_store.graph_key): the same graph in another process
    asked_share: Optional[GraphShare] = None   # the share the plan was asked to fit (None: planned alone in its step)
    checked_peak_bytes: Optional[int] = None   # its plan's peak as Inductor's check read it (``note_checked``)

    @property
    def accepted_peak_bytes(self) -> int:
        """The peak its plan stands on: as Inductor's check read it where it did, else as simulated."""
        return self.predicted_peak_bytes if self.checked_peak_bytes is None else self.checked_peak_bytes


def later_demand_bytes(later: tuple[StepGraph, ...], floor: bool = True) -> int:
    """What the later graphs of a step need next to what a graph holds (``piece_target``'s
    ``later_estimate_bytes``, here from their own plans, not scaled from this graph's): the largest,
    over later graph m, of what the graphs between hold, its inputs and its peak less its own
    gradients (``GraphShare.admits`` charges every later gradient already). ``floor``: at their
    smallest-peak plans (the estimate); else saving everything (the ceiling, holding their peak)."""
    demand = 0
    for m, graph in enumerate(later):
        between = sum((g.floor_held_bytes if floor else g.no_remat_peak_bytes) for g in later[:m])
        peak = graph.floor_peak_bytes if floor else max(graph.no_remat_peak_bytes, graph.floor_peak_bytes)
        demand = max(demand, between + graph.input_activation_bytes + max(peak - graph.param_grad_bytes, 0))
    return demand


def with_check_error(graph: StepGraph) -> StepGraph:
    """A later graph's smallest and no-recomputation peaks, as earlier graphs reserve them (``later_demand_bytes``),
    times the simulator's error Inductor's check found on its running plan (checked / simulated, where over 1): its
    plans are judged on the check (rand-brk-1536: a smallest plan simulated 4.47 MB, checked 5.39 MB; the first
    graph, reserving 4.47 MB, kept 131 kB more, and the budget a refusal had named was refused again)."""
    checked, simulated = graph.checked_peak_bytes, graph.predicted_peak_bytes
    if checked is None or simulated <= 0 or checked <= simulated:
        return graph
    return replace(graph, floor_peak_bytes=-(-graph.floor_peak_bytes * checked // simulated),
                   no_remat_peak_bytes=-(-graph.no_remat_peak_bytes * checked // simulated))


def with_eager(graph: StepGraph, during_bytes: int, after_bytes: int) -> StepGraph:
    """A later graph's numbers as an earlier graph's share reserves for it (``later_demand_bytes``), next to what eager
    code was measured to hold during its run and after its forward (its re-plans are made next to both:
    ``step_eager.eager_by_graph``), so the earlier graphs do not take the room it needs. The two are held at different
    times: during its run, next to its peak; after its forward, next to what it holds for its backward. So its smallest
    peak becomes the larger of (smallest peak + during) and (what that plan holds + after), and its no-recomputation
    peak (every value held) is raised by the larger of the two (before session 45 both were added to both)."""
    if not during_bytes and not after_bytes:
        return graph
    return replace(graph, floor_peak_bytes=max(graph.floor_peak_bytes + during_bytes, graph.floor_held_bytes + after_bytes),
                   no_remat_peak_bytes=graph.no_remat_peak_bytes + max(during_bytes, after_bytes))
