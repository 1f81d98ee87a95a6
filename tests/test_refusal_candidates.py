"""A budget the simulator refuses: Inductor's check judges the smallest-peak plan and, when that plan
checks over its target, the candidates in turn: the free min-cut plan, then checkpointing every
repeated block (``judge_loop.overrule_or_refuse``). The simulator
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
    plan = SimpleNamespace(predicted_peak_bytes=simulated, est_extra_time_s=0.0)   # nothing for the room search
    return CompiledGraph(graph_id, "0/0", plan, (), None, base_target_bytes=TARGET,
                         refusal=Refusal(error, _target_for, TARGET))


def _candidate(graphs: list, checked: int):
    def compile_and_check():
        graphs.append(_record("graph_000_r1", 1500))        # the simulator thinks it larger
        return "free plan's callable", CheckedPeak(checked, checked, checked, 0, 0, 0, library_calls=frozenset({"mm"}))
    return compile_and_check


def test_the_free_mincut_plan_runs_when_it_checks_under_the_target_and_the_smallest_does_not():
    graphs = [_record("graph_000", 1200)]
    fn = overrule_or_refuse("smallest plan's callable", graphs, 1300, (("free min-cut", _candidate(graphs, 990)),))
    assert fn == "free plan's callable"
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]
    verdict = graphs[-1].judgement
    assert verdict.action.startswith("accepted: Inductor's check of the free min-cut plan") and "1300" in verdict.action
    assert verdict.checked_peak_bytes == 990 and verdict.rejected[0].checked_peak_bytes == 1300


def test_the_smallest_plan_that_checks_under_its_target_runs_without_compiling_the_candidate():
    graphs = [_record("graph_000", 1200)]
    never = lambda: pytest.fail("the candidate is compiled only when the smallest-peak plan checks over")  # noqa: E731
    assert overrule_or_refuse("smallest plan's callable", graphs, 999, (("free min-cut", never),)) == "smallest plan's callable"
    assert graphs[-1].judgement.action == "accepted: Inductor's check overrules the simulator"


@pytest.mark.parametrize(("smallest_checked", "free_checked", "named_from"), [
    (1100, 1050, 1050),     # the free plan checks lower: the budget named is the one its check fits
    (1050, 1100, 1050),     # the smallest-peak plan checks lower: its number names the budget
    (1300, 1400, 1300),     # both check above the simulator's 1200: the check names the budget, not the
                            # simulator's figure (the plan it rests on is known to exceed that one)
])
def test_when_both_check_over_the_budget_named_is_the_lower_checked_plans(smallest_checked, free_checked, named_from):
    graphs = [_record("graph_000", 1200)]
    with pytest.raises(BudgetInfeasibleError) as raised:
        overrule_or_refuse("smallest", graphs, smallest_checked, (("free min-cut", _candidate(graphs, free_checked)),))
    assert graphs == []
    error = raised.value
    assert error.min_feasible_bytes == named_from
    assert _target_for(error.min_budget_bytes) >= named_from > _target_for(error.min_budget_bytes - 1)


def _candidate_named(graphs: list, graph_id: str, checked: int, compiled: list):
    def compile_and_check():
        compiled.append(graph_id)
        graphs.append(_record(graph_id, 1500))
        return f"{graph_id}'s callable", CheckedPeak(checked, checked, checked, 0, 0, 0, library_calls=frozenset({"mm"}))
    return compile_and_check


def test_the_per_block_checkpointing_plan_runs_when_it_checks_under_the_target_and_the_others_do_not():
    """The smallest-peak plan and the free min-cut plan check over the target; the second candidate,
    checkpointing every block, checks under it and runs; both rejections stay in its verdict."""
    graphs, compiled = [_record("graph_000", 1200)], []
    fn = overrule_or_refuse("smallest", graphs, 1300, (
        ("free min-cut", _candidate_named(graphs, "graph_000_r1", 1100, compiled)),
        ("per-block checkpointing", _candidate_named(graphs, "graph_000_r2", 995, compiled))))
    assert fn == "graph_000_r2's callable" and compiled == ["graph_000_r1", "graph_000_r2"]
    assert [g.graph_id for g in graphs] == ["graph_000_r2"]
    verdict = graphs[-1].judgement
    assert verdict.action.startswith("accepted: Inductor's check of the per-block checkpointing plan")
    assert [v.checked_peak_bytes for v in verdict.rejected] == [1300, 1100]


def test_the_first_candidate_under_the_target_runs_and_later_ones_are_not_compiled():
    graphs, compiled = [_record("graph_000", 1200)], []
    fn = overrule_or_refuse("smallest", graphs, 1300, (
        ("free min-cut", _candidate_named(graphs, "graph_000_r1", 990, compiled)),
        ("per-block checkpointing", _candidate_named(graphs, "graph_000_r2", 900, compiled))))
    assert fn == "graph_000_r1's callable" and compiled == ["graph_000_r1"]


def test_a_candidate_that_compiles_nothing_is_skipped_and_the_next_one_judged():
    """A candidate's ``compile()`` returns None where it is not worth a compile (the lean code generation's, where
    the search under it finds nothing lower: ``judge_loop._checked_candidate``); the next candidate is judged."""
    graphs, compiled = [_record("graph_000", 1200)], []
    fn = overrule_or_refuse("smallest", graphs, 1300, (
        ("lean code generation", lambda: None),
        ("per-block checkpointing", _candidate_named(graphs, "graph_000_r1", 990, compiled))))
    assert fn == "graph_000_r1's callable" and compiled == ["graph_000_r1"]
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]


def test_with_every_candidate_over_the_target_the_lowest_checked_names_the_budget():
    graphs, compiled = [_record("graph_000", 1200)], []
    with pytest.raises(BudgetInfeasibleError) as raised:
        overrule_or_refuse("smallest", graphs, 1300, (
            ("free min-cut", _candidate_named(graphs, "graph_000_r1", 1250, compiled)),
            ("per-block checkpointing", _candidate_named(graphs, "graph_000_r2", 1100, compiled))))
    assert graphs == [] and compiled == ["graph_000_r1", "graph_000_r2"]
    error = raised.value
    assert error.min_feasible_bytes == 1100
    assert _target_for(error.min_budget_bytes) >= 1100 > _target_for(error.min_budget_bytes - 1)


def test_a_candidate_whose_check_cannot_see_every_allocation_does_not_overrule():
    """The free plan checks under the target, but its graphs call a convolution (which may allocate
    inside itself) and the check is below the simulator's figure: it does not overrule, nor name the
    budget. The refusal stands, naming the budget the smallest-peak plan's check holds (1300: above the
    simulator's figure, so trusted)."""
    graphs = [_record("graph_000", 1200)]

    def convolution_candidate():
        graphs.append(_record("graph_000_r1", 1500))
        return "free", CheckedPeak(990, 990, 990, 0, 0, 0, library_calls=frozenset({"convolution"}))

    with pytest.raises(BudgetInfeasibleError) as raised:
        overrule_or_refuse("smallest", graphs, 1300, (("free min-cut", convolution_candidate),))
    assert graphs == [] and raised.value.min_feasible_bytes == 1300


def test_an_untrusted_smallest_plan_keeps_its_simulated_figure_against_a_higher_checked_candidate():
    """The smallest-peak plan's check is not trusted (None: lower than its simulated 1200, with a library
    call the check cannot see into), and the free plan checks at 1400, above the target: the smallest
    plan's simulated 1200 stands, so the error keeps the simulator's figure (before: it named the
    candidate's 1400; the corpus's hf-llama-eager floor went from 6.48 MB to 9.76 MB that way)."""
    graphs = [_record("graph_000", 1200)]
    with pytest.raises(BudgetInfeasibleError) as raised:
        overrule_or_refuse("smallest", graphs, None, (("free min-cut", _candidate(graphs, 1400)),))
    assert graphs == []
    assert raised.value.min_feasible_bytes == 1200 and raised.value.min_budget_bytes == 1264


def test_a_refused_re_plan_over_the_budget_compiles_and_judges_the_smallest_peak_plan(monkeypatch):
    """The first plan checks over the budget; the re-plan at the corrected target is refused by the
    simulator (no plan simulates that low). The smallest-peak plan, which checks under the target (the
    correction was the first plan's error, not its), is compiled and runs; the verdict keeps the first
    plan's rejection. This is the path a retry at a budget named from a check above the simulator's
    figure takes (``named_budget_after_check``)."""
    from remat import judge_loop

    checked = {"first": 1300, "smallest": 990}
    monkeypatch.setattr(judge_loop, "checked_peak_of", lambda capture, device, held, eager_loss_bytes=0: CheckedPeak(
        checked[capture], checked[capture], checked[capture], 0, 0, 0, library_calls=frozenset({"mm"})))
    plan = SimpleNamespace(predicted_peak_bytes=950, budget_bytes=BUDGET, fits_budget=True)
    graphs = [CompiledGraph("graph_000", "0/0", plan, (), None, graph_key="key", base_target_bytes=TARGET)]
    asked = []

    def recompile(correction, key, candidate):
        asked.append((round(correction.factor, 3), candidate))
        if candidate is None:
            raise BudgetInfeasibleError("refused at the corrected target", budget_bytes=BUDGET,
                                        min_feasible_bytes=900, min_budget_bytes=1300, reasons=())
        graphs.append(_record("graph_000_r1", 900))
        return "smallest plan's callable", SimpleNamespace(graphs="smallest")

    fn = judge_loop.judge_compiled("first plan's callable", SimpleNamespace(graphs="first"), "cpu", False, graphs,
                                   recompile)
    assert fn == "smallest plan's callable"
    assert asked == [(1.37, None), (1.37, judge_loop.SMALLEST_PEAK_CANDIDATE)]    # 1000 / int(1000 / (1300 / 950))
    assert [g.graph_id for g in graphs] == ["graph_000_r1"]
    verdict = graphs[-1].judgement
    assert verdict.action == "accepted: Inductor's check overrules the simulator" and verdict.checked_peak_bytes == 990
    assert [v.checked_peak_bytes for v in verdict.rejected] == [1300]


def test_a_refused_re_plan_keeps_the_last_plan_when_it_checks_within_the_budget(monkeypatch):
    """Over the target but within the budget: no further compile, the plan runs as "accepted over target"."""
    from remat import judge_loop

    plan = SimpleNamespace(predicted_peak_bytes=950, budget_bytes=BUDGET, fits_budget=True)
    graphs = [CompiledGraph("graph_000", "0/0", plan, (), None, graph_key="key", base_target_bytes=TARGET)]

    def recompile(correction, key, candidate):
        assert candidate is None, "the smallest-peak plan is compiled only when the last plan checks over the budget"
        raise BudgetInfeasibleError("refused", budget_bytes=BUDGET, min_feasible_bytes=900, min_budget_bytes=1300,
                                    reasons=())

    monkeypatch.setattr(judge_loop, "checked_peak_of", lambda capture, device, held, eager_loss_bytes=0: CheckedPeak(
        1040, 1040, 1040, 0, 0, 0, library_calls=frozenset({"mm"})))
    assert judge_loop.judge_compiled("first", SimpleNamespace(graphs=None), "cpu", False, graphs, recompile) == "first"
    assert graphs[-1].judgement.action == "accepted over target: no plan meets the corrected target"


def test_a_refusal_does_not_keep_the_frames_its_error_passed_through_alive():
    """The refusal a record keeps holds its error without tracebacks: a traceback holds the frames
    the error passed through and their locals (in a training step: the step's frames, the model's
    outputs in them, measured holding HF Llama's 1 MiB logits through its first backward)."""
    import weakref

    import torch

    from remat.inductor_verdict import refusal_for

    def planner() -> None:
        raise BudgetInfeasibleError("refused", budget_bytes=BUDGET, min_feasible_bytes=1200, min_budget_bytes=1264,
                                    reasons=())

    def compile_in_a_step(outputs: torch.Tensor) -> BudgetInfeasibleError:
        try:
            try:
                planner()
            except BudgetInfeasibleError as inner:
                raise BudgetInfeasibleError(str(inner), budget_bytes=BUDGET, min_feasible_bytes=1200,
                                            min_budget_bytes=1264, reasons=()) from inner
        except BudgetInfeasibleError as error:
            return error

    outputs = torch.ones(256)
    held = weakref.ref(outputs)
    error = compile_in_a_step(outputs)
    assert error.__traceback__ is not None and error.__cause__.__traceback__ is not None
    refusal = refusal_for(error, None, None, lambda plan: 0, _target_for, BUDGET)
    del outputs
    assert held() is None, "the refusal's error kept the step's frame, and the tensor in it, alive"
    assert refusal.error is error and error.__traceback__ is None and error.__cause__.__traceback__ is None
    assert refusal.target_bytes == _target_for(BUDGET)


def test_the_named_budgets_plan_is_asked_for_the_budget_the_lowest_checked_plan_names_and_lowers_it():
    """After every candidate, ``named_candidate`` is called with the budget the refusal would name from the
    lowest-checked plan so far (here the free min-cut's 1100); its plan (what a retry there plans first) checks
    lower, 1080, and the error names the budget that one fits. Under the target it runs instead."""
    graphs, compiled, asked = [_record("graph_000", 1200)], [], []

    def named_plan(checked: int):
        def compile_and_check(named_budget):
            asked.append(named_budget)
            return _candidate_named(graphs, "graph_000_r2", checked, compiled)()
        return compile_and_check

    with pytest.raises(BudgetInfeasibleError) as raised:
        overrule_or_refuse("smallest", graphs, 1300, (("free min-cut", _candidate_named(graphs, "graph_000_r1", 1100, compiled)),),
                           named_candidate=named_plan(1080))
    assert compiled == ["graph_000_r1", "graph_000_r2"] and graphs == []
    assert _target_for(asked[0]) >= 1100 > _target_for(asked[0] - 1)      # the budget 1100 names
    assert raised.value.min_feasible_bytes == 1080
    assert _target_for(raised.value.min_budget_bytes) >= 1080 > _target_for(raised.value.min_budget_bytes - 1)

    graphs, compiled, asked = [_record("graph_000", 1200)], [], []
    fn = overrule_or_refuse("smallest", graphs, 1300, (("free min-cut", _candidate_named(graphs, "graph_000_r1", 1100, compiled)),),
                            named_candidate=named_plan(990))
    assert fn == "graph_000_r2's callable" and [g.graph_id for g in graphs] == ["graph_000_r2"]
    assert graphs[-1].judgement.action.startswith("accepted: Inductor's check of the named budget's plan")
    graphs = [_record("graph_000", 1200)]
    with pytest.raises(BudgetInfeasibleError):     # nothing compiled for it: the refusal stands as before
        overrule_or_refuse("smallest", graphs, 1300, (), named_candidate=lambda named_budget: None)


def test_the_named_budgets_plan_is_not_compiled_where_a_retry_would_be_refused_by_the_simulator():
    """``_checked_retry`` compiles nothing without a named budget or a planning rule, nor where the named budget's
    planning target is below the smallest peak the simulator found (a retry there runs the same candidates)."""
    import dataclasses

    from remat.judge_loop import _checked_retry

    never = lambda *args: pytest.fail("nothing to compile")  # noqa: E731
    record = _record("graph_000", 1200)
    assert _checked_retry(never, record, "cpu", False, 5000) is None          # no planning rule
    record = dataclasses.replace(record, refusal=dataclasses.replace(record.refusal, planning_target_for=_target_for))
    assert _checked_retry(never, record, "cpu", False, None) is None
    assert _checked_retry(never, record, "cpu", False, 1263) is None          # target 1199 < 1200
    asked = []

    def compile_candidate(refused, kind, target_bytes):
        asked.append((refused.graph_id, kind, target_bytes))
        raise BudgetInfeasibleError("no plan there", budget_bytes=BUDGET, min_feasible_bytes=1300, min_budget_bytes=1369,
                                    reasons=("saved activations",))

    assert _checked_retry(compile_candidate, record, "cpu", False, 1264) is None   # target 1200: asked, none found
    assert asked == [("graph_000", "named budget's", 1200)]


def _shared_record(graph_id: str, simulated: int, held: int) -> CompiledGraph:
    """A record under a step's share: its refusal's limit is what the share admits next to what its plan holds (here
    the budget less 5%, less 2,000 B live before the graph, less what it holds)."""
    error = BudgetInfeasibleError("refused", budget_bytes=3000, min_feasible_bytes=1200, min_budget_bytes=5000,
                                  reasons=("saved activations",))
    plan = SimpleNamespace(predicted_peak_bytes=simulated, est_extra_time_s=0.0)
    limit = lambda b: _target_for(b) - 2000 - held  # noqa: E731
    return CompiledGraph(graph_id, "0/0", plan, (), None, base_target_bytes=_target_for(3000),
                         step_share=SimpleNamespace(kind="break"), refusal=Refusal(error, limit, limit(3000)))


@pytest.mark.parametrize(("free_checked", "free_held", "named_by"), [
    (1100, 100, "free"),       # checks lower, holds less: it names less
    (1100, 900, "smallest"),   # checks lower but holds 700 B more: the smallest-peak plan names less
    (1250, 0, "free"),         # checks higher but holds 200 B less: it names less
])
def test_under_a_share_the_refusal_is_named_from_the_plan_that_names_the_smaller_budget(free_checked, free_held,
                                                                                        named_by):
    """A step share's refusal judges its free min-cut candidate against what the share admits next to what that plan
    holds (its own refusal's limit), and names the budget from whichever of the two plans names less: under a share,
    the lower checked peak alone is not the smaller name (session 48: before, a share's refusal compiled no candidate,
    and rand-brk-1560's floor was named 1.22x plain Inductor's peak)."""
    from remat.inductor_verdict import named_budget_after_check

    graphs = [_shared_record("graph_001", 1200, held=200)]
    smallest = graphs[0]

    def compile_and_check():
        graphs.append(_shared_record("graph_001_r1", 1500, held=free_held))
        return "free", CheckedPeak(free_checked, free_checked, free_checked, 0, 0, 0, library_calls=frozenset({"mm"}))

    with pytest.raises(BudgetInfeasibleError) as refused:
        overrule_or_refuse("smallest", graphs, 1200, (("free min-cut", compile_and_check),))
    free = _shared_record("graph_001_r1", 1500, held=free_held)
    names = {"smallest": named_budget_after_check(smallest.refusal, 1200),
             "free": named_budget_after_check(free.refusal, free_checked)}
    assert refused.value.min_budget_bytes == names[named_by] == min(names.values())
