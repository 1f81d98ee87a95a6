"""A plan Inductor's check accepted with room under its target: the room is searched for a faster plan
(``judge_loop.faster_within_check``), each try compiled and checked, and the plan that runs always
checked at or under the target. Pure bookkeeping on records, no compile."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from remat.compiled_graph import CompiledGraph
from remat.errors import BudgetInfeasibleError
from remat.inductor_verdict import judge_plan
from remat.judge_loop import (MAX_ROOM_REPLANS, ROOM_FRACTION, NoFasterPlan, faster_within_check, graph_compute_s,
                              stop_if_not_faster)

TARGET = 1000      # the check's target (real bytes)
BASE = 950         # the planning target before any correction (simulator units)
BUDGET = 1010


def _plan(simulated: int, extra_s: float) -> SimpleNamespace:
    return SimpleNamespace(predicted_peak_bytes=simulated, budget_bytes=BUDGET, est_extra_time_s=extra_s)


NO_FACTS = SimpleNamespace(nodes={})      # a graph whose compute is estimated at 0 s: any gain counts


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
                          base_target_bytes=BASE, judgement=verdict, facts=NO_FACTS)]


def _search(graphs: list[CompiledGraph], tries: list[tuple]):
    """(asked, replan, estimate) for ``faster_within_check``: try i plans as ``tries[i]`` (simulated, checked,
    est. extra seconds; a fifth-element ``compiled_extra_s`` when the compile's own plan differs from the
    estimate's); ``asked`` gets the simulated target each try planned at."""
    asked: list[int] = []

    def estimate(facts, correction):
        assert facts is NO_FACTS or facts.nodes
        asked.append(round(BASE / correction.factor))   # the simulated target it plans at
        return SimpleNamespace(est_extra_time_s=tries[len(asked) - 1][2])

    def compile_and_check(correction):
        simulated, checked, extra_s, *compiled = tries[len(asked) - 1]
        graphs.append(CompiledGraph(f"graph_000_r{len(asked) + 1}", "0/0", _plan(simulated, (compiled or [extra_s])[0]),
                                    (), None))
        return f"callable {len(asked)}", checked
    return asked, compile_and_check, estimate


def test_the_aim_is_where_the_line_through_the_two_checked_plans_meets_the_target():
    """First plan: simulated 900, checked 1200 (over 1000). Re-plan: simulated 800, checked 900. The line
    meets 1000 at a simulated 833 (not halfway); a plan there checking 985 and estimated faster replaces
    the re-plan."""
    graphs = _accepted_re_plan((900, 1200), (800, 900, 0.050))
    asked, replan, estimate = _search(graphs, [(845, 985, 0.020), (850, 999, 0.010)])
    fn = faster_within_check("re-plan's callable", graphs, replan, estimate)
    assert asked[0] == 833
    assert fn == "callable 1" and [g.graph_id for g in graphs] == ["graph_000_r2"]
    verdict = graphs[-1].judgement
    assert verdict.action.startswith("accepted: a faster plan") and verdict.checked_peak_bytes == 985
    assert [v.action for v in verdict.rejected] == ["re-plan", "accepted; then replaced by a faster plan"]
    # 985 is within ROOM_FRACTION of the target: no second try
    assert len(asked) == 1 and TARGET * (1 - ROOM_FRACTION) < 985


def test_a_try_over_the_target_narrows_the_interval_and_never_runs():
    graphs = _accepted_re_plan((900, 1100), (800, 900, 0.050))
    asked, replan, estimate = _search(graphs, [(850, 1050, 0.010), (820, 940, 0.030)])
    fn = faster_within_check("re-plan's callable", graphs, replan, estimate)
    # the first try checked 1050: the line from (800, 900) through (850, 1050) meets 1000 at 833
    assert asked == [850, 833]
    assert fn == "callable 2" and [g.graph_id for g in graphs] == ["graph_000_r3"]
    assert graphs[-1].judgement.checked_peak_bytes == 940
    assert len(asked) <= MAX_ROOM_REPLANS


@pytest.mark.parametrize(("tried", "graphs_made"), [
    ((850, 990, 0.050), 0),             # estimated no faster: not compiled
    ((850, 990, 0.010, 0.060), 1),      # the compile's own plan is slower than estimated: compiled, not run
    ((850, 1001, 0.010), 1),            # over the target: not run (a second try is asked, over again)
    ((850, None, 0.010), 1)])           # the code could not be read
def test_the_accepted_re_plan_stays_when_no_try_is_faster_under_the_target(tried, graphs_made):
    graphs = _accepted_re_plan((900, 1100), (800, 900, 0.050))
    made = []
    asked, replan, estimate = _search(graphs, [tried, tried])

    def counted(correction):
        made.append(correction)
        return replan(correction)
    fn = faster_within_check("re-plan's callable", graphs, counted, estimate)
    assert fn == "re-plan's callable" and len(made) == graphs_made * (2 if tried[1] == 1001 else 1)
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]
    assert graphs[-1].judgement.action == "accepted"


def test_no_room_or_a_graph_sharing_a_step_means_no_try():
    never = lambda correction, *rest: pytest.fail("nothing to search")  # noqa: E731
    tight = int(TARGET * (1 - ROOM_FRACTION)) + 1
    graphs = _accepted_re_plan((900, 1100), (800, tight, 0.050))
    assert faster_within_check("re-plan's callable", graphs, never, never) == "re-plan's callable"
    # a graph sharing a step is judged against its share: not searched
    graphs = _accepted_re_plan((900, 1100), (800, 900, 0.050))
    graphs[-1] = replace(graphs[-1], step_share=SimpleNamespace())
    assert faster_within_check("re-plan's callable", graphs, never, never) == "re-plan's callable"


def _accepted_first_plan(simulated: int, checked: int, extra_s: float, facts=NO_FACTS) -> list[CompiledGraph]:
    verdict = judge_plan(simulated, checked, TARGET, BUDGET, may_replan=True, graph_id="graph_000")
    assert verdict.action == "accepted"
    return [CompiledGraph("graph_000", "0/0", _plan(simulated, extra_s), (), None, graph_key="key",
                          base_target_bytes=BASE, judgement=verdict, facts=facts)]


def test_with_no_plan_over_the_target_the_aim_takes_the_accepted_plans_error_as_uniform():
    """A first plan simulated 900 and checked 800 against 1000 (the simulator over-predicted it): planned again
    at 900 x 1000 / 800 = 1125 in the simulator's units, above the planning target (950): the correction
    loosens it, which a measured correction never does, and the check judges the try before it runs."""
    graphs, corrections = _accepted_first_plan(900, 800, 0.050), []
    asked, replan, estimate = _search(graphs, [(1100, 990, 0.010)])

    def compile_and_check(correction):
        corrections.append(correction)
        return replan(correction)
    assert faster_within_check("first plan's callable", graphs, compile_and_check, estimate) == "callable 1"
    assert asked == [1125] and corrections[0].loosens and corrections[0].corrected_target(BASE) == 1125
    assert graphs[-1].judgement.checked_peak_bytes == 990
    measured = replace(corrections[0], loosens=False)       # the same factor from a measured step: capped
    assert measured.corrected_target(BASE) == BASE


def test_a_refusal_the_check_overruled_is_searched_above_the_planning_target():
    """The smallest-peak plan of a refused budget simulates above the planning target (960 > 950) and checks
    at 800 against 1000: the aim is 960 x 1000 / 800 = 1200; the try checks at 1040, over the target, so it
    does not run and the second try aims on the line through (960, 800) and (1150, 1040): 1118."""
    graphs = _accepted_first_plan(960, 800, 0.050)
    asked, replan, estimate = _search(graphs, [(1150, 1040, 0.010), (1100, 985, 0.012)])
    assert faster_within_check("smallest plan's callable", graphs, replan, estimate) == "callable 2"
    assert asked == [1200, 960 + (1000 - 800) * (1150 - 960) // (1040 - 800)]
    assert [g.graph_id for g in graphs] == ["graph_000_r3"] and graphs[-1].judgement.checked_peak_bytes == 985


def test_a_try_must_gain_a_share_of_the_graphs_compute():
    """The graph's nodes are estimated at 2 s of forward and backward: a try must be estimated
    ``ROOM_MIN_GAIN`` x 2 s = 20 ms faster; an accepted plan with no more extra time than that is not searched."""
    nodes = {"a": SimpleNamespace(role="forward", cost=SimpleNamespace(est_time_s=0.5)),
             "b": SimpleNamespace(role="backward", cost=SimpleNamespace(est_time_s=1.5)),
             "p": SimpleNamespace(role="primal", cost=SimpleNamespace(est_time_s=9.0))}
    facts = SimpleNamespace(nodes=nodes)
    assert graph_compute_s(facts) == 2.0 and graph_compute_s(None) == 0.0
    graphs = _accepted_first_plan(900, 800, 0.050, facts)
    asked, replan, estimate = _search(graphs, [(940, 990, 0.031)])
    fn = faster_within_check("first plan's callable", graphs, replan, estimate)
    assert fn == "first plan's callable" and len(asked) == 1 and len(graphs) == 1     # 19 ms faster: not compiled
    graphs = _accepted_first_plan(900, 800, 0.050, facts)
    asked, replan, estimate = _search(graphs, [(940, 990, 0.029)])
    assert faster_within_check("first plan's callable", graphs, replan, estimate) == "callable 1"   # 21 ms
    never = lambda correction, *rest: pytest.fail("nothing to gain")  # noqa: E731
    assert faster_within_check("first plan's callable", _accepted_first_plan(900, 800, 0.020, facts),
                               never, never) == "first plan's callable"


def test_a_refused_try_keeps_the_accepted_re_plan():
    graphs = _accepted_re_plan((900, 1100), (800, 900, 0.050))

    def refused(facts, correction):
        raise BudgetInfeasibleError("refused", budget_bytes=BUDGET, min_feasible_bytes=1, min_budget_bytes=1,
                                    reasons=())
    never = lambda correction: pytest.fail("refused: nothing to compile")  # noqa: E731
    assert faster_within_check("re-plan's callable", graphs, never, refused) == "re-plan's callable"
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]


def test_the_estimate_stops_a_plan_no_faster():
    plan = SimpleNamespace(est_extra_time_s=0.050)
    with pytest.raises(NoFasterPlan, match="not under"):
        stop_if_not_faster(plan, 0.050)
    stop_if_not_faster(plan, 0.051)


def test_a_huge_budget_with_nothing_recomputed_is_not_searched():
    """A budget of 1e308 bytes: the plan recomputes nothing, so there is nothing to search (and no float
    arithmetic on the target, which would overflow)."""
    huge = 10 ** 308
    verdict = judge_plan(900, 800, huge, huge, may_replan=True, graph_id="graph_000")
    graphs = [CompiledGraph("graph_000", "0/0", _plan(900, 0.0), (), None, graph_key="key", base_target_bytes=huge,
                            judgement=verdict, facts=NO_FACTS)]
    never = lambda correction, *rest: pytest.fail("nothing to search")  # noqa: E731
    assert faster_within_check("plan's callable", graphs, never, never) == "plan's callable"
