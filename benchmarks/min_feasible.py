"""The smallest feasible budget per zoo model: per-use recompute instances vs one instance per value.

    python benchmarks/min_feasible.py                    # all zoo models -> results/min_feasible-cpu.{json,md}
    python benchmarks/min_feasible.py --models mlp gpt   # a subset

For each zoo model (``remat/testing/zoo.py``): trace it once as ``torch.compile`` with Inductor
would (``remat.pipeline.trace_joint_facts``, CPU cost profile, no code generation), then
find the smallest planning target ``make_plan`` meets by bisection between 15% and 100% of
the free min-cut's simulated peak (``ROUNDS`` halvings: the answer is within
``(1 - 0.15) / 2**ROUNDS`` of that peak above the true threshold of the search). Twice:

- ``held``: every recomputed value recomputed once and held until its last backward reader
  (``schedule.backward_order(..., rebuild=False)``), the schedule before per-use instances.
  The planner is made to use it by replacing ``schedule.backward_order`` in this process
  only;
- ``per-use``: the schedule as shipped (``rebuild=None``: intermediates of a recompute
  chain rebuilt per use when that lowers the simulated peak).

The budget a user must pass is the target over (1 - headroom), headroom 5% by default on the CPU
(``remat.options.DEFAULT_HEADROOM_BY_DEVICE``).
Also recorded: the minimum the planner's ``BudgetInfeasibleError`` names when asked for the
lowest target tried, with no headroom (so in target units; it should not exceed the
bisection's answer), and how long that ``make_plan`` call took (the infeasible path: every
descent, then ``smallest_peak``). Each model runs
in this one process with ``PYTHONHASHSEED`` as set by the caller. Units: bytes in the JSON,
MB (1e6 bytes) in the table; extra time is the planner's estimate on the CPU profile.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROUNDS = 7
LOW_FRACTION = 0.15


def _cpu_headroom() -> float:
    from remat.options import DEFAULT_HEADROOM_BY_DEVICE

    return DEFAULT_HEADROOM_BY_DEVICE["cpu"]


def _smallest_target(facts, min_cut_peak: int) -> dict[str, Any]:
    from remat.errors import BudgetInfeasibleError
    from remat.passes.plan import make_plan

    low, high = int(LOW_FRACTION * min_cut_peak), min_cut_peak
    best = make_plan(facts, high)
    named = None
    t0 = time.perf_counter()
    try:
        make_plan(facts, low)
    except BudgetInfeasibleError as error:
        named = error.min_feasible_bytes
    infeasible_s = time.perf_counter() - t0
    for _ in range(ROUNDS):
        middle = (low + high) // 2
        try:
            best, high = make_plan(facts, middle), middle
        except BudgetInfeasibleError:
            low = middle
    from remat.simulator import evaluate
    from remat.simulator import schedule

    evaluated = evaluate(facts, set(best.saved))
    recomputations = sum(1 for s in schedule.backward_order(facts, evaluated.partition) if s.region >= 0)
    return {
        "smallest_target_bytes": high,
        "plan_peak_bytes": best.predicted_peak_bytes,
        "budget_bytes_with_headroom": int(high / (1 - _cpu_headroom())),
        "extra_time_s": best.est_extra_time_s,
        "recomputed_values": len(best.recomputed),
        "recomputations": recomputations,
        "error_named_min_budget_bytes": named,
        "infeasible_plan_s": infeasible_s,
    }


def _with_schedule(held: bool, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    from remat.simulator import schedule

    original = schedule.backward_order
    if held:   # every schedule the planner weighs holds its intermediates (both of simulate_partition's)
        def backward_order(facts, partition, rebuild=None):
            return original(facts, partition, False)
        schedule.backward_order = backward_order
    try:
        return run()
    finally:
        schedule.backward_order = original


def measure(name: str) -> dict[str, Any]:
    from remat.testing.zoo import ZOO
    from remat.pipeline import trace_joint_facts
    from remat.passes.plan import make_plan

    def traced():   # a fresh graph per schedule: the planner memoises its schedule decisions per graph
        model, inputs = ZOO[name]()
        graphs = trace_joint_facts(model, inputs, hardware="cpu")
        return next(f for f in graphs if any(n.role == "backward" for n in f.nodes.values()))

    facts = traced()
    min_cut_peak = make_plan(facts, None).predicted_peak_bytes
    row: dict[str, Any] = {"model": name, "nodes": len(facts.order), "min_cut_peak_bytes": min_cut_peak}
    for label, held in (("held", True), ("per_use", False)):
        facts = traced()
        t0 = time.perf_counter()
        row[label] = _with_schedule(held, lambda: _smallest_target(facts, min_cut_peak))
        row[label]["search_time_s"] = time.perf_counter() - t0
    return row


def render(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def mb(n):
        return "-" if n is None else f"{n / 1e6:.2f}"

    lines = [
        "# Smallest feasible budget: per-use recompute instances vs one instance per value",
        "",
        f"torch {meta['torch']}, commit {meta['commit']}, `{meta['command']}`. Simulated (the planner's "
        "kernel-level model), not measured; MB = 1e6 bytes. Target = what the simulated peak must meet; "
        f"budget = target / (1 - {_cpu_headroom():.2f} headroom, the CPU default). 'named' = the minimum the planner's "
        "BudgetInfeasibleError names (asked with budget = target = 15% of the min-cut peak, so in target units); "
        "it should not exceed the bisection's target; 'named s' = the seconds that infeasible make_plan took "
        "(held / per-use).",
        "",
        "| model | min-cut peak | held: target | held: budget | held: extra ms | per-use: target | per-use: budget "
        "| per-use: extra ms | per-use: recomputations / values | target ratio | named (held / per-use) | named s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        h, p = r["held"], r["per_use"]
        lines.append(
            f"| {r['model']} | {mb(r['min_cut_peak_bytes'])} | {mb(h['smallest_target_bytes'])} | "
            f"{mb(h['budget_bytes_with_headroom'])} | {h['extra_time_s'] * 1e3:.1f} | {mb(p['smallest_target_bytes'])} | "
            f"{mb(p['budget_bytes_with_headroom'])} | {p['extra_time_s'] * 1e3:.1f} | "
            f"{p['recomputations']} / {p['recomputed_values']} | "
            f"{p['smallest_target_bytes'] / h['smallest_target_bytes']:.3f} | "
            f"{mb(h['error_named_min_budget_bytes'])} / {mb(p['error_named_min_budget_bytes'])} | "
            f"{h['infeasible_plan_s']:.1f} / {p['infeasible_plan_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "gpt", "cnn", "llama"])
    args = parser.parse_args()
    import torch

    rows = []
    for name in args.models:
        rows.append(measure(name))
        print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    meta = {"torch": torch.__version__, "commit": commit, "python": platform.python_version(),
            "command": "python benchmarks/min_feasible.py " + " ".join(sys.argv[1:])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "min_feasible-cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (RESULTS / "min_feasible-cpu.md").write_text(render(rows, meta))
    print(render(rows, meta))


if __name__ == "__main__":
    main()
