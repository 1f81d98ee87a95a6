"""What library calls allocate inside themselves, measured: each call's scratch bytes.

A library call (a convolution, attention's flash kernels, any op Inductor runs as an extern
kernel) allocates its outputs, which the generated code sizes, and may also allocate working
memory inside itself that it frees before returning: oneDNN's weight and gradient reorders,
the CPU flash-attention backward's per-thread blocks and its accumulation buffer for the
query's gradient. Neither the generated code nor the simulator's rules of Inductor see that
memory, and it sits on top of everything live at the call. On the CPU corpus it was the largest
gap between Inductor's check and the measured step (a VGG-style CNN 6.4% above its checked
peak, an SDPA net 5.2%; ``benchmarks/results/fidelity-unseen4-cpu.md``). Probed on this
machine (torch 2.13, 2 threads): a 64-channel 3x3 convolution's backward on 8 x 8 x 8 inputs
allocates 295 kB beyond its 279 kB of outputs; SDPA's CPU flash backward, 197 kB beyond 393 kB.

No rule predicts these bytes (they depend on the library's algorithm choice, the thread count
and the shapes), so they are measured: ``measure_library_scratch`` runs each such call of a graph
once on random inputs of its traced shapes, strides and dtypes (``calibrate.real_args``, the
layout Inductor gives convolutions; calls with the same arguments' shapes once per graph), warm,
then twice under the memory measurement of ``remat.measure_calls.calls_peak_bytes`` (the CPU profiler's
allocation events, one session for many calls; or the CUDA allocator's peak), and
keeps ``max(0, peak - outputs)``, the larger of the two; one call at a time, its inputs made just
before it and dropped after it (``scratch_of_prepared``). The random number generators' states
are restored afterwards, so probing changes no draw the step makes.

Which calls are probed: the graph's extern kernels (``kernel_facts.kernel_kind``), ops
(``namespace.op.overload``) that may be recomputed (no collectives, mutations, random draws or
side effects: ``NodeFacts.recompute_ban``), except the seed draw and the float32/float64 matrix
products, which write into buffers the generated code allocates and allocate nothing themselves
(``inductor_rules.allocates_nothing``; a bfloat16 or float16 matrix product is measured: oneDNN
packs its operands). Only when the graph is planned with a profile of the
device it runs on (``probes_apply``): a datasheet GPU profile on a CPU-traced graph (the plan-hash
tests) gets no CPU library's numbers. A call that cannot run on random inputs, or that runs while
no measurement can be made for, keeps 0, and the reason is logged. While a profiler records on the
thread (the user's around the compiling step, or the closed loop's measured step around a re-plan),
no allocation can be measured here, and the calls are made and measured in a child process instead
(``remat/child_call.py``, CPU). The result is cached
on disk by graph (``$REMAT_CACHE_DIR/scratch/``, keyed like calibration: ops, shapes, strides,
dtypes, the device with its thread count, the torch version).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx

from ..cost_model.calibrate import arg_layouts, describe, graph_hash, realize
from ..cost_model.hardware import cache_dir, real_tensors, write_atomically
from ..cost_model.tensors import node_val
from ..cost_model.inductor_rules import allocates_nothing
from ..cost_model.profiles import DATASHEET_PROFILES, HardwareProfile
from ..measure_calls import calls_peak_bytes
from ..passes.joint_graph import JointGraphFacts
from ..child_call import call_in_child
from .kernel_facts import kernel_kind, op_short_name
from .kernel_lowering import EXTERN

log = logging.getLogger(__name__)

SCRATCH_SCHEMA = 2     # 2: a tuple place the graph does not count is working memory (``keeping_places``)
SCRATCH_META = "remat_scratch_bytes"   # on a joint graph node: its measured scratch, for Inductor's check
PROBE_RUNS = 2          # measured runs after the warm one; the largest scratch is kept


def probes_apply(profile: HardwareProfile, device: torch.device) -> bool:
    """Whether a graph on ``device`` planned with ``profile`` gets this machine's measured scratch:
    the profile is the device's own kind (a datasheet profile describes a GPU; a measured one is
    named by its device type, "cpu" or "cuda")."""
    profile_device = "cuda" if profile.name in DATASHEET_PROFILES else profile.name
    return profile_device == device.type


def probed_calls(facts: JointGraphFacts, output_dtypes: Mapping[str, torch.dtype]) -> tuple[str, ...]:
    """The nodes whose scratch is measured (see the module docstring), in graph order; ``output_dtypes``:
    each node's output dtype (``output_dtypes``; a node missing counts as a dtype not known to be exact).
    (Whether a node is a library call does not depend on Inductor's reduction unrolling: ``unroll_below=0``.)"""
    return tuple(name for name in facts.order
                 if facts.nodes[name].op.count(".") == 2 and not facts.nodes[name].is_getitem
                 and facts.nodes[name].recompute_ban is None and kernel_kind(facts, name, unroll_below=0) == EXTERN
                 and not allocates_nothing(op_short_name(facts.nodes[name]), output_dtypes.get(name)))


def output_dtypes(graph: fx.Graph) -> dict[str, torch.dtype]:
    """Each node's output dtype, for the nodes whose traced value is one tensor."""
    return {node.name: node.meta["val"].dtype for node in graph.nodes if isinstance(node.meta.get("val"), torch.Tensor)}


def _storages(value: object) -> dict[int, int]:
    """The storages of the tensors in ``value`` (nested): data pointer -> bytes."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor)}


def _output_bytes(value: object, call: Callable[[], Any]) -> int:
    """The bytes of the storages ``call`` returned that it allocated: not those of its arguments (when
    ``call`` is a ``functools.partial``: an ``out=`` buffer or a tensor written in place is allocated
    before the call, and its peak does not include it; subtracting it, a bfloat16 ``mm(out=)`` whose
    oneDNN packing allocates 173,824 B measured 118,528, its 288 x 96 output's bytes less)."""
    given = _storages((call.args, call.keywords)) if isinstance(call, functools.partial) else {}
    return sum(nbytes for pointer, nbytes in _storages(value).items() if pointer not in given)


def keeping_places(places: Optional[frozenset[int]], target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``target(*args, **kwargs)`` with every place of its returned tuple not in ``places`` emptied before it
    returns (None: all kept). A tensor a library call returns at a place the graph does not count is its
    working memory: the CPU convolution backward asked for its bias's gradient alone (output mask
    ``[False, False, True]``) returns the weight's gradient too, which the traced graph has as None and the
    generated code never reads (a ViT's patch convolution with its kernel frozen: 98,304 B more than any
    output counted, a step measured 2.2% over its checked peak). Emptied so, the probe counts it in the
    call's peak and not among its outputs (``_output_bytes``). Used as ``functools.partial(keeping_places,
    places, target, *args)``, whose arguments' storages stay the call's given ones."""
    value = target(*args, **kwargs)
    if places is None or not isinstance(value, (tuple, list)):
        return value
    return tuple(item if i in places else None for i, item in enumerate(value))


def traced_places(node: fx.Node) -> Optional[frozenset[int]]:
    """The places of ``node``'s traced tuple that hold a tensor (None: its value is not a tuple)."""
    value = node.meta.get("val")
    if not isinstance(value, (tuple, list)):
        return None
    return frozenset(i for i, item in enumerate(value) if isinstance(item, torch.Tensor))


@dataclass(frozen=True)
class ProbedCall:
    """One library call to probe, picklable (measured in a child process where this one cannot measure,
    ``child_call``): the op by name ("aten.convolution_backward.default"), its arguments with every
    tensor a ``calibrate.TensorLayout``, and the places of its returned tuple the graph counts
    (``traced_places``; None: all)."""

    op: str
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    places: Optional[frozenset[int]] = None


def op_named(name: str) -> Callable[..., Any]:
    """The op overload named ``"namespace.op.overload"``."""
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def probed_call(node: fx.Node, device: torch.device) -> ProbedCall:
    """``node``'s call as a probe on ``device`` makes it (``calibrate.arg_layouts``); nothing is allocated."""
    args, kwargs = arg_layouts(node, device)
    return ProbedCall(str(node.target), args, kwargs, traced_places(node))


def prepared_call(call: ProbedCall, device: torch.device) -> Optional[Callable[[], Any]]:
    """The call on random inputs of its layouts, run once (warm: a library's first call may set up caches it
    keeps), or None when it cannot run (the reason is logged). It returns the outputs the traced graph has
    (``keeping_places``)."""
    try:
        target = op_named(call.op)
        args, kwargs = realize(call.args, device), realize(dict(call.kwargs), device)
        target(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - an op may refuse random inputs: it keeps no scratch
        log.info("library call %s not probed: %s: %s", call.op, type(error).__name__,
                 str(error).splitlines()[0][:200] if str(error) else "")
        return None
    return functools.partial(keeping_places, call.places, target, *args, **kwargs)


def scratch_of_prepared(prepares: Sequence[Callable[[], Optional[Callable[[], Any]]]],
                        device: torch.device) -> Optional[list[Optional[int]]]:
    """Each call's scratch: the largest over ``PROBE_RUNS`` runs of its peak beyond the outputs it
    returns and allocated (``_output_bytes``). The calls are made and measured one at a time:
    ``prepares[i]()`` makes call i's random inputs and runs it once (warm) and returns the call (None: it
    cannot run, and its scratch is None); its measured runs follow, each output dropped once sized, then the call and its inputs are dropped
    before the next is prepared. So a probe holds one call's inputs, outputs and working memory at a
    time, about what the step holds at that call, never every call's inputs at once: a probe made while
    a graph compiles inside a step (its first, or a re-plan) counts in that step's peak (measured on a
    drawn CNN, cnn-1341, with an empty cache: the first step peaked at 1.23x its budget, 13.6 MB, when
    every probed call's inputs were made before any was measured). Where no measurement can be made
    here now (``calls_peak_bytes``: a profiler records on this thread), nothing is made here: on the CPU
    the calls are made and measured in a child process (``child_call.call_in_child``, which needs
    every ``prepares[i]`` picklable: a ``functools.partial`` of a module-level function over picklable
    arguments); None when that fails too, or on another device."""
    made: dict[int, Callable[[], Any]] = {}
    output_bytes: dict[int, list[int]] = {}

    def prepare(i: int) -> None:
        call = prepares[i]()
        if call is not None:
            made[i] = call

    def run(i: int) -> None:
        if i in made:
            output_bytes.setdefault(i, []).append(_output_bytes(made[i](), made[i]))

    steps: list[Callable[[], Any]] = []
    measured: list[bool] = []
    runs_of: list[list[int]] = []       # per call, the indexes of its measured runs in ``steps``
    for i in range(len(prepares)):
        steps.append(functools.partial(prepare, i))
        measured.append(False)
        runs_of.append([])
        for _ in range(PROBE_RUNS):
            runs_of[i].append(len(steps))
            steps.append(functools.partial(run, i))
            measured.append(True)
        steps.append(functools.partial(made.pop, i, None))
        measured.append(False)
    peaks = calls_peak_bytes(steps, device, measured)
    if peaks is None:
        # a profiler (the user's, or a measured step's) records on this thread: a child process measures
        if device.type != "cpu":
            return None
        scratch = call_in_child(_measured_here, list(prepares), str(device), what="library calls' working memory")
        return None if scratch is None else [None if nbytes is None else int(nbytes) for nbytes in scratch]
    return [max(0, max(peaks[k] - nbytes for k, nbytes in zip(runs_of[i], output_bytes[i])))
            if i in output_bytes else None for i in range(len(prepares))]


def _measured_here(prepares: Sequence[Callable[[], Optional[Callable[[], Any]]]], device: str) -> Optional[list[Optional[int]]]:
    """``scratch_of_prepared`` in a child process (``child_call.call_in_child``), with real kernels."""
    with real_tensors():
        return scratch_of_prepared(prepares, torch.device(device))


def _signature(node: fx.Node) -> str:
    """The op and its arguments' shapes, strides and dtypes: calls alike in these are probed once."""
    return json.dumps([str(node.target), describe(fx.node.map_arg(node.args, node_val)),
                       describe(fx.node.map_arg(node.kwargs, node_val))], default=str)


def _probe_all(nodes: list[fx.Node], device: torch.device) -> list[tuple[Optional[int], str]]:
    """Each node's scratch (or None and why not), the calls made and measured one at a time
    (``scratch_of_prepared``)."""
    calls: list[Optional[ProbedCall]] = []
    for node in nodes:
        try:
            calls.append(probed_call(node, device))
        except Exception as error:  # noqa: BLE001 - an argument no probe can make: no scratch
            log.info("library call %s not probed: %s: %s", node.target, type(error).__name__, str(error)[:200])
            calls.append(None)
    scratch = scratch_of_prepared([functools.partial(prepared_call, call, device) for call in calls if call is not None],
                                  device)
    if scratch is None:
        return [(None, "no measurement could be made, here or in a child process")] * len(nodes)
    measured = iter(scratch)
    out: list[tuple[Optional[int], str]] = []
    for call in calls:
        nbytes = next(measured) if call is not None else None
        out.append((nbytes, "" if nbytes is not None else "it did not run on random inputs of its traced layouts"))
    return out


def measure_library_scratch(graph: fx.Graph, facts: JointGraphFacts, device: torch.device,
                            use_cache: bool = True) -> dict[str, int]:
    """Scratch bytes per probed node of ``graph`` (whose facts are ``facts``) on ``device``: the nodes
    ``probed_calls`` names that could be measured (0 included; a node not measured is absent)."""
    by_name = {node.name: node for node in graph.nodes}
    names = [name for name in probed_calls(facts, output_dtypes(graph))
             if isinstance(by_name[name].target, torch._ops.OpOverload)]
    if not names:
        return {}
    key = graph_hash(graph, device, 0, purpose=f"scratch{SCRATCH_SCHEMA}")
    path = cache_dir() / "scratch" / f"{key}.json"
    if use_cache:
        try:
            data = json.loads(path.read_text())
            return {str(k): int(v) for k, v in data["scratch_bytes"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass    # missing or corrupt: measure again
    signature = {name: _signature(by_name[name]) for name in names}
    first: dict[str, str] = {}
    for name in names:
        first.setdefault(signature[name], name)
    devices = [device] if device.type == "cuda" else []
    with real_tensors(), torch.random.fork_rng(devices=devices):
        probed = dict(zip(first, _probe_all([by_name[n] for n in first.values()], device)))
    measured = {name: int(probed[signature[name]][0]) for name in names if probed[signature[name]][0] is not None}
    skipped = {name: probed[signature[name]][1] for name in names if probed[signature[name]][0] is None}
    if skipped:
        log.info("library scratch not measured for %d calls: %s", len(skipped),
                 "; ".join(f"{k}: {v}" for k, v in sorted(skipped.items())[:5]))
    if use_cache and not skipped:
        try:
            write_atomically(path, json.dumps({"schema": SCRATCH_SCHEMA, "graph_hash": key, "scratch_bytes": measured}))
        except OSError:
            pass
    return measured


def with_library_scratch(facts: JointGraphFacts, graph: fx.Graph, scratch: Mapping[str, int]) -> JointGraphFacts:
    """``facts`` with each node's ``scratch_bytes`` set from ``scratch`` (node -> bytes); the nodes of
    ``graph`` (the joint graph the facts were read from) carry it too, in ``meta[SCRATCH_META]``, which
    the partition's copies keep for Inductor's check (``graph_code.library_scratch``)."""
    if not scratch:
        return facts
    for node in graph.nodes:
        if node.name in scratch:
            node.meta[SCRATCH_META] = int(scratch[node.name])
    nodes = dict(facts.nodes)
    for name, nbytes in scratch.items():
        if nbytes:
            nodes[name] = dataclasses.replace(nodes[name], scratch_bytes=int(nbytes))
    return dataclasses.replace(facts, nodes=nodes)


def scratch_key(facts: JointGraphFacts) -> str:
    """What the plans of ``facts`` read of the measured scratch, for cache keys: each node's bytes, and the
    reserve for an eager loss (``JointGraphFacts.eager_loss_bytes``, a marker step's scratch) where there is one."""
    nodes = repr(sorted((name, node.scratch_bytes) for name, node in facts.nodes.items() if node.scratch_bytes))
    return nodes + (f", eager loss {facts.eager_loss_bytes}" if facts.eager_loss_bytes else "")


__all__ = ["ProbedCall", "SCRATCH_META", "keeping_places", "measure_library_scratch", "op_named",
           "output_dtypes", "prepared_call", "probed_call", "probed_calls", "probes_apply", "scratch_key",
           "scratch_of_prepared", "traced_places", "with_library_scratch"]
