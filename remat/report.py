"""What a person reads: the plan as JSON and as a markdown report."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Optional, Sequence

import sympy
import torch
from torch import fx

from .cost_model.hardware import HardwareProfile
from .cost_model.symbolic import evaluate as evaluate_expr
from .cost_model.symbolic import format_expr, shape_hints, symbol_sources, to_sympy
from .dynamic import size_environment
from .feedback_store import Correction
from .passes.joint_graph import LOSS_OUTPUT_COPIES, JointGraphFacts
from .simulator import evaluate
from .simulator.kernel_facts import CHANNELS_LAST_SUFFIX, COPY_SUFFIX, RECOMPUTE_SUFFIX
from .passes.plan import Plan
from .passes.rewrite import RegionSummary, describe_region
from .units import format_bytes, format_seconds


def plan_to_json(plan: Plan, graph_id: str, regions: tuple[RegionSummary, ...], profile: HardwareProfile,
                 correction: Optional[Correction] = None) -> dict[str, Any]:
    """The plan.json payload: every field of the plan, regions, the hardware profile used, and
    ``feedback``: the feedback loop's correction the target was made with (null: none)."""
    payload = asdict(plan)
    payload["feedback"] = None if correction is None else asdict(correction)
    payload["graph_id"] = graph_id
    payload["nodes"] = payload.pop("decisions")
    payload["forced"] = [{"name": n, "reason": r} for n, r in plan.forced]
    payload["regions"] = [asdict(r) for r in regions]
    payload["hardware"] = {"name": profile.name, "source": profile.source}
    payload["units"] = "bytes, FLOPs, seconds; 1 GB = 1e9 bytes"
    return payload


def summary_line(plan: Plan) -> str:
    budget = "none" if plan.budget_bytes is None else format_bytes(plan.budget_bytes)
    recomputed = sum(1 for d in plan.decisions if d.decision == "recompute")
    return (
        f"budget {budget} | predicted peak {format_bytes(plan.predicted_peak_bytes)} "
        f"(no remat {format_bytes(plan.no_remat_peak_bytes)}) | saved {format_bytes(plan.saved_bytes)} "
        f"in {len(plan.saved)} values | recomputed {recomputed} ops, {plan.recompute_flops:,} FLOPs | "
        f"est. extra time {format_seconds(plan.est_extra_time_s)} | planned in {format_seconds(plan.plan_time_s)}"
    )


def correction_line(correction: Optional[Correction]) -> str:
    """The report's sentence on the feedback loop's correction of the planning target."""
    if correction is None:
        return "- feedback correction: none (the target is the budget less headroom)"
    if correction.foreseen:
        return (f"- feedback correction: target divided by {correction.factor:.3f}, made before any step measured "
                f"`{correction.graph_id}` (its plan predicted {format_bytes(correction.predicted_peak_bytes)}; "
                f"{correction.source})")
    return (f"- feedback correction: target divided by {correction.factor:.3f}, the measured / predicted peak of "
            f"`{correction.graph_id}` ({format_bytes(correction.measured_peak_bytes)} measured, "
            f"{format_bytes(correction.predicted_peak_bytes)} predicted; {correction.source})")


def eager_loss_line(eager_loss_bytes: int, correction: Optional[Correction]) -> str:
    """The report's sentence on what the plan reserves for a loss computed outside the graph (``eager_loss.py``)."""
    if not eager_loss_bytes:
        return "- eager loss outside the graph: nothing reserved (the graph returns its loss, or shares its step)"
    if correction is not None and correction.eager_loss_bytes == eager_loss_bytes:
        return (f"- eager loss outside the graph: {format_bytes(eager_loss_bytes)} between the forward and the "
                f"backward, as measured ({correction.source})")
    return (f"- eager loss outside the graph: {format_bytes(eager_loss_bytes)} reserved between the forward and the "
            f"backward ({LOSS_OUTPUT_COPIES} times the outputs' bytes, a cross-entropy's, until a step measures it)")


def render_report(plan: Plan, graph_id: str, regions: tuple[RegionSummary, ...], profile: HardwareProfile,
                  correction: Optional[Correction] = None, eager_loss_bytes: int = 0) -> str:
    lines = [
        f"# remat report: {graph_id}",
        "",
        summary_line(plan),
        "",
        "Units: 1 GB = 1e9 bytes. The peak is memory allocated during the compiled forward + backward "
        "above what was resident at step start, as simulated on the rewritten graphs. "
        f"Times are estimates on the `{profile.name}` profile ({profile.source}).",
        "",
        f"- predicted peak: {format_bytes(plan.predicted_peak_bytes)}, reached at `{plan.peak_step_name}`",
        f"- peak if every value the backward needs were saved (no remat): {format_bytes(plan.no_remat_peak_bytes)}",
        f"- peak of the free min-cut plan: {format_bytes(plan.mincut_peak_bytes)}",
        f"- planning target: {'none' if plan.target_bytes is None else format_bytes(plan.target_bytes)} "
        + ("" if plan.target_bytes is None or not plan.budget_bytes else
           "(the budget less headroom, divided by the feedback correction below)" if correction is not None else
           f"(the budget less {1 - plan.target_bytes / plan.budget_bytes:.0%} headroom, kept for what the memory "
           "simulator may miss in Inductor's code: `headroom_fraction`, by default 5% on CPU and 15% elsewhere)"),
        correction_line(correction),
        eager_loss_line(eager_loss_bytes, correction),
        f"- fits the budget: {'yes' if plan.fits_budget else 'NO (best effort)'}",
        f"- solver: {plan.solver}",
        "",
    ]
    if plan.forced:
        lines += ["## Saved because they may not be recomputed", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in plan.forced]
        lines.append("")
    lines += ["## Recompute regions (placed right before their first backward use)", ""]
    lines += [f"- {describe_region(r)}" for r in regions] or ["- none"]
    lines += ["", "## Decisions", "", "| node | op | decision | bytes | FLOPs | reason |", "|---|---|---|---:|---:|---|"]
    for d in plan.decisions:
        if d.decision == "none":
            continue
        lines.append(f"| `{d.name}` | `{d.op}` | {d.decision} | {format_bytes(d.bytes)} | {d.flops:,} | {d.reason} |")
    hidden = sum(1 for d in plan.decisions if d.decision == "none")
    lines += ["", f"{hidden} forward nodes the backward does not need are omitted (decision `none` in plan.json)."]
    return "\n".join(lines) + "\n"


def dumps_plan(payload: dict[str, Any]) -> str:
    return json.dumps(payload, indent=1, sort_keys=False)


def _storage_expr(sid: str, graphs: Sequence[fx.Graph]) -> Optional[sympy.Expr]:
    """Bytes of one storage as a formula, from the node of that name: ``name`` or ``name#i`` (the
    i-th output), a recomputed instance of either (``...@r0``: the same size), or a channels-last or
    reshape copy of a value (``#cl``, ``#copy``: the same size)."""
    name, _, index = sid.split(RECOMPUTE_SUFFIX)[0].partition("#")
    if index in (CHANNELS_LAST_SUFFIX[1:], COPY_SUFFIX[1:]):
        index = ""
    for graph in graphs:
        node = _node_named(graph, name)
        if node is None:
            continue
        value = node.meta.get("val")
        if index:
            value = value[int(index)] if isinstance(value, (list, tuple)) and int(index) < len(value) else None
        if isinstance(value, torch.Tensor):
            return sympy.expand(to_sympy(value.numel()) * value.element_size())
    return None


def _node_named(graph: fx.Graph, name: str) -> Optional[fx.Node]:
    return next((n for n in graph.nodes if n.name == name), None)


def _formula(sids_and_bytes: Sequence[tuple[str, int]], graphs: Sequence[fx.Graph]) -> tuple[sympy.Expr, int]:
    """The summed bytes of these storages as a formula; storages with no node found count at their hinted size."""
    total, missing = sympy.Integer(0), 0
    for sid, nbytes in sids_and_bytes:
        expr = _storage_expr(sid, graphs)
        if expr is None:
            expr, missing = sympy.Integer(nbytes), missing + 1
        total += expr
    return sympy.expand(total), missing


def render_symbolic_sizes(plan: Plan, facts: JointGraphFacts, graphs: Sequence[fx.Graph]) -> str:
    """A report section with the saved bytes and the peak as formulas in the shape symbols.

    Empty when the graphs have no symbolic sizes. Each formula is shown with its value at the
    sizes the plan was made at (the traced sizes, or a symbol's upper bound: ``remat.dynamic``),
    which equals the plan's number (the section says so if not).
    """
    traced: dict[sympy.Symbol, int] = {}
    sources: dict[str, str] = {}
    for graph in graphs:
        traced.update(shape_hints(graph))
        sources.update(symbol_sources(graph))
    if not traced:
        return ""
    planned = size_environment(graphs).values   # the sizes the plan was made at (remat/dynamic.py)
    hints = {sym: planned.get(str(sym), value) for sym, value in traced.items()}
    at = "at the traced sizes" if hints == traced else "at the planned sizes"
    lines = ["", "## Sizes as formulas (dynamic shapes)", ""]
    lines += [f"- `{sym}` = `{sources.get(str(sym), '?')}`, traced at {value}"
              + (f", planned at {hints[sym]} (its upper bound)" if hints[sym] != value else "")
              for sym, value in sorted(traced.items(), key=str)]
    lines.append("")
    saved = [(sid, bytes_) for name in plan.saved for sid, bytes_ in _saved_storages(facts, name)]
    rows = [("saved activations", saved, plan.saved_bytes)]
    simulated = evaluate(facts, frozenset(plan.saved)).simulation
    if simulated.peak_bytes == plan.predicted_peak_bytes:
        rows.append((f"predicted peak (at `{simulated.peak_step_name}`)", list(simulated.live_at_peak),
                     plan.predicted_peak_bytes))
    for label, sids, expected in rows:
        expr, missing = _formula(sids, graphs)
        at_hint = evaluate_expr(expr, hints)
        note = "" if at_hint == expected else f" (the plan counts {format_bytes(expected)})"
        if missing:
            note += f" ({missing} storages without a formula counted at their traced size)"
        lines.append(f"- {label} = {format_expr(expr, 'bytes')} = {format_bytes(at_hint)} {at}{note}")
    return "\n".join(lines) + "\n"


def _saved_storages(facts: JointGraphFacts, name: str) -> list[tuple[str, int]]:
    """The storages saving ``name`` keeps alive, as ``mincut.saved_cost_bytes`` counts them."""
    out = []
    for sid in facts.nodes[name].value_storages:
        owner = facts.nodes.get(sid.split("#")[0])
        if owner is not None and owner.role != "primal":
            out.append((sid, dict(owner.allocs).get(sid, 0)))
    return out
