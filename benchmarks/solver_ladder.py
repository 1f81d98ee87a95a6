"""Does the greedy's plan get cheaper when its descent also aims under the target? A corpus nobody tuned to.

    python benchmarks/solver_ladder.py                        # corpus seeds 1000-1011, CNNs, HF models
    python benchmarks/solver_ladder.py --seeds 1160-1169 --targets 8 --out /tmp/ladder

The default solver (``remat/passes/solve_greedy.py``) descends from each start towards the
planning target and keeps the cheapest plan. Its result is not monotone in the target: aimed a
little lower, a descent can end on a far cheaper plan (a plan that meets a lower target meets the
target). ``solve_greedy(..., rungs=N)`` also aims each descent ``N`` rungs (1/32 of the target each)
lower. This benchmark measures what the rungs buy and cost, per joint graph and target:

- each corpus model (``remat.testing.corpus``: random nets of the given seeds, the CNNs, the
  Hugging Face models when ``transformers`` is installed) is traced once as torch.compile with
  Inductor would trace it, without generating code (``remat.pipeline.trace_joint_facts``, CPU profile);
- targets: ``--targets`` evenly spaced between the smallest simulated peak the greedy reaches and
  the no-remat simulated peak (both ends left out);
- per target, ``solve_greedy`` with ``rungs=0`` (the descent aimed at the target only: the solver
  before the rungs) and with ``rungs=LADDER_RUNGS`` (the default), from the starts the planner gives
  it (``passes.plan.solver_starts``): the estimated extra time of the plan (the cost model's, the
  number the solver minimises), its simulated peak, the simulations and the wall time.

Reported: the distribution over (graph, target) points of ladder / base extra time, how many
points the rungs made cheaper, equal, dearer; how often the base was not monotone (a lower target
of the same graph got a cheaper plan than a higher one); and the plan-time ratio. Estimated time
only: whether estimates match measured steps is ``benchmarks/hf_models.py``'s and
``benchmarks/pareto_sweep.py``'s question. Results: ``<out>/solver_ladder-cpu.{jsonl,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

import remat
from remat.passes.mincut import min_cut_saved
from remat.passes.plan import solver_starts
from remat.passes.solve_context import SearchContext
from remat.passes.solve_greedy import LADDER_RUNGS, smallest_peak_plan, solve_greedy
from remat.pipeline import trace_joint_facts
from remat.simulator import evaluate
from remat.testing import corpus
from fidelity import parse_seeds    # run as a script: benchmarks/ is sys.path[0]
from fidelity_report import quantile

RESULTS = Path(__file__).resolve().parent / "results"
MIN_EXTRA_S = 1e-9        # a ratio's denominator floor (a plan with no extra time)


def traced(entry: corpus.CorpusEntry) -> list[Any]:
    """The joint graphs' facts of one corpus model, compiled as the corpus compiles it (the model
    alone: a Hugging Face model computes its loss inside, the others' loss runs outside)."""
    built = entry.build()

    def step(*inputs: torch.Tensor) -> Any:
        return built.model(*inputs, **built.kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trace_joint_facts(step, built.inputs, hardware="cpu")


def solve(facts: Any, target: int, starts: tuple, save_all: Any, rungs: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    result = solve_greedy(facts, target, starts, save_all, rungs=rungs)
    seconds = time.perf_counter() - t0
    plan = result.plan
    return {"extra_time_s": None if plan is None else plan.extra_time_s,
            "peak_bytes": None if plan is None else plan.peak_bytes,
            "evaluations": result.evaluations, "seconds": seconds}


def graph_points(name: str, index: int, facts: Any, targets: int, rungs: int) -> list[dict[str, Any]]:
    save_all = evaluate(facts, SearchContext(facts).save_all())
    starts = solver_starts(facts, evaluate(facts, min_cut_saved(facts)))
    floor = smallest_peak_plan(facts, starts)[0].peak_bytes
    top = save_all.peak_bytes
    rows = []
    if top <= floor:
        return rows
    for k in range(1, targets + 1):
        target = floor + (top - floor) * k // (targets + 1)
        base = solve(facts, target, starts, save_all, 0)
        ladder = solve(facts, target, starts, save_all, rungs)
        rows.append({"model": name, "graph": index, "nodes": len(facts.order), "target_bytes": target,
                     "floor_bytes": floor, "no_remat_bytes": top, "base": base, "ladder": ladder})
    return rows


def not_monotone(rows: list[dict[str, Any]]) -> int:
    """Points of one graph where a lower target's base plan was cheaper than this target's."""
    count, best_below = 0, None
    for row in sorted(rows, key=lambda r: r["target_bytes"]):
        extra = row["base"]["extra_time_s"]
        if extra is not None and best_below is not None and best_below < extra - 1e-12:
            count += 1
        if extra is not None:
            best_below = extra if best_below is None else min(best_below, extra)
    return count


def summary(rows: list[dict[str, Any]], rungs: int) -> list[str]:
    both = [r for r in rows if r["base"]["extra_time_s"] is not None and r["ladder"]["extra_time_s"] is not None]
    ratios = [max(r["ladder"]["extra_time_s"], MIN_EXTRA_S) / max(r["base"]["extra_time_s"], MIN_EXTRA_S) for r in both]
    cheaper = sum(1 for r in both if r["ladder"]["extra_time_s"] < r["base"]["extra_time_s"] - 1e-12)
    dearer = sum(1 for r in both if r["ladder"]["extra_time_s"] > r["base"]["extra_time_s"] + 1e-12)
    only_ladder = sum(1 for r in rows if r["base"]["extra_time_s"] is None and r["ladder"]["extra_time_s"] is not None)
    only_base = sum(1 for r in rows if r["ladder"]["extra_time_s"] is None and r["base"]["extra_time_s"] is not None)
    graphs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        graphs.setdefault((r["model"], r["graph"]), []).append(r)
    unmonotone = sum(not_monotone(g) for g in graphs.values())
    time_ratio = [r["ladder"]["seconds"] / max(r["base"]["seconds"], 1e-9) for r in rows]
    base_s = sum(r["base"]["seconds"] for r in rows)
    ladder_s = sum(r["ladder"]["seconds"] for r in rows)
    lines = [f"- points (graph, target): {len(rows)} on {len(graphs)} joint graphs of "
             f"{len({r['model'] for r in rows})} models; rungs: {rungs}"]
    if ratios:
        lines += [f"- estimated extra time, ladder / base: median {statistics.median(ratios):.3f}, "
                  f"p05 {quantile(ratios, 0.05):.3f}, best {min(ratios):.3f}, p95 {quantile(ratios, 0.95):.3f}, "
                  f"worst {max(ratios):.3f}",
                  f"- the rungs made the plan cheaper on {cheaper} of {len(both)} points, dearer on {dearer} "
                  "(the local search runs from a different plan), equal on the rest"]
    lines += [f"- a plan only with the rungs: {only_ladder}; only without: {only_base}",
              f"- the base was not monotone (a lower target of the same graph got a cheaper plan) on "
              f"{unmonotone} of {len(rows)} points",
              f"- solve time, ladder / base per point: median {statistics.median(time_ratio):.2f}, "
              f"p95 {quantile(time_ratio, 0.95):.2f}, worst {max(time_ratio):.2f}; in all {ladder_s:.1f} s vs "
              f"{base_s:.1f} s" if rows else "- no points"]
    return lines


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | graph | nodes | target MB | base extra ms | ladder extra ms | ratio | base sims | ladder sims | base s | ladder s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ms(v: Optional[float]) -> str:
        return "-" if v is None else f"{v * 1e3:.3f}"

    for r in rows:
        b, l = r["base"], r["ladder"]
        ratio = "-" if b["extra_time_s"] is None or l["extra_time_s"] is None else \
            f"{max(l['extra_time_s'], MIN_EXTRA_S) / max(b['extra_time_s'], MIN_EXTRA_S):.3f}"
        lines.append(f"| {r['model']} | {r['graph']} | {r['nodes']} | {r['target_bytes'] / 1e6:.3f} | {ms(b['extra_time_s'])} | "
                     f"{ms(l['extra_time_s'])} | {ratio} | {b['evaluations']} | {l['evaluations']} | "
                     f"{b['seconds']:.2f} | {l['seconds']:.2f} |")
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("1000-1011"), help="random-net seeds, e.g. 1000-1011")
    parser.add_argument("--no-cnns", action="store_true")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--only", nargs="*", default=None, help="only these corpus names")
    parser.add_argument("--targets", type=int, default=6, help="targets per joint graph")
    parser.add_argument("--rungs", type=int, default=LADDER_RUNGS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    entries = corpus.entries(args.seeds, include_cnns=not args.no_cnns, include_hf=not args.no_hf)
    if args.only:
        entries = [e for e in entries if e.name in set(args.only)]
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "solver_ladder-cpu.jsonl"
    rows: list[dict[str, Any]] = []
    load_start = os.getloadavg()
    with jsonl.open("w") as out:
        for entry in entries:
            t0 = time.perf_counter()
            try:
                graphs = traced(entry)
            except Exception as error:  # noqa: BLE001 - a model that cannot be traced is reported, not fatal
                print(f"{entry.name}: trace failed: {type(error).__name__}: {error}", flush=True)
                continue
            for index, facts in enumerate(graphs):
                for row in graph_points(entry.name, index, facts, args.targets, args.rungs):
                    rows.append(row)
                    out.write(json.dumps(row) + "\n")
            print(f"{entry.name}: {len(graphs)} graph(s), {time.perf_counter() - t0:.1f} s", flush=True)
    command = "python benchmarks/solver_ladder.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = ["# The greedy's ladder of aims: estimated extra time with and without (CPU profile)", "",
          f"- command: `{command}`; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; torch {torch.__version__}, "
          f"remat from {Path(remat.__file__).parent}",
          f"- load average (1/5/15 min) at the start {load_start[0]:.2f}/{load_start[1]:.2f}/{load_start[2]:.2f}, "
          f"at the end {'/'.join(f'{v:.2f}' for v in os.getloadavg())} (solve times are wall clock)",
          "- extra time: the cost model's estimate of the plan's recomputation (what the solver minimises), "
          "not a measured step", "", "## Distribution", "", *summary(rows, args.rungs), "", "## Points", "", *table(rows), ""]
    (args.out / "solver_ladder-cpu.md").write_text("\n".join(md))
    print("\n".join(summary(rows, args.rungs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
