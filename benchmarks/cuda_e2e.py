"""The end-to-end contract on a GPU: gradients, budget and simulated vs measured peak, per zoo model.

    python benchmarks/cuda_e2e.py                          # all zoo models, on cuda
    python benchmarks/cuda_e2e.py --models gpt --out /tmp  # a subset, results elsewhere

For each zoo model (remat/testing/zoo.py, same sizes as the CPU tests), in one process:

1. plain ``backend="inductor"``: the reference gradients, measured peak and step time;
2. remat with no budget (``budget_gb=None``, the free min-cut);
3. remat at ~70% and ~50% of (2)'s measured peak, with the backend's default headroom.
   A budget the planner proves infeasible is replaced by the smallest feasible budget it
   names (x1.002), marked "min" — the same honest clamp tests/test_e2e.py uses.

Per point: budget, remat's predicted peak (largest over the compiled graphs), the measured
peak (docs/design.md's CUDA method: ``max_memory_allocated() - memory_allocated()`` around one
forward + backward, gradients set to None before the window), whether it fits, the largest
relative gradient error against plain Inductor (same seed before every step, so Inductor's
RNG draws the same dropout masks; a gradient below 1e-5 of the largest gradient norm is
measured against the largest norm, as tests/conftest.py does), and the median step time over
``--steps`` steps (synchronised). A point that raises is recorded with its error, not fatal.

Writes ``<out>/e2e-cuda.json`` and ``<out>/e2e-cuda.md`` (``e2e-cpu.*`` for a CPU dry run) after every model. Units: bytes;
budgets in GB (1 GB = 1e9 bytes).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

import remat
from remat.testing.steps import ZERO_GRAD_FRACTION, grads_of, relative_error, run_step, zero_grads
from remat.testing.zoo import ZOO

ROOT = Path(__file__).resolve().parents[1]

FRACTIONS = (0.7, 0.5)
GRAD_REL_TOL = 1e-4
MODEL_SEED = 0


def _fresh(name: str, device: torch.device) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch._dynamo.reset()
    torch.manual_seed(MODEL_SEED)
    model, inputs = ZOO[name]()
    return model.to(device).train(), tuple(t.to(device) for t in inputs)


def _max_rel_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest per-parameter relative error, by tests/conftest.py's rule: a gradient below
    ZERO_GRAD_FRACTION of the largest gradient norm is mathematically zero (a conv bias before
    BatchNorm) and its error is measured against the largest norm instead of its own."""
    largest = max(float(g.double().norm()) for g in reference.values())
    worst = 0.0
    for key, ref in reference.items():
        if key not in grads:
            return float("inf")
        near_zero = float(ref.double().norm()) < ZERO_GRAD_FRACTION * largest
        worst = max(worst, relative_error(grads[key], ref, largest if near_zero else 0.0))
    return worst


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_point(name: str, backend: Any, device: torch.device, steps: int,
               reference: Optional[dict[str, torch.Tensor]]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Compile, check gradients, measure the peak and time ``steps`` steps of one configuration."""
    model, inputs = _fresh(name, device)
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    run_step(compiled, model, inputs)              # compiles the forward and the backward
    _sync(device)
    compile_s = time.perf_counter() - start
    run_step(compiled, model, inputs)
    grads = grads_of(model)
    zero_grads(model)
    measured = remat.measure_peak_bytes(lambda: run_step(compiled, model, inputs), device).peak_bytes
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        run_step(compiled, model, inputs)
        _sync(device)
        times.append(time.perf_counter() - t0)
    row: dict[str, Any] = {
        "measured_bytes": measured,
        "median_step_ms": statistics.median(times) * 1e3,
        "compile_s": round(compile_s, 1),
        "grad_max_rel_error": None if reference is None else _max_rel_error(grads, reference),
    }
    plans = [g.plan for g in getattr(backend, "compiled_graphs", ())]
    if plans:
        row["predicted_bytes"] = max(p.predicted_peak_bytes for p in plans)
        row["graphs"] = len(plans)
        row["est_extra_time_ms"] = sum(p.est_extra_time_s for p in plans) * 1e3
        row["plan_time_s"] = round(sum(p.plan_time_s for p in plans), 3)
        row["recomputed"] = sum(len(p.recomputed) for p in plans)
    return row, grads


def run_model(name: str, device: torch.device, steps: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def record(label: str, budget_gb: Optional[float], fn) -> Optional[dict[str, Any]]:
        try:
            row = {"model": name, "point": label, "budget_gb": budget_gb, **fn()}
        except remat.BudgetInfeasibleError as error:
            row = {"model": name, "point": label, "budget_gb": budget_gb, "infeasible": True,
                   "min_feasible_bytes": error.min_feasible_bytes}
        except Exception as error:  # recorded, not fatal: the other points still run
            row = {"model": name, "point": label, "budget_gb": budget_gb,
                   "error": f"{type(error).__name__}: {error}"[:2000], "traceback": traceback.format_exc()[-4000:]}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        return row

    reference: dict[str, torch.Tensor] = {}

    def plain() -> dict[str, Any]:
        row, grads = _run_point(name, "inductor", device, steps, None)
        reference.update(grads)
        return row

    if record("inductor", None, plain) is None or not reference:
        return rows

    def remat_at(budget_gb: Optional[float]):
        return lambda: _run_point(name, remat.backend(budget_gb), device, steps, reference)[0]

    none_row = record("remat none", None, remat_at(None))
    if not none_row or "measured_bytes" not in none_row:
        return rows
    clamped = False
    for fraction in FRACTIONS:
        budget_gb = float(f"{none_row['measured_bytes'] * fraction / 1e9:.4g}")
        row = record(f"remat {round(fraction * 100)}%", budget_gb, remat_at(budget_gb))
        if row.get("infeasible") and not clamped:
            clamped = True
            budget_gb = float(f"{row['min_feasible_bytes'] * 1.002 / 1e9:.4g}")
            record(f"remat min (for {round(fraction * 100)}%)", budget_gb, remat_at(budget_gb))
    return rows


def _verdict(row: dict[str, Any]) -> str:
    if row.get("error"):
        return "ERROR"
    if row.get("infeasible"):
        return f"infeasible (min {row['min_feasible_bytes'] / 1e9:.4g} GB)"
    marks = []
    if row["budget_gb"] is not None:
        marks.append("fits" if row["measured_bytes"] <= row["budget_gb"] * 1e9 else "OVER BUDGET")
    error = row.get("grad_max_rel_error")
    if error is not None:
        marks.append("grads ok" if error <= GRAD_REL_TOL else "GRADS DIFFER")
    return ", ".join(marks)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# End to end on CUDA: gradients, budget, predicted vs measured peak",
        "",
        f"`{result['command']}` — {result['machine']['device_name']}, torch {result['machine']['torch']}, "
        f"Python {result['machine']['python']}; {result['date']}; commit {result['commit']}.",
        "",
        "Peaks in MB (1e6 bytes) above the bytes allocated at step start (CUDA allocator); budgets in GB.",
        "Error = predicted/measured - 1. Gradients: largest relative error against plain Inductor, "
        f"tolerance {GRAD_REL_TOL:g}. Step: median over {result['steps']} synchronised steps.",
        "",
        "| model | point | budget GB | predicted MB | measured MB | error | step ms | est. extra ms | grad rel err | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        budget = "none" if r["budget_gb"] is None else f"{r['budget_gb']:.4g}"
        if r.get("error") or r.get("infeasible"):
            detail = r.get("error", "")[:120].replace("|", "/")
            lines.append(f"| {r['model']} | {r['point']} | {budget} | | | | | | | {_verdict(r)} {detail} |")
            continue
        predicted = r.get("predicted_bytes")
        error = "" if predicted is None else f"{predicted / r['measured_bytes'] - 1:+.1%}"
        grad = r.get("grad_max_rel_error")
        lines.append(
            f"| {r['model']} | {r['point']} | {budget} | {'' if predicted is None else f'{predicted / 1e6:.3f}'} | "
            f"{r['measured_bytes'] / 1e6:.3f} | {error} | {r['median_step_ms']:.2f} | "
            f"{r.get('est_extra_time_ms', 0.0):.3f} | {'' if grad is None else f'{grad:.1e}'} | {_verdict(r)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--steps", type=int, default=20, help="timed steps per point (default 20)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--device", default="cuda", help="cuda (the point of this script); cpu only to dry-run it")
    parser.add_argument("--max-minutes", type=float, default=6.0, help="start no new model after this long")
    args = parser.parse_args()
    unknown = [m for m in args.models if m not in ZOO]
    if unknown:
        parser.error(f"--models {unknown}: not in the zoo; choose from {sorted(ZOO)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False; this benchmark is for a GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        import subprocess
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    result: dict[str, Any] = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": commit,
        "steps": args.steps,
        "machine": {"device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(), "torch": torch.__version__,
                    "python": platform.python_version(), "cuda": torch.version.cuda},
        "rows": [],
    }
    start = time.perf_counter()
    for name in args.models:
        if time.perf_counter() - start > args.max_minutes * 60:
            result["rows"].append({"model": name, "point": "skipped", "budget_gb": None,
                                   "error": f"not started: past --max-minutes={args.max_minutes}"})
            continue
        result["rows"] += run_model(name, device, args.steps)
        (out / f"e2e-{device.type}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"e2e-{device.type}.md").write_text(markdown(result))
    (out / f"e2e-{device.type}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"e2e-{device.type}.md").write_text(markdown(result))
    print(markdown(result))
    bad = [r for r in result["rows"] if r.get("error") or "OVER" in _verdict(r) or "DIFFER" in _verdict(r)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
