"""Hugging Face models under a memory budget: remat next to Inductor, HF's own checkpointing and PyTorch's budget.

    PYTHONHASHSEED=0 python benchmarks/hf_models.py               # gpt2 llama qwen2 bert t5 vit -> benchmarks/results/
    PYTHONHASHSEED=0 python benchmarks/hf_models.py --models llama,t5
    python benchmarks/hf_models.py --smoke                        # the tiny gpt2, 2 timing rounds -> /tmp

Needs ``transformers`` (the ``bench`` extra). The models are built from configs, no downloads
(``remat.testing.hf_models.benchmark_specs()``: 3 layers (T5 2+2), d=256, batch 4; ``--smoke``
uses the corpus's tiny versions from ``hf_specs()``). Each model computes its own loss from
``labels``; one step is ``model(**inputs).loss.backward()`` with gradients set to None and
``torch.manual_seed`` fixed before it. Methods, all compiled over the same parameters in one process:

- plain Inductor (``backend="inductor"``): the reference for peaks, times and gradients;
- HF checkpointing under Inductor: a copy of the model's modules sharing its parameters and buffers,
  with ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``;
- PyTorch's ``torch._functorch.config.activation_memory_budget = 0.5`` under Inductor;
- remat at HF checkpointing's measured peak, at 70% and 50% of plain Inductor's measured peak,
  and at its floor: the ``min_budget_bytes`` that the ``BudgetInfeasibleError`` of a 1 kB budget
  names (two steps: a step split at graph breaks refuses it at its second); when the compile at that floor is refused (a later
  graph of the step, or Inductor's check of the code, needs more), again at the budget the
  refusal names (twice at most). A refused budget is recorded as infeasible with the smallest
  budget its error names.

Measured with ``benchmarks/common.Sweep``: the peak above the memory resident at step start
(the largest of ``--peak-rounds`` + 1 measurements), the median step time over ``--reps``
interleaved rounds (every method once per round, rotated) with its interquartile spread, the
machine's 1-minute load at every round, and each method's gradients against plain Inductor's.
What holds remat's floor is read from the floor plan's records (``backend.compiled_graphs``:
the step its predicted peak is reached at, as ``report.md`` says, what it saves and what it
must save) and from the probe's error, which sorts what is live at the smallest peak.
Each model runs with an empty store of remat's measured corrections (``$REMAT_FEEDBACK_DIR``),
as a first run does. Results are rewritten after every model: ``hf_models-<device>.json`` and
``.md`` (+ one ``.png`` per model with matplotlib). Units: bytes and seconds in the JSON; MB
(1 MB = 1e6 bytes) and ms in the tables; 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import os
import shlex
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

import remat
from common import CountingInductor, ModelSpec, Point, Sweep, machine_info, source_info
from pareto import (
    RESULTS_DIR, configure_torch, grads_text, hardware_profile_name, load_average_json, load_average_line, mb, ms,
    pareto_front, pct, point_json, short, source_note, write_plot,
)
from remat.testing import hf_models as hf

MODEL_SEED = 0
FRACTIONS = (0.7, 0.5)           # remat budgets as fractions of plain Inductor's measured peak
PROBE_BUDGET_GB = 1e-6           # 1 kB: below any model's floor
AC_BUDGET = 0.5
GRAD_REL_TOL = 1e-4              # per-parameter relative gradient error above which a method's gradients are wrong
SMOKE_SPECS = {"gpt2": "hf-gpt2-eager", "llama": "hf-llama-sdpa", "qwen2": "hf-qwen2-eager", "bert": "hf-bert-mlm",
               "t5": "hf-t5", "vit": "hf-vit"}   # the corpus's tiny version of each model
SMOKE_DEFAULT_MODELS = ("gpt2",)
ROLE_CKPT, ROLE_FLOOR = "at HF checkpointing's peak", "remat's floor"


@dataclass(frozen=True)
class RunConfig:
    reps: int = 21                   # timing rounds after one warm-up round
    peak_rounds: int = 2             # peak measurements per method before the last interleaved one
    smoke: bool = False


SMOKE = RunConfig(reps=2, peak_rounds=1, smoke=True)


@dataclass(frozen=True)
class Probe:
    """What a 1 kB budget's ``BudgetInfeasibleError`` names (or why there is no answer)."""

    min_budget_bytes: Optional[int] = None      # the smallest budget remat accepts: its floor
    min_feasible_bytes: Optional[int] = None    # the smallest simulated peak the planner reached
    reasons: tuple[str, ...] = ()               # what is live at that peak, largest share first
    error: Optional[str] = None


class HFSweep(Sweep):
    """A ``Sweep`` whose step is ``model(**inputs).loss``: the model computes its own loss from ``labels``."""

    def __init__(self, spec: hf.HFModelSpec, device: torch.device) -> None:
        self.input_names: tuple[str, ...] = ()

        def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
            model, kwargs = hf.build_hf(spec, MODEL_SEED)
            self.input_names = tuple(kwargs)
            return model, tuple(kwargs.values())

        super().__init__(ModelSpec(spec.name, spec.description, build, GRAD_REL_TOL), device)

    def forward_of(self, compiled: Callable[..., Any]) -> Callable[[], torch.Tensor]:
        return lambda: compiled(**dict(zip(self.input_names, self.inputs))).loss


def hf_checkpointed(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules holding the same parameter and buffer objects (gradients land on
    ``model``'s parameters; tied weights stay tied), with HF's non-reentrant per-layer checkpointing on."""
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    variant = copy.deepcopy(model, shared)
    with warnings.catch_warnings():   # transformers 5 calls it a deprecated alias; it is what users call
        warnings.simplefilter("ignore", FutureWarning)
        variant.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not all(a is b for a, b in zip(model.parameters(), variant.parameters())):
        raise RuntimeError("the checkpointed copy does not share the model's parameters")
    return variant


def probe_floor(sweep: HFSweep, hardware: str) -> Probe:
    """Plan at a 1 kB budget; its error names the floor. A single graph is refused by the planner (no
    code generated). A step split at graph breaks runs its first step on provisional plans and
    refuses the budget at the second (``remat/step_budget.py``), once it knows the step's graphs:
    so two steps."""
    backend = remat.backend(PROBE_BUDGET_GB, hardware=hardware)
    try:
        forward = sweep.forward_of(torch.compile(sweep.model, backend=backend))
        for _ in range(2):
            sweep.one_step(forward)
            sweep.model.zero_grad(set_to_none=True)
    except remat.BudgetInfeasibleError as error:
        return Probe(error.min_budget_bytes, error.min_feasible_bytes, tuple(error.reasons))
    except Exception as error:  # noqa: BLE001 - remat's failure is a result; the baselines still get measured
        return Probe(error=f"failed: {type(error).__name__}: {str(error).strip()[:400]}")
    finally:
        sweep.model.zero_grad(set_to_none=True)
    return Probe(error="a 1 kB budget was accepted")


def remat_budgets(plain_peak: int, ckpt: Point, floor: Optional[int]) -> list[tuple[int, list[str]]]:
    """(budget bytes, roles), by increasing budget; roles asking for the same budget share one compile."""
    wanted = [(round(f * plain_peak), f"{f:.0%} of plain Inductor's peak") for f in FRACTIONS]
    wanted += [(ckpt.peak, ROLE_CKPT)] if ckpt.has_peak else []
    wanted += [(floor, ROLE_FLOOR)] if floor is not None else []
    merged: dict[int, list[str]] = {}
    for budget, role in sorted(wanted):
        merged.setdefault(budget, []).append(role)
    return list(merged.items())


def floor_graphs(backend: remat.RematBackend) -> list[dict[str, Any]]:
    """Per graph of the floor plan (its last record: a re-plan replaces it), what its report's peak lines say
    and what the plan had to save."""
    latest: dict[str, Any] = {}
    for record in backend.compiled_graphs:
        latest[record.graph_key or record.graph_id] = record
    out = []
    for record in latest.values():
        plan, judgement = record.plan, record.judgement
        sizes = {d.name: d.bytes for d in plan.decisions}
        forced_kinds: dict[str, int] = {}
        for name, reason in plan.forced:
            kind = reason.split(":")[0]
            forced_kinds[kind] = forced_kinds.get(kind, 0) + sizes.get(name, 0)
        out.append({
            "graph_id": record.graph_id, "peak_step": plan.peak_step_name,
            "predicted_peak_bytes": plan.predicted_peak_bytes,
            "checked_peak_bytes": judgement.checked_peak_bytes if judgement is not None else None,
            "no_remat_peak_bytes": plan.no_remat_peak_bytes, "saved_bytes": plan.saved_bytes,
            "saved_values": len(plan.saved), "forced_values": len(plan.forced),
            "forced_bytes_by_kind": dict(sorted(forced_kinds.items(), key=lambda kv: -kv[1])),
            "recomputed_ops": sum(1 for d in plan.decisions if d.decision == "recompute"),
            "report": os.path.join(record.dump_path, "report.md") if record.dump_path else None,
        })
    return out


def floor_line(probe: Probe, graphs: list[dict[str, Any]], floor_point: Optional[Point]) -> str:
    """One line: the floor, where the floor plan peaks, what it saves, and what is live at the smallest peak."""
    if probe.min_budget_bytes is None:
        return f"no floor: the 1 kB probe {short(probe.error)}"
    accepted = floor_point.budget_bytes if floor_point is not None and not floor_point.error else None
    retried = (f"; compiled at the probe's figure it was refused, and the floor accepted is {mb(accepted)} MB"
               if accepted is not None and accepted != probe.min_budget_bytes else "")
    text = (f"floor {mb(probe.min_budget_bytes)} MB as the 1 kB probe names it{retried} (the smallest simulated peak "
            f"is {mb(probe.min_feasible_bytes)} MB" + "".join(f"; {reason}" for reason in probe.reasons) + "). ")
    if floor_point is not None and floor_point.error:
        return text + f"The floor plan did not run: {short(floor_point.error, 160)}"
    for g in graphs:
        checked = f", Inductor-checked {mb(g['checked_peak_bytes'])} MB" if g["checked_peak_bytes"] is not None else ""
        text += (f"`{g['graph_id']}` peaks at `{g['peak_step']}` (predicted {mb(g['predicted_peak_bytes'])} MB{checked}; "
                 f"no remat {mb(g['no_remat_peak_bytes'])} MB), saves {mb(g['saved_bytes'])} MB in {g['saved_values']} "
                 f"values, {g['forced_values']} of them forced ("
                 + (", ".join(f"{kind} {mb(b)} MB" for kind, b in g["forced_bytes_by_kind"].items()) or "none")
                 + f"); recomputes {g['recomputed_ops']} ops. ")
    return text.strip()


class ModelRun:
    """One model's methods and what is known about them so far."""

    def __init__(self, spec: hf.HFModelSpec, device: torch.device, config: RunConfig) -> None:
        self.spec, self.device, self.config = spec, device, config
        self.started, self.load_start = time.monotonic(), os.getloadavg()
        self.probe = Probe(error="not run")
        self.floor_backend: Optional[remat.RematBackend] = None   # remat's at its floor: what holds the floor
        self.sweep: Optional[HFSweep] = None

    @property
    def points(self) -> list[Point]:
        return self.sweep.points if self.sweep is not None else []

    def run(self, dump_dir: Optional[Path]) -> None:
        """Compile and measure every method; see the module docstring for the order and what is kept."""
        os.environ["REMAT_FEEDBACK_DIR"] = tempfile.mkdtemp(prefix="remat-hf-feedback-")
        sweep = self.sweep = HFSweep(self.spec, self.device)
        print(f"[{self.spec.name}] compiling the baselines", flush=True)
        plain = sweep.add(Point("inductor", "plain Inductor"), sweep.model, CountingInductor())
        ckpt = sweep.add(Point("checkpoint", "HF checkpointing", {"use_reentrant": False}),
                         hf_checkpointed(sweep.model), CountingInductor())
        patches = {"activation_memory_budget": AC_BUDGET}
        sweep.add(Point("ac-budget", f"AC budget {AC_BUDGET}", patches), sweep.model, CountingInductor(patches), patches)
        sweep.measure_peaks(self.config.peak_rounds)
        if not plain.has_peak:
            raise RuntimeError(f"plain Inductor has no measured peak: {plain.error}")
        hardware = hardware_profile_name(self.device)
        self.probe = probe_floor(sweep, hardware)
        first_remat = len(sweep.live)
        for budget, roles in remat_budgets(plain.peak, ckpt, self.probe.min_budget_bytes):
            self.add_remat(budget, roles, hardware, dump_dir)
        self.settle_floor(hardware, dump_dir)
        sweep.measure_peaks(self.config.peak_rounds, sweep.live[first_remat:])
        sweep.measure_peaks(1)                        # one more round of every method, interleaved
        print(f"[{self.spec.name}] timing {len(sweep.live)} methods x {self.config.reps} rounds, interleaved", flush=True)
        sweep.measure_times(self.config.reps)

    def add_remat(self, budget: int, roles: list[str], hardware: str, dump_dir: Optional[Path]) -> Point:
        """Compile remat at ``budget`` bytes (at the floor: with its dump in ``dump_dir``, when given)."""
        assert self.sweep is not None
        print(f"[{self.spec.name}] compiling remat at {mb(budget)} MB ({'; '.join(roles)})", flush=True)
        at_floor = ROLE_FLOOR in roles
        backend = remat.backend(budget / 1e9, hardware=hardware,
                                dump_dir=(dump_dir / self.spec.name) if at_floor and dump_dir else None)
        self.floor_backend = backend if at_floor else self.floor_backend
        return self.sweep.add(Point("remat", f"remat {mb(budget)} MB", {"budget_gb": budget / 1e9, "hardware": hardware},
                                    planned_for=roles), self.sweep.model, backend)

    def settle_floor(self, hardware: str, dump_dir: Optional[Path], tries: int = 2) -> None:
        """When the compile at the probe's floor is refused (a later graph of the step, or Inductor's check of
        the code, needs more), compile again at the budget the refusal names: the floor is the smallest budget
        accepted. The refused point stays in the table under the role ``the 1 kB probe's floor``."""
        for _ in range(tries):
            point = next((p for p in self.points if ROLE_FLOOR in p.planned_for), None)
            if point is None or point.min_budget_bytes is None or not (point.error or "").startswith("infeasible"):
                return
            if point.min_budget_bytes <= round(point.settings["budget_gb"] * 1e9):
                return
            point.planned_for = [r for r in point.planned_for if r != ROLE_FLOOR] + ["the 1 kB probe's floor"]
            self.add_remat(point.min_budget_bytes, [ROLE_FLOOR], hardware, dump_dir)

    def snapshot(self, status: str, error: Optional[str] = None) -> dict[str, Any]:
        sweep = self.sweep
        floor_point = next((p for p in self.points if ROLE_FLOOR in p.planned_for), None)
        floor = floor_graphs(self.floor_backend) if self.floor_backend is not None else []   # after any re-plan
        return {
            "model": self.spec.name, "description": self.spec.description, "status": status, "error": error,
            "wall_s": time.monotonic() - self.started,
            "load_average": load_average_json(self.load_start, sweep.load_average_1min if sweep else [], os.getloadavg()),
            "probe": asdict(self.probe), "floor_graphs": floor,
            "floor_line": floor_line(self.probe, floor, floor_point),
            "points": [point_json(p) for p in self.points],
        }


# ---- what is written -------------------------------------------------------------------------


def ratio(value: float, base: float) -> str:
    return "-" if math.isnan(value) or math.isnan(base) or not base else f"{value / base:.3f}"


def point_row(p: Point, plain: Point) -> str:
    roles = "; ".join(p.planned_for) or "-"
    if not p.measured:
        named = f" (smallest budget accepted: {mb(p.min_budget_bytes)} MB)" if p.min_budget_bytes is not None else ""
        what = "infeasible" + named if (p.error or "").startswith("infeasible") else short(p.error, 160)
        return f"| {p.label} | {roles} | {what} | | | | | | | |"
    plain_step = plain.median("step_s") if plain.measured else math.nan
    return (f"| {p.label} | {roles} | {mb(p.peak)} | {ratio(p.peak, plain.peak) if plain.has_peak else '-'} | "
            f"{ms(p.median('step_s'))} | {ratio(p.median('step_s'), plain_step)} | {pct(p.spread()).lstrip('+')} | "
            f"{grads_text(p)} | {p.compile_s:.1f} | {mb(p.budget_bytes) if p.budget_bytes else '-'} |")


def front_text(points: list[Point]) -> str:
    front = pareto_front([p for p in points if p.measured and p.grad_ok])
    if not front:
        return "no measured point with correct gradients"
    return " → ".join(f"{p.label} ({mb(p.peak)} MB, {ms(p.median('step_s'))} ms)" for p in front)


def render_model(result: dict[str, Any], points: list[Point], png: Optional[Path]) -> list[str]:
    plain = points[0] if points else Point("inductor", "plain Inductor", error="not run")
    remats = sorted((p for p in points if p.method == "remat"), key=lambda p: p.settings["budget_gb"])
    lines = [f"## {result['model']}", "", f"{result['description']}.", "",
             f"- status: **{result['status']}**" + (f": {short(result['error'])}" if result.get("error") else "")
             + f"; {result['wall_s'] / 60:.1f} min", load_average_line(result["load_average"]),
             f"- what holds remat's floor: {result['floor_line']}", "",
             "| method | planned for | peak MB | peak / plain | step ms | step / plain | spread | grads vs plain "
             "| compile s | budget MB |", "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    lines += [point_row(p, plain) for p in [p for p in points if p.method != "remat"] + remats]
    lines += ["", "Pareto front (peak vs median step time; no other point with correct gradients is both smaller "
              "and faster), by increasing peak: " + front_text(points) + "."]
    lines += [f"Plot: `{png.name}`." if png else "(No plot: matplotlib is not installed; the table is the picture.)", ""]
    return lines


def render(run_info: dict[str, Any], models: list[tuple[dict[str, Any], list[Point], Optional[Path]]]) -> str:
    m, settings = run_info["machine"], run_info["settings"]
    lines = ["# Hugging Face models: remat next to plain Inductor, HF checkpointing and activation_memory_budget", ""]
    if settings["smoke"] or run_info.get("note"):
        smoke = (f"Smoke run (the corpus's tiny models, {settings['reps']} timing rounds): not the benchmark's figures."
                 if settings["smoke"] else "")
        lines += ["**" + " ".join(filter(None, [smoke, run_info.get("note")])) + "**", ""]
    lines += [
        f"- command: `{run_info['command']}`; {run_info['date_utc']} UTC; environment "
        + (", ".join(f"{k}={v}" for k, v in run_info["environment"].items() if v is not None) or "-"),
        f"- machine: {m['host']}, {m['processor']}, {m['cpu_count']} CPUs, {m['torch_threads']} torch threads; "
        f"torch {m['torch']}, transformers {run_info['transformers']}, Python {m['python']}",
        f"- source: commit {run_info['source']['commit'][:12]}" + source_note(run_info["source"]),
        "- peak: memory allocated during one forward + backward above what was resident at step start (CPU "
        f"profiler), the largest of {settings['peak_rounds'] + 1} measurements; MB = 1e6 bytes",
        f"- step time: median over {settings['reps']} interleaved rounds (one step of every method per round, "
        "rotated); spread = interquartile range / median (needs 4 rounds); ratios are to plain Inductor's",
        f"- grads: largest per-parameter relative error against plain Inductor's (same seed); wrong when >= "
        f"{settings['grad_rel_tol']:g}",
        "- remat's floor: the smallest budget it accepts, as a 1 kB budget's BudgetInfeasibleError names it; "
        "a refused budget shows the smallest one its error names", ""]
    for result, points, png in models:
        lines += render_model(result, points, png)
    return "\n".join(lines)


def write_results(out_dir: Path, run_info: dict[str, Any], models: list[tuple[dict[str, Any], list[Point]]],
                  plot: bool) -> list[Path]:
    """Rewrite the JSON and markdown with every model so far (and each model's plot, with matplotlib)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"hf_models-{run_info['machine']['device'].split(':')[0]}"
    pngs = [write_plot(out_dir / f"{stem}-{r['model']}.png", {**r, "device": run_info["machine"]["device"],
                                                              "torch": torch.__version__, "machine": run_info["machine"]},
                       points) if plot and points else None for r, points in models]
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps({**run_info, "models": [r for r, _ in models]}, indent=1, default=str) + "\n")
    md_path.write_text(render(run_info, [(r, points, png) for (r, points), png in zip(models, pngs)]))
    return [json_path, md_path] + [png for png in pngs if png]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=None, help=f"comma-separated, from {list(SMOKE_SPECS)} (default: all; "
                        f"with --smoke: {','.join(SMOKE_DEFAULT_MODELS)})")
    parser.add_argument("--smoke", action="store_true",
                        help="the corpus's tiny models, 2 timing rounds, 2 peak measurements")
    parser.add_argument("--reps", type=int, default=None,
                        help=f"timing rounds (default {RunConfig.reps}; smoke {SMOKE.reps})")
    parser.add_argument("--peak-rounds", type=int, default=None, help="peak measurements before the last interleaved one "
                        f"(default {RunConfig.peak_rounds}; smoke {SMOKE.peak_rounds})")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default 1; see pareto.py)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help="default benchmarks/results (smoke: /tmp/remat-hf-smoke)")
    parser.add_argument("--dump-dir", type=Path, default=None,
                        help="write the floor plan's dump (report.md) here, per model")
    parser.add_argument("--note", default="", help="a line for the results' header (e.g. that this is a check run)")
    args = parser.parse_args(argv)
    names = args.models.split(",") if args.models else list(SMOKE_DEFAULT_MODELS if args.smoke else SMOKE_SPECS)
    unknown = [n for n in names if n not in SMOKE_SPECS]
    if unknown:
        parser.error(f"--models={args.models!r}: unknown {unknown}; choose from {list(SMOKE_SPECS)}")
    base = SMOKE if args.smoke else RunConfig()
    args.config = RunConfig(reps=args.reps or base.reps, peak_rounds=args.peak_rounds or base.peak_rounds, smoke=args.smoke)
    args.names = names
    args.out_dir = args.out_dir or (Path("/tmp/remat-hf-smoke") if args.smoke else RESULTS_DIR)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    reason = hf.available()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    import transformers

    device = torch.device("cpu")
    configure_torch(device, args.threads)
    specs = {s.name: s for s in (hf.hf_specs() if args.smoke else hf.benchmark_specs())}
    run_info = {"benchmark": "hf_models", "command": shlex.join(["python"] + sys.argv), "note": args.note,
                "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "machine": machine_info(device),
                "source": source_info(), "transformers": transformers.__version__,
                "environment": {k: os.environ.get(k) for k in ("PYTHONHASHSEED", "TORCHINDUCTOR_COMPILE_THREADS")},
                "settings": {**asdict(args.config), "grad_rel_tol": GRAD_REL_TOL,
                             "fractions_of_plain_peak": FRACTIONS, "ac_budget": AC_BUDGET, "model_seed": MODEL_SEED},
                "units": "bytes and seconds; 1 GB = 1e9 bytes"}
    done: list[tuple[dict[str, Any], list[Point]]] = []
    for name in args.names:
        run = ModelRun(specs[SMOKE_SPECS[name] if args.smoke else name], device, args.config)
        try:
            run.run(args.dump_dir)
            result = run.snapshot("complete")
        except Exception as error:  # noqa: BLE001 - what was measured before the failure is still written
            print(f"[{name}] failed:\n{traceback.format_exc()}", flush=True)
            result = run.snapshot("failed", f"{type(error).__name__}: {error}")
        result["model"] = name
        done.append((result, run.points))
        paths = write_results(args.out_dir, run_info, done, plot=True)
        print("\n".join(render_model(result, run.points, None)) + "\nwrote " + ", ".join(map(str, paths)), flush=True)
    return 0 if all(r["status"] == "complete" for r, _ in done) else 1


if __name__ == "__main__":
    sys.exit(main())
