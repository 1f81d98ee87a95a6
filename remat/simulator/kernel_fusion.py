"""Steps 2 and 3 of Inductor's kernel model (``kernel_schedule``): fuse realized loops, order the kernels.

``fuse`` groups realized loop nodes that share buffers (``Scheduler.fuse_nodes``),
``topological_order`` orders the fused kernels (``topological_sort_schedule``), and
``phantom_buffers`` names the realized values codegen removes (every reader in the same kernel).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .._torch_inductor import InductorConfig
from .kernel_lowering import LOOP_KINDS, POINTWISE, REDUCTION, GraphOp


class UnionFind:
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


def seeded_chain(nodes: Sequence[str], ops: Mapping[str, GraphOp], config: InductorConfig) -> dict[str, str]:
    """Under ``fallback_random``, each op tagged ``nondeterministic_seeded`` -> the one before it in
    program order (``post_grad._chain_random_ops_for_ordering``): an order, not a read (its
    ``control_deps`` are ``is_fake`` weak deps, which hold no buffer)."""
    if not config.fallback_random:
        return {}
    chain: dict[str, str] = {}
    previous = None
    for n in nodes:
        if ops[n].seeded:
            if previous is not None:
                chain[n] = previous
            previous = n
    return chain


def fuse(nodes: list[str], ops: Mapping[str, GraphOp], loads: Mapping[str, frozenset[str]],
          sizes: Mapping[str, int], config: InductorConfig,
          after: Mapping[str, str] = {}) -> tuple[UnionFind, dict[str, int], dict[str, int]]:
    """Step 2: greedy fusion of loop nodes that share buffers, in Inductor's order (two reductions or
    two loops first, then most shared bytes). Two kernels neither of which reads the other's results
    (a horizontal fusion) fuse only with ``score_fusion_memory_threshold`` shared bytes and at most
    ``horizontal_fusion_max_distance`` nodes between their farthest members (``choices.py:
    can_fuse_horizontal``), so recomputed loops of distant backward regions stay in their regions.
    The distance counts Inductor's scheduler nodes (``scheduler_orders``), not the model's. A vertical
    fusion (one reads the other's results) is refused past ``vertical_fusion_max_distance`` when the
    reader also needs a node after the producer's last member (remat's compiles,
    ``_torch_inductor.fusion_choices``; None: at any distance, as Inductor alone fuses).
    ``after``: ordering-only dependencies (``seeded_chain``), which make two loops dependent too."""
    index = {n: i for i, n in enumerate(nodes)}
    orders = scheduler_orders(nodes, ops)
    deps = {n: [d for d in loads[n] if d in index] + ([after[n]] if n in after else []) for n in nodes}
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
    # Inductor's order (choices.py: score_fusion): pairs of two reductions or of two loops first,
    # then the most shared bytes, then the closest
    pairs = sorted((key for key, score in scored.items() if score > 0),
                   key=lambda k: ((ops[k[0]].kind == REDUCTION) != (ops[k[1]].kind == REDUCTION), -scored[k],
                                  index[k[1]] - index[k[0]], index[k[0]]))
    sets = UnionFind(nodes)
    # scheduler nodes per kernel: what ``max_fusion_size`` and the CPU backend's horizontal limit count
    count = {n: orders[n][1] - orders[n][0] + 1 for n in nodes}
    bits = {n: 1 << index[n] for n in nodes}
    anc = dict(ancestors)
    desc = dict(descendants)
    span = {n: orders[n] for n in nodes}     # a kernel's first and last member (Inductor's min/max_order)
    last = dict(index)                        # a kernel's last member's place in ``nodes``
    for a, b in pairs:
        ra, rb = sets.find(a), sets.find(b)
        if ra == rb or count[ra] + count[rb] > config.max_fusion_size:
            continue
        if not _loops_match(ops[a], ops[b]):
            continue
        inside = bits[ra] | bits[rb]
        vertical = bool(anc[rb] & bits[ra] or anc[ra] & bits[rb])     # one reads the other's results
        apart = max(span[rb][1] - span[ra][0], span[ra][1] - span[rb][0])
        if not vertical and (scored[(a, b)] < config.score_fusion_memory_threshold
                             or apart > config.horizontal_fusion_max_distance
                             or count[ra] + count[rb] > config.cpp_max_horizontal_fusion_size):
            continue  # horizontal (neither reads the other): too little shared, too far apart, too big for the CPU
        if vertical and config.vertical_fusion_max_distance is not None and apart > config.vertical_fusion_max_distance:
            producer, consumer = (ra, rb) if anc[rb] & bits[ra] else (rb, ra)
            if (anc[consumer] & ~inside) >> (last[producer] + 1):
                continue  # vertical, far apart, the reader needing later work: refused (``_torch_inductor.fusion_choices``)
        if (desc[ra] & anc[rb] & ~inside) or (desc[rb] & anc[ra] & ~inside):
            continue  # a path leaves one kernel and re-enters the other: fusing makes a cycle
        root = sets.union(ra, rb)
        bits[root] = inside
        count[root] = count[ra] + count[rb]
        span[root] = (min(span[ra][0], span[rb][0]), max(span[ra][1], span[rb][1]))
        last[root] = max(last[ra], last[rb])
        anc[root] = anc[ra] | anc[rb]
        desc[root] = desc[ra] | desc[rb]
    return sets, ancestors, index


def scheduler_orders(nodes: list[str], ops: Mapping[str, GraphOp]) -> dict[str, tuple[int, int]]:
    """Each realized node's first and last place among Inductor's scheduler nodes
    (``Scheduler.compute_ancestors`` numbers them: ``min_order``/``max_order``, what
    ``are_long_distant_nodes`` measures). A node is one scheduler node, except a CPU cat: its
    ``ConcatKernel`` is one per input (a loop writing that input's slice, those loops are what
    fuses) and the ``NopKernelSchedulerNode`` that allocates the result, so on the zoo's Llama a
    block's two rotary cats take six places, not two: counted as one, recomputed rotary loops
    four regions apart looked near enough to fuse into one kernel that held every region's
    projections at once."""
    orders: dict[str, tuple[int, int]] = {}
    at = 0
    for n in nodes:
        op = ops[n]
        copies = max(len(op.inputs), 1) if op.concat else 1
        orders[n] = (at, at + copies - 1)
        at += copies + (1 if op.concat else 0)
    return orders


def topological_order(nodes: list[str], sets: UnionFind, loads: Mapping[str, frozenset[str]],
                 position: Mapping[str, float], after: Mapping[str, str] = {}) -> list[str]:
    """Step 3: fused kernels by earliest member, each preceded by the kernels it needs (what it
    loads, and what it must run ``after``)."""
    roots = {n: sets.find(n) for n in nodes}
    first = {r: min(position[m] for m in members) for r, members in sets.members.items()}
    needs = {r: sorted({roots[d] for m in members for d in (*loads[m], *((after[m],) if m in after else ()))
                        if d in roots} - {r}, key=first.__getitem__)
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


def phantom_buffers(nodes: list[str], ops: Mapping[str, GraphOp], loads: Mapping[str, frozenset[str]],
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
        if op.kind != POINTWISE or op.is_output or op.concat:
            continue  # a reduction's result is read in a later loop nest, a ConcatKernel's is no loop's: it stays
        mine = readers.get(n, [])
        if not mine or any(roots[r] != roots[n] for r in mine):
            continue
        reductions = {r for r in mine if ops[r].kind == REDUCTION}
        if reductions and any(loads[r] & reductions for r in mine):
            continue  # read again after a reduction over it: a second loop nest needs it in memory
        removed.add(n)
    return removed


__all__ = ["UnionFind", "fuse", "phantom_buffers", "scheduler_orders", "seeded_chain", "topological_order"]
