"""One budget per step across graph breaks (remat/step_budget.py).

The step's condition and the account's bookkeeping as tables on plain numbers; then tiny MLP
blocks split by ``torch._dynamo.graph_break()`` (1 and 4 breaks at 70% of plain Inductor's measured
step peak, 2 breaks with dropout at 50%, 1 break at 40%, which the first step refuses before it runs
over it, naming a budget, and the second step's re-plan may refuse again, naming slightly more): from the
step ``STEPS_OVER_ALLOWED`` documents on (the first), the measured step peak is under the budget (or the
named budget, retried), gradients equal plain Inductor's, report.md
shows each graph's share, and the step's own window measures the whole step; with a simulator made
wrong on purpose, a measured step over the budget re-plans every graph and the next measured step
fits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import pytest
import torch
from torch import nn

import remat
from remat.errors import BudgetInfeasibleError
from remat.measure import close_open_window
from remat.step_eager import FIRST_STEP_ACTION
from remat.passes.joint_graph import eager_loss_reserve_bytes
from remat.step_budget import (StepAccount, StepGraph, composed_peak_bytes, later_demand_bytes, share_in_step, slot_of,
                                step_overruns, step_totals)
from remat.step_graph import with_check_error
from conftest import assert_grads_close, grads_of, prime_loss_weights, run_step, scale_simulated_peaks

# The steps that may run over at a budget the step's leanest plans meet (remat/step_budget.py): none.
# Step 1 plans each graph a graph break follows at its leanest plan (the later graphs are unknown);
# step 2's re-plans are all made at its first graph's entry, before anything of it runs.
STEPS_OVER_ALLOWED = 0
STEPS = 4
SIM_SCALE = 0.5          # the wrong simulator's peaks (test_a_measured_step_over_the_budget_re_plans_every_graph)


def graph(graph_id: str, held: int, peak: int, grads: int = 0, inputs: int = 0, target: int = 100,
          **floors: int) -> StepGraph:
    return StepGraph(graph_id, slot_of(graph_id), held, inputs, grads, 10, peak, target, **floors)


# ---- the step's condition and the account, on plain numbers ---------------------------------

OVERRUN_TABLE = [
    # graphs (held, peak, grads, inputs), target 100 -> positions over
    ([(30, 60, 0, 0), (10, 60, 0, 5)], ()),                    # 30 + 5 + 60 = 95
    ([(30, 60, 0, 0), (10, 66, 0, 5)], (1,)),                  # 30 + 5 + 66 = 101
    ([(50, 60, 0, 0), (10, 55, 45, 5)], (0, 1)),               # 45 + 60 = 105; 50 + 5 + 55 = 110
    ([(10, 80, 0, 0), (10, 40, 21, 0)], (0,)),                 # graph 1's gradients 21 next to graph 0's peak 80
    ([(40, 95, 0, 7), (30, 20, 0, 5), (5, 31, 0, 0)], (2,)),   # the first graph's inputs count 0; 40 + 30 + 31 = 101
]


@pytest.mark.parametrize(("rows", "over"), OVERRUN_TABLE)
def test_step_overruns_table(rows, over):
    graphs = tuple(graph(f"g{i}", h, p, g, a) for i, (h, p, g, a) in enumerate(rows))
    assert step_overruns(graphs) == over


def test_a_plan_is_judged_in_its_step_on_the_peak_inductors_check_read():
    """A plan whose check read under its simulated peak is not over the step for the simulated one; one read over is."""
    simulated_over = (graph("g0", 30, 60), replace(graph("g1", 10, 66, inputs=5), checked_peak_bytes=60))
    assert step_overruns(simulated_over) == ()
    checked_over = (graph("g0", 30, 60), replace(graph("g1", 10, 60, inputs=5), checked_peak_bytes=66))
    assert step_overruns(checked_over) == (1,)


def test_the_composed_peak_is_the_largest_total_the_condition_bounds():
    terms = [(40, 7, 0, 95), (30, 5, 3, 20), (5, 0, 2, 31)]    # (held, inputs, grads, peak), forward order
    assert step_totals(terms) == (3 + 2 + 95, 40 + 5 + 2 + 20, 40 + 30 + 0 + 31)
    assert composed_peak_bytes(terms) == 101 and composed_peak_bytes([]) == 0


def test_later_demand_is_the_largest_next_to_the_graphs_between():
    later = (graph("a", 0, 0, grads=5, inputs=2, floor_peak_bytes=30, floor_held_bytes=8, no_remat_peak_bytes=50),
             graph("b", 0, 0, grads=5, inputs=3, floor_peak_bytes=20, floor_held_bytes=4, no_remat_peak_bytes=40))
    assert later_demand_bytes(later) == max(2 + 30 - 5, 8 + 3 + 20 - 5)
    assert later_demand_bytes(later, floor=False) == max(2 + 50 - 5, 50 + 3 + 40 - 5)


def test_share_next_to_pending_graphs_and_in_a_known_sequence():
    earlier = (graph("g0", held=30, peak=60, grads=7),)
    first_step = share_in_step(earlier, (), 100, 5, 6, 10, False)
    assert (first_step.kind, first_step.index, first_step.reserved_later_bytes) == ("break-partial", 1, 0)
    assert first_step.target_bytes == 100 - 30 - 5 and first_step.loose_target_bytes == 100 - 30 - 5
    later = (graph("g1", 0, 0, grads=9, inputs=4, floor_peak_bytes=29, floor_held_bytes=4, no_remat_peak_bytes=40),)
    known = share_in_step((), later, 100, 5, 6, 10, True, own_floor_bytes=20)
    assert known.kind == "break" and known.later_grad_bytes == 9 and known.input_activation_bytes == 0
    assert known.reserved_later_bytes >= later_demand_bytes(later) == 4 + 29 - 9
    assert "Graph 1 of 2 of the step" in known.explain() and "reserved for the later graphs" in known.explain()


def test_account_tracks_pending_graphs_and_the_sequence():
    account = StepAccount()
    account.note_plan(graph("g0", held=30, peak=60))
    account.note_plan(graph("g1", held=10, peak=50, inputs=5))
    assert account.share_for("g0", 100, 0, 0, 10) is None, "alone in its step: the whole budget"
    account.forward_entered("g0")
    share = account.share_for("g1", 100, 5, 0, 10)
    assert share is not None and share.held_before_bytes == 30 and share.kind == "break-partial"
    # eager code reads its outputs (a loss outside the model): as unknown as a later graph, so its leanest plan
    lean = account.share_for("g1", 100, 5, 0, 10, eager_follows=True)
    assert lean is not None and lean.kind == "break-smallest" and lean.held_before_bytes == 30
    assert account.share_for("g0", 100, 0, 0, 10, eager_follows=True) is None, "nothing pending: alone in its step"
    account.forward_entered("g1")
    assert account.check_entry("g1") is None, "the first step: nothing to re-plan at entry"
    assert account.backward_done("g1") is None
    assert account.backward_done("g0") == ("g0", "g1") == account.sequence
    account.note_plan(graph("g1_r1", held=10, peak=66, inputs=5))   # a re-plan of g1 peaking higher
    account.forward_entered("g0")
    account.forward_entered("g1")
    assert "over the step target" in account.check_entry("g1")
    assert set(account.overruns(account.sequence)) == {"g1"}
    assert account.step_peak_bytes(account.sequence) == max(60, 30 + 5 + 66)
    assert account.provisional(account.sequence) == ()
    account.note_plan(graph("g0_r1", held=5, peak=40, provisional=True))   # planned before the step was known
    assert account.provisional(account.sequence) == ("g0",)


def test_an_earlier_graph_reserves_a_later_one_at_its_floor_times_the_check_error():
    """A later graph whose running plan Inductor's check read 20% over its simulated peak is reserved its floors 20% up
    by the graphs before it (``with_check_error``): its plans are judged on the check. Read under: unchanged."""
    later = graph("g1", held=4, peak=50, grads=2, inputs=3, floor_peak_bytes=40, floor_held_bytes=4,
                  no_remat_peak_bytes=70)
    under = replace(later, checked_peak_bytes=45)
    assert with_check_error(later) is later and with_check_error(under) is under
    raised = with_check_error(replace(later, checked_peak_bytes=60))
    assert (raised.floor_peak_bytes, raised.no_remat_peak_bytes) == (48, 84)
    account = StepAccount()
    for g in (graph("g0", held=30, peak=60), later):
        account.note_plan(g)
        account.forward_entered(g.slot)
    assert account.backward_done("g1") is None and account.backward_done("g0") == ("g0", "g1")
    before = account.share_for("g0", 200, 0, 0, 10)
    account.note_checked("g1", 60)
    after = account.share_for("g0", 200, 0, 0, 10)
    assert (before.later_estimate_bytes, before.later_ceiling_bytes) == (3 + 40 - 2, 3 + 70 - 2)
    assert (after.later_estimate_bytes, after.later_ceiling_bytes) == (3 + 48 - 2, 3 + 84 - 2)
    assert after.reserved_later_bytes > before.reserved_later_bytes and after.target_bytes < before.target_bytes


def test_a_first_graph_a_break_follows_gets_a_share_alone_in_its_step():
    """Nothing pending and no sequence known: alone, the whole budget (None), unless a graph break
    follows it, when it is planned as the first of a step whose later graphs are unknown."""
    account = StepAccount()
    assert account.share_for("g0", 100, 0, 7, 10) is None
    share = account.share_for("g0", 100, 0, 7, 10, follows=True)
    assert share is not None and (share.kind, share.index, share.held_before_bytes) == ("break-smallest", 0, 0)
    account.forward_entered("g0")
    assert account.backward_done("g0") == ("g0",) and account.sequence == (), "one graph: a step, not a sequence"


def test_the_leanest_plan_is_the_least_held_plus_peak_near_the_smallest_peak():
    """A planner (plain numbers) whose smallest peak, 100, saves 60 uncapped; at 135 (the last target
    near it) a plan peaks at 130 saving 5; capped at 0 saved, the smallest peak's target plans at
    peak 100 saving 10, the last target's at 130 saving 2: the leanest is (100, 10), as
    110 < 132 < 135 < 160, and capped plans are asked at the first and the last target only, one pass first."""
    from types import SimpleNamespace

    from remat.step_fit import leanest_plan

    capped_targets = []

    def plan_at(target, saved_cap_bytes=None, saved_cap_search="greedy"):
        if target < 100:
            raise BudgetInfeasibleError("no plan", budget_bytes=0, min_feasible_bytes=100, min_budget_bytes=0,
                                        reasons=())
        if saved_cap_bytes is not None:
            capped_targets.append((target, saved_cap_search))
            if target >= 135:
                return SimpleNamespace(predicted_peak_bytes=130, saved=2, target_bytes=target)
            return SimpleNamespace(predicted_peak_bytes=100, saved=10, target_bytes=target)
        if target >= 135:
            return SimpleNamespace(predicted_peak_bytes=130, saved=5, target_bytes=target)
        return SimpleNamespace(predicted_peak_bytes=100, saved=60, target_bytes=target)

    plan = leanest_plan(plan_at, lambda p: p.saved)
    assert (plan.saved, plan.predicted_peak_bytes) == (10, 100)
    assert capped_targets == [(100, "one-pass-first"), (135, "one-pass-first")], "a provisional plan's caps: one pass first"


COPIES_TABLE = [
    # (held, peak) of a plan -> graphs like it the step admits: 10 held before, inputs 5, gradients 8, target 100
    ((20, 50), 2),    # 65, then + 20 per graph: 85, 105
    ((5, 60), 4),     # 75, then + 8 per graph (its gradients, larger than what it holds): 83, 91, 99, 107
    ((0, 70), 2),     # 85, 93, 101: holding nothing, the later graphs' gradients still count
    ((0, 85), 1),     # 100: its own run at the target; a later graph's gradients are over it
    ((0, 86), 0),     # its own run alone breaks the target
]


@pytest.mark.parametrize(("plan", "copies"), COPIES_TABLE)
def test_copies_admitted_table(plan, copies):
    from remat.step_fit import copies_admitted

    share = share_in_step((graph("g0", held=10, peak=60),), (), 100, 5, 8, 10, False, smallest=True)
    assert (share.kind, share.held_before_bytes, share.input_activation_bytes, share.own_grad_bytes) == \
        ("break-smallest", 10, 5, 8)
    assert copies_admitted(share, *plan) == copies


RUNS_OVER_TABLE = [
    # (held before, inputs, plan's peak, budget) -> its own run next to what is live is over the budget
    ((10, 5, 80, 100), False),     # 95: within the budget (over the step target of 90: the second step decides)
    ((10, 5, 86, 100), True),      # 101
    ((0, 0, 500, 100), False),     # nothing live before it: Inductor's check judges the first graph
    ((10, 5, 500, None), False),   # no budget
]


@pytest.mark.parametrize(("numbers", "over"), RUNS_OVER_TABLE)
def test_runs_over_next_to_live_table(numbers, over):
    from remat.step_fit import runs_over_next_to_live

    held_before, inputs, peak, budget = numbers
    share = share_in_step((graph("g0", held=held_before, peak=60),) if held_before else (), (), 90, inputs, 8, 10,
                          False, smallest=True)
    assert runs_over_next_to_live(share, 3, peak, budget) is over


def test_a_first_step_graph_whose_own_run_is_over_the_budget_is_refused_before_it_runs():
    """A graph of the first step (a break follows it) whose leanest plan, next to what the earlier graph holds
    and its inputs, is over the budget itself: ``fit_in_step`` asks ``fit`` (which names the budget the step
    needs) instead of taking the plan; within the budget (over the step target only) the plan is taken."""
    from types import SimpleNamespace

    from remat.step_fit import fit_in_step

    share = share_in_step((graph("g0", held=10, peak=60),), (), 90, 5, 8, 10, False, smallest=True)
    asked = []

    def fit(share):
        asked.append(share)
        raise BudgetInfeasibleError("the step needs 120 B", budget_bytes=100, min_feasible_bytes=86,
                                    min_budget_bytes=120, reasons=())

    def plan_at(peak):
        return lambda target, saved_cap_bytes=None, best_effort=None, saved_cap_search="greedy": \
            SimpleNamespace(predicted_peak_bytes=peak, saved=3, target_bytes=target)

    with pytest.raises(BudgetInfeasibleError, match="needs 120"):
        fit_in_step(share, fit, plan_at(86), lambda p: p.saved, budget_bytes=100)
    plan, kept = fit_in_step(share, fit, plan_at(80), lambda p: p.saved, budget_bytes=100)
    assert plan.predicted_peak_bytes == 80 and kept.kind == "break-smallest" and len(asked) == 1


def test_a_first_step_graph_no_plan_fits_is_refused_with_the_shares_name():
    """A graph of the first step with no break after it (kind "break-partial") that no plan fits next to the earlier
    graph: ``fit_in_step`` looks for its smallest-peak plan at the smallest peak the share's error names; when that
    search is refused too, the error raised is the share's, naming a budget for the step, not the search's own,
    which names one by a lone graph's rule (rand-brk-1535's dynamic third graph, before session 45: "budget
    274.96 kB is below the smallest feasible budget 0.0001597 GB"; the share's 371,976 B then fitted at 0.944x)."""
    from remat.step_fit import PROVISIONAL_NOTE, fit_in_step

    share = share_in_step((graph("g0", held=10, peak=60),), (), 90, 5, 8, 10, False)
    assert share.kind == "break-partial"

    def fit(share):
        raise BudgetInfeasibleError("the step needs 120 B", budget_bytes=100, min_feasible_bytes=70,
                                    min_budget_bytes=120, reasons=())

    def plan_at(target, saved_cap_bytes=None, best_effort=None, saved_cap_search="greedy"):
        raise BudgetInfeasibleError("a lone graph needs 74 B", budget_bytes=100, min_feasible_bytes=target + 1,
                                    min_budget_bytes=74, reasons=())

    with pytest.raises(BudgetInfeasibleError, match="needs 120") as refused:
        fit_in_step(share, fit, plan_at, lambda p: 0, budget_bytes=100)
    assert refused.value.min_budget_bytes == 120
    assert str(refused.value).endswith(PROVISIONAL_NOTE)    # the later graphs are unknown: it may not be the last name


def test_the_leanest_plan_admits_the_most_graphs_like_it_before_the_least_held_plus_peak():
    """Of (held 60, peak 100) and (held 40, peak 135) the first has the least held + peak, but in a step
    target of 300 only 4 graphs like it fit (100 + 3 * 60 <= 300 < 100 + 4 * 60) against 5 like the
    second (135 + 4 * 40 <= 300): the second is taken. Equal copies fall back to the least held + peak."""
    from types import SimpleNamespace

    from remat.step_fit import leanest_plan

    def plan_at(target, saved_cap_bytes=None, saved_cap_search="greedy"):
        if target < 100:
            raise BudgetInfeasibleError("no plan", budget_bytes=0, min_feasible_bytes=100, min_budget_bytes=0,
                                        reasons=())
        peak, saved = (135, 40) if target >= 135 else (100, 60)
        return SimpleNamespace(predicted_peak_bytes=peak, saved=saved, target_bytes=target)

    def copies(plan, target=300):
        return (target - plan.predicted_peak_bytes) // plan.saved + 1

    assert leanest_plan(plan_at, lambda p: p.saved, copies).predicted_peak_bytes == 135
    assert leanest_plan(plan_at, lambda p: p.saved, lambda p: 1).predicted_peak_bytes == 100


def test_the_report_names_the_share_not_headroom_as_the_planning_targets_cut(tmp_path):
    """report.md is rendered before the share is known; the split's writer restates its
    planning-target line (it called the share's cut "71% headroom" on GPT-2's loss graph)."""
    from remat.distributed import write_share_to_dump

    (tmp_path / "report.md").write_text("# remat report: graph_001\n\n- planning target: 1.67 MB (the budget less "
                                        "71% headroom, kept for what the memory simulator may miss)\n- solver: greedy\n")
    share = share_in_step((graph("g0", held=30, peak=60),), (), 100, 5, 6, 10, False)
    write_share_to_dump(str(tmp_path), share)
    report = (tmp_path / "report.md").read_text()
    assert "headroom" not in report.split("## Step budget split")[0]
    assert "- planning target: 1.67 MB (this graph's share of the step's target: see \"Step budget split\" below)" \
        in report and "- solver: greedy" in report and report.count("## Step budget split") == 1


def test_a_graph_run_twice_before_its_backward_is_not_a_sequence():
    account = StepAccount()
    account.note_plan(graph("g0", held=1, peak=1))
    account.note_plan(graph("g1", held=1, peak=1))
    for slot in ("g0", "g1", "g0"):
        account.forward_entered(slot)
    assert account.backward_done("g0") is None and account.sequence == ()
    assert account.interleaved_runs == 1     # StepHooks warns once (step_loop.INTERLEAVED_RUNS_WARNING)


def test_consecutive_runs_of_a_graph_are_a_sequence_and_stack_in_its_share():
    """g0 run twice, then g1 twice (blocks of two kinds compiled one by one): a sequence with each run; g0's share
    counts its 2 runs stacking (run 1 next to run 0's held bytes) and g1 after both; the composed peak counts every
    run. One graph's runs alone are not a sequence (its own window measures them: window_runs.py)."""
    account = StepAccount()
    account.note_plan(graph("g0", held=10, peak=40, grads=3))
    account.note_plan(graph("g1", held=20, peak=50, inputs=5, grads=4))
    for slot in ("g0", "g0", "g1", "g1"):
        account.forward_entered(slot)
    for slot in ("g1", "g1", "g0"):
        assert account.backward_done(slot) is None
    assert account.backward_done("g0") == ("g0", "g0", "g1", "g1") == account.sequence
    share = account.share_for("g0", 1000, 0, 3, 10)
    assert (share.kind, share.repeats, share.held_before_bytes) == ("break", 2, 0)
    assert share.runs_peak_bytes(10, 40) == max(0 + 0 + 40 + 3, 10 + 0 + 40)
    later = account.share_for("g1", 1000, 5, 4, 10)
    assert (later.index, later.repeats, later.held_before_bytes) == (2, 2, 20)
    assert account.step_peak_bytes(account.sequence) == max(
        3 + 4 + 4 + 40, 10 + 4 + 4 + 40, 20 + 5 + 4 + 50, 40 + 5 + 50)
    alone = StepAccount()
    for slot in ("g0", "g0"):
        alone.forward_entered(slot)
    assert alone.backward_done("g0") is None and alone.backward_done("g0") is None and alone.sequence == ()


# ---- end to end: tiny MLP blocks split by graph breaks ---------------------------------------

def _block(width: int, hidden: int, depth: int, dropout: float) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(width, hidden), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Dropout(dropout), nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(hidden, width))


class BrokenBlocks(nn.Module):
    """Residual MLP blocks with a graph break before each but the first (written out: a graph
    break inside a loop makes Dynamo run the whole frame eagerly)."""

    def __init__(self, breaks: int, dropout: float = 0.0, width: int = 128, hidden: int = 256, depth: int = 3) -> None:
        super().__init__()
        assert 0 <= breaks <= 4
        self.breaks = breaks
        self.blocks = nn.ModuleList(_block(width, hidden, depth, dropout) for _ in range(breaks + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](x) + x
        if self.breaks >= 1:
            torch._dynamo.graph_break()
            x = self.blocks[1](x) + x
        if self.breaks >= 2:
            torch._dynamo.graph_break()
            x = self.blocks[2](x) + x
        if self.breaks >= 3:
            torch._dynamo.graph_break()
            x = self.blocks[3](x) + x
        if self.breaks >= 4:
            torch._dynamo.graph_break()
            x = self.blocks[4](x) + x
        return x


def _measured_steps(compiled, model, x, steps: int, peaks: Optional[list[int]] = None) -> tuple[list[int], dict]:
    peaks, grads = [] if peaks is None else peaks, {}
    for _ in range(steps):
        peaks.append(remat.measure_peak_bytes(lambda: run_step(compiled, model, (x,))).peak_bytes)
        grads = grads_of(model)
    return peaks, grads


def _run_under(model, x, budget_bytes: int, dump_dir) -> tuple[remat.RematBackend, list[int], dict, int]:
    """Steps under ``budget_bytes``; an infeasibility error is retried at the budget it names: once, or twice
    where the first came in the first step, before it ran (a lower bound: the step's graphs were not all known;
    ``step_fit.runs_over_next_to_live``). No step measured before a refusal is over its budget."""
    refused_before_a_step = False
    for attempt in range(3):
        backend = remat.backend(budget_gb=budget_bytes / 1e9, dump_dir=dump_dir / f"try{attempt}")
        torch._dynamo.reset()
        peaks: list[int] = []
        try:
            peaks, grads = _measured_steps(torch.compile(model, backend=backend), model, x, STEPS, peaks)
            return backend, peaks, grads, backend.options.budget_bytes
        except BudgetInfeasibleError as error:
            print(f"refused at {budget_bytes} B after the steps measured {peaks}, naming {error.min_budget_bytes} B")
            assert attempt == 0 or (attempt == 1 and refused_before_a_step), \
                f"the budget the error named was refused again: {error}"
            assert all(peak <= budget_bytes for peak in peaks), f"steps {peaks} ran over {budget_bytes} B before the refusal"
            assert error.min_budget_bytes > budget_bytes
            refused_before_a_step = not peaks
            budget_bytes = error.min_budget_bytes
    raise AssertionError("unreachable")


@pytest.mark.e2e
@pytest.mark.parametrize(("breaks", "fraction", "dropout"),
                         [(1, 0.7, 0.0), (4, 0.7, 0.0), (2, 0.5, 0.1), (1, 0.4, 0.0)])   # 40%: refused, names ~43%
def test_the_step_fits_the_budget_across_graph_breaks(breaks, fraction, dropout, tmp_path):
    torch.manual_seed(0)
    model, x = BrokenBlocks(breaks, dropout), torch.randn(512, 128)
    torch._dynamo.reset()
    plain_peaks, plain_grads = _measured_steps(torch.compile(model, backend="inductor"), model, x, 2)
    asked = int(fraction * plain_peaks[-1])
    backend, peaks, grads, budget = _run_under(model, x, asked, tmp_path)
    if fraction < 0.45:
        assert budget > asked, "this budget is below the step's floor: the first step refuses it"
    slots = {g.graph_id.split("_r")[0] for g in backend.compiled_graphs}
    assert len(slots) == breaks + 1
    print(f"{breaks} break(s), dropout {dropout}, {fraction:.0%} of plain Inductor's step peak {plain_peaks[-1]} B: "
          f"budget {budget} B, steps measured {peaks}, events {[e.action for e in backend.feedback_events]}")
    late = peaks[STEPS_OVER_ALLOWED:]
    assert max(late) <= budget, (f"{breaks} break(s) at {fraction:.0%} of plain Inductor's {plain_peaks[-1]} B: "
                                 f"steps measured {peaks} against {budget} B")
    shared = [g for g in backend.compiled_graphs if g.step_share is not None and g.step_share.kind == "break"]
    assert shared, "the graphs were re-planned under their shares of the step"
    report = open(f"{shared[-1].dump_path}/report.md").read()
    assert "## Step budget split" in report and f"of {breaks + 1} of the step" in report
    assert_grads_close(grads, plain_grads)
    # Unmeasured steps (no profiler around them): the step's own window measures the whole step.
    run_step(torch.compile(model, backend=backend), model, (x,))
    close_open_window()
    # (the loop measured the steps the test measured too, reading their sessions: remat/measure_host.py)
    *_, event = [e for e in backend.feedback_events if e.graph_id.startswith("step:")]
    assert event.action == "within budget" and event.measured_peak_bytes <= budget


@pytest.mark.e2e
def test_best_effort_runs_the_steps_of_a_budget_the_first_step_would_refuse():
    """``best_effort=True`` at 40% of plain Inductor's step peak (refused in the first step otherwise, above): the
    steps run, with warnings, and no ``BudgetInfeasibleError``."""
    torch.manual_seed(0)
    model, x = BrokenBlocks(1), torch.randn(512, 128)
    torch._dynamo.reset()
    plain_peaks, _ = _measured_steps(torch.compile(model, backend="inductor"), model, x, 1)
    backend = remat.backend(budget_gb=0.4 * plain_peaks[-1] / 1e9, best_effort=True)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="remat"):
        peaks, _ = _measured_steps(torch.compile(model, backend=backend), model, x, 2)
    assert len(peaks) == 2


@pytest.mark.e2e
def test_an_unbudgeted_step_split_at_graph_breaks_is_predicted_from_its_records():
    """Without a budget nothing composes the step at run time; its records carry what composing it
    needs (each graph's activation inputs and parameter gradients), and the step they compose
    (``composed_peak_bytes``) is the measured step peak, less one known over-count: the first
    graph's held bytes include its activation input, the batch, resident at step start (a
    conservative count the planner shares). Leaving out the second graph's activation inputs,
    held through its backward, under-predicts the step."""
    torch.manual_seed(0)
    model, x = BrokenBlocks(1), torch.randn(512, 128)
    batch_bytes = x.numel() * x.element_size()
    backend = remat.backend(None)
    torch._dynamo.reset()
    peaks, _ = _measured_steps(torch.compile(model, backend=backend), model, x, 3)
    records = list({g.graph_id.split("_r")[0]: g for g in backend.compiled_graphs}.values())
    assert len(records) == 2
    assert records[0].input_activation_bytes == records[1].input_activation_bytes == batch_bytes
    assert records[0].param_grad_bytes == sum(p.numel() * p.element_size() for p in model.blocks[0].parameters())
    # no eager loss is reserved on the first graph's outputs (the second graph takes them), as under a budget's
    # share; the last graph's outputs go to the eager loss of run_step
    assert records[0].eager_loss_bytes == 0 and records[1].eager_loss_bytes == eager_loss_reserve_bytes(records[1].facts) > 0
    terms = [(r.plan.saved_bytes + r.input_activation_bytes, r.input_activation_bytes, r.param_grad_bytes,
              r.plan.predicted_peak_bytes) for r in records]
    predicted = composed_peak_bytes(terms)
    print(f"composed {predicted} B, measured {peaks}, terms {terms}")
    assert abs(predicted - batch_bytes - peaks[-1]) <= 0.005 * peaks[-1]
    without_inputs = composed_peak_bytes([(h - a, 0, g, p) for h, a, g, p in terms])
    assert without_inputs < 0.97 * peaks[-1]


@pytest.fixture
def scaled_simulator(monkeypatch):
    """Every simulated peak scaled by ``SIM_SCALE``: the planner believes plans use half what they do."""
    scale_simulated_peaks(monkeypatch, SIM_SCALE)


@pytest.mark.e2e
def test_a_measured_step_over_the_budget_re_plans_every_graph(scaled_simulator):
    """A simulator 50% low (Inductor's check off), 90% of plain Inductor's step peak: the step window
    measures the whole step over the budget (the held bytes, inputs and gradients the step composes
    are real bytes, so the composed error is less than the simulator's), every graph is re-planned
    at target / (measured / predicted), and the next measured step is under it; gradients equal
    plain Inductor's."""
    torch.manual_seed(0)
    model, x = BrokenBlocks(1), torch.randn(512, 128)
    prime_loss_weights(model, (x,))   # (as the file's earlier tests left them: run alone, the test measured the same)
    torch._dynamo.reset()
    plain = torch.compile(model, backend="inductor")
    plain_peak = max(remat.measure_peak_bytes(lambda: run_step(plain, model, (x,))).peak_bytes for _ in range(2))
    plain_grads = grads_of(model)
    backend = remat.backend(budget_gb=0.9 * plain_peak / 1e9, inductor_check=False)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with pytest.warns(UserWarning, match="a step of 2 graphs measured a peak"):
        for _ in range(7):
            run_step(compiled, model, (x,))
        close_open_window()
    # (step 0: the first step, measured whole; its plans are provisional, and nothing it held is eager here)
    assert [e.action for e in backend.feedback_events if e.step == 0] == [FIRST_STEP_ACTION + "within budget"]
    steps = [e for e in backend.feedback_events if e.graph_id.startswith("step:") and e.step > 0]
    budget = backend.options.budget_bytes
    assert [e.action for e in steps][:1] == ["re-planned"] and steps[0].measured_peak_bytes > budget
    print("measured steps:", [(e.action, e.measured_peak_bytes, e.factor) for e in steps], backend.options.budget_bytes)
    running = {slot_of(g.graph_id): g for g in backend.compiled_graphs}   # each graph's last plan
    assert all(g.correction is not None and g.correction.factor == steps[0].factor for g in running.values())
    assert steps[-1].action == "within budget" and steps[-1].measured_peak_bytes <= backend.options.budget_bytes
    assert_grads_close(grads_of(model), plain_grads)


def _second_compile_raises(monkeypatch, error: Exception) -> list:
    """``RematBackend._compile`` raising ``error`` at the second graph's compile (once), compiling every other; the
    graphs it was asked to compile, in order."""
    from remat.backend import RematBackend

    compile_graph, compiles = RematBackend._compile, []

    def compile_or_raise(self, gm, example_inputs):
        compiles.append(gm)
        if len(compiles) == 2:
            raise error
        return compile_graph(self, gm, example_inputs)

    monkeypatch.setattr(RematBackend, "_compile", compile_or_raise)
    return compiles


def _first_step_measured(backend) -> bool:
    first = [e for e in backend.feedback_events if e.step == 0]
    return bool(first) and first[0].action.startswith(FIRST_STEP_ACTION) and bool(first[0].measured_peak_bytes)


@pytest.mark.e2e
def test_a_step_a_refusal_abandons_leaves_the_next_backend_measuring(monkeypatch):
    """A refusal raised at the compile of a step's second graph (here forced: the first graph's forward ran, its window
    open) abandons the step: the window is closed unmeasured and the runs in flight forgotten
    (``window_runs.abandon_step``), so a retry in the same process, a new backend, measures its first step. Before
    session 46 the window stayed open: the retry's steps went unmeasured (in the corpus's floor retries, two budgets
    measured 1.062x and 1.079x at step 3 with nothing noticing)."""
    from remat._torch_dynamo import passthrough_error_class
    from remat.measure import open_window
    from remat.window_runs import runs_in_flight

    torch.manual_seed(0)
    model, x = BrokenBlocks(1), torch.randn(512, 128)
    with monkeypatch.context() as patch:
        compiles = _second_compile_raises(patch, passthrough_error_class(BudgetInfeasibleError)(BudgetInfeasibleError(
            "refused (forced by the test)", budget_bytes=1, min_feasible_bytes=2, min_budget_bytes=2, reasons=())))
        torch._dynamo.reset()
        with pytest.raises(BudgetInfeasibleError, match="forced by the test"):
            run_step(torch.compile(model, backend=remat.backend(budget_gb=0.05)), model, (x,))
    assert len(compiles) == 2 and open_window() is None and runs_in_flight() == 0
    torch._dynamo.reset()
    retry = remat.backend(budget_gb=0.05)
    run_step(torch.compile(model, backend=retry), model, (x,))
    close_open_window()
    assert _first_step_measured(retry), retry.feedback_events


@pytest.mark.e2e
def test_a_compile_dynamo_restarts_does_not_abandon_the_step(monkeypatch):
    """Dynamo's own exceptions raised from inside a compile (``TensorifyScalarRestartAnalysis``: Inductor's scalar
    tensorification raises one on the corpus's rand-brk-1522) are retried by Dynamo, and the step goes on: its window
    stays open and measures it (4d9d87a abandoned the step at any exception, and rand-brk-1522 at 50% of plain
    Inductor's peak then measured 1.294x its budget at step 3 with no step measured by the loop)."""
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis

    torch.manual_seed(0)
    model, x = BrokenBlocks(1), torch.randn(512, 128)
    compiles = _second_compile_raises(monkeypatch, TensorifyScalarRestartAnalysis("forced by the test"))
    torch._dynamo.reset()
    backend = remat.backend(budget_gb=0.05)
    run_step(torch.compile(model, backend=backend), model, (x,))
    close_open_window()
    assert len(compiles) == 3, "Dynamo compiled the second graph again"
    assert _first_step_measured(backend), backend.feedback_events
