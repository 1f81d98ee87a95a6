"""Inductor's verdict on a plan: accept it, re-plan it, or let the simulator's refusal stand.

``remat/inductor_check.py`` reads the peak of the code Inductor generated for a plan; this module
turns that number into a decision (pure functions over numbers: ``judge_plan`` for a plan the
simulator accepted, ``overrule_refusal`` and ``named_budget_after_check`` for the smallest-peak plan
of a budget it refused) and writes the decision into the plan's dump (``annotate_dump``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from .cost_model.tensors import has_symbolic_shapes
from .distributed import (JUDGED_SHARE_KINDS, PROVISIONAL_SHARE_KINDS, REFUSAL_CHECKED_SHARE_KINDS,
                           SINGLE_GRAPH_SHARE_KINDS, STEP_SHARE_KINDS)
from .distributed_errors import ShareInfeasibleError

if TYPE_CHECKING:
    from torch import fx

    from .distributed import GraphShare


@dataclass(frozen=True)
class Judgement:
    """Inductor's verdict on one compiled plan (bytes; 1 GB = 1e9 bytes).

    ``action``: "accepted" (checked peak at or under the target), "re-plan" (over the target:
    plan again at ``new_target_bytes``), "accepted over target" (over the target, within the
    budget, and no further re-plan is allowed), "over budget" (over the budget and no further
    re-plan is allowed: the plan does not run; ``judge_loop`` judges the smallest-peak plan at
    ``new_target_bytes`` as a refused budget's) or "unchecked" (the code could not be read: the simulated peak stands);
    for the smallest-peak plan of a budget the simulator refused (``overrule_refusal``): "accepted:
    Inductor's check overrules the simulator" or "refused"; for a plan found in the room the check left
    under an accepted one (``judge_loop.faster_within_check``): "accepted: a faster plan in the room ...",
    the plan it replaced keeps its own action with "; then replaced by a faster plan" added.
    ``factor`` = checked / simulated peak of this plan."""

    action: str
    simulated_peak_bytes: int
    checked_peak_bytes: Optional[int]
    target_bytes: Optional[int]
    budget_bytes: Optional[int]
    factor: Optional[float] = None
    new_target_bytes: Optional[int] = None
    graph_id: str = ""
    rejected: tuple["Judgement", ...] = ()    # verdicts on the plans this one replaced, oldest first

    @property
    def accepted_on(self) -> str:
        """Which number the plan stands on: "Inductor-checked peak" or "simulated peak"."""
        return "simulated peak" if self.checked_peak_bytes is None else "Inductor-checked peak"


def judge_plan(simulated_peak_bytes: int, checked_peak_bytes: Optional[int], target_bytes: Optional[int],
               budget_bytes: Optional[int], may_replan: bool, graph_id: str = "",
               rejected: tuple[Judgement, ...] = ()) -> Judgement:
    """The verdict on a plan (pure: numbers in, a verdict out). ``target_bytes`` is the planning
    target in real bytes (the budget less its headroom, before any correction of the simulator):
    the checked peak must be at or under it.

    Over it, ``factor = checked / simulated`` and the new target, in the simulator's units, is
    ``target / factor``: a plan simulated at that peak checks at about ``target`` if the simulator
    errs by the same factor. It is below the simulated peak of the plan judged, so each re-plan
    asks for less."""
    record = (simulated_peak_bytes, checked_peak_bytes, target_bytes, budget_bytes)
    named = {"graph_id": graph_id, "rejected": rejected}
    if checked_peak_bytes is None:
        return Judgement("unchecked", *record, **named)
    if target_bytes is None or checked_peak_bytes <= target_bytes:
        return Judgement("accepted", *record, **named)
    factor = checked_peak_bytes / max(simulated_peak_bytes, 1)
    new_target = int(target_bytes / factor)
    if may_replan:
        return Judgement("re-plan", *record, factor, new_target, **named)
    if budget_bytes is not None and checked_peak_bytes <= budget_bytes:
        return Judgement("accepted over target", *record, factor, **named)
    return Judgement("over budget", *record, factor, new_target, **named)   # not run: refused, or a smaller plan


@dataclass(frozen=True)
class Refusal:
    """The simulator refused a budget, and Inductor has the last word: the smallest-peak plan is
    compiled and checked before the refusal stands (``overrule_refusal``).

    ``error``: the simulator's ``BudgetInfeasibleError``; ``target_for(budget_bytes)``: the largest
    peak (real bytes) the plan compiled for the refusal may have at a budget (the rule the error's
    named budget comes from: the budget less headroom for a graph alone in its step; for a graph
    sharing a step at graph breaks, the largest peak its share of that budget's step target admits
    next to what the plan holds, ``distributed_search.peak_limit_bytes``); ``target_bytes``: that
    peak at the budget refused, the number the plan's checked peak is judged against;
    ``planning_target_for(budget_bytes)``: the simulated peak a plan at that budget is searched for (the budget
    less the planning headroom, no correction), or None: what the named budget's plan is planned at
    (``judge_loop._checked_retry``)."""

    error: Exception
    target_for: Callable[[int], int]
    target_bytes: int
    planning_target_for: Optional[Callable[[int], int]] = None


def without_tracebacks(error: BaseException) -> BaseException:
    """``error`` with its traceback, and those of the exceptions it was raised from or during,
    dropped, so that a record can keep it. A traceback holds the frames it passed through, and
    through their ``f_back`` links every calling frame with its locals: an error raised while
    Dynamo compiles inside a training step kept that step's frames, and the model's outputs in
    them, alive for as long as the record lived (measured: HF Llama's 1 MiB logits held through
    the first step's backward, 1.079x the budget, where later steps measured 0.950x)."""
    seen: set[int] = set()
    current: Optional[BaseException] = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__
    return error


def refusal_for(error: Exception, plan: Any, share: Optional["GraphShare"], held_of: Callable[[Any], int],
                target_for_budget: Callable[[int], int], budget_bytes: int,
                planning_target_for: Optional[Callable[[int], int]] = None,
                step_peak_with: Optional[Callable[[int, int, int], int]] = None) -> Refusal:
    """The refusal of ``budget_bytes`` whose plan ``plan`` is compiled for Inductor's check.
    ``target_for_budget``: the backend's planning target of a budget (the budget less headroom).
    A graph alone in its step is judged against that target; one sharing a step at graph breaks
    (``share`` of kind "break", or "runs": its runs stack, or "accumulated": next to the step's gradients, or one of
    the step's first run, ``PROVISIONAL_SHARE_KINDS``) against the largest peak its share admits next to what ``plan``
    holds (``held_of``), at the budget refused and at any budget named (``peak_limit_bytes``). A graph of a known
    step (kind "break") with ``step_peak_with`` (``step_eager.StepEagerHooks.step_peak_with``: the step's predicted
    peak with this graph's plan swapped) is judged by ``step_limit_bytes`` instead: its own runs as its share counts
    them, and the step composed with the plans its other graphs run, not the reserve for the later graphs.
    The refusal keeps ``error`` without its tracebacks (``without_tracebacks``); ``planning_target_for``, for a
    graph alone in its step: the planning rule (``Refusal.planning_target_for``)."""
    without_tracebacks(error)
    if share is None or share.kind not in REFUSAL_CHECKED_SHARE_KINDS:
        return Refusal(error, target_for_budget, target_for_budget(budget_bytes),
                       planning_target_for if share is None else None)
    from .distributed_search import peak_limit_bytes

    held = held_of(plan)
    if share.kind == "break" and step_peak_with is not None:
        limit = lambda b: step_limit_bytes(share.at(target_for_budget(b)), held, step_peak_with)  # noqa: E731
    else:
        limit = lambda b: peak_limit_bytes(share.at(target_for_budget(b)), held)  # noqa: E731
    return Refusal(error, limit, limit(budget_bytes))


def step_limit_bytes(share: "GraphShare", held_bytes: int, step_peak_with: Callable[[int, int, int], int]) -> int:
    """The largest peak a plan holding ``held_bytes`` may have in a known step split at graph breaks (``share``, of
    kind "break", at the step target judged): its own runs fit next to what is live before them (``share.admits``
    without the later graphs' reserve, as planning takes a plan whose reserve is not met,
    ``distributed_search._from_candidates``), and the step composed with it (``step_peak_with(held, peak,
    outside)``: the plans the other graphs run, next to the eager memory the step measured) fits the step target.
    -1 when no peak does. The reserve is an estimate of the later graphs' demand from their smallest-peak plans and
    counts their gradients, what is held outside and this graph's held bytes as live at once: as a condition it named
    budgets far above the step's need (rand-brk-1532, session 47: 7.65 MB named at 3.14 MB, where 4.78 MB was
    accepted and measured 4.49 MB). Monotone in the step target, so a budget named from it is the smallest whose
    limit holds the checked peak."""
    from .distributed import largest_admitted
    from .distributed_search import peak_limit_bytes

    target = share.step_target_bytes
    own = peak_limit_bytes(replace(share, reserved_later_bytes=0), held_bytes)
    composed = largest_admitted(lambda peak: step_peak_with(held_bytes, peak, share.outside_bytes) <= target, target)
    return min(own, composed)


def check_may_overrule(options: Any, share: Optional["GraphShare"], joint: "fx.GraphModule",
                       joint_inputs: Sequence[object], error: Exception, replanning: bool) -> bool:
    """Whether a budget the simulator refused goes to Inductor's check first (the plan the refusal rests on
    is compiled and judged by the backend, or by the re-planning caller): the check is on (``options``), no
    best effort, static shapes (the graphs the backend judges), and either the graph is alone in its step and
    this is not a re-plan (``replanning``: its refusal is the re-planning caller's), or it shares a step
    (``REFUSAL_CHECKED_SHARE_KINDS``) and the refusal names the plan it rests on (``ShareInfeasibleError``: the budget
    named is read off its code)."""
    shared = share is not None and share.kind in REFUSAL_CHECKED_SHARE_KINDS and isinstance(error, ShareInfeasibleError)
    return (options.inductor_check and options.budget_bytes is not None and not options.best_effort
            and not has_symbolic_shapes(joint_inputs)
            and not has_symbolic_shapes([n.meta.get("val") for n in joint.graph.find_nodes(op="placeholder")])
            and (shared or (share is None and not replanning)))


def check_rule(share: Optional["GraphShare"], correction: Any, options: Any, device_type: str,
               modeled: bool) -> tuple[Optional["GraphShare"], Callable[[int], int]]:
    """What Inductor's check judges a plan of a graph planned under ``share`` against: (the share, the target of a
    budget). A graph alone: (None, the budget less the check's headroom). A graph alone in its step whose runs stack
    or that runs next to the step's accumulated gradients (kinds "runs", "accumulated": ``runs_share``): that share
    rebuilt at the check's target of the budget, the gradients ``correction`` measured at the check's headroom, so
    its own part gets the check's headroom as a graph alone does (until session 36 the planning headroom: 5% on CPU
    where a graph alone gets 1%, and the floor named next to rand-1442's gradients was 1.005x plain Inductor's
    accumulating peak). A graph of a step split at graph breaks (``STEP_SHARE_KINDS``): its share with what is held
    outside the graphs (accumulated gradients, the eager memory a step measured: ``correction``) at the check's
    headroom, and the check's target of the budget: every graph of the step is checked against its own share, what
    the earlier graphs hold and the later graphs' gradients are real bytes, and what eager code holds between the
    graphs is measured from the first step (``step_eager.eager_by_graph``), so the planning headroom (5% on CPU)
    has nothing left to cover that a graph alone's 1% does not (until session 44 the planning target: GPT-2 split
    before its loss named floors 1.04-1.05x plain Inductor's and checkpointing's, hf-1535 and hf-1520 of the
    corpus). DDP/FSDP2 pieces (other ranks' graphs, collectives' buffers): (the share, the planning target)."""
    from .options import target_for_budget
    from .runs_share import runs_share

    def checked(budget_bytes: int) -> int:
        return options.check_target_for(budget_bytes, device_type, modeled)

    if share is None:
        return None, checked
    accumulated = getattr(correction, "accumulated_grad_bytes", 0) if correction is not None else 0
    check_headroom = options.check_headroom_for(device_type, modeled)
    if share.kind in STEP_SHARE_KINDS:
        eager = getattr(correction, "eager_step_bytes", 0) if correction is not None else 0
        return replace(share, outside_bytes=target_for_budget(accumulated + eager, check_headroom)), checked
    if share.kind not in SINGLE_GRAPH_SHARE_KINDS:
        return share, lambda budget_bytes: options.planning_target_for(budget_bytes, device_type, modeled)
    return runs_share(checked(options.budget_bytes), share.input_activation_bytes, share.total_grad_bytes,
                      share.needs[0], share.repeats,
                      target_for_budget(accumulated, check_headroom)), checked


def share_check_target(share: Optional["GraphShare"], held_bytes: int, target_bytes: int) -> Optional[int]:
    """The peak Inductor's check judges a plan against under a known step's share (kind "break", "runs" or
    "accumulated"):
    the largest peak the share, at the real planning target ``target_bytes`` (no feedback correction:
    the checked peak is in real bytes), admits next to the ``held_bytes`` the plan holds; without the
    later graphs' reserve when the plan was taken without it (``reserve_met`` False). A graph planned before its
    step was known (``PROVISIONAL_SHARE_KINDS``): ``target_bytes`` itself, the whole step's target at the check's
    headroom (its own run next to what is live before it is held to the budget at its compile,
    ``step_fit.runs_over_next_to_live``; until session 44 the planning target, and a refusal named from it carried
    the 5% planning headroom). None for a graph alone in its step (judged against its check target)."""
    if share is not None and share.kind in PROVISIONAL_SHARE_KINDS:
        return target_bytes
    if share is None or share.kind not in JUDGED_SHARE_KINDS:
        return None
    from dataclasses import replace

    from .distributed_search import peak_limit_bytes

    real = share.at(target_bytes)
    return peak_limit_bytes(real if share.reserve_met else replace(real, reserved_later_bytes=0), held_bytes)


def overrule_refusal(simulated_peak_bytes: int, checked_peak_bytes: Optional[int], target_bytes: int,
                     budget_bytes: int, graph_id: str = "") -> Judgement:
    """The verdict on the smallest-peak plan of a graph whose budget the simulator refused (pure).

    "accepted: Inductor's check overrules the simulator" when the generated code peaks at or under
    ``target_bytes`` (the simulator over-predicted that plan: the budget fits after all); otherwise
    "refused", and the refusal stands (``named_budget_after_check`` says which budget to name)."""
    record = (simulated_peak_bytes, checked_peak_bytes, target_bytes, budget_bytes)
    if checked_peak_bytes is not None and checked_peak_bytes <= target_bytes:
        return Judgement("accepted: Inductor's check overrules the simulator", *record,
                         checked_peak_bytes / max(simulated_peak_bytes, 1), graph_id=graph_id)
    return Judgement("refused", *record, None if checked_peak_bytes is None else
                     checked_peak_bytes / max(simulated_peak_bytes, 1), graph_id=graph_id)


def named_budget_after_check(refusal: Refusal, checked_peak_bytes: Optional[int]) -> Optional[int]:
    """The budget a refused graph's error names once Inductor checked the plan it rests on (the lowest-
    checked of the smallest-peak plan and the free min-cut plan): the smallest budget whose planning
    target holds that checked peak; None (keep the simulator's figure) when the code could not be read.
    Below the simulator's smallest peak, a retry there is refused by the simulator again and that same
    plan then checks under its target. Above it, the simulator's figure would name a budget the plan
    it rests on is known to exceed: the retry's plans are judged as any plan, and when the corrected
    re-plan is refused the smallest-peak plan is compiled and checked again
    (``judge_loop.judge_compiled``), so the budget named is one that is then accepted."""
    from .options import smallest_budget_bytes

    if checked_peak_bytes is None:
        return None
    return smallest_budget_bytes(lambda b: refusal.target_for(b) >= checked_peak_bytes, checked_peak_bytes)


def annotate_dump(dump_path: Optional[str], judgement: Judgement) -> None:
    """Write the verdict into a plan's dump: ``plan.json`` gets ``accepted_on`` and
    ``inductor_check``; ``report.md`` a line after its summary saying which number the plan was
    accepted on. Nothing without a dump."""
    if dump_path is None:
        return
    directory = Path(dump_path)
    plan_path, report_path = directory / "plan.json", directory / "report.md"
    if plan_path.exists():
        data = json.loads(plan_path.read_text())
        data["accepted_on"] = judgement.accepted_on
        data["inductor_check"] = {**asdict(judgement), "units": "bytes; factor = checked / simulated peak"}
        plan_path.write_text(json.dumps(data, indent=1) + "\n")
    if report_path.exists():
        lines = report_path.read_text().splitlines()
        if len(lines) > 2 and lines[2].startswith(("accepted on ", "rejected by ")):
            lines[2] = judgement_line(judgement)       # a later verdict on the same plan
        else:
            lines[1:1] = ["", judgement_line(judgement)]
        report_path.write_text("\n".join(lines) + "\n")


def judgement_line(judgement: Judgement) -> str:
    """The report's sentence on which number the plan was accepted on (or why it was replaced)."""
    gb = 1e9
    if judgement.checked_peak_bytes is None:
        return (f"accepted on the simulated peak {judgement.simulated_peak_bytes / gb:.6f} GB: Inductor's generated "
                f"code could not be read (1 GB = 1e9 bytes)")
    read = (f"{judgement.checked_peak_bytes / gb:.6f} GB read from Inductor's generated forward and backward "
            f"(simulated {judgement.simulated_peak_bytes / gb:.6f} GB")
    if judgement.action == "re-plan":
        assert judgement.target_bytes is not None and judgement.new_target_bytes is not None
        return (f"rejected by Inductor's check: {read}), over the target {judgement.target_bytes / gb:.6f} GB; "
                f"re-planned at a simulated target of {judgement.new_target_bytes / gb:.6f} GB (1 GB = 1e9 bytes)")
    return f"accepted on the Inductor-checked peak: {read}); verdict: {judgement.action} (1 GB = 1e9 bytes)"
