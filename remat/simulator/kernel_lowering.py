"""Step 1 of Inductor's kernel model (``kernel_schedule``): which ops of one graph get a buffer.

The records the model works on (``GraphOp``, one per node of one compiled graph, and the kinds
of node it tells apart) and ``Lowering``, which follows ``GraphLowering.run_node`` and
``StorageBox.mark_reuse`` in graph order: which values are realized, where each is registered,
and what each one's computation loads.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

from .._torch_inductor import InductorConfig

POINTWISE = "pointwise"    # a loop Inductor may inline into its readers
REDUCTION = "reduction"    # a loop with a reduction: always gets a buffer
EXTERN = "extern"          # a library call (mm, conv, attention, fallbacks): buffer in, buffer out
SCATTER = "scatter"        # copies its first input into a new buffer, then scatters into it in place;
                           # its other inputs (indices, values) are read inside its loop, unrealized
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
    concat: bool = False          # a CPU cat: its ConcatKernel allocates it, never in place (``CPU_CONCAT_OPS``)
    seeded: bool = False          # tagged nondeterministic_seeded: under fallback_random, after the previous such op
    unrolled: int = 0             # a reduction Inductor lowers as a pointwise loop unrolling this many elements
    loop_scatter: bool = False    # a SCATTER Inductor lowers as a loop: it runs in the C++ call of the loops next to it


class Lowering:
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

    def mark_reuse(self, name: str, users: int, at: float, graph_reuse: bool = True) -> None:
        """``StorageBox.mark_reuse``: a pointwise value read ``users`` times is stored when it is heavy,
        large, or (``graph_reuse``: the readers are graph users) loads many buffers."""
        name = self.base.get(name, name)
        op = self.op.get(name)
        if op is None or op.kind != POINTWISE or name in self.position or users <= 1:
            return
        limits = self.config
        if (self.heavy[name] or self.opcount[name] > limits.cpu_opcount_threshold
                or (graph_reuse and len(self.loads[name]) > limits.realize_reads_threshold)):
            self.position[name] = at

    def broadcast_reuse(self, op: GraphOp, at: float) -> None:
        """A pointwise op that broadcasts an input reads each of its elements many times: Inductor's
        ``lowering.expand`` (which ``broadcast_tensors`` calls for every pointwise op's smaller inputs)
        marks it reused that many times, not as graph fan-out (``graph_reuse=False``): a heavy or large
        expression is stored (a log-softmax's ``log`` of the row sums, read once per logit)."""
        for name in op.inputs:
            base = self.op.get(self.base.get(name, name))
            if base is not None and 0 < base.numel < op.numel:
                self.mark_reuse(base.name, op.numel // base.numel, at, graph_reuse=False)

    def lower(self, index: int, op: GraphOp) -> None:
        if op.kind == ALIAS:
            self.base[op.name] = self.base.get(op.inputs[0], op.inputs[0]) if op.inputs else op.name
            self.mark_reuse(op.name, op.users, index)
            return
        if op.kind == POINTWISE:
            self.broadcast_reuse(op, index - 0.5)
        sources: frozenset[str] = frozenset()
        for name in op.inputs:
            # a library call reads buffers; a scatter's lowering (index_put_impl_, scatter_reduce_ in
            # torch 2.13's lowering.py) reads its indices and values through loaders, so a pointwise
            # value is computed inside the scatter's loop and its inputs live until then (measured: a
            # tied LM's embedding gradient, 256 kB x 2 held to the scatter)
            if op.kind == EXTERN:
                self.realize(name, index - 0.5)
            sources |= self.source(name)
        self.loads[op.name] = sources
        if op.kind != POINTWISE or op.concat:
            self.position[op.name] = index   # a CPU cat too: its ConcatKernel's buffer, never inlined
            return
        unrealized = [self.base.get(i, i) for i in op.inputs]
        unrealized = [i for i in unrealized if i in self.loads and i not in self.position]
        self.heavy[op.name] = op.heavy or any(self.heavy.get(i, False) for i in unrealized)
        inlined = len(op.inputs) + sum(self.opcount.get(i, 0) for i in unrealized)
        # an unrolled reduction evaluates its input once per element it reduces, combining them
        # (``ir.Reduction._unroll_reduction_fn``); each load is at another index, so none is shared
        self.opcount[op.name] = op.unrolled * inlined + op.unrolled - 1 if op.unrolled > 1 else 1 + inlined
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


__all__ = ["ALIAS", "EXTERN", "LOOP_KINDS", "POINTWISE", "REDUCTION", "SCATTER", "GraphOp", "Lowering"]
