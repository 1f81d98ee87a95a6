"""The tables of ``benchmarks/fidelity.py``: per-model points, floors, and the distribution.

``write_report(jsonl, md, meta)`` reads the JSON lines the benchmark wrote and writes the markdown.
Definitions used in the tables:

- error = (predicted - measured) / measured, for the plans as finally compiled against step 3's
  measured peak (negative: the simulator under-predicted);
- over budget = step 3's measured peak above the budget (step 1's is counted separately: with the
  closed loop it is the step that may discover an overshoot);
- a gradient mismatch = the largest per-parameter relative error against plain Inductor > 1e-4;
- in bf16 (``--autocast bf16`` or ``--model-dtype bf16``), where compiled variants differ from one another at
  bf16's rounding, accuracy = a point's gradient error against plain Inductor in float32 without autocast (the
  fp32 reference, over all parameters at once where the row has it, else the largest per parameter) divided by
  plain Inductor's own in bf16; a point is less accurate than plain Inductor when that ratio exceeds
  ``ACCURACY_RATIO_TOL``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Optional

GRAD_TOL = 1e-4
ACCURACY_RATIO_TOL = 2.0
# floor-named: the budget a refused floor named; floor-named-<n>: the n-th retry's, at what the one before named
# (fidelity.py --floor-retries)
RETRY_POINTS = ("floor-named",) + tuple(f"floor-named-{n}" for n in range(2, 6))
BUDGET_POINTS = ("0.9", "0.7", "0.5", "floor") + RETRY_POINTS
FRACTION_POINTS = ("0.9", "0.7", "0.5")


def _mb(value: Optional[float]) -> str:
    return "" if value is None else f"{value / 1e6:.3f}"


def _sci(value: Optional[float]) -> str:
    return "" if value is None else f"{value:.1e}"


def _pct(value: Optional[float]) -> str:
    return "" if value is None or value != value else f"{100 * value:+.1f}%"


def load(jsonl: Path) -> tuple[dict[str, Any], dict[str, dict[str, dict[str, Any]]]]:
    """The first run's header row and, per model, its rows by point (the last row of a point wins).

    A resumed run appends its own header; the first header gains ``runs``: every header in order, each
    with ``models``, the models whose ``done`` line came after it (those it ran)."""
    headers: list[dict[str, Any]] = []
    models: dict[str, dict[str, dict[str, Any]]] = {}
    for line in jsonl.read_text().splitlines():
        row = json.loads(line)
        if row["model"] == "_run":
            headers.append({**row, "models": []})
            continue
        models.setdefault(row["model"], {})[row["point"]] = row
        if row["point"] == "done" and headers:
            headers[-1]["models"].append(row["model"])
    header = dict(headers[0]) if headers else {}
    header["runs"] = headers
    return header, models


def _seed_ranges(seeds: list[int]) -> str:
    """``[1000, 1001, 1002, 1005]`` -> ``"1000-1002, 1005"``."""
    parts: list[str] = []
    for seed in sorted(seeds):
        if parts and parts[-1].split("-")[-1] == str(seed - 1):
            parts[-1] = f"{parts[-1].split('-')[0]}-{seed}"
        else:
            parts.append(str(seed))
    return ", ".join(parts) or "none"


def final_plans(row: dict[str, Any]) -> dict[str, Any]:
    """The row's ``plans_final`` with its step peaks recomputed over the last record of each graph
    (``graph_000_r1`` re-plans ``graph_000``): rows written before fidelity.py keyed re-plans by their
    base id counted a graph and its re-plan as two graphs."""
    from fidelity import base_graph_id, predicted_step_peak

    plans = dict(row.get("plans_final") or {})
    ids = plans.get("graphs") or []
    if not ids:
        return plans
    last = {base_graph_id(g): i for i, g in enumerate(ids)}
    keep = sorted(last.values())
    simulated = plans["graph_predicted_peak_bytes"]
    checked = plans.get("graph_checked_peak_bytes") or [None] * len(ids)
    zeros = [0] * len(ids)      # rows written before the records carried inputs and gradients
    saved = [plans["graph_saved_bytes"][i] for i in keep]
    inputs = [(plans.get("graph_input_activation_bytes") or zeros)[i] for i in keep]
    grads = [(plans.get("graph_param_grad_bytes") or zeros)[i] for i in keep]
    accepted = [checked[i] if checked[i] is not None else simulated[i] for i in keep]
    plans["predicted_peak_bytes"] = predicted_step_peak([simulated[i] for i in keep], saved, inputs, grads)
    plans["accepted_peak_bytes"] = plans["graphs_accepted_peak_bytes"] = predicted_step_peak(accepted, saved, inputs, grads)
    if plans.get("step_predicted_bytes") is not None:
        # a step of several graphs: remat's own prediction, next to the eager memory its steps measured, is the
        # number it accepted the step on (rows written before session 46 have none: the graphs alone)
        plans["accepted_peak_bytes"] = plans["step_predicted_bytes"]
    plans["peak_step"] = [plans["peak_step"][i] for i in keep] if plans.get("peak_step") else []
    plans["judgement"] = [(plans.get("judgement") or [None] * len(ids))[i] for i in keep]
    return plans


def error_of(row: dict[str, Any], key: str = "accepted_peak_bytes") -> Optional[float]:
    """(predicted - measured) / measured for step 3; ``key``: the plans' accepted peak (Inductor-checked
    where remat checked it) or ``predicted_peak_bytes`` (the simulator's)."""
    plans = final_plans(row)
    predicted, measured = plans.get(key, plans.get("predicted_peak_bytes")), row.get("measured_later_bytes")
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _point_rows(models: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    lines = ["| model | point | budget MB | simulated MB | accepted MB | step 1 MB | step 3 MB | step 3 / budget | error (accepted) "
             "| error (simulated) | grad err | grad err vs fp32 | loop | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for name, points in models.items():
        for base in ("plain-fp32", "plain"):
            plain = points.get(base)
            if plain is None:
                continue
            lines.append(f"| {name} | {base} | | | | {_mb(plain.get('measured_first_bytes'))} "
                         f"| {_mb(plain.get('measured_later_bytes'))} | | | | | {_sci(plain.get('grad_rel_err_fp32'))} | "
                         f"| {(plain.get('error') or '')[:80]} |")
        for point in ("none",) + BUDGET_POINTS:
            row = points.get(point)
            if row is None:
                continue
            budget, later = row.get("budget_bytes"), row.get("measured_later_bytes")
            ratio = f"{later / budget:.3f}" if budget and later else ""
            grad = row.get("grad_rel_err")
            note = (row.get("error") or "")[:90].replace("|", "/").replace("\n", " ")
            plans = final_plans(row)
            lines.append(f"| {name} | {point} | {_mb(budget)} | {_mb(plans.get('predicted_peak_bytes'))} "
                         f"| {_mb(plans.get('accepted_peak_bytes'))} | {_mb(row.get('measured_first_bytes'))} | {_mb(later)} | {ratio} "
                         f"| {_pct(error_of(row))} | {_pct(error_of(row, 'predicted_peak_bytes'))} "
                         f"| {_sci(grad)} | {_sci(row.get('grad_rel_err_fp32'))} | {row.get('loop_events', '')} | {note} |")
    return lines


LOOSE_FLOOR_FRACTION = 0.05   # a floor whose own point measures more than this under it is counted as loose


def _accepted_floor(points: dict[str, dict[str, Any]]) -> tuple[Optional[int], Optional[int], str]:
    """(the floor, its point's step-3 peak, a note): the smallest budget remat accepted among the probe's (``floor``),
    the one its refusal named (``floor-named``) and the fractions of plain Inductor's peak. A step at graph breaks can
    refuse the budget its own refusal named (its first step knows only the graphs compiled so far): where both floor
    points were refused, a fraction's accepted budget is the floor found (the note says so), and where none was
    accepted, (None, None, the last budget named)."""
    named = (points.get("probe") or {}).get("floor_bytes")
    accepted = [(row["budget_bytes"], row.get("measured_later_bytes"), point) for point, row in points.items()
                if point in ("floor",) + RETRY_POINTS + FRACTION_POINTS and row.get("budget_bytes") and not row.get("error")]
    tried = [p for p in ("floor",) + RETRY_POINTS if p in points]
    if not accepted:
        last = (points.get(tried[-1]) or {}) if tried else {}
        return None, None, (f"none accepted: the retry at {_mb(last.get('budget_bytes'))} named "
                            f"{_mb(last.get('min_budget_bytes'))}" if last.get("min_budget_bytes") else "")
    budget, at_floor, point = min(accepted, key=lambda a: a[0])
    retries = {p: f" (retry {k}; probe {_mb(named)})" if k > 1 else f" (retry; probe {_mb(named)})"
               for k, p in enumerate(RETRY_POINTS, 1)}
    refused = [p for p in tried if points[p].get("error")]
    chain_end = next((points[p] for p in tried if p not in refused and points[p].get("budget_bytes")), None)
    retried = len(refused) - 1
    refusals = (f"the probe's {_mb(named)} was not run" if not tried else
                f"the probe's {_mb(named)} was refused" if retried < 1 else
                f"the probe's {_mb(named)} and its {'retry' if retried == 1 else f'{retried} retries'} were refused")
    note = {"floor": "", **retries}.get(
        point, f" (the {point} point; {refusals}"
               + ("" if chain_end is None else f", the next retry accepted at {_mb(chain_end['budget_bytes'])}") + ")")
    return budget, at_floor, note


def floor_retries(points: dict[str, dict[str, Any]]) -> Optional[int]:
    """How many budgets named by refusals a model's floor chain tried before one was accepted: 0 for the probe's
    own (``floor``), 1 for ``floor-named``, n for ``floor-named-<n>``; None where none was (or the chain was not
    run)."""
    for k, point in enumerate(("floor",) + RETRY_POINTS):
        row = points.get(point)
        if row is None:
            return None
        if row.get("budget_bytes") and not row.get("error"):
            return k
    return None


def chain_overshoots(models: dict[str, dict[str, dict[str, Any]]]) -> dict[str, float]:
    """Per model whose floor chain ended accepted: the budget it was accepted at over the smallest budget accepted at
    all (a fraction's), where that is larger: the last refusal of the chain named more than the step needs."""
    out = {}
    for model, points in models.items():
        k = floor_retries(points)
        if k is None:
            continue
        chain_budget = points[(("floor",) + RETRY_POINTS)[k]]["budget_bytes"]
        smallest = _accepted_floor(points)[0]
        if smallest is not None and chain_budget > smallest:
            out[model] = chain_budget / smallest
    return out


def _overshoot_line(overshoots: dict[str, float], chains: int) -> str:
    """``chain_overshoots`` in words."""
    return (f"- floor chains accepted above a smaller budget accepted at a fraction (a refusal named more than the step "
            f"needs): {len(overshoots)} of {chains}" + "".join(f"; {m} {r:.2f}x" for m, r in sorted(
                overshoots.items(), key=lambda mr: -mr[1])))


def _chains_line(chains: dict[str, Optional[int]]) -> str:
    """The floor chains (``floor_retries``) in words: how many models were accepted after how many retries."""
    counts: dict[Optional[int], list[str]] = {}
    for model, retries in chains.items():
        counts.setdefault(retries, []).append(model)
    parts = [f"after {k} retr{'y' if k == 1 else 'ies'}: {len(ms)}" for k, ms in sorted(
        (k, ms) for k, ms in counts.items() if k is not None)]
    if None in counts:
        parts.append(f"none accepted in the retries run: {len(counts[None])} ({', '.join(counts[None])})")
    return "- floor chains (each retry at the budget the last refusal named, as a user retrying would): " + "; ".join(parts)


def _floor_rows(models: dict[str, dict[str, dict[str, Any]]]) -> tuple[list[str], dict[str, int]]:
    lines = ["| model | plain MB | floor MB | floor / plain | checkpoint MB | floor / checkpoint | floor point: step 3 MB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    counts = {"models": 0, "floor_above_plain": 0, "with_checkpoint": 0, "floor_above_checkpoint": 0,
              "measured_at_floor": 0, "loose_floors": 0}
    for name, points in models.items():
        plain = (points.get("plain") or {}).get("measured_later_bytes")
        floor, at_floor, note = _accepted_floor(points)
        ckpt = (points.get("checkpoint") or {}).get("measured_later_bytes")
        if plain and not floor and note:
            lines.append(f"| {name} | {_mb(plain)} | ({note}) | | {_mb(ckpt)} | | |")
        if not plain or not floor:
            continue
        counts["models"] += 1
        counts["floor_above_plain"] += floor > plain
        if ckpt:
            counts["with_checkpoint"] += 1
            counts["floor_above_checkpoint"] += floor > ckpt
        if at_floor:    # a floor the plan run at it measures far under: a lower budget may have been accepted
            counts["measured_at_floor"] += 1
            counts["loose_floors"] += at_floor < (1 - LOOSE_FLOOR_FRACTION) * floor
        lines.append(f"| {name} | {_mb(plain)} | {_mb(floor)}{note} | {floor / plain:.3f} | {_mb(ckpt)} "
                     f"| {'' if not ckpt else f'{floor / ckpt:.3f}'} | {_mb(at_floor)} |")
    return lines, counts


def loop_over_budget(row: dict[str, Any]) -> bool:
    """Whether the closed loop measured a step after the first over the point's budget (its feedback events)."""
    budget = row.get("budget_bytes")
    return bool(budget) and any((e.get("step") or 0) >= 1 and (e.get("measured_peak_bytes") or 0) > budget
                                for e in row.get("feedback_events") or () if isinstance(e, dict))


def summary(models: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The distribution over every compiled remat point (no budget, the fractions, the floor)."""
    rows = [row for points in models.values() for p, row in points.items()
            if p in ("none",) + BUDGET_POINTS and not row.get("error")]
    errors = [e for e in map(error_of, rows) if e is not None]
    budgeted_errors = [e for e in (error_of(r) for r in rows if r.get("budget_bytes")) if e is not None]
    simulated = [e for e in (error_of(r, "predicted_peak_bytes") for r in rows) if e is not None]
    stepped = [r for r in rows if final_plans(r).get("step_predicted_bytes") is not None]
    graphs_alone = [e for e in (error_of(r, "graphs_accepted_peak_bytes") for r in stepped) if e is not None]
    budgeted = [r for r in rows if r.get("budget_bytes") and r.get("measured_later_bytes")]
    over = [r for r in budgeted if r["measured_later_bytes"] > r["budget_bytes"]]
    # a point refused after its first step ran (the loop measured it over and found no plan) counts there too
    refused_after_a_step = [row for points in models.values() for p, row in points.items()
                            if p in BUDGET_POINTS and row.get("error") and row.get("loop_first_step_bytes")]
    over_first = [r for r in budgeted + refused_after_a_step
                  if (r.get("measured_first_bytes") or r.get("loop_first_step_bytes") or 0) > r["budget_bytes"]]
    # a step after the first that the closed loop measured over the budget (the benchmark itself measures steps 1
    # and 3; a step split at graph breaks is measured by the loop at each of its steps until it fits)
    over_loop = [r for r in budgeted + refused_after_a_step if loop_over_budget(r)]
    first_unmeasured = [r for r in budgeted if r.get("measured_first_bytes") is None and r.get("loop_first_step_bytes") is None]
    # ``--profile-every-step``: step 2 measured by the benchmark too (a user checking every step)
    second = [r for r in budgeted if r.get("measured_second_bytes") is not None]
    over_second = [r for r in second if r["measured_second_bytes"] > r["budget_bytes"]]
    grads = [r.get("grad_rel_err") for r in rows]
    failed = [row for points in models.values() for p, row in points.items()
              if p in ("plain", "none", "checkpoint") + BUDGET_POINTS and (row.get("error") or "").startswith("failed")]
    floor_points = {m: points["floor"] for m, points in models.items() if "floor" in points}
    chains = {m: floor_retries(points) for m, points in models.items() if "floor" in points}
    return {
        "floor_points": len(floor_points),
        "floor_chains": chains,
        "floor_refused": {m: row.get("min_budget_bytes") for m, row in floor_points.items()
                          if (row.get("error") or "").startswith("infeasible")},
        "points": len(rows), "budgeted": len(budgeted), "over_budget_step3": len(over), "over_budget_step1": len(over_first),
        "over_budget_loop": len(over_loop), "first_step_unmeasured": len(first_unmeasured),
        "step2_measured": len(second), "over_budget_step2": len(over_second),
        "worst_ratio": max((r["measured_later_bytes"] / r["budget_bytes"] for r in budgeted), default=None),
        "needed_loop": sum(1 for r in rows if r.get("loop_events")),
        "abs_error_median": statistics.median(map(abs, errors)) if errors else None,
        "abs_error_p95": quantile([abs(e) for e in errors], 0.95) if errors else None,
        "abs_error_max": max(map(abs, errors)) if errors else None,
        "budgeted_errors": len(budgeted_errors),
        "budgeted_abs_error_median": statistics.median(map(abs, budgeted_errors)) if budgeted_errors else None,
        "budgeted_abs_error_p95": quantile([abs(e) for e in budgeted_errors], 0.95) if budgeted_errors else None,
        "budgeted_abs_error_max": max(map(abs, budgeted_errors)) if budgeted_errors else None,
        "error_median": statistics.median(errors) if errors else None,
        "sim_abs_error_median": statistics.median(map(abs, simulated)) if simulated else None,
        "sim_abs_error_p95": quantile([abs(e) for e in simulated], 0.95) if simulated else None,
        "sim_abs_error_max": max(map(abs, simulated)) if simulated else None,
        "stepped_points": len(stepped),
        "graphs_abs_error_median": statistics.median(map(abs, graphs_alone)) if graphs_alone else None,
        "graphs_abs_error_p95": quantile([abs(e) for e in graphs_alone], 0.95) if graphs_alone else None,
        "graphs_abs_error_max": max(map(abs, graphs_alone)) if graphs_alone else None,
        "under_predicted": sum(1 for e in errors if e < 0),
        "grad_mismatch": sum(1 for g in grads if g is None or not g <= GRAD_TOL),
        "failed_points": len(failed),
    }


def accuracy_ratios(models: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[float, str, str]]:
    """In bf16 (autocast or a bf16 model): ``(ratio, model, point)`` for every compiled remat point, the ratio
    being its gradient error against the fp32 reference over plain Inductor's in bf16; largest first. Empty for
    a run in float32."""
    out = []
    for name, points in models.items():
        key = _accuracy_key(points.get("plain") or {})
        base = (points.get("plain") or {}).get(key)
        for point, row in points.items():
            err = row.get(key)
            if point in ("none",) + BUDGET_POINTS and not row.get("error") and err is not None and base:
                out.append((err / base, name, point))
    return sorted(out, reverse=True)


def _accuracy_key(plain: dict[str, Any]) -> str:
    """The error a model's accuracy ratios use: over all parameters where its plain row has it (rows written
    before it was recorded: the largest per parameter)."""
    return "grad_global_err_fp32" if "grad_global_err_fp32" in plain else "grad_rel_err_fp32"


def _accuracy_lines(models: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    ratios = accuracy_ratios(models)
    if not ratios:
        return []
    values = [r[0] for r in ratios]
    plain = [p["plain"][_accuracy_key(p["plain"])] for p in models.values()
             if (p.get("plain") or {}).get("grad_rel_err_fp32")]
    return ["## Gradients in bf16: accuracy against the fp32 reference", "",
            f"Plain Inductor in bf16 (under autocast or on the bf16 model), gradient error against the fp32 reference (over all parameters where "
            f"recorded, else the largest per parameter): median {statistics.median(plain):.1e}, "
            f"max {max(plain):.1e} over {len(plain)} models. remat's error over plain Inductor's, per point ({len(values)}): "
            f"median {statistics.median(values):.2f}, p95 {quantile(values, 0.95):.2f}, max {max(values):.2f}; "
            f"above {ACCURACY_RATIO_TOL:g}x: {sum(1 for v in values if v > ACCURACY_RATIO_TOL)}. The largest:", ""] \
        + [f"- {name} at {point}: {ratio:.2f}x" for ratio, name, point in ratios[:5]] + [""]


def check_misses(models: dict[str, dict[str, dict[str, Any]]]) -> list[tuple[float, str, str, int, int]]:
    """Inductor's check against the step it judged: ``(measured / checked - 1, model, point, checked, measured)``
    for every single-graph point whose plan was checked (step 3), most under-checked first. What the
    check cannot see (library calls' internal allocations, eager code in the step, tangents the runtime
    frees early) is this gap: the headroom has to cover its positive side."""
    out = []
    for name, points in models.items():
        for point, row in points.items():
            plans = final_plans(row) if point in ("none",) + BUDGET_POINTS and not row.get("error") else {}
            checked = plans.get("graph_checked_peak_bytes") or []
            measured = row.get("measured_later_bytes")
            if len(checked) == 1 and checked[0] and measured:
                out.append((measured / checked[0] - 1, name, point, checked[0], measured))
    return sorted(out, reverse=True)


def _check_lines(models: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    misses = check_misses(models)
    if not misses:
        return []
    gaps = [m[0] for m in misses]
    exact = sum(1 for g in gaps if abs(g) < 1e-4)
    return ["## Inductor's check vs the measured step", "",
            f"{len(misses)} single-graph points with a checked plan: measured / checked - 1 median {_pct(statistics.median(gaps))}, "
            f"max {_pct(max(gaps))} (under-checked), min {_pct(min(gaps))} (over-checked); exact to 0.01% on {exact}. "
            "The largest gaps (measured above checked: what the check cannot see, which the headroom covers):", ""]\
        + [f"- {name} at {point}: checked {_mb(checked)} MB, measured {_mb(measured)} MB ({_pct(gap)})"
           for gap, name, point, checked, measured in misses[:5]] \
        + [f"- over-checked the most: {name} at {point}: checked {_mb(checked)} MB, measured {_mb(measured)} MB ({_pct(gap)})"
           for gap, name, point, checked, measured in misses[-2:] if gap < -1e-4] + [""]


def worst_cases(models: dict[str, dict[str, dict[str, Any]]], count: int = 5) -> list[tuple[str, str, dict[str, Any]]]:
    """The ``count`` budgeted points with the largest step-3 measured / budget."""
    rows = [(m, p, r) for m, points in models.items() for p, r in points.items()
            if p in BUDGET_POINTS and r.get("budget_bytes") and r.get("measured_later_bytes")]
    return sorted(rows, key=lambda t: -t[2]["measured_later_bytes"] / t[2]["budget_bytes"])[:count]


def lean_points(models: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The remat points where a graph's accepted plan runs under Inductor's lean code generation (a refused
    budget's candidate, ``remat/_torch_inductor.py``), as "model at point" (rows without the record's
    ``code_generation``: the verdict that accepted the candidate names it)."""
    def lean(plans: dict[str, Any]) -> bool:
        return ("lean" in (plans.get("code_generation") or [])
                or any("lean code generation" in (action or "") for action in plans.get("judgement") or []))
    return [f"{m} at {p}" for m, points in models.items() for p, row in points.items()
            if lean(row.get("plans_final") or {})]


def candidate_points(models: dict[str, dict[str, dict[str, Any]]], kind: str) -> list[str]:
    """The remat points where a graph runs the refusal's candidate ``kind`` (its verdict names it), as "model at point"."""
    return [f"{m} at {p}" for m, points in models.items() for p, row in points.items()
            if any(f"check of the {kind} plan" in (action or "")
                   for action in (row.get("plans_final") or {}).get("judgement") or [])]


def write_report(jsonl: Path, md: Path, meta: dict[str, Any]) -> None:
    header, models = load(jsonl)
    descriptions = {m: (p.get("done") or {}).get("description", "") for m, p in models.items()}
    finished = [m for m, p in models.items() if "done" in p]
    dead = {m: p["done"]["error"] for m, p in models.items() if str((p.get("done") or {}).get("error", "")).startswith("worker ")}
    s = summary(models)
    lean, named_plan = lean_points(models), candidate_points(models, "named budget's")
    floor_lines, floors = _floor_rows(models)
    source, machine = header.get("source", {}), header.get("machine", {})
    lines = [
        "# Fidelity on a corpus nobody tuned to (CPU)",
        "",
        f"Command: `{' '.join(f'{k}={v}' for k, v in header.get('environment', meta.get('environment', {})).items())} "
        f"{header.get('command', '?')}` (see `benchmarks/fidelity.py`). Commit {source.get('commit', '?')}"
        f"{'; remat files modified from it: ' + ', '.join(source.get('remat_files_modified_from_commit', [])) if source.get('remat_files_modified_from_commit') else ''}. "
        f"torch {machine.get('torch', '?')}, {machine.get('torch_threads', '?')} torch threads, {machine.get('cpu_count', '?')} CPUs. "
        f"Closed loop (`verify_peak`) available: {header.get('loop_supported')}."
        + (f" Forward and loss under CPU autocast to {header['autocast']} (the backward outside it)." if header.get("autocast") else "")
        + (f" Fine-tuned in every variant as `--freeze {header['freeze']}` says"
           " (`remat.testing.finetune.freeze_parameters`); gradients compared over the parameters that train." if header.get("freeze") else "")
        + (" Every variant's model checkpoints its own blocks (`--user-checkpointing`: `entry.build(checkpoint_blocks=True)`;"
           " plain is plain Inductor on that model, and there is no separate checkpointing baseline)." if header.get("user_checkpointing") else "")
        + (" Step 1 of every variant is measured inside `remat.measure_peak_bytes`'s profiler (`--profile-first-step`),"
           " as a user checking it would: the closed loop cannot measure that step." if header.get("profile_first_step") else "")
        + (f" Every variant's step calls the model {header['runs_per_step']} times and sums the losses before the backward"
           " (`--runs-per-step`: the runs stack); step 1 is the one that discovers it, and the probe's floor is one"
           " run's (`floor-named`: the budget a refused floor named)." if (header.get("runs_per_step") or 1) > 1 else "")
        + (f" Every variant's step accumulates gradients over {header['micro_batches']} forward and backward passes"
           " (`--micro-batches`, the same inputs each time): step 1 is the one that discovers it, and the probe's floor"
           " is one pass's (`floor-named`: the budget a refused floor named). Four steps run, the last measured (the"
           " table's step 3): where step 1 runs inside a profiler the discovery is step 2's." if (header.get("micro_batches") or 1) > 1 else "")
        + (" Every variant's model and 4-D inputs are in the channels-last memory format (`--channels-last`:"
           " `remat.testing.corpus.to_channels_last`)." if header.get("channels_last") else "")
        + (f" Every variant's model and floating inputs are in {header['model_dtype']} throughout, no autocast"
           " (`--model-dtype`: `remat.testing.corpus.to_dtype`); the fp32 reference is plain Inductor on the float32"
           " model." if header.get("model_dtype") else "")
        + (" Every variant's loss is a cross-entropy computed outside the compiled model on its output as logits"
           " (`--eager-cross-entropy`: `remat.testing.corpus.to_eager_cross_entropy`): eager memory no plan sees."
           if header.get("eager_cross_entropy") else ""),
        "",
        f"Models finished: {len(finished)} of the {len(models)} started ({sum(1 for m in finished if m.startswith('rand-'))} random nets, "
        f"{sum(1 for m in finished if m.startswith('cnn-'))} CNNs, {sum(1 for m in finished if m.startswith('hf-'))} Hugging Face models"
        f"{': left out, ' + meta['hf_skip_reason'] if meta.get('hf_skip_reason') else ''}); random-net seeds of the corpus: "
        f"{_seed_ranges(meta.get('seeds', []))}, of them run: {_seed_ranges(sorted(int(m[5:]) for m in finished if m.startswith('rand-') and m[5:].isdigit()))}"
        + "".join(f"; {what} drawn from seeds {_seed_ranges(meta[key])}" for key, what in
                  (("break_seeds", "random nets with graph breaks (rand-brk-<seed>)"), ("cnn_seeds", "CNNs"),
                   ("hf_seeds", "Hugging Face configurations")) if meta.get(key)) + "."
        + (f" Not finished: {', '.join(m for m in models if m not in finished)}." if len(finished) < len(models) else ""),
        *([f"Resumed {len(header['runs']) - 1} time(s); the models each invocation ran, by the commit it ran: "
           + "; ".join(f"run {i + 1} ({run.get('started', '?')}, commit {run.get('source', {}).get('commit', '?')}, "
                       f"`{run.get('command', '?')}`): {len(run['models'])} models"
                       + (f" ({', '.join(run['models'])})" if i > 0 else "")
                       for i, run in enumerate(header["runs"])) + "."] if len(header.get("runs", [])) > 1 else []),
        "Budgets are fractions of plain Inductor's step-3 measured peak; `floor` is the smallest budget remat accepts "
        "(named by the infeasibility error of a 1 kB budget). MB = 1e6 bytes.",
        "",
        "## Distribution",
        "",
        f"- models whose worker process died before finishing (their later points are missing): {len(dead)}"
        + (f" ({'; '.join(f'{m}: {e}' for m, e in dead.items())})" if dead else ""),
        f"- remat points compiled: {s['points']} ({s['budgeted']} with a budget); failed points (plain, remat or checkpoint): {s['failed_points']}",
        f"- predicted vs measured (step 3), |error|: median {_pct(s['abs_error_median'])}, p95 {_pct(s['abs_error_p95'])}, "
        f"max {_pct(s['abs_error_max'])}; signed median {_pct(s['error_median'])}; under-predicted on {s['under_predicted']} points "
        "(the peak the plan was accepted on: Inductor-checked where remat checked it, else simulated; for a step of "
        "several graphs, remat's step prediction next to the eager memory its steps measured, where the row has one)",
        f"- of those, the {s['budgeted_errors']} points with a budget (a plan accepted under it), |error|: median "
        f"{_pct(s['budgeted_abs_error_median'])}, p95 {_pct(s['budgeted_abs_error_p95'])}, max {_pct(s['budgeted_abs_error_max'])}",
        *([f"- of those, the {s['stepped_points']} points whose step has several graphs, their plans composed without "
           f"the eager memory, |error|: median {_pct(s['graphs_abs_error_median'])}, p95 {_pct(s['graphs_abs_error_p95'])}, "
           f"max {_pct(s['graphs_abs_error_max'])}"] if s.get("stepped_points") else []),
        f"- the simulator alone, |error|: median {_pct(s['sim_abs_error_median'])}, p95 {_pct(s['sim_abs_error_p95'])}, "
        f"max {_pct(s['sim_abs_error_max'])}",
        f"- over budget at step 3: {s['over_budget_step3']} of {s['budgeted']} (worst measured / budget "
        f"{'-' if s['worst_ratio'] is None else format(s['worst_ratio'], '.3f')}); "
        f"over budget at step 1: {s['over_budget_step1']}; at a later step the closed loop measured (steps 2 on): "
        f"{s['over_budget_loop']}; points whose step 1 nothing measured: {s.get('first_step_unmeasured', 0)}; points where "
        f"the closed loop acted: {s['needed_loop']}"
        + (f"; step 2, measured by the benchmark (every step profiled), over on {s['over_budget_step2']} of "
           f"{s['step2_measured']}" if s.get("step2_measured") else ""),
        f"- gradient mismatch > {GRAD_TOL:g} vs plain Inductor: {s['grad_mismatch']} of {s['points']}"
        + (" (in bf16 every compiled variant differs at bf16's rounding: see the accuracy section)"
           if accuracy_ratios(models) else ""),
        f"- floor points refused at the budget the probe named (it must be accepted): {len(s['floor_refused'])} of "
        f"{s['floor_points']}" + "".join(f"; {m} then named {_mb(b)} MB" for m, b in s["floor_refused"].items()),
        *([_chains_line(s["floor_chains"]),
           _overshoot_line(chain_overshoots(models), sum(k is not None for k in s["floor_chains"].values()))]
          if any(p.startswith("floor-named-") for ps in models.values() for p in ps) else []),
        f"- floor (the smallest budget accepted: the probe's, the retry's where the probe's was refused, or a fraction's "
        f"where both were: then only an upper bound of the floor) above plain "
        f"Inductor's measured peak: {floors['floor_above_plain']} of {floors['models']} models; "
        f"above full per-block checkpointing's: {floors['floor_above_checkpoint']} of {floors['with_checkpoint']}; "
        f"floors whose own point measures more than {LOOSE_FLOOR_FRACTION:.0%} under them (loose: the probe's plans check "
        f"higher than the plan a retry there runs): {floors['loose_floors']} of {floors['measured_at_floor']}",
        f"- points whose plan runs under Inductor's lean code generation (a refused budget's candidate): "
        f"{len(lean)}" + (f" ({', '.join(lean)})" if lean else ""),
        f"- points whose plan is the named budget's plan (a refused budget's last candidate): {len(named_plan)}"
        + (f" ({', '.join(named_plan)})" if named_plan else ""),
        "",
        *_accuracy_lines(models),
        *_check_lines(models),
        "## Worst points (step 3 measured / budget)",
        "",
    ]
    for model, point, row in worst_cases(models):
        plans = final_plans(row)
        lines.append(f"- {model} at {point}: budget {_mb(row['budget_bytes'])} MB, simulated {_mb(plans.get('predicted_peak_bytes'))} MB, "
                     f"accepted on {_mb(plans.get('accepted_peak_bytes'))} MB "
                     f"(peak step {', '.join(plans.get('peak_step') or [])}), measured {_mb(row['measured_later_bytes'])} MB "
                     f"({row['measured_later_bytes'] / row['budget_bytes']:.3f}x). {descriptions.get(model, '')}")
    lines += ["", "## Floors", ""] + floor_lines + ["", "## Every point", ""] + _point_rows(models)
    lines += ["", "## Models", ""] + [f"- {m}: {d}" for m, d in descriptions.items()]
    md.write_text("\n".join(lines) + "\n")
