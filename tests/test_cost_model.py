"""Cost model: FLOPs, bytes, fusion, roofline time, symbolic sizes.

Sizes are chosen so expected numbers are exact: a 512x512 fp32 tensor is 1 MiB,
a 512x512x512 matmul is 2*512^3 FLOPs. Graphs are traced with make_fx in fake
mode, or captured from AOTAutograd without compiling anything.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch._inductor import config as inductor_settings
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.flop_counter import FlopCounterMode

from remat.testing.zoo import ZOO, TwoLinear
from remat.cost_model.costs import (
    COST_KEY,
    NodeCost,
    annotate_costs,
    estimate_node_cost,
    graph_call_s,
    phase_totals,
    roofline_time_s,
)
from remat.cost_model.flops import (
    COMPOSITE_FLOPS_PER_ELEMENT,
    EXTRA_FLOP_FORMULAS,
    TORCH_RULE,
    RANDOM_VALUES_PER_ELEMENT,
    TRANSCENDENTALS_PER_ELEMENT,
    node_flops,
    node_special_ops,
    ops_without_formula,
)
from remat._torch_inductor import inductor_config
from remat.cost_model.fusion import find_fusion_groups
from remat.cost_model.hardware import DATASHEET_PROFILES, HardwareProfile
from remat.cost_model.loop_charges import split_kernel_loads
from remat.cost_model.phases import node_phases
from remat.cost_model.symbolic import (
    evaluate,
    format_expr,
    largest_value_that_fits,
    node_bytes_read_expr,
    node_bytes_written_expr,
    node_flops_expr,
    shape_hints,
    symbol_sources,
)
from remat.cost_model.tensors import is_free_op

aten = torch.ops.aten
MiB = 1 << 20
N = 512

# A round profile so expected times are arithmetic: 1 TFLOP/s, 100 GB/s, 1 us per kernel.
ROUND = HardwareProfile(name="round", flops_per_s={"float32": 1e12}, bandwidth_bytes_per_s=1e11,
                        kernel_launch_s=1e-6, source="test")


def trace(fn, *inputs) -> fx.Graph:
    return make_fx(fn, tracing_mode="fake")(*inputs).graph


def the_node(graph: fx.Graph, op_name: str) -> fx.Node:
    found = [n for n in graph.nodes if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] == op_name]
    assert len(found) == 1, f"{op_name}: {[str(n.target) for n in graph.nodes]}"
    return found[0]


def m(*shape):
    return torch.randn(*shape)


# ---------------------------------------------------------------- FLOPs and bytes, one op at a time

ONE_OP_CASES = [
    # id, fn, inputs, op, flops, bytes_read, bytes_written, rule
    ("mm 512^3 fp32", torch.mm, (m(N, N), m(N, N)), "mm", 2 * N**3, 2 * MiB, MiB, TORCH_RULE),
    ("addmm", torch.addmm, (m(N), m(N, N), m(N, N)), "addmm", 2 * N**3, 2 * MiB + 4 * N, MiB, TORCH_RULE),
    ("bmm", torch.bmm, (m(4, 128, 64), m(4, 64, 32)), "bmm", 2 * 4 * 128 * 64 * 32,
     4 * (4 * 128 * 64 + 4 * 64 * 32), 4 * 4 * 128 * 32, TORCH_RULE),
    ("conv2d 3x3", lambda x, w: F.conv2d(x, w, padding=1), (m(8, 16, 32, 32), m(32, 16, 3, 3)), "convolution",
     2 * (8 * 32 * 32 * 32) * (16 * 3 * 3), 4 * (8 * 16 * 32 * 32 + 32 * 16 * 9), 4 * 8 * 32 * 32 * 32, TORCH_RULE),
    ("sdpa on cpu", F.scaled_dot_product_attention, (m(2, 4, 128, 32), m(2, 4, 128, 32), m(2, 4, 128, 32)),
     "_scaled_dot_product_flash_attention_for_cpu", 2 * (2 * 2 * 4 * 128 * 32 * 128),
     3 * 4 * 2 * 4 * 128 * 32, 4 * 2 * 4 * 128 * 32 + 4 * 2 * 4 * 128, "remat formula: attention"),
    ("relu: pointwise", torch.relu, (m(N, N),), "relu", N * N, MiB, MiB, "pointwise: 1 per output element"),
    ("sum over rows: reduction", lambda x: x.sum(dim=1), (m(N, N),), "sum", N * N, MiB, 4 * N,
     "reduction: 1 per input element"),
    ("gelu: composite", F.gelu, (m(N, N),), "gelu", 5 * N * N, MiB, MiB, "composite: 5 per element of its decomposition"),
    ("clone: data movement", torch.clone, (m(N, N),), "clone", 0, MiB, MiB, "data movement"),
    ("expanded bias is read once", lambda x, b: x + b.expand(N, N), (m(N, N), m(N)), "add", N * N, MiB + 4 * N, MiB,
     "pointwise: 1 per output element"),
]


@pytest.mark.parametrize("fn,inputs,op,flops,read,written,rule",
                         [case[1:] for case in ONE_OP_CASES], ids=[case[0] for case in ONE_OP_CASES])
def test_one_op_flops_and_bytes(fn, inputs, op, flops, read, written, rule):
    node = the_node(trace(fn, *inputs), op)
    cost = estimate_node_cost(node, ROUND)
    assert (cost.flops, cost.bytes_read, cost.bytes_written, cost.flop_rule) == (flops, read, written, rule)


VIEW_CASES = [
    ("t", lambda x: x.t()), ("view", lambda x: x.view(N * N)), ("expand", lambda x: x[:1].expand(N, N)),
    ("transpose", lambda x: x.transpose(0, 1)), ("unsqueeze", lambda x: x.unsqueeze(0)),
    ("slice", lambda x: x[:, : N // 2]), ("split", lambda x: x.split(N // 2)[1]),
]


@pytest.mark.parametrize("fn", [c[1] for c in VIEW_CASES], ids=[c[0] for c in VIEW_CASES])
def test_views_and_getitems_cost_nothing(fn):
    graph = trace(fn, m(N, N))
    ops = [n for n in graph.nodes if n.op == "call_function"]
    assert ops
    for node in ops:
        assert is_free_op(node), node.format_node()
        assert estimate_node_cost(node, ROUND) == NodeCost(flop_rule="free", time_source="roofline")


SPECIAL_CASES = [
    # id, fn, inputs, op, transcendentals, random values
    ("exp", torch.exp, (m(N, N),), "exp", N * N, 0),
    ("erf", torch.erf, (m(N, N),), "erf", N * N, 0),
    ("gelu: one erf per element", F.gelu, (m(N, N),), "gelu", N * N, 0),
    ("softmax", lambda x: x.softmax(-1), (m(N, N),), "_softmax", N * N, 0),
    ("rand", lambda x: torch.rand_like(x), (m(N, N),), "rand_like", 0, N * N),
    ("dropout: one draw per element", lambda x: torch.ops.aten.native_dropout(x, 0.1, True), (m(N, N),),
     "native_dropout", 0, N * N),
    ("mul: neither", lambda x: x * 2, (m(N, N),), "mul", 0, 0),
]


@pytest.mark.parametrize("fn,inputs,op,transcendentals,randoms", [c[1:] for c in SPECIAL_CASES],
                         ids=[c[0] for c in SPECIAL_CASES])
def test_special_functions_and_random_numbers(fn, inputs, op, transcendentals, randoms):
    node = the_node(trace(fn, *inputs), op)
    assert node_special_ops(node) == (transcendentals, randoms)


# ---------------------------------------------------------------- roofline time

def test_roofline_mm_is_compute_bound_and_relu_memory_bound():
    graph = trace(lambda a, b: torch.mm(a, b).relu(), m(N, N), m(N, N))
    mm = estimate_node_cost(the_node(graph, "mm"), ROUND)
    relu = estimate_node_cost(the_node(graph, "relu"), ROUND)
    assert math.isclose(mm.est_time_s, 2 * N**3 / 1e12 + 1e-6)          # 2.68e-4 s compute > 3 MiB / 1e11
    assert math.isclose(relu.est_time_s, 2 * MiB / 1e11 + 1e-6)         # 2 MiB of traffic
    assert mm.est_time_s == mm.unfused_time_s and mm.launches == 1


def test_special_functions_are_charged_at_their_own_rate():
    slow_exp = HardwareProfile(name="round", flops_per_s={"float32": 1e12}, bandwidth_bytes_per_s=1e11,
                               kernel_launch_s=1e-6, source="test", transcendentals_per_s=1e9)
    exp = estimate_node_cost(the_node(trace(torch.exp, m(N, N)), "exp"), slow_exp)
    assert exp.transcendentals == N * N
    assert math.isclose(exp.est_time_s, N * N / 1e12 + N * N / 1e9 + 1e-6)   # 2.6e-4 s: above 2 MiB / 1e11
    assert math.isclose(estimate_node_cost(the_node(trace(torch.exp, m(N, N)), "exp"), ROUND).est_time_s,
                        2 * MiB / 1e11 + 1e-6)                                # rate 0: not charged


def test_bandwidth_level_by_working_set():
    cached = HardwareProfile(name="round", flops_per_s={"float32": 1e12}, bandwidth_bytes_per_s=1e11,
                             kernel_launch_s=0.0, source="test", bandwidth_levels=((MiB, 1e12),))
    small = estimate_node_cost(the_node(trace(torch.relu, m(256, 256)), "relu"), cached)   # 512 KiB: cache
    large = estimate_node_cost(the_node(trace(torch.relu, m(N, N)), "relu"), cached)       # 2 MiB: memory
    assert math.isclose(small.est_time_s, (MiB // 2) / 1e12)
    assert math.isclose(large.est_time_s, 2 * MiB / 1e11)


def test_fp32_matmul_uses_tf32_rate_only_when_torch_allows_it():
    big = 4 * N   # 2048^3: compute-bound on an H100 even at the TF32 rate
    node = the_node(trace(torch.mm, m(big, big), m(big, big)), "mm")
    h100 = DATASHEET_PROFILES["h100"]
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        highest = estimate_node_cost(node, h100).est_time_s
        torch.set_float32_matmul_precision("high")
        high = estimate_node_cost(node, h100).est_time_s
    finally:
        torch.set_float32_matmul_precision(before)
    assert math.isclose(highest, 2 * big**3 / 67e12 + 4e-6)
    assert math.isclose(high, 2 * big**3 / 495e12 + 4e-6)


def test_roofline_time_formula():
    assert roofline_time_s(ROUND, 2 * 10**12, 10**9, 3) == pytest.approx(2.0 + 3e-6)       # compute bound
    assert roofline_time_s(ROUND, 10**6, 10**12, 0) == pytest.approx(10.0)                # memory bound


def test_node_cost_adds_up():
    a = NodeCost(flops=1, bytes_read=2, bytes_written=3, est_time_s=0.5, fused_bytes_read=1, launches=1)
    b = NodeCost(flops=10, bytes_read=20, bytes_written=30, est_time_s=0.25, has_flop_formula=False,
                 measured_time_s=0.1, launches=1)
    total = a + b
    assert (total.flops, total.bytes_read, total.bytes_written, total.launches) == (11, 22, 33, 2)
    assert total.est_time_s == 0.75 and total.measured_time_s == 0.1 and not total.has_flop_formula


# ---------------------------------------------------------------- Inductor's generated loops and library rates

# What the profile measured Inductor's CPU loops pay beyond the roofline (loop_costs.py), in round numbers
LOOPY = HardwareProfile(
    name="round", flops_per_s={"float32": 1e12}, bandwidth_bytes_per_s=1e11, kernel_launch_s=1e-6, source="test",
    random_values_per_s=1e9,
    loop_costs_s={"random_value": 8e-9, "bool_store": 6e-9, "bool_load": 1e-9, "welford_long": 2e-10,
                  "kernel_call": 3e-6, "graph_call": 5e-5, "graph_input": 7e-7})


def test_a_dropout_mask_pays_inductors_rng_and_bool_store():
    graph = trace(lambda x: (lambda keep: (keep, x * keep))(torch.rand_like(x) > 0.1), m(N, N))
    costs = annotate_costs(graph, LOOPY)
    rand, gt, mul = (the_node(graph, op).name for op in ("rand_like", "gt", "mul"))
    assert costs[rand].fusion_group == costs[gt].fusion_group == costs[mul].fusion_group   # one kernel
    # random numbers at the loop's 8 ns instead of the eager 1 ns the roofline charges
    assert costs[rand].loop_extra_s == pytest.approx(N * N * (8e-9 - 1e-9))
    assert costs[gt].loop_extra_s == pytest.approx(N * N * 6e-9)    # the mask is returned: N*N bools stored
    assert costs[mul].loop_extra_s == 0.0                           # reads the mask in registers
    kernel = sum(costs[n].est_time_s for n in (rand, gt, mul))
    compute = N * N * 8e-9 + N * N * 6e-9 + 3 * N * N / 1e12    # each op: 1 FLOP per element (estimates)
    assert kernel == pytest.approx(compute + 3e-6)                    # compute-bound; one wrapper call
    assert annotate_costs(graph, ROUND)[gt].loop_extra_s == 0.0       # a profile without loop costs: none


@pytest.mark.parametrize("mask_shape,loaded", [((N, N), N * N), ((N,), N * N)], ids=["full", "broadcast"])
def test_a_bool_mask_loaded_from_memory_is_charged_per_element_read(mask_shape, loaded):
    graph = trace(lambda keep, x: x * keep, torch.ones(mask_shape, dtype=torch.bool), m(N, N))
    costs = annotate_costs(graph, LOOPY)
    assert costs[the_node(graph, "mul").name].loop_extra_s == pytest.approx(loaded * 1e-9)


@pytest.mark.parametrize("shape,dim,charged", [
    ((4096, 16), 0, 4096 * 16),     # batch-norm-like: 4096 elements per output, one long Welford chain each
    ((N, N), 1, 0),                 # layer-norm-like: 512 per row, chains overlap: the roofline holds
], ids=["long", "short"])
def test_long_welford_reductions_pay_per_element(shape, dim, charged):
    graph = trace(lambda x: torch.var_mean(x, dim=dim, correction=0), m(*shape))
    costs = annotate_costs(graph, LOOPY)
    assert costs[the_node(graph, "var_mean").name].loop_extra_s == pytest.approx(charged * 2e-10)


def test_a_reduction_and_its_epilogue_read_their_full_size_inputs_twice():
    """Batch norm's backward, in small: a column sum, then every element from it. Inductor runs two
    loop nests; the second reloads g and x."""
    graph = trace(lambda g, x: g - x * (g * x).sum(0, keepdim=True), m(N, N), m(N, N))
    groups = find_fusion_groups(graph)
    assert len(groups.members) == 1
    assert sorted(v for loads in split_kernel_loads(graph, groups).values() for v in loads) == ["g_1", "x_1"]
    costs = annotate_costs(graph, ROUND)
    assert sum(c.fused_bytes_read for c in costs.values()) == 4 * MiB   # 2 MiB in each pass
    # a row reduction whose epilogue reads only the reduced values reloads nothing
    plain = trace(lambda x: x.sum(1, keepdim=True) * 2.0, m(N, N))
    assert split_kernel_loads(plain, find_fusion_groups(plain)) == {}


def test_a_mask_the_kernel_stores_is_loaded_back_by_each_later_nest():
    """Dropout then layer norm, as in GPT's forward: the mask is stored for the backward, then the
    statistics' nest and the normalisation's nest each load it (and x) back."""
    def dropout_norm(x):
        keep = torch.rand_like(x) > 0.1
        y = x * keep
        return keep, y - y.mean(1, keepdim=True)

    graph = trace(dropout_norm, m(N, N))
    groups = find_fusion_groups(graph)
    assert len(groups.members) == 1
    keep = the_node(graph, "gt").name
    (loads,) = split_kernel_loads(graph, groups).values()
    assert sorted(loads) == sorted([keep, keep, "x_1"])
    costs = annotate_costs(graph, LOOPY)
    bool_loads = sum(c.loop_extra_s for c in costs.values()) - costs[keep].loop_extra_s \
        - costs[the_node(graph, "rand_like").name].loop_extra_s
    assert bool_loads == pytest.approx(2 * N * N * 1e-9)


def test_on_a_cpu_a_generated_loops_compute_and_memory_time_add_up():
    graph = trace(lambda x: x.relu() * 3.0, m(N, N))
    elsewhere = annotate_costs(graph, ROUND)
    on_cpu = annotate_costs(graph, HardwareProfile(name="cpu", flops_per_s={"float32": 1e12},
                                                   bandwidth_bytes_per_s=1e11, kernel_launch_s=1e-6, source="test"))
    compute, memory = 2 * N * N / 1e12, 2 * MiB / 1e11
    assert sum(c.est_time_s for c in elsewhere.values()) == pytest.approx(max(compute, memory) + 1e-6)
    assert sum(c.est_time_s for c in on_cpu.values()) == pytest.approx(compute + memory + 1e-6)


def test_convolution_runs_at_its_librarys_measured_rate():
    x, w = m(8, 64, 32, 32), m(64, 64, 3, 3)
    conv = the_node(trace(lambda x, w: F.conv2d(x, w, padding=1), x, w), "convolution")
    flops = 2 * 8 * 64 * 32 * 32 * 64 * 9
    fast_conv = HardwareProfile(name="round", flops_per_s={"float32": 1e12}, bandwidth_bytes_per_s=1e11,
                                kernel_launch_s=1e-6, source="test", library_flops_per_s={"convolution": 2e12})
    assert estimate_node_cost(conv, fast_conv).est_time_s == pytest.approx(flops / 2e12 + 1e-6)
    assert estimate_node_cost(conv, ROUND).est_time_s == pytest.approx(flops / 1e12 + 1e-6)
    # the rate was measured in fp32: a half-precision convolution keeps the dtype's peak
    assert fast_conv.library_rate("convolution", torch.bfloat16) is None
    # measured at two widths: a 64-channel convolution runs at the rate interpolated in log2(channels)
    by_width = HardwareProfile(name="round", flops_per_s={"float32": 1e12}, bandwidth_bytes_per_s=1e11,
                               kernel_launch_s=1e-6, source="test",
                               library_flops_per_s={"convolution@16": 1e12, "convolution@128": 4e12})
    assert estimate_node_cost(conv, by_width).est_time_s == pytest.approx(flops / 3e12 + 1e-6)


def test_phase_totals_add_each_phases_graph_call():
    # forward inputs: primals; backward inputs: the tangent and the forward value it reads (relu's output)
    graph = make_fx(lambda primals, tangents: (primals.relu(), tangents * primals.relu()))(m(N), m(N)).graph
    calls = graph_call_s(graph, LOOPY)
    assert calls == pytest.approx({"forward": 5e-5 + 1 * 7e-7, "backward": 5e-5 + 2 * 7e-7})
    costs = annotate_costs(graph, LOOPY)
    plain, called = phase_totals(graph, costs), phase_totals(graph, costs, per_graph_s=calls)
    for phase in ("forward", "backward"):
        assert called[phase].est_time_s == pytest.approx(plain[phase].est_time_s + calls[phase])
    no_backward = make_fx(lambda primals: primals.relu())(m(N)).graph
    totals = phase_totals(no_backward, annotate_costs(no_backward, LOOPY), per_graph_s={"backward": 5e-5})
    assert totals["backward"].est_time_s == 0.0     # no backward kernel, no backward graph to call
    assert graph_call_s(graph, ROUND) == {"forward": 0.0, "backward": 0.0}


# ---------------------------------------------------------------- fusion-aware traffic

def fused(graph: fx.Graph, name: str):
    costs = annotate_costs(graph, ROUND)
    return {n.name: costs[n.name] for n in graph.nodes}


def test_pointwise_chain_before_a_matmul_is_one_kernel_writing_only_its_end():
    graph = trace(lambda x, w: (x.relu() * 2 + 1) @ w, m(N, N), m(N, N))
    costs = annotate_costs(graph, ROUND)
    relu, mul, add, mm = (the_node(graph, op).name for op in ("relu", "mul", "add", "mm"))
    chain = [costs[relu], costs[mul], costs[add]]
    assert [c.fused_bytes_read for c in chain] == [MiB, 0, 0]          # x loaded once
    assert [c.fused_bytes_written for c in chain] == [0, 0, MiB]       # only what the matmul reads
    assert [c.launches for c in chain] == [0, 0, 1]
    assert sum(c.bytes_read + c.bytes_written for c in chain) == 6 * MiB   # unfused: each op reads and writes
    assert costs[relu].fusion_group == costs[add].fusion_group == relu
    assert costs[mm].fused_bytes_read == 2 * MiB and costs[mm].launches == 1
    assert sum(c.est_time_s for c in chain) == pytest.approx(2 * MiB / 1e11 + 1e-6)
    assert sum(c.unfused_time_s for c in chain) == pytest.approx(6 * MiB / 1e11 + 3e-6)


def test_softmax_is_one_kernel_reading_its_input_once():
    def softmax(x):
        e = (x - x.amax(-1, keepdim=True)).exp()
        return e / e.sum(-1, keepdim=True)

    graph = trace(softmax, m(N, N))
    groups = find_fusion_groups(graph)
    assert len(groups.members) == 1 and groups.kernel_count() == 1
    assert sum(groups.bytes_read.values()) == MiB and sum(groups.bytes_written.values()) == MiB


def test_residual_after_a_matmul_reads_the_saved_value():
    graph = trace(lambda x, w: (lambda h: (h @ w) + h)(x.relu()), m(N, N), m(N, N))
    groups = find_fusion_groups(graph)
    relu, add = the_node(graph, "relu").name, the_node(graph, "add").name
    assert groups.group_of[relu] != groups.group_of[add]      # add needs the matmul, which needs relu
    assert groups.bytes_written[relu] == MiB and groups.bytes_read[add] == 2 * MiB


def test_graph_outputs_are_written_even_inside_a_group():
    graph = trace(lambda x: (lambda r: (r, r * 2))(x.relu()), m(N, N))
    groups = find_fusion_groups(graph)
    relu, mul = the_node(graph, "relu").name, the_node(graph, "mul").name
    assert groups.group_of[relu] == groups.group_of[mul]
    assert (groups.bytes_written[relu], groups.bytes_written[mul]) == (MiB, MiB)   # both are graph outputs


def test_reduction_epilogue_over_its_result_is_fused():
    def batch_norm_like(x, running):
        mean = x.mean(0)
        return x - mean, running * 0.9 + mean * 0.1     # normalize, and update the running stat

    graph = trace(batch_norm_like, m(N, N), m(N))
    groups = find_fusion_groups(graph)
    assert groups.kernel_count() == 1
    assert sum(groups.bytes_read.values()) == MiB + 4 * N          # x once, the running stat once


def test_siblings_reading_the_same_tensor_share_a_kernel():
    graph = trace(lambda x, w: (lambda h: ((h * 2) @ w, (h * 3) @ w))(x @ w), m(N, N), m(N, N))
    groups = find_fusion_groups(graph)
    muls = [n.name for n in graph.nodes if n.target is aten.mul.Tensor]
    assert len(muls) == 2 and groups.group_of[muls[0]] == groups.group_of[muls[1]]
    assert sum(groups.bytes_read[n] for n in muls) == MiB             # the matmul's output, loaded once


def test_siblings_sharing_only_a_scalar_stay_apart():
    graph = trace(lambda x, y, z: (lambda s: (y * s, z * s))(x.sum()), m(16), m(N, N), m(N, N))
    groups = find_fusion_groups(graph)
    muls = [n.name for n in graph.nodes if n.target is aten.mul.Tensor]
    assert groups.group_of[muls[0]] != groups.group_of[muls[1]]


def test_forward_and_backward_never_share_a_kernel():
    graph = trace(lambda x: x.relu() * 2, m(N, N))
    the_node(graph, "relu").meta["partitioner_tag"] = "is_forward"
    the_node(graph, "mul").meta["partitioner_tag"] = "is_backward"
    groups = find_fusion_groups(graph)
    assert groups.kernel_count() == 2 and groups.bytes_written[the_node(graph, "relu").name] == MiB


def test_groups_stop_at_the_size_limit():
    """The limit is Inductor's ``max_fusion_size``, read when the graph is grouped, or the one given."""
    limit = inductor_config().max_fusion_size

    def chain(x):
        for _ in range(limit + 6):
            x = x * 1.5
        return x

    graph = trace(chain, m(8, 8))
    assert sorted(len(ms) for ms in find_fusion_groups(graph).members.values()) == [6, limit]
    assert sorted(len(ms) for ms in find_fusion_groups(graph, max_group_size=30).members.values()) == [10, 30, 30]
    with inductor_settings.patch(max_fusion_size=40):
        assert sorted(len(ms) for ms in find_fusion_groups(graph).members.values()) == [30, 40]


def test_annotate_writes_meta_and_fusion_can_be_turned_off():
    graph = trace(lambda x: x.relu() * 2, m(N, N))
    costs = annotate_costs(graph, ROUND, fusion=False)
    for node in graph.nodes:
        assert node.meta[COST_KEY] is costs[node.name]
    assert all(c.est_time_s == c.unfused_time_s for c in costs.values())
    assert sum(c.launches for c in costs.values()) == 2


# ---------------------------------------------------------------- composite estimates = their decomposition

def _composite_examples():
    x, g, w, b = m(8, 16), m(8, 16), m(16), m(16)
    xc, wc, rm, rv = m(4, 6, 5, 5), m(6), m(6), torch.rand(6)
    return {
        "gelu": (aten.gelu.default, (x,)), "gelu_backward": (aten.gelu_backward.default, (g, x)),
        "silu": (aten.silu.default, (x,)), "silu_backward": (aten.silu_backward.default, (g, x)),
        "_softmax": (aten._softmax.default, (x, -1, False)), "_log_softmax": (aten._log_softmax.default, (x, -1, False)),
        "_softmax_backward_data": (aten._softmax_backward_data.default, (g, x, -1, torch.float32)),
        "_log_softmax_backward_data": (aten._log_softmax_backward_data.default, (g, x, -1, torch.float32)),
        "native_layer_norm": (aten.native_layer_norm.default, (x, [16], w, b, 1e-5)),
        "native_layer_norm_backward": (aten.native_layer_norm_backward.default,
                                       (g, x, [16], m(8, 1), m(8, 1), w, b, [True, True, True])),
        "_native_batch_norm_legit_functional": (aten._native_batch_norm_legit_functional.default,
                                                (xc, wc, wc, rm, rv, True, 0.1, 1e-5)),
        "native_batch_norm_backward": (aten.native_batch_norm_backward.default,
                                       (m(4, 6, 5, 5), xc, wc, rm, rv, rm, rv, True, 1e-5, [True, True, True])),
        "native_dropout": (aten.native_dropout.default, (x, 0.1, True)),
        "native_dropout_backward": (aten.native_dropout_backward.default, (g, x > 0, 1.1)),
        "sigmoid_backward": (aten.sigmoid_backward.default, (g, x)),
        "tanh_backward": (aten.tanh_backward.default, (g, x)),
        "threshold_backward": (aten.threshold_backward.default, (g, x, 0.0)),
    }


@pytest.fixture(scope="module")
def inductor_decompositions():
    import torch._inductor.lowering  # noqa: F401  (some decompositions consult it)
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


@pytest.mark.parametrize("name", sorted(COMPOSITE_FLOPS_PER_ELEMENT))
def test_composite_table_matches_inductor_decomposition(name, inductor_decompositions):
    op, args = _composite_examples()[name]
    big = max(a.numel() for a in args if isinstance(a, torch.Tensor))
    whole = make_fx(lambda *a: op(*a))(*args).graph
    assert node_flops(the_node(whole, op.overloadpacket.__name__)).flops == COMPOSITE_FLOPS_PER_ELEMENT[name] * big
    decomposed = make_fx(lambda *a: op(*a), decomposition_table=inductor_decompositions)(*args).graph
    full_size = 0
    for node in decomposed.nodes:
        if node.op != "call_function":
            continue
        sizes = [t.numel() for v in [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
                 for t in ([v] if isinstance(v, torch.Tensor) else [])]
        if sizes and max(sizes) == big:   # the full-size ops; those over reduced rows are lower order
            full_size += node_flops(node).flops
    assert full_size == COMPOSITE_FLOPS_PER_ELEMENT[name] * big


@pytest.mark.parametrize("name", sorted(set(COMPOSITE_FLOPS_PER_ELEMENT)))
def test_composite_special_ops_match_inductor_decomposition(name, inductor_decompositions):
    op, args = _composite_examples()[name]
    big = max(a.numel() for a in args if isinstance(a, torch.Tensor))
    whole = the_node(make_fx(lambda *a: op(*a))(*args).graph, op.overloadpacket.__name__)
    decomposed = make_fx(lambda *a: op(*a), decomposition_table=inductor_decompositions)(*args).graph
    specials = [node_special_ops(n) for n in decomposed.nodes
                if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].numel() == big]
    expected = (sum(t for t, _ in specials), sum(r for _, r in specials))
    assert node_special_ops(whole) == expected
    assert TRANSCENDENTALS_PER_ELEMENT.get(name, 0) * big == expected[0]
    assert RANDOM_VALUES_PER_ELEMENT.get(name, 0) * big == expected[1]


# ---------------------------------------------------------------- FLOP totals = FlopCounterMode on the zoo

def capture_joint(model: nn.Module, inputs, decompositions) -> fx.GraphModule:
    """The joint forward+backward graph AOTAutograd builds (no compile: compilers return the graph)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module
    from torch._functorch.partitioners import default_partition

    box = {}

    def partition(joint, joint_inputs, **kwargs):
        box["joint"] = joint
        return default_partition(joint, joint_inputs, **kwargs)

    compiled = aot_module(model, fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=lambda g, _: make_boxed_func(g),
                          partition_fn=partition, decompositions=decompositions)
    compiled(*inputs).sum().backward()
    return box["joint"]


def flop_counter_counts(model: nn.Module, inputs, custom_mapping=None) -> dict[str, Counter]:
    counts = {}
    fwd = FlopCounterMode(display=False, custom_mapping=custom_mapping)
    with fwd:
        out = model(*inputs)
    bwd = FlopCounterMode(display=False, custom_mapping=custom_mapping)
    loss = out.sum()
    with bwd:
        loss.backward()
    for phase, mode in (("forward", fwd), ("backward", bwd)):
        counts[phase] = Counter({str(op): n for op, n in mode.get_flop_counts()["Global"].items()})
    return counts


def graph_counts(graph: fx.Graph, rules) -> dict[str, Counter]:
    counts = {"forward": Counter(), "backward": Counter()}
    phases = node_phases(graph)
    for node in graph.nodes:
        estimate = node_flops(node)
        if estimate.rule in rules:
            counts[phases[node.name]][str(node.target.overloadpacket)] += estimate.flops
    return counts


def without_extra_formulas(counts: dict[str, Counter]) -> dict[str, Counter]:
    extra = {str(op) for op in EXTRA_FLOP_FORMULAS}
    return {phase: Counter({op: n for op, n in c.items() if op not in extra}) for phase, c in counts.items()}


@pytest.fixture(scope="module", params=sorted(ZOO))
def zoo_joint(request, inductor_decompositions):
    """(name, joint graph as the backend sees it, after Inductor's decompositions,
    FlopCounterMode's counts with remat's extra formulas registered)."""
    model, inputs = ZOO[request.param]()
    joint = capture_joint(model, inputs, inductor_decompositions)
    model, inputs = ZOO[request.param]()
    return request.param, joint.graph, flop_counter_counts(model, inputs, EXTRA_FLOP_FORMULAS)


def test_flops_equal_flop_counter_mode_per_phase_and_op(zoo_joint):
    name, graph, counted = zoo_joint
    ours = graph_counts(graph, {TORCH_RULE})
    plain = without_extra_formulas(counted)   # what FlopCounterMode counts with torch's registry alone
    for phase in ("forward", "backward"):
        assert +ours[phase] == +plain[phase], f"{name} {phase}"
        assert sum(plain[phase].values()) > 0


def test_flops_with_remat_formulas_equal_flop_counter_mode_with_them(zoo_joint):
    name, graph, counted = zoo_joint
    ours = graph_counts(graph, {TORCH_RULE, "remat formula: attention"})
    totals = phase_totals(graph, annotate_costs(graph, ROUND))
    phases = node_phases(graph)
    for phase in ("forward", "backward"):
        assert +ours[phase] == +counted[phase], f"{name} {phase}"
        estimated = sum(node_flops(n).flops for n in graph.nodes if phases[n.name] == phase and not node_flops(n).has_formula)
        assert totals[phase].flops == sum(counted[phase].values()) + estimated


def test_ops_without_formula_are_listed(zoo_joint):
    name, graph, _ = zoo_joint
    missing = ops_without_formula(graph.nodes)
    assert all(not node_flops(n).has_formula for n in graph.nodes if str(n.target) in missing)
    assert not any(op.startswith(("aten.mm", "aten.addmm", "aten.bmm", "aten.convolution")) for op in missing)


def test_flop_totals_also_match_without_decompositions():
    """Eager's ops, undecomposed (batch norm, max pool as single nodes): the same counts."""
    model, inputs = ZOO["cnn"]()
    graph = capture_joint(model, inputs, {}).graph
    model, inputs = ZOO["cnn"]()
    assert graph_counts(graph, {TORCH_RULE}) == without_extra_formulas(flop_counter_counts(model, inputs))


def test_phases_follow_autograd_tags(zoo_joint):
    name, graph, _ = zoo_joint
    phases = node_phases(graph)
    for node in graph.nodes:
        tag = node.meta.get("partitioner_tag")
        if tag:
            assert phases[node.name] == ("forward" if tag == "is_forward" else "backward")
        if node.op == "placeholder" and node.name.startswith("tangents"):
            assert phases[node.name] == "backward"


def test_phases_fall_back_to_tangent_dependency():
    graph = make_fx(lambda primals, tangents: (primals.relu(), tangents * primals.sin()))(m(4), m(4)).graph
    phases = node_phases(graph)
    assert phases[the_node(graph, "relu").name] == "forward"
    assert phases[the_node(graph, "sin").name] == "forward"
    assert phases[the_node(graph, "mul").name] == "backward"


# ---------------------------------------------------------------- symbolic sizes

FORMAT_CASES = [
    (sympy.Integer(0), "", "0"),
    (sympy.Integer(1024), "bytes", "1024 bytes"),
    (3 * sympy.Symbol("s0") * sympy.Symbol("s1") * 256, "bytes", "768·s0·s1 bytes"),
    (4 * sympy.Symbol("s0") ** 2 + 3 * sympy.Symbol("s0") + 5, "FLOPs", "4·s0^2 + 3·s0 + 5 FLOPs"),
    (sympy.Symbol("s1") * sympy.Symbol("s0"), "", "s0·s1"),
    (1024 * sympy.Symbol("s0") - 8, "bytes", "1024·s0 - 8 bytes"),
]


@pytest.mark.parametrize("expr,unit,text", FORMAT_CASES)
def test_format_expr(expr, unit, text):
    assert format_expr(expr, unit) == text


FITS_CASES = [
    # expr, limit, hints(s1), expected largest s0
    (768 * sympy.Symbol("s0") * sympy.Symbol("s1"), 1_000_000, 10, 130),     # 768*10*130 = 998400
    (768 * sympy.Symbol("s0") * sympy.Symbol("s1"), 7679, 10, None),         # even s0=1 needs 7680
    (sympy.Symbol("s0") ** 2, 10**6, 1, 1000),
    (sympy.Integer(5), 10, 1, 1 << 40),                                       # never grows: the search cap
]


@pytest.mark.parametrize("expr,limit,s1,expected", FITS_CASES)
def test_largest_value_that_fits(expr, limit, s1, expected):
    s0, s1_sym = sympy.Symbol("s0"), sympy.Symbol("s1")
    assert largest_value_that_fits(expr, s0, limit, {s1_sym: s1}) == expected


@pytest.fixture(scope="module")
def dynamic_joint():
    """The joint graph of TwoLinear on x of shape (6, 10, 256), dims 0 and 1 marked dynamic."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import default_partition

    box = {}

    def partition(joint, joint_inputs, **kwargs):
        box["joint"] = joint
        return default_partition(joint, joint_inputs, **kwargs)

    backend = aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g), bw_compiler=lambda g, _: make_boxed_func(g),
                           partition_fn=partition)
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = TwoLinear(), torch.randn(6, 10, 256)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1)
    torch.compile(model, backend=backend, fullgraph=True)(x).sum().backward()
    torch._dynamo.reset()
    return box["joint"].graph


def _batch_and_seq(graph):
    names = {src: sym for sym, src in symbol_sources(graph).items()}
    batch = next(sym for src, sym in names.items() if src.endswith("size()[0]"))
    seq = next(sym for src, sym in names.items() if src.endswith("size()[1]"))
    return batch, seq


def test_symbolic_costs_evaluate_to_the_numbers_at_the_hint(dynamic_joint):
    hints = shape_hints(dynamic_joint)
    assert sorted(hints.values()) == [6, 10]
    symbolic_nodes = 0
    for node in dynamic_joint.nodes:
        cost = estimate_node_cost(node, ROUND)
        flops, read, written = node_flops_expr(node), node_bytes_read_expr(node), node_bytes_written_expr(node)
        assert (evaluate(flops, hints), evaluate(read, hints), evaluate(written, hints)) == (
            cost.flops, cost.bytes_read, cost.bytes_written), node.format_node()
        symbolic_nodes += bool(flops.free_symbols or written.free_symbols)
    assert symbolic_nodes >= 6


def test_symbolic_formulas_read_as_expected(dynamic_joint):
    batch, seq = _batch_and_seq(dynamic_joint)
    b_s = "·".join(sorted([batch, seq]))
    first_addmm = next(n for n in dynamic_joint.nodes if n.target is aten.addmm.default)
    gelu = the_node(dynamic_joint, "gelu")
    assert format_expr(node_flops_expr(first_addmm), "FLOPs") == f"{2 * 256 * 512}·{b_s} FLOPs"
    assert format_expr(node_bytes_written_expr(first_addmm), "bytes") == f"{512 * 4}·{b_s} bytes"
    # the input (B·S·256 fp32) plus the weight (256·512) and bias (512), fp32
    assert format_expr(node_bytes_read_expr(first_addmm), "bytes") == f"{256 * 4}·{b_s} + {(256 * 512 + 512) * 4} bytes"
    assert format_expr(node_flops_expr(gelu), "FLOPs") == f"{5 * 512}·{b_s} FLOPs"


def test_symbolic_flops_at_another_size_equal_a_static_trace(dynamic_joint):
    batch, seq = _batch_and_seq(dynamic_joint)
    hints = {sym: {batch: 3, seq: 7}[str(sym)] for sym in shape_hints(dynamic_joint)}
    total = sum(evaluate(node_flops_expr(n), hints) for n in dynamic_joint.nodes)
    torch.manual_seed(0)
    static = capture_joint(TwoLinear(), (torch.randn(3, 7, 256),), {}).graph
    assert total == sum(node_flops(n).flops for n in static.nodes)


def test_annotate_costs_works_on_symbolic_graphs(dynamic_joint):
    costs = annotate_costs(dynamic_joint, ROUND)
    assert sum(c.flops for c in costs.values()) == sum(node_flops(n).flops for n in dynamic_joint.nodes)
    assert all(c.est_time_s >= 0 for c in costs.values())


# ---------------------------------------------------------------- storages: views allocate nothing

STORAGE_VIEW_CASES = [
    # id, fn on a (4, 512, 512) fp32 input (4 MiB), the view op whose storage must be its input's
    ("_unsafe_view after bmm", lambda x: aten._unsafe_view(torch.bmm(x, x), [4 * N, N]).relu(), "_unsafe_view"),
    ("view", lambda x: torch.bmm(x, x).view(4 * N, N).relu(), "view"),
    ("permute", lambda x: torch.bmm(x, x).permute(0, 2, 1).relu(), "permute"),
    ("alias", lambda x: torch.ops.aten.alias(torch.bmm(x, x)).relu(), "alias"),
]


@pytest.mark.parametrize("fn,view_op", [c[1:] for c in STORAGE_VIEW_CASES], ids=[c[0] for c in STORAGE_VIEW_CASES])
def test_view_ops_allocate_nothing_and_alias_their_input(fn, view_op):
    from remat.passes.joint_graph import read_joint_graph

    graph = trace(fn, m(4, N, N))
    facts = read_joint_graph(graph, annotate_costs(graph, ROUND), num_fwd_outputs=1)
    view = next(n for n in facts.nodes.values() if n.op.startswith(f"aten.{view_op}."))
    bmm = next(n for n in facts.nodes.values() if n.op.startswith("aten.bmm"))
    assert view.allocs == () and view.is_view
    assert view.value_storages == bmm.value_storages == (bmm.name,)
    assert bmm.allocs == ((bmm.name, 4 * MiB),)
    # the graph allocates the input (4 MiB), bmm's output and relu's output, nothing else
    assert sum(n.alloc_bytes for n in facts.nodes.values()) == 12 * MiB


# ---------------------------------------------------------------- eager families below the roofline

EAGER_FAMILY_CASES = [
    # id, fn on a (512, 512) fp32 input, op, family (None: the roofline describes it)
    ("var_mean: Welford", lambda x: torch.var_mean(x, dim=1), "var_mean", "welford"),
    ("gt: floats in, bools out", lambda x: x > 0, "gt", "compare"),
    ("logical_not: bools in and out", lambda x: (x > 0).logical_not(), "logical_not", None),
    ("where", lambda x: torch.where(x > 0, x, 0.0), "where", "select"),
    ("any over bools", lambda x: (x > 0).any(dim=1), "any", "bool_reduction"),
    ("full", lambda x: torch.full((N, N), 1.0) + x, "full", "factory"),
    ("add", lambda x: x + x, "add", None),
    ("mm", lambda x: x @ x, "mm", None),
]


@pytest.mark.parametrize("fn,op,family", [c[1:] for c in EAGER_FAMILY_CASES], ids=[c[0] for c in EAGER_FAMILY_CASES])
def test_eager_family_sets_the_op_alone_time_never_the_fused_one(fn, op, family):
    from remat.cost_model.eager_ops import eager_class

    graph = trace(fn, m(N, N))
    node = next(n for n in graph.nodes if n.op == "call_function" and n.target.overloadpacket.__name__ == op)
    assert eager_class(node) == family
    slow = ROUND.__class__(**{**ROUND.__dict__, "eager_classes": ((family or "none", 1e-3, 1e-8),)})
    plain, eager = estimate_node_cost(node, ROUND), estimate_node_cost(node, slow)
    if family is None:
        assert eager == plain
        return
    # N*N elements (the largest tensor it touches) at 10 ns each plus 1 ms: far above the roofline
    assert eager.unfused_time_s == pytest.approx(1e-3 + 1e-8 * N * N) and plain.unfused_time_s < 1e-3
    fused_plain, fused_eager = annotate_costs(graph, ROUND), annotate_costs(graph, slow)
    if fused_plain[node.name].fusion_group:   # Inductor's loop, not the eager kernel: the roofline stays
        assert fused_eager[node.name].est_time_s == fused_plain[node.name].est_time_s
