"""The paragraph report.md gives a graph's share of its step (``GraphShare.explain``): how the budget was split
between the step's graphs (DDP pieces, FSDP2 units, graphs at breaks, stacked runs, accumulated gradients) and
why the step fits."""

from __future__ import annotations

from typing import Any

from .units import format_bytes

GraphShare = Any    # a remat.distributed.GraphShare (not imported: distributed.py imports this module)


def explain_share(share: GraphShare) -> str:
    """One paragraph for report.md: how the budget was split and why the step fits."""
    if share.kind in ("runs", "accumulated"):     # distributed.SINGLE_GRAPH_SHARE_KINDS (not importable here)
        return _explain_runs(share)
    if share.kind.startswith("break"):
        return _explain_break(share)
    where = (f"DDP piece {share.index + 1} of {share.count}" if share.kind == "ddp"
             else f"FSDP2 unit graph, run {share.repeats} times per step")
    return (
        f"{where}. Per-rank step target {format_bytes(share.step_target_bytes)} (budget less headroom); "
        f"held for their backward by earlier pieces {format_bytes(share.held_before_bytes)}; "
        f"activation inputs {format_bytes(share.input_activation_bytes)}; gradients of later pieces "
        f"{format_bytes(share.later_grad_bytes)}; outside the graphs (FSDP2 parameters and gradients) "
        f"{format_bytes(share.outside_bytes)}; reserved for later pieces {format_bytes(share.reserved_later_bytes)} "
        f"(own share {format_bytes(share.own_share_bytes)}). Target for this graph's simulated peak: "
        f"{format_bytes(share.target_bytes)}"
        + (f" (its {share.repeats} runs stack: each earlier run keeps what it holds for its backward, each later "
           f"run its sharded gradients {format_bytes(share.later_run_bytes)} and up to {share.rs_buffers} "
           f"reduce-scatter buffer(s) of {format_bytes(share.rs_buffer_bytes)})" if share.repeats > 1 else "")
        + ". The step fits if every piece meets its target: each piece's peak plus what the earlier "
        "pieces hold, the later pieces' gradients and the memory outside the graphs stays under the step target."
        + ("" if share.reserve_met else
           " No plan fit next to the room reserved for the later pieces (an estimate of their need): the plan "
           "near the smallest peak that holds least for its backward was taken, leaving them the rest.")
    )


def _explain_runs(share: GraphShare) -> str:
    """``explain_share`` for a graph alone in its step, run several times or next to accumulated gradients."""
    accumulated = (f"the gradients earlier backwards of the step left in its parameters (gradient accumulation, "
                   f"measured by the feedback loop), {format_bytes(share.outside_bytes)}, are held through it")
    if share.kind == "accumulated":
        return (f"One graph run once per forward and backward, {accumulated}. Step target "
                f"{format_bytes(share.step_target_bytes)}; target for this graph's simulated peak: "
                f"{format_bytes(share.target_bytes)}. The step fits if the graph's peak plus those gradients stays "
                "under the step target.")
    return (f"One graph run {share.repeats} times per step before their backwards (measured: the feedback "
            f"loop's window held that many runs). Step target {format_bytes(share.step_target_bytes)}; each "
            f"earlier run keeps what it holds for its backward while the next runs, each later run (its "
            f"backward ran first) its parameters' gradients {format_bytes(share.later_run_bytes)}; activation "
            f"inputs {format_bytes(share.input_activation_bytes)} per run"
            + (f"; {accumulated}" if share.outside_bytes else "")
            + f". Target for this graph's simulated peak: {format_bytes(share.target_bytes)}. The step fits if every "
            "run's peak plus what the earlier runs hold and the later runs' gradients stays under the step target.")


def _explain_break(share: GraphShare) -> str:
    """``explain_share`` for a graph of a step split at graph breaks (``remat/step_budget.py``)."""
    known = share.kind == "break"
    where = (f"Graph {share.index + 1} of {share.count} of the step (graph breaks; the sequence as the last "
             "complete step ran it)" if known else
             f"Graph {share.index + 1} of the step so far (graph breaks; the first step: later graphs are not "
             "known yet, so nothing is reserved for them and their gradients are not counted)")
    return (
        f"{where}. Step target {format_bytes(share.step_target_bytes)} (budget less headroom); held for "
        f"their backward by the {share.index} earlier graph(s) whose backward is pending "
        f"{format_bytes(share.held_before_bytes)}; activation inputs {format_bytes(share.input_activation_bytes)}; "
        f"gradients the later graphs' backwards produce before this one's {format_bytes(share.later_grad_bytes)}; "
        f"reserved for the later graphs {format_bytes(share.reserved_later_bytes)}"
        + (f"; held outside the graphs through its run, as the feedback loop measured (gradients earlier backwards "
           f"of the step left in the parameters: gradient accumulation; eager code between or around the graphs) "
           f"{format_bytes(share.outside_bytes)}" if share.outside_bytes else "")
        + (f" (an estimate of their smallest demand, {format_bytes(share.later_estimate_bytes)}, plus their "
           "part of what is left by need)" if share.later_estimate_bytes is not None else "")
        + f". Target for this graph's simulated peak: {format_bytes(share.target_bytes)}. The step fits if every "
        "graph's peak plus what the earlier graphs hold, its inputs and the later graphs' gradients stays under "
        "the step target" + (" less what is held outside the graphs." if share.outside_bytes else ".")
        + ("" if share.reserve_met else
           " A graph break, or eager code reading its outputs (a loss), follows this graph, and what follows is not known yet: of the plans near the smallest "
           "peak, the one under which the step admits the most later graphs like this one (each holding what it "
           "holds and producing its gradients), then the least held + peak, was taken (its target is above); "
           "when the step completes it is re-planned with the whole sequence known."
           if share.kind == "break-smallest" else
           " No plan fit next to what the earlier graphs hold (they were planned before the step's graphs were "
           "known): the smallest-peak plan was taken and this first step runs over; at its end the graphs whose "
           "plans break the step target are re-planned with the whole sequence known."
           if not known else
           " No plan fit next to the room reserved for the later graphs: the plan near the smallest peak that "
           "holds least for its backward was taken, leaving them the rest.")
    )


__all__ = ["explain_share"]
