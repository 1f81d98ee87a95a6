"""The simulator's steps for a partition: the forward and backward graphs as Inductor runs them.

``kernel_steps`` describes each compiled graph (the forward; the backward with
its recompute regions where ``schedule.backward_order`` puts them) as plain
``GraphOp`` records, lets ``kernel_schedule`` decide which values get
a buffer and how they group into kernel calls, and emits one ``Step`` per node
in kernel order. A kernel call's allocations, reads and phantom buffers sit on
its last node's step (the wrapper allocates every output before the call and
frees inputs after it); its other nodes, and values computed inside kernels,
are steps that allocate and read nothing.

Storage ids are those of ``NodeFacts.allocs``; a recomputation's are suffixed
with its instance's suffix (``@r0``, ``@r1``, ...: a value the backward recomputes
twice holds two storages, each freed after its own last reader). A value without a
buffer of its own (a view, an inlined or removed loop value) refers to the
storages it is made of (``kernel_facts`` says how storages are named).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from ..passes.joint_graph import JointGraphFacts
from ..passes.partition import Partition, Scheduled
from .addmm_fusion import addmm_fusions, products_kept_apart, without_fused_products
from .kernel_facts import CHANNELS_LAST_SUFFIX, COPY_SUFFIX, KernelFacts, kernel_facts_of, op_short_name
from .kernel_lowering import EXTERN, SCATTER, GraphOp
from .kernel_schedule import schedule_kernels
from .memory_timeline import Step


FORWARD_RETURNS = "<forward returns>"   # the marker step where the forward hands its outputs to the caller
EAGER_LOSS = "<eager loss>"   # the marker step where an eager loss holds ``JointGraphFacts.eager_loss_bytes``
_CALLS = (EXTERN, SCATTER)


class _GraphOps:
    """One compiled graph: its ops, and the storages each instance's value refers to.

    An instance is one copy of a node in the graph; ``reads`` says, per instance, which
    instance it reads for an input that has several (a recomputed value). Any other input
    is read under its node name: an instance named like its node, or a graph input.
    """

    def __init__(self, facts: JointGraphFacts, cache: KernelFacts, instances: Sequence[tuple[str, str]],
                 outputs: set[str], outer_storages: Callable[[str], tuple[str, ...]], donated: frozenset[str],
                 reads: Mapping[str, Mapping[str, str]] | None = None,
                 estimated_inputs: frozenset[str] = frozenset(), copied_views: frozenset[str] = frozenset(),
                 keep_products_apart: bool = False) -> None:
        self.facts = facts
        self.copied_views = copied_views                 # returned views Inductor copies (``returned_views``)
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
        # Inductor's addmm fusion makes such a product and its add one library call, ``addmm(other, a,
        # b)``, where the add runs: the add reads the product's operands and is that call (``addmm_fusion``),
        # unless remat's rewrite keeps the two apart (``keep_products_apart``: the backward's graphs)
        fused = addmm_fusions(facts, self.instances, self.inputs_of, outputs)
        self.kept_apart = (products_kept_apart(facts, self.instances, self.inputs_of, outputs, fused)
                           if keep_products_apart else frozenset())
        self.addmm_of = {add: product for product, (add, _) in fused.items() if add not in self.kept_apart}
        for add, product in self.addmm_of.items():
            other = next(i for i in self.inputs_of[add] if i != product)
            self.inputs_of[add] = (other, *self.inputs_of[product])
        self.instances = without_fused_products(self.instances, self.addmm_of)

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
            call = static[node_of[self.addmm_of[inst]]] if inst in self.addmm_of else info   # an addmm: the mm's kind
            mine = readers.get(inst, ())
            output = inst in outputs
            ops.append(GraphOp(
                inst, call.kind, self.inputs_of[inst], info.nbytes, info.numel,
                call.loop_numel, call.heavy, len(mine) + output, info.mutation or output,
                any(static[u].kind in _CALLS for u in mine), call.inner_reduction, info.layout, info.concat,
                info.seeded, info.unrolled, info.loop_scatter,
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
        if name in self.copied_views:
            found = (name + COPY_SUFFIX,)
        elif node_name is None:
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
        if self.copied_views:   # the forward's (no estimated inputs there: ``kernel_rows`` stay right)
            assert not self.estimated_inputs
            rows = self._with_view_copies(rows, of)
        extra = self._estimated_input_bytes(schedule.kernels, kernel_rows, len(rows))
        # a library call's working memory (``library_scratch``), on top of what is live at its call
        scratch = {kernel.ops[-1]: self.facts.nodes[node_of[kernel.ops[-1]]].scratch_bytes
                   for kernel in schedule.kernels if kernel.extern}
        steps = [Step(inst, phase, allocs, uses, regions.get(inst, -1), phantom_bytes=phantom + more,
                      inplace=inplace, pooled=pooled, scratch_bytes=scratch.get(inst, 0) if allocs or uses else 0)
                 for (inst, allocs, uses, phantom, inplace, pooled), more in zip(rows, extra)]
        return steps, of

    def _with_view_copies(self, rows: list[tuple], of: Callable[[str], tuple[str, ...]]) -> list[tuple]:
        """``rows`` with each copied view's row (``copied_views``) made a copy kernel: it allocates the
        copy and reads the view's base, right after the row that allocates the base (where the view
        was, when the base has no buffer of its own)."""
        position = {row[0]: i for i, row in enumerate(rows)}
        placed = [row for row in rows if row[0] not in self.copied_views]
        for inst in sorted(self.copied_views, key=position.__getitem__):
            name, allocs, uses, phantom, inplace, pooled = rows[position[inst]]
            base = of(self.inputs_of[inst][0])
            copy = (name, allocs + ((inst + COPY_SUFFIX, self.cache.storage_bytes[inst + COPY_SUFFIX]),),
                    uses + base, phantom, inplace, pooled)
            after = max((i for i, row in enumerate(placed) if any(sid in base for sid, _ in row[1])), default=None)
            if after is None:
                after = max((i for i, row in enumerate(placed) if position[row[0]] < position[inst]), default=-1)
            placed.insert(after + 1, copy)
        return placed

    def _estimated_input_bytes(self, kernels: Sequence, kernel_rows: Sequence[int], count: int) -> list[int]:
        """Per step, the bytes of graph inputs Inductor's own peak estimate counts but the window
        does not hold (``estimated_inputs``: saved values whose storage is a parameter's, e.g. a
        transposed weight), added to the step's ``phantom_bytes``.
        ``torch._inductor.memory.get_freeable_input_buf`` counts every input not named
        ``primals_*``/``tangents_*`` as memory live from the graph's start to its last reader;
        that estimate gates buffer reuse (``memory_timeline.simulate_memory``). ``kernel_rows``: the step
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
    cache = kernel_facts_of(facts)
    fw_outputs = set(partition.saved) | set(facts.fwd_outputs)
    copies = channels_last_copies(facts, fw_order)

    def forward_input(name: str) -> tuple[str, ...]:
        return (copies[name][0],) if name in copies else facts.nodes[name].value_storages

    copied = frozenset(v for v in fw_outputs if v in cache.view_copies and cache.view_copies[v][0] not in fw_outputs)
    forward = _GraphOps(facts, cache, [(n, n) for n in fw_order], fw_outputs, forward_input, frozenset(),
                     copied_views=copied)
    fw_steps, fw_storages = forward.steps("forward", {})
    if copies:
        fw_steps.insert(0, Step("<channels_last>", "forward", tuple(copies.values()), ()))
    returned = tuple(dict.fromkeys(s for o in facts.fwd_outputs for s in fw_storages(o)))
    if not facts.outputs_held:
        # the forward returns: its outputs live to here, and past it only while the backward reads them
        fw_steps.append(Step(FORWARD_RETURNS, "forward", (), returned))
    if facts.eager_loss_bytes:
        # an eager loss on the outputs runs before the backward, next to what the forward keeps for it
        fw_steps.append(Step(EAGER_LOSS, "forward", (), (), scratch_bytes=facts.eager_loss_bytes))
    return ForwardSteps(fw_steps, fw_storages, copies, tuple(fw_order), returned)


def kernel_steps(facts: JointGraphFacts, partition: Partition, fw_order: Sequence[str],
                 bw_order: Sequence[Scheduled], forward: ForwardSteps | None = None) -> tuple[list[Step], set[str]]:
    """The forward, then the backward, as simulator steps in Inductor's kernel order; and the pinned storages.

    ``bw_order`` is ``schedule.backward_order``'s: each recomputation is its own instance,
    with its own storages, reading the instances it names. ``forward``: ``forward_steps`` of
    the same partition and ``fw_order``, when the caller has it (the result is the same).
    """
    cache = kernel_facts_of(facts)
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
    # only Inductor's peak estimate holds (``_GraphOps._estimated_input_bytes``)
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
    bw_instances, reads, outputs = _backward_instances(facts, bw_order)
    regions = {s.instance: s.region for s in bw_order}
    backward = _GraphOps(facts, cache, bw_instances, outputs, backward_input, frozenset(donated), reads,
                      frozenset(param_views), keep_products_apart=True)
    bw_steps, bw_storages = backward.steps("backward", regions)
    steps = fw_steps + [Step("<tangents>", "backward", cache.tangent_allocs, (), external=True)] + bw_steps
    # the incoming gradients die at their last reader: the autograd engine hands them to AOTAutograd's
    # backward and keeps none (unless a post-hook is registered on its node: remat registers none,
    # ``_torch_compile._after``; measured on rand-1239: 1,103,880 B, where a post-hook held the logits'
    # gradient to the end, 1,234,952 B)
    pinned = pinned_fw | {s for o in outputs for s in bw_storages(o)}
    return steps, pinned


def _backward_instances(facts: JointGraphFacts, bw_order: Sequence[Scheduled]
                        ) -> tuple[list[tuple[str, str]], dict[str, dict[str, str]], set[str]]:
    """The backward's (node, instance) list, what each instance reads for a recomputed input, and
    the instances it returns (a gradient that is a recomputed value: its last copy)."""
    instances = [(s.name, s.instance) for s in bw_order]
    reads = {s.instance: dict(s.reads) for s in bw_order if s.reads}
    last = {s.name: s.instance for s in bw_order}
    return instances, reads, {last.get(o, o) for o in facts.bwd_outputs}


def adds_kept_apart(facts: JointGraphFacts, bw_order: Sequence[Scheduled]) -> frozenset[str]:
    """The add instances of the backward ``bw_order`` whose matrix product remat keeps apart from
    Inductor's addmm fusion (``addmm_fusion.products_kept_apart``): the same answer ``kernel_steps``
    simulates, for the rewrite to write."""
    instances, reads, outputs = _backward_instances(facts, bw_order)
    graph = _GraphOps(facts, kernel_facts_of(facts), instances, outputs, lambda name: (), frozenset(), reads,
                   keep_products_apart=True)
    return graph.kept_apart
