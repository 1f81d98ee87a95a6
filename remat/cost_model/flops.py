"""FLOPs per FX node.

Rules, in the order they are tried (``FlopEstimate.rule`` names the one used):

1. ``"flop_counter"``: the op has a formula in ``torch.utils.flop_counter``'s
   registry (matmuls, convolutions, attention). Totals over these nodes equal
   what ``FlopCounterMode`` counts for the same ops.
2. ``"remat formula: ..."``: a formula of ours for a compute-heavy op torch's
   registry lacks (``EXTRA_FLOP_FORMULAS``: the CPU flash-attention kernels,
   counted like their CUDA siblings). ``FlopCounterMode(custom_mapping=
   EXTRA_FLOP_FORMULAS)`` counts them the same way.
3. Zero, exact by construction: views, getitems and data movement (copies,
   fills, gathers, dtype casts) do no arithmetic.
4. Estimates (``has_formula=False``): a composite op Inductor decomposes
   (``native_layer_norm``, ``gelu_backward``, ...) counts the FLOPs of its
   decomposition per element of its largest tensor (``COMPOSITE_FLOPS_PER_ELEMENT``);
   a pointwise op counts 1 per output element; a reduction 1 per input element;
   anything else 1 per output element.

Apart from FLOPs, ``node_special_ops`` counts special-function evaluations
(exp, erf, tanh, ...) and random numbers drawn, which the roofline charges at
their own rates.

Sizes may be symbolic: ``node_flops_value`` keeps the SymInt (see ``symbolic.py``
for the formula), ``node_flops`` evaluates it at its hint.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

from .inductor_rules import REDUCTION_OPS
from .tensors import concrete_int, is_aliasing_op, iter_tensors, node_val, op_tags

aten = torch.ops.aten

TORCH_RULE = "flop_counter"


def _sdpa_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# Shape-based formulas, in the form FlopCounterMode's ``custom_mapping`` takes.
# Causal masking is not discounted, as torch's own attention formulas do not.
EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
}
_EXTRA_WRAPPED = {packet: shape_wrapper(fn) for packet, fn in EXTRA_FLOP_FORMULAS.items()}

# FLOPs per element of the op's largest tensor: the sum of rules 3-4 over the ops
# Inductor's decomposition table turns it into, counting the full-size ops only
# (terms on the reduced tensors, e.g. layer norm's rsqrt over rows, are dropped).
# tests/test_cost_model.py re-derives every entry from the decomposition.
COMPOSITE_FLOPS_PER_ELEMENT: dict[str, int] = {
    "gelu": 5, "gelu_backward": 11, "silu": 4, "silu_backward": 6,
    "_softmax": 5, "_log_softmax": 5, "_softmax_backward_data": 4, "_log_softmax_backward_data": 4,
    "native_layer_norm": 5, "native_layer_norm_backward": 14,
    "_native_batch_norm_legit_functional": 5, "native_batch_norm_backward": 9,
    "native_dropout": 4, "native_dropout_backward": 2,
    "sigmoid_backward": 3, "tanh_backward": 3, "threshold_backward": 2,
}

# Special-function evaluations and random numbers per element of the op's
# largest tensor. A CPU evaluates an exp or draws a random number an order of
# magnitude slower than it adds, so the roofline charges these at their own
# measured rates (``HardwareProfile.transcendentals_per_s`` / ``random_values_per_s``),
# as XLA's cost analysis counts "transcendentals" apart from FLOPs. Composites
# count the special functions of their decomposition (gelu_backward: erf and exp).
TRANSCENDENTALS_PER_ELEMENT: dict[str, int] = {
    "exp": 1, "exp2": 1, "expm1": 1, "log": 1, "log2": 1, "log10": 1, "log1p": 1, "erf": 1, "erfc": 1,
    "erfinv": 1, "tanh": 1, "sigmoid": 1, "sin": 1, "cos": 1, "tan": 1, "asin": 1, "acos": 1, "atan": 1,
    "atan2": 1, "sinh": 1, "cosh": 1, "asinh": 1, "acosh": 1, "atanh": 1, "lgamma": 1, "digamma": 1,
    "gelu": 1, "gelu_backward": 2, "silu": 1, "silu_backward": 1, "_softmax": 1, "_log_softmax": 1,
    "_log_softmax_backward_data": 1, "logsumexp": 1, "softplus": 2, "elu": 1, "mish": 2, "logit": 1,
}
RANDOM_VALUES_PER_ELEMENT: dict[str, int] = {
    "rand": 1, "randn": 1, "rand_like": 1, "randn_like": 1, "inductor_random": 1, "native_dropout": 1,
    "bernoulli": 1, "normal": 1, "uniform": 1, "randint": 1, "randint_like": 1, "exponential": 1,
}

DATA_MOVEMENT_OPS = frozenset({
    "clone", "copy", "copy_", "_to_copy", "cat", "stack", "index", "index_select", "gather",
    "scatter", "embedding", "full", "empty", "zeros", "ones", "iota", "arange",
    "constant_pad_nd", "slice_scatter", "select_scatter", "as_strided_scatter", "new_zeros",
    "new_empty", "new_ones", "full_like", "zeros_like", "empty_like", "ones_like", "empty_strided",
    "lift_fresh_copy", "convert_element_type", "scalar_tensor", "_unsafe_view", "slice_backward",
    "select_backward", "masked_fill", "repeat", "tril", "triu", "flip", "roll",
})


@dataclass(frozen=True)
class FlopEstimate:
    flops: int
    has_formula: bool   # True for torch's and remat's formulas and for exact zeros; False for estimates
    rule: str           # which rule produced it, for the report


@dataclass(frozen=True)
class _FlopValue:
    value: Any          # int, or SymInt under dynamic shapes
    has_formula: bool
    rule: str


def _numel(value: Any) -> Any:
    total: Any = 0
    for tensor in iter_tensors(value):
        total = total + tensor.numel()
    return total


def _largest_numel(node: fx.Node) -> Any:
    """Element count of the largest tensor the node reads or writes (at the hint)."""
    values = [node_val(node)] + [node_val(arg) for arg in node.all_input_nodes]
    tensors = [t for v in values for t in iter_tensors(v)]
    if not tensors:
        return 0
    return max((t.numel() for t in tensors), key=concrete_int)


def _formula(node: fx.Node, formula: Callable[..., Any]) -> Any:
    args = fx.node.map_arg(node.args, node_val)
    kwargs = fx.node.map_arg(node.kwargs, node_val)
    return formula(*args, **kwargs, out_val=node_val(node))


def node_flops_value(node: fx.Node) -> _FlopValue:
    """Like ``node_flops`` but the count may be a SymInt (its formula in the shape symbols)."""
    if node.op != "call_function":
        return _FlopValue(0, True, "not an op")
    packet = getattr(node.target, "overloadpacket", None)
    if packet is None:
        return _FlopValue(0, True, "python builtin")
    for registry, rule in ((flop_registry, TORCH_RULE), (_EXTRA_WRAPPED, "remat formula: attention")):
        if packet in registry:
            try:
                return _FlopValue(_formula(node, registry[packet]), True, rule)
            except Exception:  # a formula that cannot take these args: fall through to the estimates
                break
    if is_aliasing_op(node):
        return _FlopValue(0, True, "view")
    name = packet.__name__.split(".")[-1]
    if name in DATA_MOVEMENT_OPS:
        return _FlopValue(0, True, "data movement")
    if name in COMPOSITE_FLOPS_PER_ELEMENT:
        per = COMPOSITE_FLOPS_PER_ELEMENT[name]
        return _FlopValue(per * _largest_numel(node), False, f"composite: {per} per element of its decomposition")
    if torch.Tag.pointwise in op_tags(node):
        return _FlopValue(_numel(node_val(node)), False, "pointwise: 1 per output element")
    if torch.Tag.reduction in op_tags(node) or name in REDUCTION_OPS:
        in_elems: Any = 0
        for arg in node.all_input_nodes:
            in_elems = in_elems + _numel(node_val(arg))
        return _FlopValue(in_elems, False, "reduction: 1 per input element")
    return _FlopValue(_numel(node_val(node)), False, "default: 1 per output element")


def node_flops(node: fx.Node) -> FlopEstimate:
    """FLOPs of running ``node`` once, evaluated at the size hints."""
    value = node_flops_value(node)
    return FlopEstimate(concrete_int(value.value), value.has_formula, value.rule)


def node_special_ops_value(node: fx.Node) -> tuple[Any, Any]:
    """(transcendental evaluations, random values) of ``node``; SymInts under dynamic shapes."""
    packet = getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None
    if packet is None:
        return 0, 0
    name = packet.__name__.split(".")[-1]
    per_t, per_r = TRANSCENDENTALS_PER_ELEMENT.get(name, 0), RANDOM_VALUES_PER_ELEMENT.get(name, 0)
    if not per_t and not per_r:
        return 0, 0
    elements = _largest_numel(node)
    return per_t * elements, per_r * elements


def node_special_ops(node: fx.Node) -> tuple[int, int]:
    """(transcendental evaluations, random values) of running ``node`` once, at the size hints."""
    transcendentals, randoms = node_special_ops_value(node)
    return concrete_int(transcendentals), concrete_int(randoms)


def ops_without_formula(nodes: Iterable[fx.Node]) -> Counter:
    """How many nodes of each op ("aten.mul.Tensor") have estimated, not counted, FLOPs."""
    counts: Counter = Counter()
    for node in nodes:
        if not node_flops_value(node).has_formula:
            counts[str(node.target)] += 1
    return counts


__all__ = [
    "COMPOSITE_FLOPS_PER_ELEMENT", "EXTRA_FLOP_FORMULAS", "RANDOM_VALUES_PER_ELEMENT", "TORCH_RULE",
    "TRANSCENDENTALS_PER_ELEMENT", "FlopEstimate", "node_flops", "node_flops_value", "node_special_ops",
    "node_special_ops_value", "ops_without_formula",
]
