"""Analysis of FX graphs: FLOPs, bytes, time and memory over time. Never rewrites a graph.

- ``flops``: FLOPs per node (torch's formulas, ours, documented estimates).
- ``fusion``: which nodes Inductor fuses, hence which tensors reach memory.
- ``costs``: ``NodeCost`` records and the roofline; ``annotate_costs``.
- ``hardware``: ``HardwareProfile``s (datasheet GPUs, measured CPU/GPU, cached).
- ``eager_ops``: families of ops eager PyTorch runs far below the roofline, fitted per profile.
- ``loop_costs``: what Inductor's generated CPU loops pay beyond the roofline, measured on its own kernels.
- ``loop_charges``: which node pays them.
- ``calibrate``: measured kernel times per node, cached by graph hash.
- ``symbolic``: costs as formulas in the shape symbols.

The memory simulator that reads these costs is ``remat.simulator``.
"""

from .calibrate import Calibration, calibrate, measure_node_times
from .costs import COST_KEY, NodeCost, annotate_costs, estimate_node_cost, phase_totals
from .flops import FlopEstimate, node_flops, ops_without_formula
from .fusion import FusionGroups, find_fusion_groups
from .hardware import HardwareProfile, get_profile

__all__ = [
    "COST_KEY", "Calibration", "FlopEstimate", "FusionGroups", "HardwareProfile", "NodeCost", "annotate_costs",
    "calibrate", "estimate_node_cost", "find_fusion_groups", "get_profile", "measure_node_times", "node_flops",
    "ops_without_formula", "phase_totals",
]
