"""Why a forward value may never be recomputed: the answer every solver and the min-cut ask.

``why_not_recomputable`` gives the reason (or None), worked out once per joint graph for every
node and kept in the graph's ``GraphAnalysis``; ``node_positions`` gives each node's index in the
graph's order, kept the same way.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..cost_model.inductor_rules import INDEX_REDUCTIONS, REDUCTION_OPS
from .joint_graph import JointGraphFacts

# Reductions whose result may round differently when recomputed in another kernel (all but the
# index ones, which are exact).
_ROUNDING_REDUCTIONS = REDUCTION_OPS - INDEX_REDUCTIONS


def _why_not_recomputable_uncached(facts: JointGraphFacts, name: str) -> str | None:
    node = facts.nodes[name]
    if node.recompute_ban is not None:
        return node.recompute_ban
    if node.is_sym:
        return "symbolic size: saved as an int"
    if node.is_getitem:
        source = node.inputs[0]
        if facts.nodes[source].is_multi_output:
            return _why_not_recomputable_uncached(facts, source)  # save this output, never the tuple
    op_name = node.op.split(".")[1] if node.op.startswith("aten.") else ""
    if op_name in _ROUNDING_REDUCTIONS and 4 * node.cost.bytes_written <= node.cost.bytes_read:
        # A reduction recomputed in another kernel may round differently (another
        # reduction order), and normalisation backwards amplify the difference; its
        # output is small, so saving it costs little.
        return "reduction: saving its small output keeps recomputation bit-identical"
    return None


def recompute_bans(facts: JointGraphFacts) -> Mapping[str, str | None]:
    """Every node's ``why_not_recomputable`` answer (the planner asks about the same nodes
    millions of times on a large graph: worked out once per graph)."""
    analysis = facts.analysis
    if analysis.bans is None:
        analysis.bans = {name: _why_not_recomputable_uncached(facts, name) for name in facts.nodes}
    return analysis.bans


def node_positions(facts: JointGraphFacts) -> Mapping[str, int]:
    """Each node's index in the graph's order, worked out once per graph."""
    analysis = facts.analysis
    if analysis.positions is None:
        analysis.positions = facts.position()
    return analysis.positions


def why_not_recomputable(facts: JointGraphFacts, name: str) -> str | None:
    """The reason ``name`` must be saved rather than recomputed, or None if it may be recomputed.

    Worked out once per joint graph for every node (``facts`` is immutable), then looked up.
    """
    return recompute_bans(facts)[name]


__all__ = ["node_positions", "recompute_bans", "why_not_recomputable"]
