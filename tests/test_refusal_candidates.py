"""A budget the simulator refuses: Inductor's check judges the smallest-peak plan and, when that plan
checks over its target, the free min-cut plan too (``judge_loop.overrule_or_refuse``). The simulator
can rank two plans the wrong way round; the checked numbers decide which runs and which budget an
error names. Pure bookkeeping on records, no compile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from remat.compiled_graph import CompiledGraph
from remat.errors import BudgetInfeasibleError
from remat.inductor_check import CheckedPeak
from remat.inductor_verdict import Refusal
from remat.judge_loop import overrule_or_refuse

TARGET = 1000      # the planning target: the budget less 5% headroom
BUDGET = 1053


def _target_for(budget_bytes: int) -> int:
    return budget_bytes * 95 // 100


def _record(graph_id: str, simulated: int) -> CompiledGraph:
    error = BudgetInfeasibleError("refused", budget_bytes=BUDGET, min_feasible_bytes=1200, min_budget_bytes=1264,
                                  reasons=("saved activations",))
    return CompiledGraph(graph_id, "0/0", SimpleNamespace(predicted_peak_bytes=simulated), (), None,
                         base_target_bytes=TARGET, refusal=Refusal(error, _target_for))


def _candidate(graphs: list, checked: int):
    def compile_and_check():
        graphs.append(_record("graph_000_r1", 1500))        # the simulator thinks it larger
        return "free plan's callable", CheckedPeak(checked, checked, checked, 0, 0, 0, library_calls=frozenset({"mm"}))
    return compile_and_check


def test_the_free_mincut_plan_runs_when_it_checks_under_the_target_and_the_smallest_does_not():
    graphs = [_record("graph_000", 1200)]
    fn = overrule_or_refuse("smallest plan's callable", graphs, 1300, _candidate(graphs, 990))
    assert fn == "free plan's callable"
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]
    verdict = graphs[-1].judgement
    assert verdict.action.startswith("accepted: Inductor's check of the free min-cut plan") and "1300" in verdict.action
    assert verdict.checked_peak_bytes == 990 and verdict.rejected[0].checked_peak_bytes == 1300


def test_the_smallest_plan_that_checks_under_its_target_runs_without_compiling_the_candidate():
    graphs = [_record("graph_000", 1200)]
    never = lambda: pytest.fail("the candidate is compiled only when the smallest-peak plan checks over")  # noqa: E731
    assert overrule_or_refuse("smallest plan's callable", graphs, 999, never) == "smallest plan's callable"
    assert graphs[-1].judgement.action == "accepted: Inductor's check overrules the simulator"


@pytest.mark.parametrize(("smallest_checked", "free_checked", "named_from"), [
    (1100, 1050, 1050),     # the free plan checks lower: the budget named is the one its check fits
    (1050, 1100, 1050),     # the smallest-peak plan checks lower: its number names the budget
])
def test_when_both_check_over_the_budget_named_is_the_lower_checked_plans(smallest_checked, free_checked, named_from):
    graphs = [_record("graph_000", 1200)]
    with pytest.raises(BudgetInfeasibleError) as raised:
        overrule_or_refuse("smallest", graphs, smallest_checked, _candidate(graphs, free_checked))
    assert graphs == []
    error = raised.value
    assert error.min_feasible_bytes == named_from
    assert _target_for(error.min_budget_bytes) >= named_from > _target_for(error.min_budget_bytes - 1)


def test_a_candidate_whose_check_cannot_see_every_allocation_does_not_overrule():
    """The free plan checks under the target, but its graphs call a convolution (which may allocate
    inside itself) and the check is below the simulator's figure: the simulator's refusal stands."""
    graphs = [_record("graph_000", 1200)]

    def convolution_candidate():
        graphs.append(_record("graph_000_r1", 1500))
        return "free", CheckedPeak(990, 990, 990, 0, 0, 0, library_calls=frozenset({"convolution"}))

    with pytest.raises(BudgetInfeasibleError) as raised:
        overrule_or_refuse("smallest", graphs, 1300, convolution_candidate)
    assert graphs == [] and raised.value.min_feasible_bytes == 1200    # the simulator's figure stands
