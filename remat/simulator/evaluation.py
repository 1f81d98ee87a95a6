"""The ground truth every solver answers to: close a saved set into a partition and simulate it.

``evaluate(facts, chosen_saved)`` runs ``schedule.partition_nodes`` and
``schedule.simulate_partition`` (the backward order, the simulator's steps and their
simulation) and charges the recompute time of that order; a solver compares plans only by
what it returns, so a change to the schedule (how regions are placed, how often a
value is recomputed) changes what the solvers optimise, not their correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any

from ..passes.graph_analysis import SIMULATION_ENTRIES
from ..passes.joint_graph import JointGraphFacts
from ..passes.partition import Partition, Scheduled
from . import schedule
from .memory_timeline import MemorySimulation, Step
from .shared_storage import one_value_per_storage


@dataclass(frozen=True)
class Evaluated:
    """One simulated plan: the saved set asked for, its partition, simulation, extra time and the
    backward schedule they were simulated on."""

    chosen: frozenset[str]
    partition: Partition
    simulation: MemorySimulation
    extra_time_s: float
    steps: tuple[Step, ...]
    pinned: frozenset[str] = frozenset()    # storages never freed in the simulated window
    backward_order: tuple[Scheduled, ...] = ()   # the backward schedule simulated (``schedule.backward_order``)

    @property
    def peak_bytes(self) -> int:
        return self.simulation.peak_bytes


def partition_of(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> tuple[frozenset[str], Partition]:
    """The saved set as ``evaluate`` normalises it, and its partition, without simulating it: what
    the plan saves (``Partition.saved``), for a fraction of a millisecond where a simulation takes tens."""
    chosen = frozenset(one_value_per_storage(facts, chosen_saved) or chosen_saved)
    return chosen, schedule.partition_nodes(facts, chosen)


def evaluate(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> Evaluated:
    """Partition, steps, simulated peak and estimated recompute time of saving ``chosen_saved``.

    ``Evaluated.chosen`` is ``chosen_saved`` with values that share a storage replaced by the
    storage's owner (``shared_storage.one_value_per_storage``, the rule ``partition_nodes``
    applies): a solver that then stops saving the owner frees the storage, where dropping one
    of two aliases would change nothing."""
    chosen, partition = partition_of(facts, chosen_saved)
    run, extra = simulated(facts, partition)
    return Evaluated(chosen, partition, run.simulation, extra, tuple(run.steps), frozenset(run.pinned), tuple(run.order))


def simulated(facts: JointGraphFacts, partition: Partition) -> tuple[Any, float]:
    """``schedule.simulate_partition`` of ``partition`` and the recompute time of its order, remembered in the
    graph's analysis (``GraphAnalysis.simulations``: the last ``SIMULATION_ENTRIES``): a deterministic function of
    the facts and the partition (and its rebuild decision, which ``schedule.hold_intermediates`` may set: it forgets
    the partition's simulation), so a remembered answer is the one a new simulation would give."""
    key = partition.simulated_as
    known = facts.analysis.simulations
    found = known.get(key)
    if found is not None:
        try:
            known.move_to_end(key)
        except KeyError:     # dropped by another thread meanwhile
            pass
        return found
    run = schedule.simulate_partition(facts, partition)
    found = known[key] = (run, schedule.recompute_time_of(facts, run.order))
    while len(known) > SIMULATION_ENTRIES:
        try:
            known.popitem(last=False)
        except KeyError:
            break
    return found
