"""Split one per-rank budget across the graphs of a distributed training step.

Under DDP, Dynamo's DDP optimizer splits the step into pieces (at DDP's bucket boundaries)
and remat plans each piece separately; under FSDP2 (torch 2.13), each ``fully_shard`` unit's
forward compiles as its own graph, shared by every unit of the same class. The budget
(docs/design.md: the peak above what was resident at step start, per rank) holds for the whole
step, so each graph gets a *planning target*: the simulated peak its plan must meet.

The step, as the ledger models it (pieces in forward order, k = 0 .. n-1)::

    forward:  P0.fw  P1.fw ... Pk.fw ...      backward: ... Pk.bw ... P1.bw  P0.bw

While piece k runs (forward or backward), these are live besides what its own plan
simulates (its simulated peak ``p_k`` counts its saved values, temporaries and the
gradients it produces, above its inputs):

- ``held_j`` for every earlier piece j < k: what j's forward keeps for j's backward
  (its saved activations, and its activation inputs if it saves them), exactly known when
  k compiles, because pieces compile in forward order and the ledger records each plan;
- ``a_k``: piece k's own activation inputs (not parameters);
- ``G_>k``: gradients the later pieces' backwards already produced: the bytes of the
  parameters some piece after k reads (``_torch_distributed.later_param_bytes``; a parameter
  pieces i < j both read, a tied embedding and head, has j's part of its gradient held by the
  autograd engine from j's backward until i's adds to it);
- ``outside``: memory the step allocates outside remat's graphs that remat can count
  (FSDP2: the running unit's all-gathered parameters and all-gather output, and the root's
  parameters and gradients, ``distributed_fit.fsdp_outside_bytes`` says why each).

So the step fits when, for every piece, ``sum_{j<k} held_j + a_k + G_>k + outside + p_k <= T``
(T: the budget less remat's headroom). The later pieces' ``held`` never coexist with piece
k's peak (their backwards ran and freed them first), but piece k's ``held`` lowers the
room every later piece gets, so each piece is planned under

    target_k = room_k - sum_{j>k} share_j,   room_k = T - sum_{j<k} held_j - a_k - G_>k - outside

where ``share_j`` reserves room for later piece j, in proportion to its need (the bytes of
the tensors its forward computes, read from Dynamo's graph before it is planned):
``share_j = (T - G - outside) * need_j / sum(need)``. By induction every piece k gets at least
``share_k``, and a piece that uses less leaves the rest to the pieces after it (the ledger
records what it actually holds).

A graph that runs ``r`` times per step (an FSDP2 unit class of ``r`` identical blocks,
k = 0 .. r-1 in forward order) peaks in run k next to the k earlier runs' held bytes ``h``
and, since the backward runs the units in reverse, the ``r-1-k`` later runs' leftovers
``L(r-1-k)`` (FSDP2 keeps each one's sharded gradients, and its reduce-scatter input
buffer until the next reduce-scatter), and FSDP2 prefetches the unit before it, ``U_k``:
``max_k (k*h + a + p + L(r-1-k) + U_k) <= room`` (``GraphShare.runs_peak_bytes``). Its safe
target bounds ``h`` by ``a + p``.

Proportional shares misjudge what later pieces need once they recompute: far more than it
for most, too little for a piece whose floor is high (the one holding the head's logits),
and then earlier pieces plan fast, hold much, and leave it too little, at every budget. So
``distributed_fit.calibrate_reserve`` replaces the reserve with an estimate of the later
pieces' smallest demand, scaled from this piece's smallest-peak plan: its peak (plus
inputs) and what it holds, each over its need, times the later pieces' needs; the demand
of later piece m is its estimated peak next to what the pieces between hold. What is left
once that and this piece's own floor are met is split between this piece and the later ones
by need, so a misjudged later piece gets more room as the budget grows. An estimate, not a
bound: a later piece that shrinks less than this one can find too little room, and then
names the budget it needs (a budget some pieces past it may still find short).

That ``target_k`` is safe but tight: it charges the later pieces' reserve against piece k's
whole peak, when only what k holds coexists with them. So ``distributed_fit.fit_plan`` first plans under
the *loose* target (the room, as if nothing were held), and checks the plan's real held
bytes and peak against both conditions (``GraphShare.admits``); if they fail, it bisects
the target between the safe and the loose one (``FIT_ROUNDS`` plans at most) and keeps the
largest admitted. The share written to the dump carries the target the plan was made for.

What is exact and what is not: a piece's ``held`` is what its plan saves (saved
activations by their storages, and the activation inputs it saves), recorded on the ledger
after it is planned (``Plan.saved_bytes`` counts each saved view's storage once per view:
an over-count where a plan saves several views of one tensor, exact on the tight plans that
matter here). Later pieces' needs are a proxy (forward tensor bytes), so the reserve can be
more or less than they need. Memory the step allocates in eager code outside the graphs is
not in the ledger, except the loss of a DDP step: an eager loss on the outputs holds about
three outputs' bytes at the start of the backward next to everything the pieces hold
(``LOSS_OUTPUT_COPIES``; the last piece is admitted only if what all pieces hold leaves room
for it). The rest must fit in the headroom: a loss that holds more, and under FSDP2 on torch
2.13 the root's own forward, which runs eagerly (the embedding, the final norm, the head, the loss).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

# what an eager loss on the step's outputs holds next to everything the pieces hold (a DDP step's last piece)
from .passes.joint_graph import LOSS_OUTPUT_COPIES



def largest_admitted(admits: Callable[[int], bool], high_bytes: int) -> int:
    """The largest ``x`` in ``[0, max(high_bytes, 1)]`` with ``admits(x)``, for an ``admits`` true up to
    some value and false above it; -1 when ``admits(0)`` is false."""
    from .options import smallest_budget_bytes

    if not admits(0):
        return -1
    high = max(high_bytes, 1)
    if admits(high):
        return high
    return smallest_budget_bytes(lambda x: not admits(x), high) - 1


# shares whose graph Inductor's check judges against the largest peak the share admits next to what its plan holds,
# and whose refusal names its budget from the checked code of the plan it rests on (``ShareInfeasibleError``): a
# known step's graph at a break, stacked runs, a graph next to accumulated gradients; others against their target
# shares of a graph alone in its step whose runs stack, or that runs next to the step's accumulated gradients
# (``runs_share.runs_share``): every other term of the step is exact (its own held bytes, the measured gradients)
SINGLE_GRAPH_SHARE_KINDS = ("runs", "accumulated")
JUDGED_SHARE_KINDS = ("break",) + SINGLE_GRAPH_SHARE_KINDS
# shares of a step's graphs planned before the step is known (its first run, ``step_budget.py``): accepted, a plan is
# judged against its target; refused (its own run does not fit next to what is live before it,
# ``step_fit.runs_over_next_to_live``), its budget is named from the checked code of the plan it rests on, as above
PROVISIONAL_SHARE_KINDS = ("break-partial", "break-smallest")
REFUSAL_CHECKED_SHARE_KINDS = JUDGED_SHARE_KINDS + PROVISIONAL_SHARE_KINDS
# shares of a step split at graph breaks (``step_budget.py``): known, or its first run's
STEP_SHARE_KINDS = ("break",) + PROVISIONAL_SHARE_KINDS


@dataclass(frozen=True)
class GraphShare:
    """What one graph of a distributed step was given, and why (all sizes bytes)."""

    kind: str                      # "ddp" | "fsdp2" | "break" | "break-partial" | "break-smallest" (step_budget.py)
    index: int                     # its position in the step (DDP piece, forward order); 0 for FSDP2
    count: int                     # pieces in the step (DDP) or 1 (FSDP2)
    repeats: int                   # times the graph runs per step (FSDP2 units of one class)
    step_target_bytes: int         # T: the per-rank budget less remat's headroom
    held_before_bytes: int         # sum of held_j of earlier pieces (ledger)
    input_activation_bytes: int    # a_k
    later_grad_bytes: int          # G_>k
    outside_bytes: int             # FSDP2's unsharded parameters and sharded gradients
    reserved_later_bytes: int      # sum of share_j of later pieces
    own_share_bytes: int           # share_k
    target_bytes: int              # the simulated peak this graph's plan must meet
    needs: tuple[int, ...] = ()    # every piece's need (forward tensor bytes), as the split used them
    total_grad_bytes: int = 0      # G: gradient bytes of the whole step's parameters
    later_estimate_bytes: Optional[int] = None  # estimated smallest demand of the later pieces (see calibrate_reserve)
    own_floor_bytes: int = 0       # this piece's smallest peak plus its activation inputs (with the estimate)
    step_output_bytes: int = 0     # DDP: the step's outputs (the last piece's), which an eager loss consumes
    own_grad_bytes: int = 0        # DDP: gradients of this piece's own parameters (in its simulated peaks)
    later_ceiling_bytes: Optional[int] = None  # later pieces' estimated demand with no recomputation
    reserve_met: bool = True       # False: no plan fit next to the later pieces' reserve (fit_plan)

    @property
    def is_last(self) -> bool:
        return self.kind == "ddp" and self.index == self.count - 1

    def loss_bytes(self) -> int:
        """What an eager loss holds at the start of the backward, next to every piece's held
        bytes (the last piece only): ``LOSS_OUTPUT_COPIES`` times the step's outputs."""
        return LOSS_OUTPUT_COPIES * self.step_output_bytes if self.is_last else 0
    later_run_bytes: int = 0       # FSDP2: what each later run leaves after its backward (its sharded gradients)
    rs_buffer_bytes: int = 0       # FSDP2: one reduce-scatter input buffer (a unit's unsharded gradient bytes)
    rs_buffers: int = 0            # FSDP2: how many of those buffers FSDP keeps after their reduce-scatter
    prefetch_bytes: int = 0        # FSDP2: the unit before a run (forward order), all-gathered during its backward
    first_prefetch_bytes: int = 0  # FSDP2: the same for the first run (a unit of another class, if any)

    def later_runs_bytes(self, runs: int) -> int:
        """Bytes that ``runs`` runs of this graph, finished before the one now running (in
        backward order), still keep: their sharded gradients, and the reduce-scatter input
        buffers FSDP2 has not reclaimed yet (at most ``rs_buffers``)."""
        return runs * self.later_run_bytes + min(runs, self.rs_buffers) * self.rs_buffer_bytes

    def runs_peak_bytes(self, held_bytes: int, peak_bytes: int) -> int:
        """The step's live bytes from this graph's runs at the worst one: run ``k`` (forward
        order) peaks while the ``k`` runs before it hold ``held_bytes`` each and the
        ``repeats - 1 - k`` runs after it (their backwards ran first) keep
        ``later_runs_bytes``; the running one adds its activation input, its peak, and the
        unit FSDP2 prefetches during its backward (the one before it)."""
        return max(k * held_bytes + self.input_activation_bytes + peak_bytes + self.later_runs_bytes(self.repeats - 1 - k)
                   + (self.prefetch_bytes if k > 0 else self.first_prefetch_bytes) for k in range(self.repeats))

    def at(self, step_target_bytes: int) -> "GraphShare":
        """The same graph's share had the step target been ``step_target_bytes``."""
        return piece_target(
            step_target_bytes=step_target_bytes, index=self.index, needs=self.needs,
            held_before_bytes=self.held_before_bytes,
            input_activation_bytes=self.input_activation_bytes, total_grad_bytes=self.total_grad_bytes,
            grads_so_far_bytes=self.total_grad_bytes - self.later_grad_bytes, outside_bytes=self.outside_bytes,
            repeats=self.repeats, kind=self.kind, later_estimate_bytes=self.later_estimate_bytes,
            own_floor_bytes=self.own_floor_bytes, step_output_bytes=self.step_output_bytes, later_run_bytes=self.later_run_bytes, rs_buffer_bytes=self.rs_buffer_bytes, rs_buffers=self.rs_buffers,
            prefetch_bytes=self.prefetch_bytes, first_prefetch_bytes=self.first_prefetch_bytes,
            own_grad_bytes=self.own_grad_bytes, later_ceiling_bytes=self.later_ceiling_bytes,
        )

    @property
    def loose_target_bytes(self) -> int:
        """The largest peak this graph may have if it kept nothing for its backward: the room
        with no bytes held (``admits`` then checks what the plan really holds)."""
        return self.step_target_bytes - self.own_run_bytes(0, 0)

    def own_run_bytes(self, held_bytes: int, peak_bytes: int) -> int:
        """The step's live bytes at this graph's worst run, for a plan holding ``held_bytes`` and peaking at
        ``peak_bytes``: what is live before it (the earlier pieces' held bytes, the later pieces' gradients, the
        bytes outside the step's graphs) and its own runs (``runs_peak_bytes``)."""
        return (self.held_before_bytes + self.later_grad_bytes + self.outside_bytes
                + self.runs_peak_bytes(held_bytes, peak_bytes))

    def admits(self, held_bytes: int, peak_bytes: int) -> bool:
        """Whether a plan that holds ``held_bytes`` for its backward (its saved activations and
        the activation inputs it saves) and peaks at ``peak_bytes`` keeps the step under its
        target: its own runs (``runs_peak_bytes``) and, for later pieces, the room reserved
        for them next to what it holds."""
        fixed = self.held_before_bytes + self.later_grad_bytes + self.outside_bytes
        later = self.repeats * held_bytes + max(self.reserved_later_bytes, self.loss_bytes())
        return (self.own_run_bytes(held_bytes, peak_bytes) <= self.step_target_bytes
                and fixed + later <= self.step_target_bytes)

    def largest_held_bytes(self, peak_bytes: int) -> int:
        """The most a plan peaking at ``peak_bytes`` may hold for its backward and still be
        admitted (``admits`` only gets stricter as the held bytes grow: a bisection finds it);
        -1 when even holding nothing is not admitted."""
        return largest_admitted(lambda held: self.admits(held, peak_bytes), self.step_target_bytes)

    def smallest_step_target_bytes(self, peak_bytes: int, loose: bool = False) -> int:
        """The smallest step target whose share for this graph (its safe target, or with
        ``loose`` its loose one) is >= ``peak_bytes``: both grow with the step target, so a
        bisection finds it."""
        def target(step: int) -> int:
            share = self.at(step)
            return share.loose_target_bytes if loose else share.target_bytes

        low, high = 0, max(self.step_target_bytes, 1)
        while target(high) < peak_bytes:
            low, high = high, 2 * high
        while high - low > 1:
            middle = (low + high) // 2
            if target(middle) >= peak_bytes:
                high = middle
            else:
                low = middle
        return high

    @property
    def in_step(self) -> bool:
        """A share of one process's step (graph breaks, or one graph's stacked runs), not of a DDP/FSDP2 ledger."""
        return self.kind.startswith("break") or self.kind in SINGLE_GRAPH_SHARE_KINDS

    def explain(self) -> str:
        """One paragraph for report.md: how the budget was split and why the step fits (``share_explain.py``)."""
        from .share_explain import explain_share

        return explain_share(self)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def split_shares(available_bytes: int, needs: tuple[int, ...]) -> tuple[int, ...]:
    """``available_bytes`` split in proportion to ``needs`` (equal parts if every need is 0).

    Guarantees: the shares are >= 0 and sum to at most ``available_bytes``.
    """
    available = max(int(available_bytes), 0)
    total = sum(max(n, 0) for n in needs)
    if not needs:
        return ()
    if total == 0:
        return tuple(available // len(needs) for _ in needs)
    return tuple(available * max(n, 0) // total for n in needs)


def piece_target(
    *, step_target_bytes: int, index: int, needs: tuple[int, ...], held_before_bytes: int,
    input_activation_bytes: int, total_grad_bytes: int, grads_so_far_bytes: int, outside_bytes: int = 0,
    repeats: int = 1, kind: str = "ddp", later_estimate_bytes: Optional[int] = None, own_floor_bytes: int = 0,
    step_output_bytes: int = 0, later_run_bytes: int = 0,
    rs_buffer_bytes: int = 0, rs_buffers: int = 0, prefetch_bytes: int = 0, first_prefetch_bytes: int = 0,
    own_grad_bytes: int = 0, later_ceiling_bytes: Optional[int] = None,
) -> GraphShare:
    """The planning target of piece ``index`` of a step (see the module docstring).

    ``grads_so_far_bytes`` are the parameter-gradient bytes of pieces 0..index (this one
    included). Guarantees: if every earlier piece met its target, piece ``index`` gets at
    least its own share of the room, divided by ``repeats``; the target may be <= 0 when the
    fixed costs alone exceed the step target (the planner then reports the budget infeasible).
    """
    if not 0 <= index < len(needs):
        raise ValueError(f"piece index {index} is outside the {len(needs)} pieces of the step")
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: a graph runs at least once per step")
    later_grads = max(total_grad_bytes - grads_so_far_bytes, 0)
    shares = split_shares(step_target_bytes - total_grad_bytes - outside_bytes, needs)
    reserved = sum(shares[index + 1:])
    if later_estimate_bytes is not None:
        # Reserve what the later pieces are estimated to need at their floors, and of what is
        # left once this piece's floor is met too, their part by need: a later piece the
        # estimate misjudges gets more room as the budget grows (taking all of it here, a
        # larger budget only let this piece hold more, and the later one failed again).
        estimate = max(later_estimate_bytes, 0)
        room = step_target_bytes - held_before_bytes - input_activation_bytes - later_grads - outside_bytes
        surplus = max(room + input_activation_bytes - own_floor_bytes - estimate, 0)
        later_need, all_need = sum(needs[index + 1:]), sum(needs[index:])
        reserved = estimate + (surplus * later_need // all_need if all_need > 0 else 0)
        if later_ceiling_bytes is not None:
            # ... but never more than they are estimated to use with no recomputation at all: past
            # that, a larger budget went to the reserve instead of to this piece (at a budget equal
            # to plain Inductor's peak, a step measured 81% of it, recomputing for nothing).
            reserved = min(reserved, max(later_ceiling_bytes, estimate))
    avail = step_target_bytes - held_before_bytes - later_grads - outside_bytes - reserved
    # Run k (of r) peaks next to k earlier runs, each holding at most its input and its peak
    # (what a plan holds is live at its peak), and r-1-k later runs' leftovers (FSDP2's
    # sharded gradients and reduce-scatter buffers): (k+1) * (p + a) + later(r-1-k) <= avail.
    share = GraphShare(
        kind=kind, index=index, count=len(needs), repeats=repeats, step_target_bytes=step_target_bytes,
        held_before_bytes=held_before_bytes, input_activation_bytes=input_activation_bytes,
        later_grad_bytes=later_grads, outside_bytes=outside_bytes, reserved_later_bytes=reserved,
        own_share_bytes=0, target_bytes=0, later_run_bytes=later_run_bytes, rs_buffer_bytes=rs_buffer_bytes,
        rs_buffers=rs_buffers, prefetch_bytes=prefetch_bytes, first_prefetch_bytes=first_prefetch_bytes,
    )
    target = min((avail - share.later_runs_bytes(repeats - 1 - k) - (prefetch_bytes if k > 0 else first_prefetch_bytes))
                 // (k + 1) - input_activation_bytes for k in range(repeats))
    if kind == "ddp" and index == len(needs) - 1:  # the loss's copies of the outputs, next to all it holds (<= a + p)
        target = min(target, avail - LOSS_OUTPUT_COPIES * step_output_bytes - input_activation_bytes)
    return GraphShare(
        kind=kind, index=index, count=len(needs), repeats=repeats, step_target_bytes=step_target_bytes,
        held_before_bytes=held_before_bytes, input_activation_bytes=input_activation_bytes,
        later_grad_bytes=later_grads, outside_bytes=outside_bytes, reserved_later_bytes=reserved,
        own_share_bytes=(shares[index] + input_activation_bytes) // repeats - input_activation_bytes,
        target_bytes=int(target), needs=tuple(needs), total_grad_bytes=total_grad_bytes,
        later_estimate_bytes=later_estimate_bytes, own_floor_bytes=own_floor_bytes, step_output_bytes=step_output_bytes,
        own_grad_bytes=own_grad_bytes, later_ceiling_bytes=later_ceiling_bytes, later_run_bytes=later_run_bytes,
        rs_buffer_bytes=rs_buffer_bytes,
        rs_buffers=rs_buffers, prefetch_bytes=prefetch_bytes, first_prefetch_bytes=first_prefetch_bytes,
    )


@dataclass(frozen=True)
class LedgerEntry:
    """What one planned piece keeps live for its backward, recorded after its plan is made."""

    index: int
    held_bytes: int          # saved activations + saved activation inputs
    param_grad_bytes: int    # gradients of its parameters its backward produces


@dataclass
class StepLedger:
    """The pieces of one DDP step planned so far, keyed by the split they belong to.

    Lives on the backend object; a new split (a recompile, or another model) starts a new
    ledger. Thread-safe: Inductor may compile on several threads.
    """

    split_id: Optional[int] = None
    needs: tuple[int, ...] = ()
    entries: dict[int, LedgerEntry] = field(default_factory=dict)
    # per piece: how it plans at another step target next to other held bytes (distributed_fit._refit),
    # so that a later piece that is refused can name a budget at which the whole split admits it
    refits: dict[int, Callable[[int, int], Optional[int]]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _switch(self, split_id: int, needs: tuple[int, ...]) -> None:
        if self.split_id != split_id:
            self.split_id, self.needs, self.entries, self.refits = split_id, needs, {}, {}

    def set_refit(self, index: int, refit: Callable[[int, int], Optional[int]]) -> None:
        """Keep how piece ``index`` of the current split plans (``distributed_fit.fit_plan``)."""
        with self._lock:
            self.refits[index] = refit

    def refits_before(self, index: int) -> list[Callable[[int, int], Optional[int]]]:
        """How the pieces before ``index`` of the current split plan, in forward order."""
        with self._lock:
            return [self.refits[i] for i in sorted(self.refits) if i < index]

    def before(self, split_id: int, index: int, needs: tuple[int, ...]) -> tuple[int, int, tuple[int, ...]]:
        """(held bytes, parameter-gradient bytes) of the pieces before ``index`` of ``split_id``,
        and the pieces' needs as first seen (when no piece was compiled yet, so that every
        piece's share is computed from the same numbers)."""
        with self._lock:
            self._switch(split_id, needs)
            earlier = [e for i, e in self.entries.items() if i < index]
            return sum(e.held_bytes for e in earlier), sum(e.param_grad_bytes for e in earlier), self.needs

    def record(self, split_id: int, entry: LedgerEntry) -> None:
        with self._lock:
            self._switch(split_id, ())
            self.entries[entry.index] = entry


def write_share_to_dump(dump_path: str, share: GraphShare) -> None:
    """Add the budget split to a graph's dump: a section of report.md, a key of plan.json."""
    import json
    from pathlib import Path

    directory = Path(dump_path)
    report = directory / "report.md"
    if report.exists():
        title = "Step budget split" if share.in_step else "Distributed budget split"
        # report.md was rendered before the share was known: its planning-target line would call
        # the share's cut "headroom"; it names the split instead.
        lines = [_share_target_line(line, title) if line.startswith("- planning target:") else line
                 for line in report.read_text().split("\n")]
        report.write_text("\n".join(lines) + f"\n## {title}\n\n" + share.explain() + "\n")
    plan_json = directory / "plan.json"
    if plan_json.exists():
        payload = json.loads(plan_json.read_text())
        payload["step_share" if share.in_step else "distributed"] = share.to_json()
        plan_json.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def _share_target_line(line: str, title: str) -> str:
    """report.md's planning-target line for a graph planned under a share of the step."""
    head = line.split(" (", 1)[0]
    return f"{head} (this graph's share of the step's target: see \"{title}\" below)"
