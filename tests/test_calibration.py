"""Calibration: real kernel times per node, cached by graph hash, usable as est_time_s."""

from __future__ import annotations

import json

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from remat.cost_model.calibrate import calibrate, graph_device, graph_hash, measure_node_times, random_tensor
from remat.cost_model.costs import annotate_costs
from remat.cost_model.hardware import HardwareProfile
from remat.cost_model.tensors import is_free_op

ROUND = HardwareProfile(name="round", flops_per_s={"float32": 1e12}, bandwidth_bytes_per_s=1e11,
                        kernel_launch_s=1e-6, source="test")


def block(x, w, idx):
    h = (x @ w).relu() * 2             # an extern matmul, then a fused pointwise pair
    return h.t().sum(0), torch.embedding(w, idx)   # a view, a reduction, an integer-indexed gather


def inputs(n=64):
    return torch.randn(n, n), torch.randn(n, n), torch.randint(0, n, (8,))


def traced(n=64):
    return make_fx(block, tracing_mode="fake")(*inputs(n)).graph


def kernel_names(graph):
    return {n.name for n in graph.nodes if n.op == "call_function" and not is_free_op(n)}


def test_every_kernel_node_is_timed_and_views_are_not(tmp_path):
    graph = traced()
    result = calibrate(graph, cache_path=tmp_path / "c.json", repeats=3)
    assert set(result.times_s) == kernel_names(graph) and not result.skipped
    assert all(0 < t < 1.0 for t in result.times_s.values())
    assert not result.from_cache and result.device == "cpu"


def test_second_call_reads_the_cache_and_a_corrupt_cache_is_measured_again(tmp_path):
    graph, path = traced(), tmp_path / "c.json"
    first = calibrate(graph, cache_path=path, repeats=3)
    second = calibrate(graph, cache_path=path, repeats=3)
    assert second.from_cache and second.times_s == first.times_s and second.graph_hash == first.graph_hash
    path.write_text("{ not json")
    third = calibrate(graph, cache_path=path, repeats=3)
    assert not third.from_cache and set(third.times_s) == set(first.times_s)
    assert json.loads(path.read_text())["graph_hash"] == first.graph_hash


def test_default_cache_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    graph = traced()
    result = calibrate(graph, repeats=3)
    assert (tmp_path / "calibration" / f"{result.graph_hash}.json").exists()
    assert calibrate(graph, repeats=3).from_cache


def test_graph_hash_changes_with_shapes_repeats_and_ops():
    cpu = torch.device("cpu")
    base = graph_hash(traced(64), cpu, 5)
    assert base == graph_hash(traced(64), cpu, 5)
    assert base != graph_hash(traced(32), cpu, 5)
    assert base != graph_hash(traced(64), cpu, 3)
    other = make_fx(lambda x, w, idx: ((x @ w).sigmoid() * 2, idx), tracing_mode="fake")(*inputs()).graph
    assert base != graph_hash(other, cpu, 5)


def test_a_node_that_fails_on_random_inputs_is_skipped_with_the_reason(tmp_path):
    # Cholesky of a random (not positive definite) matrix raises at run time.
    graph = make_fx(lambda a: torch.ops.aten.linalg_cholesky_ex(a, check_errors=True)[0].relu(),
                    tracing_mode="fake")(torch.randn(8, 8)).graph
    result = calibrate(graph, cache_path=tmp_path / "c.json", repeats=3)
    (name,) = [n.name for n in graph.nodes if "cholesky" in str(n.target)]
    assert result.skipped[name].startswith("_LinAlgError: linalg.cholesky_ex: ") and "not positive-definite" in result.skipped[name]
    assert name not in result.times_s and any("relu" in n for n in result.times_s)


RANDOM_TENSOR_CASES = [
    ("contiguous float", torch.empty(3, 4), lambda t: t.std() > 0),
    ("transposed", torch.empty(4, 3).t(), lambda t: t.stride() == (1, 3)),
    ("expanded (stride 0)", torch.empty(1, 4).expand(5, 4), lambda t: t.stride() == (0, 1)),
    ("int64 indices are in range", torch.empty(6, dtype=torch.long), lambda t: bool((t == 0).all())),
    ("bool", torch.empty(100, dtype=torch.bool), lambda t: t.dtype == torch.bool),
    ("half", torch.empty(2, 2, dtype=torch.float16), lambda t: t.dtype == torch.float16),
    ("empty", torch.empty(0, 3), lambda t: t.shape == (0, 3)),
]


@pytest.mark.parametrize("like,check", [c[1:] for c in RANDOM_TENSOR_CASES], ids=[c[0] for c in RANDOM_TENSOR_CASES])
def test_random_tensor_matches_layout(like, check):
    real = random_tensor(like, torch.device("cpu"))
    assert real.shape == like.shape and real.dtype == like.dtype and real.stride() == like.stride()
    assert check(real)


def test_measured_times_become_est_time_s(tmp_path):
    graph = traced()
    times = measure_node_times(graph, cache_path=tmp_path / "c.json", repeats=3)
    roofline = annotate_costs(graph, ROUND)
    costs = annotate_costs(graph, ROUND, measured_times=times)
    mm = next(n.name for n in graph.nodes if n.target is torch.ops.aten.mm.default)
    relu = next(n.name for n in graph.nodes if n.target is torch.ops.aten.relu.default)
    assert costs[mm].est_time_s == costs[mm].measured_time_s == times[mm] and costs[mm].time_source == "measured"
    # relu runs in a loop Inductor generates with the multiply: the eager op timed alone is a different
    # program, so it keeps the fused estimate; its measured time is recorded
    assert costs[relu].fusion_group and costs[relu].est_time_s == roofline[relu].est_time_s
    assert costs[relu].measured_time_s == times[relu] and costs[relu].time_source == "roofline (fused)"
    # without fusion every op runs alone, as it was measured
    eager = annotate_costs(graph, ROUND, fusion=False, measured_times=times)
    assert eager[relu].est_time_s == times[relu] and eager[relu].time_source == "measured"
    for name, cost in costs.items():
        if name not in times:
            assert cost.est_time_s == roofline[name].est_time_s and cost.measured_time_s is None


def test_calibration_runs_real_kernels_under_a_fake_mode(tmp_path, monkeypatch):
    """The partitioner that would calibrate runs under AOTAutograd's FakeTensorMode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import sys

    calibrate_module = sys.modules["remat.cost_model.calibrate"]   # the package re-exports the function

    output_types = set()

    def record(calls, device, held):
        seconds = {}
        for name, call, _ in calls:
            out = call()
            output_types.update(type(t) for t in (out if isinstance(out, (tuple, list)) else [out]))
            seconds[name] = 1e-3
        return seconds

    monkeypatch.setattr(calibrate_module, "_call_seconds", record)
    graph = traced()
    with FakeTensorMode():
        result = calibrate(graph, cache_path=tmp_path / "c.json", repeats=3)
    assert not result.skipped and set(result.times_s.values()) == {1e-3}
    assert output_types == {torch.Tensor}


def test_graph_device_is_read_from_meta():
    assert graph_device(traced()) == torch.device("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibration_on_cuda(tmp_path):
    cuda_inputs = [t.cuda() for t in inputs()]
    graph = make_fx(block, tracing_mode="fake")(*cuda_inputs).graph
    result = calibrate(graph, cache_path=tmp_path / "c.json", repeats=3)
    assert result.device.startswith("cuda") and set(result.times_s) == kernel_names(graph)


def test_rounds_time_each_node_once_per_round_in_graph_order_after_a_warm_up(tmp_path, monkeypatch):
    import sys

    calibrate_module = sys.modules["remat.cost_model.calibrate"]
    rounds = []

    def record(calls, device, held):
        rounds.append([name for name, _, _ in calls])
        return {name: float(len(rounds)) for name, _, _ in calls}   # round r times every node at r seconds

    monkeypatch.setattr(calibrate_module, "_call_seconds", record)
    graph = traced()
    result = calibrate(graph, use_cache=False, repeats=4)
    order = [n.name for n in graph.nodes if n.name in kernel_names(graph)]
    assert rounds == [order] * 5
    assert set(result.times_s.values()) == {2.0}   # best of rounds 2..5: the warm-up round (1 s) is dropped


def test_inputs_beyond_the_live_byte_cap_are_timed_in_chunks(monkeypatch):
    import sys

    calibrate_module = sys.modules["remat.cost_model.calibrate"]
    chunks = []

    def record(calls, device, held):
        chunks.append(tuple(name for name, _, _ in calls))
        return {name: 1e-6 for name, _, _ in calls}

    monkeypatch.setattr(calibrate_module, "_call_seconds", record)
    graph = traced()
    times, skipped = calibrate_module._measure(graph, torch.device("cpu"), repeats=1, max_live_input_bytes=1)
    assert not skipped and set(times) == kernel_names(graph)
    assert all(len(set(chunk)) == 1 for chunk in chunks)          # one node per chunk at a 1-byte cap
    assert len(chunks) == 2 * len(kernel_names(graph))            # two rounds each


def test_cpu_convolutions_are_timed_channels_last_as_inductor_lays_them_out():
    from torch.fx.experimental.proxy_tensor import make_fx

    from remat.cost_model.calibrate import real_args

    graph = make_fx(lambda x, w: torch.nn.functional.conv2d(x, w, padding=1) + 1,
                    tracing_mode="fake")(torch.randn(2, 16, 8, 8), torch.randn(16, 16, 3, 3)).graph
    conv = next(n for n in graph.nodes if n.target is torch.ops.aten.convolution.default)
    add = next(n for n in graph.nodes if n.target is torch.ops.aten.add.Tensor)
    args, _ = real_args(conv, torch.device("cpu"))
    if torch.backends.mkldnn.is_available():
        assert args[0].is_contiguous(memory_format=torch.channels_last) and args[0].shape == (2, 16, 8, 8)
        assert args[1].is_contiguous(memory_format=torch.channels_last)
    assert real_args(add, torch.device("cpu"))[0][0].is_contiguous()   # other ops keep the traced layout


def test_an_input_that_is_a_view_of_a_fresh_output_is_warmed():
    """A batched matmul in the backward reads a transposed view of the gradient just made:
    the view is not a kernel node, the tensor under it is, and it is in cache in a step."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from remat.cost_model.calibrate import _warm_fresh_inputs

    graph = make_fx(lambda a, b: torch.bmm((a * 2).transpose(1, 2), b),
                    tracing_mode="fake")(torch.randn(2, 4, 4), torch.randn(2, 4, 4)).graph
    mul = next(n for n in graph.nodes if n.target is torch.ops.aten.mul.Tensor)
    bmm = next(n for n in graph.nodes if n.target is torch.ops.aten.bmm.default)
    assert bmm.args[0] is not mul                      # reads the transpose, a view of mul's output
    args = (torch.randn(2, 4, 4), torch.randn(2, 4, 4))
    assert _warm_fresh_inputs(bmm, args, recent=[mul.name]) is not None
    assert _warm_fresh_inputs(bmm, args, recent=["something_else"]) is None
