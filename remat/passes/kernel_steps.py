"""The simulator's steps for a partition: the forward and backward graphs as Inductor runs them.

``kernel_steps`` describes each compiled graph (the forward; the backward with
its recompute regions where ``schedule.backward_order`` puts them) as plain
``GraphOp`` records, lets ``cost_model.kernel_schedule`` decide which values get
a buffer and how they group into kernel calls, and emits one ``Step`` per node
in kernel order. A kernel call's allocations, reads and phantom buffers sit on
its last node's step (the wrapper allocates every output before the call and
frees inputs after it); its other nodes, and values computed inside kernels,
are steps that allocate and read nothing.

Storage ids are those of ``NodeFacts.allocs``; a recomputation's are suffixed
with its instance's suffix (``@r0``, ``@r1``, ...: a value the backward recomputes
twice holds two storages, each freed after its own last reader). A value without a
buffer of its own (a view, an inlined or removed loop value) refers to the
storages it is made of.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..cost_model.kernel_schedule import ALIAS, EXTERN, POINTWISE, REDUCTION, SCATTER, GraphOp, schedule_kernels
from .._torch_inductor import InductorConfig, inductor_config
from ..cost_model.inductor_rules import ALWAYS_STORED_LOOPS, HEAVY_OPS, LOOP_OPS, MUTATIONS, SCATTER_OPS
from ..cost_model.memory import Step
from .joint_graph import JointGraphFacts, NodeFacts
from .partition import Partition, Scheduled


RECOMPUTE_SUFFIX = "@r"          # followed by the instance number: "@r0", "@r1", ...
CHANNELS_LAST_SUFFIX = "#cl"
COPY_SUFFIX = "#copy"
CHANNELS_LAST = "channels_last"
FORWARD_RETURNS = "<forward returns>"   # the marker step where the forward hands its outputs to the caller
_RESHAPES = frozenset({"view", "_unsafe_view", "reshape"})
_CALLS = (EXTERN, SCATTER)


def storage_owner(sid: str) -> str:
    """The node whose value a storage id belongs to: ``mm_3#1@r2`` -> ``mm_3``."""
    return sid.split("#")[0].split(RECOMPUTE_SUFFIX)[0]


def op_short_name(node: NodeFacts) -> str:
    parts = node.op.split(".")
    return parts[1] if len(parts) >= 3 else node.op


def kernel_kind(facts: JointGraphFacts, name: str) -> str:
    """How Inductor lowers the node: a loop it may inline, a reduction, an extern call, a scatter, or a view."""
    node = facts.nodes[name]
    if not node.is_tensor or node.op == "placeholder":
        return ALIAS
    if node.is_getitem:
        source = facts.nodes[node.inputs[0]]
        if not source.is_multi_output:
            return ALIAS
        # an output of a multi-output call (Inductor's MultiOutput), or one buffer of a multi-output loop
        return EXTERN if kernel_kind(facts, source.name) in (EXTERN, SCATTER) else REDUCTION
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
        return REDUCTION
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


def _static_of(facts: JointGraphFacts, name: str, kinds: Mapping[str, str], layouts: Mapping[str, str],
               storage_bytes: Mapping[str, int]) -> _Static:
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
    )


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


class _FactsCache:
    """Per-joint-graph constants, computed once: the planner simulates one graph many times."""

    def __init__(self, facts: JointGraphFacts) -> None:
        self.inductor = inductor_config()      # read once per graph, when it is first simulated
        kinds: dict[str, str] = {}
        for name in facts.order:
            kinds[name] = kernel_kind(facts, name)
        self.storage_bytes = {sid: n for node in facts.nodes.values() for sid, n in node.allocs}
        self.layouts = _layouts(facts, kinds)
        self.static = {name: _static_of(facts, name, kinds, self.layouts, self.storage_bytes) for name in facts.order}
        # storages a step allocates (a primal's or a tangent's is there before the step starts)
        self.owned = frozenset(sid for node in facts.nodes.values() if node.role in ("forward", "backward")
                               for sid, _ in node.allocs)
        self.tangent_allocs = tuple(alloc for name in facts.order if facts.nodes[name].role == "tangent"
                                    for alloc in facts.nodes[name].allocs)


def kernel_kinds(facts: JointGraphFacts) -> Mapping[str, str]:
    """``kernel_kind`` of every node of the graph (with CPU layout copies), worked out once per graph."""
    return {name: info.kind for name, info in _cache(facts).static.items()}


def graph_inductor_config(facts: JointGraphFacts) -> InductorConfig:
    """Inductor's config as this graph's simulation reads it: read when the graph is first simulated."""
    return _cache(facts).inductor


def _cache(facts: JointGraphFacts) -> _FactsCache:
    """This graph's ``_FactsCache``, made when the graph is first simulated and kept in its
    ``GraphAnalysis``."""
    analysis = facts.analysis
    if analysis.kernel_facts is None:
        analysis.kernel_facts = _FactsCache(facts)
    return analysis.kernel_facts


class _Graph:
    """One compiled graph: its ops, and the storages each instance's value refers to.

    An instance is one copy of a node in the graph; ``reads`` says, per instance, which
    instance it reads for an input that has several (a recomputed value). Any other input
    is read under its node name: an instance named like its node, or a graph input.
    """

    def __init__(self, facts: JointGraphFacts, cache: _FactsCache, instances: Sequence[tuple[str, str]],
                 outputs: set[str], outer_storages: Callable[[str], tuple[str, ...]], donated: frozenset[str],
                 reads: Mapping[str, Mapping[str, str]] | None = None,
                 estimated_inputs: frozenset[str] = frozenset()) -> None:
        self.facts = facts
        self.estimated_inputs = estimated_inputs         # inputs only Inductor's estimate holds (see steps)
        self.cache = cache
        self.instances = list(instances)                 # (node name, instance name), in graph order
        self.node_of = {i: n for n, i in self.instances}
        self.reads = reads or {}
        self.outputs = outputs                           # instance names
        self.outer = outer_storages                      # graph input (node name) -> its storages
        self.donated = donated
        self.inputs_of = {inst: tuple(self.input_instance(inst, i) for i in cache.static[name].inputs)
                          for name, inst in self.instances}

    def input_instance(self, inst: str, input_name: str) -> str:
        """The instance (or graph input) that instance ``inst`` reads for its input node ``input_name``."""
        return self.reads.get(inst, {}).get(input_name, input_name)

    def ops(self) -> list[GraphOp]:
        static, node_of, outputs = self.cache.static, self.node_of, self.outputs
        readers: dict[str, list[str]] = {}
        for _, inst in self.instances:
            for i in self.inputs_of[inst]:
                if i in node_of:
                    readers.setdefault(i, []).append(node_of[inst])
        ops = []
        for name, inst in self.instances:
            info = static[name]
            mine = readers.get(inst, ())
            output = inst in outputs
            ops.append(GraphOp(
                inst, info.kind, self.inputs_of[inst], info.nbytes, info.numel,
                info.loop_numel, info.heavy, len(mine) + output, info.mutation or output,
                any(static[u].kind in _CALLS for u in mine), info.inner_reduction, info.layout,
            ))
        return ops

    def input_bytes(self) -> dict[str, int]:
        """Bytes behind each graph input (what a kernel reading it shares with another)."""
        sizes: dict[str, int] = {}
        storage_bytes = self.cache.storage_bytes
        for _, inst in self.instances:
            for i in self.inputs_of[inst]:
                if i not in self.node_of and i not in sizes:
                    sizes[i] = sum(storage_bytes.get(s, 0) for s in self.outer(i))
        return sizes

    def storages_of(self, name: str, stands_for: Mapping[str, tuple[str, ...]], memo: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
        """Storages of an instance or graph input."""
        found = memo.get(name)
        if found is not None:
            return found
        node_name = self.node_of.get(name)
        if node_name is None:
            found = self.outer(name)
        else:
            node = self.facts.nodes[node_name]
            if node.is_getitem and (name in stands_for or self.cache.static[node_name].kind == EXTERN):
                source = self.storages_of(self.input_instance(name, node.inputs[0]), stands_for, memo)
                index = node.getitem_index
                found = (source[index],) if len(source) > 1 and index is not None and index < len(source) else source
            elif name in stands_for:
                found = tuple(dict.fromkeys(s for m in stands_for[name] for s in self.storages_of(m, stands_for, memo)))
            else:
                mine = name[len(node_name):]          # the instance's suffix, "" for a node's only copy
                found = tuple(sid + mine for sid, _ in self.cache.static[node_name].allocs)
                if not found and node.is_multi_output:
                    found = tuple(sid + mine for sid, _ in node.allocs)
        memo[name] = found
        return found

    def steps(self, phase: str, regions: Mapping[str, int]) -> tuple[list[Step], Callable[[str], tuple[str, ...]]]:
        """Steps in kernel order, and the storages of an instance or input, by name."""
        layouts = self.cache.layouts
        schedule = schedule_kernels(self.ops(), self.input_bytes(), self.donated, layouts, self.cache.inductor)
        stands_for = schedule.stands_for
        memo: dict[str, tuple[str, ...]] = {}

        def of(name: str) -> tuple[str, ...]:
            return self.storages_of(name, stands_for, memo)

        static, node_of = self.cache.static, self.node_of
        by_kernel: dict[int, list[str]] = {}
        for _, inst in self.instances:
            by_kernel.setdefault(schedule.first_kernel.get(inst, len(schedule.kernels)), []).append(inst)
        # (instance, allocs, uses, phantom bytes, inplace, pooled) per step; Steps are made once the
        # estimated inputs' bytes are known (remaking each Step with dataclasses.replace cost 9%)
        rows: list[tuple[str, tuple, tuple, int, tuple, bool]] = []
        kernel_rows: list[int] = []          # the row of each kernel's call (its last op)
        for k, kernel in enumerate(schedule.kernels):
            in_kernel = set(kernel.ops)
            for inst in by_kernel.get(k, ()):   # values computed inside this kernel, views of it
                if inst not in in_kernel:
                    rows.append((inst, (), (), 0, (), True))
            for inst in kernel.ops[:-1]:
                rows.append((inst, (), (), 0, (), True))
            allocs = tuple(
                (sid, nbytes) for b in kernel.buffers
                for sid, (_, nbytes) in zip(of(b), static[node_of[b]].allocs)
            )
            uses = tuple(dict.fromkeys(s for name in kernel.loads for s in of(name)))
            phantom = sum(static[node_of[p]].nbytes for p in kernel.phantoms)
            inplace = tuple((mine, theirs) for op, source in kernel.inplace for mine, theirs in zip(of(op), of(source)))
            kernel_rows.append(len(rows))
            rows.append((kernel.ops[-1], allocs, uses, phantom, inplace, not (kernel.extern and len(allocs) > 1)))
        for inst in by_kernel.get(len(schedule.kernels), ()):   # never computed or read by a kernel
            rows.append((inst, (), (), 0, (), True))
        extra = self._estimated_input_bytes(schedule.kernels, kernel_rows, len(rows))
        steps = [Step(inst, phase, allocs, uses, regions.get(inst, -1), phantom_bytes=phantom + more,
                      inplace=inplace, pooled=pooled)
                 for (inst, allocs, uses, phantom, inplace, pooled), more in zip(rows, extra)]
        return steps, of

    def _estimated_input_bytes(self, kernels: Sequence, kernel_rows: Sequence[int], count: int) -> list[int]:
        """Per step, the bytes of graph inputs Inductor's own peak estimate counts but the window
        does not hold (``estimated_inputs``: saved values whose storage is a parameter's, e.g. a
        transposed weight), added to the step's ``phantom_bytes``.
        ``torch._inductor.memory.get_freeable_input_buf`` counts every input not named
        ``primals_*``/``tangents_*`` as memory live from the graph's start to its last reader;
        that estimate gates buffer reuse (``memory.simulate_memory``). ``kernel_rows``: the step
        of each kernel's call."""
        if not self.estimated_inputs:
            return [0] * count
        facts = self.facts
        last: dict[str, int] = {}
        for kernel, index in zip(kernels, kernel_rows):
            for op in kernel.ops:
                for name in self.inputs_of.get(op, ()):
                    if name in self.estimated_inputs:
                        last[name] = index
        ending = [0] * count          # bytes whose last reader is at each step
        for name, end in last.items():
            ending[end] += facts.nodes[name].numel * facts.nodes[name].itemsize
        extra, held = [0] * count, sum(ending)
        for i, gone in enumerate(ending):
            extra[i] = held
            held -= gone
        return extra


def channels_last_copies(facts: JointGraphFacts, fw_order: Sequence[str]) -> dict[str, tuple[str, int]]:
    """Inputs of the forward that Inductor copies to channels-last before it starts, with
    the storage and bytes of each copy.

    Inductor's layout optimization (``GraphLowering.decide_layout_opt``) is on for any CPU
    graph with a convolution (mkldnn): it converts every convolution's weight and graph-input
    activation up front, in one kernel, and hands the converted copy (not the parameter) to
    the backward when the backward reads it. On CUDA it depends on heuristics not modelled here.
    """
    copies: dict[str, tuple[str, int]] = {}
    for name in fw_order:
        node = facts.nodes[name]
        if node.device != "cpu" or op_short_name(node) != "convolution":
            continue
        for source in node.inputs[:2]:
            primal = facts.nodes[source]
            if primal.role == "primal" and primal.allocs and source not in copies:
                copies[source] = (source + CHANNELS_LAST_SUFFIX, primal.alloc_bytes)
    return copies


@dataclass(frozen=True)
class ForwardSteps:
    """The forward graph's steps for one partition, and what the backward's steps need of it."""

    steps: list[Step]
    storages: Callable[[str], tuple[str, ...]]    # a forward value's storages, by name
    copies: dict[str, tuple[str, int]]            # channels_last_copies
    fw_order: tuple[str, ...]
    returned: tuple[str, ...]                     # the storages of the forward's outputs, in output order


def forward_steps(facts: JointGraphFacts, partition: Partition, fw_order: Sequence[str]) -> ForwardSteps:
    """The forward's part of ``kernel_steps``: it depends on the partition and ``fw_order`` only,
    so one serves every backward schedule of the partition (``schedule.simulate_partition``)."""
    cache = _cache(facts)
    fw_outputs = set(partition.saved) | set(facts.fwd_outputs)
    copies = channels_last_copies(facts, fw_order)

    def forward_input(name: str) -> tuple[str, ...]:
        return (copies[name][0],) if name in copies else facts.nodes[name].value_storages

    forward = _Graph(facts, cache, [(n, n) for n in fw_order], fw_outputs, forward_input, frozenset())
    fw_steps, fw_storages = forward.steps("forward", {})
    if copies:
        fw_steps.insert(0, Step("<channels_last>", "forward", tuple(copies.values()), ()))
    returned = tuple(dict.fromkeys(s for o in facts.fwd_outputs for s in fw_storages(o)))
    if not facts.outputs_held:
        # the forward returns: its outputs live to here, and past it only while the backward reads them
        fw_steps.append(Step(FORWARD_RETURNS, "forward", (), returned))
    return ForwardSteps(fw_steps, fw_storages, copies, tuple(fw_order), returned)


def kernel_steps(facts: JointGraphFacts, partition: Partition, fw_order: Sequence[str],
                 bw_order: Sequence[Scheduled], forward: ForwardSteps | None = None) -> tuple[list[Step], set[str]]:
    """The forward, then the backward, as simulator steps in Inductor's kernel order; and the pinned storages.

    ``bw_order`` is ``schedule.backward_order``'s: each recomputation is its own instance,
    with its own storages, reading the instances it names. ``forward``: ``forward_steps`` of
    the same partition and ``fw_order``, when the caller has it (the result is the same).
    """
    cache = _cache(facts)
    if forward is None or forward.fw_order != tuple(fw_order):
        forward = forward_steps(facts, partition, fw_order)
    fw_steps, fw_storages, copies = list(forward.steps), forward.storages, forward.copies

    def backward_input(name: str) -> tuple[str, ...]:
        """A saved value, a primal (its channels-last copy if the forward made one), a tangent."""
        node = facts.nodes[name]
        if node.role == "forward":
            return fw_storages(name)
        if name in copies and name in partition.saved_primals:
            return (copies[name][0],)
        return node.value_storages

    output_storages = set(forward.returned)
    # the caller's outputs: alive to the step's end when it holds them, else from the forward's return
    # only while the backward reads them (``FORWARD_RETURNS``)
    pinned_fw = output_storages if facts.outputs_held else set()
    # AOTAutograd donates to the backward every saved tensor whose storage no forward input or
    # output shares (``collect_fw_donated_buffer_idxs``), views of intermediates included; the
    # backward may then overwrite it (``cache.owned``: storages the step allocates; a primal's or
    # a tangent's is there before the step starts).
    # ``param_views``: saved views of what the step did not allocate (a transposed weight), which
    # only Inductor's peak estimate holds (``_Graph._estimated_input_bytes``)
    donated: set[str] = set()
    param_views: set[str] = set()
    for n in partition.saved:
        node = facts.nodes[n]
        is_view = node.is_view and node.is_tensor
        if not (node.allocs or is_view):
            continue
        storages = set(fw_storages(n))
        if is_view and not storages & cache.owned:
            param_views.add(n)
        if storages & output_storages:
            continue
        if node.allocs or (storages and storages <= cache.owned):
            donated.add(n)
    bw_instances = [(s.name, s.instance) for s in bw_order]
    regions = {s.instance: s.region for s in bw_order}
    reads = {s.instance: dict(s.reads) for s in bw_order if s.reads}
    last = {s.name: s.instance for s in bw_order}    # a gradient that is a recomputed value: its last copy
    outputs = {last.get(o, o) for o in facts.bwd_outputs}
    backward = _Graph(facts, cache, bw_instances, outputs, backward_input, frozenset(donated), reads,
                      frozenset(param_views))
    bw_steps, bw_storages = backward.steps("backward", regions)
    steps = fw_steps + [Step("<tangents>", "backward", cache.tangent_allocs, (), external=True)] + bw_steps
    # the incoming gradients live to the backward's end: the autograd engine holds the tangents it
    # passed to AOTAutograd's backward node until the node returns (measured: they are freed after the
    # compiled backward's last allocation, whatever its last reader); but the zeros AOTAutograd makes
    # for an output without a gradient die at their last reader (``joint_graph.tangents_without_gradient``)
    held_tangents = {sid for sid, _ in cache.tangent_allocs if storage_owner(sid) not in facts.gradless_tangents}
    pinned = pinned_fw | held_tangents | {s for o in outputs for s in bw_storages(o)}
    return steps, pinned
