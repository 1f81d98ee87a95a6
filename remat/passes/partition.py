"""The records a plan's schedule is made of: which forward values the backward gets and how
(``Partition``), and each node of the backward in the order it runs (``Scheduled``).

``simulator.schedule`` builds them, ``simulator.kernel_steps`` simulates them and ``rewrite`` emits
them; they live here, apart from all three, so the simulator reads them without importing the scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Partition:
    """What the backward gets of the forward: saved values, resident inputs, recomputed values."""

    saved: frozenset[str]                  # forward candidates handed to the backward
    saved_primals: frozenset[str]          # inputs the backward reads (resident: cost no memory)
    recomputed: frozenset[str]             # forward candidates the backward recomputes
    forced: Mapping[str, str]              # saved although not chosen: name -> reason

    @property
    def simulated_as(self) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
        """What its simulation depends on (with the graph and its rebuild decision): the key it is remembered by."""
        return self.saved, self.saved_primals, self.recomputed


@dataclass(frozen=True)
class Scheduled:
    """One node of the backward graph, in the order the backward runs it."""

    name: str                              # the joint-graph node
    instance: str                          # what the simulator and the rewrite call this copy
                                           # (``schedule.backward_order`` says how instances are named)
    region: int                            # recompute region id, -1 for a backward node
    reads: tuple[tuple[str, str], ...]     # (recomputed input, the instance of it this copy reads)


__all__ = ["Partition", "Scheduled"]
