"""The distributed side of one planned graph, as its ``CompiledGraph`` records it: its share of the
per-rank budget and the collectives in its forward and backward (``distributed_fit.record_graph``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from torch import fx

    from .distributed import GraphShare


@dataclass(frozen=True)
class DistributedGraphRecord:
    """The distributed side of one planned graph: its share of the budget (None when it got
    the whole budget) and the collectives in its graphs, by node name."""

    share: Optional["GraphShare"]
    collective_nodes: tuple[str, ...]         # collectives (and waits) in the forward and backward
    recomputed_collectives: tuple[str, ...]   # collectives inside a recompute region of the backward: always empty


def collectives_of(fw: "fx.GraphModule", bw: "fx.GraphModule") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(collective nodes of both graphs, collective nodes the backward recomputes).

    A recomputed node is one ``place_recompute_regions`` tagged with ``node.meta[REMAT_KEY]``.
    """
    from .passes.joint_graph import is_collective
    from .passes.rewrite import REMAT_KEY

    found = tuple(f"{gm_name}.{n.name}" for gm_name, gm in (("forward", fw), ("backward", bw))
                  for n in gm.graph.nodes if is_collective(n))
    recomputed = tuple(f"backward.{n.name}" for n in bw.graph.nodes if is_collective(n) and REMAT_KEY in n.meta)
    return found, recomputed


__all__ = ["DistributedGraphRecord", "collectives_of"]
