"""FLOPs per FX node.

Where ``torch.utils.flop_counter`` has a formula for the op (matmuls,
convolutions, attention), that formula is used, so totals match
``FlopCounterMode``. For every other op a documented estimate is used and the
node is marked as having no formula: pointwise ops count one FLOP per output
element, reductions one per input element, views and data movement zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry

from .tensors import concrete_int, is_aliasing_op, node_val, op_tags

_DATA_MOVEMENT = {
    "clone", "copy", "copy_", "_to_copy", "cat", "stack", "index", "index_select", "gather",
    "scatter", "scatter_add", "embedding", "full", "empty", "zeros", "ones", "iota", "arange",
    "constant_pad_nd", "slice_scatter", "select_scatter", "as_strided_scatter", "new_zeros",
    "new_empty", "new_ones", "full_like", "zeros_like", "empty_like", "ones_like", "empty_strided",
    "index_put", "embedding_dense_backward", "lift_fresh_copy", "convert_element_type",
}


@dataclass(frozen=True)
class FlopEstimate:
    flops: int
    has_formula: bool   # True when the number came from torch's flop_counter registry or is exact by construction
    rule: str           # which rule produced it, for the report


def node_flops(node: fx.Node) -> FlopEstimate:
    if node.op != "call_function":
        return FlopEstimate(0, True, "not an op")
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return FlopEstimate(0, True, "python builtin")
    if packet in flop_registry:
        args = fx.node.map_arg(node.args, lambda n: node_val(n))
        kwargs = fx.node.map_arg(node.kwargs, lambda n: node_val(n))
        try:
            flops = flop_registry[packet](*args, **kwargs, out_val=node_val(node))
            return FlopEstimate(concrete_int(flops), True, "flop_counter")
        except Exception:  # a formula that cannot take these (symbolic) args: fall through
            pass
    if is_aliasing_op(node):
        return FlopEstimate(0, True, "view")
    name = packet.__name__.split(".")[-1]
    if name in _DATA_MOVEMENT:
        return FlopEstimate(0, True, "data movement")
    out_elems = _numel(node_val(node))
    tags = op_tags(node)
    if torch.Tag.pointwise in tags:
        return FlopEstimate(out_elems, False, "pointwise: 1 per output element")
    if torch.Tag.reduction in tags or name in {"sum", "mean", "amax", "amin", "var_mean", "var", "any", "all", "max", "min", "argmax", "argmin", "prod", "logsumexp"}:
        in_elems = sum(_numel(node_val(a)) for a in node.all_input_nodes)
        return FlopEstimate(in_elems, False, "reduction: 1 per input element")
    return FlopEstimate(out_elems, False, "default: 1 per output element")


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return concrete_int(value.numel())
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


__all__ = ["FlopEstimate", "node_flops"]
