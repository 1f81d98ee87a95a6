"""What the kernel model needs of each node of a joint graph, whatever the partition.

``kernel_kind`` says how Inductor lowers a node (a loop it may inline, a reduction, a library
call, a scatter, a view); ``KernelFacts`` holds, per graph, each node's kind, CPU layout and
buffers, worked out once when the graph is first simulated and kept in its ``GraphAnalysis``
(``kernel_facts_of``). ``kernel_steps`` builds the simulator's steps from them.

Storage ids are those of ``NodeFacts.allocs``; the simulator suffixes a recomputation's with
its instance (``RECOMPUTE_SUFFIX``), a channels-last copy's and a copied reshape's with
``CHANNELS_LAST_SUFFIX`` and ``COPY_SUFFIX``; ``storage_owner`` reads the node back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .._torch_inductor import InductorConfig, inductor_config
from ..cost_model.inductor_rules import (ALWAYS_STORED_LOOPS, CPU_CONCAT_OPS, HEAVY_OPS, LOOP_OPS, LOOP_SCATTER_OPS,
                                         MUTATIONS, SCATTER_OPS)
from ..passes.joint_graph import JointGraphFacts, NodeFacts
from .kernel_lowering import ALIAS, EXTERN, POINTWISE, REDUCTION, SCATTER
from .returned_views import view_copies


RECOMPUTE_SUFFIX = "@r"          # followed by the instance number: "@r0", "@r1", ...
CHANNELS_LAST_SUFFIX = "#cl"
COPY_SUFFIX = "#copy"
CHANNELS_LAST = "channels_last"
_RESHAPES = frozenset({"view", "_unsafe_view", "reshape"})


def storage_owner(sid: str) -> str:
    """The node whose value a storage id belongs to: ``mm_3#1@r2`` -> ``mm_3``."""
    return sid.split("#")[0].split(RECOMPUTE_SUFFIX)[0]


def op_short_name(node: NodeFacts) -> str:
    parts = node.op.split(".")
    return parts[1] if len(parts) >= 3 else node.op


def unrolled_reduction_elements(facts: JointGraphFacts, name: str, unroll_below: int) -> int:
    """How many elements each output element of reduction ``name`` reduces when Inductor lowers it
    as a pointwise loop that unrolls them (else 0).

    ``ir.Reduction.create`` (torch 2.13) returns a ``Pointwise`` for a reduction over one element,
    or over fewer than ``unroll_below`` (``config.unroll_reductions_threshold``) whose result has
    more than one element on a CPU (any result on a GPU): a sum over a batch of 4, a bias gradient
    over 2 rows. Its readers then inline it like any pointwise value, so what it reads stays alive
    until they run. Single-output reductions only: a tuple (``var_mean``, ``max.dim``) is counted as
    stored."""
    node = facts.nodes[name]
    if not node.fusible_consumer or node.inlinable or node.is_view or node.is_getitem or node.is_multi_output \
            or not node.inputs or node.numel <= 0:
        return 0
    source = facts.nodes[node.inputs[0]]
    if not source.is_tensor or source.numel % node.numel:
        return 0
    elements = source.numel // node.numel
    if elements <= 1:
        return 1
    if elements < unroll_below and (node.numel != 1 or node.device not in ("", "cpu")):
        return elements
    return 0


def kernel_kind(facts: JointGraphFacts, name: str, *, unroll_below: int) -> str:
    """How Inductor lowers the node: a loop it may inline, a reduction, an extern call, a scatter, or a view.
    ``unroll_below``: ``InductorConfig.unroll_reductions_threshold`` (``unrolled_reduction_elements``)."""
    node = facts.nodes[name]
    if not node.is_tensor or node.op == "placeholder":
        return ALIAS
    if node.is_getitem:
        source = facts.nodes[node.inputs[0]]
        if not source.is_multi_output:
            return ALIAS
        # an output of a multi-output call (Inductor's MultiOutput), one buffer of a multi-output loop, or
        # one view of a view op's tuple (split, unbind: ``lowering.split`` makes slices, no buffer)
        kind = kernel_kind(facts, source.name, unroll_below=unroll_below)
        return EXTERN if kind in (EXTERN, SCATTER) else ALIAS if kind == ALIAS else REDUCTION
    if node.is_view:
        return ALIAS
    short = op_short_name(node)
    if short in SCATTER_OPS:
        return SCATTER
    if short in ALWAYS_STORED_LOOPS:
        return REDUCTION
    if node.inlinable or short in LOOP_OPS or short in MUTATIONS:
        return POINTWISE
    if node.fusible_consumer:
        return POINTWISE if unrolled_reduction_elements(facts, name, unroll_below) else REDUCTION
    return EXTERN


@dataclass(frozen=True)
class _Static:
    """What the kernel model needs of a node, whatever the partition."""

    kind: str
    inputs: tuple[str, ...]               # tensor inputs
    allocs: tuple[tuple[str, int], ...]   # what its buffer allocates (none for a call's outputs, mutations)
    nbytes: int
    numel: int
    loop_numel: int
    heavy: bool
    mutation: bool
    inner_reduction: bool
    layout: str                           # "channels_last" when Inductor lays it out so, else ""
    concat: bool = False                  # a cat on CPU: Inductor's ConcatKernel (``CPU_CONCAT_OPS``)
    seeded: bool = False                  # its op is tagged ``nondeterministic_seeded`` (``_seeded``)
    unrolled: int = 0                     # a reduction lowered as a pointwise loop over this many elements
    loop_scatter: bool = False            # a scatter Inductor lowers as a loop (``LOOP_SCATTER_OPS``), not a fallback


def _static_of(facts: JointGraphFacts, name: str, kinds: Mapping[str, str], layouts: Mapping[str, str],
               storage_bytes: Mapping[str, int], unroll_below: int, scatters_fall_back: bool = False) -> _Static:
    node = facts.nodes[name]
    kind = kinds[name]
    short = op_short_name(node)
    allocs = node.allocs
    loop = node.numel
    inner = node.inner_reduction
    if short in MUTATIONS or (node.is_multi_output and kind in (POINTWISE, REDUCTION)):
        allocs = ()   # a multi-output loop's buffers are allocated by its getitems
    elif node.is_getitem:
        parent = facts.nodes[node.inputs[0]]
        index = node.getitem_index
        allocs = ()
        if kind == REDUCTION and index is not None and index < len(parent.allocs):
            allocs = (parent.allocs[index],)
            inner = parent.inner_reduction
            loop = max((facts.nodes[i].numel for i in parent.inputs), default=parent.numel)
    if kind == REDUCTION and node.inputs and not node.is_getitem:
        loop = max((facts.nodes[i].numel for i in node.inputs), default=node.numel)
    if node.is_view and kind == POINTWISE:   # a reshape Inductor must copy (see _layouts)
        allocs = ((name + COPY_SUFFIX, sum(storage_bytes.get(s, 0) for s in node.value_storages)),)
    return _Static(
        kind=kind,
        inputs=tuple(i for i in node.inputs if facts.nodes[i].is_tensor),
        allocs=allocs,
        numel=node.numel,
        nbytes=sum(n for _, n in allocs),
        loop_numel=loop,
        heavy=short in HEAVY_OPS,
        mutation=short in MUTATIONS,
        inner_reduction=inner,
        layout=layouts.get(name, ""),
        concat=kind == POINTWISE and short in CPU_CONCAT_OPS and node.device == "cpu",
        seeded=_seeded(node.op),
        unrolled=unrolled_reduction_elements(facts, name, unroll_below) if kind == POINTWISE else 0,
        loop_scatter=kind == SCATTER and short in LOOP_SCATTER_OPS and not scatters_fall_back,
    )


def has_op_tag(op: str, tag: "torch.Tag") -> bool:
    """Whether the ATen/prims op named ``op`` (``"aten.native_dropout.default"``) carries ``tag``;
    False for anything that is not an op overload (a placeholder, ``getitem``)."""
    parts = op.split(".")
    if len(parts) != 3:
        return False
    try:
        overload = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        return False
    return tag in getattr(overload, "tags", ())


def _seeded(op: str) -> bool:
    """Whether ``op`` is tagged ``nondeterministic_seeded``: the tag Inductor chains random ops by
    under ``fallback_random``."""
    return has_op_tag(op, torch.Tag.nondeterministic_seeded)


def _viewable_in_channels_last(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a channels-last tensor of 4-d ``shape`` can be viewed as ``target`` (ATen's computeStride)."""
    n, c, h, w = shape
    strides = (c * h * w, 1, w * c, c)
    if n * c * h * w == 0:
        return True
    view_d = len(target) - 1
    chunk_base_stride = strides[-1]
    tensor_numel = view_numel = 1
    for tensor_d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[tensor_d]
        if tensor_d == 0 or (shape[tensor_d - 1] != 1 and strides[tensor_d - 1] != tensor_numel * chunk_base_stride):
            while view_d >= 0 and (view_numel < tensor_numel or target[view_d] == 1):
                view_numel *= target[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return False
            if tensor_d > 0:
                chunk_base_stride = strides[tensor_d - 1]
                tensor_numel = view_numel = 1
    return view_d == -1


def _layouts(facts: JointGraphFacts, kinds: dict[str, str]) -> dict[str, str]:
    """Values Inductor lays out channels-last, on a CPU graph with convolutions.

    Its layout optimization makes convolution inputs, outputs and input gradients
    channels-last, and loops over a 4-d value follow a channels-last input of their
    shape. A reshape of such a value that no strides can express is no view: an
    extern reading it gets a copy, so the reshape becomes a loop (``kinds`` is updated).
    """
    if not any(op_short_name(facts.nodes[n]) == "convolution" and facts.nodes[n].device == "cpu" for n in facts.order):
        return {}
    layout: dict[str, str] = {}
    for name in facts.order:
        node = facts.nodes[name]
        short = op_short_name(node)
        if short == "convolution":
            layout[name] = CHANNELS_LAST
            for source in node.inputs[:2]:
                if facts.nodes[source].role == "primal" and len(facts.nodes[source].shape) == 4:
                    layout[source] = CHANNELS_LAST
            continue
        if len(node.shape) != 4 or not node.inputs:
            if node.is_view and node.inputs and layout.get(node.inputs[0]) and short in _RESHAPES \
                    and not _viewable_in_channels_last(facts.nodes[node.inputs[0]].shape, node.shape):
                kinds[name] = POINTWISE
            continue
        if node.is_getitem:
            parent = facts.nodes[node.inputs[0]]
            if op_short_name(parent) == "convolution_backward" and node.getitem_index == 0:
                layout[name] = CHANNELS_LAST
            elif kinds[parent.name] in (POINTWISE, REDUCTION) and any(layout.get(i) for i in parent.inputs):
                layout[name] = CHANNELS_LAST
        elif node.is_view:
            if layout.get(node.inputs[0]) and facts.nodes[node.inputs[0]].shape == node.shape:
                layout[name] = CHANNELS_LAST
        elif kinds[name] in (POINTWISE, REDUCTION):
            if any(layout.get(i) and facts.nodes[i].shape == node.shape for i in node.inputs):
                layout[name] = CHANNELS_LAST
    return layout


class KernelFacts:
    """Per-joint-graph constants, computed once: the planner simulates one graph many times."""

    def __init__(self, facts: JointGraphFacts) -> None:
        self.inductor = inductor_config()      # read once per graph, when it is first simulated
        unroll_below = self.inductor.unroll_reductions_threshold
        kinds = {name: kernel_kind(facts, name, unroll_below=unroll_below) for name in facts.order}
        self.storage_bytes = {sid: n for node in facts.nodes.values() for sid, n in node.allocs}
        self.layouts = _layouts(facts, kinds)
        self.static = {name: _static_of(facts, name, kinds, self.layouts, self.storage_bytes, unroll_below,
                                        self.inductor.deterministic_algorithms) for name in facts.order}
        # views Inductor copies when the forward returns them (``returned_views``): view -> (its base, bytes)
        base_of = {name: storage_owner(node.value_storages[0]) for name, node in facts.nodes.items()
                   if node.is_view and len(node.value_storages) == 1}
        self.view_copies = view_copies(facts, kinds, self.layouts, base_of)
        for name, (_, nbytes) in self.view_copies.items():
            self.storage_bytes[name + COPY_SUFFIX] = nbytes
        # storages a step allocates (a primal's or a tangent's is there before the step starts)
        self.owned = frozenset([sid for node in facts.nodes.values() if node.role in ("forward", "backward")
                                for sid, _ in node.allocs] + [name + COPY_SUFFIX for name in self.view_copies])
        self.tangent_allocs = tuple(alloc for name in facts.order if facts.nodes[name].role == "tangent"
                                    for alloc in facts.nodes[name].allocs)
        # Inductor takes a graph input as aligned only on a GPU (``utils.should_assume_input_aligned``)
        self.inputs_aligned = any(node.device not in ("", "cpu") for node in facts.nodes.values())


def kernel_kinds(facts: JointGraphFacts) -> Mapping[str, str]:
    """``kernel_kind`` of every node of the graph (with CPU layout copies), worked out once per graph."""
    return {name: info.kind for name, info in kernel_facts_of(facts).static.items()}


def graph_inputs_aligned(facts: JointGraphFacts) -> bool:
    """Whether Inductor counts this graph's inputs as aligned for buffer reuse (on a GPU)."""
    return kernel_facts_of(facts).inputs_aligned


def graph_inductor_config(facts: JointGraphFacts) -> InductorConfig:
    """Inductor's config as this graph's simulation reads it: read when the graph is first simulated."""
    return kernel_facts_of(facts).inductor


def kernel_facts_of(facts: JointGraphFacts) -> KernelFacts:
    """This graph's ``KernelFacts``, made when the graph is first simulated and kept in its
    ``GraphAnalysis``."""
    analysis = facts.analysis
    if analysis.kernel_facts is None:
        analysis.kernel_facts = KernelFacts(facts)
    return analysis.kernel_facts
