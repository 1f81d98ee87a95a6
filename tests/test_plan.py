"""Planner properties on small joint graphs (no Inductor codegen)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from remat.errors import BudgetInfeasibleError
from remat.units import format_gb_up
from remat.passes.plan import make_plan
from remat.simulator.schedule import backward_order, partition_nodes

from joint_graphs import capture_joint

ROWS, WIDTH = 2048, 128  # 2048 x 128 fp32 = 1 MiB per activation, 64 KiB per weight


def mlp(x, *ws):
    for w in ws[:-1]:
        x = torch.tanh(x @ w)
    return (x @ ws[-1]).sum()


@pytest.fixture(scope="module")
def mlp_facts():
    torch.manual_seed(0)
    x = torch.randn(ROWS, WIDTH)
    ws = [torch.randn(WIDTH, WIDTH, requires_grad=True) for _ in range(6)]
    return capture_joint(mlp, x, *ws).facts()


def test_no_budget_is_the_free_min_cut(mlp_facts):
    plan = make_plan(mlp_facts, None)
    assert plan.budget_bytes is None and plan.fits_budget
    assert plan.predicted_peak_bytes == plan.mincut_peak_bytes
    assert plan.mincut_peak_bytes <= plan.no_remat_peak_bytes
    # Every recomputed op under no budget is free to recompute (no matmul re-run).
    assert all(mlp_facts.nodes[n].free_to_recompute for n in plan.recomputed)


def test_budget_is_met_on_the_simulated_peak_and_monotone(mlp_facts):
    no_budget = make_plan(mlp_facts, None)
    peaks = []
    for fraction in (1.0, 0.9, 0.8, 0.7, 0.6):
        budget = int(no_budget.predicted_peak_bytes * fraction)
        try:
            plan = make_plan(mlp_facts, budget)
        except BudgetInfeasibleError as error:
            assert error.min_feasible_bytes > budget
            break
        assert plan.predicted_peak_bytes <= budget
        peaks.append(plan.predicted_peak_bytes)
    assert len(peaks) >= 3, "the MLP should fit at least down to 80% of its no-budget peak"
    assert peaks == sorted(peaks, reverse=True)


def test_matmuls_recomputed_only_under_pressure(mlp_facts):
    no_budget = make_plan(mlp_facts, None)
    tight = make_plan(mlp_facts, int(no_budget.predicted_peak_bytes * 0.8))
    mm_ops = {n for n in tight.recomputed if mlp_facts.nodes[n].op == "aten.mm.default"}
    assert tight.est_extra_time_s > no_budget.est_extra_time_s
    assert mm_ops, "meeting 80% of the peak needs a matmul recomputed"
    dropped = {d.name for d in tight.decisions if d.reason.startswith("dropped to meet the budget")}
    assert dropped


def test_infeasible_budget_names_the_smallest_feasible_one(mlp_facts):
    with pytest.raises(BudgetInfeasibleError) as excinfo:
        make_plan(mlp_facts, 1_000_000)
    error = excinfo.value
    assert error.min_feasible_bytes > 1_000_000
    assert f"at least {format_gb_up(error.min_budget_bytes)} GB" in str(error)
    assert "gradients" in str(error)
    # The named minimum is feasible (with no headroom, the budget to pass is the smallest peak).
    assert error.min_budget_bytes == error.min_feasible_bytes
    assert make_plan(mlp_facts, error.min_budget_bytes).fits_budget


def test_best_effort_returns_the_smallest_peak_plan(mlp_facts):
    plan = make_plan(mlp_facts, 1_000_000, best_effort=True)
    assert not plan.fits_budget
    with pytest.raises(BudgetInfeasibleError) as excinfo:
        make_plan(mlp_facts, 1_000_000)
    assert plan.predicted_peak_bytes == excinfo.value.min_feasible_bytes


def test_recompute_regions_sit_right_before_their_first_use(mlp_facts):
    no_budget = make_plan(mlp_facts, None)
    plan = make_plan(mlp_facts, int(no_budget.predicted_peak_bytes * 0.8))
    order = backward_order(mlp_facts, partition_nodes(mlp_facts, set(plan.saved)))
    made_at = {s.instance: i for i, s in enumerate(order)}
    regions = sorted({s.region for s in order if s.region >= 0})
    assert regions, "an 80% budget recomputes something"
    assert regions == list(range(len(regions)))
    for region in regions:
        members = [i for i, s in enumerate(order) if s.region == region]
        start, end = members[0], members[-1]
        assert members == list(range(start, end + 1)), "a region is one contiguous block"
        first_use = order[end + 1]
        assert first_use.region == -1
        instances = {order[i].instance for i in members}
        # The backward node right after the region reads what the region rebuilt...
        assert {inst for _, inst in first_use.reads} & instances
        # ...and nothing reads a rebuilt instance before the region runs.
        for later in order:
            for _, inst in later.reads:
                assert made_at[inst] < made_at[later.instance]


def dropout_net(x, w1, w2):
    h = F.dropout(torch.relu(x @ w1), p=0.5, training=True)
    return (h @ w2).sum()


def test_random_ops_are_never_recomputed():
    torch.manual_seed(0)
    x = torch.randn(256, 256)
    w1, w2 = (torch.randn(256, 256, requires_grad=True) for _ in range(2))
    facts = capture_joint(dropout_net, x, w1, w2).facts()
    banned = {n for n, f in facts.nodes.items() if f.recompute_ban and f.recompute_ban.startswith("random")}
    assert banned, "the captured graph should hold a random op"
    no_budget = make_plan(facts, None)
    for fraction in (1.0, 0.8, 0.6):
        try:
            plan = make_plan(facts, int(no_budget.predicted_peak_bytes * fraction))
        except BudgetInfeasibleError:
            continue
        assert not banned & set(plan.recomputed)
        assert banned & {name for name, _ in plan.forced} or not banned & set(plan.saved)


OLD_GREEDY_GPT_SMALLEST_TARGET_BYTES = 23_140_000   # the peak-directed greedy of commit 32dddff, bisected


def test_zoo_gpt_smallest_peak_is_below_the_old_greedys():
    """The zoo GPT, traced as the backend does (CPU costs, no code generation): the smallest peak
    the planner names is no higher than the old greedy's smallest feasible target, nor than the
    no-budget plan, and planning at it succeeds."""
    from remat.testing.zoo import ZOO
    from remat.pipeline import trace_joint_facts

    model, inputs = ZOO["gpt"]()
    facts = trace_joint_facts(model, inputs, hardware="cpu")[0]
    no_budget = make_plan(facts, None)
    with pytest.raises(BudgetInfeasibleError) as info:
        make_plan(facts, 1)
    named = info.value.min_feasible_bytes
    assert named <= min(OLD_GREEDY_GPT_SMALLEST_TARGET_BYTES, no_budget.predicted_peak_bytes)
    assert make_plan(facts, named).fits_budget


def test_planning_pauses_the_cyclic_gc_and_restores_it(mlp_facts, monkeypatch):
    """make_plan turns the cyclic collector off while it works (40% of its time on a 48-layer
    GPT) and leaves it as it found it, on success and on an infeasible budget."""
    import gc

    from remat.passes import plan as plan_module

    seen = []
    solve = plan_module.solve_greedy
    monkeypatch.setattr(plan_module, "solve_greedy", lambda *a, **k: (seen.append(gc.isenabled()), solve(*a, **k))[1])
    no_budget = make_plan(mlp_facts, None)
    assert gc.isenabled()
    make_plan(mlp_facts, no_budget.predicted_peak_bytes)
    assert seen == [False] and gc.isenabled()
    with pytest.raises(BudgetInfeasibleError):
        make_plan(mlp_facts, 1_000_000)
    assert gc.isenabled()
    gc.disable()
    try:
        make_plan(mlp_facts, no_budget.predicted_peak_bytes)
        assert not gc.isenabled()
    finally:
        gc.enable()
