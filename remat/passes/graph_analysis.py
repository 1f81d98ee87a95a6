"""What the planner works out once per joint graph, kept with the graph it belongs to.

A ``GraphAnalysis`` is created with each ``JointGraphFacts`` (its ``analysis`` field) and
filled lazily by the modules that compute each part: ``recompute_bans`` (why each node may
not be recomputed, node positions), ``mincut`` (the free min-cut), ``simulator.schedule`` (register-only
values, the rebuild decision per partition), ``held_cap`` (the numbers of the plans its trials simulate),
``simulator.evaluation`` (the partitions it simulated last) and ``simulator.kernel_facts`` (the kernel model's
per-node constants and Inductor's config, read when the graph is first simulated). It dies
with its facts: no module keeps per-graph state, nothing is keyed by ``id(facts)``.

This module imports nothing from ``remat.passes``, so every pass can use it without an
import cycle. Each part is a deterministic function of the (immutable) facts: two threads
that fill the same part at once compute equal values, and either may be kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

REBUILD_ENTRIES = 4096   # rebuild decisions remembered per graph before the table starts over
CAP_TRIAL_ENTRIES = 16384   # held-cap trials remembered per graph before the table starts over
SIMULATION_ENTRIES = 64     # simulations remembered per graph (least recently used dropped first)


@dataclass
class GraphAnalysis:
    """Per-graph results, each None until the module that owns it first computes it."""

    bans: Mapping[str, str | None] | None = None    # node -> why it may not be recomputed, or None
    positions: Mapping[str, int] | None = None         # node -> index in the graph's order
    min_cut_saved: frozenset[str] | None = None        # mincut.min_cut_saved
    register_only: frozenset[str] | None = None        # simulator.schedule.register_only
    kernel_facts: Any = None                              # simulator.kernel_facts.KernelFacts
    # (saved, recomputed) -> whether that partition's backward rebuilds intermediates per use
    rebuilds: dict[tuple[frozenset[str], frozenset[str]], bool] = field(default_factory=dict)
    # saved set -> (saved bytes, simulated peak, extra time s) of its plan: passes.held_cap's trials,
    # which the capped plans of several targets of one graph repeat (a step's share search)
    cap_trials: dict[frozenset[str], tuple[int, int, float]] = field(default_factory=dict)
    # partition (saved, resident inputs, recomputed) -> (its simulated run, extra time s): simulator.evaluation's,
    # the last SIMULATION_ENTRIES used; the solvers of one graph's plans ask for the same partitions again (a
    # cold HF GPT-2: 2,596 simulations, 563 distinct). Emptied once the graph is planned (forget_simulations)
    simulations: "OrderedDict[tuple[frozenset[str], ...], Any]" = field(default_factory=OrderedDict)

    def forget_simulations(self) -> None:
        """Drop the remembered simulations (each ~0.1-0.2 MB on a 700-node graph): the graph is planned."""
        self.simulations.clear()


__all__ = ["CAP_TRIAL_ENTRIES", "REBUILD_ENTRIES", "SIMULATION_ENTRIES", "GraphAnalysis"]
