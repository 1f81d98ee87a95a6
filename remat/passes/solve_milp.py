"""The exact reference solver: least recompute time under a simulated-peak target.

``solve_min_time(facts, target_bytes)`` chooses, for every forward value the
backward needs (directly or to recompute another), whether the forward saves it
or the backward recomputes it, minimising the estimated time of the recomputed
nodes subject to the *simulated* peak (``evaluate.evaluate``) being at most the
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
  runs and frees its inputs after, and kernels respect data dependences; so at a
  call ``e`` a buffer is live when ``e`` or an ancestor of it made it and ``e`` or
  a descendant of it reads it. With Inductor's ``reorder_for_peak_memory`` off,
  calls also run in graph order, and "an ancestor of ``e``" widens to "an earlier
  call, or an ancestor of one" (and "a descendant" to "a later call, or a
  descendant of one"); with it on (the default) the order is the one of several
  topological orders with the least estimated peak, and only the dependences
  are certain. Which values
  have a buffer: library calls', reductions' and scatters' always; a loop
  value's when a call reads it (and then only from that call on); saved values'.
  At any other backward op only what calls among its ancestors made and its
  descendants read counts (it may share a kernel, or write over a dying input).
  The recomputation of a library call ``x`` gets a row of its own, every term
  multiplied by ``r_x``: its region lands before the first backward op needing
  it, between the earliest and the latest position that can be (in graph order;
  reordered, only its backward readers and their descendants certainly run after
  it). Forward rows:
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
from typing import AbstractSet, Optional

import numpy as np

from ..simulator import schedule
from ..simulator import evaluate
from .joint_graph import JointGraphFacts
from .mincut import min_cut_saved, saved_cost_bytes
from .recompute_bans import why_not_recomputable
from .solve_milp_liveness import Liveness

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
    meeting the target was found; pass it to ``evaluate.evaluate`` to get the partition.
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
    liveness: Optional[Liveness] = None

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
        from scipy.optimize import Bounds, LinearConstraint, milp   # only when a MILP is solved
        from scipy.sparse import csr_matrix

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
        cannot_recompute = why_not_recomputable(facts, name) is not None
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
    liveness = Liveness(facts, model, relevant, in_relevant)
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
        if (why_not_recomputable(facts, name) is None and not node.is_multi_output
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
