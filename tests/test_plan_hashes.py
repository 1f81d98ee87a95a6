"""Plans of the zoo models are unchanged by refactoring: each plan's hash equals the recorded one.

For every zoo model (``ZOO``), traced as the backend traces it (Inductor's decompositions and
joint-graph passes, no code generation; the ``h100`` datasheet profile, so costs do not depend on
the machine), the planner (``make_plan``, greedy solver) plans its joint graph at three budgets,
each without and with a saved-bytes cap. A plan's hash covers its saved set, its recomputed set,
its backward schedule (every copy the backward runs, in order: node, instance, region, the
instances it reads) and its predicted peak; ``tests/data/plan_hashes.json`` holds the hashes.

The budgets are ``lo + f * (hi - lo)`` for ``f`` in ``FRACTIONS``, between the smallest feasible
peak ``lo`` (named by ``BudgetInfeasibleError``) and the no-remat peak ``hi``: a tight one, one
halfway, and a loose one (at or above the min-cut's peak on most models). The cap is one byte
under the uncapped plan's saved bytes, so ``held_cap.reduce_saved_bytes`` drops at least one
value: a round of it simulates one plan per saved value, so a tighter cap costs minutes on the
GPT. The four models take about a minute on a loaded 2-core VM, most of it the capped plans.

A change that is meant to change plans (a new simulator convention, a better solver) re-records
the file, and its commit says so::

    PYTHONPATH=$PWD python tests/test_plan_hashes.py --record
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from remat.errors import BudgetInfeasibleError
from remat.passes.joint_graph import JointGraphFacts
from remat.passes.plan import Plan, make_plan
from remat.simulator.schedule import backward_order, partition_nodes
from remat.testing.zoo import ZOO

RECORDED = Path(__file__).resolve().parent / "data" / "plan_hashes.json"
PROFILE = "h100"
FRACTIONS = (0.1, 0.5, 0.9)


def backward_schedule(facts: JointGraphFacts, plan: Plan) -> list[tuple[Any, ...]]:
    """The backward the rewrite builds for ``plan``: each copy as (node, instance, region, reads)."""
    order = backward_order(facts, partition_nodes(facts, set(plan.saved)))
    return [(s.name, s.instance, s.region, [list(r) for r in s.reads]) for s in order]


def plan_record(facts: JointGraphFacts, plan: Plan) -> dict[str, Any]:
    """The hash of what a plan decides, next to its predicted peak and sizes (to read a diff by)."""
    content = {
        "saved": sorted(plan.saved),
        "recomputed": sorted(plan.recomputed),
        "backward_schedule": backward_schedule(facts, plan),
        "predicted_peak_bytes": plan.predicted_peak_bytes,
    }
    digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
    return {"hash": digest, "predicted_peak_bytes": plan.predicted_peak_bytes,
            "saved": len(plan.saved), "recomputed": len(plan.recomputed),
            "est_extra_time_us": round(plan.est_extra_time_s * 1e6)}


def trace(name: str) -> list[JointGraphFacts]:
    from remat.pipeline import trace_joint_facts

    model, inputs = ZOO[name]()
    model.train()
    return trace_joint_facts(model, inputs, hardware=PROFILE)


def budgets_between(facts: JointGraphFacts) -> list[tuple[float, int]]:
    """(fraction, budget) for each of ``FRACTIONS``: ``lo + fraction * (hi - lo)`` between the smallest
    feasible peak ``lo`` and the no-remat peak ``hi`` of the graph."""
    hi = make_plan(facts, None).no_remat_peak_bytes
    try:
        make_plan(facts, 1)
        lo = 1
    except BudgetInfeasibleError as error:
        lo = error.min_feasible_bytes
    return [(fraction, int(lo + fraction * (hi - lo))) for fraction in FRACTIONS]


def model_records(name: str) -> dict[str, Any]:
    """Every case of zoo model ``name``, keyed ``graph<i>/<fraction>/<cap|nocap>``, plus the budgets."""
    records: dict[str, Any] = {}
    for index, facts in enumerate(trace(name)):
        for fraction, budget in budgets_between(facts):
            plan = make_plan(facts, budget)
            capped = make_plan(facts, budget, saved_cap_bytes=plan.saved_bytes - 1)
            key = f"graph{index}/{fraction}"
            records[f"{key}/budget_bytes"] = budget
            records[f"{key}/nocap"] = plan_record(facts, plan)
            records[f"{key}/cap"] = plan_record(facts, capped)
    return records


def recorded() -> dict[str, Any]:
    return json.loads(RECORDED.read_text())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_plans_match_the_recorded_hashes(name: str) -> None:
    expected: Optional[dict[str, Any]] = recorded()["models"].get(name)
    assert expected is not None, f"no recorded plans for {name}: re-record ({__doc__.splitlines()[-1].strip()})"
    actual = model_records(name)
    changed = {k: (expected.get(k), v) for k, v in actual.items() if expected.get(k) != v}
    missing = sorted(expected.keys() - actual.keys())
    assert not changed and not missing, (
        f"{name}: plans differ from tests/data/plan_hashes.json (recorded, now): "
        + "; ".join(f"{k}: {old} -> {new}" for k, (old, new) in sorted(changed.items()))
        + (f"; cases gone: {missing}" if missing else "")
    )


def record() -> None:
    """Write every zoo model's plan hashes to ``RECORDED``."""
    data = {"profile": PROFILE, "fractions": list(FRACTIONS),
            "models": {name: model_records(name) for name in sorted(ZOO)}}
    RECORDED.parent.mkdir(parents=True, exist_ok=True)
    RECORDED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORDED}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: PYTHONPATH=$PWD python {sys.argv[0]} --record")
    record()
