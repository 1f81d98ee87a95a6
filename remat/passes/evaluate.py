"""The ground truth every solver answers to: close a saved set into a partition and simulate it.

``evaluate(facts, chosen_saved)`` runs ``schedule.partition_nodes``, ``memory_steps``
and ``recompute_time_s`` and the memory simulator; a solver compares plans only by
what it returns, so a change to the schedule (how regions are placed, how often a
value is recomputed) changes what the solvers optimise, not their correctness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet

from ..cost_model.memory import MemorySimulation, Step, simulate_memory
from . import schedule
from .joint_graph import JointGraphFacts
from .schedule import Partition


@dataclass(frozen=True)
class Evaluated:
    """One simulated plan: the saved set asked for, its partition, simulation and extra time."""

    chosen: frozenset[str]
    partition: Partition
    simulation: MemorySimulation
    extra_time_s: float
    steps: tuple[Step, ...]
    pinned: frozenset[str] = frozenset()    # storages never freed in the simulated window

    @property
    def peak_bytes(self) -> int:
        return self.simulation.peak_bytes


def evaluate(facts: JointGraphFacts, chosen_saved: AbstractSet[str]) -> Evaluated:
    """Partition, steps, simulated peak and estimated recompute time of saving ``chosen_saved``."""
    partition = schedule.partition_nodes(facts, chosen_saved)
    steps, pinned = schedule.memory_steps(facts, partition)
    extra = schedule.recompute_time_s(facts, partition)
    return Evaluated(frozenset(chosen_saved), partition, simulate_memory(steps, pinned), extra, tuple(steps),
                     frozenset(pinned))
