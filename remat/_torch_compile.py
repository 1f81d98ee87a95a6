"""Inductor's compile path with remat's partitioner: the private torch APIs the backend compiles
through, in one place (verified on torch 2.13.0; see README "Torch versions").

- ``torch._inductor.compile_fx.compile_fx(gm, inputs, inner_compile=..., config_patches=...)``:
  Inductor's entry point; ``config_patches`` applies to the lazily compiled backward too
  (``compile_with_partitioner``).
- ``torch._inductor.config.custom_partitioner_fn`` and
  ``torch._inductor.custom_graph_pass.CustomPartitionerFn``: Inductor runs its joint-graph passes,
  then calls the partitioner, then generates code for the forward and backward it returns.
  ``uuid()`` joins the compile-cache key (``make_partitioner``).
- ``torch._inductor.compile_fx.compile_fx_inner`` (called with ``is_backward=True`` for the
  backward) and ``CompiledFxGraph.source_code``: the generated wrapper of each graph, which
  ``remat.inductor_check`` reads to judge the plan (``CodeCapture``).
- ``torch._functorch.partitioners._extract_fwd_bwd_modules``: builds the forward and backward
  modules from a joint graph and the saved values chosen (it keeps AOTAutograd's calling
  conventions: saved-tensor order, symbol bindings); ``default_partition`` handles joint graphs
  with no backward work (``split_joint``, ``split_by_default``).
- ``torch._guards.TracingContext`` / ``tracing`` with a ``FakeTensorMode`` holding a
  ``torch.fx.experimental.symbolic_shapes.ShapeEnv``: Inductor's FX graph cache reads the shape
  environment from the tracing context and bypasses the cache without one ("No shape env"), which a
  compile outside Dynamo's (a re-plan in a later step) has not (``compile_with_partitioner``). That
  mode is made with ``static_shapes=True`` and the inputs of such a compile are fakified with
  ``FakeTensorMode.from_tensor(x, static_shapes=True)`` in another mode, without a shape environment:
  AOTAutograd fakifies a real input with ``static_shapes=False`` whenever the fake mode has a shape
  environment (``_functorch/_aot_autograd/frontend_utils.py`` ``process_inputs``), i.e. with every
  dimension symbolic, and it keys its cache by ``dynamic_shapes``, True when its first fake input's mode
  has a shape environment (``_functorch/aot_autograd.py`` ``prepare_aot_config``).
- ``torch._dynamo.backends.registry.register_backend`` and ``_COMPILER_FNS``
  (``register_dynamo_backend``).
- AOTAutograd's autograd node of a compiled graph is named ``CompiledFunctionBackward``
  (``watch_compiled_backward`` hooks it).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from typing import Any, Callable, Optional, Sequence

import torch
from torch import fx

from ._torch_deferred import deferral_supported, deferred_loading, load_deferred
from ._torch_inductor import fusion_choices
from .graph_code import GraphCode, activation_itemsize, graph_code
from .wrapper_call_scratch import call_inputs, with_scratch_at_generated_layouts

log = logging.getLogger(__name__)


class CodeCapture:
    """An ``inner_compile`` for ``compile_fx``: compiles each graph as Inductor does and keeps its
    generated wrapper with the FX names it was handed (one capture per ``compile_fx`` call). With
    ``defer_loading`` the generated modules are not loaded (no kernel is built) until ``load()``: a
    compile only Inductor's check reads until it is kept (``_torch_deferred.py``)."""

    def __init__(self, defer_loading: bool = False) -> None:
        self.graphs: list[tuple[bool, GraphCode, int]] = []   # (is_backward, code, activation item size)
        self.deferred: Optional[list] = [] if defer_loading and deferral_supported() else None   # not loaded yet

    def load(self) -> None:
        """Load the modules this capture's compile deferred (``defer_loading``): their kernels are built now."""
        load_deferred(self.deferred or [])

    def inner_compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs: Any) -> Any:
        from torch._inductor.compile_fx import compile_fx_inner

        # before Inductor's post-grad passes change gm:
        names, itemsize, inputs = graph_code(gm, ""), activation_itemsize(gm), call_inputs(gm)
        with deferred_loading(self.deferred) if self.deferred is not None else contextlib.nullcontext(), fusion_choices():
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
        source = getattr(compiled, "source_code", None)
        if isinstance(source, str):
            code = with_scratch_at_generated_layouts(dataclasses.replace(names, source_code=source), inputs)
            self.graphs.append((bool(kwargs.get("is_backward", False)), code, itemsize))
        return compiled


class _PartitionerCacheKey:
    """What a pickled partitioner becomes: Inductor pickles its config, this
    partitioner included, into the compile-cache key; the key is our uuid."""

    def __init__(self, uuid: str) -> None:
        self.uuid = uuid


def import_compile_path() -> None:
    """Import Inductor's compile path (``torch._inductor.compile_fx`` and the lowerings, kernels and
    templates it imports) now. ``torch.compile(fn, backend="inductor")`` imports it when it is called
    (``_TorchCompileInductorWrapper.get_compiler_config``); a backend passed as an object is not looked
    into by ``torch.compile``, so without this the import ran inside the first compile, i.e. inside the
    first training step: 0.6-0.8 s of a warm (AOTAutograd cache hit) zoo-GPT step on the 2-core VM
    (py-spy, torch 2.13), most of what a warm remat step spent beyond plain Inductor's. ``make_partitioner``
    calls it, so it runs when a backend is made (``remat.backend(...)``), as plain Inductor's runs in
    ``torch.compile``; once per process."""
    import torch._inductor.compile_fx  # noqa: F401


def make_partitioner(partition: Callable[[fx.GraphModule, Sequence[object], dict[str, Any]], Any],
                     uuid: Callable[[], str]) -> Any:
    """A ``CustomPartitionerFn`` that calls ``partition(joint, joint_inputs, kwargs)`` (kwargs:
    ``num_fwd_outputs``, ``static_lifetime_input_indices``, ...) and whose ``uuid()`` is ``uuid()``."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn

    import_compile_path()

    class RematPartitioner(CustomPartitionerFn):
        def __call__(self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any):
            return partition(gm, joint_inputs, kwargs)

        def uuid(self) -> Any:
            return uuid()

        def __reduce__(self):
            return (_PartitionerCacheKey, (self.uuid(),))

    return RematPartitioner()


def compile_with_partitioner(gm: fx.GraphModule, example_inputs: Sequence[Any], partitioner: Any,
                             capture: Optional[CodeCapture] = None) -> Callable[..., Any]:
    """Inductor's compile of Dynamo's graph ``gm`` with ``partitioner`` as its partitioner (for the
    backward too), each generated graph kept by ``capture`` (a new one if None). Outside Dynamo's
    compile (a re-plan, for the step's real inputs) the graph is compiled for the static shapes of
    ``example_inputs``, as Dynamo traced it (``_tracing_context``)."""
    from torch._inductor.compile_fx import compile_fx

    context, inputs = _tracing_context(example_inputs)
    with context:
        return compile_fx(gm, inputs, inner_compile=(capture or CodeCapture()).inner_compile,
                          config_patches={"custom_partitioner_fn": partitioner})


def _tracing_context(example_inputs: Sequence[Any]) -> tuple[Any, list[Any]]:
    """The tracing context to compile in and the inputs to compile for. Inside Dynamo's compile (the
    first compile of a graph): Dynamo's context and its (fake) inputs, as they are. Outside it (a
    re-plan compiled while the step runs, for the step's real inputs): a fresh context whose fake mode
    has its own shape environment and makes static fake tensors, and the inputs fakified with static
    shapes in a fake mode without a shape environment (AOTAutograd fakifies them again in the context's).

    The shape environment, because without one Inductor's FX graph cache is bypassed: measured on a
    2-graph step re-planned after its first step, every re-plan's graph generated its code again in
    every process ("Bypassing FX Graph Cache because 'No shape env'"). The static fakification,
    because with a shape environment AOTAutograd fakifies a real input with every dimension symbolic
    (duck-sized: ``process_inputs`` in torch/_functorch/_aot_autograd/frontend_utils.py passes
    ``static_shapes=False``), so a graph Dynamo traced with static shapes was compiled again with
    dynamic ones: another plan and other code than the step was measured on, and graphs whose
    decompositions compute a Python float from sizes failed outright. BatchNorm in training mode does
    (``native_batch_norm_helper``'s unbiased-variance factor ``n / (n - 1)``, n = numel / channels, in
    torch/_decomp/decompositions.py): that SymFloat's size symbols are bound by no node of the graph,
    and AOTAutograd's ``tensorify_python_scalars`` (torch/fx/passes/_tensorify_python_scalars.py,
    ``_sympy_interp``) raised ``KeyError`` on one of them, so every re-plan of such a graph failed.
    Only static shapes are compiled this way (the backend re-plans graphs without symbolic shapes),
    so the guards the fresh environment records are not needed by anyone. The inputs' own mode without a
    shape environment, because AOTAutograd's cache key records ``dynamic_shapes``, True when the first
    fake input's mode has one (``prepare_aot_config``): Dynamo hands its compile real tensors (False),
    so a re-plan fakified in the context's mode was keyed otherwise than the same graph compiled by
    Dynamo in the next process, which therefore never found the re-plan's entry."""
    import contextlib

    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if TracingContext.try_get() is not None:
        return contextlib.nullcontext(), list(example_inputs)
    inputs_mode = FakeTensorMode()      # no shape environment: AOTAutograd's key then says static shapes
    inputs = [inputs_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]
    return tracing(TracingContext(FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True))), inputs


def split_joint(joint: fx.GraphModule, saved_names: Sequence[str],
                num_fwd_outputs: int) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward modules of ``joint`` when the forward saves the nodes named
    ``saved_names`` (tensors and symbols, in any order) for the backward."""
    from torch._functorch.partitioners import _extract_fwd_bwd_modules

    by_name = {n.name: n for n in joint.graph.nodes}
    saved = [by_name[name] for name in saved_names]
    sym_nodes = [n for n in saved if isinstance(n.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))]
    saved_values = [n for n in saved if n not in sym_nodes]
    position = {n: i for i, n in enumerate(joint.graph.nodes)}
    saved_values.sort(key=position.__getitem__)
    sym_nodes.sort(key=position.__getitem__)
    return _extract_fwd_bwd_modules(joint, saved_values, saved_sym_nodes=sym_nodes, num_fwd_outputs=num_fwd_outputs)


def split_by_default(joint: fx.GraphModule, joint_inputs: Sequence[object], num_fwd_outputs: int,
                     static_lifetime_input_indices: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
    """AOTAutograd's default partition (for a joint graph with no backward work to plan)."""
    from torch._functorch.partitioners import default_partition

    return default_partition(joint, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                             static_lifetime_input_indices=static_lifetime_input_indices)


def default_partition_saved(joint: fx.GraphModule, joint_inputs: Sequence[object], num_fwd_outputs: int,
                            static_lifetime_input_indices: Any = None) -> Optional[frozenset[str]]:
    """Names of the values PyTorch's default partitioner for Inductor
    (``min_cut_rematerialization_partition``, what plain Inductor runs) saves for ``joint``'s backward,
    computed on a copy (``joint`` is untouched); None when it fails on this graph. Without
    ``static_lifetime_input_indices`` (what AOTAutograd hands a partitioner: the parameters'
    indices), the inputs the backward returns a gradient for are taken as the parameters: the
    partitioner saves a parameter rather than a view of it only when it knows it outlives the step."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if static_lifetime_input_indices is None:
        static_lifetime_input_indices = _inputs_with_gradients(joint, num_fwd_outputs)
    try:
        fw, _ = min_cut_rematerialization_partition(
            _graph_copy(joint), joint_inputs, compiler="inductor", num_fwd_outputs=num_fwd_outputs,
            static_lifetime_input_indices=static_lifetime_input_indices)
    except Exception as error:  # noqa: BLE001 - a candidate plan only: without it the planner plans as before
        log.warning("remat: PyTorch's default partition failed on this graph (%s: %s); planning without its "
                    "saved set as a start", type(error).__name__, str(error)[:200])
        return None
    output = next(n for n in fw.graph.nodes if n.op == "output")
    return frozenset(a.name for a in output.args[0][num_fwd_outputs:] if isinstance(a, fx.Node))


def _graph_copy(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``joint`` whose graph (nodes, their meta shallowly) is its own and whose attributes
    (tensor constants a ``get_attr`` reads) are ``joint``'s own objects. ``copy.deepcopy`` would clone
    those tensors, and under the fake mode AOTAutograd has active it cannot: a real constant's storage
    cloned as a meta tensor raises (a T5's lifted constants), which left graphs with a tensor constant
    without the default partition's saved set."""
    copied = fx.GraphModule(joint, copy.deepcopy(joint.graph))
    copied.meta = dict(getattr(joint, "meta", {}))
    return copied


def _inputs_with_gradients(joint: fx.GraphModule, num_fwd_outputs: int) -> list[int]:
    """Indices of the joint graph's primal inputs whose gradient the backward returns (not None)."""
    output = next(n for n in joint.graph.nodes if n.op == "output")
    values = output.args[0]
    grads = values[num_fwd_outputs:] if isinstance(values, (list, tuple)) else []
    return [i for i, g in enumerate(grads) if g is not None]


def register_dynamo_backend(compiler_fn: Callable[..., Any], name: str) -> None:
    """Register ``compiler_fn`` as Dynamo's backend ``name``, unless one is registered by that name."""
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    if name not in _COMPILER_FNS:
        register_backend(compiler_fn, name=name)


def watch_compiled_backward(outputs: Any, at_end: Optional[Callable[[], None]],
                            at_start: Optional[Callable[[], Any]] = None) -> Any:
    """Run ``at_end``, if given, right after the compiled backward of the graph whose outputs these
    are (AOTAutograd's ``CompiledFunctionBackward`` node, reached from an output's ``grad_fn``, through
    the view nodes of aliased outputs; ``_after``), and ``at_start``, if given, right before it (a
    pre-hook). Returns that node (a Python object that lives as long as the autograd graph holding it,
    and takes weak references), or None if no output leads to one."""
    roots = [o.grad_fn for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])
             if isinstance(o, torch.Tensor) and o.grad_fn is not None]
    seen, node = set(), None
    for _ in range(4):      # aliased outputs reach the node through a few view nodes at most
        node = next((n for n in roots if "CompiledFunctionBackward" in n.name()), None)
        if node is not None:
            break
        seen.update(roots)
        roots = [nxt for n in roots for nxt, _ in n.next_functions if nxt is not None and nxt not in seen]
    if node is None:
        return None
    if at_end is not None:
        _after(node, at_end)
    if at_start is not None:
        def before(*_: Any) -> None:   # a pre-hook returning None leaves the incoming gradients as they are
            at_start()
        node.register_prehook(before)
    return node


def _after(node: Any, at_end: Callable[[], None]) -> None:
    """Run ``at_end`` once, when the first node the autograd engine runs after ``node`` starts (a pre-hook
    on each of ``node``'s next functions, all removed then), or after ``node`` when it has none.

    Not a post-hook on ``node``: the engine keeps a node's incoming gradients alive until its post-hooks
    have run, so one would hold the step's tangents through the whole compiled backward, where the
    generated code frees each at its last reader. Measured (corpus net rand-1239, an LM whose loss
    is outside the graph: its tangent is the logits' gradient, 131 kB): 1,234,952 B on the step the
    feedback loop measured against 1,103,880 B on the next steps and under plain Inductor."""
    after = [nxt for nxt, _ in node.next_functions if nxt is not None]
    if not after:
        node.register_hook(lambda *_: at_end())
        return
    handles: list[Any] = []

    def first(*_: Any) -> None:     # a pre-hook returning None leaves the incoming gradients as they are
        if handles:
            for handle in handles:
                handle.remove()
            handles.clear()
            at_end()

    handles.extend(nxt.register_prehook(first) for nxt in after)


__all__ = ["CodeCapture", "compile_with_partitioner", "import_compile_path", "make_partitioner",
           "register_dynamo_backend", "split_by_default", "split_joint", "watch_compiled_backward"]
