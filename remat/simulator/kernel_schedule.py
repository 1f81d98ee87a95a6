"""Which buffers Inductor's CPU backend allocates for one compiled graph, and when.

The memory of a compiled graph is decided by Inductor, not by the FX order:
a value gets a buffer only if Inductor *realizes* it, realized values fuse into
kernels, fused kernels run in the scheduler's order, and the C++ wrapper
allocates every output of a kernel call before the call and frees inputs after
it. ``schedule_kernels`` reproduces those decisions on plain records
(``GraphOp``), one graph at a time, following torch 2.13's Inductor:

1. *Realize* (``GraphLowering.run_node``, ``StorageBox.mark_reuse``), in graph
   order. Matmuls, convolutions, attention and other library calls ("extern")
   get a buffer and need realized inputs. Reductions get a buffer. A pointwise
   value is inlined into its readers unless it is a graph output read in the
   graph too, or has several readers and is expensive to recompute (its inlined
   expression calls exp/log/sigmoid/tanh, reads more than ``realize_reads_threshold``
   buffers or has more than ``realize_cpu_opcount_threshold`` ops), or reads more than
   ``realize_cpu_acc_reads_threshold`` buffers (Inductor's config: 4, 50, 12 in torch 2.13). A value realized only because an
   extern reads it is registered where that extern is.
2. *Fuse* (``Scheduler.fuse_nodes``): realized loop nodes that share a buffer
   fuse (pairs of two reductions or of two loops first, then the most shared bytes) when
   their loops match (same elements; a loop
   over a reduction's result; or a row reduction and a loop over the same rows:
   a column reduction's loop order differs), the kernel stays within
   ``max_fusion_size`` nodes, and no path leaves one and re-enters the other (a cycle).
   Two kernels neither of which reads the other's results (a horizontal fusion) also need
   ``score_fusion_memory_threshold`` shared bytes and at most ``horizontal_fusion_max_distance``
   nodes between their farthest members (``choices.py: can_fuse_horizontal``): recomputed loops
   of distant backward regions stay in their own regions.
3. *Order* (``topological_sort_schedule``): kernels by their earliest member,
   each preceded by what it needs, so a fused kernel pulls its producers forward; then, with
   ``reorder_for_peak_memory`` on (the default), the order of least estimated peak among that
   one and three other topological orders (``peak_reorder``), as Inductor's scheduler picks.
4. *Call* (``CppScheduling``): consecutive loop kernels run as one C++ call, so
   they allocate together (a scatter Inductor lowers as a loop, ``GraphOp.loop_scatter``, among
   them); each extern is a call of its own.

Step 1 is ``kernel_lowering``, steps 2 and 3 are ``kernel_fusion``; this module runs them,
decides in-place writes and makes the calls (step 4).

A realized value whose every reader is in its own fused kernel is removed at
codegen (*phantom*): it costs no memory, but Inductor's peak estimate, which
gates its buffer reuse (see ``memory_timeline.simulate_memory``), still counts it.
The records are plain, so a planner can call this per candidate plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .._torch_inductor import InductorConfig, inductor_config
from .kernel_fusion import UnionFind, fuse, phantom_buffers, seeded_chain, topological_order
from .peak_reorder import reorder_for_peak_memory
from .kernel_lowering import ALIAS, LOOP_KINDS, SCATTER, GraphOp, Lowering


@dataclass(frozen=True)
class Kernel:
    """One call in the wrapper: ``extern`` for a library call, else consecutive fused loops."""

    ops: tuple[str, ...]          # realized ops it computes, in order
    buffers: tuple[str, ...]      # ops whose buffers are allocated before the call
    phantoms: tuple[str, ...]     # realized ops whose buffer codegen removes (Inductor's estimate counts them)
    loads: tuple[str, ...]        # buffers and graph inputs the call reads
    extern: bool                  # a library call (its multi-output results are freed, never pooled)
    inplace: tuple[tuple[str, str], ...] = ()   # (op, buffer or input it overwrites in place)


@dataclass(frozen=True)
class KernelSchedule:
    kernels: tuple[Kernel, ...]
    stands_for: Mapping[str, tuple[str, ...]]   # op without a buffer of its own -> buffers/inputs its value is made of
    first_kernel: Mapping[str, int]             # op -> index of the first kernel that computes or reads it


def schedule_kernels(ops: Sequence[GraphOp], input_bytes: Mapping[str, int],
                     donated: frozenset[str] = frozenset(), input_layouts: Mapping[str, str] = {},
                     config: InductorConfig | None = None) -> KernelSchedule:
    """Inductor's kernels for one graph whose ops are given in graph order.

    ``input_bytes``: bytes of each graph input (for fusion scores); ``donated``:
    graph inputs the graph owns and may overwrite (saved activations handed to
    the backward). Guarantees: every realized op is in exactly one kernel, and
    each kernel comes after the kernels that produce what it loads (up to cycles
    the approximate fusion check misses, which keep the earlier kernel first).
    ``config``: Inductor's thresholds and switches (``remat._torch_inductor``); None reads them now.
    """
    if config is None:
        config = inductor_config()
    lowering = Lowering(ops, config)
    for index, op in enumerate(ops):
        lowering.lower(index, op)
    lowering.finish(len(ops))
    by_name = lowering.op
    nodes = sorted(lowering.position, key=lambda n: lowering.position[n])
    loads = {n: lowering.loads[n] for n in nodes}
    sizes = dict(input_bytes)
    sizes.update((n, by_name[n].nbytes) for n in nodes)
    after = seeded_chain(nodes, by_name, config)
    sets, ancestors, position = fuse(nodes, by_name, loads, sizes, config, after)
    roots = {n: sets.find(n) for n in nodes}
    removed = phantom_buffers(nodes, by_name, loads, roots)
    expanded: dict[str, frozenset[str]] = {}

    def memory_of(name: str) -> frozenset[str]:
        """Buffers/inputs behind a load, looking through removed buffers."""
        if name not in removed:
            return frozenset((name,))
        if name not in expanded:
            expanded[name] = frozenset().union(*(memory_of(d) for d in loads[name]))
        return expanded[name]

    reads = {n: frozenset().union(*(memory_of(d) for d in loads[n])) for n in nodes}
    order = topological_order(nodes, sets, loads, lowering.position, after)
    # a scatter's buffer is a copy of its first input, filled before it scatters (``lowering._unsafe_index_put``)
    fills = {n: lowering.source(by_name[n].inputs[0]) for n in nodes if by_name[n].kind == SCATTER and by_name[n].inputs}
    if config.reorder_for_peak_memory:
        order = reorder_for_peak_memory(order, sets.members, loads, {n: by_name[n].nbytes for n in nodes},
                                        frozenset(n for n in nodes if by_name[n].is_output), after, input_bytes, fills)
    rank = {root: k for k, root in enumerate(order)}
    layouts = dict(input_layouts)
    layouts.update((o.name, o.layout) for o in ops)
    inplace = (_inplace(order, sets, by_name, reads, removed, rank, roots, sizes, donated, ancestors, position, layouts,
                        fills) if config.inplace_buffers else {})
    kernels: list[Kernel] = []
    current: list[str] = []

    def close() -> None:
        if current:
            members = [m for r in current for m in sorted(sets.members[r], key=lowering.position.__getitem__)]
            kernels.append(_kernel(members, removed, reads, inplace, extern=False))
            current.clear()

    for root in order:
        if by_name[root].kind in LOOP_KINDS or by_name[root].loop_scatter:   # consecutive loops: one C++ call
            current.append(root)
            continue
        close()
        kernels.append(_kernel([root], removed, reads, inplace, extern=True))
    close()
    return KernelSchedule(tuple(kernels), _StandsFor(ops, lowering, removed, memory_of),
                          _first_kernel(ops, kernels))


def _inplace(order: list[str], sets: UnionFind, ops: Mapping[str, GraphOp], reads: Mapping[str, frozenset[str]],
             removed: set[str], rank: Mapping[str, int], roots: Mapping[str, str], sizes: Mapping[str, int],
             donated: frozenset[str], ancestors: Mapping[str, int], position: Mapping[str, int],
             layouts: Mapping[str, str], fills: Mapping[str, frozenset[str]]) -> dict[str, str]:
    """Outputs written over an input (``SchedulerNode.decide_inplace_update``): a loop node
    may overwrite a buffer of its own size when it is that buffer's only remaining reader
    (every other reader ran in an earlier kernel or is one of its ancestors) and it is laid out
    the same way (the write walks the same indices as the read). Graph inputs qualify only if
    donated; a scatter's result (written by a fallback) never does. A scatter's own buffer is a
    loop copying its first input (``fills``), which may overwrite that input the same way: a
    gradient part scattered into (``passes/gradient_sums.py``) gives its buffer to the sum."""
    readers: dict[str, list[str]] = {}
    for n, sources in reads.items():
        for source in sources:
            readers.setdefault(source, []).append(n)
    taken: set[str] = set()
    chosen: dict[str, str] = {}
    for root in order:
        for n in sorted(sets.members[root]):
            op = ops[n]
            if (op.kind not in LOOP_KINDS and op.kind != SCATTER) or n in removed or op.nbytes == 0 or op.concat:
                continue   # a CPU cat's buffer is its ConcatKernel's, which reads nothing: never in place
            candidates = fills.get(n, frozenset()) if op.kind == SCATTER else reads[n]
            # buffers made in this graph first, then donated inputs (the order Inductor meets them in)
            for source in sorted(candidates, key=lambda s: (s not in ops, s)):
                if source in taken or sizes.get(source, -1) != op.nbytes or layouts.get(source, "") != op.layout:
                    continue
                if source in ops:
                    if ops[source].is_output or ops[source].kind in (ALIAS, SCATTER) or ops[source].concat:
                        continue   # nor is a ConcatKernel's buffer overwritten (a NopKernelSchedulerNode's)
                elif source not in donated:
                    continue
                others = [r for r in readers[source] if r != n]
                if all(rank[roots[r]] < rank[root] or (ancestors[n] >> position[r]) & 1 for r in others):
                    chosen[n] = source
                    taken.add(source)
                    break
    return chosen


class _StandsFor(Mapping[str, tuple[str, ...]]):
    """Op without a buffer of its own -> the buffers/inputs its value is made of, worked out
    when asked (a caller usually needs a few)."""

    def __init__(self, ops: Sequence[GraphOp], lowering: Lowering, removed: set[str], memory_of) -> None:
        self._names = [o.name for o in ops if o.name not in lowering.position or o.name in removed]
        self._members = set(self._names)
        self._lowering, self._memory_of = lowering, memory_of
        self._found: dict[str, tuple[str, ...]] = {}

    def __getitem__(self, name: str) -> tuple[str, ...]:
        if name not in self._members:
            raise KeyError(name)
        found = self._found.get(name)
        if found is None:
            found = self._found[name] = tuple(sorted(self._lowering.memory_of_value(name, self._memory_of)))
        return found

    def __contains__(self, name: object) -> bool:
        return name in self._members

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _first_kernel(ops: Sequence[GraphOp], kernels: list[Kernel]) -> dict[str, int]:
    """Kernel index per op: its own kernel, or the first kernel reading it (views, inlined values)."""
    first: dict[str, int] = {}
    for k, kernel in enumerate(kernels):
        for name in kernel.ops:
            first[name] = k
    readers: dict[str, list[str]] = {}
    for op in ops:
        for name in op.inputs:
            readers.setdefault(name, []).append(op.name)
    for op in reversed(ops):
        if op.name not in first:
            found = [first[r] for r in readers.get(op.name, ()) if r in first]
            if found:
                first[op.name] = min(found)
    return first


def _kernel(members: list[str], removed: set[str], reads: Mapping[str, frozenset[str]],
            inplace: Mapping[str, str], extern: bool) -> Kernel:
    inside = set(members)
    read: dict[str, None] = {}
    for m in members:
        for source in sorted(reads[m]):
            if source not in inside:
                read[source] = None
    return Kernel(
        ops=tuple(members),
        buffers=tuple(m for m in members if m not in removed),
        phantoms=tuple(m for m in members if m in removed),
        loads=tuple(read),
        extern=extern,
        inplace=tuple((m, inplace[m]) for m in members if m in inplace),
    )


__all__ = ["Kernel", "KernelSchedule", "schedule_kernels"]
