"""The private torch APIs remat's compile cache uses, in one place (verified on torch 2.13.0).

- ``torch._functorch.config.enable_autograd_cache``: AOTAutograd's cache of whole compiles (the
  forward and backward Inductor generated, keyed by Dynamo's graph, its inputs, the configs and
  ``CustomPartitionerFn.uuid()`` of the partitioner in Inductor's config,
  ``torch/_inductor/codecache.py: FxGraphHashDetails._get_custom_partitioner_fn_detail``). A hit
  returns the compiled function without tracing the joint graph, so a custom partitioner is
  never called: ``torch/_functorch/_aot_autograd/autograd_cache.py: AOTAutogradCache.try_load``.
  A ``uuid()`` of None is *not* a bypass for a partitioner (it is for custom passes): it would
  join the key as None, so remat's uuid is never None.
- What else AOTAutograd's key reads that a compile outside Dynamo's (a re-plan, compiled from a copy of
  Dynamo's graph) must give as Dynamo's compile does, for a later process's compile of Dynamo's graph to
  find the re-plan's entry (``autograd_cache_key``): the graph module's ``__dict__``, pickled in order
  (``_torch_dynamo.copy_dynamo_graph``), ``AOTConfig.dynamic_shapes`` (from the first fake input's mode:
  ``_torch_compile._tracing_context``) and functorch's config, ``force_non_lazy_backward_lowering``
  included (``autograd_cache``'s ``non_lazy_backward``: the backend compiles every budgeted graph's
  backward at once, as its re-plans do).
- ``torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_hit"]``: incremented by
  ``try_load`` on every hit; the only sign a backend gets that its partitioner was skipped.
"""

from __future__ import annotations

import contextlib
from typing import Iterator


def autograd_cache_hits() -> int:
    """How many AOTAutograd cache hits this process has had so far."""
    from torch._dynamo.utils import counters

    return int(counters["aot_autograd"]["autograd_cache_hit"])


@contextlib.contextmanager
def autograd_cache(enabled: bool, *, non_lazy_backward: bool) -> Iterator[None]:
    """AOTAutograd's cache on or off, and the backward compiled with the forward (not at its first
    call) when ``non_lazy_backward``, for the compiles inside."""
    from torch._functorch import config as functorch_config

    with functorch_config.patch(enable_autograd_cache=enabled, force_non_lazy_backward_lowering=non_lazy_backward):
        yield
