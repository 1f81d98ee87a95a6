"""Per-node cost records: FLOPs, bytes moved and estimated time.

``annotate_costs`` writes one frozen ``NodeCost`` under ``node.meta[COST_KEY]``
for every node of a graph and returns them by name. It never rewrites a graph.

Time is a roofline: ``max(flops / peak_rate(dtype), bytes / bandwidth)`` plus
the profile's kernel-launch floor for every op that launches a kernel (views and
getitems launch none).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from .flops import node_flops
from .hardware import HardwareProfile
from .tensors import is_aliasing_op, iter_tensors, node_val, value_nbytes

COST_KEY = "remat_cost"


@dataclass(frozen=True)
class NodeCost:
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    est_time_s: float = 0.0
    has_flop_formula: bool = True
    flop_rule: str = ""

    def __add__(self, other: "NodeCost") -> "NodeCost":
        return NodeCost(
            flops=self.flops + other.flops,
            bytes_read=self.bytes_read + other.bytes_read,
            bytes_written=self.bytes_written + other.bytes_written,
            est_time_s=self.est_time_s + other.est_time_s,
            has_flop_formula=self.has_flop_formula and other.has_flop_formula,
            flop_rule="sum",
        )


ZERO_COST = NodeCost()


def _out_dtype(node: fx.Node) -> Optional[torch.dtype]:
    for tensor in iter_tensors(node_val(node)):
        return tensor.dtype
    return None


def estimate_node_cost(node: fx.Node, profile: HardwareProfile) -> NodeCost:
    """The cost of running ``node`` once on ``profile``; zero for placeholders, views and getitems."""
    if node.op != "call_function" or node.target is operator.getitem or is_aliasing_op(node):
        return NodeCost(flop_rule="free")
    estimate = node_flops(node)
    bytes_written = value_nbytes(node_val(node))
    bytes_read = sum(value_nbytes(node_val(arg)) for arg in node.all_input_nodes)
    compute_s = estimate.flops / profile.peak_flops_per_s(_out_dtype(node))
    memory_s = (bytes_read + bytes_written) / profile.bandwidth_bytes_per_s
    return NodeCost(
        flops=estimate.flops,
        bytes_read=bytes_read,
        bytes_written=bytes_written,
        est_time_s=max(compute_s, memory_s) + profile.kernel_launch_s,
        has_flop_formula=estimate.has_formula,
        flop_rule=estimate.rule,
    )


def annotate_costs(graph: fx.Graph, profile: HardwareProfile) -> dict[str, NodeCost]:
    """Write ``node.meta[COST_KEY]`` on every node; return the costs by node name."""
    costs: dict[str, NodeCost] = {}
    for node in graph.nodes:
        cost = estimate_node_cost(node, profile)
        node.meta[COST_KEY] = cost
        costs[node.name] = cost
    return costs
