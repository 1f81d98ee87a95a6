"""The exact reference solver: least recompute time under a simulated-peak target.

``solve_min_time(facts, target_bytes)`` chooses, for every forward value the
backward needs (directly or to recompute another), whether the forward saves it
or the backward recomputes it, minimising the estimated time of the recomputed
nodes subject to the *simulated* peak (``plan.evaluate``) being at most the
target. Each value is recomputed at most once (Checkmate's general schedule,
which may recompute a value several times and free it in between, is out of
scope): that is the plan space ``partition_nodes`` can express.

The construction, once:

* Variables. ``s_v`` (saved) and ``r_v`` (recomputed) are binaries for every
  forward value ``v`` that can reach a backward read through forward values.
  A value that may not be recomputed (random op, mutation, symbolic size, ...)
  has no ``r_v``; a tuple-valued op has no ``s_v`` (only its getitems can be saved).
* Closure, exactly as ``partition_nodes`` closes a saved set. A value a backward
  node reads: ``s_v + r_v >= 1``; an input ``u`` of a recomputed ``w``:
  ``s_u + r_u >= r_w``; ``s_v + r_v <= 1``; and nothing is saved or recomputed
  unless something needs it: ``s_v + r_v <= [v read by backward] + sum r_w`` over
  its users ``w``. With these, ``{v : r_v = 1}`` *is* the recomputed set of the
  partition of ``{v : s_v = 1}``, so the objective ``sum est_time_s(v) * r_v``
  is the plan's estimated extra time exactly.
* Memory, a lower bound. The simulator's peak depends on where each recompute
  region lands (before its first backward use), on Inductor-style inlining of
  pointwise ops and on in-place buffer reuse; not all of that is linear. So the
  MILP only encodes bytes that are *certainly* live at a sample point, whatever
  the plan: after each forward op every plan runs, at the tangents step, and
  after each backward op. A saved value's storage is live from its producer
  until its last backward read, and at least until just before the earliest
  backward node that could need it; a recomputed value's storage (when it is
  certainly materialised, not inlined) is live between its first and last
  direct backward reads; views read their source's storage (a product of
  binaries, linearised as ``L >= sum x - (n - 1)``). Bytes that do not depend
  on the plan (backward temporaries, gradients, tangents, forward outputs, ops
  every plan materialises) form a constant per sample point, taken from the
  simulator itself. At a step that may reuse a dying input in place, storages
  read last at that step are not counted. One row per distinct sample point:
  ``sum bytes * live <= target - constant``.
* Verification and lazy cuts. Every MILP solution is evaluated with the real
  simulator. If its peak exceeds the target, a no-good cut on the saved set
  removes exactly that plan (the saved set determines the plan) and the MILP is
  solved again; a verified plan becomes the incumbent and an objective cutoff
  row asks for something strictly cheaper. The loop ends when the MILP is
  infeasible (the incumbent is optimal), when a solution verifies at the MILP's
  own optimum, or at the time limit.

Optimality therefore rests on the memory rows being a lower bound of the
simulated peak; ``tests/test_solvers.py`` checks the result against exhaustive
enumeration (``solve_exhaustive.py``). Feasibility rests on nothing: every plan
returned was simulated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

from . import schedule
from .joint_graph import JointGraphFacts
from .mincut import saved_cost_bytes
from .plan import evaluate

MAX_CHAIN = 6            # how far a recompute chain is followed to place a region early
MAX_SOLVES = 500          # MILP solves (1 + cuts) before giving up as if out of time
_TIME_SCALE = 1e6         # objective in microseconds: keeps HiGHS's absolute tolerances meaningful
_REL_TOL = 1e-7


@dataclass(frozen=True)
class MilpResult:
    """What ``solve_min_time`` found.

    status: "optimal" (proven least extra time among one-recomputation plans),
    "time_limit" (stopped by ``time_limit_s`` or ``MAX_SOLVES``; ``chosen_saved``
    is the best verified plan found, or None), "infeasible" (no plan's simulated
    peak meets the target). ``chosen_saved`` is None exactly when no plan
    meeting the target was found; pass it to ``plan.evaluate`` to get the partition.
    """

    status: str
    chosen_saved: Optional[tuple[str, ...]]
    est_extra_time_s: Optional[float]
    simulated_peak_bytes: Optional[int]
    target_bytes: int
    lower_bound_s: float          # proven lower bound on the optimal extra time (inf when infeasible)
    solves: int                   # MILP solves; solves - 1 lazy cuts were added at most
    rejected_by_simulator: int    # MILP solutions whose simulated peak exceeded the target
    solve_time_s: float


def solve_min_time(
    facts: JointGraphFacts,
    target_bytes: int,
    *,
    time_limit_s: float = 60.0,
    start: Optional[AbstractSet[str]] = None,
) -> MilpResult:
    """Least estimated extra time plan whose simulated peak is <= ``target_bytes``.

    ``start`` (e.g. the greedy's saved set), when its simulated peak meets the
    target, is the first incumbent: on a time limit the result is never worse.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    model = _build_model(facts, target_bytes)
    incumbent: Optional[tuple[float, frozenset[str], int]] = None   # (extra time s, saved, peak)
    if start is not None:
        trial = evaluate(facts, start)
        if trial.simulation.peak_bytes <= target_bytes:
            incumbent = (trial.extra_time_s, frozenset(start), trial.simulation.peak_bytes)
    cut_rows: list[tuple[dict[int, float], float, float]] = []
    solves = rejected = 0
    status, lower_bound = "time_limit", 0.0
    while solves < MAX_SOLVES:
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            break
        rows = list(cut_rows)
        if incumbent is not None:  # ask for strictly cheaper than the incumbent
            cutoff = incumbent[0] * _TIME_SCALE
            rows.append(({i: c for i, c in model.objective.items()}, -math.inf, cutoff - max(1e-9, _REL_TOL * cutoff)))
        result = model.solve(rows, remaining)
        solves += 1
        if result.status == 2:      # infeasible: nothing (cheaper) meets the target
            status, lower_bound = ("optimal", incumbent[0]) if incumbent else ("infeasible", math.inf)
            break
        if result.x is None:        # time limit before any solution
            lower_bound = max(lower_bound, _dual_bound(result))
            break
        saved = model.saved_set(result.x)
        trial = evaluate(facts, saved)
        fits = trial.simulation.peak_bytes <= target_bytes
        if fits and (incumbent is None or trial.extra_time_s < incumbent[0]):
            incumbent = (trial.extra_time_s, saved, trial.simulation.peak_bytes)
        rejected += not fits
        lower_bound = max(lower_bound, _dual_bound(result))
        if result.status != 0:
            break
        if fits and trial.extra_time_s * _TIME_SCALE <= result.fun * (1 + _REL_TOL) + 1e-9:
            status, lower_bound = "optimal", trial.extra_time_s
            break
        cut_rows.append(model.no_good(saved))
    return MilpResult(
        status=status,
        chosen_saved=tuple(sorted(incumbent[1])) if incumbent else None,
        est_extra_time_s=incumbent[0] if incumbent else None,
        simulated_peak_bytes=incumbent[2] if incumbent else None,
        target_bytes=target_bytes,
        lower_bound_s=lower_bound,
        solves=solves,
        rejected_by_simulator=rejected,
        solve_time_s=time.perf_counter() - t0,
    )


def _dual_bound(result) -> float:
    bound = getattr(result, "mip_dual_bound", None)
    if bound is None or not math.isfinite(bound):
        return 0.0
    return max(0.0, bound / _TIME_SCALE)


def must_save_reason(facts: JointGraphFacts, name: str) -> Optional[str]:
    """Why ``partition_nodes`` would save ``name`` rather than recompute it, or None."""
    node = facts.nodes[name]
    reason = node.recompute_ban or ("symbolic size" if node.is_sym else None)
    if reason is None and node.is_getitem and node.inputs:
        source = facts.nodes[node.inputs[0]]
        if source.is_multi_output and source.recompute_ban is not None:
            reason = source.recompute_ban
    return reason


def relevant_forward(facts: JointGraphFacts) -> list[str]:
    """Forward values that reach a backward read through forward values, in joint order."""
    seen: set[str] = set()
    stack = [n for n in facts.needed_by_backward if facts.nodes[n].role == "forward"]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        stack.extend(i for i in facts.nodes[name].inputs if facts.nodes[i].role == "forward")
    return [n for n in facts.order if n in seen]


@dataclass
class _Model:
    """The MILP: variable columns, constant rows, and how to read a solution back."""

    s_col: dict[str, int]
    r_col: dict[str, int]
    n_cols: int
    integer: np.ndarray
    upper: np.ndarray
    objective: dict[int, float]
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def solve(self, extra_rows: list[tuple[dict[int, float], float, float]], time_limit_s: float):
        rows = self.rows + extra_rows
        c = np.zeros(self.n_cols)
        for col, coef in self.objective.items():
            c[col] = coef
        options = {"time_limit": max(time_limit_s, 1e-3), "mip_rel_gap": _REL_TOL, "disp": False}
        if not rows:
            return milp(c, integrality=self.integer, bounds=Bounds(np.zeros(self.n_cols), self.upper), options=options)
        data, indices, indptr = [], [], [0]
        lower, upper = [], []
        for coefs, lo, hi in rows:
            indices.extend(coefs)
            data.extend(coefs.values())
            indptr.append(len(indices))
            lower.append(lo)
            upper.append(hi)
        matrix = csr_matrix((data, indices, indptr), shape=(len(rows), self.n_cols))
        return milp(
            c,
            integrality=self.integer,
            bounds=Bounds(np.zeros(self.n_cols), self.upper),
            constraints=LinearConstraint(matrix, np.array(lower), np.array(upper)),
            options=options,
        )

    def saved_set(self, x: np.ndarray) -> frozenset[str]:
        return frozenset(name for name, col in self.s_col.items() if x[col] > 0.5)

    def no_good(self, saved: frozenset[str]) -> tuple[dict[int, float], float, float]:
        """Row excluding exactly the saved set ``saved``: at least one s flips."""
        free = {name: col for name, col in self.s_col.items() if self.upper[col] > 0}
        coefs = {col: (-1.0 if name in saved else 1.0) for name, col in free.items()}
        return coefs, 1.0 - sum(1 for name in free if name in saved), math.inf


def _build_model(facts: JointGraphFacts, target_bytes: int) -> _Model:
    relevant = relevant_forward(facts)
    in_relevant = set(relevant)
    s_col: dict[str, int] = {}
    r_col: dict[str, int] = {}
    for name in relevant:
        node = facts.nodes[name]
        cannot_recompute = must_save_reason(facts, name) is not None
        if not node.is_multi_output or cannot_recompute:
            s_col[name] = len(s_col) + len(r_col)
        if not cannot_recompute:
            r_col[name] = len(s_col) + len(r_col)
    n_binary = len(s_col) + len(r_col)
    model = _Model(s_col, r_col, n_binary, np.ones(n_binary), np.ones(n_binary), {})
    for name in _free_aliases(facts, relevant):
        if name in r_col:   # saving or recomputing it is the same plan: keep one, so cuts don't see two
            model.upper[s_col[name]] = 0.0
    for name, col in r_col.items():
        cost = facts.nodes[name].cost.est_time_s * _TIME_SCALE
        if cost:
            model.objective[col] = cost
    _closure_rows(facts, model, relevant, in_relevant)
    live = _Liveness(facts, model, relevant, in_relevant)
    for base_bytes, terms in live.sample_points():
        coefs: dict[int, float] = {}
        for col, nbytes in terms:
            coefs[col] = coefs.get(col, 0.0) + nbytes / target_bytes if target_bytes > 0 else nbytes
        rhs = (target_bytes - base_bytes) / target_bytes if target_bytes > 0 else -base_bytes
        model.rows.append((coefs, -math.inf, rhs))
    return model


def _free_aliases(facts: JointGraphFacts, relevant: list[str]) -> set[str]:
    """Values that alias parameters only and cost nothing to rebuild, down to the parameters."""
    free: set[str] = set()
    for name in relevant:
        node = facts.nodes[name]
        if (must_save_reason(facts, name) is None and not node.is_multi_output and node.cost.est_time_s == 0
                and saved_cost_bytes(facts, name) == 0 and not node.allocs
                and all(facts.nodes[i].role == "primal" or i in free for i in node.inputs)):
            free.add(name)
    return free


def _closure_rows(facts: JointGraphFacts, model: _Model, relevant: list[str], in_relevant: set[str]) -> None:
    """Rows that make (s, r) exactly the partition ``partition_nodes`` builds from s."""
    read_by_backward = set(facts.needed_by_backward)
    for name in relevant:
        own = {model.s_col[name]: 1.0} if name in model.s_col else {}
        if name in model.r_col:
            own[model.r_col[name]] = 1.0
        recomputing_users = [model.r_col[u] for u in facts.users[name] if u in in_relevant and u in model.r_col]
        if name in read_by_backward:
            model.rows.append((dict(own), 1.0, math.inf))
        else:
            row = dict(own)
            for col in recomputing_users:
                row[col] = row.get(col, 0.0) - 1.0
            model.rows.append((row, -math.inf, 0.0))
        for col in recomputing_users:
            row = dict(own)
            row[col] = row.get(col, 0.0) - 1.0
            model.rows.append((row, 0.0, math.inf))
        if len(own) == 2:
            model.rows.append((dict(own), -math.inf, 1.0))


Monomial = frozenset  # of column indices; true when every binary in it is 1


class _Liveness:
    """Certainly-live bytes per sample point, as constants plus terms over monomials."""

    def __init__(self, facts: JointGraphFacts, model: _Model, relevant: list[str], in_relevant: set[str]) -> None:
        self.facts, self.model, self.relevant, self.in_relevant = facts, model, relevant, in_relevant
        self.backward = [n for n in facts.order if facts.nodes[n].role == "backward"]
        self.bpos = {n: k for k, n in enumerate(self.backward)}
        self.position = facts.position()
        self.reference = self._reference_timeline()
        self.pinned = self.reference[3]
        self.bytes_of: dict[str, int] = {}
        for name in facts.order:
            for sid, nbytes in facts.nodes[name].allocs:
                self.bytes_of[sid] = nbytes
                self.bytes_of[sid + schedule.RECOMPUTE_SUFFIX] = nbytes
        self.earliest = self._earliest_backward_use()

    # -- plan-independent parts, read off one simulated reference plan ----------------------------
    def _reference_timeline(self):
        """(base bytes at tangents step, base bytes per backward node, owner position, pinned storages).

        Backward nodes read only backward storages or forward values; which backward storages
        exist and when they die does not depend on the plan, so one simulation (save all
        needed values, nothing recomputed) gives them; recompute steps are absent from it.
        """
        save_all = {n for n in self.facts.needed_by_backward if self.facts.nodes[n].role == "forward"}
        partition = schedule.partition_nodes(self.facts, save_all)
        steps, pinned = schedule.memory_steps(self.facts, partition)
        first_bw = next(i for i, s in enumerate(steps) if s.phase == "backward")
        alloc_at: dict[str, int] = {}
        last_use: dict[str, int] = {}
        for index, step in enumerate(steps):
            for sid, _ in step.allocs:
                alloc_at.setdefault(sid, index)
                last_use[sid] = max(last_use.get(sid, index), index)
            for sid in step.uses:
                if sid in alloc_at:
                    last_use[sid] = index
        pinned_fwd = {sid for sid in pinned if sid in alloc_at and alloc_at[sid] < first_bw}
        pinned_fwd_bytes = sum(self._size(steps, sid) for sid in pinned_fwd)
        backward_owned = [sid for sid, i in alloc_at.items() if i >= first_bw]
        base: list[int] = []
        for index in range(first_bw, len(steps)):
            reuses = steps[index].reuses_inputs
            total = pinned_fwd_bytes
            for sid in backward_owned:
                last = math.inf if sid in pinned else last_use[sid]
                if alloc_at[sid] <= index and (last > index or (last == index and not reuses)):
                    total += self._size(steps, sid)
            base.append(total)
        return base[0], base[1:], alloc_at, frozenset(pinned_fwd)

    @staticmethod
    def _size(steps, sid: str) -> int:
        for step in steps:
            for other, nbytes in step.allocs:
                if other == sid:
                    return nbytes
        return 0

    def _earliest_backward_use(self) -> dict[str, int]:
        """Earliest backward position that could read each relevant value or what it feeds."""
        earliest: dict[str, int] = {}
        for name in reversed(self.relevant):
            best = min((self.bpos[u] for u in self.facts.users[name] if u in self.bpos), default=len(self.backward))
            for user in self.facts.users[name]:
                if user in earliest:
                    best = min(best, earliest[user])
            earliest[name] = best
        return earliest

    # -- which storages a value holds --------------------------------------------------------------
    def _forward_storages(self, name: str) -> list[str]:
        out = []
        for sid in self.facts.nodes[name].value_storages:
            owner = self.facts.nodes.get(sid.split("#")[0])
            if owner is not None and owner.role == "forward" and sid not in self.pinned:
                out.append(sid)
        return out

    def _materialized_when_recomputed(self, name: str) -> bool:
        node = self.facts.nodes[name]
        if not node.allocs or node.is_view or node.is_getitem:
            return False
        if not node.inlinable or not schedule.INLINE_FUSED:
            return True
        readers = [u for u in self.facts.users[name] if self.facts.nodes[u].role == "backward"]
        if schedule.SINGLE_READER_ONLY and len(readers) > 1:
            return True
        return any(not self.facts.nodes[u].fusible_consumer for u in readers)

    def _held(self, name: str, depth: int = 0) -> list[tuple[Monomial, str]]:
        """(monomial, storage): the storage ``name``'s value refers to when the monomial holds."""
        node = self.facts.nodes[name]
        if node.role != "forward" or name not in self.in_relevant:
            return []
        terms: list[tuple[Monomial, str]] = []
        if name in self.model.s_col:
            terms += [(Monomial({self.model.s_col[name]}), sid) for sid in self._forward_storages(name)]
        if name not in self.model.r_col:
            return terms
        r = self.model.r_col[name]
        if (node.is_view or node.is_getitem) and node.inputs and depth < 8:
            wanted = set(node.value_storages)
            for mono, sid in self._held(node.inputs[0], depth + 1):
                if sid.removesuffix(schedule.RECOMPUTE_SUFFIX) in wanted:
                    terms.append((mono | {r}, sid))
        elif self._materialized_when_recomputed(name):
            terms += [(Monomial({r}), sid + schedule.RECOMPUTE_SUFFIX) for sid, _ in node.allocs if sid not in self.pinned]
        return terms

    # -- the sample points -------------------------------------------------------------------------
    def _reach_by_recompute(self, name: str) -> list[tuple[Monomial, int]]:
        """(monomial, position): if ``name`` and a path of recomputed users are all recomputed,
        ``name`` is recomputed no later than the region before backward position ``position``.

        Breadth-first over forward users, one shortest path per node, at most MAX_CHAIN deep.
        """
        r_col = self.model.r_col
        paths = {name: Monomial({r_col[name]})}
        frontier = [name]
        for _ in range(MAX_CHAIN):
            nxt = []
            for node in frontier:
                for user in self.facts.users[node]:
                    if user in self.in_relevant and user in r_col and user not in paths:
                        paths[user] = paths[node] | {r_col[user]}
                        nxt.append(user)
            frontier = nxt
        out = []
        for node, mono in paths.items():
            first = min((self.bpos[u] for u in self.facts.users[node] if u in self.bpos), default=None)
            if first is not None:
                out.append((mono, first))
        return _earliest_minimal(out)

    def _backward_intervals(self) -> dict[str, list[tuple[Monomial, int, int]]]:
        """Per storage: (monomial, first, last) backward positions (-1 = tangents step) it is live.

        A storage is live at k when it is certainly allocated by k (an *allocation witness*) and
        certainly read at k or later (a *read witness*); each pair of witnesses gives an interval.
        """
        suffix = schedule.RECOMPUTE_SUFFIX
        reads: dict[str, dict[Monomial, int]] = {}
        allocated: dict[str, list[tuple[Monomial, int]]] = {}

        def read(sid: str, mono: Monomial, last: int) -> None:
            per = reads.setdefault(sid, {})
            per[mono] = max(per.get(mono, last), last)

        for k, name in enumerate(self.backward):
            last_k = k - 1 if self.facts.nodes[name].inlinable else k   # may reuse a dying input in place
            for inp in self.facts.nodes[name].inputs:
                for mono, sid in self._held(inp):
                    read(sid, mono, last_k)
        for name in self.relevant:
            if name in self.model.s_col:
                s = self.model.s_col[name]
                witnesses = [(Monomial({s}), self.earliest[name] - 1)]
                witnesses += [
                    (Monomial({s, self.model.r_col[u]}), self.earliest[u] - 1)
                    for u in self.facts.users[name] if u in self.in_relevant and u in self.model.r_col
                ]
                for sid in self._forward_storages(name):
                    allocated.setdefault(sid, []).append((Monomial({s}), -1))
                    for mono, last in witnesses:
                        read(sid, mono, last)
            if name in self.model.r_col and self._materialized_when_recomputed(name):
                reach = self._reach_by_recompute(name)
                for sid, _ in self.facts.nodes[name].allocs:
                    if sid not in self.pinned:
                        allocated.setdefault(sid + suffix, []).extend(reach)
        intervals: dict[str, list[tuple[Monomial, int, int]]] = {}
        for sid, per in reads.items():
            spans = {}
            for alloc_mono, first in allocated.get(sid, ()):
                for read_mono, last in per.items():
                    if first <= last:
                        mono = alloc_mono | read_mono
                        lo, hi = spans.get(mono, (first, last))
                        spans[mono] = (min(lo, first), max(hi, last))
            intervals[sid] = [(mono, lo, hi) for mono, (lo, hi) in spans.items()]
        return intervals

    def _forward_base(self) -> list[tuple[int, set[str], int]]:
        """Per forward op every plan runs: (joint position, storages certainly live, their bytes)."""
        facts = self.facts
        required = [n for n in facts.order if n in facts.forward_required]
        req_set = set(required)
        outputs = set(facts.fwd_outputs)
        last_read: dict[str, float] = {}
        materialized: list[str] = []
        for name in required:
            node = facts.nodes[name]
            for inp in node.inputs:
                for sid in facts.nodes[inp].value_storages:
                    last_read[sid] = max(last_read.get(sid, -1), self.position[name])
            if not node.allocs or node.is_view or node.is_getitem:
                continue
            readers = [u for u in facts.users[name] if u in req_set]
            if (name in outputs or not node.inlinable or not schedule.INLINE_FUSED
                    or (schedule.SINGLE_READER_ONLY and len(readers) > 1)
                    or any(not facts.nodes[u].fusible_consumer for u in readers)):
                materialized.append(name)
        for sid in self.pinned:
            last_read[sid] = math.inf
        points = []
        for name in required:
            at = self.position[name]
            reuses = facts.nodes[name].inlinable
            live: set[str] = set()
            for producer in materialized:
                if self.position[producer] > at:
                    break
                for sid, _ in facts.nodes[producer].allocs:
                    last = last_read.get(sid, self.position[producer])
                    if last > at or (last == at and not reuses) or self.position[producer] == at:
                        live.add(sid)
            points.append((at, live, sum(self.bytes_of[s] for s in live)))
        return points

    def sample_points(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """Distinct (constant bytes, [(column, bytes)]) rows; each must satisfy constant + sum <= target."""
        tangents_base, backward_base, _, _ = self.reference
        intervals = self._backward_intervals()
        helper: dict[frozenset, int] = {}
        rows: dict[tuple, int] = {}

        def add_row(base: int, monos_by_sid: dict[str, list[Monomial]]) -> None:
            terms: dict[int, int] = {}
            for sid, monos in monos_by_sid.items():
                col = self._indicator(_minimal(monos), helper)
                if col is not None:
                    terms[col] = terms.get(col, 0) + self.bytes_of[sid]
            key = tuple(sorted(terms.items()))
            rows[key] = max(rows.get(key, base), base)

        for k in range(-1, len(self.backward)):
            monos: dict[str, list[Monomial]] = {}
            for sid, spans in intervals.items():
                hits = [mono for mono, first, last in spans if first <= k <= last]
                if hits:
                    monos[sid] = hits
            add_row(tangents_base if k < 0 else backward_base[k], monos)
        saved_from = {
            sid: self.position[sid.split("#")[0]]
            for name in self.relevant if name in self.model.s_col for sid in self._forward_storages(name)
        }
        savers: dict[str, list[Monomial]] = {}
        for name in self.relevant:
            if name in self.model.s_col:
                for sid in self._forward_storages(name):
                    savers.setdefault(sid, []).append(Monomial({self.model.s_col[name]}))
        for at, live, base in self._forward_base():
            add_row(base, {sid: savers[sid] for sid, pos in saved_from.items() if pos <= at and sid not in live})
        return [(base, list(key)) for key, base in rows.items()]

    def _indicator(self, monos: list[Monomial], helper: dict[frozenset, int]) -> Optional[int]:
        """A column that is 1 whenever any monomial holds: a binary itself, or a helper L >= each."""
        if not monos:
            return None
        if len(monos) == 1 and len(monos[0]) == 1:
            return next(iter(monos[0]))
        key = frozenset(monos)
        if key not in helper:
            model = self.model
            col = model.n_cols
            model.n_cols += 1
            model.integer = np.append(model.integer, 0)
            model.upper = np.append(model.upper, 1.0)
            helper[key] = col
            for mono in monos:
                row = {col: 1.0}
                for x in mono:
                    row[x] = -1.0
                model.rows.append((row, 1.0 - len(mono), math.inf))
        return helper[key]


def _earliest_minimal(witnesses: list[tuple[Monomial, int]]) -> list[tuple[Monomial, int]]:
    """Drop witnesses implied by another with a smaller monomial and an earlier position."""
    kept: list[tuple[Monomial, int]] = []
    for mono, pos in sorted(witnesses, key=lambda w: (w[1], len(w[0]))):
        if not any(k <= mono for k, _ in kept):
            kept.append((mono, pos))
    return kept


def _minimal(monos: list[Monomial]) -> list[Monomial]:
    """Drop monomials implied by a smaller one (a superset holds only when its subset does)."""
    unique = sorted(set(monos), key=len)
    kept: list[Monomial] = []
    for mono in unique:
        if not any(k <= mono for k in kept):
            kept.append(mono)
    return kept
