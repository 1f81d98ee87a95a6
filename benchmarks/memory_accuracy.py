"""Does the simulated peak match the measured one? Predicted vs measured peak for the zoo.

    python benchmarks/memory_accuracy.py                       # all zoo models, Inductor as shipped
    python benchmarks/memory_accuracy.py --models llama cnn    # a subset
    python benchmarks/memory_accuracy.py --reuse-off           # also with allow_buffer_reuse=False

For each zoo model: plan and compile it with ``remat.backend(budget, headroom_fraction=0.0)``
at no budget, then at ~70% and ~50% of its measured no-remat peak. A budget no plan can meet
is replaced by the smallest feasible budget the planner names (marked "min"). For each plan:

- predicted: ``plan.predicted_peak_bytes``, the planner's simulated peak;
- measured: docs/design.md's CPU method (profiler allocation events, running sum) around one
  step ``out = compiled(x); out.float().sum().backward()`` after a warm-up step, with the
  gradients set to None and garbage collected *before* the window and the collector off in
  it, counting only allocations made inside the window (a free of older memory, e.g. a
  previous step's gradient, would otherwise lower the baseline by its size).

With ``--reuse-off`` each plan is compiled again under Inductor's
``allow_buffer_reuse=False`` and measured, and predicted with
``simulate_memory(..., reuse_freed=False)``: what the backend would get if it turned
Inductor's buffer reuse off.

Each model runs in its own process with ``PYTHONHASHSEED=0``: the planner's choices
depend on set iteration order. Writes ``benchmarks/results/memory_accuracy-cpu.json`` and
``.md``. Units: bytes; budgets in GB (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
FRACTIONS = (0.7, 0.5)
TOLERANCE = 0.05
ZOO_MODELS = ("mlp", "gpt", "cnn", "llama")


# ---- one model, in a worker process -----------------------------------------------------------


def _measure(model, compiled, inputs) -> dict[str, int]:
    """Peak of the allocations made inside one step: ``remat.measure_peak_bytes`` (the module
    docstring's method), gradients set to None before the window."""
    import remat

    def step() -> None:
        out = compiled(*inputs)
        out.float().sum().backward()
        del out

    for p in model.parameters():
        p.grad = None
    measured = remat.measure_peak_bytes(step, "cpu")
    return {"peak_bytes": measured.peak_bytes, "foreign_freed_bytes": measured.foreign_freed_bytes}


def _compile_and_measure(name: str, budget_gb: Optional[float], reuse: bool) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor_config

    import remat
    from remat.simulator.memory_timeline import simulate_memory
    from remat.errors import BudgetInfeasibleError
    from remat.simulator import schedule
    from remat.testing.zoo import ZOO

    torch._dynamo.reset()
    model, inputs = ZOO[name]()
    be = remat.backend(budget_gb, headroom_fraction=0.0)
    compiled = torch.compile(model, backend=be)
    start = time.perf_counter()
    try:
        with inductor_config.patch(allow_buffer_reuse=reuse):
            compiled(*inputs).float().sum().backward()   # compiles; warm-up step
    except BudgetInfeasibleError as error:
        return {"infeasible": True, "min_feasible_bytes": error.min_feasible_bytes}
    compile_s = time.perf_counter() - start
    record = be.compiled_graphs[-1]    # the plan accepted, and the facts it was made on (to re-simulate it)
    assert record.facts is not None, f"{record.cache} restored no facts; rerun with REMAT_COMPILE_CACHE=0"
    plan, facts = record.plan, record.facts
    steps, pinned = schedule.memory_steps(facts, schedule.partition_nodes(facts, set(plan.saved)))
    predicted = simulate_memory(steps, pinned, reuse_freed=reuse).peak_bytes
    measured = _measure(model, compiled, inputs)
    again = _measure(model, compiled, inputs)
    return {
        "infeasible": False,
        "predicted_bytes": predicted,
        "planner_predicted_bytes": plan.predicted_peak_bytes,
        "measured_bytes": measured["peak_bytes"],
        "measured_again_bytes": again["peak_bytes"],
        "foreign_freed_bytes": measured["foreign_freed_bytes"],
        "saved": len(plan.saved),
        "recomputed": len(plan.recomputed),
        "plan_time_s": round(plan.plan_time_s, 3),
        "compile_s": round(compile_s, 1),
    }


def run_model(name: str, reuse_off: bool) -> list[dict[str, Any]]:
    def row(target: str, budget_gb: Optional[float], reuse: bool, result: dict[str, Any]) -> dict[str, Any]:
        return {"model": name, "target": target, "budget_gb": budget_gb, "allow_buffer_reuse": reuse, **result}

    rows = [row("none", None, True, _compile_and_measure(name, None, True))]
    no_remat = rows[0]["measured_bytes"]
    budgets: list[tuple[str, Optional[float]]] = [("none", None)]
    for fraction in FRACTIONS:
        label, budget_gb = f"{round(fraction * 100)}%", float(f"{no_remat * fraction / 1e9:.4g}")
        result = _compile_and_measure(name, budget_gb, True)
        rows.append(row(label, budget_gb, True, result))
        if not result["infeasible"]:
            budgets.append((label, budget_gb))
        elif not any(t.startswith("min") for t, _ in budgets):
            # the smallest budget the planner can meet, instead (once per model)
            label, budget_gb = f"min (for {label})", float(f"{result['min_feasible_bytes'] * 1.002 / 1e9:.4g}")
            result = _compile_and_measure(name, budget_gb, True)
            rows.append(row(label, budget_gb, True, result))
            if not result["infeasible"]:
                budgets.append((label, budget_gb))
    if reuse_off:
        rows += [row(label, budget_gb, False, _compile_and_measure(name, budget_gb, False)) for label, budget_gb in budgets]
    return rows


# ---- the driver -------------------------------------------------------------------------------


def _machine() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def _error(row: dict[str, Any]) -> Optional[float]:
    if row.get("infeasible"):
        return None
    return row["predicted_bytes"] / row["measured_bytes"] - 1


def _markdown(result: dict[str, Any]) -> str:
    machine = result["machine"]
    lines = [
        "# Memory simulator: predicted vs measured peak (CPU)",
        "",
        f"`{result['command']}` — torch {machine['torch']}, {machine['cpus']} CPUs ({machine['processor']}, "
        f"{machine['threads']} threads), {machine['platform']}; {result['date']}.",
        "",
        "Peak bytes above the step's starting baseline, 1 MB = 1e6 bytes; budgets in GB (1e9 bytes).",
        "Predicted: remat's simulated peak of the plan; measured: docs/design.md's CPU profiler method",
        "(allocations made inside one step; see the script's docstring). Error = predicted/measured - 1;",
        f"|error| <= {TOLERANCE:.0%} passes. \"min\": the requested budget is infeasible, the smallest",
        "feasible budget the planner names is used instead.",
        "",
    ]
    for reuse in (True, False):
        rows = [r for r in result["rows"] if r["allow_buffer_reuse"] is reuse]
        if not rows:
            continue
        lines += [f"## Inductor allow_buffer_reuse={reuse}" + (" (as shipped)" if reuse else ""), "",
                  "| model | target | budget GB | predicted MB | measured MB | error | plan: saved / recomputed |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            budget = "none" if r["budget_gb"] is None else f"{r['budget_gb']:.4g}"
            if r.get("infeasible"):
                note = r.get("note", f"infeasible: smallest feasible {r['min_feasible_bytes'] / 1e9:.4g} GB")
                lines.append(f"| {r['model']} | {r['target']} | {budget} | — | — | — | {note} |")
                continue
            error = _error(r)
            mark = "" if abs(error) <= TOLERANCE else " ✗"
            lines.append(
                f"| {r['model']} | {r['target']} | {budget} | {r['predicted_bytes'] / 1e6:.3f} | "
                f"{r['measured_bytes'] / 1e6:.3f} | {error:+.1%}{mark} | {r['saved']} / {r['recomputed']} |")
        errors = [abs(e) for r in rows if (e := _error(r)) is not None]
        if errors:
            lines += ["", f"Max |error| {max(errors):.1%} over {len(errors)} plans; "
                          f"{sum(e <= TOLERANCE for e in errors)} within {TOLERANCE:.0%}.", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(ZOO_MODELS))
    parser.add_argument("--reuse-off", action="store_true", help="also compile with allow_buffer_reuse=False")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("ROWS " + json.dumps(run_model(args.worker, args.reuse_off)), flush=True)
        return
    rows: list[dict[str, Any]] = []
    env = dict(os.environ, PYTHONHASHSEED="0")
    for name in args.models:
        cmd = [sys.executable, __file__, "--worker", name] + (["--reuse-off"] if args.reuse_off else [])
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        found = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
        if done.returncode != 0 or not found:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"worker for {name} failed (exit {done.returncode})")
        for row in json.loads(found[-1][5:]):
            rows.append(row)
            error = _error(row)
            shown = "infeasible" if error is None else f"predicted {row['predicted_bytes'] / 1e6:.3f} MB, " \
                f"measured {row['measured_bytes'] / 1e6:.3f} MB, error {error:+.1%}"
            print(f"{row['model']:6s} {row['target']:12s} reuse={row['allow_buffer_reuse']!s:5s} {shown}", flush=True)
    command = "python benchmarks/memory_accuracy.py" + (" --models " + " ".join(args.models) if args.models != list(ZOO_MODELS) else "") \
        + (" --reuse-off" if args.reuse_off else "")
    result = {"command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": _machine(),
              "tolerance": TOLERANCE, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "memory_accuracy-cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "memory_accuracy-cpu.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
