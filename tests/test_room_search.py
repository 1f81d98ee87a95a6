"""A corrected re-plan Inductor's check accepted with room under its target: the room is searched for a
faster plan (``judge_loop.faster_within_check``), each try compiled and checked, and the plan that
runs always checked at or under the target. Pure bookkeeping on records, no compile."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from remat.compiled_graph import CompiledGraph
from remat.errors import BudgetInfeasibleError
from remat.inductor_verdict import judge_plan
from remat.judge_loop import MAX_ROOM_REPLANS, ROOM_FRACTION, NoFasterPlan, faster_within_check, stop_if_not_faster

TARGET = 1000      # the check's target (real bytes)
BASE = 950         # the planning target before any correction (simulator units)
BUDGET = 1010


def _plan(simulated: int, extra_s: float) -> SimpleNamespace:
    return SimpleNamespace(predicted_peak_bytes=simulated, budget_bytes=BUDGET, est_extra_time_s=extra_s)


def _accepted_re_plan(first: tuple[int, int], accepted: tuple[int, int, float]) -> list[CompiledGraph]:
    """The records after ``judge_compiled``: the first plan (simulated, checked) was re-planned, and the
    re-plan (simulated, checked, est. extra seconds) was accepted."""
    rejected = judge_plan(first[0], first[1], TARGET, BUDGET, may_replan=True, graph_id="graph_000")
    assert rejected.action == "re-plan"
    simulated, checked, extra_s = accepted
    verdict = judge_plan(simulated, checked, TARGET, BUDGET, may_replan=True, graph_id="graph_000_r1",
                         rejected=(rejected,))
    assert verdict.action == "accepted"
    return [CompiledGraph("graph_000_r1", "0/0", _plan(simulated, extra_s), (), None, graph_key="key",
                          base_target_bytes=BASE, judgement=verdict)]


def _replans(graphs: list[CompiledGraph], tries: list[tuple[int, int, float]], asked: list):
    """Each call plans the next of ``tries`` (simulated, checked, est. extra seconds), records the
    simulated target it was asked to plan at, and compiles it unless it is estimated no faster than
    asked (the partitioner's ``stop_if_not_faster``)."""
    def compile_and_check(correction, faster_than_s):
        asked.append(round(BASE / correction.factor))   # the simulated target it plans at
        simulated, checked, extra_s = tries[len(asked) - 1]
        stop_if_not_faster(SimpleNamespace(est_extra_time_s=extra_s), faster_than_s)
        graphs.append(CompiledGraph(f"graph_000_r{len(asked) + 1}", "0/0", _plan(simulated, extra_s), (), None))
        return f"callable {len(asked)}", checked
    return compile_and_check


def test_the_aim_is_where_the_line_through_the_two_checked_plans_meets_the_target():
    """First plan: simulated 900, checked 1200 (over 1000). Re-plan: simulated 800, checked 900. The line
    meets 1000 at a simulated 833 (not halfway); a plan there checking 985 and estimated faster replaces
    the re-plan."""
    graphs, asked = _accepted_re_plan((900, 1200), (800, 900, 0.050)), []
    tries = [(845, 985, 0.020), (850, 999, 0.030)]
    fn = faster_within_check("re-plan's callable", graphs, _replans(graphs, tries, asked))
    assert asked[0] == 833
    assert fn == "callable 1" and [g.graph_id for g in graphs] == ["graph_000_r2"]
    verdict = graphs[-1].judgement
    assert verdict.action.startswith("accepted: a faster plan") and verdict.checked_peak_bytes == 985
    assert [v.action for v in verdict.rejected] == ["re-plan", "accepted, then replaced by a faster plan"]
    # 985 is within ROOM_FRACTION of the target: no second try
    assert len(asked) == 1 and TARGET * (1 - ROOM_FRACTION) < 985


def test_a_try_over_the_target_narrows_the_interval_and_never_runs():
    graphs, asked = _accepted_re_plan((900, 1100), (800, 900, 0.050)), []
    fn = faster_within_check("re-plan's callable", graphs,
                             _replans(graphs, [(850, 1050, 0.010), (820, 940, 0.030)], asked))
    # the first try checked 1050: the line from (800, 900) through (850, 1050) meets 1000 at 833
    assert asked == [850, 833]
    assert fn == "callable 2" and [g.graph_id for g in graphs] == ["graph_000_r3"]
    assert graphs[-1].judgement.checked_peak_bytes == 940
    assert len(asked) <= MAX_ROOM_REPLANS


@pytest.mark.parametrize(("tried", "calls"), [((850, 990, 0.050), 1),    # estimated no faster: not compiled
                                              ((850, 1001, 0.010), 2),   # over the target: try again lower
                                              ((850, None, 0.010), 1)])  # the code could not be read
def test_the_accepted_re_plan_stays_when_no_try_is_faster_under_the_target(tried, calls):
    graphs, asked = _accepted_re_plan((900, 1100), (800, 900, 0.050)), []
    fn = faster_within_check("re-plan's callable", graphs, _replans(graphs, [tried, tried], asked))
    assert fn == "re-plan's callable" and len(asked) == calls
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]
    assert graphs[-1].judgement.action == "accepted"


def test_no_room_or_no_plan_above_means_no_try():
    never = lambda correction, faster_than_s: pytest.fail("nothing to search")  # noqa: E731
    tight = int(TARGET * (1 - ROOM_FRACTION)) + 1
    graphs = _accepted_re_plan((900, 1100), (800, tight, 0.050))
    assert faster_within_check("re-plan's callable", graphs, never) == "re-plan's callable"
    # the rejected plan simulated under the accepted one: no interval to search
    graphs = _accepted_re_plan((790, 1100), (800, 900, 0.050))
    assert faster_within_check("re-plan's callable", graphs, never) == "re-plan's callable"
    # a graph sharing a step is judged against its share: not searched
    graphs = _accepted_re_plan((900, 1100), (800, 900, 0.050))
    graphs[-1] = replace(graphs[-1], step_share=SimpleNamespace())
    assert faster_within_check("re-plan's callable", graphs, never) == "re-plan's callable"


def test_a_refused_try_keeps_the_accepted_re_plan():
    graphs = _accepted_re_plan((900, 1100), (800, 900, 0.050))

    def refused(correction, faster_than_s):
        raise BudgetInfeasibleError("refused", budget_bytes=BUDGET, min_feasible_bytes=1, min_budget_bytes=1,
                                    reasons=())
    assert faster_within_check("re-plan's callable", graphs, refused) == "re-plan's callable"
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]


def test_a_plan_no_faster_is_stopped_before_its_code_is_generated():
    """The partitioner's check: a try's plan estimated at or over the accepted plan's time raises
    ``NoFasterPlan`` (through Dynamo unwrapped); any plan passes when no bound is set."""
    plan = SimpleNamespace(est_extra_time_s=0.050)
    with pytest.raises(NoFasterPlan, match="not under"):
        stop_if_not_faster(plan, 0.050)
    stop_if_not_faster(plan, 0.051)
    stop_if_not_faster(plan, None)
