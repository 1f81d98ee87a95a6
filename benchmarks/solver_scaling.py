"""How planning time grows with the graph, and how far the greedy is from the exact optimum.

    python benchmarks/solver_scaling.py                 # GPT 2/12/48 layers -> results/solver_scaling.{json,md}
    python benchmarks/solver_scaling.py --layers 2 12 48 116   # and ~20k nodes (the committed results)
    python benchmarks/solver_scaling.py --layers 2 12   # a subset
    python benchmarks/solver_scaling.py --gap           # greedy vs MILP -> results/solver_scaling_gap.{json,md}

Scaling: the zoo's GPT (``remat/testing/zoo.py``, default config, batch 8) with 2, 12 and 48
layers, traced once to its AOTAutograd joint graph with ``aot_module`` (no Inductor), prepared
as the backend prepares it (dead code out, dropout split), costed on the H100 datasheet
profile (deterministic). Timed, each on its own: ``annotate_costs``, ``read_joint_graph``,
the no-remat simulation, ``min_cut_saved``, ``solve_greedy`` (the default solver, from saving
everything and from the min-cut) to a target of 60% of the no-remat simulated peak, and
``make_plan`` end to end (best_effort, so an infeasible target still times the full search).
Every part is timed cold, on its own reading of the joint graph (the planner memoises per
graph: timing ``make_plan`` after the solver ran on the same graph once hid half its cost),
in wall-clock seconds, with ``make_plan``'s CPU seconds and the 1-minute load average beside
it (the machine is shared: wall time under load overstates what the planner costs).
The growth exponent is the slope of a least-squares fit of log(time) on log(nodes). The largest graph's ``make_plan`` is profiled
with cProfile. One real ``torch.compile(..., backend=remat.backend(...))`` of the 2-layer model
(forward + backward) gives Inductor's compile time for comparison.

Gap: on small graphs (the MLP and attention graphs of ``tests/test_solvers.py``, a 1-layer
GPT, and random graphs) the greedy (``make_plan``) against the MILP optimum
(``solve_milp.solve_min_time``) at budgets spread between the smallest peak the MILP can
reach and the no-remat peak. Units: bytes and seconds in the JSON; MB (1e6 bytes) and ms in
the tables.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import pstats
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import remat
from remat.cost_model import annotate_costs, get_profile
from remat.errors import BudgetInfeasibleError
from remat.simulator import schedule as schedule_module
from remat.passes import plan as plan_module
from remat.passes.solve_greedy import solve_greedy
from remat.passes.joint_graph import JointGraphFacts, read_joint_graph
from remat.passes.mincut import min_cut_saved
from remat.passes.random_ops import split_dropout_outputs
from remat.passes.solve_exhaustive import best_under, enumerate_plans, exhaustive_candidates
from remat.passes.solve_milp import solve_min_time
from common import machine_info, source_info
from remat.testing.zoo import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BATCH = 8
TARGET_FRACTION = 0.6
PROFILE = "h100"
TARGETS_S = {2_000: 1.0, 20_000: 5.0}     # issue 4: planning time at ~2k and ~20k nodes
EXHAUSTIVE_CHECK = 12                      # --gap: also enumerate graphs with at most this many candidates


def trace_joint(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.fx.GraphModule, int, float]:
    """The joint graph AOTAutograd hands a partitioner, and the seconds tracing took."""
    from torch._functorch.aot_autograd import aot_module
    from torch._functorch.partitioners import default_partition

    captured: list[tuple[torch.fx.GraphModule, int]] = []

    def capture(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        captured.append((joint, num_fwd_outputs))
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    t0 = time.perf_counter()
    compiled = aot_module(model, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=capture)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(*inputs)
    return captured[-1][0], captured[-1][1], time.perf_counter() - t0


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


class CountEvaluations:
    """Counts ``evaluate`` calls (each closes a partition and simulates it) while active: it
    counts the ``schedule.simulate_partition`` calls ``evaluate.evaluate`` makes, whoever calls it."""

    def __enter__(self) -> "CountEvaluations":
        self.calls = 0
        self._original = schedule_module.simulate_partition

        def counting(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)

        schedule_module.simulate_partition = counting
        return self

    def __exit__(self, *exc) -> None:
        schedule_module.simulate_partition = self._original


def gpt(n_layers: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=n_layers)
    return GPT(cfg), (torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len)),)


def measure_layers(n_layers: int, profile_plan: bool) -> dict[str, Any]:
    model, inputs = gpt(n_layers)
    joint, num_fwd_outputs, trace_s = trace_joint(model, inputs)
    graph = joint.graph
    graph.eliminate_dead_code()
    split_dropout_outputs(graph)
    joint.recompile()
    costs, cost_s = timed(lambda: annotate_costs(graph, get_profile(PROFILE)))
    facts, read_s = timed(lambda: read_joint_graph(graph, costs, num_fwd_outputs))
    # the target comes from a separate reading of the graph, so make_plan below is timed cold:
    # the planner's per-graph memos (kernel kinds, rebuild decisions) start empty, as in the backend
    probe = read_joint_graph(graph, costs, num_fwd_outputs)
    target = int(plan_module.evaluate(probe, plan_module._save_all(probe)).simulation.peak_bytes * TARGET_FRACTION)
    load_before = os.getloadavg()[0]
    with CountEvaluations() as plan_count:
        cpu0 = time.process_time()
        plan, plan_s = timed(lambda: plan_module.make_plan(facts, target, best_effort=True))
        plan_cpu_s = time.process_time() - cpu0
    facts = read_joint_graph(graph, costs, num_fwd_outputs)   # each part below timed cold too
    with plan_module._cyclic_gc_paused():   # as make_plan runs them
        # the min-cut first: it is worked out once per graph, and the first simulation asks for it
        mincut_saved, mincut_s = timed(lambda: min_cut_saved(facts))
        save_all = plan_module._save_all(facts)
        no_remat, no_remat_s = timed(lambda: plan_module.evaluate(facts, save_all))
        mincut, mincut_eval_s = timed(lambda: plan_module.evaluate(facts, mincut_saved))
        with CountEvaluations() as greedy_count:
            result, greedy_s = timed(lambda: solve_greedy(facts, target, starts=(mincut,), save_all=no_remat))
    greedy = result.plan if result.plan is not None else mincut
    row: dict[str, Any] = {
        "n_layers": n_layers,
        "nodes": len(facts.order),
        "forward_nodes": sum(1 for n in facts.nodes.values() if n.role == "forward"),
        "backward_nodes": sum(1 for n in facts.nodes.values() if n.role == "backward"),
        "trace_s": trace_s,
        "annotate_costs_s": cost_s,
        "read_joint_graph_s": read_s,
        "simulate_no_remat_s": no_remat_s,
        "min_cut_s": mincut_s,
        "simulate_min_cut_s": mincut_eval_s,
        "greedy_s": greedy_s,
        "greedy_evaluations": greedy_count.calls,
        "greedy_drops": len(result.dropped),
        "greedy_fits": result.plan is not None,
        "make_plan_s": plan_s,
        "make_plan_cpu_s": plan_cpu_s,
        "load_average_1min": load_before,
        "make_plan_evaluations": plan_count.calls,
        "planning_total_s": cost_s + read_s + plan_s,
        "no_remat_peak_bytes": no_remat.simulation.peak_bytes,
        "min_cut_peak_bytes": mincut.simulation.peak_bytes,
        "target_bytes": target,
        "greedy_peak_bytes": greedy.simulation.peak_bytes,
        "plan_peak_bytes": plan.predicted_peak_bytes,
        "plan_fits": plan.fits_budget,
        "plan_extra_time_s": plan.est_extra_time_s,
        "plan_solver": plan.solver,
    }
    if profile_plan:
        facts = read_joint_graph(graph, costs, num_fwd_outputs)
        profiler = cProfile.Profile()
        profiler.enable()
        plan_module.make_plan(facts, target, best_effort=True)
        profiler.disable()
        row["profile"] = profile_rows(profiler)
    return row


def profile_rows(profiler: cProfile.Profile, top: int = 15) -> list[dict[str, Any]]:
    stats = pstats.Stats(profiler, stream=io.StringIO())
    rows = []
    for (filename, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = filename.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        rows.append({"function": f"{where}:{line}({func})", "calls": calls, "tottime_s": tottime, "cumtime_s": cumtime})
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:top]


def growth_exponent(rows: list[dict[str, Any]], key: str) -> Optional[float]:
    points = [(math.log(r["nodes"]), math.log(r[key])) for r in rows if r.get(key, 0) > 0]
    if len(points) < 2:
        return None
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def inductor_compile_seconds(n_layers: int, budget_bytes: int) -> dict[str, Any]:
    """One torch.compile with remat's backend: the first forward + backward, which compiles both graphs."""
    model, inputs = gpt(n_layers)
    torch._dynamo.reset()
    backend = remat.backend(budget_gb=budget_bytes / 1e9, hardware=PROFILE, best_effort=True)
    compiled = torch.compile(model, backend=backend)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled(*inputs).float().sum().backward()
    seconds = time.perf_counter() - t0
    torch._dynamo.reset()
    plans = [{"graph": g.graph_id, "plan_time_s": g.plan.plan_time_s}
             for g in backend.compiled_graphs]
    return {"n_layers": n_layers, "budget_bytes": budget_bytes, "compile_and_first_step_s": seconds, "plans": plans}


# -- the gap ----------------------------------------------------------------------------------------

def gap_graphs() -> dict[str, Callable[[], JointGraphFacts]]:
    import test_solvers as ts

    graphs: dict[str, Callable[[], JointGraphFacts]] = {name: (lambda n=name: ts.captured(n)) for name in
                                                        ("mlp2", "mlp3", "mlp_dropout", "attention")}

    def gpt1() -> JointGraphFacts:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=1, dropout=0.0)
        joint, n, _ = trace_joint(GPT(cfg), (torch.randint(0, 64, (4, 32)),))
        joint.graph.eliminate_dead_code()
        split_dropout_outputs(joint.graph)
        joint.recompile()
        return read_joint_graph(joint.graph, annotate_costs(joint.graph, get_profile(PROFILE)), n)

    graphs["gpt1"] = gpt1
    for seed in range(20):
        graphs[f"random{seed}"] = lambda s=seed: ts.random_facts(s, 12)
    return graphs


def measure_gap(time_limit_s: float, budgets_per_graph: int) -> list[dict[str, Any]]:
    rows = []
    for name, make in gap_graphs().items():
        facts = make()
        top = plan_module.evaluate(facts, plan_module._save_all(facts)).simulation.peak_bytes
        # the smallest peak known to be reachable: saving nothing, or the greedy's smallest
        low = min(top, plan_module.evaluate(facts, frozenset()).simulation.peak_bytes,
                  plan_module.make_plan(facts, 1, best_effort=True).predicted_peak_bytes)
        steps = budgets_per_graph - 1
        targets = sorted({int(low + (top - low) * i / steps) for i in range(budgets_per_graph)}, reverse=True)
        points = None
        if len(exhaustive_candidates(facts)) <= EXHAUSTIVE_CHECK:
            points = enumerate_plans(facts, max_candidates=EXHAUSTIVE_CHECK)
        for target in targets:
            try:
                greedy = plan_module.make_plan(facts, target)
                greedy_s: Optional[float] = greedy.est_extra_time_s
                start = set(greedy.saved) - {n for n, _ in greedy.forced}
            except BudgetInfeasibleError:
                greedy_s, start = None, None
            exact = solve_min_time(facts, target, time_limit_s=time_limit_s, start=start)
            rows.append({
                "graph": name, "nodes": len(facts.order), "target_bytes": target,
                "milp_status": exact.status, "milp_extra_time_s": exact.est_extra_time_s,
                "milp_lower_bound_s": exact.lower_bound_s if math.isfinite(exact.lower_bound_s) else None,
                "milp_solve_s": exact.solve_time_s, "milp_memory_model": exact.memory_model,
                "greedy_extra_time_s": greedy_s,
                "gap": gap(greedy_s, exact.est_extra_time_s) if exact.status == "optimal" else None,
            })
            if points is not None:   # ground truth where enumeration is cheap
                truth = best_under(points, target)
                rows[-1]["exhaustive_extra_time_s"] = truth.est_extra_time_s if truth else None
            print(json.dumps(rows[-1]), flush=True)
    return rows


def gap(greedy_s: Optional[float], optimum_s: Optional[float]) -> Optional[float]:
    """Relative extra time of the greedy over the optimum; inf when the greedy fails a feasible target."""
    if optimum_s is None:
        return None
    if greedy_s is None:
        return math.inf
    if optimum_s == 0:
        return 0.0 if greedy_s == 0 else math.inf
    return greedy_s / optimum_s - 1


# -- reports ----------------------------------------------------------------------------------------

def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def scaling_markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    lines = [
        "# Planning time vs graph size (GPT joint graphs)",
        "",
        f"Command: `{result['command']}`. Machine: {result['machine']['processor']}, "
        f"{result['machine']['cpu_count']} cores (shared with other engineers' compiles), "
        f"torch {result['machine']['torch']}, commit {result['source']['commit'][:10]}.",
        f"Graphs: remat/testing/zoo.py GPT, default config, batch {BATCH}, traced with aot_module (no Inductor); "
        f"costs from the {PROFILE} datasheet profile; target = {TARGET_FRACTION:.0%} of the no-remat simulated peak.",
        "",
        "| layers | nodes | annotate_costs ms | read_joint_graph ms | no-remat sim ms | min-cut ms | greedy ms "
        "(evaluations) | make_plan ms (evaluations) | make_plan CPU ms | load | planning total ms | target MB | "
        "plan peak MB | fits | plan extra time us |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['n_layers']} | {r['nodes']} | {ms(r['annotate_costs_s'])} | {ms(r['read_joint_graph_s'])} | "
            f"{ms(r['simulate_no_remat_s'])} | {ms(r['min_cut_s'])} | "
            f"{ms(r['greedy_s'])} ({r['greedy_evaluations']}) | "
            f"{ms(r['make_plan_s'])} ({r['make_plan_evaluations']}) | {ms(r.get('make_plan_cpu_s', math.nan))} | "
            f"{r.get('load_average_1min', math.nan):.1f} | {ms(r['planning_total_s'])} | "
            f"{r['target_bytes'] / 1e6:.2f} | {r['plan_peak_bytes'] / 1e6:.2f} | {'yes' if r['plan_fits'] else 'no'} | "
            f"{r['plan_extra_time_s'] * 1e6:.1f} |"
        )
    lines += ["", "Growth exponent (time ~ nodes^k, least squares on log-log):", ""]
    for key, k in result["exponents"].items():
        lines.append(f"- {key}: k = {k:.2f}" if k is not None else f"- {key}: n/a")
    targets = "; ".join(f"<= {s:g} s at ~{n:,} nodes" for n, s in TARGETS_S.items())
    lines += ["", f"Targets (issue 4): {targets}.", ""]
    for line in result["verdicts"]:
        lines.append(f"- {line}")
    k = result["exponents"].get("planning_total_s")
    if k is not None and rows:
        last = max(rows, key=lambda r: r["nodes"])
        for nodes, limit in TARGETS_S.items():
            if nodes <= last["nodes"]:
                continue
            predicted = last["planning_total_s"] * (nodes / last["nodes"]) ** k
            lines.append(f"- extrapolated from {last['nodes']} nodes with k = {k:.2f}: ~{predicted:.1f} s "
                         f"at {nodes:,} nodes (target {limit:g} s)")
    if result.get("inductor"):
        ind = result["inductor"]
        inside = ", ".join(f"{p['graph']} {ms(p['plan_time_s'])} ms" for p in ind["plans"])
        lines += ["", f"Inductor: `torch.compile(GPT {ind['n_layers']} layers, backend=remat.backend(...))`, "
                  f"first forward + backward (compiles both graphs): {ind['compile_and_first_step_s']:.1f} s; "
                  f"remat's planning inside it: {inside}."]
    prof = next((r for r in reversed(rows) if "profile" in r), None)
    if prof:
        lines += ["", f"## Where make_plan's time goes ({prof['n_layers']} layers, cProfile, top by own time)", "",
                  "| function | calls | own s | cumulative s |", "|---|---:|---:|---:|"]
        for p in prof["profile"]:
            lines.append(f"| `{p['function']}` | {p['calls']} | {p['tottime_s']:.3f} | {p['cumtime_s']:.3f} |")
    return "\n".join(lines) + "\n"


def gap_markdown(result: dict[str, Any]) -> str:
    rows = result["rows"]
    solved = [r for r in rows if r["milp_status"] == "optimal"]
    finite = sorted(r["gap"] for r in solved if r["gap"] is not None and math.isfinite(r["gap"]))
    failed = [r for r in solved if r["gap"] is not None and not math.isfinite(r["gap"])]
    within = [r for r in solved if r["gap"] is not None and r["gap"] <= 0.02 + 1e-12]
    checked = [r for r in rows if "exhaustive_extra_time_s" in r]
    disagree = [
        r for r in checked
        if (r["exhaustive_extra_time_s"] is None) != (r["milp_extra_time_s"] is None)
        or (r["milp_status"] == "optimal" and abs(r["exhaustive_extra_time_s"] - r["milp_extra_time_s"]) > 1e-12)
    ]

    def q(p: float) -> str:
        return f"{100 * finite[min(len(finite) - 1, int(p * len(finite)))]:.1f}%" if finite else "n/a"

    lines = [
        "# Greedy vs MILP optimum (estimated extra time)",
        "",
        f"Command: `{result['command']}`. Machine: {result['machine']['processor']}, "
        f"torch {result['machine']['torch']}, commit {result['source']['commit'][:10]}. "
        f"MILP time limit {result['time_limit_s']:g} s per target.",
        "",
        f"- (graph, target) pairs: {len(rows)}; MILP proved optimal: {len(solved)}; infeasible: "
        f"{sum(r['milp_status'] == 'infeasible' for r in rows)}; "
        f"time limit: {sum(r['milp_status'] == 'time_limit' for r in rows)}.",
        f"- Greedy within 2% of the optimum: {len(within)} of {len(solved)}; greedy raised BudgetInfeasibleError "
        f"where a plan exists (or spent time where the optimum spends none): {len(failed)}.",
        f"- Gap (greedy / optimum - 1) over the {len(finite)} finite cases: "
        f"median {q(0.5)}, p90 {q(0.9)}, max {q(1.0)}.",
        f"- MILP checked against exhaustive enumeration on {len(checked)} pairs: {len(disagree)} disagree.",
        "",
        "| graph | nodes | target MB | MILP | optimum us | greedy us | gap |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        opt = "" if r["milp_extra_time_s"] is None else f"{r['milp_extra_time_s'] * 1e6:.2f}"
        gr = "raises" if r["greedy_extra_time_s"] is None else f"{r['greedy_extra_time_s'] * 1e6:.2f}"
        g = "" if r["gap"] is None else ("inf" if not math.isfinite(r["gap"]) else f"{100 * r['gap']:.1f}%")
        lines.append(f"| {r['graph']} | {r['nodes']} | {r['target_bytes'] / 1e6:.4f} | {r['milp_status']} "
                     f"({r['milp_solve_s']:.1f} s) | {opt} | {gr} | {g} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 12, 48])
    parser.add_argument("--no-inductor", action="store_true", help="skip the real torch.compile of the 2-layer model")
    parser.add_argument("--gap", action="store_true", help="measure the greedy's gap to the MILP optimum instead")
    parser.add_argument("--time-limit", type=float, default=60.0, help="MILP seconds per target (--gap)")
    parser.add_argument("--budgets", type=int, default=6, help="targets per graph (--gap)")
    parser.add_argument("--render", action="store_true", help="rewrite the .md tables from the results JSON")
    args = parser.parse_args()
    if args.render:
        for stem, render in (("solver_scaling", scaling_markdown), ("solver_scaling_gap", gap_markdown)):
            path = RESULTS_DIR / f"{stem}.json"
            if path.exists():
                (RESULTS_DIR / f"{stem}.md").write_text(render(json.loads(path.read_text())))
        return
    torch.set_num_threads(1)
    common = {"command": "python benchmarks/solver_scaling.py " + " ".join(sys.argv[1:]),
              "machine": machine_info(torch.device("cpu")), "source": source_info()}
    RESULTS_DIR.mkdir(exist_ok=True)
    if args.gap:
        result = dict(common, time_limit_s=args.time_limit, rows=measure_gap(args.time_limit, args.budgets))
        (RESULTS_DIR / "solver_scaling_gap.json").write_text(json.dumps(result, indent=1, default=str))
        (RESULTS_DIR / "solver_scaling_gap.md").write_text(gap_markdown(result))
        print(gap_markdown(result))
        return
    rows = []
    for n_layers in args.layers:
        rows.append(measure_layers(n_layers, profile_plan=n_layers == max(args.layers)))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"}), flush=True)
    keys = ("read_joint_graph_s", "min_cut_s", "greedy_s", "make_plan_s", "planning_total_s")
    exponents = {key: growth_exponent(rows, key) for key in keys}
    verdicts = []
    for r in rows:
        for nodes, limit in TARGETS_S.items():
            if nodes / 2 <= r["nodes"] <= nodes * 2:
                met = "met" if r["planning_total_s"] <= limit else "MISSED"
                verdicts.append(f"{r['n_layers']} layers, {r['nodes']} nodes: planning {r['planning_total_s']:.2f} s "
                                f"vs target {limit:g} s at ~{nodes:,} nodes: {met}")
    inductor = None if args.no_inductor else inductor_compile_seconds(2, next(
        (r["target_bytes"] for r in rows if r["n_layers"] == 2), 10**8))
    result = dict(common, rows=rows, exponents=exponents, verdicts=verdicts, inductor=inductor)
    (RESULTS_DIR / "solver_scaling.json").write_text(json.dumps(result, indent=1))
    (RESULTS_DIR / "solver_scaling.md").write_text(scaling_markdown(result))
    print(scaling_markdown(result))


if __name__ == "__main__":
    main()
