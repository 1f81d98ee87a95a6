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
   fuse, most shared bytes first, when their loops match (same elements; a loop
   over a reduction's result; or a row reduction and a loop over the same rows:
   a column reduction's loop order differs), the kernel stays within
   ``max_fusion_size`` nodes, and no path leaves one and re-enters the other (a cycle).
3. *Order* (``topological_sort_schedule``): kernels by their earliest member,
   each preceded by what it needs, so a fused kernel pulls its producers forward.
   Inductor's ``reorder_for_peak_memory`` is not modelled (``remat._torch_inductor``): it kept
   that order on the zoo's graphs, and lowered a small LM head's measured peak by 512 KiB.
4. *Call* (``CppScheduling``): consecutive loop kernels run as one C++ call, so
   they allocate together; each extern is a call of its own.

A realized value whose every reader is in its own fused kernel is removed at
codegen (*phantom*): it costs no memory, but Inductor's peak estimate, which
gates its buffer reuse (see ``memory.simulate_memory``), still counts it.
The records are plain, so a planner can call this per candidate plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from .._torch_inductor import InductorConfig, inductor_config

POINTWISE = "pointwise"    # a loop Inductor may inline into its readers
REDUCTION = "reduction"    # a loop with a reduction: always gets a buffer
EXTERN = "extern"          # a library call (mm, conv, attention, fallbacks): buffer in, buffer out
SCATTER = "scatter"        # copies its first input into a new buffer, then scatters into it in place
ALIAS = "alias"            # a view or getitem: the memory of its first input
LOOP_KINDS = (POINTWISE, REDUCTION)



class GraphOp(NamedTuple):
    """One node of one compiled graph, as the kernel model needs it (a tuple: the planner builds
    thousands of these per plan it weighs)."""

    name: str
    kind: str                     # POINTWISE | REDUCTION | EXTERN | SCATTER | ALIAS
    inputs: tuple[str, ...]       # earlier ops of this graph, or the graph's inputs
    nbytes: int                   # bytes of the buffer(s) it gets if realized
    numel: int                    # elements of its (first) output
    loop_numel: int               # elements its loop runs over (a reduction's input), else numel
    heavy: bool = False           # calls exp/log/sigmoid/tanh: Inductor stores it rather than recompute it
    users: int = 0                # readers in this graph, the graph output counting as one
    is_output: bool = False       # the graph returns it
    extern_user: bool = False     # an extern op reads it directly
    inner_reduction: bool = False # a reduction over the innermost dims: fuses with loops over the same rows
    layout: str = ""              # memory layout ("channels_last" or "" for the default): in-place needs equal ones


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


class _Lowering:
    """Step 1: which ops get a buffer, where each is registered, and what each loads."""

    def __init__(self, ops: Sequence[GraphOp], config: InductorConfig) -> None:
        self.config = config
        self.op = {o.name: o for o in ops}
        self.base: dict[str, str] = {}
        self.position: dict[str, float] = {}          # realized op -> registration position
        self.loads: dict[str, frozenset[str]] = {}    # op -> buffers/inputs its computation loads
        self.heavy: dict[str, bool] = {}
        self.opcount: dict[str, int] = {}

    def source(self, name: str) -> frozenset[str]:
        """What a reader of ``name`` loads now: its buffer if realized (or an input), else its loads."""
        name = self.base.get(name, name)
        if name in self.position or name not in self.loads:
            return frozenset((name,))
        return self.loads[name]

    def realize(self, name: str, at: float) -> None:
        name = self.base.get(name, name)
        if name in self.loads and name not in self.position:
            self.position[name] = at

    def mark_reuse(self, name: str, users: int, at: float) -> None:
        name = self.base.get(name, name)
        op = self.op.get(name)
        if op is None or op.kind != POINTWISE or name in self.position or users <= 1:
            return
        limits = self.config
        if (self.heavy[name] or self.opcount[name] > limits.cpu_opcount_threshold
                or len(self.loads[name]) > limits.realize_reads_threshold):
            self.position[name] = at

    def lower(self, index: int, op: GraphOp) -> None:
        if op.kind == ALIAS:
            self.base[op.name] = self.base.get(op.inputs[0], op.inputs[0]) if op.inputs else op.name
            self.mark_reuse(op.name, op.users, index)
            return
        sources: frozenset[str] = frozenset()
        for position, name in enumerate(op.inputs):
            if op.kind == EXTERN or (op.kind == SCATTER and position > 0):
                self.realize(name, index - 0.5)
            sources |= self.source(name)
        self.loads[op.name] = sources
        if op.kind != POINTWISE:
            self.position[op.name] = index
            return
        unrealized = [self.base.get(i, i) for i in op.inputs]
        unrealized = [i for i in unrealized if i in self.loads and i not in self.position]
        self.heavy[op.name] = op.heavy or any(self.heavy.get(i, False) for i in unrealized)
        self.opcount[op.name] = 1 + len(op.inputs) + sum(self.opcount.get(i, 0) for i in unrealized)
        if op.users > 1 and op.is_output and sources:
            self.position[op.name] = index   # an output read in the graph too (a free fill waits for the end)
        if op.users > 1 and op.extern_user and len(sources) > 1:
            self.position[op.name] = index   # realize_hint: an extern will need it anyway
        self.mark_reuse(op.name, op.users, index)
        if len(sources) > self.config.cpu_acc_reads_threshold:
            self.position[op.name] = index

    def finish(self, end: int) -> None:
        """Outputs not realized yet are realized by the graph's output node."""
        for name, op in self.op.items():
            if op.is_output:
                self.realize(name, end)

    def memory_of_value(self, name: str, memory_of) -> frozenset[str]:
        """Buffers/inputs a reader of ``name``'s final value would hold live."""
        name = self.base.get(name, name)
        if name in self.position:
            return memory_of(name)
        if name in self.loads:
            return frozenset().union(*(memory_of(d) for d in self.loads[name]))
        return frozenset((name,))


class _UnionFind:
    def __init__(self, names: Sequence[str]) -> None:
        self.parent = {n: n for n in names}
        self.members = {n: [n] for n in names}

    def find(self, name: str) -> str:
        root = name
        while self.parent[root] != root:
            root = self.parent[root]
        while self.parent[name] != root:
            self.parent[name], name = root, self.parent[name]
        return root

    def union(self, a: str, b: str) -> str:
        if len(self.members[a]) < len(self.members[b]):
            a, b = b, a
        self.parent[b] = a
        self.members[a] += self.members.pop(b)
        return a


def _loops_match(a: GraphOp, b: GraphOp) -> bool:
    if a.kind == POINTWISE and b.kind == POINTWISE:
        return a.numel == b.numel
    if a.kind == REDUCTION and b.kind == REDUCTION:
        return a.loop_numel == b.loop_numel and a.numel == b.numel
    reduction, loop = (a, b) if a.kind == REDUCTION else (b, a)
    if loop.numel == reduction.numel:
        return True   # a loop over the reduced result: the reduction's epilogue
    return reduction.inner_reduction and loop.numel == reduction.loop_numel   # same rows, outer loop shared


def _fuse(nodes: list[str], ops: Mapping[str, GraphOp], loads: Mapping[str, frozenset[str]],
          sizes: Mapping[str, int], config: InductorConfig) -> tuple[_UnionFind, dict[str, int], dict[str, int]]:
    """Step 2: greedy fusion of loop nodes that share buffers, most shared bytes first."""
    index = {n: i for i, n in enumerate(nodes)}
    deps = {n: [d for d in loads[n] if d in index] for n in nodes}
    ancestors: dict[str, int] = {}
    for n in nodes:
        bits = 0
        for d in deps[n]:
            bits |= ancestors[d] | (1 << index[d])
        ancestors[n] = bits
    descendants = {n: 0 for n in nodes}
    for n in reversed(nodes):
        for d in deps[n]:
            descendants[d] |= descendants[n] | (1 << index[n])
    loop_nodes = [n for n in nodes if ops[n].kind in LOOP_KINDS]
    touching: dict[str, list[str]] = {}
    for n in loop_nodes:
        for buffer in loads[n] | {n}:
            touching.setdefault(buffer, []).append(n)
    scored: dict[tuple[str, str], int] = {}
    for buffer, group in touching.items():
        for i, a in enumerate(group):
            for b in group[i + 1:i + 1 + config.max_fusion_buffer_group_pairwise_attempts]:
                key = (a, b) if index[a] < index[b] else (b, a)
                if key not in scored:
                    shared = (loads[a] | {a}) & (loads[b] | {b})
                    scored[key] = sum(sizes.get(s, 0) for s in shared)
    pairs = sorted((key for key, score in scored.items() if score > 0),
                   key=lambda k: (-scored[k], index[k[1]] - index[k[0]], index[k[0]]))
    sets = _UnionFind(nodes)
    bits = {n: 1 << index[n] for n in nodes}
    anc = dict(ancestors)
    desc = dict(descendants)
    for a, b in pairs:
        ra, rb = sets.find(a), sets.find(b)
        if ra == rb or len(sets.members[ra]) + len(sets.members[rb]) > config.max_fusion_size:
            continue
        if not _loops_match(ops[a], ops[b]):
            continue
        inside = bits[ra] | bits[rb]
        if (desc[ra] & anc[rb] & ~inside) or (desc[rb] & anc[ra] & ~inside):
            continue  # a path leaves one kernel and re-enters the other: fusing makes a cycle
        root = sets.union(ra, rb)
        bits[root] = inside
        anc[root] = anc[ra] | anc[rb]
        desc[root] = desc[ra] | desc[rb]
    return sets, ancestors, index


def _topological(nodes: list[str], sets: _UnionFind, loads: Mapping[str, frozenset[str]],
                 position: Mapping[str, float]) -> list[str]:
    """Step 3: fused kernels by earliest member, each preceded by the kernels it needs."""
    roots = {n: sets.find(n) for n in nodes}
    first = {r: min(position[m] for m in members) for r, members in sets.members.items()}
    needs = {r: sorted({roots[d] for m in members for d in loads[m] if d in roots} - {r}, key=first.__getitem__)
             for r, members in sets.members.items()}
    order: list[str] = []
    state: dict[str, int] = {}
    for root in sorted(sets.members, key=first.__getitem__):
        stack = [(root, iter(needs[root]))]
        state[root] = state.get(root, 0) or 1
        if state[root] == 2:
            continue
        while stack:
            current, pending = stack[-1]
            nxt = next((d for d in pending if state.get(d, 0) == 0), None)
            if nxt is not None:
                state[nxt] = 1
                stack.append((nxt, iter(needs[nxt])))
                continue
            stack.pop()
            if state[current] != 2:
                state[current] = 2
                order.append(current)
    return order


def _phantoms(nodes: list[str], ops: Mapping[str, GraphOp], loads: Mapping[str, frozenset[str]],
              roots: Mapping[str, str]) -> set[str]:
    """Realized loop values whose readers are all in their kernel, within one loop nest."""
    readers: dict[str, list[str]] = {}
    for n in nodes:
        for d in loads[n]:
            if d in roots:
                readers.setdefault(d, []).append(n)
    removed = set()
    for n in nodes:
        op = ops[n]
        if op.kind != POINTWISE or op.is_output:
            continue  # a reduction's result is read in a later loop nest: it stays in memory
        mine = readers.get(n, [])
        if not mine or any(roots[r] != roots[n] for r in mine):
            continue
        reductions = {r for r in mine if ops[r].kind == REDUCTION}
        if reductions and any(loads[r] & reductions for r in mine):
            continue  # read again after a reduction over it: a second loop nest needs it in memory
        removed.add(n)
    return removed


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
    lowering = _Lowering(ops, config)
    for index, op in enumerate(ops):
        lowering.lower(index, op)
    lowering.finish(len(ops))
    by_name = lowering.op
    nodes = sorted(lowering.position, key=lambda n: lowering.position[n])
    loads = {n: lowering.loads[n] for n in nodes}
    sizes = dict(input_bytes)
    sizes.update((n, by_name[n].nbytes) for n in nodes)
    sets, ancestors, position = _fuse(nodes, by_name, loads, sizes, config)
    roots = {n: sets.find(n) for n in nodes}
    removed = _phantoms(nodes, by_name, loads, roots)
    expanded: dict[str, frozenset[str]] = {}

    def memory_of(name: str) -> frozenset[str]:
        """Buffers/inputs behind a load, looking through removed buffers."""
        if name not in removed:
            return frozenset((name,))
        if name not in expanded:
            expanded[name] = frozenset().union(*(memory_of(d) for d in loads[name]))
        return expanded[name]

    reads = {n: frozenset().union(*(memory_of(d) for d in loads[n])) for n in nodes}
    order = _topological(nodes, sets, loads, lowering.position)
    rank = {root: k for k, root in enumerate(order)}
    layouts = dict(input_layouts)
    layouts.update((o.name, o.layout) for o in ops)
    inplace = (_inplace(order, sets, by_name, reads, removed, rank, roots, sizes, donated, ancestors, position, layouts)
               if config.inplace_buffers else {})
    kernels: list[Kernel] = []
    current: list[str] = []

    def close() -> None:
        if current:
            members = [m for r in current for m in sorted(sets.members[r], key=lowering.position.__getitem__)]
            kernels.append(_kernel(members, removed, reads, inplace, extern=False))
            current.clear()

    for root in order:
        if by_name[root].kind in LOOP_KINDS:
            current.append(root)
            continue
        close()
        kernels.append(_kernel([root], removed, reads, inplace, extern=True))
    close()
    return KernelSchedule(tuple(kernels), _StandsFor(ops, lowering, removed, memory_of),
                          _first_kernel(ops, kernels))


def _inplace(order: list[str], sets: _UnionFind, ops: Mapping[str, GraphOp], reads: Mapping[str, frozenset[str]],
             removed: set[str], rank: Mapping[str, int], roots: Mapping[str, str], sizes: Mapping[str, int],
             donated: frozenset[str], ancestors: Mapping[str, int], position: Mapping[str, int],
             layouts: Mapping[str, str]) -> dict[str, str]:
    """Outputs written over an input (``SchedulerNode.decide_inplace_update``): a loop node
    may overwrite a buffer of its own size when it is that buffer's only remaining reader
    (every other reader ran in an earlier kernel or is one of its ancestors) and it is laid out
    the same way (the write walks the same indices as the read). Graph inputs qualify only if
    donated; a scatter's result (written by a fallback) never does."""
    readers: dict[str, list[str]] = {}
    for n, sources in reads.items():
        for source in sources:
            readers.setdefault(source, []).append(n)
    taken: set[str] = set()
    chosen: dict[str, str] = {}
    for root in order:
        for n in sorted(sets.members[root]):
            op = ops[n]
            if op.kind not in LOOP_KINDS or n in removed or op.nbytes == 0:
                continue
            # buffers made in this graph first, then donated inputs (the order Inductor meets them in)
            for source in sorted(reads[n], key=lambda s: (s not in ops, s)):
                if source in taken or sizes.get(source, -1) != op.nbytes or layouts.get(source, "") != op.layout:
                    continue
                if source in ops:
                    if ops[source].is_output or ops[source].kind in (ALIAS, SCATTER):
                        continue
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

    def __init__(self, ops: Sequence[GraphOp], lowering: _Lowering, removed: set[str], memory_of) -> None:
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


__all__ = ["ALIAS", "EXTERN", "POINTWISE", "REDUCTION", "SCATTER", "GraphOp", "Kernel", "KernelSchedule", "schedule_kernels"]
