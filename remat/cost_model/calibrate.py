"""Calibration: time the real kernels of a graph's nodes on the current device.

``calibrate(graph)`` runs every node that launches a kernel on random inputs
built from the ``node.meta["val"]`` of its arguments (same shapes, strides,
dtypes, on the device the graph was traced for, sizes at their hints; a CPU
convolution's tensors channels-last, as Inductor lays them out). Integer
inputs are zeros, so every index is in range; booleans are random.

It times in rounds: each round calls every kernel node once, in graph order, and
a node's time is the best of the rounds after the first (a warm-up): like every
profile number, what the kernel takes when nothing else interferes (medians read
the zoo's library calls 10-15% above the compiled step's own time at load 2). An
op timed once between the graph's other ops meets the cache and allocator state
it meets in a step; an op looped on its own finds its inputs in cache and its
output buffer just freed, and runs up to several times faster than in the graph
for small ops (on two CPU cores the rank correlation with times measured in a
real step rose from 0.93 to 0.96 for the zoo CNN). CPU calls are timed with
``hardware.clock_for`` (CPU time with one torch thread, else ``perf_counter``);
CUDA calls with a pair of events each, read after the round synchronises. Inputs
for at most ``max_live_input_bytes`` are made at a time: the nodes are timed in
chunks.

A node that cannot run on random inputs is skipped with the reason, and keeps
its roofline estimate. Results are cached on disk by a hash of the graph (ops,
arguments, shapes, strides, dtypes), the device (CPU host and thread count, or
GPU name), the torch version and the repeat count, under
``$REMAT_CACHE_DIR/calibration/<hash>.json``; a corrupt file is measured again.

Use: ``annotate_costs(graph, profile, measured_times=measure_node_times(graph))``.
"""

from __future__ import annotations

import functools
import operator
import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Union

import torch
from torch import fx

from .hardware import cache_dir, clock_for, real_tensors, write_atomically
from .tensors import concrete_int, is_free_op, iter_tensors, node_val, op_name

log = logging.getLogger("remat.calibrate")

CALIBRATION_SCHEMA = 6
MAX_LIVE_INPUT_BYTES = 1 << 30
RECENT_PRODUCERS = 2     # inputs made by this many kernels just before an op are in cache when it runs


@dataclass(frozen=True)
class Calibration:
    times_s: Mapping[str, float]           # node name -> best seconds per run over the rounds
    skipped: Mapping[str, str]             # node name -> why it was not timed
    graph_hash: str
    device: str
    from_cache: bool = False
    extra: Mapping[str, str] = field(default_factory=dict)


def _concrete(value: Any) -> Any:
    """Meta values and constants with SymInts evaluated at their hints."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        hinted = concrete_int(value) if isinstance(value, torch.SymInt) else value.node.hint
        return hinted
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v) for v in value)
    return value


def describe(value: Any) -> Any:
    """A JSON-able description of an argument (a node by its name and meta value's dtype, device, sizes and
    strides at their hints), for the graph hash."""
    if isinstance(value, fx.Node):
        return {"node": value.name, "val": describe(node_val(value))}
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), str(value.device.type), list(_concrete(tuple(value.shape))),
                list(_concrete(tuple(value.stride())))]
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in value.items()}
    return repr(_concrete(value))


def _device_key(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{socket.gethostname()}:{torch.get_num_threads()}threads"


def graph_hash(graph: fx.Graph, device: torch.device, repeats: int, purpose: str = "") -> str:
    """A digest of the graph's nodes (ops, arguments, shapes, strides, dtypes), the device with its
    thread count, the torch version and ``repeats``; ``purpose`` keeps other measurements' keys apart."""
    digest = hashlib.sha256()
    digest.update(f"schema={CALIBRATION_SCHEMA};torch={torch.__version__};{_device_key(device)};r={repeats}"
                  f"{';' + purpose if purpose else ''}".encode())
    for node in graph.nodes:
        entry = [node.name, node.op, str(node.target), describe(node.args), describe(node.kwargs),
                 describe(node_val(node))]
        digest.update(json.dumps(entry, sort_keys=True, default=str).encode())
    return digest.hexdigest()[:32]


def graph_device(graph: fx.Graph) -> torch.device:
    """The device of the graph's first tensor value (CPU when it has none)."""
    for node in graph.nodes:
        for tensor in iter_tensors(node_val(node)):
            return torch.device(tensor.device.type, tensor.device.index)
    return torch.device("cpu")


@dataclass(frozen=True)
class TensorLayout:
    """A tensor argument as a probe makes it: sizes and strides at their hints, the dtype, and whether it is
    handed over in channels-last (``_hands_channels_last``). Picklable, unlike the traced value it describes:
    a probe that cannot be measured in its own process is measured in a child (``remat/child_call.py``)."""

    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: torch.dtype
    channels_last: bool = False


def layout_of(like: Any, channels_last: bool = False) -> TensorLayout:
    """``like``'s (a real, fake or meta tensor's) layout at its hints."""
    return TensorLayout(_concrete(tuple(like.shape)), _concrete(tuple(like.stride())), like.dtype, channels_last)


def random_tensor(like: Any, device: torch.device) -> torch.Tensor:
    """A real tensor with ``like``'s (a tensor's or a ``TensorLayout``'s) shape, strides and dtype; floats
    random, ints zero, bools random; a layout marked channels-last is made contiguous in it."""
    layout = like if isinstance(like, TensorLayout) else layout_of(like)
    shape, stride = layout.sizes, layout.strides
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(s > 0 for s in shape) else 0
    if layout.dtype.is_floating_point or layout.dtype.is_complex:
        base = torch.randn(span, device=device).to(layout.dtype)
    elif layout.dtype == torch.bool:
        base = torch.rand(span, device=device) < 0.5
    else:
        base = torch.zeros(span, dtype=layout.dtype, device=device)
    tensor = base.as_strided(shape, stride)
    return tensor.contiguous(memory_format=torch.channels_last) if layout.channels_last else tensor


_CONVOLUTIONS = frozenset({"convolution", "convolution_backward"})


def _hands_channels_last(node: fx.Node, value: torch.Tensor, device: torch.device) -> bool:
    """Whether a CPU convolution's 4-D tensor is handed to it in channels-last: where oneDNN runs it,
    Inductor's layout optimisation then always picks channels-last (``GraphLowering.decide_layout_opt``,
    torch 2.13), and oneDNN runs a contiguous 16-channel 3x3 convolution 1.5-3x slower (the zoo CNN's
    calibrated sums read 20% above the compiled step's time)."""
    mkldnn = torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()
    return mkldnn and device.type == "cpu" and op_name(node) in _CONVOLUTIONS and value.dim() == 4


def arg_layouts(node: fx.Node, device: torch.device) -> tuple[tuple, dict]:
    """``node``'s arguments with every tensor as the ``TensorLayout`` a probe on ``device`` makes it (a CPU
    convolution's in the layout Inductor gives it), constants at their hints; nothing is allocated."""
    def describe_arg(arg: fx.Node) -> Any:
        value = node_val(arg)
        if isinstance(value, torch.Tensor):
            return layout_of(value, _hands_channels_last(node, value, device))
        if isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            return type(value)(layout_of(v) for v in value)
        if value is None and arg.op == "get_attr":
            raise ValueError("a get_attr argument with no meta value")
        return _concrete(value)

    args = fx.node.map_arg(node.args, describe_arg)
    kwargs = fx.node.map_arg(node.kwargs, describe_arg)
    return _concrete(args), {k: _concrete(v) for k, v in kwargs.items()}


def realize(value: Any, device: torch.device) -> Any:
    """``value`` (nested lists, tuples and dicts) with every ``TensorLayout`` made a random tensor on ``device``,
    in order (``random_tensor``)."""
    if isinstance(value, TensorLayout):
        return random_tensor(value, device)
    if isinstance(value, (list, tuple)):
        return type(value)(realize(v, device) for v in value)
    if isinstance(value, dict):
        return {k: realize(v, device) for k, v in value.items()}
    return value


def real_args(node: fx.Node, device: torch.device) -> tuple[tuple, dict]:
    """Real arguments for ``node``: random tensors of its inputs' traced shapes, strides and dtypes
    (``random_tensor``; a CPU convolution's in the layout Inductor gives it), constants at their hints."""
    args, kwargs = arg_layouts(node, device)
    return realize(args, device), realize(kwargs, device)


Call = tuple[str, Callable[[], Any], Optional[Callable[[], Any]]]   # (node, the op on its inputs, warm its inputs)


def _call_seconds(calls: list[Call], device: torch.device, held: dict[str, Any]) -> dict[str, float]:
    """One round: each call once, in order (after its warm-up, untimed); seconds per call.

    Each output is kept in ``held`` until the same call's next output replaces it: memory
    stays allocated the way a running graph keeps it. Freed at once, a CPU output of a few
    hundred KB and more goes back to the OS, and the next one pays a page fault per 4 KiB
    (a 2 MB multiply took 0.7 ms instead of 0.08).
    """
    if device.type == "cuda":
        events = []
        for name, call, warm in calls:
            if warm is not None:
                warm()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = call()
            end.record()
            held[name] = out
            events.append((name, start, end))
        torch.cuda.synchronize(device)
        return {name: start.elapsed_time(end) / 1e3 for name, start, end in events}
    seconds = {}
    clock = clock_for(device)   # CPU time with one thread: what a neighbour's load does not inflate
    for name, call, warm in calls:
        if warm is not None:
            warm()
        t0 = clock()
        out = call()
        seconds[name] = clock() - t0
        held[name] = out
    return seconds


def _time_rounds(calls: list[Call], device: torch.device, repeats: int) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name, _, _ in calls}
    held: dict[str, Any] = {}
    for round_index in range(repeats + 1):
        for name, seconds in _call_seconds(calls, device, held).items():
            if round_index > 0:   # the first round warms caches, the allocator and lazy initialisation
                samples[name].append(seconds)
    return {name: min(values) for name, values in samples.items()}


def _producer(node: fx.Node) -> fx.Node:
    """The kernel node whose output ``node``'s value is (through views and getitems)."""
    while node.op == "call_function" and (is_free_op(node) or node.target is operator.getitem) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def _warm_fresh_inputs(node: fx.Node, args: tuple, recent: list[str]) -> Optional[Callable[[], Any]]:
    """Read the inputs the graph produced just before ``node`` (they are in cache when it runs
    in a step; its other inputs were made long before and are not). An input that is a view
    (a transposed gradient into a batched matmul) is fresh when the tensor under it is."""
    fresh = [value for arg, value in zip(node.args, args)
             if isinstance(arg, fx.Node) and _producer(arg).name in recent and isinstance(value, torch.Tensor)]
    if not fresh:
        return None
    return lambda: [t.sum() if t.dtype != torch.bool else t.any() for t in fresh]


def _input_bytes(args: Any) -> int:
    leaves = torch.utils._pytree.tree_leaves(args)
    return sum(t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))


def _measure(graph: fx.Graph, device: torch.device, repeats: int,
             max_live_input_bytes: int = MAX_LIVE_INPUT_BYTES) -> tuple[dict[str, float], dict[str, str]]:
    times: dict[str, float] = {}
    skipped: dict[str, str] = {}
    with real_tensors():   # the partitioner that calibrates runs under a fake mode
        chunk: list[Call] = []
        live = 0
        recent: list[str] = []   # the last kernel nodes, in graph order
        for node in graph.nodes:
            if is_free_op(node):
                continue
            try:
                args, kwargs = real_args(node, device)
                target = node.target
                target(*args, **kwargs)   # an op that refuses random inputs is found here, not mid-round
            except Exception as error:  # noqa: BLE001 - any op may refuse random inputs; it keeps its roofline
                skipped[node.name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
                continue
            warm = _warm_fresh_inputs(node, args, recent)
            chunk.append((node.name, functools.partial(target, *args, **kwargs), warm))
            recent = (recent + [node.name])[-RECENT_PRODUCERS:]
            live += _input_bytes((args, kwargs))
            if live > max_live_input_bytes:
                times.update(_time_rounds(chunk, device, repeats))
                chunk, live = [], 0
        if chunk:
            times.update(_time_rounds(chunk, device, repeats))
    return times, skipped


def calibrate(graph: fx.Graph, *, device: Optional[Union[str, torch.device]] = None, repeats: int = 9,
              use_cache: bool = True, cache_path: Optional[Path] = None) -> Calibration:
    """Time every kernel node of ``graph`` on ``device`` (default: the graph's), or read the cached times."""
    device = torch.device(device) if device is not None else graph_device(graph)
    key = graph_hash(graph, device, repeats)
    path = cache_path or cache_dir() / "calibration" / f"{key}.json"
    if use_cache:
        try:
            data = json.loads(path.read_text())
            if data.get("schema") == CALIBRATION_SCHEMA and data.get("graph_hash") == key:
                times = {str(k): float(v) for k, v in data["times_s"].items()}
                return Calibration(times, dict(data.get("skipped", {})), key, str(device), from_cache=True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # missing or corrupt: measure again
    times, skipped = _measure(graph, device, repeats)
    if skipped:
        log.info("calibration skipped %d nodes: %s", len(skipped), ", ".join(sorted(skipped)[:10]))
    if use_cache:
        payload = {"schema": CALIBRATION_SCHEMA, "graph_hash": key, "device": _device_key(device),
                   "torch": torch.__version__, "pid": os.getpid(), "times_s": times, "skipped": skipped}
        try:
            write_atomically(path, json.dumps(payload, indent=1))
        except OSError:
            pass
    return Calibration(times, skipped, key, str(device))


def measure_node_times(graph: fx.Graph, **kwargs: Any) -> dict[str, float]:
    """Measured seconds per kernel node (``calibrate(graph, **kwargs).times_s``)."""
    return dict(calibrate(graph, **kwargs).times_s)


__all__ = ["Calibration", "TensorLayout", "arg_layouts", "calibrate", "graph_device", "graph_hash", "layout_of", "measure_node_times",
           "describe", "random_tensor", "real_args", "realize"]
