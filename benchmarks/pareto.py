"""Peak memory vs step time for remat next to every baseline, measured in one process.

    python benchmarks/pareto.py                          # gpt, cnn, gpt-deep on CPU -> benchmarks/results/
    python benchmarks/pareto.py --quick                  # smoke run: tiny GPT, fewer points -> /tmp
    python benchmarks/pareto.py --device cuda            # gpt-h200 on one GPU (< 8 min on an H200)

``--device cuda`` shares every line with the CPU path except the model (``gpt-h200``: ~0.34 B
parameters, fp32 with TF32 matmuls, a peak of ~12 GB above the resident state at batch 8 x 2048
tokens), CUDA events for the times, the CUDA allocator for the peak
(``reset_peak_memory_stats``, then ``max_memory_allocated()`` minus the bytes allocated at step
start), and remat's datasheet profile of the GPU. It runs under ``--max-minutes 7`` by default:
compiles stop starting at 75% of that, peak measurements at 85%, timing rounds at 95%, and
what was skipped or cut is written as such. Results are written after each phase, so a run that
is killed leaves its partial results. A development version ran on an H200 (torch 2.11.0+cu130)
in 5.4 minutes (--max-minutes 6): compiles took 8-23 s each.

Methods, all compiled from the same parameters: plain ``backend="inductor"``; PyTorch's
``torch._functorch.config.activation_memory_budget`` at 0.8 / 0.5 / 0.3 / 0.1 / 0.0; full
per-block ``torch.utils.checkpoint`` (use_reentrant=False) under torch.compile; every k-th
block checkpointed (k = 2, 4); Megatron-style selective recomputation of the attention core
(``create_selective_checkpoint_contexts``); remat at >= 6 budgets from its smallest feasible
budget (the planner's answer to a 1 kB budget; when that is above Inductor's peak, from the
smallest baseline peak instead) to plain Inductor's measured peak, at 50% of that peak, at each
baseline's measured peak, and at the smallest budget an infeasible compile named when that is
below every budget that fitted (budgets within 1% of each other are planned once, at the smallest).
The CPU runs use one torch thread and record the machine's load average: other processes share
its cores. Run with ``PYTHONHASHSEED=0`` (the planner's choices depend on set order).

Per point: the measured peak above the memory resident at step start (docs/design.md's method,
``remat.measure_peak_bytes``; the largest of ``--peak-rounds`` + 1 measurements), the median
step, forward and backward time over ``--reps`` steps (runs interleaved A B C A B C, each
round in a rotated order), the gradients against plain Inductor with the same seed, and
for remat the plan's predicted peak and extra time next to the measured ones. Writes
``<model>-<device>.json``, ``.md`` and ``.png`` (with matplotlib) and ``pareto-<device>.md``.
Units: bytes and seconds in the JSON; MB (1 MB = 1e6 bytes) and ms in the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import traceback
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import remat
from remat.metrics import MonitorOptions, StepMetrics, check_step
from common import (
    MODELS, STEP_SEED, CountingInductor, ModelSpec, Point, Sweep, has_attention, machine_info, source_info,
    selective_context_fn, with_checkpointed_blocks,
)

AC_BUDGETS = (0.8, 0.5, 0.3, 0.1, 0.0)
EVERY_K = (2, 4)
DOMINANCE_TIME_FACTOR = 1.03
CUDA_MAX_MINUTES = 7.0        # --device cuda: the whole run, compiles included, inside 8 minutes
MERGE_FRACTION = 0.01          # remat budgets within 1% of each other are planned once, at the smallest
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# ---- the sweep ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepConfig:
    """Which methods run and how much is measured."""

    ac_budgets: tuple[float, ...] = AC_BUDGETS
    every_k: tuple[int, ...] = EVERY_K
    full_checkpoint: bool = True
    selective: bool = True
    sweep_points: int = 6
    reps: int = 31
    peak_rounds: int = 2
    max_minutes: Optional[float] = None


QUICK = SweepConfig(ac_budgets=(0.5, 0.0), every_k=(2,), sweep_points=3, reps=5, peak_rounds=1)


def ordinal(k: int) -> str:
    return f"{k}{'tsnrhtdd'[(k // 10 % 10 != 1) * (k % 10 < 4) * k % 10::4]}"


def baseline_methods(sweep: Sweep, config: SweepConfig) -> None:
    model = sweep.model
    sweep.add(Point("inductor", "inductor"), model, CountingInductor())
    for budget in config.ac_budgets:
        patches = {"activation_memory_budget": budget}
        sweep.add(Point("ac-budget", f"AC budget {budget}", {"activation_memory_budget": budget}),
                  model, CountingInductor(patches), patches)
    if config.full_checkpoint:
        sweep.add(Point("checkpoint", "checkpoint every block", {"every": 1}), with_checkpointed_blocks(model, 1),
                  CountingInductor())
    for k in config.every_k:
        sweep.add(Point("checkpoint-every-k", f"checkpoint every {ordinal(k)} block", {"every": k}),
                  with_checkpointed_blocks(model, k), CountingInductor())
    if config.selective and has_attention(model):
        sweep.add(Point("selective", "selective (attention core)", {"policy": "attention_core_policy"}),
                  with_checkpointed_blocks(model, 1, selective_context_fn), CountingInductor())
    elif config.selective:
        sweep.points.append(Point("selective", "selective (attention core)",
                                  error="not applicable: the model has no attention"))


def smallest_feasible_bytes(sweep: Sweep) -> int:
    """Ask remat for a 1 kB budget: the error names the smallest feasible budget (planning only, no codegen)."""
    backend = remat.backend(1e-6, hardware=hardware_profile_name(sweep.device))
    try:
        sweep.one_step(sweep.forward_of(torch.compile(sweep.model, backend=backend)))
    except remat.BudgetInfeasibleError as error:
        return error.min_feasible_bytes
    raise RuntimeError("a 1 kB budget was feasible: this model's step allocates next to nothing")


def remat_budgets(min_feasible: Optional[int], inductor_peak: int, baselines: list[Point],
                  sweep_points: int) -> list[tuple[int, list[str]]]:
    """(budget bytes, roles) pairs: the sweep, 50% of Inductor's peak, each baseline's peak; close ones merged.
    Without a smallest feasible budget (remat failed to plan) there is no sweep, only the other roles."""
    wanted: list[tuple[int, str]] = []
    if min_feasible is not None:
        low = min_feasible
        if low > inductor_peak:   # the probe overstated (plans at Inductor's own peak always fit so far)
            low = min([p.peak for p in baselines if p.has_peak] + [inductor_peak])
        top = max(inductor_peak, low)
        wanted += [(round(low + (top - low) * i / (sweep_points - 1)), f"sweep {i + 1}/{sweep_points}")
                   for i in range(sweep_points)]
    wanted.append((inductor_peak // 2, "50% of inductor's peak"))
    wanted += [(p.peak, f"at {p.label}'s peak") for p in baselines if p.has_peak]
    merged: list[tuple[int, list[str]]] = []
    for budget, role in sorted(wanted):
        if merged and budget <= merged[-1][0] * (1 + MERGE_FRACTION):
            merged[-1][1].append(role)
        else:
            merged.append((budget, [role]))
    return merged


# Shares of a model's time (``--max-minutes`` split over the models left) after which a phase starts
# nothing new: compiles, then peak measurements, then timing rounds; the rest is for writing results.
# Measured on an H200 (torch 2.11, gpt-h200): compiles take 11-23 s each, every peak and timing round
# of ~20 methods under 5 s, so measuring needs under a fifth of the time the compiles take.
COMPILE_SHARE, PEAK_SHARE, TIMING_SHARE = 0.75, 0.85, 0.95


@dataclass(frozen=True)
class Deadlines:
    """``time.monotonic()`` instants after which a phase of one model's sweep starts nothing new."""

    compile: float = math.inf
    peaks: float = math.inf
    timing: float = math.inf

    @staticmethod
    def share(run_deadline: float, models_left: int) -> "Deadlines":
        if math.isinf(run_deadline):
            return Deadlines()
        now = time.monotonic()
        share_s = max(run_deadline - now, 0.0) / max(models_left, 1)
        return Deadlines(now + COMPILE_SHARE * share_s, now + PEAK_SHARE * share_s, now + TIMING_SHARE * share_s)


class ModelRun:
    """One model's sweep, with what is known so far; ``snapshot`` turns it into the results JSON."""

    def __init__(self, spec: ModelSpec, device: torch.device, config: SweepConfig, deadlines: Deadlines) -> None:
        self.spec, self.device, self.config, self.deadlines = spec, device, config, deadlines
        self.started = time.monotonic()
        self.load_start = os.getloadavg()
        self.min_feasible: Optional[int] = None
        self.min_feasible_error: Optional[str] = None
        self.sweep: Optional[Sweep] = None

    @property
    def points(self) -> list[Point]:
        return self.sweep.points if self.sweep is not None else []

    def snapshot(self, status: str, error: Optional[str] = None) -> dict[str, Any]:
        spec, config = self.spec, self.config
        sweep = self.sweep
        result: dict[str, Any] = {
            "model": spec.name, "description": spec.description, "device": str(self.device), "torch": torch.__version__,
            "status": status, "error": error, "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
            "machine": machine_info(self.device), "source": source_info(), "command": " ".join(["python"] + sys.argv),
            "units": "bytes and seconds; 1 GB = 1e9 bytes",
            "settings": {**asdict(config), "peak_measurements": config.peak_rounds + 1, "step_seed": STEP_SEED,
                         "grad_rel_tol": spec.grad_rel_tol, "dominance_time_factor": DOMINANCE_TIME_FACTOR,
                         "merge_fraction": MERGE_FRACTION},
            "load_average": load_average_json(self.load_start, sweep.load_average_1min if sweep else [], os.getloadavg()),
            "rounds_cut_by_time_limit": list(sweep.rounds_cut) if sweep else [],
            "min_feasible_bytes": self.min_feasible, "min_feasible_error": self.min_feasible_error,
            "wall_s": time.monotonic() - self.started,
            "points": [point_json(p) for p in self.points],
        }
        inductor = self.points[0] if self.points else None
        result["checks"] = compute_checks(self.points, inductor) if inductor is not None and inductor.has_peak else None
        return result


def load_average_json(start: tuple[float, float, float], during: list[float], end: tuple[float, float, float]) -> dict[str, Any]:
    """The machine's load (other processes share its cores): 1/5/15-min load averages at the start and
    the end, and the 1-min load average at the start of every measurement round (median, min, max)."""
    out: dict[str, Any] = {"cpu_count": os.cpu_count(), "start_1_5_15min": list(start), "end_1_5_15min": list(end)}
    if during:
        out.update(rounds_1min_median=statistics.median(during), rounds_1min_min=min(during),
                   rounds_1min_max=max(during), rounds=len(during))
    return out


SMALLEST_NAMED_ROLE = "smallest feasible named by an infeasible compile"


def refine_smallest(sweep: Sweep, hardware: str, rounds: int = 2) -> None:
    """Compile remat at the smallest feasible budget an infeasible compile named (x1.002), when that is
    below the lowest budget that compiled: the 1 kB probe's answer is not always the smallest (on an H200
    it named 10.11 GB while 9.15 GB fitted; the 8-layer GPT's probe named 35.3 MB, a 31.5 MB compile 34.0 MB)."""
    for _ in range(rounds):
        remats = [p for p in sweep.points if p.method == "remat"]
        fitted = [p.budget_bytes for p in remats if p.error is None and p.budget_bytes is not None]
        lowest = min(fitted) if fitted else math.inf
        named = [p.min_feasible_bytes for p in remats if p.min_feasible_bytes and p.min_feasible_bytes * 1.002 < lowest * (1 - MERGE_FRACTION)]
        tried = {round(p.settings["budget_gb"] * 1e9) for p in remats}
        candidates = sorted(round(n * 1.002) for n in named if round(n * 1.002) not in tried)
        if not candidates:
            return
        budget = candidates[0]
        size = f"{budget / 1e9:.3f} GB" if budget >= 1e9 else f"{budget / 1e6:.3f} MB"
        point = Point("remat", f"remat {size}", {"budget_gb": budget / 1e9, "hardware": hardware},
                      planned_for=[SMALLEST_NAMED_ROLE])
        sweep.add(point, sweep.model, remat.backend(budget / 1e9, hardware=hardware))


def hardware_profile_name(device: torch.device) -> str:
    """remat's cost profile for ``device``, named explicitly: the datasheet profile of a recognised GPU
    (else the measured "cuda" one), the measured CPU on CPU. ``hardware="auto"`` chose the CPU profile on
    an H200 (predicted recompute 7.4 s against 16 ms measured), so the benchmark does not rely on it."""
    if device.type != "cuda":
        return "cpu"
    from remat.cost_model.hardware import datasheet_name_for

    return datasheet_name_for(torch.cuda.get_device_name(device)) or "cuda"


def compile_priority(budget_roles: tuple[int, list[str]], correct: set[str]) -> tuple[int, int]:
    """The checks' budgets first (the peak of each baseline with correct gradients, 50% of Inductor's, the
    smallest feasible), then the peaks of baselines with wrong gradients, then the rest of the sweep; by
    increasing budget within each group. ``correct``: the labels of the baselines with correct gradients."""
    budget, roles = budget_roles
    if any(r.startswith("50%") or r.startswith("sweep 1/") or r in {f"at {label}'s peak" for label in correct}
           for r in roles):
        return (0, budget)
    return (1 if any(r.startswith("at ") for r in roles) else 2, budget)


def run_model(run: ModelRun, write: Callable[[str], None]) -> None:
    """Compile and measure every method on one model; ``write(status)`` after each phase (partial results)."""
    spec, device, config, deadlines = run.spec, run.device, run.config, run.deadlines
    sweep = run.sweep = Sweep(spec, device, deadline=deadlines.compile, measure_deadline=deadlines.peaks)
    print(f"[{spec.name}] compiling the baselines", flush=True)
    baseline_methods(sweep, config)
    baselines = list(sweep.points)
    sweep.measure_peaks(1)                     # the first round always runs: remat's budgets need the peaks
    sweep.measure_peaks(config.peak_rounds - 1)
    inductor = baselines[0]
    if not inductor.has_peak:
        raise RuntimeError(f"plain Inductor failed on {spec.name}: {inductor.error}")
    write("partial: baselines compiled and their peaks measured")
    try:
        run.min_feasible = smallest_feasible_bytes(sweep)
    except Exception as error:  # noqa: BLE001 - remat's failure is a result, the baselines still get measured
        run.min_feasible_error = f"{type(error).__name__}: {str(error).strip()[:400]}"
        print(f"[{spec.name}] remat could not plan at all: {run.min_feasible_error}", flush=True)
    budgets = remat_budgets(run.min_feasible, inductor.peak, baselines, config.sweep_points)
    print(f"[{spec.name}] smallest feasible budget {run.min_feasible} B; compiling remat at {len(budgets)} budgets",
          flush=True)
    first_remat = len(sweep.live)
    # Every budget is compiled, those under the smallest feasible one too: that number comes from the planner's
    # error for a 1 kB budget, and on an H200 it said 10.11 GB while plans at 9.15 GB were found and fit.
    hardware = hardware_profile_name(device)
    correct = {p.label for p in baselines if p.grad_ok}
    for budget, roles in sorted(budgets, key=lambda b: compile_priority(b, correct)):   # the least needed last
        size = f"{budget / 1e9:.3f} GB" if budget >= 1e9 else f"{budget / 1e6:.3f} MB"
        point = Point("remat", f"remat {size}", {"budget_gb": budget / 1e9, "hardware": hardware}, planned_for=roles)
        sweep.add(point, sweep.model, remat.backend(budget / 1e9, hardware=hardware))
    refine_smallest(sweep, hardware)
    sweep.measure_peaks(1, sweep.live[first_remat:])
    sweep.measure_peaks(config.peak_rounds - 1, sweep.live[first_remat:])
    sweep.measure_peaks(1)                     # one more round of every method, interleaved
    write("partial: every method compiled and its peak measured; timing next")
    sweep.measure_deadline = deadlines.timing
    print(f"[{spec.name}] timing {len(sweep.live)} methods x {config.reps} reps, interleaved", flush=True)
    sweep.measure_times(config.reps)
    post_hoc_monitor_checks(sweep.points, inductor)


def measure_model(spec: ModelSpec, device: torch.device, config: SweepConfig) -> tuple[dict[str, Any], list[Point]]:
    """One model's sweep within ``config.max_minutes`` (if set), no partial files: its results JSON and points."""
    deadline = time.monotonic() + 60 * config.max_minutes if config.max_minutes else math.inf
    run = ModelRun(spec, device, config, Deadlines.share(deadline, 1))
    run_model(run, lambda status: None)
    return run.snapshot("complete" if not run.sweep.rounds_cut else "complete, with rounds cut by --max-minutes"), run.points


def post_hoc_monitor_checks(points: list[Point], inductor: Point) -> None:
    """What remat.metrics would warn about on each remat point's median step and largest peak."""
    options = MonitorOptions(baseline_backward_s=inductor.median("backward_s"))
    for p in points:
        if p.method != "remat" or not p.measured:
            continue
        metrics = StepMetrics(
            step=0, forward_s=p.median("forward_s"), backward_s=p.median("backward_s"), step_s=p.median("step_s"),
            peak_bytes=p.peak, compiled=False, profiled=False, graph_ids=tuple(p.graph_ids),
            budget_bytes=p.budget_bytes, predicted_peak_bytes=p.predicted_peak_bytes,
            predicted_extra_s=p.est_extra_time_s, baseline_backward_s=options.baseline_backward_s)
        p.monitor_warnings = list(check_step(metrics, options))


def point_json(p: Point) -> dict[str, Any]:
    out = asdict(p)
    out.update({
        "peak_max_bytes": p.peak if p.peak_bytes else None,
        "step_median_s": p.median("step_s"), "forward_median_s": p.median("forward_s"),
        "backward_median_s": p.median("backward_s"), "step_iqr_over_median": p.spread(),
    })
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


# ---- checks ---------------------------------------------------------------------------------


def remat_for(points: list[Point], role: str) -> Optional[Point]:
    return next((p for p in points if p.method == "remat" and role in p.planned_for), None)


def overhead(p: Point, inductor: Point) -> float:
    return p.median("step_s") / inductor.median("step_s") - 1.0


def compute_checks(points: list[Point], inductor: Point) -> dict[str, Any]:
    remats = [p for p in points if p.method == "remat"]
    baselines = [p for p in points if p.method != "remat"]
    budget_rows = [{"label": p.label, "budget_bytes": p.budget_bytes, "peak_bytes": p.peak,
                    "ok": p.peak <= p.budget_bytes} for p in remats if p.measured]
    dominance = []
    for b in baselines:
        if not b.measured or not b.grad_ok:
            continue
        r = remat_for(points, f"at {b.label}'s peak")
        row: dict[str, Any] = {"baseline": b.label, "baseline_peak_bytes": b.peak, "baseline_step_s": b.median("step_s")}
        if r is None or not r.measured:
            row.update(ok=False, why=(r.error if r is not None else "not planned"))
        else:
            ratio = r.median("step_s") / b.median("step_s")
            row.update(remat=r.label, remat_budget_bytes=r.budget_bytes, remat_peak_bytes=r.peak,
                       remat_step_s=r.median("step_s"), time_ratio=ratio, remat_grad_ok=r.grad_ok,
                       ok=bool(r.peak <= b.peak and ratio <= DOMINANCE_TIME_FACTOR and r.grad_ok))
        dominance.append(row)
    half = remat_for(points, "50% of inductor's peak")
    correct = [b for b in baselines if b.measured and b.grad_ok]
    smallest = min(correct, key=lambda b: b.peak) if correct else None
    lowest_any = min((b for b in baselines if b.measured), key=lambda b: b.peak, default=None)
    at_smallest = remat_for(points, f"at {smallest.label}'s peak") if smallest else None
    return {
        "every_remat_peak_within_budget": all(r["ok"] for r in budget_rows) if budget_rows else None,
        "budget_rows": budget_rows,
        "remat_dominates": all(r["ok"] for r in dominance) if dominance else None,
        "dominance_rows": dominance,
        "half_inductor_peak": describe_point(half, inductor, inductor.peak // 2),
        "smallest_baseline": None if smallest is None else {
            "baseline": smallest.label, "peak_bytes": smallest.peak, "overhead": overhead(smallest, inductor),
            "remat": describe_point(at_smallest, inductor, smallest.peak)},
        "lowest_peak_any_baseline": None if lowest_any is None else {
            "baseline": lowest_any.label, "peak_bytes": lowest_any.peak, "grad_ok": lowest_any.grad_ok},
        "inductor_step_iqr_over_median": inductor.spread(),
        "same_plan_step_ratio": same_plan_step_ratio(remats),
    }


def same_plan_step_ratio(remats: list[Point]) -> Optional[dict[str, Any]]:
    """The largest ratio of median step times between remat points whose plans predicted the same peak and
    the same extra time (the same plan, compiled for different budgets): the timing noise floor, measured."""
    groups: dict[tuple[Any, Any], list[Point]] = {}
    for p in remats:
        if p.measured:
            groups.setdefault((p.predicted_peak_bytes, p.est_extra_time_s), []).append(p)
    worst: Optional[dict[str, Any]] = None
    for group in (g for g in groups.values() if len(g) > 1):
        times = sorted(group, key=lambda p: p.median("step_s"))
        ratio = times[-1].median("step_s") / times[0].median("step_s")
        if worst is None or ratio > worst["ratio"]:
            worst = {"ratio": ratio, "fast": times[0].label, "slow": times[-1].label, "points": len(group)}
    return worst


def describe_point(p: Optional[Point], inductor: Point, target_bytes: int) -> dict[str, Any]:
    if p is None:
        return {"target_bytes": target_bytes, "error": "not planned"}
    if not p.measured:
        return {"target_bytes": target_bytes, "label": p.label, "error": p.error}
    return {"target_bytes": target_bytes, "label": p.label, "budget_bytes": p.budget_bytes, "peak_bytes": p.peak,
            "overhead": overhead(p, inductor), "grad_ok": p.grad_ok}


# ---- what is written -----------------------------------------------------------------------


def mb(num_bytes: Optional[float]) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1e6:.3f}"


def ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None or (isinstance(seconds, float) and math.isnan(seconds)) else f"{seconds * 1e3:.2f}"


def pct(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:+.1f}%"


def grads_text(p: Point) -> str:
    if p.grad_ok is None:
        return "-"
    verdict = "ok" if p.grad_ok else "**WRONG**"
    return f"{verdict} ({p.grad_max_rel_err:.1e})"


def render_markdown(result: dict[str, Any], points: list[Point]) -> str:
    m = result["machine"]
    lines = [
        f"# Pareto benchmark: {result['model']} on {result['device']}",
        "",
        f"- status: **{result.get('status', 'complete')}**" + (f"; error: {short(result['error'])}" if result.get("error") else "")
        + (f"; rounds cut by the time limit: {'; '.join(result['rounds_cut_by_time_limit'])}"
           if result.get("rounds_cut_by_time_limit") else "") + (f"; {result['date_utc']} UTC" if "date_utc" in result else ""),
        f"- model: {result['description']}",
        f"- machine: {m['host']}, {m['processor']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads"
        + (f", GPU {m['gpu']} (CUDA {m['cuda']}, fp32 matmul precision {m['float32_matmul_precision']})" if "gpu" in m else "")
        + f"; {m['platform']}",
        f"- torch {result['torch']}, Python {m['python']}; command: `{result['command']}`; wall time {result['wall_s']:.0f} s",
        load_average_line(result.get("load_average")),
        f"- source: commit {result['source']['commit'][:12]}" + source_note(result["source"]),
        f"- peak: memory allocated during one forward + backward above what was resident at step start "
        f"(docs/design.md; {'CUDA allocator' if result['device'].startswith('cuda') else 'CPU profiler'}), the largest of "
        f"{result['settings']['peak_measurements']} measurements, in MB (1 MB = 1e6 bytes; 1 GB = 1e9 bytes)",
        f"- times: medians over {result['settings']['reps']} steps per method, run interleaved (one step of every method "
        "per round, each round in a rotated order); spread = interquartile range / median of the step time",
        f"- grads: largest per-parameter relative error against plain Inductor with the same seed "
        f"({result['settings']['step_seed']}); wrong when >= {result['settings']['grad_rel_tol']:g}",
        (f"- remat could not plan at all (no sweep): {short(result['min_feasible_error'])}; "
         if result.get("min_feasible_error") else "")
        + f"- remat's smallest feasible budget: {mb(result['min_feasible_bytes'])} MB; its sweep runs from there to "
        "plain Inductor's measured peak (no recomputation beyond Inductor's default); budgets within "
        f"{100 * result['settings']['merge_fraction']:.0f}% of each other are planned once, at the smallest "
        "(column 'planned for')",
        f"- plot: `{result['model']}-{result['device'].split(':')[0]}.png` (peak vs median step time, remat's front as a line)",
        "",
        "| method | setting | peak MB | step ms | fwd ms | bwd ms | spread | overhead vs inductor | grads vs inductor | compile s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    if not points:
        return "\n".join(lines) + "\n"
    inductor = points[0]
    points = display_order(points)
    for p in points:
        if not p.measured:
            lines.append(f"| {p.method} | {p.label} | - | - | - | - | - | - | - | {short(p.error)} |")
            continue
        lines.append(
            f"| {p.method} | {p.label} | {mb(p.peak)} | {ms(p.median('step_s'))} | {ms(p.median('forward_s'))} | "
            f"{ms(p.median('backward_s'))} | {pct(p.spread()).lstrip('+')} | {pct(overhead(p, inductor))} | {grads_text(p)} | "
            f"{p.compile_s:.1f} |")
    lines += [
        "", "## remat: predicted next to measured", "",
        "Measured extra time is remat's median step (backward) minus plain Inductor's; the predicted extra time is "
        "the plan's estimated recompute time. The backward difference also holds work that remat's partition moved "
        "out of the forward (compare the fwd column above), and the remat.metrics column is what "
        "`remat.metrics.check_step` says about the median step with plain Inductor's backward as the baseline.", "",
        "| budget MB | planned for | predicted peak MB | measured peak MB | measured / budget | predicted extra ms "
        "| measured extra step ms | measured extra bwd ms | remat.metrics warnings |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in (p for p in points if p.method == "remat"):
        roles = "; ".join(p.planned_for)
        if not p.measured:
            lines.append(f"| {mb(round(p.settings['budget_gb'] * 1e9))} | {roles} | - | - | - | - | - | - | {short(p.error)} |")
            continue
        lines.append(
            f"| {mb(p.budget_bytes)} | {roles} | {mb(p.predicted_peak_bytes)} | {mb(p.peak)} | {p.peak / p.budget_bytes:.3f} | "
            f"{ms(p.est_extra_time_s)} | {ms(p.median('step_s') - inductor.median('step_s'))} | "
            f"{ms(p.median('backward_s') - inductor.median('backward_s'))} | "
            + (", ".join(warning_kind(w) for w in p.monitor_warnings) or "none") + " |")
    lines += ["", "## Checks", ""] + (render_checks(result["checks"]) if result.get("checks") else
                                       ["Not computed: plain Inductor has no measured peak."])
    return "\n".join(lines) + "\n"


def source_note(source: dict[str, Any]) -> str:
    if source.get("commit_from"):
        return f" (from {source['commit_from']}; git could not check remat/'s files against it)"
    modified = source["remat_files_modified_from_commit"]
    return f", with uncommitted changes to {', '.join(modified)}" if modified else ", remat/ as committed"


def display_order(points: list[Point]) -> list[Point]:
    """Baselines as compiled, then remat by increasing budget (remat compiles in priority order)."""
    remats = sorted((p for p in points if p.method == "remat"), key=lambda p: p.settings.get("budget_gb", 0.0))
    return [p for p in points if p.method != "remat"] + remats


def load_average_line(load: Optional[dict[str, Any]]) -> str:
    if not load:
        return "- load average: not recorded"
    during = (f", 1-min load at the start of the {load['rounds']} measurement rounds: median {load['rounds_1min_median']:.2f} "
              f"(min {load['rounds_1min_min']:.2f}, max {load['rounds_1min_max']:.2f})" if "rounds" in load else "")
    start, end = load["start_1_5_15min"], load["end_1_5_15min"]
    return (f"- load average (other processes share the {load['cpu_count']} CPUs): 1/5/15 min "
            f"{start[0]:.2f}/{start[1]:.2f}/{start[2]:.2f} at the start, {end[0]:.2f}/{end[1]:.2f}/{end[2]:.2f} at the end"
            + during)


def short(text: Optional[str], limit: int = 220) -> str:
    """One line of an error for a table cell."""
    line = (text or "").strip().splitlines()[0] if text else "-"
    return (line[:limit] + "...") if len(line) > limit else line


def warning_kind(message: str) -> str:
    return "peak over budget" if "measured peak" in message else "backward inflation beyond predicted recompute"


def yes_no(value: Optional[bool]) -> str:
    return "n/a" if value is None else ("YES" if value else "NO")


def render_checks(c: dict[str, Any]) -> list[str]:
    rows = c["budget_rows"]
    over = [r for r in rows if not r["ok"]]
    out = [f"1. Every remat point's measured peak <= its budget: **{yes_no(c['every_remat_peak_within_budget'])}** "
           f"({len(rows) - len(over)} of {len(rows)} points)."]
    out += [f"   - over: {r['label']}: measured {mb(r['peak_bytes'])} MB > budget {mb(r['budget_bytes'])} MB "
            f"({100 * (r['peak_bytes'] / r['budget_bytes'] - 1):+.1f}%)" for r in over]
    dom = c["dominance_rows"]
    out.append(f"2. remat's front dominates (for every correct-gradient baseline point (m, t), remat planned at m "
               f"measures peak <= m and time <= {DOMINANCE_TIME_FACTOR}·t, with correct gradients): "
               f"**{yes_no(c['remat_dominates'])}** ({sum(r['ok'] for r in dom)} of {len(dom)} baseline points).")
    for r in dom:
        if "remat_step_s" in r:
            out.append(f"   - {r['baseline']} (m = {mb(r['baseline_peak_bytes'])} MB, t = {ms(r['baseline_step_s'])} ms): "
                       f"{r['remat']} measured {mb(r['remat_peak_bytes'])} MB, {ms(r['remat_step_s'])} ms "
                       f"(time ratio {r['time_ratio']:.3f}{'' if r['remat_grad_ok'] else ', wrong gradients'}) -> "
                       f"{'ok' if r['ok'] else 'NOT dominated'}")
        else:
            out.append(f"   - {r['baseline']} (m = {mb(r['baseline_peak_bytes'])} MB): remat has no point there: "
                       f"{short(r['why'])}")
    half = c["half_inductor_peak"]
    out.append(f"3. At 50% of plain Inductor's peak ({mb(half['target_bytes'])} MB): " + point_sentence(half) + ".")
    small = c["smallest_baseline"]
    if small is None:
        out.append("4. No baseline has correct gradients and a measured peak.")
    else:
        out.append(f"4. The smallest peak any correct-gradient baseline reaches is {small['baseline']}'s "
                   f"{mb(small['peak_bytes'])} MB, at {pct(small['overhead'])} step time over plain Inductor; remat "
                   f"planned there: " + point_sentence(small["remat"]) + ".")
    low = c["lowest_peak_any_baseline"]
    if low is not None and small is not None and low["baseline"] != small["baseline"]:
        out.append(f"   - (lower still, with wrong gradients: {low['baseline']} at {mb(low['peak_bytes'])} MB)")
    out.append(f"\nTiming noise: plain Inductor's step-time interquartile range is {pct(c['inductor_step_iqr_over_median']).lstrip('+')} "
               "of its median on this machine; differences smaller than that are not resolved.")
    same = c.get("same_plan_step_ratio")
    if same:
        out.append(f"The same plan compiled for different budgets ({same['fast']} and {same['slow']}: equal predicted "
                   f"peak and extra time) measured median step times {100 * (same['ratio'] - 1):.1f}% apart: a measured "
                   "noise floor for the step-time comparisons above.")
    return out


def point_sentence(d: dict[str, Any]) -> str:
    if "error" in d:
        return f"remat has no measured point ({short(d['error'])})"
    grads = "" if d["grad_ok"] else ", WRONG gradients"
    return (f"{d['label']} measured {mb(d['peak_bytes'])} MB (budget {mb(d['budget_bytes'])} MB) at "
            f"{pct(d['overhead'])} step time over plain Inductor{grads}")


def pareto_front(points: list[Point]) -> list[Point]:
    """The points no other point beats in both peak and step time, by increasing peak."""
    ordered = sorted(points, key=lambda p: (p.peak, p.median("step_s")))
    front: list[Point] = []
    for p in ordered:
        if not front or p.median("step_s") < front[-1].median("step_s"):
            front.append(p)
    return front


def write_plot(path: Path, result: dict[str, Any], points: list[Point]) -> Optional[Path]:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install 'remat[plot]'): no plot written", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"inductor": ("k", "*"), "ac-budget": ("tab:blue", "o"), "checkpoint": ("tab:red", "s"),
              "checkpoint-every-k": ("tab:orange", "^"), "selective": ("tab:purple", "D"), "remat": ("tab:green", ".")}
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for method, (color, marker) in styles.items():
        group = [p for p in points if p.method == method and p.measured]
        for ok in (True, False):
            sub = [p for p in group if bool(p.grad_ok) == ok]
            if sub:
                ax.scatter([p.median("step_s") * 1e3 for p in sub], [p.peak / 1e6 for p in sub], color=color,
                           marker=marker, s=60, facecolors=color if ok else "none",
                           label=method + ("" if ok else " (wrong grads)"))
        if method not in ("remat", "inductor"):
            for p in group:
                ax.annotate(p.label.replace("checkpoint ", "ckpt ").replace("AC budget ", "AC "),
                            (p.median("step_s") * 1e3, p.peak / 1e6), fontsize=7, xytext=(4, 2), textcoords="offset points")
    front = pareto_front([p for p in points if p.method == "remat" and p.measured and p.grad_ok])
    if front:
        ax.plot([p.median("step_s") * 1e3 for p in front], [p.peak / 1e6 for p in front], color="tab:green", lw=1.5,
                label="remat front")
    ax.set_xlabel("median step time (ms)")
    ax.set_ylabel("peak above step-start memory (MB, 1 MB = 1e6 bytes)")
    ax.set_title(f"{result['model']} on {result['device']} — torch {result['torch']}, {result['machine']['host']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_model_results(out_dir: Path, result: dict[str, Any], points: list[Point], plot: bool = True) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{result['model']}-{result['device'].split(':')[0]}"
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    md_path.write_text(render_markdown(result, points))
    png = write_plot(out_dir / f"{stem}.png", result, points) if plot else None
    return [json_path, md_path] + ([png] if png else [])


def write_summary(out_dir: Path, device: str, results: list[dict[str, Any]]) -> Path:
    lines = [f"# Pareto benchmark summary ({device})", "",
             "The issue's checks, one section per model, as computed by `benchmarks/pareto.py`; the full tables "
             "are in `<model>-<device>.md`, the points in `<model>-<device>.json`. 1 MB = 1e6 bytes.", ""]
    for r in results:
        machine = r["machine"]
        lines += [f"## {r['model']}", "",
                  f"{r['description']}; {machine['host']} ({machine.get('gpu', machine['processor'])}, "
                  f"{machine['torch_threads']} torch threads), torch {r['torch']}, commit {r['source']['commit'][:12]}; "
                  f"command `{r['command']}`; {r['wall_s'] / 60:.0f} min.", ""]
        if r.get("status", "complete") != "complete":
            lines += [f"Status: **{r['status']}**" + (f" ({short(r['error'])})" if r.get("error") else "") + ".", ""]
        lines += (render_checks(r["checks"]) if r.get("checks") else ["No checks: plain Inductor has no measured peak."])
        lines += [""]
    path = out_dir / f"pareto-{device}.md"
    path.write_text("\n".join(lines))
    return path


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--models", default=None, help=f"comma-separated, from {sorted(MODELS)} "
                        "(default: gpt,cnn,gpt-deep on cpu; gpt-h200 on cuda; gpt-tiny with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny GPT, fewer methods and budgets, few reps")
    parser.add_argument("--reps", type=int, default=None, help="timed steps per method (default 31 cpu, 10 cuda, 5 quick)")
    parser.add_argument("--peak-rounds", type=int, default=None,
                        help="peak measurements per method before the last interleaved one (default 2, 1 quick)")
    parser.add_argument("--sweep-points", type=int, default=None,
                        help="remat budgets from the smallest feasible to Inductor's peak (default 6, 3 quick)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads on cpu (default 1: on cores shared with other processes a second "
                             "thread makes every parallel region wait on a descheduled one, and the timings scatter)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default benchmarks/results (with --quick: /tmp/remat-pareto-quick)")
    parser.add_argument("--render", type=Path, nargs="+", default=None, metavar="JSON",
                        help="measure nothing: write the tables, plot and summary again from these results files")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="the whole run's time limit, split evenly over the models left (default: 7 on cuda, none "
                             f"on cpu). Within a model's share no compile starts after {COMPILE_SHARE * 100:.0f}%% of it, no peak "
                             f"measurement after {PEAK_SHARE * 100:.0f}%%, no timing round after {TIMING_SHARE * 100:.0f}%%; what was "
                             "not compiled or measured by then is listed as skipped or cut")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    models = (args.models or ("gpt-tiny" if args.quick else "gpt-h200" if cuda else "gpt,cnn,gpt-deep")).split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"--models={args.models!r}: unknown {unknown}; choose from {sorted(MODELS)}")
    base = QUICK if args.quick else SweepConfig(reps=10 if cuda else 31, max_minutes=CUDA_MAX_MINUTES if cuda else None)
    overrides = {k: v for k, v in (("reps", args.reps), ("peak_rounds", args.peak_rounds),
                                   ("sweep_points", args.sweep_points), ("max_minutes", args.max_minutes)) if v is not None}
    for key, value in overrides.items():
        if value < (2 if key == "sweep_points" else 1):
            parser.error(f"--{key.replace('_', '-')}={value}: too small")
    args.config = replace(base, **overrides)
    args.models = models
    args.out_dir = args.out_dir or (Path("/tmp/remat-pareto-quick") if args.quick else RESULTS_DIR)
    return args


def configure_torch(device: torch.device, threads: Optional[int]) -> None:
    """Room for one Dynamo cache entry per method; no silent fallback to eager when it runs out."""
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # AOTAutograd's cache is keyed on the graph and config; off so no method can reuse another's partition.
    torch._functorch.config.enable_autograd_cache = False
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
    else:
        torch.set_num_threads(threads or 1)


def load_results(path: Path) -> tuple[dict[str, Any], list[Point]]:
    """A results JSON and its points, to render the tables and the plot again without measuring."""
    result = json.loads(path.read_text())
    names = set(Point.__dataclass_fields__)
    points = [Point(**{k: (math.nan if v is None and k in ("compile_s", "grad_max_rel_err") else v)
                       for k, v in p.items() if k in names}) for p in result["points"]]
    return result, points


def measure_models(args: argparse.Namespace, device: torch.device) -> list[tuple[dict[str, Any], list[Point]]]:
    """Every model in turn, within ``--max-minutes`` over all of them; a model that fails is written with its error."""
    run_deadline = time.monotonic() + 60 * args.config.max_minutes if args.config.max_minutes else math.inf
    runs = []
    for index, name in enumerate(args.models):
        run = ModelRun(MODELS[name], device, args.config, Deadlines.share(run_deadline, len(args.models) - index))

        def write(status: str, run: ModelRun = run) -> None:
            try:    # partial results must never end the run
                write_model_results(args.out_dir, run.snapshot(status), run.points, plot=False)
            except Exception:  # noqa: BLE001
                print(f"[{run.spec.name}] could not write partial results:\n{traceback.format_exc()}", flush=True)

        try:
            run_model(run, write)
            result = run.snapshot("complete" if not run.sweep.rounds_cut else "complete, with rounds cut by --max-minutes")
        except Exception as error:  # noqa: BLE001 - what was measured before the failure is still written
            print(f"[{name}] failed:\n{traceback.format_exc()}", flush=True)
            result = run.snapshot("failed", f"{type(error).__name__}: {error}")
        runs.append((result, run.points))
        print(render_markdown(result, run.points))
        print("wrote " + ", ".join(str(p) for p in write_model_results(args.out_dir, result, run.points)), flush=True)
    return runs


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.render:
        runs = [load_results(path) for path in args.render]
        for result, points in runs:   # the checks as this version computes them, from the stored measurements
            if points and points[0].has_peak:
                result["checks"] = compute_checks(points, points[0])
        for result, points in runs:
            print("wrote " + ", ".join(str(p) for p in write_model_results(args.out_dir, result, points)))
    else:
        if device.type == "cuda" and not torch.cuda.is_available():
            print("--device cuda: no CUDA device is available (torch.cuda.is_available() is False); "
                  "run on a machine with a GPU and a CUDA build of torch, or use --device cpu", file=sys.stderr)
            return 2
        configure_torch(device, args.threads)
        runs = measure_models(args, device)
    summary = write_summary(args.out_dir, runs[0][0]["device"].split(":")[0], [r for r, _ in runs])
    print(f"wrote {summary}")
    return 0 if all(r.get("status", "complete").startswith("complete") for r, _ in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
