"""The search for one graph's plan under its share of a distributed step's budget, and the
replay that names the budget a refused DDP piece needs (``distributed_fit.fit_plan`` uses both).

``fit_share``: the largest planning target whose plan the share admits (the loose target, a
bisection down to the safe one, the plans near the smallest peak), the reserve for later pieces
a preference, not a condition. ``Replay``: what a retry at another budget would do, the earlier
pieces planned again in order (each keeps its ``refit_of`` on the step's ledger), so that the
budget a refused piece names is one at which every piece up to it is admitted.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .distributed import GraphShare, largest_admitted
from .distributed_errors import budget_for_step_target
from .errors import BudgetInfeasibleError, raise_budget_hint
from .units import format_gb_up


FIT_ROUNDS = 4


def _admitted(share: GraphShare, plan: Any, target: int, held_of: "Callable[[Any], int]",
              plan_capped: "Optional[Callable[[int, int], Any]]") -> Any:
    """``plan`` if the share admits it; else, given ``plan_capped``, the plan for the same target
    made to save less (``make_plan(saved_cap_bytes=)``: what it holds beyond its saved bytes, its
    activation inputs, stays), if the share admits that one; else None."""
    held = held_of(plan)
    if share.admits(held, plan.predicted_peak_bytes):
        return plan
    if plan_capped is None:
        return None
    cap = share.largest_held_bytes(plan.predicted_peak_bytes) - (held - plan.saved_bytes)
    if cap < 0:
        return None
    try:
        capped = plan_capped(max(target, 1), cap)
    except BudgetInfeasibleError:
        return None
    return capped if share.admits(held_of(capped), capped.predicted_peak_bytes) else None


class NoPlan(Exception):
    """No plan of this graph is admitted under its share (``fit_share``): the planner's error, the
    plans near its smallest peak that were tried, and whether even the loose target failed."""

    def __init__(self, error: BudgetInfeasibleError, candidates: "list[tuple[int, Any]]", loose: bool) -> None:
        super().__init__(str(error))
        self.error, self.candidates, self.loose = error, candidates, loose


def fit_share(share: GraphShare, held_of: "Callable[[Any], int]", plan_at: "Callable[[int], Any]",
         plan_capped: "Optional[Callable[[int, int], Any]]") -> tuple[Any, GraphShare]:
    """``fit_plan``'s search for one share (see there); raises ``NoPlan``."""
    from dataclasses import replace

    high = share.loose_target_bytes
    try:
        plan = plan_at(max(high, 1))
    except BudgetInfeasibleError as error:
        # No plan the planner finds for this target; but it is a heuristic, so a plan made for a
        # higher target near the smallest peak can peak at or under this one (measured: GPT-2's
        # body, refused at a 5.00 MB loose target while the plan made for 5.38 MB peaked at
        # exactly 5.00 MB, so the budget the refusal named was refused again)
        return _from_candidates(share, error, holding_least(near_smallest(error, plan_at), plan_capped), held_of,
                                loose=True)
    admitted = _admitted(share, plan, high, held_of, plan_capped)
    if admitted is not None:
        return admitted, replace(share, target_bytes=high)
    low, best = share.target_bytes, None
    for _ in range(FIT_ROUNDS):
        if high - low <= max(high // 50, 1):
            break
        middle = (low + high) // 2
        try:
            trial = plan_at(max(middle, 1))
        except BudgetInfeasibleError as error:
            # No plan peaks this low; the planner names the smallest peak it reaches.
            low = max(middle, named_peak(error) - 1)
            continue
        admitted = _admitted(share, trial, middle, held_of, plan_capped)
        if admitted is not None:
            low, best = middle, (admitted, middle)
        else:
            high = middle
    if best is not None:
        return best[0], replace(share, target_bytes=best[1])
    try:
        return plan_at(max(share.target_bytes, 1)), share
    except BudgetInfeasibleError as error:
        # Last, the plans just above the smallest peak the planner names: the admitted
        # targets can be a window the bisection stepped over.
        return _from_candidates(share, error, holding_least(near_smallest(error, plan_at), plan_capped), held_of,
                                loose=False)


def _from_candidates(share: GraphShare, error: BudgetInfeasibleError, candidates: "list[tuple[int, Any]]",
                     held_of: "Callable[[Any], int]", loose: bool) -> tuple[Any, GraphShare]:
    """The admitted plan of ``candidates`` (target, plan) made for the largest target; else, the
    reserve being an estimate of what later pieces need, the one holding least whose own runs fit
    (``reserve_met`` False: the later pieces get the rest). Raises ``NoPlan`` (with ``error``,
    the planner's, and ``loose``) when none fits. The same candidates and the same ``admits``
    name the budget of the refusal (``distributed_fit._infeasible``), so a budget named is one a
    plan here is admitted at."""
    from dataclasses import replace

    admitted = [(t, c) for t, c in candidates if share.admits(held_of(c), c.predicted_peak_bytes)]
    if admitted:
        target, plan = max(admitted, key=lambda tc: tc[0])
        return plan, replace(share, target_bytes=target)
    unreserved = replace(share, reserved_later_bytes=0)
    fitting = [(held_of(c), c.predicted_peak_bytes, -t, c) for t, c in candidates
               if unreserved.admits(held_of(c), c.predicted_peak_bytes)]
    if fitting:
        _, _, negative_target, plan = min(fitting, key=lambda f: f[:3])
        return plan, replace(share, target_bytes=-negative_target, reserve_met=False)
    raise NoPlan(error, candidates, loose) from None


def remembered(make: "Optional[Callable[..., Any]]") -> "Optional[Callable[..., Any]]":
    """``make`` (a planner: the same arguments give the same plan or the same error) with its
    answers kept, for the searches and replays that ask it again."""
    if make is None:
        return None
    answers: dict[tuple, Any] = {}

    def remembered(*args: Any) -> Any:
        if args not in answers:
            try:
                answers[args] = make(*args)
            except BudgetInfeasibleError as error:
                answers[args] = error
        answer = answers[args]
        if isinstance(answer, BudgetInfeasibleError):
            raise answer
        return answer

    return remembered


def refit_of(share: GraphShare, held_of: "Callable[[Any], int]", plan_at: "Callable[[int], Any]",
           plan_capped: "Optional[Callable[[int, int], Any]]") -> "Callable[[int, int], Optional[int]]":
    """How this piece plans at another budget: ``refit(step_target, held_before)`` is what the
    plan ``fit_plan`` makes there holds, or None when none is admitted (its reserve estimate does
    not depend on the budget: ``calibrate_reserve`` reads only the smallest-peak plan)."""
    from dataclasses import replace

    answers: dict[tuple[int, int], Optional[int]] = {}

    def refit(step_target: int, held_before: int) -> Optional[int]:
        key = (step_target, held_before)
        if key not in answers:
            try:
                moved = replace(share, held_before_bytes=held_before).at(step_target)
                plan, _ = fit_share(moved, held_of, plan_at, plan_capped)
                answers[key] = held_of(plan)
            except NoPlan:
                answers[key] = None
        return answers[key]

    return refit


REPLAY_ROUNDS = 8           # budgets a refused piece tries, replaying the earlier pieces at each
REPLAY_STEP = 1000          # each one at least 1/REPLAY_STEP above the one before
REPLAY_BISECTIONS = 6       # then at most this many bisections towards the last budget refused,
REPLAY_PRECISION = 200      # stopping within 1/REPLAY_PRECISION of it


class Replay:
    """What a retry at another budget would do, for a DDP piece refused at this one: the
    earlier pieces planned again in forward order (``earlier``: their ``refit_of``), each next to
    what the ones before it hold, as the ledger would record them; then this piece (``fit_share``)."""

    def __init__(self, earlier: "list[Callable[[int, int], Optional[int]]]", share: GraphShare,
                 held_of: "Callable[[Any], int]", plan_at: "Callable[[int], Any]",
                 plan_capped: "Optional[Callable[[int, int], Any]]", target_for_budget: "Callable[[int], int]") -> None:
        self.earlier, self.share, self.held_of = earlier, share, held_of
        self.plan_at, self.plan_capped, self.target_for_budget = plan_at, plan_capped, target_for_budget

    def held_before(self, step_target: int) -> Optional[int]:
        """What the earlier pieces hold at ``step_target``; None if one of them is refused there."""
        held_before = 0
        for refit in self.earlier:
            held = refit(step_target, held_before)
            if held is None:
                return None
            held_before += held
        return held_before

    def admits(self, budget: int, candidates: "list[tuple[int, Any]]") -> tuple[bool, Optional[int]]:
        """Whether a retry at ``budget`` admits every piece up to this one; if not, the budget this
        piece's plans near its smallest peak (``candidates``) need next to what the earlier pieces
        hold there (None when an earlier piece is refused there, or there are no candidates)."""
        from dataclasses import replace

        step = self.target_for_budget(budget)
        held_before = self.held_before(step)
        if held_before is None:
            return False, None
        moved = replace(self.share, held_before_bytes=held_before)
        try:
            fit_share(moved.at(step), self.held_of, self.plan_at, self.plan_capped)
            return True, None
        except NoPlan:
            pass
        return False, min((budget_for_step_target(step_target_admitting(moved, self.held_of(c), c.predicted_peak_bytes),
                                                  self.target_for_budget) for _, c in candidates), default=None)

    def named(self, error: BudgetInfeasibleError, candidates: "list[tuple[int, Any]]") -> BudgetInfeasibleError:
        """``error`` naming a budget at which the replay admits every piece up to this one: from the
        budget ``error`` names, each round moves to what this piece needs next to what the earlier
        pieces hold at the budget tried (``_next``), until one is admitted (``REPLAY_ROUNDS`` at
        most); then bisections between it and the last refused one (``REPLAY_BISECTIONS``, to
        1/``REPLAY_PRECISION``). ``error`` unchanged when it names such a budget already, or none is found."""
        refused, budget, tried = error.budget_bytes, error.min_budget_bytes, []
        for _ in range(REPLAY_ROUNDS):
            admitted, needed = self.admits(budget, candidates)
            if admitted:
                break
            refused, budget = budget, self._next(budget, needed, tried)
        else:
            return error
        for _ in range(REPLAY_BISECTIONS):
            if budget - refused <= max(budget // REPLAY_PRECISION, 1):
                break
            middle = (refused + budget) // 2
            if self.admits(middle, candidates)[0]:
                budget = middle
            else:
                refused = middle
        return error if budget == error.min_budget_bytes else _renamed(error, budget, len(self.earlier))

    @staticmethod
    def _next(budget: int, needed: Optional[int], tried: "list[tuple[int, int]]") -> int:
        """The next budget to try: what this piece needed next to the earlier pieces' held bytes
        at ``budget``; from the second round, where the line through the last two (budget, needed)
        pairs meets needed = budget (what the earlier pieces hold grows with the budget, often
        about linearly: moving to ``needed`` alone only halves the gap when they keep half of any
        more room), but never more than twice as far as ``needed`` (a slope near 1 sends that
        point far off; the bisection after brings it back). At least 1/``REPLAY_STEP`` above
        ``budget`` (1/8 when nothing was needed)."""
        floor = budget + max(budget // (REPLAY_STEP if needed is not None else 8), 1)
        if needed is None:
            return floor
        tried.append((budget, needed))
        if len(tried) >= 2:
            (b1, n1), (b2, n2) = tried[-2], tried[-1]
            if b2 != b1 and (n2 - n1) < (b2 - b1):      # slope below 1: the fixed point exists
                slope = (n2 - n1) / (b2 - b1)
                meets = int((n2 - slope * b2) / (1 - slope))
                return max(floor, needed, min(meets + meets // REPLAY_STEP, 2 * needed - budget))
        return max(floor, needed)


def _renamed(error: BudgetInfeasibleError, budget: int, earlier_pieces: int) -> BudgetInfeasibleError:
    """``error`` naming ``budget`` instead, and saying why."""
    old = error.min_budget_bytes
    note = (f"Replayed at a larger budget, the {earlier_pieces} earlier piece(s) plan at larger targets and hold more, "
            f"so the step target above is not enough: every piece up to this one is admitted at "
            f"{format_gb_up(budget)} GB. ")
    message = str(error).replace(f"smallest feasible budget {format_gb_up(old)} GB",
                                 f"smallest feasible budget {format_gb_up(budget)} GB")
    message = message.replace(raise_budget_hint(old), note + raise_budget_hint(budget))
    return BudgetInfeasibleError(message, budget_bytes=error.budget_bytes, min_feasible_bytes=error.min_feasible_bytes,
                                 min_budget_bytes=budget, reasons=error.reasons)


# Targets tried just above the smallest peak the planner names, as multiples of it: a plan
# allowed a little more peak can hold much less for its backward (the zoo GPT's block under
# FSDP2: +0.4% peak, -0.8 MB held), which a graph run several times per step needs more.
NEAR_SMALLEST_FACTORS = (1.0, 1.02, 1.05, 1.1, 1.2, 1.35)


def near_smallest(error: BudgetInfeasibleError, plan_at: "Callable[[int], Any]") -> list[tuple[int, Any]]:
    """(target, plan) for the targets ``NEAR_SMALLEST_FACTORS`` times the smallest peak the
    planner named when it refused a target; the ones it plans (the first always does: a
    target at the smallest peak gets that plan)."""
    named = named_peak(error)
    found = []
    for factor in NEAR_SMALLEST_FACTORS:
        target = max(int(named * factor), 1)
        try:
            found.append((target, plan_at(target)))
        except BudgetInfeasibleError:
            continue
    return found


def holding_least(candidates: "list[tuple[int, Any]]", plan_capped: "Optional[Callable[[int, int], Any]]"
                   ) -> "list[tuple[int, Any]]":
    """``candidates`` and, given ``plan_capped``, each target's plan saving as little as it can at
    that peak (cap 0): near the smallest peak, what a plan holds often decides admission."""
    if plan_capped is None:
        return candidates
    capped = []
    for target, _ in candidates:
        try:
            capped.append((target, plan_capped(target, 0)))
        except BudgetInfeasibleError:
            continue
    return candidates + capped


def step_target_admitting(share: GraphShare, held: int, peak: int) -> int:
    """The smallest step target at which ``share`` admits a plan holding ``held`` and peaking
    at ``peak`` (admission grows with the step target: a bisection finds it)."""
    low, high = 0, max(share.step_target_bytes, 1)
    while not share.at(high).admits(held, peak):
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        if share.at(middle).admits(held, peak):
            high = middle
        else:
            low = middle
    return high


def peak_limit_bytes(share: GraphShare, held_bytes: int) -> int:
    """The largest peak at which ``share`` admits a plan holding ``held_bytes`` (admission only
    gets stricter as the peak grows); -1 when no peak is admitted. The target Inductor's check
    judges a graph of a step against: its checked peak must be at or under it."""
    return largest_admitted(lambda peak: share.admits(held_bytes, peak), share.step_target_bytes)


def named_peak(error: BudgetInfeasibleError) -> int:
    """The smallest simulated peak the planner reached (its error's ``min_feasible_bytes``)."""
    return error.min_feasible_bytes
