"""A settled step of graph-break graphs, remembered across processes: a warm first step plans it at once.

A step split at graph breaks is planned in two rounds in a process that knows nothing of it
(``step_budget.py``): in step 1 each graph takes a provisional plan (its leanest, or a share next to
the graphs pending), since the later graphs are unknown; once step 1 completes, the provisional graphs
are re-planned under their shares of the known sequence, before step 2 runs. The step is *settled*
when it completes with every graph running a plan made under a share of the known sequence (kind
"break") and nothing to re-plan. ``remember_step`` stores that state: the graphs' keys
(``feedback_store.graph_key``) in forward order and the share each one's running plan was asked to
fit (``StepGraph.asked_share``).

A later process whose step starts with the same graphs plans each of them at its remembered share
as it is compiled (``recall_share``), so its plans are the settled ones (each answer read from the
plan cache), none is provisional, and nothing is re-planned when step 1 completes. A share is
recalled only when what it rests on is this process's too: the keys of the graphs pending before
this one and this graph's key are the remembered sequence's first keys, and the step target, what
those graphs hold for their backward, this graph's activation inputs and its gradients are the
numbers the share was computed from. What it rests on beyond that (the later graphs: what they hold,
their gradients, their floors) is the remembered step's; a later graph that turns out different (not
the remembered key, or other plans) is planned as in a cold process, and the end of step 1 checks
the step's condition on the running plans and re-plans what breaks it, as it does after a cold step 1
(which may run over, as a cold step 1 may).

The step is also kept under the *call identity* of its first graph (``compile_cache.graph_identity``:
Dynamo's graph and its inputs, known before AOTAutograd traces anything), with each graph's identity:
``expected_share`` tells the backend, as Dynamo hands it a graph, which share the partitioner will
recall for it, so that AOTAutograd's cache can be keyed by that share (``compile_cache.StepKey``).

Stored with the plan cache (``plan_cache``: ``steps/<key>.pkl``; key: the first graph's key, the step
target and remat's source; the identity's entry: the first graph's identity, the backend's options and
remat's source); off with it (``REMAT_COMPILE_CACHE=0``), cleared with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Protocol, Sequence

from . import plan_cache

if TYPE_CHECKING:
    from .distributed import GraphShare

ENTRY_KIND = "steps"


class StepGraph(Protocol):
    """What this module reads of a plan's numbers on the step's account (``step_graph.StepGraph``)."""

    graph_key: str
    held_bytes: int
    asked_share: Optional["GraphShare"]


@dataclass(frozen=True)
class RememberedStep:
    """A settled step: its graphs' keys in forward order, the share each running plan was asked to fit and
    each graph's call identity (``compile_cache.graph_identity``; "" where unknown)."""

    graph_keys: tuple[str, ...]
    asked_shares: tuple["GraphShare", ...]
    identities: tuple[str, ...] = ()


def step_key(first_graph_key: str, step_target_bytes: int) -> str:
    """The store key of a step beginning with the graph ``first_graph_key`` at the step target ``step_target_bytes``."""
    return plan_cache.digest_of("step", first_graph_key, step_target_bytes, plan_cache.planner_source_hash())


def identity_key(first_identity: str, context: str) -> str:
    """The store key of a step whose first graph has the call identity ``first_identity``, for a backend
    whose options are ``context`` (``RematOptions.cache_key``)."""
    return plan_cache.digest_of("step-call", first_identity, context, plan_cache.planner_source_hash())


def settled(graphs: Sequence[Optional["StepGraph"]], identities: Sequence[str] = ()) -> Optional[RememberedStep]:
    """The step ``graphs`` (the running plans of a completed step, forward order; ``identities``: their
    call identities) as a ``RememberedStep``, or None when it is not one to remember: fewer than two
    graphs, a graph without a key, or a plan not made under a share of the known sequence (provisional,
    or planned alone)."""
    if len(graphs) < 2 or any(g is None or not g.graph_key or g.asked_share is None or g.asked_share.kind != "break"
                              for g in graphs):
        return None
    return RememberedStep(tuple(g.graph_key for g in graphs if g is not None),
                          tuple(g.asked_share for g in graphs if g is not None and g.asked_share is not None),
                          tuple(identities))


def remember_step(step: RememberedStep, context: str = "") -> Optional[Path]:
    """Store ``step`` for later processes (``settled`` makes it), by its first graph's key and step target,
    and, when every graph's call identity is known, by its first graph's identity and ``context`` (the
    options: ``expected_share``); the first path, or None (caching off, not writable)."""
    if len(step.identities) == len(step.graph_keys) and all(step.identities):
        plan_cache.write_entry(ENTRY_KIND, identity_key(step.identities[0], context), step)
    return plan_cache.write_entry(ENTRY_KIND, step_key(step.graph_keys[0], step.asked_shares[0].step_target_bytes), step)


def expected_share(earlier: Sequence["StepGraph"], earlier_identities: Sequence[str], identity: str,
                   context: str) -> Optional["GraphShare"]:
    """The share a remembered step (stored by identity under ``context``) gives the graph of call identity
    ``identity`` compiled now after ``earlier`` (the running plans of the graphs whose backward is pending,
    forward order; ``earlier_identities``, theirs): the share ``recall_share`` will return for it when its
    joint graph, step target, inputs and gradients are the remembered ones, which only the partitioner can
    check. None when no remembered step has these graphs before this one holding what they hold."""
    k = len(earlier)
    first = earlier_identities[0] if k else identity
    step = plan_cache.read_entry(ENTRY_KIND, identity_key(first, context)) if first else None
    if not isinstance(step, RememberedStep) or len(step.identities) <= k or len(step.asked_shares) <= k:
        return None
    if step.identities[:k + 1] != tuple(earlier_identities) + (identity,) \
            or step.graph_keys[:k] != tuple(g.graph_key for g in earlier):
        return None
    share = step.asked_shares[k]
    return share if (share.index, share.held_before_bytes) == (k, sum(g.held_bytes for g in earlier)) else None


def recall_share(earlier: Sequence["StepGraph"], graph_key: str, step_target_bytes: int,
                 input_activation_bytes: int, param_grad_bytes: int) -> Optional["GraphShare"]:
    """The share a remembered step gave the graph ``graph_key`` planned now after ``earlier`` (the running
    plans of the graphs whose backward is pending, forward order), or None when no remembered step
    matches (see the module docstring for what must match)."""
    first_key = earlier[0].graph_key if earlier else graph_key
    if not first_key:
        return None
    step = plan_cache.read_entry(ENTRY_KIND, step_key(first_key, step_target_bytes))
    k = len(earlier)
    if not isinstance(step, RememberedStep) or len(step.graph_keys) <= k:
        return None
    if step.graph_keys[:k + 1] != tuple(g.graph_key for g in earlier) + (graph_key,):
        return None
    share = step.asked_shares[k]
    rests_on = (share.index, share.step_target_bytes, share.held_before_bytes, share.input_activation_bytes,
                share.own_grad_bytes)
    here = (k, step_target_bytes, sum(g.held_bytes for g in earlier), input_activation_bytes if earlier else 0,
            param_grad_bytes)
    return share if rests_on == here else None
