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
layout Inductor gives convolutions), warm, then twice under the memory measurement of
``remat.measure`` (the CPU profiler's allocation events, or the CUDA allocator's peak), and
keeps ``max(0, peak - outputs)``, the larger of the two. The random number generators' states
are restored afterwards, so probing changes no draw the step makes.

Which calls are probed: the graph's extern kernels (``kernel_facts.kernel_kind``), ops
(``namespace.op.overload``) that may be recomputed (no collectives, mutations, random draws or
side effects: ``NodeFacts.recompute_ban``), except the matrix
products and the seed draw, which write into buffers the generated code allocates and allocate
nothing themselves (``EXACT_LIBRARY_CALLS``). Only when the graph is planned with a profile of the
device it runs on (``probes_apply``): a datasheet GPU profile on a CPU-traced graph (the plan-hash
tests) gets no CPU library's numbers. A call that cannot run on random inputs, or that runs while
another measurement is open on the thread, keeps 0, and the reason is logged. The result is cached
on disk by graph (``$REMAT_CACHE_DIR/scratch/``, keyed like calibration: ops, shapes, strides,
dtypes, the device with its thread count, the torch version).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Mapping, Optional

import torch
from torch import fx

from ..cost_model.calibrate import graph_hash, real_args
from ..cost_model.hardware import cache_dir, real_tensors, write_atomically
from ..cost_model.inductor_rules import EXACT_LIBRARY_CALLS
from ..cost_model.profiles import DATASHEET_PROFILES, HardwareProfile
from ..measure import call_peak_bytes
from ..passes.joint_graph import JointGraphFacts
from .kernel_facts import kernel_kind, op_short_name
from .kernel_lowering import EXTERN

log = logging.getLogger(__name__)

SCRATCH_SCHEMA = 1
SCRATCH_META = "remat_scratch_bytes"   # on a joint graph node: its measured scratch, for Inductor's check
PROBE_RUNS = 2          # measured runs after the warm one; the largest scratch is kept


def probes_apply(profile: HardwareProfile, device: torch.device) -> bool:
    """Whether a graph on ``device`` planned with ``profile`` gets this machine's measured scratch:
    the profile is the device's own kind (a datasheet profile describes a GPU; any other, this CPU)."""
    profile_device = "cuda" if profile.name in DATASHEET_PROFILES else "cpu"
    return profile_device == device.type


def probed_calls(facts: JointGraphFacts) -> tuple[str, ...]:
    """The nodes whose scratch is measured (see the module docstring), in graph order."""
    return tuple(name for name in facts.order
                 if facts.nodes[name].op.count(".") == 2 and not facts.nodes[name].is_getitem
                 and facts.nodes[name].recompute_ban is None and kernel_kind(facts, name) == EXTERN
                 and op_short_name(facts.nodes[name]) not in EXACT_LIBRARY_CALLS)


def _output_bytes(value: object) -> int:
    leaves = torch.utils._pytree.tree_leaves(value)
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _probe(node: fx.Node, device: torch.device) -> tuple[Optional[int], str]:
    """The node's scratch bytes on random inputs, or None and why not."""
    try:
        args, kwargs = real_args(node, device)
        target = node.target
        target(*args, **kwargs)      # warm: a library's first call may set up caches it keeps
        best = 0
        for _ in range(PROBE_RUNS):
            outputs: list = []
            peak = call_peak_bytes(lambda: outputs.append(target(*args, **kwargs)), device)
            if peak is None:
                return None, "another measurement is open on this thread"
            best = max(best, peak - _output_bytes(outputs))
        return best, ""
    except Exception as error:  # noqa: BLE001 - an op may refuse random inputs: it keeps no scratch
        return None, f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def measure_library_scratch(graph: fx.Graph, facts: JointGraphFacts, device: torch.device,
                            use_cache: bool = True) -> dict[str, int]:
    """Scratch bytes per probed node of ``graph`` (whose facts are ``facts``) on ``device``: the nodes
    ``probed_calls`` names that could be measured (0 included; a node not measured is absent)."""
    by_name = {node.name: node for node in graph.nodes}
    names = [name for name in probed_calls(facts) if isinstance(by_name[name].target, torch._ops.OpOverload)]
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
    scratch: dict[str, int] = {}
    skipped: dict[str, str] = {}
    devices = [device] if device.type == "cuda" else []
    with real_tensors(), torch.random.fork_rng(devices=devices):
        for name in names:
            measured, why = _probe(by_name[name], device)
            if measured is None:
                skipped[name] = why
            else:
                scratch[name] = measured
    if skipped:
        log.info("library scratch not measured for %d calls: %s", len(skipped),
                 "; ".join(f"{k}: {v}" for k, v in sorted(skipped.items())[:5]))
    if use_cache and not skipped:
        try:
            write_atomically(path, json.dumps({"schema": SCRATCH_SCHEMA, "graph_hash": key, "scratch_bytes": scratch}))
        except OSError:
            pass
    return scratch


def with_library_scratch(facts: JointGraphFacts, graph: fx.Graph, scratch: Mapping[str, int]) -> JointGraphFacts:
    """``facts`` with each node's ``scratch_bytes`` set from ``scratch`` (node -> bytes); the nodes of
    ``graph`` (the joint graph the facts were read from) carry it too, in ``meta[SCRATCH_META]``, which
    the partition's copies keep for Inductor's check (``inductor_check.library_scratch``)."""
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


__all__ = ["SCRATCH_META", "measure_library_scratch", "probed_calls", "probes_apply", "with_library_scratch"]
