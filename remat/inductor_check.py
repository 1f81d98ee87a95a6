"""Inductor judges a plan: the step's peak read from the code Inductor generated for it.

remat plans on its own simulator of Inductor's memory behaviour (``simulator/``:
``memory_timeline.py``, ``kernel_steps.py``). Once a plan's forward and backward are compiled, the generated
Python wrapper of each (``CompiledFxGraph.source_code``, the ``call`` function) *is* the
program that allocates and frees the step's buffers: every ``empty_strided_*`` allocation,
every ``del`` (where Python frees a buffer at its last reference), every buffer Inductor
reuses (``bufB = bufA; del bufA  # reuse``: the memory stays held from ``bufA``'s last use to
``bufB``'s allocation), every in-place write into an input, and the sizes of library calls'
outputs (``assert_size_stride``). ``replay_wrapper`` walks that code and counts live bytes;
``checked_step_peak`` composes the two graphs the way the budget counts a step (docs/design.md):

- the forward's own peak, above what was resident when it started (its inputs: parameters,
  buffers and the batch are the resident baseline and cost nothing);
- then the backward, starting from what the forward handed over: every storage the forward
  returned (saved tensors and user outputs; a returned input or a view of one costs nothing),
  plus the incoming gradients (tangents, made by the autograd engine before the backward
  runs; freed where the code drops them: the engine hands them over and keeps none, as long as no
  post-hook is registered on the backward's node, ``_torch_compile._after``). Saved storages are
  freed where the backward drops its last
  reference, as the generated code says (AOTAutograd's backward clears its context's saved
  tensors before it calls the code, ``ctx.maybe_clear_saved_tensors``), except one a user output
  shares while the caller holds its outputs. User outputs stay only when the caller holds them
  through its backward (``outputs_held``, the same convention as the simulator's); by default the
  caller dropped them, and one the backward reads lives to its last reader there.

A library call's working memory (a convolution's reorders, attention's blocks) is in no code: the
simulator measures it (``simulator/library_scratch.py``) and the replay adds it on top of what is live
once the call's output is sized (``GraphCode.library_scratch``). What it does not see, and so may
still differ from the measured peak by: the working memory of a call that was not measured, what the eager
code between the forward and the backward allocates (the loss), and the autograd engine's
own buffers. It does not model allocator rounding beyond CUDA's 512-byte blocks. A wrapper it
cannot read (symbolic sizes, graph partitions) gives ``None``, and the plan keeps its
simulated peak as the authority. What the backend decides from the number is in
``remat/inductor_verdict.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from .cost_model.inductor_rules import EXACT_LIBRARY_CALLS
from .graph_code import GraphCode
from .wrapper_text import (ALLOC, ASSERT_SIZE, ASSIGN, DEL, ELEMENT, RENAME, VIEW, call_body, ints_or_none, library_calls_in,
                           library_outputs_before_frees, returned_values)

CUDA_BLOCK_BYTES = 512       # the CUDA caching allocator rounds every block up to this



@dataclass(frozen=True)
class InputStorage:
    """A graph input that occupies memory above the resident baseline (bytes; 1 GB = 1e9 bytes).

    ``storage`` names the storage (inputs that share one share the name); ``freeable``: the
    graph may free it when its last reference is dropped (a saved tensor no held output shares)."""

    storage: str
    nbytes: int
    freeable: bool


@dataclass(frozen=True)
class WrapperReplay:
    """Live bytes along one generated ``call``: ``start_bytes`` held by its inputs at entry,
    ``peak_bytes`` the most live at once (inputs included), ``end_bytes`` live at its return.

    ``outputs`` gives, per returned value, the storage it lives in (None for ``None``, a
    resident input or a view of one) and ``storage_bytes`` the size of each storage the graph
    allocated. ``unsized`` lists values a library call returned whose size the code never
    states (counted as 0 bytes) or whose dtype it never states (an element of a library call's
    tuple, counted at the activation's itemsize); ``checked_peak_of`` declines a graph with any."""

    start_bytes: int
    peak_bytes: int
    end_bytes: int
    outputs: tuple[Optional[str], ...]
    storage_bytes: Mapping[str, int]
    unsized: tuple[str, ...]
    library_calls: frozenset[str] = frozenset()    # ``library_calls`` of the code replayed


@dataclass(frozen=True)
class CheckedPeak:
    """The step's peak as Inductor's generated code allocates it (bytes above the step's start).

    ``forward_peak_bytes``: the forward's; ``handed_bytes``: what the forward returned that
    the backward starts with (plus its incoming gradients, ``tangent_bytes``);
    ``backward_peak_bytes``: the backward's peak, those included. ``peak_bytes`` is the largest
    of the two peaks and, for a graph with an eager loss reserve (``JointGraphFacts.eager_loss_bytes``),
    ``eager_loss_peak_bytes``: what the forward hands its backward (its incoming gradients aside) plus that
    reserve, live while the loss runs between them. ``held_output_bytes``: the forward's user outputs the backward does not
    read that were counted live through the backward (0 unless the caller holds its outputs,
    ``outputs_held``). ``unsized`` counts library-call outputs of unknown size (0 bytes)."""

    peak_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    handed_bytes: int
    tangent_bytes: int
    unsized: int
    held_output_bytes: int = 0
    eager_loss_peak_bytes: int = 0
    # the library calls both graphs make (``extern_kernels.mm`` -> "mm", ``torch.ops.aten.x.default`` -> "x"):
    # what they allocate inside themselves is the part of the step the check cannot see, unless measured
    library_calls: frozenset[str] = frozenset()
    # those whose every call had its working memory measured and counted (``GraphCode.measured_calls``)
    measured_calls: frozenset[str] = frozenset()
    # those some call of which was neither measured nor known to allocate nothing (a bfloat16 matrix product)
    unmeasured_calls: frozenset[str] = frozenset()


def trusted_peak_bytes(checked: Optional["CheckedPeak"], simulated_peak_bytes: int) -> Optional[int]:
    """The checked peak a verdict may rest on. The check can always raise the number (its code peaks
    above the simulator's figure); it may lower it only where it sees every allocation, i.e. every
    library call the graphs make had its working memory measured (``simulator/library_scratch.py``) or
    allocates nothing (``EXACT_LIBRARY_CALLS``, none of whose calls is known to be in another dtype than
    ``inductor_rules.EXACT_MATMUL_DTYPES``). Otherwise None: the simulated peak stands, as for code the
    check cannot read."""
    if checked is None:
        return None
    exact = EXACT_LIBRARY_CALLS - checked.unmeasured_calls
    if checked.peak_bytes >= simulated_peak_bytes or checked.library_calls <= exact | checked.measured_calls:
        return checked.peak_bytes
    return None


def storage_nbytes(shape: Sequence[int], stride: Sequence[int], itemsize: int, device_type: str) -> int:
    """The bytes an ``empty_strided`` of this shape and stride allocates on ``device_type``."""
    if any(size == 0 for size in shape):
        elements = 0
    else:
        elements = 1 + sum((size - 1) * step for size, step in zip(shape, stride))
    nbytes = elements * itemsize
    if device_type == "cuda" and nbytes:
        nbytes = -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES
    return nbytes


class _Live:
    """Reference counts of storages while one ``call`` is replayed (local to one replay)."""

    def __init__(self, inputs: Mapping[str, InputStorage], tag: str) -> None:
        self.tag, self.allocations = tag, 0      # storages this graph allocates: "<tag>:<name>:<n>"
        self.root: dict[str, str] = {}          # bound name -> storage
        self.refs: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.counted: set[str] = set()          # storages whose bytes are live above the baseline
        self.pinned: set[str] = set()           # held by someone else: never freed here
        self.live = self.peak = 0
        for name, storage in inputs.items():
            self.bind(name, storage.storage)
            if storage.storage not in self.counted:
                self.nbytes[storage.storage] = storage.nbytes
                self.counted.add(storage.storage)
                self.live += storage.nbytes
            if not storage.freeable:
                self.pinned.add(storage.storage)
        self.peak = self.live

    def bind(self, name: str, storage: str) -> None:
        self.unbind(name)
        self.root[name] = storage
        self.refs[storage] = self.refs.get(storage, 0) + 1

    def allocate(self, name: str, nbytes: int) -> None:
        storage = f"{self.tag}:{name}:{self.allocations}"
        self.allocations += 1
        self.bind(name, storage)
        self.nbytes[storage] = nbytes
        self.counted.add(storage)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def unbind(self, name: str) -> None:
        storage = self.root.pop(name, None)
        if storage is None:
            return
        self.refs[storage] -= 1
        if self.refs[storage] == 0 and storage in self.counted and storage not in self.pinned:
            self.counted.discard(storage)
            self.live -= self.nbytes[storage]


def replay_wrapper(source_code: str, inputs: Mapping[str, InputStorage], device_type: str,
                   fallback_itemsize: int = 4, tag: str = "graph",
                   library_itemsizes: Mapping[tuple[str, int], int] = {},
                   library_scratch: Mapping[tuple[str, int, tuple[int, ...]], int] = {},
                   call_scratch: Mapping[str, int] = {}) -> Optional[WrapperReplay]:
    """Replay the allocations and frees of a generated wrapper's ``call``.

    ``inputs`` maps the input names that hold memory above the baseline to their storages;
    every other input is resident (costs nothing, never freed). A library call's output is
    sized by the ``assert_size_stride`` that follows it, which states no dtype but names the op:
    its elements count the item size ``library_itemsizes`` gives that op's output (its index in
    the op's tuple, or -1), else ``fallback_itemsize`` bytes (the graph's activation dtype), and
    an element of a tuple whose item size is not known that way is ``unsized``. A call whose output
    ``library_scratch`` names (op, index, sizes) peaks that many bytes above what is live once the
    output is allocated (its working memory, measured); ``call_scratch`` names the same by the call's
    result (``bufN = torch.ops...``), or by the statement of a call in place whose result is not bound
    (``aten.scatter_reduce_.two(buf12, ...)``, counted on top of what is live there), and, where it
    names the call, replaces the table's entry (that
    table is keyed by the output's sizes only, so two calls with the same output can share an entry
    measured for the other: an 8-channel convolution's backward and a 16-channel one's). The storages it
    allocates are named ``<tag>:<buffer>:<n>``. Returns None when the code cannot be read exactly
    (no ``call``, graph partitions, a symbolic size)."""
    body = call_body(source_code)
    if body is None:
        return None
    state, pending, outputs = _Live(inputs, tag), set(), ()
    tuple_elements: set[str] = set()
    element_index: dict[str, int] = {}           # a tuple element's index in its library call's tuple
    call_of: dict[str, str] = {}                  # a pending name -> the name the library call's result was bound to
    start_bytes = state.live
    for statement in library_outputs_before_frees(body):
        if (match := ALLOC.match(statement)):
            name, _, shape, stride, dtype = match.groups()
            sizes, steps = ints_or_none(shape), ints_or_none(stride)
            if sizes is None or steps is None or not hasattr(torch, dtype):
                return None
            state.allocate(name, storage_nbytes(sizes, steps, getattr(torch, dtype).itemsize, device_type))
        elif statement in call_scratch:         # a call in place (its result unbound): its working memory only
            state.peak = max(state.peak, state.live + call_scratch[statement])
        elif (match := ASSERT_SIZE.match(statement)) and match.group(1) in pending:
            name, sizes, steps = match.group(1), ints_or_none(match.group(2)), ints_or_none(match.group(3))
            if sizes is None or steps is None:
                return None
            pending.discard(name)
            itemsize = library_itemsizes.get((match.group(4) or "", element_index.get(name, -1)))
            if itemsize is not None:
                tuple_elements.discard(name)     # its dtype is known after all
            state.allocate(name, storage_nbytes(sizes, steps, itemsize or fallback_itemsize, device_type))
            bound_to = call_of.get(name, name)
            scratch = (call_scratch[bound_to] if bound_to in call_scratch else
                       library_scratch.get((match.group(4) or "", element_index.get(name, -1), tuple(sizes)), 0))
            state.peak = max(state.peak, state.live + scratch)
        elif (match := DEL.match(statement)):
            for name in match.group(1).split(","):
                state.unbind(name.strip())
        elif statement.startswith("return"):
            outputs = tuple(_output_storage(state, value) for value in returned_values(statement))
            break
        elif (match := VIEW.match(statement)) and match.group(2) in state.root:
            state.bind(match.group(1), state.root[match.group(2)])
        elif (match := ASSIGN.match(statement)) and match.group(2) in pending:
            # another name for a library call's result not sized yet (``buf6 = buf5``, then the assert on buf6)
            state.unbind(match.group(1))
            pending.discard(match.group(2))
            pending.add(match.group(1))
            if match.group(2) in tuple_elements:
                tuple_elements.discard(match.group(2))
                tuple_elements.add(match.group(1))
            if match.group(2) in element_index:
                element_index[match.group(1)] = element_index.pop(match.group(2))
            call_of[match.group(1)] = call_of.pop(match.group(2), match.group(2))
        elif RENAME.match(statement):
            pass    # another name for an input or a size (``s72 = primals_2``, a static re-plan's int input): no storage
        elif (match := ASSIGN.match(statement)) and not match.group(2).startswith(("reinterpret_tensor(", "empty_strided")):
            # a library call's result: sized by the assert_size_stride that follows it, if any
            state.unbind(match.group(1))
            pending.add(match.group(1))
            if (element := ELEMENT.match(match.group(2))) and element.group(1) in pending:
                tuple_elements.add(match.group(1))
                element_index[match.group(1)] = int(match.group(2)[len(element.group(1)) + 1:-1])
                call_of[match.group(1)] = call_of.get(element.group(1), element.group(1))
    # a pending name that is only indexed (``buf3[0]``) is a library call's tuple, not a tensor; an
    # element of such a tuple has a dtype the code never states (native_dropout's mask is bool, a
    # max-pool's indices int64): counted at the activation's itemsize it could be 4x off, so it is unsized
    unsized = sorted({name for name in pending if not any(f"= {name}[" in statement for statement in body)}
                     | tuple_elements)
    return WrapperReplay(start_bytes, state.peak, state.live, outputs, dict(state.nbytes), tuple(unsized),
                         library_calls_in(body))


def _output_storage(state: _Live, value: str) -> Optional[str]:
    match = re.match(r"^(?:reinterpret_tensor\()?(\w+)", value)
    if match is None or match.group(1) == "None":
        return None
    storage = state.root.get(match.group(1))
    return storage if storage in state.counted else None


def checked_step_peak(forward: GraphCode, backward: GraphCode, device_type: str,
                      fallback_itemsize: int = 4, outputs_held: bool = False,
                      eager_loss_bytes: int = 0) -> Optional[CheckedPeak]:
    """The step's peak above its start, composed from the generated forward and backward (see
    the module docstring); None when either wrapper cannot be read exactly. ``outputs_held``:
    the caller keeps the forward's user outputs through the backward (else they die when the
    forward returns, unless the backward reads them; ``JointGraphFacts.outputs_held``).
    ``eager_loss_bytes``: what an eager loss holds between the two, next to what the forward
    hands the backward (``JointGraphFacts.eager_loss_bytes``)."""
    fw = replay_wrapper(forward.source_code, {}, device_type, fallback_itemsize, "forward", forward.library_itemsizes,
                        forward.library_scratch, forward.call_scratch)
    if fw is None or len(fw.outputs) != len(forward.output_names):
        return None
    saved_names = [n for n in backward.input_names if not n.startswith("tangents_")]
    n_user = len(forward.output_names) - len(saved_names)
    if n_user < 0:
        return None
    user_storages = {s for s in fw.outputs[:n_user] if s is not None}
    by_name = {name: fw.outputs[i] for i, name in enumerate(forward.output_names) if i >= n_user and name}
    inputs: dict[str, InputStorage] = {}
    tangent_bytes = 0
    for name, nbytes in zip(backward.input_names, backward.input_bytes):
        if name.startswith("tangents_"):    # freed where the code drops them (``_torch_compile._after``)
            inputs[name] = InputStorage(f"tangent:{name}", nbytes, True)
            tangent_bytes += nbytes
        elif (storage := by_name.get(name)) is not None:
            # a saved tensor is freed at the backward's last reference to it (AOTAutograd's backward clears
            # its context's saved tensors first, ``ctx.maybe_clear_saved_tensors``), unless the caller still
            # holds a user output in the same storage
            inputs[name] = InputStorage(storage, fw.storage_bytes[storage],
                                        not (outputs_held and storage in user_storages))
    handed = {s for s in fw.outputs if s is not None}
    held = handed - {s.storage for s in inputs.values()}        # returned, not read by the backward
    if not outputs_held:
        held -= user_storages                                   # the caller dropped them before its backward
    for storage in held:
        inputs[f"held:{storage}"] = InputStorage(storage, fw.storage_bytes[storage], False)
    bw = replay_wrapper(backward.source_code, inputs, device_type, fallback_itemsize, "backward", backward.library_itemsizes,
                        backward.library_scratch, backward.call_scratch)
    if bw is None:
        return None
    handed_bytes = sum(fw.storage_bytes[s] for s in handed)
    between = {i.storage: i.nbytes for name, i in inputs.items() if not name.startswith("tangents_")}
    loss_peak = sum(between.values()) + eager_loss_bytes if eager_loss_bytes else 0
    # an op's working memory is known where the joint graph's probe measured every node of it, or where
    # each graph that calls it had every call of it measured again in its own layouts
    remeasured = {op for op in fw.library_calls | bw.library_calls
                  if all(op not in replay.library_calls or op in code.remeasured_calls
                         for replay, code in ((fw, forward), (bw, backward)))}
    return CheckedPeak(max(fw.peak_bytes, bw.peak_bytes, loss_peak), fw.peak_bytes, bw.peak_bytes, handed_bytes,
                       tangent_bytes, len(fw.unsized) + len(bw.unsized), sum(fw.storage_bytes[s] for s in held & user_storages),
                       loss_peak,
                       fw.library_calls | bw.library_calls,
                       ((forward.measured_calls | backward.measured_calls) - (forward.unmeasured_calls | backward.unmeasured_calls))
                       | remeasured, (forward.unmeasured_calls | backward.unmeasured_calls) - remeasured)


def checked_peak_of(graphs: Sequence[tuple[bool, GraphCode, int]], device_type: str,
                    outputs_held: bool = False, eager_loss_bytes: int = 0) -> Optional[CheckedPeak]:
    """The step's Inductor-checked peak from the graphs one compile produced, as
    ``(is_backward, code, activation itemsize)``: None unless exactly one forward and one backward
    were compiled, both can be read, and every library-call output's size is stated (a check
    that counts one as 0 bytes could accept a plan the simulator would not)."""
    forwards = [(code, size) for is_backward, code, size in graphs if not is_backward]
    backwards = [code for is_backward, code, _ in graphs if is_backward]
    if len(forwards) != 1 or len(backwards) != 1:
        return None
    checked = checked_step_peak(forwards[0][0], backwards[0], device_type, forwards[0][1], outputs_held,
                                eager_loss_bytes)
    return None if checked is None or checked.unsized else checked
