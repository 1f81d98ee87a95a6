"""What Inductor does with an op, by its ATen name: the one home of remat's op families.

The time model's fusion (``fusion.py``, ``loop_charges.py``), the memory model's kernels
(``simulator/kernel_facts.py``), the joint graph's facts (``passes/joint_graph.py``), the
recompute bans (``passes/recompute_bans.py``) and the rewrite's dead-code roots all read their op
families here. Each family says where in Inductor (torch 2.13.0, ``torch/_inductor/``) the rule
comes from. Names are ATen overload-packet names (``aten.mm.default`` -> ``"mm"``), and the
joint graphs remat plans are already decomposed by Inductor's table
(``decomposition.select_decomp_table``): ops that table decomposes (``std``, ``norm``,
``logsumexp``, ``max_pool2d_with_indices``, ``native_layer_norm``, ...) never reach these
checks on a planned graph, and are listed only so a family is complete.

Inductor's numeric thresholds (fusion size, realize thresholds) are its config, read through
``remat._torch_inductor``, not here.
"""

from __future__ import annotations

from typing import Optional

import torch

# Ops Inductor lowers to a loop of its own (``lowering.py``: ``register_lowering`` building a
# ``Pointwise``/``make_pointwise``, or a decomposition into such ops), beyond ops tagged
# ``torch.Tag.pointwise`` and reductions: fills, copies, casts, indexing, padding and
# concatenation. A reader may fuse it; a pointwise reader may inline it.
LOOP_OPS = frozenset({
    "cat", "constant_pad_nd", "slice_scatter", "select_scatter", "index", "gather", "embedding", "tril", "triu",
    "slice_backward", "select_backward", "masked_fill", "repeat", "flip", "roll", "index_select",
    "_low_memory_max_pool_offsets_to_indices", "clone", "_to_copy", "full", "full_like", "zeros", "ones",
    "zeros_like", "ones_like", "scalar_tensor", "iota", "arange", "where",
    "inductor_lookup_seed", "convert_element_type", "rand", "rand_like", "randn",
})

# Concatenation on CPU: ``lowering.cat`` returns ``ir.ConcatKernel.create(inputs, dim)`` whenever the
# device is a CPU ("negative performance impact of pointwise_cat ... on CPU so disabled it"). The
# ConcatKernel (a ``NopKernelSchedulerNode`` that reads nothing) allocates the result, and each input is
# a loop that writes its slice through a ``NonOwningLayout`` (``should_allocate()`` is False), so the
# result is always stored, never inlined, and never written in place over an input
# (``BaseSchedulerNode.allocate`` reuses an input only for an output it allocates from a read it makes).
# On other devices ``lowering.cat`` may choose ``pointwise_cat``, a loop like any other.
CPU_CONCAT_OPS = frozenset({"cat"})

# Loops whose values are always stored, never inlined into a reader: windowed reductions
# (``lowering._low_memory_max_pool_with_offsets``, a ``Reduction``; ``max_pool2d_with_indices``
# decomposes to it) and random numbers (``lowering.inductor_random``/``inductor_randint`` call
# ``realize()`` so every reader sees the same draw).
ALWAYS_STORED_LOOPS = frozenset({
    "_low_memory_max_pool_with_offsets", "max_pool2d_with_indices", "inductor_random", "inductor_randint",
})

# Ops lowered as a copy of their first input that a fallback then scatters into in place
# (``lowering.index_put_``/``_unsafe_index_put``/``scatter_``/``scatter_reduce_``: ``clone`` then
# ``ir.ScatterFallback``/``IndexPutFallback``; ``embedding_dense_backward`` and ``index_add``
# decompose to an accumulating ``index_put``). Their inputs can fuse in, nothing fuses after them.
SCATTER_OPS = frozenset({
    "index_put", "_unsafe_masked_index_put_accumulate", "scatter_add", "scatter", "index_add",
    "scatter_reduce", "embedding_dense_backward",
})

# Of those, the ones Inductor lowers as a loop (``lowering.index_put_impl_``: an ``ir.Scatter`` writing
# into the copied buffer, accumulating for index_put with ``accumulate=True``, the embedding gradient
# and index_add), not a fallback: the loop runs in the C++ call of the loops next to it, its buffer
# allocated with theirs before the call (measured on hf-1361, a GPT-2: the embedding gradients'
# zeroed buffers allocated while the last layer norm's backward still held its inputs). Inductor falls
# back instead under deterministic algorithms (``InductorConfig.deterministic_algorithms``), for a
# boolean index, and for int64/bool buffers (not told apart here: a backward's scatters are gradients).
# scatter_add/scatter_reduce's sum falls back on a multi-threaded CPU (``cpp.fallback_scatter_reduce_sum``).
LOOP_SCATTER_OPS = frozenset({"index_put", "_unsafe_masked_index_put_accumulate", "index_add",
                              "embedding_dense_backward"})

# Mutations: a loop that writes into an existing buffer (``lowering.copy_`` -> ``mutate_to``;
# BatchNorm's running statistics). A kernel, no allocation of its own.
MUTATIONS = frozenset({"copy_"})

# Inductor's CPU backend stores a value with several readers rather than recompute it when its
# inlined expression calls one of these (``ir.StorageBox.should_realize_on_reuse``'s ``heavy_ops``).
HEAVY_IR_OPS = ("exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh")
# ATen ops whose decomposition calls one of ``HEAVY_IR_OPS`` (silu is x * sigmoid(x), softplus
# log1p(exp(x)), log_sigmoid_forward a log1p of an exp): the heavy ones by ATen name.
HEAVY_OPS = frozenset(HEAVY_IR_OPS) | frozenset({"silu", "softplus", "log_sigmoid_forward"})

# Reductions (``lowering.make_reduction``: sum, prod, amax, amin, argmax, argmin, any; mean and
# var/var_mean through ``lowering.mean``/``var_mean``; all, max.dim and min.dim as reductions
# too). ``std``, ``logsumexp``, ``norm`` and ``linalg_vector_norm`` decompose to these.
REDUCTION_OPS = frozenset({
    "sum", "mean", "amax", "amin", "var_mean", "var", "std", "any", "all", "max", "min",
    "argmax", "argmin", "prod", "logsumexp", "norm", "linalg_vector_norm",
})
# Reductions that return an index: exact whatever the order they run in.
INDEX_REDUCTIONS = frozenset({"argmax", "argmin"})

# Reductions Inductor runs as Welford reductions (``lowering.var_mean_welford_``,
# ``reduction_type="welford_reduce"``: var and var_mean; std and std_mean decompose to var).
WELFORD_OPS = frozenset({"var_mean", "var", "std", "std_mean"})

# Non-pointwise-tagged ops Inductor evaluates inside a reader's loop rather than store: fills,
# index ranges, casts, copies, selects and random draws (``lowering.full``/``iota``/``where``/
# ``clone``/``_to_copy``/``inductor_random``), and ``expand`` (a view a reader's loop indexes).
INLINABLE_OPS = frozenset({
    "full", "iota", "arange", "scalar_tensor", "inductor_random", "inductor_lookup_seed", "inductor_randint",
    "convert_element_type", "_to_copy", "where", "clone", "expand",
})

# Ops whose recomputation Inductor makes (almost) free: fills and casts it inlines, views, and
# the cheap loops and reductions a backward kernel can fuse (remat's judgement, built on the
# families above; ``joint_graph.is_free_to_recompute``).
CHEAP_TO_RECOMPUTE_OPS = frozenset({
    "full", "iota", "arange", "zeros", "ones", "empty", "scalar_tensor", "full_like", "zeros_like",
    "ones_like", "empty_like", "clone", "_to_copy", "convert_element_type", "inductor_random",
    "inductor_lookup_seed", "inductor_randint", "expand", "sum", "mean", "amax", "amin", "var_mean",
    "any", "all", "where", "cat", "constant_pad_nd", "slice_scatter", "select_scatter", "squeeze",
    "unsqueeze", "permute", "view", "reshape", "alias",
})

# Operator namespaces whose ops communicate between ranks: functional collectives and their
# waits (``_c10d_functional.all_gather_into_tensor``, ``.wait_tensor``, ...), their
# differentiable variants (``_c10d_functional_autograd``), the in-place c10d ops
# (``c10d.allreduce_``), the legacy ``c10d_functional``, DTensor's redistribution ops and
# symmetric memory. Inductor lowers them to ``ir._CollectiveKernel``/``ir.FallbackKernel``s it
# never removes (``comm_lowering.py``); remat never recomputes or drops them.
COLLECTIVE_NAMESPACES = (
    "_c10d_functional", "_c10d_functional_autograd", "c10d", "c10d_functional", "_dtensor", "symm_mem",
)


# Library calls that write into buffers the generated code allocated (``out=``) and allocate nothing the
# step's measurement sees: the matrix products and the RNG seed draw. On the CPU corpus no checked plan
# measured above its checked peak (beyond the loss's 8 bytes) unless its graphs called others: oneDNN
# convolutions (up to 8.3% above) or SDPA's flash attention (12.4%)
# (benchmarks/results/fidelity-cpu.md, "Inductor's check vs the measured step"). What those others
# allocate inside themselves is measured (``simulator/library_scratch.py``).
MATMUL_CALLS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
EXACT_LIBRARY_CALLS = MATMUL_CALLS | {"randint"}
# ... in these dtypes only, for the matrix products (the corpus was float32). On the CPU (torch 2.13, 2
# threads) a 512x192 @ 192x576 ``mm(out=)`` allocates 0 bytes inside itself in float32 and float64, 231 kB
# in bfloat16 and 624 kB in float16 (oneDNN's reduced-precision GEMM packs its operands); under bf16
# autocast Inductor's check missed that and a drawn net measured 16.6% above its checked peak
# (rand-1384, ``benchmarks/results/fidelity-autocast-cpu.md``). In other dtypes they are measured.
EXACT_MATMUL_DTYPES = frozenset({torch.float32, torch.float64})


def allocates_nothing(op: str, dtype: Optional[torch.dtype]) -> bool:
    """Whether a library call of ``op`` (short name, ``aten.mm.default`` -> "mm") whose output has
    ``dtype`` (None: not known) allocates nothing inside itself (``EXACT_LIBRARY_CALLS``): the seed
    draw always, a matrix product (``MATMUL_CALLS``) in ``EXACT_MATMUL_DTYPES`` only."""
    return op in EXACT_LIBRARY_CALLS and (op not in MATMUL_CALLS or dtype in EXACT_MATMUL_DTYPES)


__all__ = [
    "ALWAYS_STORED_LOOPS", "CHEAP_TO_RECOMPUTE_OPS", "COLLECTIVE_NAMESPACES", "CPU_CONCAT_OPS", "EXACT_LIBRARY_CALLS",
    "EXACT_MATMUL_DTYPES", "HEAVY_IR_OPS", "MATMUL_CALLS",
    "HEAVY_OPS", "INDEX_REDUCTIONS", "INLINABLE_OPS", "LOOP_OPS", "LOOP_SCATTER_OPS", "MUTATIONS", "REDUCTION_OPS", "SCATTER_OPS", "WELFORD_OPS",
    "allocates_nothing",
]
