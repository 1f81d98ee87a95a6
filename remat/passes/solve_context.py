"""The search context the default solver's two halves share: ``solve_greedy.py`` (descent,
polish, smallest peak) and ``solve_local.py`` (local search).

A ``SearchContext`` is built once per solve by the solver's entry point and passed to every
function of the search, explicitly: the joint graph's facts, the per-graph constants every move
reads (graph positions, why each forward value may not be recomputed), and the count of the
simulations the solve ran. Nothing outlives the solve; no module keeps one. The local search's
work limit is not part of it: each ``local_search`` call has its own (``LOCAL_SEARCH_STEPS``).
"""

from __future__ import annotations

from typing import Mapping, Optional

from ..simulator import Evaluated, evaluate
from .joint_graph import JointGraphFacts
from .recompute_bans import why_not_recomputable


class SearchContext:
    """One solve over one joint graph: ``facts``, ``position`` (node -> joint-graph index, the
    tie-break of every ordering), ``ban`` (forward value -> why it may not be recomputed, None when
    it may), and ``evaluations``, the simulations ``evaluate`` ran so far."""

    def __init__(self, facts: JointGraphFacts) -> None:
        self.facts = facts
        self.position: Mapping[str, int] = facts.position()
        self.ban: Mapping[str, Optional[str]] = {name: why_not_recomputable(facts, name) for name in facts.nodes
                                                 if facts.nodes[name].role == "forward"}
        self.evaluations = 0

    def evaluate(self, chosen: frozenset[str]) -> Evaluated:
        """``evaluate.evaluate`` of the saved set ``chosen``, counted in ``evaluations``."""
        self.evaluations += 1
        return evaluate(self.facts, chosen)

    def save_all(self) -> frozenset[str]:
        """Every forward value the backward reads: the plan with no extra time."""
        return frozenset(n for n in self.facts.needed_by_backward if self.facts.nodes[n].role == "forward")


__all__ = ["SearchContext"]
