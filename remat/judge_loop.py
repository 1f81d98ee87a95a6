"""Inductor's check on the compile path: each compiled plan judged on the code Inductor generated
for it, before its first step, and re-planned or refused on that number.

``judge_compiled`` runs the loop over one compile's records: read the generated code's peak
(``inductor_check.checked_peak_of``), take the verdict (``inductor_verdict.judge_plan``), and on
"re-plan" compile again at the corrected target, up to ``MAX_JUDGED_REPLANS`` times.
``overrule_or_refuse`` is the verdict on a budget the simulator refused. The records live in the
backend's ``compiled_graphs`` list, passed in and edited in place (the last record is the one
judged); compiling again is the caller's ``recompile``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from fractions import Fraction
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from ._torch_dynamo import passthrough_error_class
from .errors import BudgetInfeasibleError, raise_budget_hint
from .feedback_store import CHECK_SOURCE, Correction
from .pipeline import (FREE_MINCUT_CANDIDATE, LEAN_CODE_GENERATION_CANDIDATE, NAMED_BUDGET_CANDIDATE,
                       SMALLEST_PEAK_CANDIDATE, refusal_candidates)
from .inductor_check import CheckedPeak, checked_peak_of, trusted_peak_bytes
from .inductor_verdict import Judgement, annotate_dump, judge_plan, named_budget_after_check, overrule_refusal
from .units import format_bytes, format_gb_up, format_seconds

if TYPE_CHECKING:
    from ._torch_compile import CodeCapture
    from .compiled_graph import CompiledGraph

log = logging.getLogger("remat")

MAX_JUDGED_REPLANS = 3   # re-plans Inductor's verdict may ask for per compile (remat/inductor_check.py)
ROOM_FRACTION = Fraction(2, 100)   # an accepted plan checked this far under its target searches the room (exact)
MAX_ROOM_REPLANS = 2     # re-plans that search (``faster_within_check``)
ROOM_MIN_GAIN = 0.01     # a try is compiled only if estimated faster by this fraction of the graph's compute


def judge_compiled(fn: Callable[..., Any], capture: "CodeCapture", device_type: str, outputs_held: bool,
                   compiled_graphs: list["CompiledGraph"],
                   recompile: Callable[..., tuple[Callable[..., Any], "CodeCapture"]],
                   compile_candidate: Optional[Callable[["CompiledGraph", str], tuple[Callable[..., Any], "CodeCapture"]]] = None,
                   estimate: Optional[Callable[[Any, Correction], Any]] = None) -> Callable[..., Any]:
    """Inductor judges the plan just compiled (the last of ``compiled_graphs``, its code in ``capture``),
    before any step runs: its peak is read from the generated forward and backward; over its target
    (``record.check_target_bytes``: for a graph alone in its step the budget less the check's headroom,
    ``RematOptions.check_target_for``; under a known step's share the largest peak the share admits
    next to what the plan holds; else the planning target), the graph is planned again at
    ``target / (checked / simulated)`` (in the simulator's units; under a share, the step target less
    the same difference) and compiled again by ``recompile(correction, graph_key, None)`` (the
    feedback loop's re-plan path, which appends its record), up to ``MAX_JUDGED_REPLANS`` times. Returns the
    callable accepted; its record (last in ``compiled_graphs``) carries the verdict and its dump says
    which number the plan was accepted on; the plans it rejected leave ``compiled_graphs`` (their
    verdicts are in ``judgement.rejected``, their dumps stay). A re-plan no plan can meet keeps the last
    plan if its checked peak is within the budget; otherwise the smallest-peak plan at the corrected
    target is compiled (``recompile(correction, graph_key, SMALLEST_PEAK_CANDIDATE)``, a record with
    a refusal) and judged as a refused budget is, which accepts it or a candidate that checks under
    the target, or raises ``BudgetInfeasibleError`` naming the budget the lowest-checked plan fits; so is
    a plan still checked over the budget when the re-plans have run out ("over budget"): no plan whose
    checked peak is over its budget runs.
    A budget the simulator refused is judged by ``overrule_or_refuse`` (with ``compile_candidate(record, kind)``
    for each of the graph's ``pipeline.refusal_candidates``; for a graph sharing a step, its refusal's plan is the
    one the share's named budget rests on, and the free min-cut its only candidate, each judged against the largest
    peak the share admits next to what it holds, ``inductor_verdict.refusal_for``). An accepted plan with room under its target
    is then searched for a faster one (``faster_within_check``; ``estimate(facts, correction)`` plans a
    try before it is compiled)."""
    rejected: tuple[Judgement, ...] = ()
    # a plan made under the feedback loop's correction (measured over its budget, here or in an earlier
    # process) is not searched for room: the search would loosen what a measured step tightened
    searched = compiled_graphs[-1].correction is None
    ran_out: Optional[Correction] = None    # the re-plans ran out over the budget: their last correction (below)

    def room_searched(fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn if not searched else faster_within_check(fn, compiled_graphs, functools.partial(
            _checked_replan, recompile, compiled_graphs, device_type, outputs_held), estimate)

    for round_ in itertools.count():
        record = compiled_graphs.pop()
        if rejected:
            compiled_graphs.pop()      # the plan this one replaces
        compiled_graphs.append(record)
        checked = checked_peak_of(capture.graphs, device_type, outputs_held, record.eager_loss_bytes)
        if record.refusal is not None:
            # A graph sharing a step has one candidate, the free min-cut (planned without the share's search again,
            # ``refused_at``; each judged against what its share admits next to what it holds, its own refusal's
            # target): the simulator can over-predict the plans saving more (rand-brk-1560: its plans with no
            # budget checked 1.13 MB, simulated 1.49, and its floor was named 1.22x plain Inductor's peak)
            candidates: tuple = ()
            named_candidate = None
            if compile_candidate is not None:
                kinds = ((FREE_MINCUT_CANDIDATE,) if record.facts is None or record.step_share is not None
                         else refusal_candidates(record.facts, record.plan, device_type))
                candidates = tuple((kind, functools.partial(_checked_candidate, compile_candidate, record, kind,
                                                            device_type, outputs_held)) for kind in kinds)
                if record.step_share is None:
                    named_candidate = functools.partial(_checked_retry, compile_candidate, record, device_type, outputs_held)
            accepted = overrule_or_refuse(fn, compiled_graphs, trusted_peak_bytes(checked, record.plan.predicted_peak_bytes),
                                          candidates, rejected, within_budget_runs=ran_out is not None,
                                          named_candidate=named_candidate)
            if ran_out is not None:
                # the plan kept carries the correction of the re-plans, not the 1-byte target it was found at
                # (a step's or the feedback loop's later re-plan starts from a record's correction)
                compiled_graphs[-1] = dataclasses.replace(compiled_graphs[-1], correction=ran_out)
            return room_searched(accepted)
        target = record.base_target_bytes if record.check_target_bytes is None else record.check_target_bytes
        verdict = judge_plan(record.plan.predicted_peak_bytes, trusted_peak_bytes(checked, record.plan.predicted_peak_bytes),
                             target, record.plan.budget_bytes,
                             may_replan=record.plan.fits_budget and round_ < MAX_JUDGED_REPLANS,
                             graph_id=record.graph_id, rejected=rejected)
        compiled_graphs[-1] = dataclasses.replace(record, judgement=verdict)
        annotate_dump(record.dump_path, verdict)
        log.info("remat %s: %s on Inductor's check, %s", record.graph_id, verdict.action, verdict)
        if verdict.action == "accepted":
            return room_searched(fn)
        if verdict.action not in ("re-plan", "over budget") or not record.plan.fits_budget:
            return fn       # (a plan that does not fit even as simulated runs only as best_effort=True asked)
        assert verdict.new_target_bytes is not None and verdict.checked_peak_bytes is not None
        assert record.base_target_bytes is not None and verdict.target_bytes is not None
        # the graph's room shrinks by what the check found over (for a graph alone: the target becomes
        # new_target, where a plan erring as this one did checks at its target; under a share, the step
        # target shrinks by as much, and with it the share)
        corrected_bytes = (verdict.new_target_bytes if record.step_share is None else
                           record.base_target_bytes - (verdict.target_bytes - verdict.new_target_bytes))
        correction = Correction(record.base_target_bytes / max(corrected_bytes, 1), record.plan.budget_bytes,
                                record.plan.predicted_peak_bytes, verdict.checked_peak_bytes, record.graph_id,
                                f"{CHECK_SOURCE}{record.graph_id}'s generated code peaks at "
                                f"{verdict.checked_peak_bytes} bytes where its plan simulated "
                                f"{record.plan.predicted_peak_bytes} (target {verdict.target_bytes})")
        rejected += (verdict,)
        if verdict.action == "over budget":
            # The re-plans ran out and this plan's code peaks over the budget itself: it must not run (it did
            # until session 39: hf-1491, a T5 with an eager cross-entropy, measured 1.042x its budget at step 1).
            # The smallest-peak plan is compiled as a refusal's record (planned at a 1-byte target, which no plan
            # meets: planned at the corrected target, a plan that fits it came back as a plan to judge again, and
            # HF GPT-2 re-planned without end) and judged as a refused budget is, below, except that the
            # lowest-checked plan runs where it is within the budget, as this plan would have ("accepted over
            # target"), rather than being refused for the check's headroom.
            if ran_out is not None:
                raise passthrough_error_class(BudgetInfeasibleError)(_over_budget_again(record, verdict))
            ran_out = correction
            smallest = dataclasses.replace(correction, factor=record.base_target_bytes / 1.0, foreseen=True,
                                           source="the judge's re-plans ran out: the smallest-peak plan")
            fn, capture = recompile(smallest, record.graph_key, SMALLEST_PEAK_CANDIDATE)
            continue
        try:
            fn, capture = recompile(correction, record.graph_key, None)
        except BudgetInfeasibleError:
            if record.plan.budget_bytes is not None and verdict.checked_peak_bytes <= record.plan.budget_bytes:
                kept = dataclasses.replace(verdict, action="accepted over target: no plan meets the corrected target")
                compiled_graphs[-1] = dataclasses.replace(record, judgement=kept)
                annotate_dump(record.dump_path, kept)
                return fn
            # No plan simulates under the corrected target, and this one checks over the budget: the
            # simulator's smallest-peak plan may still check under the target (the correction is one
            # plan's error). It is compiled as a refusal's record, and the next round judges it as
            # any refusal (``overrule_or_refuse``: then the free min-cut plan, then the refusal).
            fn, capture = recompile(correction, record.graph_key, SMALLEST_PEAK_CANDIDATE)
    raise AssertionError("unreachable")


def _over_budget_again(record: "CompiledGraph", verdict: Judgement) -> BudgetInfeasibleError:
    """The refusal of a budget whose smallest-peak plan, planned at a 1-byte target and so expected to come back
    refused, was accepted by the simulator and still checks over the budget (a graph whose plans simulate at
    almost nothing): named at the budget whose check target, in proportion, holds the checked peak."""
    budget, checked, target = verdict.budget_bytes, verdict.checked_peak_bytes, verdict.target_bytes
    assert budget is not None and checked is not None and target
    named = -(-checked * budget // target)
    return BudgetInfeasibleError(
        f"budget {format_bytes(budget)} is below the smallest feasible budget {format_gb_up(named)} GB: "
        f"{record.graph_id}'s smallest-peak plan's generated code peaks at {checked:,} bytes as Inductor compiled it "
        f"(the simulator predicted {verdict.simulated_peak_bytes:,}). " + raise_budget_hint(named),
        budget_bytes=budget, min_feasible_bytes=checked, min_budget_bytes=named, reasons=())


class NoFasterPlan(Exception):
    """A try of ``faster_within_check`` whose plan is estimated no faster than the plan it would replace."""


def stop_if_not_faster(plan: Any, faster_than_s: float) -> None:
    """Raise ``NoFasterPlan`` unless ``plan``'s estimated extra time is under ``faster_than_s``."""
    if plan.est_extra_time_s >= faster_than_s:
        raise NoFasterPlan(f"the plan at this target is estimated at {format_seconds(plan.est_extra_time_s)} extra, "
                           f"not under {format_seconds(faster_than_s)}")


def faster_within_check(fn: Callable[..., Any], compiled_graphs: list["CompiledGraph"],
                        replan: Callable[[Correction], tuple[Callable[..., Any], Optional[int]]],
                        estimate: Optional[Callable[[Any, Correction], Any]] = None) -> Callable[..., Any]:
    """Look for a faster plan in the room Inductor's check left under an accepted plan's target (at
    least ``ROOM_FRACTION`` of it). The planner aimed at the budget less its headroom, or at a target
    corrected for the simulator's error on another plan; the error is plan-specific, so the accepted
    plan can recompute far more than the target needs. From the accepted plan (simulated ``s_lo``,
    checked ``c_lo``, target ``t``) the graph is planned again at a simulated target: where the line
    through it and the lowest-simulated rejected plan above it (``s_hi``, ``c_hi`` over ``t``) meets
    ``t``, or, with none, at ``s_lo x t / c_lo`` (this plan's error taken as uniform), above the planning
    target too (a correction that ``loosens``; the check judges every try before it runs), so a refusal
    the check overruled, whose plan simulates above that target, is searched. A try must be estimated
    faster by ``ROOM_MIN_GAIN`` of the graph's estimated compute: ``estimate(facts, correction)`` (the plan
    the partitioner would make, without tracing; the backend's ``pipeline.replan_estimate``, whose plan the
    compile then takes) says so before anything is compiled; then ``replan(correction)`` compiles it
    (appending its record) and returns its callable and trusted checked peak. Up to ``MAX_ROOM_REPLANS``
    tries, each narrowing the interval on its checked peak. A try that checks at or under ``t`` replaces the
    accepted plan (its record carries the verdict, the replaced verdicts in ``rejected``); any other leaves
    ``compiled_graphs`` (its dump stays). So the plan that runs always checked at or under ``t``.
    Found on the Hugging Face Llama of ``benchmarks/hf_models.py`` at checkpointing's peak: the first
    plan simulated 35.30 MB and checked 39.88 (target 37.09), the corrected re-plan simulated 32.08,
    checked 35.84, and rebuilt one layer's attention seven times (est. extra 57 ms; measured 1.52x
    plain Inductor's step); the try at 33.07 checked 32.13 (est. 29 ms; 1.24x)."""
    accepted = compiled_graphs[-1]
    verdict = accepted.judgement
    if (verdict is None or not verdict.action.startswith("accepted") or verdict.checked_peak_bytes is None
            or verdict.target_bytes is None or accepted.step_share is not None or accepted.base_target_bytes is None):
        return fn
    base_target = accepted.base_target_bytes     # the planning target (simulator units), before any correction
    min_gain_s = ROOM_MIN_GAIN * graph_compute_s(accepted.facts)
    target = verdict.target_bytes
    low = (verdict.simulated_peak_bytes, verdict.checked_peak_bytes)
    above = [(r.simulated_peak_bytes, r.checked_peak_bytes) for r in verdict.rejected
             if r.checked_peak_bytes is not None and r.checked_peak_bytes > target and r.simulated_peak_bytes > low[0]]
    high = min(above) if above else None
    replaced: tuple[Judgement, ...] = ()
    for _ in range(MAX_ROOM_REPLANS):
        if (low[1] > target * (1 - ROOM_FRACTION) or accepted.plan.est_extra_time_s <= min_gain_s
                or (high is not None and high[1] <= low[1])):
            break        # no room, nothing to gain (no recompute), or no slope to follow
        if high is None:
            planning = low[0] * target // max(low[1], 1)
        else:
            planning = min(low[0] + (target - low[1]) * (high[0] - low[0]) // (high[1] - low[1]), high[0] - 1)
        if planning <= low[0]:
            break        # no simulated peak left between the accepted plan and the aim
        # above the planning target too: the check judges the try before it runs, and the feedback loop
        # measures its first step (the check is what the first step of a process measures: test_inductor_check.py)
        correction = Correction(base_target / planning, accepted.plan.budget_bytes,
                                verdict.simulated_peak_bytes, verdict.checked_peak_bytes, accepted.graph_id,
                                f"Inductor-checked with room: {accepted.graph_id}'s code peaks at "
                                f"{verdict.checked_peak_bytes} bytes against a target of {target}; planned again "
                                f"for time at a simulated {planning} bytes", loosens=planning > base_target)
        faster_than_s = accepted.plan.est_extra_time_s - min_gain_s
        try:
            if estimate is not None and accepted.facts is not None:
                stop_if_not_faster(estimate(accepted.facts, correction), faster_than_s)
            try_fn, checked = replan(correction)
        except NoFasterPlan as stopped:     # a looser aim gave no faster plan: a tighter one only recomputes more
            log.info("remat %s: the re-plan for time at a simulated %d bytes: not compiled, %s", accepted.graph_id,
                     planning, stopped)
            break
        except BudgetInfeasibleError:    # not expected (a plan simulates under the aim: the accepted one)
            break
        tried = compiled_graphs[-1]
        faster = tried.plan.est_extra_time_s < faster_than_s     # the estimated plan (the compile took it, unplanned)
        if checked is not None and checked <= target and tried.refusal is None and faster:
            replaced += (dataclasses.replace(verdict, action=f"{verdict.action}; then replaced by a faster plan"),)
            verdict = Judgement(
                f"accepted: a faster plan in the room Inductor's check left (the {accepted.graph_id} plan it "
                f"replaces checked {verdict.checked_peak_bytes} bytes, est. extra "
                f"{format_seconds(accepted.plan.est_extra_time_s)}; this one "
                f"{format_seconds(tried.plan.est_extra_time_s)})", tried.plan.predicted_peak_bytes, checked,
                target, verdict.budget_bytes, graph_id=tried.graph_id, rejected=verdict.rejected + replaced)
            compiled_graphs.remove(accepted)
            compiled_graphs[-1] = accepted = dataclasses.replace(tried, judgement=verdict)
            annotate_dump(tried.dump_path, verdict)
            log.info("remat %s: %s", tried.graph_id, verdict.action)
            fn, low = try_fn, (tried.plan.predicted_peak_bytes, checked)
            continue
        compiled_graphs.pop()
        log.info("remat %s: the re-plan for time at a simulated %d bytes checked %s (target %d), est. extra %s: "
                 "not taken", tried.graph_id, planning, checked, target, format_seconds(tried.plan.est_extra_time_s))
        if checked is None or checked <= target or tried.plan.predicted_peak_bytes <= low[0]:
            break        # no reading, under the target yet slower, or a plan below the interval: nothing to narrow
        high = (tried.plan.predicted_peak_bytes, checked)
    return fn


def graph_compute_s(facts: Any) -> float:
    """The estimated time of a graph's forward and backward nodes (``NodeCost.est_time_s``); 0 without facts
    (a record an AOTAutograd cache hit restored)."""
    if facts is None:
        return 0.0
    return sum(node.cost.est_time_s for node in facts.nodes.values() if node.role in ("forward", "backward"))


def _checked_replan(recompile: Callable[..., tuple[Callable[..., Any], "CodeCapture"]],
                    compiled_graphs: list["CompiledGraph"], device_type: str, outputs_held: bool,
                    correction: Correction) -> tuple[Callable[..., Any], Optional[int]]:
    """Compile a re-plan of the last record's graph at ``correction``; its callable and trusted checked peak."""
    fn, capture = recompile(correction, compiled_graphs[-1].graph_key, None)
    return fn, trusted_peak_bytes(checked_peak_of(capture.graphs, device_type, outputs_held,
                                                  compiled_graphs[-1].eager_loss_bytes),
                                  compiled_graphs[-1].plan.predicted_peak_bytes)


def _checked_candidate(compile_candidate: Callable[["CompiledGraph", str], tuple[Callable[..., Any], "CodeCapture"]],
                       refused: "CompiledGraph", kind: str, device_type: str,
                       outputs_held: bool) -> Optional[tuple[Callable[..., Any], Optional[CheckedPeak]]]:
    """Compile candidate ``kind``'s plan of the graph whose record ``refused`` is (its record is appended) and
    read its checked peak; None, and no code generated, for the lean code generation's candidate where the search
    under it finds no plan simulated lower than ``refused``'s (the partitioner refuses it before splitting the graph:
    one search, where a separate check ran it twice)."""
    try:
        fn, capture = compile_candidate(refused, kind)
    except BudgetInfeasibleError:
        if kind != LEAN_CODE_GENERATION_CANDIDATE:
            raise
        return None
    return fn, checked_peak_of(capture.graphs, device_type, outputs_held, refused.eager_loss_bytes)


def _checked_retry(compile_candidate: Callable[..., tuple[Callable[..., Any], "CodeCapture"]], refused: "CompiledGraph",
                   device_type: str, outputs_held: bool,
                   named_budget: Optional[int]) -> Optional[tuple[Callable[..., Any], Optional[CheckedPeak]]]:
    """The plan the search makes at the planning target of ``named_budget`` (``Refusal.planning_target_for``), what a
    retry there plans first, compiled as the refused graph's candidate (its record appended) with its checked peak.
    None, and nothing compiled, without a budget or a planning rule, where that target is below the smallest peak the
    simulator found (``refused``'s plan: a retry there is refused by the simulator and runs these same candidates),
    or where the search finds no plan at it. Every candidate before it is made without regard to the target, so a
    retry at the budget this one's check names meets the same plans and this one, which checks within it."""
    rule = refused.refusal.planning_target_for if refused.refusal is not None else None
    if named_budget is None or rule is None or rule(named_budget) < refused.plan.predicted_peak_bytes:
        return None
    try:
        fn, capture = compile_candidate(refused, NAMED_BUDGET_CANDIDATE, rule(named_budget))
    except BudgetInfeasibleError:
        return None
    return fn, checked_peak_of(capture.graphs, device_type, outputs_held, refused.eager_loss_bytes)


def refused_at(replan: Any, target_bytes: Optional[int], shared: bool = False) -> bool:
    """Whether the compile ``replan`` (the backend's per-thread re-plan state) describes is a candidate
    plan of a refusal at ``target_bytes`` (``_checked_candidate``: its ``refused`` is (target, error, plan)):
    the planner refused that target moments ago, and planning the candidate need not search for it again.
    ``shared``: a graph under a step's share, whose refusal is the share's at any target (its search plans many)."""
    refused = getattr(replan, "refused", None)
    return refused is not None and (shared or refused[0] == target_bytes)


def overrule_or_refuse(fn: Callable[..., Any], compiled_graphs: list["CompiledGraph"],
                       checked_peak_bytes: Optional[int],
                       candidates: Sequence[tuple[str, Callable[[], Optional[tuple[Callable[..., Any], Optional[CheckedPeak]]]]]] = (),
                       rejected: tuple[Judgement, ...] = (), within_budget_runs: bool = False,
                       named_candidate: Optional[Callable[[Optional[int]], Optional[tuple[Callable[..., Any], Optional[CheckedPeak]]]]] = None
                       ) -> Callable[..., Any]:
    """Inductor's verdict on the smallest-peak plan of a budget the simulator refused (the last record of
    ``compiled_graphs``; ``checked_peak_bytes``: its trusted checked peak, ``trusted_peak_bytes``): at or
    under the planning target, the plan runs (the simulator over-predicted it) and the record carries
    the verdict. Otherwise each of ``candidates`` is compiled and checked in turn (``(kind, compile)``:
    ``compile()`` appends its record and returns its callable and checked peak, or None where it compiled
    nothing; the backend's are the free min-cut plan, then checkpointing every repeated block, then lean code
    generation, ``pipeline.refusal_candidates``): the simulator
    can rank plans the wrong way round (its smallest-peak plan may check above a plan it thinks larger),
    and Inductor's number decides, so the first candidate that checks at or under the target runs.
    Then ``named_candidate(named)``, where given: the plan a retry at the budget ``named`` (the one this refusal
    would name now, from the lowest-checked plan so far) plans first, compiled and checked like a candidate
    (None where it compiled nothing): the simulator can rank that plan above the others and Inductor's check put it
    lower, and the budget named is then the one its check fits (``_checked_retry``).
    Otherwise the records leave ``compiled_graphs`` and the refusal is raised, naming the budget whose
    target holds the lowest checked peak, above or below the simulator's figure
    (``inductor_verdict.named_budget_after_check``). ``rejected``: the verdicts on
    plans judged before this refusal (a corrected re-plan the simulator refused), kept in the verdict.
    ``within_budget_runs`` (the judge's re-plans ran out over the budget): before refusing, the
    lowest-checked plan runs if its checked peak is within the budget itself ("accepted over target", the
    verdict ``judge_plan`` gives a last re-plan within its budget)."""
    record = compiled_graphs[-1]
    assert record.refusal is not None
    error, target_bytes = record.refusal.error, record.refusal.target_bytes
    assert isinstance(error, BudgetInfeasibleError)
    verdict = dataclasses.replace(overrule_refusal(record.plan.predicted_peak_bytes, checked_peak_bytes,
                                                   target_bytes, error.budget_bytes, record.graph_id),
                                  rejected=rejected)
    compiled_graphs[-1] = dataclasses.replace(record, judgement=verdict)
    annotate_dump(record.dump_path, verdict)
    if verdict.action != "refused":
        log.info("remat %s: %s (simulated %d bytes, checked %s)", record.graph_id, verdict.action,
                 record.plan.predicted_peak_bytes, checked_peak_bytes)
        return fn
    compiled_graphs.pop()
    log.info("remat %s: the simulator's refusal stands on Inductor's check (simulated %d bytes, checked %s, "
             "target %d)", record.graph_id, record.plan.predicted_peak_bytes, checked_peak_bytes, target_bytes)
    smallest, standing_fn = record, fn
    # the smallest-peak plan stands on its trusted checked peak, else on its simulated one (a check lower
    # than the simulation that cannot see every allocation is not trusted): a candidate's checked peak
    # replaces it only when lower than that
    standing_bytes = checked_peak_bytes if checked_peak_bytes is not None else record.plan.predicted_peak_bytes
    judged = rejected + (verdict,)

    def and_the_named_budgets_plan() -> Iterator[tuple[str, Callable[[], Optional[tuple[Callable[..., Any], Optional[CheckedPeak]]]]]]:
        yield from candidates
        if named_candidate is not None:     # named from the lowest-checked plan so far, when it is asked for
            yield NAMED_BUDGET_CANDIDATE, lambda: named_candidate(named_budget_after_check(record.refusal, checked_peak_bytes))

    for kind, compile_candidate in and_the_named_budgets_plan():
        compiled = compile_candidate()
        if compiled is None:    # not worth a compile (``_checked_candidate``)
            continue
        candidate_fn, other_checked = compiled
        other = compiled_graphs[-1]
        candidate_checked = trusted_peak_bytes(other_checked, other.plan.predicted_peak_bytes)
        assert other.refusal is not None   # the candidate's own admission: what it holds may differ
        other_verdict = overrule_refusal(other.plan.predicted_peak_bytes, candidate_checked, other.refusal.target_bytes,
                                         error.budget_bytes, other.graph_id)
        if other_verdict.action != "refused":
            other_verdict = dataclasses.replace(
                other_verdict, action=f"accepted: Inductor's check of the {kind} plan overrules the simulator "
                f"(its smallest-peak plan checked {checked_peak_bytes} bytes, over the target)", rejected=judged)
        compiled_graphs[-1] = dataclasses.replace(other, judgement=other_verdict)
        annotate_dump(other.dump_path, other_verdict)
        log.info("remat %s: the %s plan: %s (simulated %d bytes, checked %s)", other.graph_id, kind,
                 other_verdict.action, other.plan.predicted_peak_bytes, candidate_checked)
        if other_verdict.action != "refused":
            return candidate_fn
        compiled_graphs.pop()
        judged += (other_verdict,)
        # the plan the refusal names from: the one whose checked peak names the smaller budget (a graph alone: the lower
        # checked peak; under a share, what each plan holds counts too, its own refusal's ``target_for``)
        if candidate_checked is not None and (named_budget_after_check(other.refusal, candidate_checked)
                                              < named_budget_after_check(record.refusal, standing_bytes)):
            record, checked_peak_bytes, standing_bytes, standing_fn = other, candidate_checked, candidate_checked, candidate_fn
    if within_budget_runs and checked_peak_bytes is not None and checked_peak_bytes <= error.budget_bytes:
        kept = Judgement("accepted over target: the judge's re-plans ran out; the lowest-checked plan is within the budget",
                         record.plan.predicted_peak_bytes, checked_peak_bytes, record.refusal.target_bytes,
                         error.budget_bytes, checked_peak_bytes / max(record.plan.predicted_peak_bytes, 1), rejected=judged)
        compiled_graphs.append(dataclasses.replace(record, judgement=kept))
        annotate_dump(record.dump_path, kept)
        return standing_fn
    named = named_budget_after_check(record.refusal, checked_peak_bytes)
    if named is not None and named != error.min_budget_bytes:
        error = BudgetInfeasibleError(
            f"budget {format_bytes(error.budget_bytes)} is below the smallest feasible budget "
            f"{format_gb_up(named)} GB: the lowest-checked plan's generated code peaks at {checked_peak_bytes:,} "
            f"bytes as Inductor compiled it (the simulator predicted {record.plan.predicted_peak_bytes:,}), "
            f"over the planning target of {record.refusal.target_bytes:,} bytes (the budget less headroom"
            + (", less what the rest of the step needs next to it" if record.step_share is not None else "") + "). "
            f"Of the smallest-peak plan's simulated {smallest.plan.predicted_peak_bytes:,} bytes, " + "; ".join(error.reasons) + ". "
            + raise_budget_hint(named), budget_bytes=error.budget_bytes, min_feasible_bytes=checked_peak_bytes,
            min_budget_bytes=named, reasons=error.reasons)
    raise passthrough_error_class(BudgetInfeasibleError)(error)


__all__ = ["MAX_JUDGED_REPLANS", "MAX_ROOM_REPLANS", "NoFasterPlan", "ROOM_FRACTION", "ROOM_MIN_GAIN",
           "faster_within_check", "graph_compute_s", "judge_compiled", "overrule_or_refuse", "stop_if_not_faster"]
