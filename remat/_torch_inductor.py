"""Inductor's configuration the simulator follows, read in one place (verified on torch 2.13.0).

Every value is an attribute of ``torch._inductor.config`` (a private module): read when a graph
is planned (``inductor_config()``), never frozen at import, so a user's
``torch._inductor.config.patch(...)`` around a compile reaches the planner too. Where each one acts
in Inductor (torch 2.13.0):

- ``realize_reads_threshold``: a pointwise value with several readers is stored, not inlined,
  when it loads more than this many buffers (``ir.StorageBox.should_realize_on_reuse``).
- ``realize_opcount_threshold`` (None: ``realize_cpu_opcount_threshold`` on CPU,
  ``_realize_opcount_threshold_default`` elsewhere): ... or when its inlined expression has more
  ops than this (``ir.Loops.has_large_inner_fn``). A pointwise op that broadcasts a smaller input
  marks it reused once per element read (``lowering.expand``, ``graph_reuse=False``): the same
  heavy/large tests, not the reads test.
- ``realize_acc_reads_threshold`` (None: ``realize_cpu_acc_reads_threshold`` on CPU,
  ``_realize_acc_reads_threshold_default`` elsewhere): any pointwise value loading more buffers
  than this is stored (``ir.StorageBox.has_exceeded_max_reads``).
- ``unroll_reductions_threshold``: a reduction over fewer elements than this is lowered as a
  pointwise loop that unrolls it (``ir.Reduction.create``; on a CPU only when the result has more
  than one element), which a reader may inline like any other pointwise value.
- ``max_fusion_size``: the most nodes one fused kernel may hold (``choices.py: can_fuse``).
- ``max_fusion_buffer_group_pairwise_attempts``: how many later readers of a buffer each reader
  is tried against as a fusion pair (``Scheduler.get_possible_fusions.check_all_pairs``).
- ``score_fusion_memory_threshold``: two loops that neither reads the other's result (a horizontal
  fusion) fuse only when they share at least this many bytes (``choices.py: can_fuse_horizontal``).
- ``HORIZONTAL_FUSION_MAX_DISTANCE`` (a constant of Inductor's, not a config): nor when they are
  more than this many scheduler nodes apart (``Scheduler.are_long_distant_nodes``, which Inductor
  added for activation checkpointing: recomputed loops of different checkpointed regions that read
  one buffer would otherwise fuse and run in the earliest region, holding their outputs across the others).
- ``VERTICAL_FUSION_MAX_DISTANCE`` (remat's, not Inductor's): a loop and a loop reading its result (a
  vertical fusion) fuse in Inductor at any distance; remat's compiles refuse it past the distance
  ``are_long_distant_nodes`` measures when the reader also needs work scheduled after the producer
  (``fusion_choices``; a reader whose inputs are all ready where the producer runs fuses at any distance).
  Fused, such a pair runs as one kernel, and what the producer reads stays live until the reader's other
  inputs exist: on a drawn T5 (hf-1491), each layer's batch-sum of its position-bias gradient fused with
  the sum over layers at the end of the backward, holding every layer's attention probabilities and their
  gradients (1 MB each) to that kernel; the smallest-peak plan's code peaked at 16.18 MB (simulated
  10.88), 10.93 MB with the veto. Off (None) where the user set ``inductor_choices_class``: theirs
  stands, and the simulator follows Inductor's rule.
- ``cpp.max_horizontal_fusion_size``: the CPU backend fuses two kernels horizontally only while they
  hold at most this many scheduler nodes together (``codegen/cpp.py: CppScheduling.can_fuse_horizontal``).
- ``fallback_random``: random ops run ATen's generator, and the post-grad pass chains every op tagged
  ``nondeterministic_seeded`` (SDPA included, whatever its dropout) to the previous one in program
  order (``fx_passes/post_grad.py: _chain_random_ops_for_ordering``, a ``control_deps``): each waits
  for the one before, so loops on either side of one are no longer independent (no horizontal fusion).
- ``inplace_buffers``: a loop may write its output over an input whose last reader it is
  (``scheduler.SchedulerNode.decide_inplace_update``).
- ``allow_buffer_reuse``: a freed buffer is reused by a later allocation of its size
  (``codegen/wrapper.py: AllocateLine.plan``).
- ``reorder_for_peak_memory``: Inductor reorders each graph's kernels to lower its peak
  (``memory.reorder_for_peak_memory``); ``simulator/peak_reorder.py`` follows it on the kernel
  model's fused nodes (off: ``topological_sort_schedule``'s order is kept).

The simulator models Inductor's CPU backend: ``InductorConfig.cpu_*`` resolve the thresholds for CPU.

Code generations (``code_generation_patches``): remat compiles a graph under Inductor's config as the user
left it ("default") or, as one more candidate for a budget the simulator refused (``pipeline.refusal_candidates``),
under "lean" code generation: ``realize_acc_reads_threshold`` lowered to ``realize_reads_threshold``, so a
pointwise value is stored once it loads more buffers than a value with several readers may (Inductor's own
bound for those), not only past the accumulated-reads bound (12 on CPU, 8 elsewhere). Inlined, such a value
keeps every buffer it loads live until its last reader runs; stored, only its result. The plan is made and
the code generated under the same patch (the simulator reads the config when it plans), and the record
says which (``CompiledGraph.code_generation``); Inductor's check judges the candidate like any other.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Iterator

DEFAULT_CODE_GENERATION = "default"
LEAN_CODE_GENERATION = "lean"
CODE_GENERATIONS = (DEFAULT_CODE_GENERATION, LEAN_CODE_GENERATION)

# torch/_inductor/scheduler.py: Scheduler.are_long_distant_nodes returns ``proximity_score > 64``
HORIZONTAL_FUSION_MAX_DISTANCE = 64
VERTICAL_FUSION_MAX_DISTANCE = HORIZONTAL_FUSION_MAX_DISTANCE   # remat's compiles (``fusion_choices``)


@dataclass(frozen=True)
class InductorConfig:
    """The ``torch._inductor.config`` values the simulator follows (see the module docstring)."""

    realize_reads_threshold: int
    realize_opcount_threshold: int | None           # None: the device's default below
    realize_cpu_opcount_threshold: int
    realize_gpu_opcount_threshold: int              # ``_realize_opcount_threshold_default``
    realize_acc_reads_threshold: int | None         # None: the device's default below
    realize_cpu_acc_reads_threshold: int
    realize_gpu_acc_reads_threshold: int            # ``_realize_acc_reads_threshold_default``
    unroll_reductions_threshold: int
    max_fusion_size: int
    max_fusion_buffer_group_pairwise_attempts: int
    score_fusion_memory_threshold: int              # least shared bytes of a horizontal fusion
    inplace_buffers: bool
    allow_buffer_reuse: bool
    reorder_for_peak_memory: bool                   # ``simulator/peak_reorder.py``
    horizontal_fusion_max_distance: int = 64        # HORIZONTAL_FUSION_MAX_DISTANCE
    vertical_fusion_max_distance: int | None = None  # VERTICAL_FUSION_MAX_DISTANCE under remat's choices
    cpp_max_horizontal_fusion_size: int = 16        # ``config.cpp.max_horizontal_fusion_size``
    fallback_random: bool = False                   # random ops chained in program order (see above)
    deterministic_algorithms: bool = False          # ``torch.are_deterministic_algorithms_enabled()``: scatters fall back

    @property
    def cpu_opcount_threshold(self) -> int:
        """Ops an inlined CPU expression may have before a reused value is stored."""
        if self.realize_opcount_threshold is not None:
            return self.realize_opcount_threshold
        return self.realize_cpu_opcount_threshold

    @property
    def cpu_acc_reads_threshold(self) -> int:
        """Buffers a CPU pointwise value may load before it is stored."""
        return self.acc_reads_threshold_for("cpu")

    def acc_reads_threshold_for(self, device_type: str) -> int:
        """Buffers a pointwise value on ``device_type`` may load before it is stored
        (``ir.StorageBox.has_exceeded_max_reads``)."""
        if self.realize_acc_reads_threshold is not None:
            return self.realize_acc_reads_threshold
        return self.realize_cpu_acc_reads_threshold if device_type == "cpu" else self.realize_gpu_acc_reads_threshold


def inductor_config() -> InductorConfig:
    """The current ``torch._inductor.config`` values, as a frozen record (read now, every call)."""
    import torch
    from torch._inductor import config

    return InductorConfig(
        realize_reads_threshold=int(config.realize_reads_threshold),
        realize_opcount_threshold=config.realize_opcount_threshold,
        realize_cpu_opcount_threshold=int(config.realize_cpu_opcount_threshold),
        realize_gpu_opcount_threshold=int(config._realize_opcount_threshold_default),
        realize_acc_reads_threshold=config.realize_acc_reads_threshold,
        realize_cpu_acc_reads_threshold=int(config.realize_cpu_acc_reads_threshold),
        realize_gpu_acc_reads_threshold=int(config._realize_acc_reads_threshold_default),
        unroll_reductions_threshold=int(config.unroll_reductions_threshold),
        max_fusion_size=int(config.max_fusion_size),
        max_fusion_buffer_group_pairwise_attempts=int(config.max_fusion_buffer_group_pairwise_attempts),
        score_fusion_memory_threshold=int(config.score_fusion_memory_threshold),
        inplace_buffers=bool(config.inplace_buffers),
        allow_buffer_reuse=bool(config.allow_buffer_reuse),
        reorder_for_peak_memory=bool(config.reorder_for_peak_memory),
        horizontal_fusion_max_distance=HORIZONTAL_FUSION_MAX_DISTANCE,
        vertical_fusion_max_distance=VERTICAL_FUSION_MAX_DISTANCE if _remat_choices_apply() else None,
        cpp_max_horizontal_fusion_size=int(config.cpp.max_horizontal_fusion_size),
        fallback_random=bool(config.fallback_random),
        deterministic_algorithms=bool(torch.are_deterministic_algorithms_enabled()),
    )


def code_generation_patches(code_generation: str, device_type: str) -> dict[str, int]:
    """The ``torch._inductor.config`` values ``code_generation`` (one of ``CODE_GENERATIONS``) sets over the
    current config on ``device_type`` (module docstring): none for the default; for "lean",
    ``realize_acc_reads_threshold`` at ``realize_reads_threshold`` where that is below the device's current
    threshold, else none (the lean code generation is then the default one)."""
    if code_generation not in CODE_GENERATIONS:
        raise ValueError(f"unknown code generation {code_generation!r}; expected one of {CODE_GENERATIONS}")
    if code_generation == DEFAULT_CODE_GENERATION:
        return {}
    config = inductor_config()
    lean = config.realize_reads_threshold
    return {"realize_acc_reads_threshold": lean} if lean < config.acc_reads_threshold_for(device_type) else {}


@contextlib.contextmanager
def code_generation(code_generation: str, device_type: str) -> Iterator[None]:
    """Inside, Inductor's config carries ``code_generation_patches(code_generation, device_type)``: what
    remat plans (the simulator reads the config) and what Inductor generates (and keys its caches by)."""
    from torch._inductor import config

    with config.patch(code_generation_patches(code_generation, device_type)):
        yield


@functools.cache
def fusion_choices_class() -> type:
    """Inductor's heuristics (``torch._inductor.choices.InductorChoices``) with one more rule: no
    vertical fusion of two scheduler nodes that ``Scheduler.are_long_distant_nodes`` calls far apart
    (more than ``VERTICAL_FUSION_MAX_DISTANCE``) where the reader also needs work scheduled after the
    producer (``_needs_later_work``). Inductor applies the distance test to horizontal fusions only; the
    vertical case holds a producer's inputs live until its far reader runs (module docstring)."""
    from torch._inductor.choices import InductorChoices

    class RematFusionChoices(InductorChoices):
        @classmethod
        def uuid(cls) -> str:           # Inductor's FX graph cache keys on it (``inductor_choices_class``)
            return f"remat-vertical-fusion-max-distance-{VERTICAL_FUSION_MAX_DISTANCE}"

        @staticmethod
        def can_fuse_vertical(scheduler, node1, node2, shared_data_score):  # type: ignore[no-untyped-def]
            if scheduler.are_long_distant_nodes(node1, node2) and _needs_later_work(scheduler, node1, node2):
                return False
            return InductorChoices.can_fuse_vertical(scheduler, node1, node2, shared_data_score)

    return RematFusionChoices


def _needs_later_work(scheduler, producer, reader) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``reader`` depends on an operation scheduled after ``producer``'s last member (orders as
    ``Scheduler.compute_ancestors`` numbered them): fused, the kernel cannot run where the producer ran
    without moving that work, and what the producer reads is held meanwhile. A reader whose inputs are
    all ready there (an output the forward saves, computed from a LayerNorm's statistics) still fuses."""
    own = producer.get_operation_names()
    nodes = scheduler.name_to_node
    return any(nodes[name].max_order > producer.max_order for name in reader.ancestors
               if name not in own and name in nodes)


def _choices_supported() -> bool:
    """Whether this torch has the hooks ``fusion_choices`` uses (checked on 2.13.0; elsewhere remat compiles,
    and its simulator plans, with Inductor's own fusion rules)."""
    from torch._inductor import config
    from torch._inductor.choices import InductorChoices
    from torch._inductor.scheduler import Scheduler

    return (hasattr(config, "inductor_choices_class") and hasattr(InductorChoices, "can_fuse_vertical")
            and hasattr(Scheduler, "are_long_distant_nodes"))


def _remat_choices_apply() -> bool:
    """Whether a compile of remat's runs under ``fusion_choices_class`` (the hooks exist and the user set no
    choices of their own)."""
    if not _choices_supported():
        return False
    from torch._inductor import config

    chosen = config.inductor_choices_class
    return chosen is None or chosen is fusion_choices_class()


@contextlib.contextmanager
def fusion_choices() -> Iterator[None]:
    """Inside, Inductor compiles with ``fusion_choices_class``: set as the choices handler (which
    Inductor otherwise creates once per thread, so a config alone would not reach a thread that
    compiled before) and in the config (so the FX graph cache never hands remat's code to a plain
    compile, nor the reverse). Nothing changes where the user set ``inductor_choices_class``."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    if not _choices_supported() or config.inductor_choices_class is not None:
        yield
        return
    chosen = fusion_choices_class()
    # the handler first: setting it makes the thread's default handler (from the config as it is now) the one
    # restored on exit; made under the patched config, remat's choices would stay the thread's handler for good
    with V.set_choices_handler(chosen()), config.patch(inductor_choices_class=chosen):
        yield


__all__ = ["CODE_GENERATIONS", "DEFAULT_CODE_GENERATION", "HORIZONTAL_FUSION_MAX_DISTANCE", "LEAN_CODE_GENERATION",
           "code_generation", "code_generation_patches", "InductorConfig", "VERTICAL_FUSION_MAX_DISTANCE", "fusion_choices",
           "fusion_choices_class", "inductor_config"]
