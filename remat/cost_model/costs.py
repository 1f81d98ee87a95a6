"""Per-node cost records: FLOPs, bytes moved and estimated time.

``annotate_costs`` writes one frozen ``NodeCost`` under ``node.meta[COST_KEY]``
for every node of a graph and returns them by name. It never rewrites a graph.

Bytes. ``bytes_read`` / ``bytes_written`` are the traffic of the op run on its
own (as eager PyTorch runs it): views, getitems and ``_unsafe_view`` move 0
bytes; an input is charged the distinct elements it touches (an expanded bias
counts once). ``fused_bytes_read`` / ``fused_bytes_written`` are the traffic
once Inductor fuses the graph (``fusion.py``): an intermediate whose every
reader is in the same kernel is never written or read back.

Time is a roofline on a ``HardwareProfile``::

    compute = flops / peak_rate(dtype) + transcendentals / special_rate + random_values / rng_rate
    time = max(compute, bytes / bandwidth(working set)) + launches * launch_floor

except for a loop Inductor generates on a CPU, whose compute and memory time add
up (one core issues both from one instruction stream; measured on batch norm's
kernels, the sum is within 5% and the max 30-40% low).

``unfused_time_s`` applies it to the op alone (its own kernel, unfused bytes),
and is never below the profile's fitted eager time of the op's family
(``eager_ops.py``: Welford reductions, bool masks, Python prims run eagerly far
below the roofline).
``est_time_s``, what the planner uses, applies it once per fused kernel (the
kernel's summed FLOPs and fused bytes, one launch) and shares that time among
the kernel's nodes in proportion to each node's own roofline; the launch is
charged to the kernel's last node. Inside a generated loop, compute also pays
what the profile measured Inductor's CPU loops pay per element beyond the
roofline (``loop_costs.py``): random numbers at Inductor's Philox rate instead
of eager's, bool tensors written and read, long Welford reductions.
Convolutions run at the rate the profile measured for their library kernel
(``HardwareProfile.library_flops_per_s``) where it has one.

Given measured kernel times (``calibrate.measure_node_times``), ``est_time_s``
of a library call (matmul, convolution, attention: the same kernel Inductor
calls) is the measured time. A node Inductor generates a loop for keeps its
fused estimate: the measurement ran the eager op as its own kernel, a different
program (own dispatch, own loop, eager's RNG) from the loop Inductor fuses it
into; its measured time is recorded in ``measured_time_s``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import Mapping, Optional

import torch
from torch import fx

from .flops import TORCH_RULE, node_flops, node_special_ops
from .fusion import FusionGroups, find_fusion_groups, is_loop_op
from .eager_ops import eager_time_s
from .hardware import HardwareProfile
from .loop_charges import loop_extra_s, split_kernel_loads
from .phases import node_phases
from .tensors import concrete_int, is_free_op, iter_tensors, node_val, op_name, tensor_nbytes, touched_nbytes, value_nbytes

COST_KEY = "remat_cost"


@dataclass(frozen=True)
class NodeCost:
    flops: int = 0
    bytes_read: int = 0                 # the op alone: distinct input bytes it touches (views: 0)
    bytes_written: int = 0              # the op alone: bytes of its outputs
    est_time_s: float = 0.0             # the estimate the planner uses (see time_source)
    has_flop_formula: bool = True
    flop_rule: str = ""
    fused_bytes_read: int = 0           # once Inductor fuses: bytes loaded from memory (a second pass: twice)
    fused_bytes_written: int = 0        # once Inductor fuses: bytes stored to memory
    launches: int = 0                   # kernel launches charged to this node
    unfused_time_s: float = 0.0         # roofline of the op as its own kernel, as eager runs it
    measured_time_s: Optional[float] = None   # calibration: the op's kernel timed on the device
    time_source: str = ""               # "roofline", "roofline (fused)", "measured"
    fusion_group: str = ""              # name of the first node of its fused kernel ("" outside one)
    transcendentals: int = 0            # special-function evaluations (exp, erf, tanh, ...)
    random_values: int = 0              # random numbers drawn
    loop_extra_s: float = 0.0           # in a generated loop: what it pays beyond the roofline (loop_costs.py)

    def __add__(self, other: "NodeCost") -> "NodeCost":
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                if f.type in ("int", "float")}
        # sums the records that were measured; None only when neither was
        measured = None
        if self.measured_time_s is not None or other.measured_time_s is not None:
            measured = (self.measured_time_s or 0.0) + (other.measured_time_s or 0.0)
        return NodeCost(**sums, has_flop_formula=self.has_flop_formula and other.has_flop_formula,
                        flop_rule="sum", measured_time_s=measured, time_source="sum")


ZERO_COST = NodeCost()

_TENSOR_CORE_RULES = (TORCH_RULE, "remat formula: attention")


def _compute_dtype(node: fx.Node) -> Optional[torch.dtype]:
    """The dtype that sets the FLOP rate: the first floating input, else the output's."""
    for arg in node.all_input_nodes:
        for tensor in iter_tensors(node_val(arg)):
            if tensor.dtype.is_floating_point:
                return tensor.dtype
    for tensor in iter_tensors(node_val(node)):
        return tensor.dtype
    return None


def _uses_tensor_cores(node: fx.Node, rule: str) -> bool:
    """fp32 matmuls and convolutions run at the TF32 rate when torch allows it (CUDA profiles only)."""
    if rule not in _TENSOR_CORE_RULES:
        return False
    if "convolution" in op_name(node):
        return bool(torch.backends.cudnn.allow_tf32)
    return torch.get_float32_matmul_precision() != "highest"


def _conv_channels(node: fx.Node) -> int:
    """A convolution's width: the smaller of its weight's input and output channels (0 for other ops)."""
    name = op_name(node)
    position = {"convolution": 1, "convolution_backward": 2}.get(name)
    if position is None or len(node.args) <= position or not isinstance(node.args[position], fx.Node):
        return 0
    weight = node_val(node.args[position])
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2:
        return 0
    return min(concrete_int(weight.shape[0]), concrete_int(weight.shape[1]))


def flop_rate(profile: HardwareProfile, node: fx.Node, rule: str) -> float:
    """FLOP/s for ``node``: its library kernel's measured rate where the profile has one, else the dtype's peak."""
    dtype = _compute_dtype(node)
    library = profile.library_rate(op_name(node), dtype, _conv_channels(node))
    if library is not None:
        return library
    return profile.peak_flops_per_s(dtype, tensor_cores=profile.name != "cpu" and _uses_tensor_cores(node, rule))


def roofline_time_s(profile: HardwareProfile, flops: int, nbytes: int, launches: int,
                    dtype: Optional[torch.dtype] = None, *, tensor_cores: bool = False,
                    working_set_bytes: Optional[int] = None, transcendentals: int = 0,
                    random_values: int = 0, flops_per_s: Optional[float] = None) -> float:
    """max(compute time, memory time) + launch floors; memory at the bandwidth of the working set's level.

    Compute time is FLOPs at the dtype's peak (or at ``flops_per_s``) plus special
    functions and random numbers at their own rates (they share the same execution units).
    """
    rate = flops_per_s if flops_per_s is not None else profile.peak_flops_per_s(dtype, tensor_cores=tensor_cores)
    compute_s = flops / rate
    compute_s += profile.special_ops_s(transcendentals, random_values)
    memory_s = nbytes / profile.bandwidth_for(nbytes if working_set_bytes is None else working_set_bytes)
    return max(compute_s, memory_s) + launches * profile.kernel_launch_s


def estimate_node_cost(node: fx.Node, profile: HardwareProfile) -> NodeCost:
    """The cost of running ``node`` once, as its own kernel, on ``profile``; zero for free nodes."""
    if is_free_op(node) or node.target is operator.getitem:
        return NodeCost(flop_rule="free", time_source="roofline")
    estimate = node_flops(node)
    transcendentals, random_values = node_special_ops(node)
    bytes_written = value_nbytes(node_val(node))
    bytes_read = sum(touched_nbytes(t) for arg in node.all_input_nodes for t in iter_tensors(node_val(arg)))
    dtype = _compute_dtype(node)
    time_s = roofline_time_s(profile, estimate.flops, bytes_read + bytes_written, 1, dtype,
                             transcendentals=transcendentals, random_values=random_values,
                             flops_per_s=flop_rate(profile, node, estimate.rule))
    time_s = max(time_s, eager_time_s(profile.eager_classes, node)) if profile.eager_classes else time_s
    return NodeCost(
        flops=estimate.flops, bytes_read=bytes_read, bytes_written=bytes_written, est_time_s=time_s,
        has_flop_formula=estimate.has_formula, flop_rule=estimate.rule,
        fused_bytes_read=bytes_read, fused_bytes_written=bytes_written, launches=1,
        unfused_time_s=time_s, time_source="roofline", transcendentals=transcendentals, random_values=random_values,
    )


def _fused_costs(graph: fx.Graph, base: Mapping[str, NodeCost], groups: FusionGroups,
                 profile: HardwareProfile) -> dict[str, NodeCost]:
    """Costs of the kernel nodes once fused: one roofline per fused kernel, shared among its nodes.

    A kernel's time is ``max(sum of compute, sum of memory time) + one launch``
    (on a CPU, a generated loop's is their sum). A loop node's compute includes
    what the generated loop pays beyond the roofline (``loop_extra_s``), its memory
    the values a kernel split by a reduction loads again (``split_kernel_loads``). Each node
    gets the part in proportion to its own ``max(compute, memory)``, so the nodes
    of a kernel add up to exactly the kernel's time.
    """
    nodes = {n.name: n for n in graph.nodes}
    split_loads = split_kernel_loads(graph, groups)
    extras = loop_extra_s(graph, groups, profile, split_loads)
    rereads = {name: sum(tensor_nbytes(t) for value in loaded for t in iter_tensors(node_val(nodes[value])))
               for name, loaded in split_loads.items()}
    # a kernel of a compiled graph is a call from Inductor's wrapper: its measured cost where the profile has one
    launch_s = profile.loop_costs_s.get("kernel_call", profile.kernel_launch_s)
    compute: dict[str, float] = {}
    nbytes: dict[str, int] = {}
    for name, gid in groups.group_of.items():
        node, cost = nodes[name], base[name]
        rate = flop_rate(profile, node, cost.flop_rule)
        compute[name] = (cost.flops / rate + profile.special_ops_s(cost.transcendentals, cost.random_values)
                         + extras.get(name, 0.0))
        nbytes[name] = groups.bytes_read[name] + groups.bytes_written[name] + rereads.get(name, 0)
    group_compute: dict[str, float] = {}
    group_bytes: dict[str, int] = {}
    for name, gid in groups.group_of.items():
        group_compute[gid] = group_compute.get(gid, 0.0) + compute[name]
        group_bytes[gid] = group_bytes.get(gid, 0) + nbytes[name]
    own = {name: max(compute[name], nbytes[name] / profile.bandwidth_for(group_bytes[gid]))
           for name, gid in groups.group_of.items()}
    own_total: dict[str, float] = {}
    for name, gid in groups.group_of.items():
        own_total[gid] = own_total.get(gid, 0.0) + own[name]
    fused: dict[str, NodeCost] = {}
    for name, gid in groups.group_of.items():
        memory_s = group_bytes[gid] / profile.bandwidth_for(group_bytes[gid])
        if profile.name == "cpu" and is_loop_op(nodes[name]):
            # one core runs a generated loop's loads and arithmetic from one instruction stream: they add up
            # (batch norm's kernels, forward and backward, measure within 5% of the sum and 30-40% above the max)
            kernel_s = group_compute[gid] + memory_s
        else:
            kernel_s = max(group_compute[gid], memory_s)
        share = own[name] / own_total[gid] if own_total[gid] > 0 else 1.0 / len(groups.members[gid])
        launches = groups.launches[name]
        cost = base[name]
        fused[name] = NodeCost(
            flops=cost.flops, bytes_read=cost.bytes_read, bytes_written=cost.bytes_written,
            est_time_s=kernel_s * share + launches * launch_s,
            has_flop_formula=cost.has_flop_formula, flop_rule=cost.flop_rule,
            fused_bytes_read=groups.bytes_read[name] + rereads.get(name, 0),
            fused_bytes_written=groups.bytes_written[name],
            launches=launches, unfused_time_s=cost.unfused_time_s, time_source="roofline (fused)", fusion_group=gid,
            transcendentals=cost.transcendentals, random_values=cost.random_values,
            loop_extra_s=extras.get(name, 0.0),
        )
    return fused


def _calibrated(node: fx.Node, cost: NodeCost, measured_s: float) -> NodeCost:
    """The measured time for a library call or an op run alone; a node fused into a generated loop
    keeps its estimate (see the module docstring)."""
    fields_now = {f.name: getattr(cost, f.name) for f in fields(cost)}
    fields_now.update(measured_time_s=measured_s)
    if not (is_loop_op(node) and cost.fusion_group):
        fields_now.update(est_time_s=measured_s, time_source="measured")
    return NodeCost(**fields_now)


def annotate_costs(graph: fx.Graph, profile: HardwareProfile, *, fusion: bool = True,
                   measured_times: Optional[Mapping[str, float]] = None) -> dict[str, NodeCost]:
    """Write ``node.meta[COST_KEY]`` on every node; return the costs by node name.

    ``fusion=False`` charges every op as its own kernel (eager). ``measured_times``
    (node name -> seconds, from ``calibrate.measure_node_times``) replaces the
    estimate of every library call it has a time for (of every op with ``fusion=False``), and is
    recorded on every node.
    """
    base = {node.name: estimate_node_cost(node, profile) for node in graph.nodes}
    fused = _fused_costs(graph, base, find_fusion_groups(graph), profile) if fusion else {}
    costs: dict[str, NodeCost] = {}
    for node in graph.nodes:
        cost = fused.get(node.name, base[node.name])
        if measured_times is not None and node.name in measured_times and not is_free_op(node):
            cost = _calibrated(node, cost, float(measured_times[node.name]))
        node.meta[COST_KEY] = cost
        costs[node.name] = cost
    return costs


def graph_call_s(graph: fx.Graph, profile: HardwareProfile) -> dict[str, float]:
    """Per phase, what calling its compiled graph costs beyond its kernels (``loop_costs.py``):
    one ``graph_call`` plus ``graph_input`` per input. The forward's inputs are the joint
    graph's forward placeholders; the backward's are its tangents and the forward values
    it reads (what the default partition saves). Zeros when the profile did not measure them."""
    per_call, per_input = profile.loop_costs_s.get("graph_call", 0.0), profile.loop_costs_s.get("graph_input", 0.0)
    phases = node_phases(graph)
    inputs = {"forward": 0, "backward": 0}
    for node in graph.nodes:
        if node.op == "placeholder":
            inputs[phases[node.name]] += 1
        if phases[node.name] == "forward" and node.op != "output" and not is_free_op(node) \
                and any(phases[user.name] == "backward" and user.op != "output" for user in node.users):
            inputs["backward"] += 1   # a forward value (a parameter, an activation) the backward reads
    return {phase: per_call + per_input * count for phase, count in inputs.items()}


def phase_totals(graph: fx.Graph, costs: Mapping[str, NodeCost], *,
                 per_graph_s: Optional[Mapping[str, float]] = None) -> dict[str, NodeCost]:
    """The summed cost of the forward and of the backward part of a joint graph.

    ``per_graph_s`` (phase -> seconds; ``graph_call_s`` for fused costs) is added once
    to each phase with a kernel: the forward and the backward are each one compiled
    graph, whose call costs that much beyond its kernels. It belongs to no node (it is
    paid once per call, never recomputed), so it is only in these totals.
    """
    totals = {"forward": ZERO_COST, "backward": ZERO_COST}
    has_kernel = {"forward": False, "backward": False}
    for name, phase in node_phases(graph).items():
        if name in costs:
            totals[phase] = totals[phase] + costs[name]
            has_kernel[phase] = has_kernel[phase] or costs[name].launches > 0
    for phase, seconds in (per_graph_s or {}).items():
        if has_kernel[phase] and seconds:
            totals[phase] = totals[phase] + NodeCost(est_time_s=seconds, time_source="graph call")
    return totals


__all__ = [
    "COST_KEY", "ZERO_COST", "NodeCost", "annotate_costs", "estimate_node_cost", "flop_rate", "graph_call_s",
    "phase_totals", "roofline_time_s",
]
