"""Analysis of FX graphs: FLOPs, bytes, time and memory over time. Never rewrites a graph."""

from .costs import COST_KEY, NodeCost, annotate_costs, estimate_node_cost
from .hardware import HardwareProfile, get_profile

__all__ = ["COST_KEY", "NodeCost", "annotate_costs", "estimate_node_cost", "HardwareProfile", "get_profile"]
