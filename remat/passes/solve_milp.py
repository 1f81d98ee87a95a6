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
  A value that may not be recomputed (``why_not_recomputable``) has no ``r_v``;
  a tuple-valued op has no ``s_v`` (only its getitems can be saved).
* Closure, exactly as ``partition_nodes`` closes a saved set. A value a backward
  node reads: ``s_v + r_v >= 1``; an input ``u`` of a recomputed ``w``:
  ``s_u + r_u >= r_w``; ``s_v + r_v <= 1``; and nothing is saved or recomputed
  unless something needs it: ``s_v + r_v <= [v read by backward] + sum r_w`` over
  its users ``w``. With these, ``{v : r_v = 1}`` *is* the recomputed set of the
  partition of ``{v : s_v = 1}``, so the objective ``sum est_time_s(v) * r_v``
  is the plan's estimated extra time exactly.
* Memory, a lower bound. The simulator follows Inductor (which values get a
  buffer, fusion into kernels, kernel order, in-place writes, a pool of freed
  buffers); most of that is not linear. So each row counts only bytes that are
  *certainly* live at one point, whatever the plan, at points whose order is
  known: the tangents step between the graphs (every saved storage, the forward
  outputs, the tangents), and the library calls (``kernel_kind`` extern or
  scatter). A call is a kernel of its own that allocates its output before it
  runs and frees its inputs after, kernels respect data dependences, and calls
  run in graph order; so at a call ``e`` a buffer is live when something at or
  before ``e`` (an earlier call, or an ancestor of one) made it and something at
  or after ``e`` (a later call, or a descendant of one) reads it. Which values
  have a buffer: library calls', reductions' and scatters' always; a loop
  value's when a call reads it (and then only from that call on); saved values'.
  At any other backward op only what calls among its ancestors made and its
  descendants read counts (it may share a kernel, or write over a dying input).
  The recomputation of a library call ``x`` gets a row of its own, every term
  multiplied by ``r_x``: its region lands before the first backward op needing
  it, between the earliest and the latest position that can be. Forward rows:
  at each forward call every plan runs, the saved storages its ancestors made.
  Reasons are products of binaries (views hold their source's storage),
  linearised as ``L >= sum x - (n - 1)``; bytes that do not depend on the plan
  are each row's constant. ``sum bytes * live <= target - constant``.
* Verification and lazy cuts. Every MILP solution is simulated. If its peak
  exceeds the target, a no-good cut on the saved set (which determines the plan)
  removes it and the MILP is solved again; a verified plan becomes the
  incumbent and an objective cutoff asks for something strictly cheaper. The
  loop ends when the MILP is infeasible (the incumbent, if any, is optimal),
  when a solution verifies at the MILP's own optimum, or at the time limit.
* A guard. Before solving, a few plans (save all, save none, the min-cut,
  random saved sets) are simulated, then every MILP solution: if a row claims
  more bytes for one of them than its simulated peak, the rows do not bound this
  simulator (it changed, or an assumption above failed) and the solve continues
  with ``memory_model="safe"``: the tangents row alone, exact for any simulator
  that keeps saved values until the backward, slower because cuts do the rest.

Optimality rests on the rows being lower bounds; ``tests/test_solvers.py``
checks the answers against exhaustive enumeration (``solve_exhaustive.py``).
Feasibility rests on nothing: every plan returned was simulated.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import AbstractSet, Mapping, Optional

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import csr_matrix

from ..cost_model.kernel_schedule import ALIAS, EXTERN, POINTWISE, SCATTER
from . import schedule
from .kernel_steps import RECOMPUTE_SUFFIX, kernel_kind
from .joint_graph import JointGraphFacts
from .mincut import min_cut_saved, saved_cost_bytes
from .evaluate import evaluate

MAX_VIEW_CHAIN = 8       # views of views followed back to the storage they alias
PROBES = 8               # random plans simulated up front to test the structural rows
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
    memory_model: str             # "structural" | "safe": which memory rows the answer rests on


def solve_min_time(
    facts: JointGraphFacts,
    target_bytes: int,
    *,
    time_limit_s: float = 60.0,
    start: Optional[AbstractSet[str]] = None,
    memory_model: str = "structural",
) -> MilpResult:
    """Least estimated extra time plan whose simulated peak is <= ``target_bytes``.

    ``start`` (e.g. the greedy's saved set), when its simulated peak meets the
    target, is the first incumbent: on a time limit the result is never worse.
    ``memory_model``: "structural" (the rows of the module docstring) or "safe" (only
    the tangents-step row: exact for any simulator that keeps saved values until the
    backward, but it leans on cuts, so it is slower). A structural row found to
    overstate the simulated peak of any plan the solver simulates switches the
    solve to "safe"; ``MilpResult.memory_model`` says which one answered.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    model = _build_model(facts, target_bytes, memory_model)
    incumbent: Optional[tuple[float, frozenset[str], int]] = None   # (extra time s, saved, peak)
    candidates = [(frozenset(start), False)] if start is not None else []
    candidates += [(plan, True) for plan in _probe_plans(facts, model)]
    for plan, probe in candidates:
        trial = evaluate(facts, plan)
        if probe and model.liveness is not None and model.unsound_rows(trial):
            model = _build_model(facts, target_bytes, "safe")
        if trial.simulation.peak_bytes <= target_bytes and (incumbent is None or trial.extra_time_s < incumbent[0]):
            incumbent = (trial.extra_time_s, plan, trial.simulation.peak_bytes)
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
            rows.append((dict(model.objective), -math.inf, cutoff - max(1e-9, _REL_TOL * cutoff)))
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
        if model.liveness is not None and model.unsound_rows(trial):
            # this solve's bound rested on a row the simulator contradicts; no-good cuts stay valid
            model, lower_bound = _build_model(facts, target_bytes, "safe"), 0.0
        else:
            lower_bound = max(lower_bound, _dual_bound(result))
            if result.status == 0 and fits and trial.extra_time_s * _TIME_SCALE <= result.fun * (1 + _REL_TOL) + 1e-9:
                status, lower_bound = "optimal", trial.extra_time_s
                break
        if result.status != 0:
            break
        cut_rows.append(model.no_good(saved))
    if incumbent is not None:
        lower_bound = min(lower_bound, incumbent[0])
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
        memory_model="structural" if model.liveness is not None else "safe",
    )


def _probe_plans(facts: JointGraphFacts, model: _Model) -> list[frozenset[str]]:
    """Plans simulated before solving: save everything, save nothing, the free min-cut, and
    a few random saved sets. They seed the incumbent, and they test the structural rows:
    a row that overstates any of them would cut feasible plans, so the solve goes "safe"."""
    everything = frozenset(n for n in facts.needed_by_backward if facts.nodes[n].role == "forward")
    plans = [everything, frozenset(), min_cut_saved(facts)]
    rng = random.Random(0)
    names = sorted(model.s_col)
    plans += [frozenset(n for n in names if rng.random() < 0.5) for _ in range(PROBES)]
    return [_tight(facts, plan) for plan in plans]


def _tight(facts: JointGraphFacts, chosen: AbstractSet[str]) -> frozenset[str]:
    """The saved set the MILP would write for the partition of ``chosen``: only values that
    the backward or a recomputation reads (saving others only keeps them longer)."""
    partition = schedule.partition_nodes(facts, chosen)
    read_by_backward = set(facts.needed_by_backward)
    return frozenset(
        name for name in partition.saved if name not in partition.forced
        and (name in read_by_backward or any(u in partition.recomputed for u in facts.users[name]))
    )


def _dual_bound(result) -> float:
    bound = getattr(result, "mip_dual_bound", None)
    if bound is None or not math.isfinite(bound):
        return 0.0
    return max(0.0, bound / _TIME_SCALE)


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
    memory_rows: list[tuple[int, int, str]] = field(default_factory=list)   # (row, constant bytes, sample step)
    target_bytes: int = 0
    liveness: Optional["_Liveness"] = None

    def add_memory_row(self, base_bytes: int, terms: list[tuple[int, int]], label: str) -> None:
        """constant + sum(bytes * column) <= target, scaled by the target."""
        scale = 1.0 / self.target_bytes if self.target_bytes > 0 else 1.0
        coefs: dict[int, float] = {}
        for col, nbytes in terms:
            coefs[col] = coefs.get(col, 0.0) + nbytes * scale
        self.memory_rows.append((len(self.rows), base_bytes, label))
        self.rows.append((coefs, -math.inf, (self.target_bytes - base_bytes) * scale))

    def unsound_rows(self, trial) -> list[str]:
        """Memory rows that claim more bytes for this simulated plan than its simulated peak:
        the linear model does not bound this simulator (see ``memory_model="safe"``)."""
        if self.liveness is None:
            return []
        values = self.liveness.column_values(trial.partition.saved, trial.partition.recomputed)
        scale = 1.0 / self.target_bytes if self.target_bytes > 0 else 1.0
        return [
            label for row, base, label in self.memory_rows
            if base + sum(c * values.get(col, 0.0) for col, c in self.rows[row][0].items()) / scale
            > trial.simulation.peak_bytes + 0.5
        ]

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

    def add_continuous(self) -> int:
        """A new [0, 1] continuous column; returns its index."""
        self.integer = np.append(self.integer, 0)
        self.upper = np.append(self.upper, 1.0)
        self.n_cols += 1
        return self.n_cols - 1

    def saved_set(self, x: np.ndarray) -> frozenset[str]:
        return frozenset(name for name, col in self.s_col.items() if x[col] > 0.5)

    def no_good(self, saved: frozenset[str]) -> tuple[dict[int, float], float, float]:
        """Row excluding exactly the saved set ``saved``: at least one s flips."""
        free = {name: col for name, col in self.s_col.items() if self.upper[col] > 0}
        coefs = {col: (-1.0 if name in saved else 1.0) for name, col in free.items()}
        return coefs, 1.0 - sum(1 for name in free if name in saved), math.inf


def _build_model(facts: JointGraphFacts, target_bytes: int, memory_model: str = "structural") -> _Model:
    relevant = relevant_forward(facts)
    in_relevant = set(relevant)
    s_col: dict[str, int] = {}
    r_col: dict[str, int] = {}
    for name in relevant:
        node = facts.nodes[name]
        cannot_recompute = schedule.why_not_recomputable(facts, name) is not None
        if not node.is_multi_output or cannot_recompute:
            s_col[name] = len(s_col) + len(r_col)
        if not cannot_recompute:
            r_col[name] = len(s_col) + len(r_col)
    n_binary = len(s_col) + len(r_col)
    model = _Model(s_col, r_col, n_binary, np.ones(n_binary), np.ones(n_binary), {})
    for name in _free_aliases(facts, relevant):
        if name in r_col:   # saving or recomputing it is the same plan: keep one, so cuts don't see two
            model.upper[s_col[name]] = 0.0
    for name in schedule.register_only(facts):   # never saved: partition_nodes recomputes them
        if name in s_col and name in r_col:
            model.upper[s_col[name]] = 0.0
    for name, col in r_col.items():
        cost = facts.nodes[name].cost.est_time_s * _TIME_SCALE
        if cost:
            model.objective[col] = cost
    _closure_rows(facts, model, relevant, in_relevant)
    model.target_bytes = target_bytes
    liveness = _Liveness(facts, model, relevant, in_relevant)
    if memory_model == "structural":
        model.liveness = liveness
        for base_bytes, terms, label in liveness.sample_points():
            model.add_memory_row(base_bytes, terms, label)
    elif memory_model == "safe":
        model.add_memory_row(*liveness.tangents_row())
    else:
        raise ValueError(f"memory_model={memory_model!r}: use 'structural' or 'safe'")
    return model


def _free_aliases(facts: JointGraphFacts, relevant: list[str]) -> set[str]:
    """Values that alias parameters only and cost nothing to rebuild, down to the parameters."""
    free: set[str] = set()
    for name in relevant:
        node = facts.nodes[name]
        if (schedule.why_not_recomputable(facts, name) is None and not node.is_multi_output
                and node.cost.est_time_s == 0
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


Monomial = frozenset  # of binary columns; true when all of them are 1


@dataclass(frozen=True)
class _Witness:
    """A reason a storage is live at a sample point: every ``pos`` column is 1 and every ``neg`` is 0."""

    pos: frozenset
    neg: frozenset = frozenset()


class _Liveness:
    """Certainly-live bytes at sample points, as a constant plus terms over the model's columns.

    Sample points are the library calls (``kernel_kind`` extern or scatter) every plan runs:
    each is a kernel of its own that allocates its output before the call and frees its
    inputs after it, and the kernel order respects data dependences, so at such a call
    ``e`` a buffer is live when it was made by ``e`` or by an op ``e`` depends on, and is
    read by ``e`` or by an op that depends on ``e``. What gets a buffer at all follows
    Inductor's lowering: library calls, reductions and scatters always; a loop value when
    a library call reads it; a graph output.
    """

    def __init__(self, facts: JointGraphFacts, model: _Model, relevant: list[str], in_relevant: set[str]) -> None:
        self.facts, self.model, self.relevant, self.in_relevant = facts, model, relevant, in_relevant
        self.backward = [n for n in facts.order if facts.nodes[n].role == "backward"]
        self.position = facts.position()
        self.bytes_of: dict[str, int] = {}
        for name in facts.order:
            for sid, nbytes in facts.nodes[name].allocs:
                self.bytes_of[sid] = nbytes
                self.bytes_of[sid + RECOMPUTE_SUFFIX] = nbytes
        self.kind = {n: kernel_kind(facts, n) for n in facts.order}
        self.pinned = self._pinned_forward()     # live to the forward's end
        # live through the backward too, when the caller holds them (``JointGraphFacts.outputs_held``)
        self.held_outputs = self.pinned if facts.outputs_held else frozenset()
        self.tangents_base = sum(self.bytes_of.get(s, 0) for s in self.held_outputs) + sum(
            facts.nodes[n].alloc_bytes for n in facts.order if facts.nodes[n].role == "tangent")
        self.helper_col: dict[frozenset, int] = {}
        self._setup = None

    def _pinned_forward(self) -> frozenset[str]:
        out = set()
        for name in self.facts.fwd_outputs:
            out.update(sid for sid in self.facts.nodes[name].value_storages if self._owner_role(sid) == "forward")
        return frozenset(out)

    def _owner_role(self, sid: str) -> Optional[str]:
        owner = self.facts.nodes.get(sid.removesuffix(RECOMPUTE_SUFFIX).split("#")[0])
        return owner.role if owner is not None else None

    def is_call(self, name: str) -> bool:
        return self.kind[name] in (EXTERN, SCATTER)

    def _always_buffered(self, name: str) -> bool:
        return self.kind[name] not in (POINTWISE, ALIAS)

    # -- the dependence order ----------------------------------------------------------------------
    def _closure(self, members: list[str], edges) -> dict[str, frozenset[str]]:
        """For each member, the members reachable through ``edges`` (itself excluded)."""
        member_set = set(members)
        out: dict[str, frozenset[str]] = {}
        for name in members:
            nxt = [e for e in edges(name) if e in member_set]
            acc: set[str] = set(nxt)
            for e in nxt:
                acc |= out[e]
            out[name] = frozenset(acc)
        return out

    def _orders(self, members: list[str]) -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
        """Strict ancestors and strict descendants of each member, within ``members``."""
        ancestors = self._closure(members, lambda n: self.facts.nodes[n].inputs)
        descendants = self._closure(list(reversed(members)), lambda n: self.facts.users[n])
        return ancestors, descendants

    # -- which storages a forward value holds when the backward reads it ---------------------------
    def _forward_storages(self, name: str) -> list[str]:
        return [sid for sid in self.facts.nodes[name].value_storages
                if self._owner_role(sid) == "forward" and sid not in self.held_outputs]

    def _buffered_when_recomputed(self, name: str) -> list[Monomial]:
        """Monomials under which the recomputation of ``name`` certainly has a buffer: always for
        a library call or reduction; for a loop value, when a library call reads it (through views)."""
        r = Monomial({self.model.r_col[name]})
        if self._always_buffered(name):
            return [r]
        conditions: list[Monomial] = []
        stack = [(u, r) for u in self.facts.users[name]]
        seen = set()
        while stack:
            user, mono = stack.pop()
            if (user, mono) in seen:
                continue
            seen.add((user, mono))
            node = self.facts.nodes[user]
            if node.role == "backward":
                if self.is_call(user):
                    conditions.append(mono)
                elif node.is_view and self.kind[user] == ALIAS:
                    stack += [(w, mono) for w in self.facts.users[user]]
                continue
            if user not in self.in_relevant or user not in self.model.r_col:
                continue
            here = mono | {self.model.r_col[user]}
            if self.is_call(user):
                conditions.append(here)
            elif self.kind[user] == ALIAS:
                stack += [(w, here) for w in self.facts.users[user]]
        return [w.pos for w in _minimal([_Witness(c) for c in conditions])]

    def held(self, name: str, depth: int = 0) -> list[tuple[Monomial, str]]:
        """(monomial, storage): a storage ``name``'s value is made of when the monomial holds."""
        node = self.facts.nodes[name]
        if node.role != "forward" or name not in self.in_relevant:
            return []
        terms: list[tuple[Monomial, str]] = []
        if name in self.model.s_col:
            terms += [(Monomial({self.model.s_col[name]}), sid) for sid in self._forward_storages(name)]
        if name not in self.model.r_col:
            return terms
        r = self.model.r_col[name]
        if self.kind[name] == ALIAS and node.inputs and depth < MAX_VIEW_CHAIN:
            wanted = set(node.value_storages)
            for mono, sid in self.held(node.inputs[0], depth + 1):
                if sid.removesuffix(RECOMPUTE_SUFFIX) in wanted:
                    terms.append((mono | {r}, sid))
        elif not node.is_view and not node.is_getitem:
            terms += [
                (mono, sid + RECOMPUTE_SUFFIX)
                for mono in self._buffered_when_recomputed(name) for sid, _ in node.allocs if sid not in self.held_outputs
            ]
        return terms

    # -- the rows ----------------------------------------------------------------------------------
    def tangents_row(self) -> tuple[int, list[tuple[int, int]], str]:
        """Between the graphs every saved storage, the forward outputs and the tangents are live."""
        return self.tangents_base, self.row_terms(self._savers(lambda owner: True)), "<tangents>"

    def _savers(self, keep) -> dict[str, set[_Witness]]:
        """Forward storages of saved values whose owner passes ``keep``: live from their
        owner's kernel until the backward."""
        savers: dict[str, set[_Witness]] = {}
        for name in self.relevant:
            if name in self.model.s_col:
                for sid in self._forward_storages(name):
                    if keep(sid.split("#")[0]):
                        savers.setdefault(sid, set()).add(_Witness(Monomial({self.model.s_col[name]})))
        return savers

    def _backward_setup(self):
        """Orders, reads and plan-independent buffers of the backward graph (cached)."""
        if self._setup is not None:
            return self._setup
        facts = self.facts
        ancestors, descendants = self._orders(self.backward)
        reads = {b: [t for i in facts.nodes[b].inputs for t in self.held(i)] for b in self.backward}
        buffered: dict[str, str] = {}           # storage -> the backward op that makes it, in every plan
        for b in self.backward:
            if self._always_buffered(b) or any(self.is_call(u) for u in facts.users[b]):
                for sid, _ in facts.nodes[b].allocs:
                    buffered[sid] = b
        readers: dict[str, list[str]] = {}
        for b in self.backward:
            for i in facts.nodes[b].inputs:
                for sid in facts.nodes[i].value_storages:
                    readers.setdefault(sid, []).append(b)
        calls = [b for b in self.backward if self.is_call(b)]
        upto: dict[str, frozenset[str]] = {}      # a call and its ancestors, for every call up to it
        acc: frozenset[str] = frozenset()
        for c in calls:
            acc = acc | ancestors[c] | {c}
            upto[c] = acc
        onwards: dict[str, frozenset[str]] = {}   # a call and its descendants, for every call from it
        acc = frozenset()
        for c in reversed(calls):
            acc = acc | descendants[c] | {c}
            onwards[c] = acc
        self._setup = (ancestors, descendants, reads, buffered, readers, calls, upto, onwards)
        return self._setup

    def _constant(self, before: AbstractSet[str], after: AbstractSet[str]) -> int:
        """Plan-independent bytes live between ``before`` and ``after``: forward outputs,
        backward buffers made before and read after (or gradients), tangents read after."""
        _, _, _, buffered, readers, _, _, _ = self._backward_setup()
        grads = {sid for o in self.facts.bwd_outputs for sid in self.facts.nodes[o].value_storages}
        total = sum(self.bytes_of.get(s, 0) for s in self.held_outputs)
        for sid, maker in buffered.items():
            if maker in before and (sid in grads or any(r in after for r in readers.get(sid, ()))):
                total += self.bytes_of[sid]
        for name in self.facts.order:
            if self.facts.nodes[name].role == "tangent":
                for sid, nbytes in self.facts.nodes[name].allocs:
                    if any(r in after for r in readers.get(sid, ())):
                        total += nbytes
        return total

    def _live_between(self, before: AbstractSet[str], after: AbstractSet[str], given: Monomial = Monomial()
                      ) -> dict[str, set[_Witness]]:
        """Forward and recomputed storages live between ``before`` and ``after``: read by an op
        in ``after``, and (recomputed ones) certainly made by an op in ``before``."""
        _, _, reads, _, _, _, _, _ = self._backward_setup()
        made_before: dict[str, list[Monomial]] = {}
        for b in before:
            for mono, sid in reads[b]:
                # a loop value buffered only because a call reads it gets its buffer at that
                # call; before it, readers compute it inline
                owner = sid.removesuffix(RECOMPUTE_SUFFIX).split("#")[0]
                if self.is_call(b) or self._always_buffered(owner):
                    made_before.setdefault(sid, []).append(mono)
        witnesses: dict[str, set[_Witness]] = {}
        for b in after:
            for mono, sid in reads[b]:
                if not sid.endswith(RECOMPUTE_SUFFIX):
                    witnesses.setdefault(sid, set()).add(_Witness(mono | given))
                    continue
                for alloc in made_before.get(sid, ()):
                    witnesses.setdefault(sid, set()).add(_Witness(mono | alloc | given))
        return witnesses

    def _backward_rows(self) -> list[tuple[int, dict[str, set[_Witness]], str]]:
        ancestors, descendants, _, _, _, _, upto, onwards = self._backward_setup()
        rows = []
        for e in self.backward:
            # At a call: what was made by it, earlier calls, or their ancestors, and is read by
            # it, later calls or their descendants (calls run in graph order, see the module
            # docstring). At any other op, which may share a kernel with its neighbours (and
            # overwrite a dying input in place): what calls among its ancestors made, read by
            # its descendants.
            call = self.is_call(e)
            after = onwards[e] if call else descendants[e]
            before = upto[e] if call else {a for a in ancestors[e] if self.is_call(a)}
            rows.append((self._constant(before, after), self._live_between(before, after), e))
        return rows

    def _recomputed_call_rows(self) -> list[tuple[dict[str, set[_Witness]], dict[int, int], str]]:
        """Rows at the recomputation of a library call ``x``, all conditional on ``r_x``.

        Its region lands before the first backward op that needs it, somewhere between the
        earliest and the latest position that can be: calls before the earliest run before it,
        calls from the latest on run after it. Its own buffer and its inputs are live too.
        """
        _, _, _, _, _, calls, upto, onwards = self._backward_setup()
        index = {b: k for k, b in enumerate(self.backward)}
        earliest, latest = self._placement_window(index)
        rows = []
        for x in self.relevant:
            if x not in self.model.r_col or not self.is_call(x):
                continue
            r = self.model.r_col[x]
            given = Monomial({r})
            earlier = [c for c in calls if index[c] < earliest[x]]
            later = [c for c in calls if index[c] >= latest[x]]
            before = upto[earlier[-1]] if earlier else frozenset()
            after = onwards[later[0]] if later else frozenset()
            witnesses = self._live_between(before, after, given)
            node = self.facts.nodes[x]
            own = [(Monomial(), sid + RECOMPUTE_SUFFIX) for sid, _ in node.allocs if sid not in self.held_outputs]
            for mono, sid in own + [t for i in node.inputs for t in self.held(i)]:
                witnesses.setdefault(sid, set()).add(_Witness(mono | given))
            rows.append((witnesses, {r: self._constant(before, after)}, f"{x}{RECOMPUTE_SUFFIX}"))
        return rows

    def _placement_window(self, index: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
        """Per value: the earliest and the latest backward position its region can precede."""
        end = len(self.backward)
        earliest: dict[str, int] = {}
        latest: dict[str, int] = {}
        for name in reversed(self.relevant):
            users = [u for u in self.facts.users[name] if u in self.in_relevant]
            direct = sorted(index[u] for u in self.facts.users[name] if u in index)
            earliest[name] = min([direct[0] if direct else end] + [earliest[u] for u in users])
            recomputing = [latest[u] for u in users if u in self.model.r_col]
            latest[name] = direct[0] if direct else max(recomputing, default=end)
        return earliest, latest

    def _forward_rows(self) -> list[tuple[int, dict[str, set[_Witness]], str]]:
        facts = self.facts
        required = [n for n in facts.order if n in facts.forward_required]
        forward = [n for n in facts.order if facts.nodes[n].role == "forward"]
        ancestors, _ = self._orders(forward)
        _, req_descendants = self._orders(required)
        outputs = set(facts.fwd_outputs)
        buffered: dict[str, str] = {}
        for name in required:
            node = facts.nodes[name]
            if (self._always_buffered(name) or name in outputs
                    or any(self.is_call(u) for u in facts.users[name] if u in facts.forward_required)):
                for sid, _ in node.allocs:
                    buffered[sid] = name
        readers: dict[str, list[str]] = {}
        for name in required:
            for i in facts.nodes[name].inputs:
                for sid in facts.nodes[i].value_storages:
                    readers.setdefault(sid, []).append(name)
        rows = []
        for e in required:
            if not self.is_call(e):
                continue
            before = ancestors[e] | {e}
            after = req_descendants[e] | {e}
            live = {sid for sid, maker in buffered.items() if maker in before and (
                sid in self.pinned or maker == e or any(r in after for r in readers.get(sid, ())))}
            base = sum(self.bytes_of[s] for s in live)
            savers = self._savers(lambda owner: owner in before)
            rows.append((base, {sid: w for sid, w in savers.items() if sid not in live}, e))
        return rows

    def sample_points(self) -> list[tuple[int, list[tuple[int, int]], str]]:
        """Distinct (constant bytes, [(column, bytes)], step name) rows: constant + sum <= target."""
        rows: dict[tuple, tuple[int, str]] = {}
        base, terms, label = self.tangents_row()
        rows[tuple(terms)] = (base, label)
        for base, witnesses, label in self._backward_rows() + self._forward_rows():
            key = tuple(self.row_terms(witnesses))
            if key not in rows or rows[key][0] < base:
                rows[key] = (base, label)
        out = [(base, list(key), label) for key, (base, label) in rows.items()]
        for witnesses, constant, label in self._recomputed_call_rows():
            terms = dict(self.row_terms(witnesses))
            for col, nbytes in constant.items():
                terms[col] = terms.get(col, 0) + nbytes
            out.append((0, sorted(terms.items()), label))
        return out

    def row_terms(self, witnesses_by_sid: dict[str, set[_Witness]]) -> list[tuple[int, int]]:
        terms: dict[int, int] = {}
        for sid, witnesses in witnesses_by_sid.items():
            col = self._indicator(witnesses)
            if col is not None:
                terms[col] = terms.get(col, 0) + self.bytes_of[sid]
        return sorted(terms.items())

    def column_values(self, saved: frozenset[str], recomputed: frozenset[str]) -> dict[int, float]:
        """The value every column takes for one plan."""
        values: dict[int, float] = {}
        for name, col in self.model.s_col.items():
            values[col] = float(name in saved)
        for name, col in self.model.r_col.items():
            values[col] = float(name in recomputed)
        for witnesses, col in self.helper_col.items():
            values[col] = float(any(
                all(values[x] > 0.5 for x in w.pos) and not any(values[x] > 0.5 for x in w.neg) for w in witnesses
            ))
        return values

    def _indicator(self, witnesses: set[_Witness]) -> Optional[int]:
        """A column that is 1 whenever any witness holds: a binary itself, or a helper L >= each."""
        kept = _minimal([w for w in witnesses if not (w.pos & w.neg)])
        if not kept:
            return None
        if len(kept) == 1 and len(kept[0].pos) == 1 and not kept[0].neg:
            return next(iter(kept[0].pos))
        key = frozenset(kept)
        if key not in self.helper_col:
            col = self.model.add_continuous()
            self.helper_col[key] = col
            for w in kept:
                row = {col: 1.0}
                for x in w.pos:
                    row[x] = row.get(x, 0.0) - 1.0
                for x in w.neg:
                    row[x] = row.get(x, 0.0) + 1.0
                self.model.rows.append((row, 1.0 - len(w.pos), math.inf))
        return self.helper_col[key]


def _minimal(witnesses: list[_Witness]) -> list[_Witness]:
    """Drop witnesses implied by a weaker one (fewer conditions)."""
    kept: list[_Witness] = []
    for w in sorted(set(witnesses), key=lambda w: (len(w.pos) + len(w.neg), sorted(w.pos), sorted(w.neg))):
        if not any(k.pos <= w.pos and k.neg <= w.neg for k in kept):
            kept.append(w)
    return kept
