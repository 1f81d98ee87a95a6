"""Simulate a 1F1B pipeline schedule to show where recomputation costs time (pure Python).

    python benchmarks/pipeline_1f1b.py            # writes benchmarks/results/pipeline_1f1b.{json,md}

Under pipeline parallelism a rank's recomputation is not only its own extra time: a stage's
backward that recomputes first delivers its input gradient later to the stage before it, so
recomputation on a busy stage lengthens the whole step, while recomputation done in a
stage's idle time (a pipeline bubble, while it waits for the next gradient) costs nothing.

Model (units are one microbatch forward on one stage, ``f = 1``): ``P`` stages, ``M``
microbatches, backward ``b = 2 f``, point-to-point transfers take ``comm``. In 1F1B, stage
``s`` runs ``P - s - 1`` warm-up forwards, then alternates one forward and one backward,
then drains the backwards; it holds the activations of up to ``P - s`` microbatches, so
under one per-rank budget the first stages must recompute the most. A stage that keeps
fraction ``1 - x`` of a microbatch's activations ``A`` holds ``(P - s) * A * (1 - x)`` and
recomputes ``x * f`` per backward. The budget is a fraction of stage 0's save-everything
peak ``P * A``.

Policies compared, each at the same per-rank budget:

- ``uniform``: every stage recomputes what stage 0 needs (a per-graph planner that does
  not know which stage it plans, like remat's per-graph budget today);
- ``stage-aware``: each stage recomputes only what its own in-flight count needs, just
  before each backward (on the critical path);
- ``stage-aware, ahead``: the same recomputation issued as soon as the stage would
  otherwise wait for the next backward's gradient (its recomputed activations then live a
  little longer: the memory model here does not count that).

The step time (makespan) of each is compared to the no-recompute schedule, and to the sum of
the recompute time a critical-path-blind cost model would predict (per stage, M times the
per-backward recompute; the step takes at least the largest of those).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Config:
    stages: int
    microbatches: int
    forward_s: float = 1.0
    backward_s: float = 2.0
    comm_s: float = 0.05


def order_1f1b(stage: int, config: Config) -> list[tuple[str, int]]:
    """The ops stage ``stage`` runs, in order: ("F", m) / ("B", m)."""
    warmup = min(config.stages - stage - 1, config.microbatches)
    ops: list[tuple[str, int]] = [("F", m) for m in range(warmup)]
    next_f, next_b = warmup, 0
    while next_b < config.microbatches:
        if next_f < config.microbatches:
            ops.append(("F", next_f))
            next_f += 1
        ops.append(("B", next_b))
        next_b += 1
    return ops


def simulate(config: Config, recompute_s: list[float], ahead: bool) -> float:
    """Makespan of one 1F1B step where stage s recomputes ``recompute_s[s]`` per backward.

    ``ahead``: the recomputation of microbatch m on stage s is its own op, right before B(s, m)
    in the stage's order, needing only F(s, m): it runs while the stage waits for B(s+1, m).
    Otherwise it is part of B(s, m), which needs B(s+1, m)'s gradient first.
    """
    p, c = config.stages, config.comm_s
    done: dict[tuple[str, int, int], float] = {}
    orders = []
    for s in range(p):
        ops: list[tuple[str, int]] = []
        for kind, m in order_1f1b(s, config):
            if kind == "B" and ahead and recompute_s[s] > 0:
                ops.append(("R", m))
            ops.append((kind, m))
        orders.append(ops)
    position = [0] * p
    free = [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                if kind == "F":
                    deps = [("F", s - 1, m)] if s > 0 else []
                    duration = config.forward_s
                elif kind == "R":
                    deps = [("F", s, m)]
                    duration = recompute_s[s]
                else:
                    deps = [("B", s + 1, m)] if s < p - 1 else [("F", s, m)]
                    if ahead and recompute_s[s] > 0:
                        deps.append(("R", s, m))
                    duration = config.backward_s + (0.0 if ahead else recompute_s[s])
                if any(d not in done for d in deps):
                    break
                ready = max([free[s]] + [done[d] + (c if d[1] != s else 0.0) for d in deps])
                done[(kind, s, m)] = ready + duration
                free[s] = ready + duration
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError("the schedule deadlocked: a stage waits on an op that never runs")
    return max(free)


def recompute_per_stage(config: Config, budget_fraction: float, policy: str) -> list[float]:
    """Recompute time per backward on each stage, for a budget of ``budget_fraction`` of stage
    0's save-everything activation peak (``P`` microbatches' activations)."""
    p = config.stages
    budget = budget_fraction * p  # in units of one microbatch's activations
    need = [max(0.0, 1.0 - budget / (p - s)) for s in range(p)]  # fraction to recompute, stage s
    if policy == "uniform":
        need = [max(need)] * p
    return [x * config.forward_s for x in need]


def run(configs: list[Config], fractions: list[float]) -> list[dict]:
    rows = []
    for config in configs:
        base = simulate(config, [0.0] * config.stages, ahead=False)
        for fraction in fractions:
            for policy, ahead in (("uniform", False), ("stage-aware", False), ("stage-aware, ahead", True)):
                recompute = recompute_per_stage(config, fraction, "uniform" if policy == "uniform" else "stage")
                makespan = simulate(config, recompute, ahead=ahead)
                blind = max(recompute) * config.microbatches  # the busiest stage's own recompute time
                total = sum(recompute) * config.microbatches  # every rank's recompute time summed
                rows.append({
                    **asdict(config), "budget_fraction": fraction, "policy": policy,
                    "recompute_per_backward_s": [round(r, 4) for r in recompute],
                    "makespan_s": round(makespan, 4), "no_recompute_makespan_s": round(base, 4),
                    "extra_s": round(makespan - base, 4), "ratio": round(makespan / base, 4),
                    "blind_prediction_s": round(blind, 4), "sum_over_stages_s": round(total, 4),
                })
    return rows


def render(rows: list[dict], commit: str) -> str:
    lines = [
        "# 1F1B pipeline: where recomputation costs time (simulation)",
        "",
        f"`python benchmarks/pipeline_1f1b.py` (pure Python, no torch), commit {commit}. Times in units of one",
        "microbatch's forward on one stage (backward = 2, transfer = 0.05). Budget: a fraction of stage 0's",
        "save-everything activation peak (P microbatches in flight); stage s holds P - s.",
        "`extra` is the step's makespan minus the no-recompute makespan; `busiest stage's own` is what a",
        "critical-path-blind model predicts (M x the largest per-backward recompute); `all ranks` sums every",
        "stage's recompute time.",
        "",
        "| P | M | budget | policy | recompute per backward, by stage | makespan | extra | ratio | busiest stage's own | all ranks |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_stage = " ".join(f"{x:.2f}" for x in r["recompute_per_backward_s"])
        lines.append(
            f"| {r['stages']} | {r['microbatches']} | {r['budget_fraction']:.0%} | {r['policy']} | {per_stage} | "
            f"{r['makespan_s']:.2f} | {r['extra_s']:.2f} | {r['ratio']:.3f} | {r['blind_prediction_s']:.2f} | "
            f"{r['sum_over_stages_s']:.2f} |")
    by_policy: dict[str, list[float]] = {}
    for r in rows:
        by_policy.setdefault(r["policy"], []).append(r["ratio"])
    lines += ["", "Median makespan ratio (to no recompute) over the rows above: "
              + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in by_policy.items()) + "."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    configs = [Config(4, 8), Config(4, 16), Config(8, 16), Config(8, 32)]
    fractions = [0.75, 0.5]
    rows = run(configs, fractions)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_1f1b.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=2) + "\n")
    text = render(rows, commit)
    (args.out / "pipeline_1f1b.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
