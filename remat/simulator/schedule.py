"""Which nodes run where, in what order, once the saved set is chosen.

Given the forward values the plan saves, ``partition_nodes`` finds what the
backward must recompute (and which values must be saved anyway, with the
reason), ``backward_order`` places each recompute region right before the
backward node that needs it (not all at the start of the backward: that keeps
every recomputed value alive at once) and decides how often each value is
recomputed (a value may have several instances, see ``backward_order``), and
``memory_steps`` turns both into the steps the memory simulator walks. The
rewrite uses the same ``backward_order``, so the graph that runs is the graph
that was simulated, and ``recompute_time_s`` charges every instance.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import AbstractSet, Iterable, Mapping

from ..passes.graph_analysis import REBUILD_ENTRIES
from ..passes.joint_graph import JointGraphFacts
from ..passes.mincut import min_cut_saved, saved_cost_bytes
from ..passes.partition import Partition, Scheduled
from ..passes.recompute_bans import node_positions, recompute_bans
from .kernel_facts import RECOMPUTE_SUFFIX, graph_inductor_config, graph_inputs_aligned, kernel_kinds
from .kernel_lowering import EXTERN, SCATTER
from .kernel_steps import forward_steps, kernel_steps
from .memory_timeline import MemorySimulation, Step, simulate_memory
from .shared_storage import one_value_per_storage, shared_storage_groups


def _register_only_uncached(facts: JointGraphFacts) -> frozenset[str]:
    bans = recompute_bans(facts)
    in_registers = {
        name for name, node in facts.nodes.items()
        if node.role == "forward" and bans[name] is None and not node.is_getitem and node.cost.fusion_group
        and node.cost.bytes_written > 0 and node.cost.fused_bytes_written == 0
    }
    candidates = in_registers - min_cut_saved(facts)
    return frozenset(candidates - _default_saved_masks(facts, candidates))


def _default_saved_masks(facts: JointGraphFacts, in_registers: AbstractSet[str]) -> set[str]:
    """The values of ``in_registers`` PyTorch's default partitioner saves (``JointGraphFacts.default_saved``)
    that take fewer bytes than the largest value their kernel rebuilds them from (a bool mask saved
    instead of the float it came from)."""
    masks = set()
    for name in (facts.default_saved or frozenset()) & in_registers:
        sources = _memory_sources(facts, {name}, in_registers, set())
        largest = max((saved_cost_bytes(facts, s) for s in sources), default=0)
        if saved_cost_bytes(facts, name) < largest:
            masks.add(name)
    return masks


def _memory_sources(facts: JointGraphFacts, values: AbstractSet[str], in_registers: AbstractSet[str],
                    saved: AbstractSet[str]) -> set[str]:
    """The nearest forward values ``values``' kernels read from memory (not in ``in_registers``, not
    in ``saved``): what the backward rebuilds ``values`` from."""
    nodes = facts.nodes
    found: set[str] = set()
    seen: set[str] = set()
    stack = [i for name in values for i in nodes[name].inputs]
    while stack:
        name = stack.pop()
        if name in seen or name in saved or nodes[name].role != "forward":
            continue
        seen.add(name)
        if name in in_registers:
            stack.extend(nodes[name].inputs)
        else:
            found.add(name)
    return found


def register_only(facts: JointGraphFacts) -> frozenset[str]:
    """Forward values no plan saves: values the forward's fused kernels keep in registers (the
    cost model's fusion writes none of their bytes) that may be recomputed, except those the
    free min-cut saves (a bool mask kept instead of the float it came from cuts the bytes the
    forward hands to the backward) and the masks PyTorch's default partitioner saves
    (``_default_saved_masks``): plain Inductor's forward stores those already, so saving one adds no
    store plain Inductor's code lacks, and without them the default's partition could not be
    planned as it runs (rand-1202: its ReLU mask ``le`` became the float ``relu`` saved beside the
    dropout output, 2.14 MB simulated and measured against plain Inductor's 1.75 MB).

    Saving any other one adds a store to a fused forward kernel to buy back a recomputation the
    cost model prices at microseconds; on Inductor's CPU code that was measured to make the zoo
    CNN's forward 4x slower (3.4 -> 14.3 ms, plans that also saved ReLU masks and BatchNorm
    factors). The backward rebuilds such a value inside its own kernels instead.
    """
    analysis = facts.analysis
    if analysis.register_only is None:
        analysis.register_only = _register_only_uncached(facts)
    return analysis.register_only


def _instead_of_register_only(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> set[str]:
    """``chosen_saved`` with each register-only value replaced by the nearest values its forward
    kernel reads from memory (forward values that are not register-only): saving a value the
    forward keeps in registers means saving what the backward's kernels rebuild it from."""
    not_saved = register_only(facts)
    saved = set(chosen_saved)
    dropped = saved & not_saved
    if not dropped:
        return saved
    saved -= dropped
    return saved | _memory_sources(facts, dropped, not_saved, saved)


def partition_nodes(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> Partition:
    """Close ``chosen_saved`` into a valid partition.

    Every value the backward reads is either saved, a primal, or recomputed from
    saved values and primals. A register-only value (``register_only``) chosen for saving is
    recomputed from the values its kernel reads, which are saved instead. A value that may not
    be recomputed (random,
    mutation, collective, symbolic size) is saved and recorded in ``forced``
    (in joint-graph order: the result does not depend on set iteration order).
    No two saved values share a storage (``shared_storage.one_value_per_storage``).
    """
    partition = _close(facts, chosen_saved)
    # Two saved values sharing a storage would both be donated to the backward (shared_storage.py):
    # save the storage's owner once and rebuild the other values as views of it.
    for _ in range(4):
        canonical = one_value_per_storage(facts, partition.saved)
        if canonical is None:
            return partition
        partition = _close(facts, canonical)
    raise RuntimeError("remat: saving each storage once did not converge in 4 rounds; "
                       f"values sharing a storage: {shared_storage_groups(facts, partition.saved)}")


def _close(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> Partition:
    """``partition_nodes``'s closure of ``chosen_saved``, before the one-value-per-storage rule."""
    bans, position = recompute_bans(facts), node_positions(facts)
    nodes = facts.nodes
    saved = _instead_of_register_only(facts, chosen_saved)
    forced: dict[str, str] = {}
    primals: set[str] = set()
    recomputed: set[str] = set()
    stack = list(facts.needed_by_backward)
    while stack:
        name = stack.pop()
        node = nodes[name]
        if node.role == "primal":
            primals.add(name)
            continue
        if name in saved or name in recomputed:
            continue
        reason = bans[name]
        if reason is not None:
            saved.add(name)
            forced[name] = reason
            continue
        recomputed.add(name)
        stack.extend(node.inputs)
    for name in saved:
        if name not in forced and bans[name] is not None:
            forced[name] = bans[name]  # type: ignore[assignment]
    ordered = {name: forced[name] for name in sorted(forced, key=position.__getitem__)}
    return Partition(frozenset(saved), frozenset(primals), frozenset(recomputed), ordered)


def forward_ancestors(facts: JointGraphFacts, roots: Iterable[str]) -> set[str]:
    """The forward nodes among ``roots`` and their inputs, transitively (a non-forward node ends
    the walk: primals, tangents)."""
    found: set[str] = set()
    stack = list(roots)
    while stack:
        name = stack.pop()
        if name in found or facts.nodes[name].role != "forward":
            continue
        found.add(name)
        stack.extend(facts.nodes[name].inputs)
    return found


def forward_order(facts: JointGraphFacts, partition: Partition) -> list[str]:
    """Forward candidates the forward graph computes, in joint-graph order."""
    needed = forward_ancestors(facts, set(facts.forward_required) | set(partition.saved))
    return [name for name in facts.order if name in needed]


def recompute_instance(name: str, k: int) -> str:
    """The name of the ``k``-th recomputation (from 0) of forward node ``name`` in the backward."""
    return f"{name}{RECOMPUTE_SUFFIX}{k}"


def _builds(facts: JointGraphFacts, partition: Partition, missing: list[str], available: Mapping[str, str]) -> set[str]:
    """Recomputed values a region must build to make ``missing``: their recomputed ancestors,
    up to values that have an instance ``available``."""
    pending: set[str] = set()
    stack = list(missing)
    while stack:
        dep = stack.pop()
        if dep in pending or dep in available:
            continue
        pending.add(dep)
        stack.extend(i for i in facts.nodes[dep].inputs if i in partition.recomputed)
    return pending


def _with_alias_bases(facts: JointGraphFacts, partition: Partition, names: list[str]) -> set[str]:
    """``names`` and the recomputed values they alias (a view's base, a tuple's getitem source):
    keeping a view open keeps its base's storage alive anyway."""
    out: set[str] = set()
    stack = list(names)
    while stack:
        name = stack.pop()
        if name in out:
            continue
        out.add(name)
        node = facts.nodes[name]
        if (node.is_view or node.is_getitem) and node.inputs and node.inputs[0] in partition.recomputed:
            stack.append(node.inputs[0])
    return out


def _unanchored(facts: JointGraphFacts, built: Mapping[str, str], kinds: Mapping[str, str]) -> set[str]:
    """Values of a region (``built``, in order) that no library call of the region precedes.

    Inductor fuses loops that read the same buffers into one kernel and runs it where
    its earliest member could run: a second instance of a loop computed only from saved
    values would be merged with the first, allocated early and held anyway (the kernel
    model says so too). A library call's output, and loops downstream of one, are
    anchored to their region: only those are rebuilt.
    """
    anchored: set[str] = set()
    for name in built:
        if kinds[name] in (EXTERN, SCATTER) or any(i in anchored for i in facts.nodes[name].inputs):
            anchored.add(name)
    return set(built) - anchored


def backward_order(facts: JointGraphFacts, partition: Partition, rebuild: bool | None = None) -> list[Scheduled]:
    """Backward nodes in joint order, each preceded by the recompute region it needs.

    A recomputed value may be recomputed more than once: each recomputation is an
    *instance* (``recompute_instance(name, k)``) with its own storage. Walking the
    backward nodes in joint order, a node that reads a recomputed value with no *open*
    instance gets a region right before it that builds one, together with the
    recomputed values it is made from that have no open instance (open ones are read).
    After the region, the instances the node reads directly (and the values those alias)
    stay open: later backward nodes read them, and each dies after its last reader. The
    values built only on the way to them (a recompute chain's intermediates):

    - ``rebuild=False``: stay open too, so every value is recomputed once and held
      until its last backward reader (one region per value's first use);
    - ``rebuild=True``: are closed, so they die with their region, and a later node that
      needs one gets a fresh instance: intermediates are never held across the rest of
      the backward, at the price of recomputing them again (classic checkpointing's
      per-segment recomputation);
    - ``None`` (what the planner and the rewrite use): ``rebuilds_intermediates``.

    Guarantees: every copy comes after the copies it reads; every recomputed copy is
    read by a later copy; region ids count up from 0 in the order regions run; each
    region is one contiguous block followed by the backward node it was placed for.
    """
    if rebuild is None:
        rebuild = rebuilds_intermediates(facts, partition)
    position = node_positions(facts)
    kinds = kernel_kinds(facts) if rebuild else {}    # a new dict per call: fetched once, not per region
    recomputed = partition.recomputed
    open_: dict[str, str] = {}
    count: dict[str, int] = {}
    schedule: list[Scheduled] = []
    region = 0
    for name in facts.order:
        node = facts.nodes[name]
        if node.role != "backward":
            continue
        needs = [i for i in node.inputs if i in recomputed]
        missing = [v for v in needs if v not in open_]
        if missing:
            built: dict[str, str] = {}
            for dep in sorted(_builds(facts, partition, missing, open_), key=position.__getitem__):
                k = count.get(dep, 0)
                count[dep] = k + 1
                reads = tuple((i, built[i] if i in built else open_[i])
                              for i in facts.nodes[dep].inputs if i in recomputed)
                built[dep] = recompute_instance(dep, k)
                schedule.append(Scheduled(dep, built[dep], region, reads))
            region += 1
            kept = _with_alias_bases(facts, partition, needs) | _unanchored(facts, built, kinds) if rebuild else built
            open_.update((v, i) for v, i in built.items() if v in kept)
        schedule.append(Scheduled(name, name, -1, tuple((i, open_[i]) for i in needs)))
    return schedule


@dataclass(frozen=True)
class Simulated:
    """A partition's backward schedule, the simulator's steps for it, and their simulation."""

    order: list[Scheduled]          # backward_order(facts, partition)
    steps: list[Step]
    pinned: set[str]
    simulation: MemorySimulation


def simulate_partition(facts: JointGraphFacts, partition: Partition) -> Simulated:
    """``backward_order``, ``memory_steps`` and their simulation for ``partition``, with the
    rebuild decision (``rebuilds_intermediates``) made on the way when it is not known yet.

    Exactly what calling those three gives, with less work: the forward's steps are built once
    for both schedules, the steps of the schedule chosen are the ones the decision simulated
    (not built and simulated again), and when rebuilding
    changes nothing (no recompute chain has an intermediate to close) the two schedules are
    equal, so one simulation decides (holding, as a tie always has).
    """
    known = facts.analysis.rebuilds
    key = (partition.saved, partition.recomputed)
    reuse = graph_inductor_config(facts).allow_buffer_reuse
    simulate = functools.partial(simulate_memory, reuse_freed=reuse, aligned_inputs=graph_inputs_aligned(facts))
    fw_order = forward_order(facts, partition)
    if key in known:
        order = backward_order(facts, partition, known[key])
        steps, pinned = kernel_steps(facts, partition, fw_order, order)
        return Simulated(order, steps, pinned, simulate(steps, pinned))
    held = backward_order(facts, partition, False)
    rebuilt = backward_order(facts, partition, True)
    forward = forward_steps(facts, partition, fw_order)     # the same for both schedules
    runs = []
    for order in ((held,) if rebuilt == held else (held, rebuilt)):
        steps, pinned = kernel_steps(facts, partition, fw_order, order, forward)
        runs.append(Simulated(order, steps, pinned, simulate(steps, pinned)))
    rebuild = len(runs) == 2 and runs[1].simulation.peak_bytes < runs[0].simulation.peak_bytes
    if len(known) >= REBUILD_ENTRIES:
        known.clear()
    known[key] = rebuild
    return runs[1] if rebuild else runs[0]


def hold_intermediates(facts: JointGraphFacts, partition: Partition) -> None:
    """Decide, for this (graph, partition), that its backward builds each recomputed value once and
    holds it to its last reader (``backward_order(..., rebuild=False)``), whatever the simulator would
    pick: what PyTorch's partition of a checkpointed block runs. Call it before the partition is
    simulated; the simulator, the time estimate and the rewrite then all see that schedule.
    Why: on rand-1337 (a conv net) the simulator put the per-block checkpointing plan at the same peak
    either way and chose per-use rebuilds; that code, which ran one BatchNorm block's convolution three
    times, measured 3,376,216 B, and holding measured 3,136,736 B, checkpointing's own peak."""
    facts.analysis.rebuilds[(partition.saved, partition.recomputed)] = False
    facts.analysis.simulations.pop(partition.simulated_as, None)    # a simulation remembered with the other schedule


def rebuilds_intermediates(facts: JointGraphFacts, partition: Partition) -> bool:
    """Whether this partition's backward rebuilds recompute-chain intermediates per use.

    True exactly when the ``rebuild=True`` schedule's simulated peak is lower than the
    ``rebuild=False`` one's: the planner's peak is never higher than holding every
    recomputed value would give, and no time is spent on second recomputations that do
    not lower the peak. Decided once per (graph, partition) and remembered, so the
    simulator, the time estimate and the rewrite all see the same schedule.
    """
    known = facts.analysis.rebuilds
    key = (partition.saved, partition.recomputed)
    if key not in known:
        simulate_partition(facts, partition)
    return known[key]


def recompute_time_of(facts: JointGraphFacts, order: list[Scheduled]) -> float:
    """Estimated recompute time of a backward schedule: every instance its regions run."""
    return sum(facts.nodes[s.name].cost.est_time_s for s in order if s.region >= 0)


def recompute_time_s(facts: JointGraphFacts, partition: Partition) -> float:
    """Estimated time the backward spends recomputing, for this partition.

    Every recomputation the backward runs is counted, once per instance
    (``backward_order``): the solvers read their extra time from here and nowhere
    else, so a value recomputed twice is charged twice.
    """
    return recompute_time_of(facts, backward_order(facts, partition))


def memory_steps(facts: JointGraphFacts, partition: Partition) -> tuple[list[Step], set[str]]:
    """The forward, then the backward, as simulator steps in Inductor's kernel order; and the
    pinned storages (see ``kernel_steps``)."""
    return kernel_steps(facts, partition, forward_order(facts, partition), backward_order(facts, partition))
