"""What Inductor's check needs of a compiled graph besides its generated code, read from the FX graph
handed to Inductor (before its post-grad passes): the names of its inputs and outputs, the bytes of
each input, the item sizes of its library calls' outputs (the generated code states their sizes, not
their dtypes), and the working memory of its library calls that the joint graph's probe measured
(``simulator/library_scratch.py``). ``graph_code`` bundles them with the wrapper source as a
``GraphCode``, which ``inductor_check`` replays."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch

from .cost_model.inductor_rules import allocates_nothing
from .simulator.library_scratch import SCRATCH_META
from .wrapper_text import ints_or_none


@dataclass(frozen=True)
class GraphCode:
    """One graph as Inductor compiled it: its wrapper source, the FX names of its inputs and
    outputs (in the wrapper's order; "" for an output that is not a node), and the storage
    bytes of each input tensor (0 for non-tensors)."""

    source_code: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    input_bytes: tuple[int, ...]
    # the item size of a library call's output, by (op as ``aten.x.default``, index in its tuple or
    # -1 for a single tensor), where every node of that op in the FX graph agrees (``library_itemsizes``)
    library_itemsizes: Mapping[tuple[str, int], int] = field(default_factory=dict)
    # a library call's measured working memory (``simulator/library_scratch.py``), by (op as ``aten.x.default``,
    # index in its tuple or -1, the output's sizes): added on top of what is live once that output exists
    library_scratch: Mapping[tuple[str, int, tuple[int, ...]], int] = field(default_factory=dict)
    # a library call's working memory measured in the layouts this code hands it, by the name the call's
    # result is bound to or, for a call in place, its statement (``wrapper_call_scratch``); where a call
    # has one, it replaces ``library_scratch``'s
    call_scratch: Mapping[str, int] = field(default_factory=dict)
    # ops (short names) every call of which in this code was measured so (``call_scratch``)
    remeasured_calls: frozenset[str] = frozenset()
    # ops (by short name, as ``library_calls`` names them) every node of which in the FX graph had its
    # working memory measured, and ops some node of which did not (``measured_calls``)
    measured_calls: frozenset[str] = frozenset()
    unmeasured_calls: frozenset[str] = frozenset()


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size() if not _symbolic(value) else 0
    return 0


def _symbolic(value: torch.Tensor) -> bool:
    return any(not isinstance(d, int) for d in value.shape)


def activation_dtype(gm: torch.fx.GraphModule) -> torch.dtype:
    """The graph's most common floating-point dtype among its values (float32 if none)."""
    counts: dict[torch.dtype, int] = {}
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype.is_floating_point:
            counts[value.dtype] = counts.get(value.dtype, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def activation_itemsize(gm: torch.fx.GraphModule) -> int:
    """The item size of ``activation_dtype(gm)``."""
    return activation_dtype(gm).itemsize


def _tensor_outputs(node: torch.fx.Node) -> list[tuple[int, torch.Tensor]]:
    """``(index, value)`` of each tensor a node's meta value holds: its place in the op's tuple, or -1
    for a single tensor (the index the generated code's tuple elements use)."""
    value = node.meta.get("val")
    outputs = [(-1, value)] if isinstance(value, torch.Tensor) else list(enumerate(value)) if isinstance(value, (tuple, list)) else []
    return [(index, output) for index, output in outputs if isinstance(output, torch.Tensor)]


def library_itemsizes(gm: torch.fx.GraphModule) -> dict[tuple[str, int], int]:
    """The item size of each op's outputs in ``gm``, by ``(op, index)`` (``op`` as ``aten.x.default``,
    ``index`` the output's place in the op's tuple, -1 for a single tensor), kept only where every
    node of that op agrees. The generated code names the op of a library call (its
    ``assert_size_stride``) but not the dtype of what it returns; Inductor keeps a library call's
    output dtypes as the FX graph states them, so this table gives them. An op whose nodes disagree
    (e.g. one call in float32 and one in bfloat16) is left out: its outputs stay of unknown dtype."""
    seen = _output_dtypes(gm)
    sizes = {key: {dtype.itemsize for dtype in dtypes} for key, dtypes in seen.items()}
    return {key: size.pop() for key, size in sizes.items() if len(size) == 1}


def library_dtypes(gm: torch.fx.GraphModule) -> dict[tuple[str, int], torch.dtype]:
    """As ``library_itemsizes``, the dtypes themselves: what a re-measured call's outputs are made of
    (``wrapper_call_scratch``; under bf16 autocast most of a backward's library outputs are bfloat16 where
    the graph's most common dtype, the fallback, is float32)."""
    return {key: next(iter(dtypes)) for key, dtypes in _output_dtypes(gm).items() if len(dtypes) == 1}


def _output_dtypes(gm: torch.fx.GraphModule) -> dict[tuple[str, int], set[torch.dtype]]:
    seen: dict[tuple[str, int], set[torch.dtype]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for index, output in _tensor_outputs(node):
            seen.setdefault((str(node.target), index), set()).add(output.dtype)
    return seen


def library_scratch(gm: torch.fx.GraphModule) -> dict[tuple[str, int, tuple[int, ...]], int]:
    """The measured working memory of ``gm``'s library calls (``SCRATCH_META`` on a node, set where the
    joint graph is prepared and kept by the partition's copies), by ``(op, index, sizes)`` of each of
    its outputs (``op`` as ``aten.x.default``, ``index`` its place in the op's tuple or -1): the key the
    generated code's ``assert_size_stride`` of that output gives. Calls sharing a key keep the largest."""
    table: dict[tuple[str, int, tuple[int, ...]], int] = {}
    for node in gm.graph.nodes:
        scratch = node.meta.get(SCRATCH_META, 0)
        if not scratch or node.op != "call_function":
            continue
        for index, output in _tensor_outputs(node):
            sizes = ints_or_none(",".join(str(s) for s in output.shape))   # None for a symbolic size
            if sizes is not None:
                key = (str(node.target), index, tuple(sizes))
                table[key] = max(table.get(key, 0), int(scratch))
    return table


def measured_calls(gm: torch.fx.GraphModule) -> tuple[frozenset[str], frozenset[str]]:
    """The ops of ``gm`` by short name (``aten.x.default`` -> "x") every node of which carries its
    measured working memory (``SCRATCH_META``, 0 included) or is known to allocate nothing
    (``inductor_rules.allocates_nothing``: a float32 matrix product), and those some node of which
    is neither (a bfloat16 matrix product the probe did not measure)."""
    measured: set[str] = set()
    unmeasured: set[str] = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            short = str(node.target).split(".")[1]
            value = node.meta.get("val")
            exact = allocates_nothing(short, value.dtype if isinstance(value, torch.Tensor) else None)
            (measured if SCRATCH_META in node.meta or exact else unmeasured).add(short)
    return frozenset(measured - unmeasured), frozenset(unmeasured)


def graph_code(gm: torch.fx.GraphModule, source_code: str) -> GraphCode:
    """``GraphCode`` of ``gm`` (as handed to Inductor, before its post-grad passes: the names the
    partitioner gave, the dtypes of its library calls' outputs) and the wrapper source Inductor
    generated for it."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    measured = measured_calls(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return GraphCode(source_code, tuple(n.name for n in placeholders),
                     tuple(v.name if isinstance(v, torch.fx.Node) else "" for v in values),
                     tuple(_nbytes(n.meta.get("val")) for n in placeholders), library_itemsizes(gm),
                     library_scratch=library_scratch(gm),
                     measured_calls=measured[0], unmeasured_calls=measured[1])


__all__ = ["GraphCode", "activation_dtype", "activation_itemsize", "graph_code", "library_dtypes", "library_itemsizes",
           "library_scratch",
           "measured_calls"]
