"""Capture AOTAutograd joint graphs without compiling them, for planner unit tests.

``capture_joint(fn, *inputs)`` traces ``fn`` (a function or module) with
``aot_function`` and returns the joint forward+backward graph that a partitioner
would receive, with ``num_fwd_outputs``. No Inductor codegen runs: a capture
takes well under a second for the small graphs the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import default_partition

from remat.cost_model import annotate_costs, get_profile
from remat.passes.joint_graph import JointGraphFacts, read_joint_graph


@dataclass
class CapturedJoint:
    graph_module: fx.GraphModule
    num_fwd_outputs: int

    def facts(self, profile: str = "h100") -> JointGraphFacts:
        costs = annotate_costs(self.graph_module.graph, get_profile(profile))
        return read_joint_graph(self.graph_module.graph, costs, self.num_fwd_outputs)


def capture_joint(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> CapturedJoint:
    captured: list[CapturedJoint] = []

    def partition(joint: fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **kwargs):
        captured.append(CapturedJoint(joint, num_fwd_outputs))
        return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    compiled = aot_function(fn, fw_compiler=lambda gm, _: gm, bw_compiler=lambda gm, _: gm, partition_fn=partition)
    compiled(*inputs)
    return captured[-1]
