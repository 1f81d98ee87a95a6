"""The working memory of the library calls a generated wrapper makes, measured in the layouts the
wrapper hands them.

``simulator/library_scratch.py`` measures each library call of the joint graph before planning, on
random inputs of the traced shapes, in the layout it expects Inductor to give (channels-last for a
CPU convolution). That guess is what Inductor's layout optimisation does in a graph with forward
convolutions; a backward graph has none (``GraphLowering.decide_layout_opt`` counts
``aten.convolution``), so there a convolution's backward gets whatever layouts the saved and
recomputed values have. How much a library allocates inside itself depends on those layouts: a
depthwise 3x3 convolution's backward on 2 x 48 x 48 x 48 allocates 3.5 kB in channels-last, 1.77 MB
contiguous, and 2.65 MB with the contiguous gradient and the (n, h, c, w)-ordered input Inductor
handed it in a drawn MobileNet-style CNN (corpus model cnn-1294, whose checked peak was 4.3% under
the measured step: 10.168 MB checked, 10.605 MB measured).

The generated code states every layout: each buffer's ``empty_strided`` sizes and strides, each
input's ``assert_size_stride``, each view's ``reinterpret_tensor``. So once Inductor has generated a
graph, each of its library calls (``torch.ops.<ns>.<op>.<overload>(...)`` or ``aten.<op>.<overload>(...)``
statements of ops the joint-graph probe measures, and of every ``aten`` op not known to allocate
nothing) is run once more on random tensors of exactly those layouts, and its scratch is measured the
same way (``library_scratch.scratch_of_prepared``, one call at a time), by the name the call's result is bound to, or the
statement of a call in place (``GraphCode.call_scratch``; ``GraphCode.remeasured_calls``: the ops
every call of which was measured). Some calls exist only in the generated code: Inductor falls back
to ``aten.scatter_reduce_`` in place for a max-pool's backward (corpus net rand-1321), which the joint
graph's probe never saw; the check did not trust a peak below the simulator's with an unmeasured call
in it, so plans there were accepted on a simulation 18.8% over the measured step (1,652,072 B
simulated, 1,390,512 B measured; checked 1,390,504 B). Inductor's check (``inductor_check.replay_wrapper``) counts,
per call, this measurement where there is one (it is of that very call) and the joint graph's
otherwise. The joint graph's table is keyed by (op, output index, output sizes), which two calls can
share: in a drawn ResNet-style CNN (cnn-1295) an 8-channel convolution's backward and a 16-channel
one's have the same weight-gradient sizes, and the table's 127 kB (the larger) charged both; the
check was 2.9% over the measured step, and exact (3,843,424 B vs 3,843,432 B) once each call is
charged its own. The extern kernels the wrapper calls by their own names are measured as the ATen
overloads they are: a convolution recomputed in a backward (``extern_kernels.convolution``), and a
matrix product outside float32/float64 (``extern_kernels.mm(..., out=buf)``: oneDNN packs bfloat16
operands). A library output's dtype, which its ``assert_size_stride`` does not state, is the FX graph's
(``graph_code.library_dtypes``): under bf16 autocast the graph's most common dtype, float32, made a
bfloat16 convolution backward measure 12 kB where it allocates 588 kB (cnn-1364).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import logging
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from .cost_model.calibrate import TensorLayout
from .cost_model.hardware import real_tensors
from .graph_code import GraphCode, activation_dtype, library_dtypes
from .simulator.library_scratch import ProbedCall, prepared_call, scratch_of_prepared
from .cost_model.inductor_rules import COLLECTIVE_NAMESPACES, EXACT_LIBRARY_CALLS, MATMUL_CALLS, allocates_nothing
from .wrapper_text import ALLOC, ASSERT_SIZE, LIBRARY_CALL, call_body, ints_or_none

ATEN_CALL = re.compile(r"\b(?:torch\.ops\.)?aten\.(\w+)\.\w+\(")     # ``aten.op.overload(`` -> op
EXTERN_MATMUL = re.compile(rf"\bextern_kernels\.({'|'.join(sorted(MATMUL_CALLS))})\(")   # ``extern_kernels.mm(`` -> "mm"

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class WrapperCall:
    """One library call of a wrapper, its tensor arguments replaced by their layouts (``calibrate.TensorLayout``,
    as the joint graph's probe describes its calls: ``library_scratch.ProbedCall``)."""

    result: str                     # the name its result is bound to ("buf12"); for a call whose result is
                                    # not bound (in place), its statement as ``call_body`` gives it
    op: str                         # "aten.convolution_backward.default"
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    # the places of its returned tuple the wrapper reads (``buf3 = buf2[1]``); None: a single tensor
    read_places: Optional[frozenset[int]] = None


def _ints(node: ast.AST) -> Optional[tuple[int, ...]]:
    try:
        value = ast.literal_eval(node)
    except (ValueError, SyntaxError):
        return None
    if isinstance(value, int):
        value = (value,)
    return tuple(value) if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value) else None


class _Unreadable(Exception):
    """An argument the wrapper's text does not state exactly (a symbol, an unknown name)."""


def _argument(node: ast.AST, layouts: Mapping[str, TensorLayout]) -> Any:
    if isinstance(node, ast.Name):
        if node.id in layouts:
            return layouts[node.id]
        if node.id in ("None", "True", "False"):
            return ast.literal_eval(node)
        raise _Unreadable(node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "reinterpret_tensor":
        base, sizes, strides = node.args[0], _ints(node.args[1]), _ints(node.args[2])
        if not isinstance(base, ast.Name) or base.id not in layouts or sizes is None or strides is None:
            raise _Unreadable(ast.unparse(node))
        return TensorLayout(sizes, strides, layouts[base.id].dtype)
    if isinstance(node, (ast.List, ast.Tuple)):
        values = [_argument(element, layouts) for element in node.elts]
        return values if isinstance(node, ast.List) else tuple(values)
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError):
        raise _Unreadable(ast.unparse(node)) from None


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def _library_op(func: ast.AST) -> Optional[str]:
    """``ns.op.overload`` of a call to ``torch.ops.ns.op.overload`` or to ``aten.op.overload`` (the wrapper's
    alias of ``torch.ops.aten``), and the overload taking the same arguments of an extern kernel the wrapper
    calls by its own name: a matrix product ``extern_kernels.mm(..., out=buf)`` (``aten.mm.out``), a
    convolution ``extern_kernels.convolution(x, w, stride=..., bias=...)`` (``aten.convolution.default``,
    ``torch.convolution``'s keywords: a forward convolution recomputed in a backward, whose inputs come in
    the layouts the backward gives them); else None."""
    dotted = _dotted(func)
    if dotted.startswith("torch.ops."):
        return dotted[len("torch.ops."):]
    if dotted.startswith("aten."):
        return dotted
    name = dotted.split(".")[1] if dotted.startswith("extern_kernels.") else ""
    if name in MATMUL_CALLS:
        return f"aten.{name}.out"
    return "aten.convolution.default" if name == "convolution" else None


def wrapper_calls(body: Sequence[str], input_dtypes: Mapping[str, torch.dtype], ops: frozenset[str],
                  fallback_dtype: torch.dtype,
                  library_dtypes: Mapping[tuple[str, int], torch.dtype] = {}) -> list[WrapperCall]:
    """The calls of ``body`` (a wrapper's ``call`` statements) to ``torch.ops`` overloads (or ``aten.``,
    the wrapper's alias, or the extern kernels ``_library_op`` maps to one), bound to a name or in place,
    whose short names are in ``ops`` (collectives never; a matrix product in float32 never: it allocates
    nothing), with their tensor arguments' layouts, in order. A layout comes from the
    buffer's ``empty_strided``, a view's ``reinterpret_tensor``, or the ``assert_size_stride`` of an
    input (dtype: ``input_dtypes``) or of a library call's output (dtype not stated: the FX graph's, by the
    op the assert names and the output's place in its tuple, ``graph_code.library_dtypes``, else
    ``fallback_dtype``, the graph's activation dtype). A call with an argument the text does not state is
    left out. A call whose result is a tuple carries the places the wrapper reads (``read_places``)."""
    layouts: dict[str, TensorLayout] = {}
    element_index: dict[str, int] = {}          # ``buf3 = buf2[1]``: buf3 is element 1 of a library call's tuple
    places_read: dict[str, set[int]] = {}       # ``buf3 = buf2[1]``: place 1 of buf2 is read
    calls: list[WrapperCall] = []
    for statement in body:
        if (match := ALLOC.match(statement)):
            name, _, shape, stride, dtype = match.groups()
            sizes, steps = ints_or_none(shape), ints_or_none(stride)
            if sizes is not None and steps is not None and isinstance(getattr(torch, dtype, None), torch.dtype):
                layouts[name] = TensorLayout(tuple(sizes), tuple(steps), getattr(torch, dtype))
            continue
        if (match := ASSERT_SIZE.match(statement)):
            name, sizes, steps = match.group(1), ints_or_none(match.group(2)), ints_or_none(match.group(3))
            if sizes is not None and steps is not None:
                output_of = (match.group(4) or "", element_index.get(name, -1))
                dtype = input_dtypes.get(name) or library_dtypes.get(output_of) or fallback_dtype
                layouts[name] = TensorLayout(tuple(sizes), tuple(steps), dtype)
            continue
        try:
            tree = ast.parse(statement)
        except SyntaxError:
            continue
        if len(tree.body) != 1:
            continue
        if isinstance(tree.body[0], ast.Expr):       # a call whose result is not bound: in place (``aten.scatter_reduce_``)
            target, value = None, tree.body[0].value
        elif isinstance(tree.body[0], ast.Assign) and len(tree.body[0].targets) == 1:
            target, value = tree.body[0].targets[0], tree.body[0].value
            if not isinstance(target, ast.Name):
                continue
        else:
            continue
        if target is not None and isinstance(value, ast.Name) and value.id in layouts:   # another name for a value
            layouts[target.id] = layouts[value.id]
        elif (target is not None and isinstance(value, ast.Subscript) and isinstance(value.slice, ast.Constant)
              and isinstance(value.slice.value, int)):
            element_index[target.id] = value.slice.value
            if isinstance(value.value, ast.Name):
                places_read.setdefault(value.value.id, set()).add(value.slice.value)
        elif (target is not None and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
              and value.func.id == "reinterpret_tensor"):
            try:
                layouts[target.id] = _argument(value, layouts)
            except _Unreadable:
                pass
        elif isinstance(value, ast.Call) and (op := _library_op(value.func)) is not None:
            if op.count(".") != 2 or op.split(".")[1] not in ops or op.split(".")[0] in COLLECTIVE_NAMESPACES:
                continue
            try:
                args = tuple(_argument(a, layouts) for a in value.args)
                kwargs = {k.arg: _argument(k.value, layouts) for k in value.keywords if k.arg is not None}
            except _Unreadable as unreadable:
                log.debug("library call not re-measured (%s unreadable): %s", unreadable, statement[:200])
                continue
            out = kwargs.get("out")
            if allocates_nothing(op.split(".")[1], out.dtype if isinstance(out, TensorLayout) else None):
                continue    # a float32 matrix product: nothing to measure
            calls.append(WrapperCall(target.id if target is not None else statement, op, args, kwargs))
    return [dataclasses.replace(call, read_places=frozenset(places_read[call.result])) if call.result in places_read
            else call for call in calls]


def scratch_at_wrapper_layouts(source_code: str, input_dtypes: Mapping[str, torch.dtype], ops: frozenset[str],
                               device: torch.device, fallback_dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Each library call of the wrapper ``source_code`` (of ops in ``ops``, by short name), run on
    random tensors of the layouts the wrapper hands it: its measured scratch, by the name its result
    is bound to (for a call in place, its statement). Random number generators are restored
    afterwards; empty when the code has no readable ``call`` or no measurement can be made here now."""
    body = call_body(source_code)
    if body is None:
        return {}
    return {call.result: nbytes for call, nbytes in _measured_calls(body, input_dtypes, ops, device, fallback_dtype)}


def _measured_calls(body: Sequence[str], input_dtypes: Mapping[str, torch.dtype], ops: frozenset[str],
                    device: torch.device, fallback_dtype: torch.dtype,
                    library_dtypes: Mapping[tuple[str, int], torch.dtype] = {}) -> list[tuple[WrapperCall, int]]:
    """The library calls of ``body`` (of ops in ``ops``) that could run on random tensors of their
    layouts, each with its measured scratch; empty when no measurement can be made here now."""
    calls = wrapper_calls(body, input_dtypes, ops, fallback_dtype, library_dtypes) if ops else []
    if not calls:
        return []
    devices = [device] if device.type == "cuda" else []
    with real_tensors(), torch.random.fork_rng(devices=devices):
        # each call made on random tensors of its layouts as the joint graph's probe makes its calls; a tuple's
        # places the wrapper never reads are the call's working memory (``library_scratch.keeping_places``)
        scratch = scratch_of_prepared([functools.partial(prepared_call, ProbedCall(call.op, call.args, call.kwargs,
                                                                                   call.read_places), device)
                                       for call in calls], device)
    if scratch is None:
        return []
    return [(call, int(nbytes)) for call, nbytes in zip(calls, scratch) if nbytes is not None]


@dataclass(frozen=True)
class CallInputs:
    """What re-measuring a generated wrapper's library calls needs of its graph (read before Inductor's
    post-grad passes change it): the inputs' dtypes by name, the device, the activation dtype, and the
    library calls' output dtypes (``graph_code.library_dtypes``)."""

    dtypes: Mapping[str, torch.dtype]
    device: torch.device
    activation_dtype: torch.dtype
    library_dtypes: Mapping[tuple[str, int], torch.dtype] = dataclasses.field(default_factory=dict)


def call_inputs(gm: torch.fx.GraphModule) -> CallInputs:
    values = {n.name: n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"}
    tensors = {name: v for name, v in values.items() if isinstance(v, torch.Tensor)}
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    return CallInputs({name: v.dtype for name, v in tensors.items()}, device, activation_dtype(gm), library_dtypes(gm))


def with_scratch_at_generated_layouts(code: GraphCode, inputs: CallInputs) -> GraphCode:
    """``code`` with ``call_scratch``: what each library call allocates inside itself in the layouts its
    generated wrapper hands it (the check counts it in place of the joint graph's probe for that
    call), and ``remeasured_calls``: the ops every call of which was measured so. The calls run are
    those of ops the joint graph's probe measured and every ``aten`` call that is not known to
    allocate nothing (``EXACT_LIBRARY_CALLS``): Inductor falls back to some only in the code it
    generates (``aten.scatter_reduce_`` for a max-pool's backward, in place, whose working memory is
    0 bytes for a sum and 98 kB for a mean on the same 768 x 64 buffer)."""
    body = call_body(code.source_code)
    if body is None:
        return code
    matmuls = frozenset(op for statement in body for op in EXTERN_MATMUL.findall(statement))   # measured if not float32
    ops = code.measured_calls | (frozenset(ATEN_CALL.findall(" ".join(body))) - EXACT_LIBRARY_CALLS) | matmuls
    measured = _measured_calls(body, inputs.dtypes, ops, inputs.device, inputs.activation_dtype, inputs.library_dtypes)
    if not measured:
        return code
    # an op is measured throughout when every statement calling it is among the calls measured
    calls = Counter(op for statement in body for op in {a or b for a, b in LIBRARY_CALL.findall(statement)} & ops)
    measured_per_op = Counter(call.op.split(".")[1] for call, _ in measured)
    return dataclasses.replace(code, call_scratch={call.result: nbytes for call, nbytes in measured},
                               remeasured_calls=frozenset(op for op, n in calls.items() if measured_per_op[op] == n))


__all__ = ["CallInputs", "WrapperCall", "call_inputs", "scratch_at_wrapper_layouts", "with_scratch_at_generated_layouts",
           "wrapper_calls"]
