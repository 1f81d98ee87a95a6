"""Dynamo's private API that remat uses outside the backend's compile path (verified on torch 2.13.0).

- ``torch._dynamo.exc.ShortenTraceback``: Dynamo re-raises an error of this class as is instead
  of wrapping it in ``BackendCompilerFailed`` (``passthrough_error_class``).
- ``torch._guards.CompileContext.current_compile_id()``: the compile a partitioner runs in.
- ``GraphModule._param_name_to_source`` and each placeholder's ``_dynamo_source``: what Dynamo
  hands AOTAutograd besides the graph (``copy_dynamo_graph``), from which it marks the parameters
  as static-lifetime inputs (``_try_get_metadata_from_dynamo``).
- For tracing without codegen (``trace_joint_graphs``, used by ``remat.pipeline.trace_joint_facts``):
  ``torch._dynamo.backends.common.aot_autograd``, ``torch._inductor.compile_fx.partition_fn``
  (Inductor's joint-graph passes, then the configured partitioner, through
  ``torch._inductor.config.custom_partitioner_fn``), ``torch._functorch.partitioners.default_partition``,
  ``torch._inductor.decomposition.select_decomp_table``, ``make_boxed_func``,
  ``torch._inductor.virtualized.V.set_fake_mode``, ``torch._guards.detect_fake_mode``.
- ``node.meta["nn_module_stack"]`` on the nodes of a joint graph traced from Dynamo's: an ordered
  mapping, outermost module first, of ``key -> (qualified path, module class)``; the key ends in
  ``@k`` on the k-th repeated call of one module (``module_calls``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx


def passthrough_error_class(cls: type) -> type:
    """A subclass of ``cls`` that Dynamo re-raises as is instead of wrapping it in
    ``BackendCompilerFailed`` (it does so for ``ShortenTraceback``), so users can
    ``except BudgetInfeasibleError`` around their first compiled call."""
    from torch._dynamo.exc import ShortenTraceback

    class Passthrough(cls, ShortenTraceback):  # type: ignore[misc, valid-type]
        def __init__(self, original: Exception) -> None:
            Exception.__init__(self, *original.args)
            self.__dict__.update(original.__dict__)
            self.first_useful_frame = None

    Passthrough.__name__ = cls.__name__
    Passthrough.__qualname__ = cls.__qualname__
    Passthrough.__module__ = cls.__module__
    return Passthrough


# what Dynamo sets on the graph it hands a backend, which ``deepcopy`` drops (torch 2.13)
_DYNAMO_GRAPH_ATTRIBUTES = ("compile_subgraph_reason", "_param_name_to_source", "_source_to_user_stacks", "_backend_id")


def copy_dynamo_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A deep copy of Dynamo's graph ``gm`` that AOTAutograd reads as it reads ``gm``: ``deepcopy``
    drops the attributes Dynamo sets besides the graph (``_param_name_to_source``, each placeholder's
    ``_dynamo_source``), and without them AOTAutograd hands the partitioner no static-lifetime inputs,
    so a graph compiled again from the copy (a re-plan, a cache hit compiled without the cache) would
    be planned from another default partition than the first compile was. AOTAutograd's cache key
    (``autograd_cache.py``: ``_reduce_graph_module_for_cache_key`` pickles the module's ``__dict__``)
    is the same for the copy as for ``gm``: the same attributes (the generated code where ``gm`` has
    it), in the same order; so a re-plan compiled from a copy is stored under the key a later process
    computes for Dynamo's graph."""
    import copy

    copied = copy.deepcopy(gm)
    for name in [n for n in gm.__dict__ if n in _DYNAMO_GRAPH_ATTRIBUTES]:
        setattr(copied, name, getattr(gm, name))
    if "_code" in gm.__dict__:      # a lazy module's code, generated as on gm (it sets attributes)
        copied.code  # noqa: B018
    # AOTAutograd's cache key pickles the module's __dict__, order included: gm's order
    order = {name: i for i, name in enumerate(gm.__dict__)}
    attributes = sorted(copied.__dict__.items(), key=lambda item: order.get(item[0], len(order)))
    copied.__dict__.clear()
    copied.__dict__.update(attributes)
    for original, twin in zip(gm.graph.find_nodes(op="placeholder"), copied.graph.find_nodes(op="placeholder")):
        if hasattr(original, "_dynamo_source"):
            twin._dynamo_source = original._dynamo_source   # type: ignore[attr-defined]
    return copied


def copy_dynamo_graph_or_none(gm: fx.GraphModule) -> Optional[fx.GraphModule]:
    """``copy_dynamo_graph(gm)``, or None when an attribute cannot be copied (the feedback loop then
    cannot recompile the graph in place)."""
    try:
        return copy_dynamo_graph(gm)
    except Exception:  # noqa: BLE001 - any attribute Dynamo set may refuse a deep copy
        return None


def module_calls(node: fx.Node) -> tuple[tuple[str, str], ...]:
    """The module calls ``node`` was traced in, outermost first, as (call, class) pairs: ``call`` is
    the module's qualified path, with ``@k`` appended on the k-th repeated call of the same module
    (weights shared between two applications are two calls), ``class`` the module class's qualified
    name. Empty when Dynamo recorded no module stack (nodes it created outside any module, graphs
    not traced by Dynamo). Process-independent: the mapping's keys embed ``id(module)``, which is dropped."""
    stack = node.meta.get("nn_module_stack") or {}
    calls = []
    for key, entry in stack.items():
        path, cls = entry[0], entry[1]
        repeat = str(key).rpartition("@")[2] if "@" in str(key) else ""
        name = cls if isinstance(cls, str) else f"{cls.__module__}.{cls.__qualname__}"
        calls.append((f"{path}@{repeat}" if repeat else str(path), name))
    return tuple(calls)


def current_compile_id() -> str:
    """The id of the compile running now ("0/0", ...), or "?" outside one."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    return str(compile_id) if compile_id is not None else "?"


def trace_joint_graphs(model: Callable[..., Any], example_inputs: Sequence[Any],
                       read: Callable[[fx.GraphModule, Sequence[object], int], Any]) -> list[Any]:
    """Trace ``model`` once, as torch.compile with Inductor would, and return
    ``read(joint, joint_inputs, num_fwd_outputs)`` for every joint graph, in trace order, without
    planning or generating code.

    The joint graphs are the ones Inductor hands a partitioner (its decompositions and
    joint-graph passes applied). Only the forward runs, uncompiled; gradients are not touched.
    Resets Dynamo before and after, so the trace leaves no compiled code behind.
    """
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch import config as functorch_config
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import default_partition
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import partition_fn as inductor_partition_fn
    from torch._inductor.custom_graph_pass import CustomPartitionerFn
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.virtualized import V

    captured: list[Any] = []

    class CapturingPartitioner(CustomPartitionerFn):
        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
            captured.append(read(gm, joint_inputs, int(kwargs["num_fwd_outputs"])))
            return default_partition(gm, joint_inputs, num_fwd_outputs=kwargs["num_fwd_outputs"],
                                     static_lifetime_input_indices=kwargs.get("static_lifetime_input_indices"))

        def uuid(self) -> Any:
            return None

    def partition_with_fake_mode(gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
        # Inductor's joint-graph passes read the fake mode from its virtualized context.
        with V.set_fake_mode(detect_fake_mode(joint_inputs)):
            return inductor_partition_fn(gm, joint_inputs, **kwargs)

    tracer = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm),
        bw_compiler=lambda gm, _: make_boxed_func(gm),
        partition_fn=partition_with_fake_mode,
        decompositions=select_decomp_table(),
    )
    torch._dynamo.reset()
    try:
        with inductor_config.patch(custom_partitioner_fn=CapturingPartitioner()), \
                functorch_config.patch(enable_autograd_cache=False):
            torch.compile(model, backend=tracer)(*example_inputs)
    finally:
        torch._dynamo.reset()
    return captured


__all__ = ["current_compile_id", "module_calls", "passthrough_error_class", "trace_joint_graphs"]
