"""The exact solvers (MILP, exhaustive) and the greedy measured against them.

Graphs: joint graphs captured with ``aot_function`` (no Inductor), and random
``JointGraphFacts`` built directly (``random_facts``). Budgets are simulated peaks the
exhaustive enumeration reaches (up to MAX_BUDGETS of them, largest to smallest), so each
is met exactly by some plan, and one byte below the smallest, which none meets.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from remat.cost_model.costs import NodeCost
from remat.errors import BudgetInfeasibleError
from remat.passes.joint_graph import JointGraphFacts, NodeFacts
from remat.passes.plan import evaluate, make_plan
from remat.passes.random_ops import split_dropout_outputs
from remat.passes.solve_exhaustive import best_under, enumerate_plans, exhaustive_candidates, solve_exhaustive
from remat.passes.solve_milp import solve_min_time

from joint_graphs import capture_joint

GAP_LIMIT = 0.02            # issue 4: the greedy's extra time within 2% of the MILP optimum
KiB = 1024


# -- graphs ---------------------------------------------------------------------------------------

def _captured_facts(fn, *inputs) -> JointGraphFacts:
    """As the backend prepares a joint graph (dead code out, dropout split), costed on the H100 datasheet."""
    captured = capture_joint(fn, *inputs)
    graph = captured.graph_module.graph
    graph.eliminate_dead_code()
    split_dropout_outputs(graph)
    captured.graph_module.recompile()
    return captured.facts("h100")


def _mlp(x, *ws):
    for w in ws:
        x = F.gelu(x @ w)
    return x.sum()


def _mlp_dropout(x, w1, w2, w3):
    h = F.dropout(F.gelu(x @ w1), p=0.5, training=True)
    h = torch.tanh(h @ w2)
    return (h @ w3).sum()


def _attention_block(x, wq, wk, wv, wo):
    q, k, v = x @ wq, x @ wk, x @ wv
    a = torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1)
    y = x + (a @ v) @ wo
    return F.layer_norm(y, y.shape[-1:]).sum()


def _layer_norm(x):
    """A layer norm written with var_mean, as Inductor's decomposition leaves it: the statistics
    are reductions, which the partition saves rather than recomputes."""
    var, mean = torch.var_mean(x, -1, keepdim=True, correction=0)
    return (x - mean) * torch.rsqrt(var + 1e-5)


def _pre_norm(x, *ws):
    for w in ws:
        x = x + F.gelu(_layer_norm(x) @ w)
    return x.sum()


def _weights(n: int, width: int) -> list[torch.Tensor]:
    return [torch.randn(width, width, requires_grad=True) for _ in range(n)]


@lru_cache(maxsize=None)
def captured(name: str) -> JointGraphFacts:
    torch.manual_seed(0)
    rows, width = 256, 64          # 256 x 64 fp32 = 64 KiB per activation
    if name == "mlp2":
        return _captured_facts(_mlp, torch.randn(rows, width), *_weights(2, width))
    if name == "mlp3":
        return _captured_facts(_mlp, torch.randn(rows, width), *_weights(3, width))
    if name == "mlp_dropout":
        return _captured_facts(_mlp_dropout, torch.randn(rows, width), *_weights(3, width))
    if name == "attention":
        return _captured_facts(_attention_block, torch.randn(2, 32, 32), *_weights(4, 32))
    if name == "pre_norm":
        return _captured_facts(_pre_norm, torch.randn(128, 32), *_weights(4, 32))
    raise KeyError(name)


@dataclass(frozen=True)
class _Kind:
    op: str
    inlinable: bool
    fusible: bool
    cost_us: tuple[int, int]


_KINDS = {
    "mm": _Kind("random.mm", False, False, (8, 60)),
    "pointwise": _Kind("random.pointwise", True, True, (1, 6)),
    "reduction": _Kind("random.reduction", False, True, (2, 8)),
    "view": _Kind("random.view", False, True, (0, 0)),
    "random": _Kind("random.dropout_mask", False, False, (2, 4)),
}


def random_facts(seed: int, n_forward: int = 9) -> JointGraphFacts:
    """A random forward chain with skip inputs, and a backward chain that reads forward values.

    Sizes are multiples of 4 KiB; times are whole microseconds, so ties are rare and exact.
    Roles, users, needed_by_backward and forward_required follow read_joint_graph's rules.
    """
    rng = random.Random(seed)
    nodes: dict[str, NodeFacts] = {}

    def add(name, role, kind, inputs, nbytes, view_of: Optional[str] = None, ban: Optional[str] = None):
        k = _KINDS.get(kind)
        allocs = () if view_of is not None or nbytes == 0 else ((name, nbytes),)
        storages = nodes[view_of].value_storages if view_of is not None else tuple(s for s, _ in allocs)
        cost_us = rng.randint(*k.cost_us) if k else 0
        nodes[name] = NodeFacts(
            name=name, role=role, op=k.op if k else "placeholder", inputs=tuple(inputs), allocs=allocs,
            value_storages=storages, is_tensor=True, is_sym=False, is_multi_output=False, is_getitem=False,
            getitem_index=None, is_view=view_of is not None, inlinable=bool(k and k.inlinable),
            fusible_consumer=bool(k and k.fusible), free_to_recompute=bool(k and (k.inlinable or kind == "view")),
            recompute_ban=ban, cost=NodeCost(est_time_s=cost_us * 1e-6),
        )

    add("x", "primal", None, (), 16 * KiB)
    forward: list[str] = []
    sizes: dict[str, int] = {"x": 16 * KiB}
    for i in range(n_forward):
        kind = rng.choices(list(_KINDS), weights=(4, 4, 1, 1, 1))[0]
        prev = forward[-1] if forward else "x"
        inputs = [prev]
        if kind == "mm":
            weight = f"w{i}"
            add(weight, "primal", None, (), 4 * KiB)
            inputs.append(weight)
        elif kind == "pointwise" and len(forward) >= 2 and rng.random() < 0.4:
            inputs.append(rng.choice(forward[:-1]))       # a residual input
        name = f"f{i}"
        if kind == "view":
            add(name, "forward", kind, inputs, 0, view_of=prev)
            sizes[name] = sizes[prev]
        else:
            nbytes = sizes[prev] // 4 if kind == "reduction" else rng.choice((1, 2, 4, 8)) * 4 * KiB
            ban = "random op: recomputing it would draw fresh random numbers" if kind == "random" else None
            add(name, "forward", kind, inputs, nbytes, ban=ban)
            sizes[name] = nbytes
        forward.append(name)
    add("tangent", "tangent", None, (), sizes[forward[-1]])
    grad, bwd_outputs = "tangent", []
    for i in reversed(range(n_forward)):
        f = nodes[forward[i]]
        reads = [v for v in (forward[i], *f.inputs) if nodes[v].role in ("forward", "primal") and rng.random() < 0.6]
        if f.op == "random.dropout_mask":
            reads = [forward[i]]                          # the mask is always needed
        kind = "pointwise" if f.inlinable else "mm"
        name = f"g{i}"
        add(name, "backward", kind, [grad, *dict.fromkeys(reads)], sizes[f.inputs[0]])
        if f.op == "random.mm":
            dw = f"dw{i}"
            add(dw, "backward", "mm", [grad, f.inputs[0]], 4 * KiB)
            bwd_outputs.append(dw)
        grad = name
    bwd_outputs.append(grad)
    return _assemble(nodes, fwd_outputs=(forward[-1],), bwd_outputs=tuple(bwd_outputs))


def _assemble(
    nodes: dict[str, NodeFacts], fwd_outputs: tuple[str, ...], bwd_outputs: tuple[str, ...]
) -> JointGraphFacts:
    order = tuple(nodes)
    users = {n: tuple(u for u in order if n in nodes[u].inputs) for n in order}
    required: set[str] = set()
    stack = list(fwd_outputs)
    while stack:
        name = stack.pop()
        if name not in required and nodes[name].role == "forward":
            required.add(name)
            stack.extend(nodes[name].inputs)
    needed = tuple(
        n for n in order
        if nodes[n].role in ("forward", "primal") and any(nodes[u].role == "backward" for u in users[n])
    )
    return JointGraphFacts(
        order=order, nodes=nodes, users=users, fwd_outputs=fwd_outputs, bwd_outputs=bwd_outputs,
        forward_required=frozenset(required), needed_by_backward=needed,
    )


RANDOM_SEEDS = tuple(range(8))
TINY = ("mlp2", "mlp3", "mlp_dropout") + tuple(f"random{seed}" for seed in RANDOM_SEEDS)


def facts_of(name: str) -> JointGraphFacts:
    return random_facts(int(name.removeprefix("random"))) if name.startswith("random") else captured(name)


@lru_cache(maxsize=None)
def plans_of(name: str):
    return enumerate_plans(facts_of(name), max_candidates=12)


MAX_BUDGETS = 6


@lru_cache(maxsize=None)
def budgets_of(name: str) -> tuple[int, ...]:
    """Distinct simulated peaks some plan reaches, largest first: all of them, or
    MAX_BUDGETS spread evenly from the largest to the smallest."""
    peaks = sorted({p.simulated_peak_bytes for p in plans_of(name)}, reverse=True)
    if len(peaks) > MAX_BUDGETS:
        step = (len(peaks) - 1) / (MAX_BUDGETS - 1)
        peaks = [peaks[round(i * step)] for i in range(MAX_BUDGETS)]
    return tuple(peaks)


@lru_cache(maxsize=None)
def milp(name: str, target: int):
    return solve_min_time(facts_of(name), target, time_limit_s=60)


def banned(facts: JointGraphFacts) -> set[str]:
    return {n for n, node in facts.nodes.items() if node.recompute_ban is not None}


# -- the exact solvers agree ----------------------------------------------------------------------

@pytest.mark.parametrize("name", TINY)
def test_milp_matches_exhaustive_across_reachable_peaks(name):
    facts = facts_of(name)
    assert 1 <= len(exhaustive_candidates(facts)) <= 12
    for target in budgets_of(name):
        truth = best_under(plans_of(name), target)
        result = milp(name, target)
        assert result.status == "optimal", (name, target, result)
        assert result.memory_model == "structural", "a structural row overstated a simulated peak"
        assert result.est_extra_time_s == pytest.approx(truth.est_extra_time_s, rel=1e-9, abs=1e-15), (name, target)
        check = evaluate(facts, set(result.chosen_saved))
        assert check.simulation.peak_bytes == result.simulated_peak_bytes <= target
        assert check.extra_time_s == pytest.approx(result.est_extra_time_s, rel=1e-12, abs=1e-18)
        assert not check.partition.recomputed & banned(facts), "a random op was recomputed"
        assert result.lower_bound_s <= result.est_extra_time_s * (1 + 1e-9) + 1e-15


@pytest.mark.parametrize("name", TINY)
def test_below_the_smallest_peak_is_infeasible(name):
    smallest = min(budgets_of(name))
    exhaustive = solve_exhaustive(facts_of(name), smallest - 1, max_candidates=12)
    assert exhaustive.status == "infeasible" and exhaustive.min_peak_bytes == smallest
    result = milp(name, smallest - 1)
    assert result.status == "infeasible"
    assert result.chosen_saved is None and result.est_extra_time_s is None and result.lower_bound_s == math.inf


@pytest.mark.parametrize("name", TINY)
def test_optimal_time_is_monotone_as_the_budget_shrinks(name):
    times = [milp(name, target).est_extra_time_s for target in budgets_of(name)]
    assert times == sorted(times), times


def test_no_random_op_is_ever_recomputed():
    """Over every plan of graphs with dropout masks: the closure saves them instead."""
    for name in ("mlp_dropout",) + tuple(f"random{s}" for s in RANDOM_SEEDS):
        facts = facts_of(name)
        bans = banned(facts) & set(facts.order)
        if name == "mlp_dropout":
            assert bans, "the dropout graph should hold a random op"
        for point in plans_of(name):
            assert not set(point.recomputed) & bans, (name, point)


def test_exhaustive_refuses_too_many_candidates():
    with pytest.raises(ValueError, match="max_candidates=2"):
        enumerate_plans(facts_of("mlp3"), max_candidates=2)


# -- time limit and the start plan ----------------------------------------------------------------

def test_time_limit_returns_the_start_plan_or_a_better_probe():
    name = "mlp3"
    target = budgets_of(name)[2]
    start = set(best_under(plans_of(name), budgets_of(name)[-1]).chosen_saved)   # fits any budget
    result = solve_min_time(facts_of(name), target, time_limit_s=0.0, start=start)
    assert result.status == "time_limit" and result.solves == 0
    assert result.est_extra_time_s <= evaluate(facts_of(name), start).extra_time_s
    check = evaluate(facts_of(name), set(result.chosen_saved))
    assert check.simulation.peak_bytes == result.simulated_peak_bytes <= target


def test_time_limit_with_nothing_that_fits_returns_none():
    smallest = min(budgets_of("mlp3"))
    result = solve_min_time(facts_of("mlp3"), smallest - 1, time_limit_s=0.0)
    assert result.status == "time_limit" and result.chosen_saved is None and result.simulated_peak_bytes is None


def test_an_optimal_start_plan_is_proven_optimal():
    name = "mlp3"
    target = budgets_of(name)[1]
    truth = best_under(plans_of(name), target)
    result = solve_min_time(facts_of(name), target, start=set(truth.chosen_saved))
    assert result.status == "optimal"
    assert result.est_extra_time_s == pytest.approx(truth.est_extra_time_s, rel=1e-12)


def test_captured_attention_block_solves_and_verifies():
    """Too many candidates to enumerate: check the MILP's plan against the simulator only."""
    facts = facts_of("attention")
    full = evaluate(facts, {n for n in facts.needed_by_backward if facts.nodes[n].role == "forward"})
    for fraction in (1.0, 0.9, 0.8):
        target = int(full.simulation.peak_bytes * fraction)
        result = solve_min_time(facts, target, time_limit_s=60)
        assert result.status == "optimal", result
        check = evaluate(facts, set(result.chosen_saved))
        assert check.simulation.peak_bytes <= target
        assert check.extra_time_s == pytest.approx(result.est_extra_time_s, rel=1e-12, abs=1e-18)


# -- the greedy against the optimum ---------------------------------------------------------------

def greedy_gaps(names) -> list[tuple[str, int, float, Optional[float]]]:
    """(graph, target, optimal extra time, greedy extra time or None when it raises)."""
    rows = []
    for name in names:
        for target in budgets_of(name):
            optimum = best_under(plans_of(name), target).est_extra_time_s
            try:
                greedy: Optional[float] = make_plan(facts_of(name), target).est_extra_time_s
            except BudgetInfeasibleError:
                greedy = None
            rows.append((name, target, optimum, greedy))
    return rows


def _within_gap(optimum: float, greedy: Optional[float]) -> bool:
    return greedy is not None and greedy <= optimum * (1 + GAP_LIMIT) + 1e-12


def test_greedy_plan_meets_its_target_and_never_recomputes_random_ops():
    for name in TINY:
        facts = facts_of(name)
        for target in budgets_of(name):
            try:
                plan = make_plan(facts, target)
            except BudgetInfeasibleError:
                continue
            assert plan.predicted_peak_bytes <= target
            assert not set(plan.recomputed) & banned(facts)


def test_greedy_peak_is_monotone_as_the_budget_shrinks():
    for name in TINY:
        peaks = []
        for target in budgets_of(name):
            try:
                peaks.append(make_plan(facts_of(name), target).predicted_peak_bytes)
            except BudgetInfeasibleError:
                break
        assert peaks == sorted(peaks, reverse=True), (name, peaks)


def test_greedy_within_2_percent_of_optimum():
    """Issue 4: on every tiny graph, at every budget some plan reaches, the default solver's extra
    time is within 2% of the exhaustive optimum (and it never raises where a plan exists)."""
    misses = [row for row in greedy_gaps(TINY) if not _within_gap(row[2], row[3])]
    assert not misses, misses


@pytest.mark.parametrize("name", ("mlp3", "random0", "random1"))
def test_safe_memory_model_matches_exhaustive(name):
    """The fallback (tangents row and cuts only) is exact too, just slower."""
    for target in budgets_of(name)[:3]:
        result = solve_min_time(facts_of(name), target, time_limit_s=60, memory_model="safe")
        assert result.status == "optimal" and result.memory_model == "safe"
        truth = best_under(plans_of(name), target)
        assert result.est_extra_time_s == pytest.approx(truth.est_extra_time_s, rel=1e-9, abs=1e-15)


def test_a_row_that_overstates_a_simulated_peak_is_caught():
    from remat.passes.solve_milp import _build_model

    facts = facts_of("mlp3")
    model = _build_model(facts, budgets_of("mlp3")[0])
    trial = evaluate(facts, set())
    assert model.unsound_rows(trial) == []
    model.add_memory_row(trial.simulation.peak_bytes + 1, [], "bogus")
    assert model.unsound_rows(trial) == ["bogus"]


# -- every solver path: named budgets, determinism ------------------------------------------------

@pytest.mark.parametrize("name", TINY)
def test_the_smallest_feasible_budget_named_is_feasible(name):
    facts = facts_of(name)
    below = min(budgets_of(name)) - 1
    with pytest.raises(BudgetInfeasibleError) as info:
        make_plan(facts, below)
    named = info.value.min_feasible_bytes
    plan = make_plan(facts, named)
    assert plan.fits_budget and plan.predicted_peak_bytes <= named
    assert make_plan(facts, below, best_effort=True).predicted_peak_bytes == named


def test_drops_whose_recomputation_reaches_a_saved_reduction_are_taken():
    """Recomputing a value below a var_mean layer norm reaches the statistics, which the partition
    saves (a reduction). The descent once refused such drops: the smallest-peak plan stayed above
    the min-cut's peak and no budget below the min-cut was met."""
    facts = captured("pre_norm")
    no_budget = make_plan(facts, None)
    smallest = make_plan(facts, 1, best_effort=True)
    assert not smallest.fits_budget
    assert smallest.predicted_peak_bytes <= 0.75 * no_budget.predicted_peak_bytes
    for fraction in (0.9, 0.8):
        target = int(fraction * no_budget.predicted_peak_bytes)
        plan = make_plan(facts, target)
        assert plan.predicted_peak_bytes <= target
        assert smallest.predicted_peak_bytes <= plan.predicted_peak_bytes
    with pytest.raises(BudgetInfeasibleError) as info:
        make_plan(facts, 1)
    assert info.value.min_feasible_bytes == smallest.predicted_peak_bytes
    assert make_plan(facts, info.value.min_feasible_bytes).fits_budget


_DETERMINISM_SCRIPT = r"""
import json, sys
sys.path.insert(0, "tests")
import test_solvers as ts
from remat.errors import BudgetInfeasibleError
from remat.passes.plan import evaluate, make_plan, _save_all
out = []
for name in ("attention", "mlp_dropout", "random3"):
    facts = ts.facts_of(name)
    top = evaluate(facts, _save_all(facts)).simulation.peak_bytes
    for fraction in (0.95, 0.8, 0.65, 0.3):
        try:
            plan = make_plan(facts, int(top * fraction))
            out.append([name, fraction, plan.saved, plan.recomputed, plan.predicted_peak_bytes,
                        plan.est_extra_time_s, [d.reason for d in plan.decisions]])
        except BudgetInfeasibleError as error:
            out.append([name, fraction, "infeasible", error.min_feasible_bytes, list(error.reasons)])
for target in ts.budgets_of("mlp3")[1:3]:
    plan = make_plan(ts.facts_of("mlp3"), target, solver="milp")
    out.append(["mlp3", target, plan.saved, plan.recomputed, plan.predicted_peak_bytes, plan.est_extra_time_s])
print(json.dumps(out))
"""


def test_plans_do_not_depend_on_the_hash_seed():
    """Issue 4: the same graph and budget give the same plan under two PYTHONHASHSEEDs (the
    default solver, its infeasibility answer, and solver='milp')."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    results = []
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        run = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT], cwd=root, env=env,
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        results.append(json.loads(run.stdout.strip().splitlines()[-1]))
    assert len(results[0]) == 14
    assert any(row[2] == "infeasible" for row in results[0]), "one budget should be out of reach"
    assert results[0] == results[1]


# -- solver="milp" ----------------------------------------------------------------------------------

def test_milp_solver_returns_the_exhaustive_optimum():
    name = "mlp3"
    for target in budgets_of(name)[1:4]:
        plan = make_plan(facts_of(name), target, solver="milp")
        truth = best_under(plans_of(name), target)
        assert plan.solver.startswith("milp (optimal"), plan.solver
        assert plan.predicted_peak_bytes <= target
        assert plan.est_extra_time_s == pytest.approx(truth.est_extra_time_s, rel=1e-9, abs=1e-15)


def test_milp_time_out_keeps_the_best_verified_plan():
    name = "random2"
    target = budgets_of(name)[-2]
    greedy = make_plan(facts_of(name), target)
    plan = make_plan(facts_of(name), target, solver="milp", milp_time_limit_s=1e-9)
    assert plan.solver.startswith("milp (time limit 1e-09 s reached: best verified plan kept"), plan.solver
    assert plan.predicted_peak_bytes <= target
    assert plan.est_extra_time_s <= greedy.est_extra_time_s


def test_milp_failure_falls_back_to_the_greedy_with_the_reason(monkeypatch):
    from remat.passes import plan as plan_module

    def broken(*args, **kwargs):
        raise RuntimeError("HiGHS is unavailable")

    monkeypatch.setattr(plan_module, "solve_min_time", broken)
    target = budgets_of("mlp3")[2]
    plan = make_plan(facts_of("mlp3"), target, solver="milp")
    assert plan.solver == ("greedy (milp failed: RuntimeError: HiGHS is unavailable; "
                           "fell back to the greedy's plan)")
    greedy = make_plan(facts_of("mlp3"), target)
    assert (plan.saved, plan.est_extra_time_s) == (greedy.saved, greedy.est_extra_time_s)


def test_milp_refuses_graphs_too_large(monkeypatch):
    from remat.passes import plan as plan_module

    monkeypatch.setattr(plan_module, "MILP_MAX_CANDIDATES", 5)
    forward = sum(1 for n in facts_of("mlp3").nodes.values() if n.role == "forward")
    with pytest.raises(ValueError, match=rf"solver='milp' is for small graphs: this joint graph has {forward} "
                                         r"forward values to decide, more than 5.*Use solver='greedy'"):
        make_plan(facts_of("mlp3"), budgets_of("mlp3")[0], solver="milp")


def test_milp_infeasible_budget_names_a_feasible_budget():
    facts = facts_of("mlp3")
    with pytest.raises(BudgetInfeasibleError) as info:
        make_plan(facts, min(budgets_of("mlp3")) - 1, solver="milp")
    assert make_plan(facts, info.value.min_feasible_bytes, solver="milp").fits_budget


def test_unknown_solver_is_refused():
    with pytest.raises(ValueError, match="solver='ilp' is not one of"):
        make_plan(facts_of("mlp2"), None, solver="ilp")


# -- the covering knapsack of one descent round -----------------------------------------------------

@pytest.mark.parametrize(("priced", "need", "expected"), [
    # (time s, bytes, index): two cheap items beat the big one that covers alone
    ([(1.0, 10, 0), (1.0, 10, 1), (5.0, 100, 2)], 15, [0, 1]),
    # the one item that covers alone beats every prefix of cheaper-per-byte items
    ([(3.0, 10, 0), (1.0, 4, 1), (1.0, 4, 2)], 10, [0]),
    # a prefix completed by the cheapest item that covers the rest
    ([(1.0, 8, 0), (2.0, 8, 1), (0.5, 3, 2)], 10, [0, 2]),
    # exactly enough
    ([(2.0, 6, 0), (2.0, 4, 1)], 10, [0, 1]),
    # everything together falls short: nothing
    ([(1.0, 5, 0), (1.0, 4, 1)], 10, []),
])
def test_cheapest_cover(priced, need, expected):
    from remat.passes.solve_greedy import _cheapest_cover

    chosen = _cheapest_cover(priced, need)
    assert sorted(chosen) == expected
    assert not chosen or sum(b for _, b, i in priced if i in chosen) >= need


def test_backend_passes_solver_milp_to_the_planner(tmp_path):
    """Through torch.compile: the plan, plan.json and report.md record that the MILP answered;
    gradients match eager."""
    import json
    from pathlib import Path

    import remat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    x = torch.randn(16, 32)
    backend = remat.backend(1, solver="milp", milp_time_limit_s=20, dump_dir=tmp_path)
    torch._dynamo.reset()
    try:
        torch.compile(model, backend=backend)(x).square().sum().backward()
    finally:
        torch._dynamo.reset()
    compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for got, want in zip(compiled, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)
    assert backend.compiled_graphs
    assert all(g.plan.solver.startswith("milp (optimal") for g in backend.compiled_graphs), \
        [g.plan.solver for g in backend.compiled_graphs]
    for graph in backend.compiled_graphs:
        directory = Path(graph.dump_path)
        assert json.loads((directory / "plan.json").read_text())["solver"] == graph.plan.solver
        assert f"- solver: {graph.plan.solver}\n" in (directory / "report.md").read_text()


# -- the ladder of aims ---------------------------------------------------------------------------

def test_descents_aimed_under_the_target_find_cheaper_plans_than_the_target_alone():
    """The descent's plan is not monotone in its aim: on corpus net rand-1000 (traced as the backend
    traces it, H100 datasheet costs), aimed at a target three quarters of the way from its floor to
    its no-remat peak, the descent ends on a plan of 8.1 us estimated extra time; aimed 1/32 lower it
    ends on one of 4.1 us, which meets the target too. ``solve_greedy``'s rungs find it; with the
    rungs off (``rungs=0``) they do not. At every target the rungs are never dearer."""
    import warnings

    from remat.passes.mincut import min_cut_saved
    from remat.passes.plan import solver_starts
    from remat.passes.solve_context import SearchContext
    from remat.passes.solve_greedy import smallest_peak_plan, solve_greedy
    from remat.pipeline import trace_joint_facts
    from remat.testing import corpus

    built = corpus.random_entry(1000).build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        facts = trace_joint_facts(lambda *inputs: built.model(*inputs), built.inputs, hardware="h100")[0]
    save_all = evaluate(facts, SearchContext(facts).save_all())
    starts = solver_starts(facts, evaluate(facts, min_cut_saved(facts)))
    floor, top = smallest_peak_plan(facts, starts)[0].peak_bytes, save_all.peak_bytes
    ratios = {}
    for eighth in range(1, 8):
        target = floor + (top - floor) * eighth // 8
        alone = solve_greedy(facts, target, starts, save_all, rungs=0).plan
        laddered = solve_greedy(facts, target, starts, save_all).plan
        assert alone is not None and laddered is not None
        assert laddered.peak_bytes <= target
        assert laddered.extra_time_s <= alone.extra_time_s + 1e-12, eighth
        ratios[eighth] = laddered.extra_time_s / alone.extra_time_s
    assert ratios[6] < 0.6, ratios
