"""The MILP's memory rows (``solve_milp.py``): bytes certainly live at sample points.

``Liveness(facts, model, ...)`` reads one joint graph and writes, for each sample point (the
tangents step between the graphs, every library call every plan runs, and the recomputation of
each library call), the bytes certainly live there whatever the plan, as a constant plus terms
over the model's binary columns: why each storage is live is a product of binaries (a view
holds its source's storage), linearised with helper columns. The reasoning is in
``solve_milp.py``'s docstring ("Memory, a lower bound"); ``column_values`` evaluates the terms
for a simulated plan, so the solver can check that no row claims more than the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional, Protocol

from ..simulator.kernel_lowering import ALIAS, EXTERN, POINTWISE, SCATTER
from .joint_graph import JointGraphFacts
from ..simulator.kernel_facts import RECOMPUTE_SUFFIX, graph_inductor_config, kernel_kind

MAX_VIEW_CHAIN = 8       # views of views followed back to the storage they alias


class MilpColumns(Protocol):
    """What the rows need of the MILP model (``solve_milp._Model``): its binary columns, its
    constant rows (the linearisation rows go there), and a way to add a helper column."""

    s_col: dict[str, int]
    r_col: dict[str, int]
    rows: list[tuple[dict[int, float], float, float]]

    def add_continuous(self) -> int: ...


Monomial = frozenset  # of binary columns; true when all of them are 1


@dataclass(frozen=True)
class Witness:
    """A reason a storage is live at a sample point: every ``pos`` column is 1 and every ``neg`` is 0."""

    pos: frozenset
    neg: frozenset = frozenset()


class Liveness:
    """Certainly-live bytes at sample points, as a constant plus terms over the model's columns.

    Sample points are the library calls (``kernel_kind`` extern or scatter) every plan runs:
    each is a kernel of its own that allocates its output before the call and frees its
    inputs after it, and the kernel order respects data dependences, so at such a call
    ``e`` a buffer is live when it was made by ``e`` or by an op ``e`` depends on, and is
    read by ``e`` or by an op that depends on ``e``. What gets a buffer at all follows
    Inductor's lowering: library calls, reductions and scatters always; a loop value when
    a library call reads it; a graph output.
    """

    def __init__(self, facts: JointGraphFacts, model: MilpColumns, relevant: list[str], in_relevant: set[str]) -> None:
        self.facts, self.model, self.relevant, self.in_relevant = facts, model, relevant, in_relevant
        self.backward = [n for n in facts.order if facts.nodes[n].role == "backward"]
        self.position = facts.position()
        self.bytes_of: dict[str, int] = {}
        for name in facts.order:
            for sid, nbytes in facts.nodes[name].allocs:
                self.bytes_of[sid] = nbytes
                self.bytes_of[sid + RECOMPUTE_SUFFIX] = nbytes
        unroll_below = graph_inductor_config(facts).unroll_reductions_threshold
        self.kind = {n: kernel_kind(facts, n, unroll_below=unroll_below) for n in facts.order}
        # Inductor's reorder_for_peak_memory (``simulator/peak_reorder.py``) may run the backward's
        # calls in any order their dependences allow: then only ancestors certainly ran before
        # a call, and only descendants certainly run after it
        self.calls_in_graph_order = not graph_inductor_config(facts).reorder_for_peak_memory
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
        return [w.pos for w in _minimal([Witness(c) for c in conditions])]

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

    def _savers(self, keep) -> dict[str, set[Witness]]:
        """Forward storages of saved values whose owner passes ``keep``: live from their
        owner's kernel until the backward."""
        savers: dict[str, set[Witness]] = {}
        for name in self.relevant:
            if name in self.model.s_col:
                for sid in self._forward_storages(name):
                    if keep(sid.split("#")[0]):
                        savers.setdefault(sid, set()).add(Witness(Monomial({self.model.s_col[name]})))
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
        # what certainly ran by a call (it and its ancestors, and every earlier call with its
        # ancestors when calls run in graph order), and what certainly runs from it on
        upto: dict[str, frozenset[str]] = {}
        acc: frozenset[str] = frozenset()
        for c in calls:
            acc = (acc if self.calls_in_graph_order else frozenset()) | ancestors[c] | {c}
            upto[c] = acc
        onwards: dict[str, frozenset[str]] = {}
        acc = frozenset()
        for c in reversed(calls):
            acc = (acc if self.calls_in_graph_order else frozenset()) | descendants[c] | {c}
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
                      ) -> dict[str, set[Witness]]:
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
        witnesses: dict[str, set[Witness]] = {}
        for b in after:
            for mono, sid in reads[b]:
                if not sid.endswith(RECOMPUTE_SUFFIX):
                    witnesses.setdefault(sid, set()).add(Witness(mono | given))
                    continue
                for alloc in made_before.get(sid, ()):
                    witnesses.setdefault(sid, set()).add(Witness(mono | alloc | given))
        return witnesses

    def _backward_rows(self) -> list[tuple[int, dict[str, set[Witness]], str]]:
        ancestors, descendants, _, _, _, _, upto, onwards = self._backward_setup()
        rows = []
        for e in self.backward:
            # At a call: what was made by it, earlier calls, or their ancestors, and is read by
            # it, later calls or their descendants (when calls run in graph order, see the module
            # docstring; else made by its ancestors and read by its descendants). At any other
            # op, which may share a kernel with its neighbours (and overwrite a dying input in
            # place): what calls among its ancestors made, read by its descendants.
            call = self.is_call(e)
            after = onwards[e] if call else descendants[e]
            before = upto[e] if call else {a for a in ancestors[e] if self.is_call(a)}
            rows.append((self._constant(before, after), self._live_between(before, after), e))
        return rows

    def _recomputed_call_rows(self) -> list[tuple[dict[str, set[Witness]], dict[int, int], str]]:
        """Rows at the recomputation of a library call ``x``, all conditional on ``r_x``.

        Its region lands before the first backward op that needs it, somewhere between the
        earliest and the latest position that can be: when calls run in graph order, calls
        before the earliest run before it and calls from the latest on run after it; else only
        its backward readers and their descendants certainly run after it. Its own buffer and
        its inputs are live too.
        """
        _, descendants, _, _, _, calls, upto, onwards = self._backward_setup()
        index = {b: k for k, b in enumerate(self.backward)}
        earliest, latest = self._placement_window(index)
        rows = []
        for x in self.relevant:
            if x not in self.model.r_col or not self.is_call(x):
                continue
            r = self.model.r_col[x]
            given = Monomial({r})
            if self.calls_in_graph_order:
                earlier = [c for c in calls if index[c] < earliest[x]]
                later = [c for c in calls if index[c] >= latest[x]]
                before = upto[earlier[-1]] if earlier else frozenset()
                after = onwards[later[0]] if later else frozenset()
            else:
                before = frozenset()
                after = frozenset().union(*(descendants[u] | {u} for u in self.facts.users[x] if u in index))
            witnesses = self._live_between(before, after, given)
            node = self.facts.nodes[x]
            own = [(Monomial(), sid + RECOMPUTE_SUFFIX) for sid, _ in node.allocs if sid not in self.held_outputs]
            for mono, sid in own + [t for i in node.inputs for t in self.held(i)]:
                witnesses.setdefault(sid, set()).add(Witness(mono | given))
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

    def _forward_rows(self) -> list[tuple[int, dict[str, set[Witness]], str]]:
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

    def row_terms(self, witnesses_by_sid: dict[str, set[Witness]]) -> list[tuple[int, int]]:
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

    def _indicator(self, witnesses: set[Witness]) -> Optional[int]:
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


def _minimal(witnesses: list[Witness]) -> list[Witness]:
    """Drop witnesses implied by a weaker one (fewer conditions)."""
    kept: list[Witness] = []
    for w in sorted(set(witnesses), key=lambda w: (len(w.pos) + len(w.neg), sorted(w.pos), sorted(w.neg))):
        if not any(k.pos <= w.pos and k.neg <= w.neg for k in kept):
            kept.append(w)
    return kept


__all__ = ["MAX_VIEW_CHAIN", "Liveness", "MilpColumns", "Monomial", "Witness"]
