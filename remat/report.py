"""What a person reads: the plan as JSON and as a markdown report."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from .cost_model.hardware import HardwareProfile
from .passes.plan import Plan
from .passes.rewrite import RegionSummary, describe_region
from .units import format_bytes, format_seconds


def plan_to_json(plan: Plan, graph_id: str, regions: tuple[RegionSummary, ...], profile: HardwareProfile) -> dict[str, Any]:
    """The plan.json payload: every field of the plan, regions, and the hardware profile used."""
    payload = asdict(plan)
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


def render_report(plan: Plan, graph_id: str, regions: tuple[RegionSummary, ...], profile: HardwareProfile) -> str:
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
        "(the budget less the headroom kept for Inductor's kernel fusion and reordering)",
        f"- fits the budget: {'yes' if plan.fits_budget else 'NO (best effort)'}",
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
