"""Two rules of Inductor's scheduler the kernel model missed on a plan that recomputes a block many times.

A CPU cat is Inductor's ``ConcatKernel`` (``lowering.cat``: always on CPU): a loop per input that
writes its slice, and a ``NopKernelSchedulerNode`` that allocates the result. So the result is a
buffer of its own, never written in place over an input, and the cat counts as one scheduler node
per input plus one wherever Inductor counts nodes: the 64-node distance of a horizontal fusion
(``Scheduler.are_long_distant_nodes``) and the CPU backend's horizontal fusion size
(``cpp.max_horizontal_fusion_size``, 16 nodes).

The kernel model treated a cat as one loop like any other: it wrote each recomputed rotary cat in
place over the matmul it reads (Inductor holds both: four regions' rotary loops fuse into one kernel,
so eight matmul outputs and eight cat results are alive at once), and it fused five regions' rotary
loops where Inductor stops at four (16 nodes). On the zoo's Llama at its smallest-peak plan that
simulated 7.53 MB where Inductor's code peaks at 9.43 MB.

Under ``fallback_random`` (what the end-to-end tests compile with) Inductor chains every op tagged
``nondeterministic_seeded``, SDPA included, in program order: loops on either side of an attention
call are no longer independent, so they do not fuse horizontally.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from remat._torch_inductor import inductor_config
from remat.simulator.kernel_fusion import scheduler_orders
from remat.simulator.kernel_lowering import EXTERN, POINTWISE, GraphOp
from remat.simulator.kernel_schedule import schedule_kernels

ROWS = 64
NBYTES = ROWS * ROWS * 4           # 64 x 64 fp32 = 16 KiB
HALF = NBYTES // 2


def _inductor_code(fn, *inputs) -> str:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(fn, backend="inductor"), *inputs)
    torch._dynamo.reset()
    body = code[0]
    return body[body.index("def call"):]


# ---- a cat's result is a buffer of its own -----------------------------------------------------

def _halves_cat(x, w):
    h = x @ w
    return torch.cat([h[:, :ROWS // 2] * 2, h[:, ROWS // 2:] * 3], dim=1)


def _halves_cat_ops(concat: bool) -> list[GraphOp]:
    """``_halves_cat`` as the kernel model sees it: the matmul, two inlined halves, the cat."""
    return [
        GraphOp("h", EXTERN, ("x", "w"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=2),
        GraphOp("a", POINTWISE, ("h",), HALF, ROWS * ROWS // 2, ROWS * ROWS // 2, users=1),
        GraphOp("b", POINTWISE, ("h",), HALF, ROWS * ROWS // 2, ROWS * ROWS // 2, users=1),
        GraphOp("cat", POINTWISE, ("a", "b"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, is_output=True,
                concat=concat),
    ]


def test_a_cpu_cat_is_never_written_in_place_over_its_input_as_in_inductors_code():
    x, w = torch.randn(ROWS, ROWS), torch.randn(ROWS, ROWS)
    code = _inductor_code(_halves_cat, x, w)
    assert code.count("empty_strided_cpu((64, 64)") == 2, code   # the matmul's and the cat's own
    assert "# reuse" not in code, code

    schedule = schedule_kernels(_halves_cat_ops(concat=True), {"x": NBYTES, "w": NBYTES})
    assert not any(k.inplace for k in schedule.kernels)
    assert any("cat" in k.buffers for k in schedule.kernels)
    # as a plain loop it would overwrite the matmul's buffer, its only reader
    plain = schedule_kernels(_halves_cat_ops(concat=False), {"x": NBYTES, "w": NBYTES})
    assert any(k.inplace == (("cat", "h"),) for k in plain.kernels)


def test_a_cpu_cat_is_stored_even_with_one_pointwise_reader():
    ops = _halves_cat_ops(concat=True)
    ops[-1] = ops[-1]._replace(is_output=False)
    ops.append(GraphOp("y", POINTWISE, ("cat",), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, is_output=True))
    schedule = schedule_kernels(ops, {"x": NBYTES, "w": NBYTES})
    assert any("cat" in k.buffers for k in schedule.kernels)


# ---- a cat counts one scheduler node per input, plus one ---------------------------------------

def test_a_cat_takes_a_place_per_input_and_one_for_its_allocation():
    ops = _halves_cat_ops(concat=True) + [GraphOp("m", EXTERN, ("cat", "w"), NBYTES, ROWS * ROWS, ROWS * ROWS)]
    names = ["h", "cat", "m"]
    assert scheduler_orders(names, {o.name: o for o in ops}) == {"h": (0, 0), "cat": (1, 2), "m": (4, 4)}


def _rotary(regions: int):
    def fn(x, w, c, s):
        outs = []
        for i in range(regions):
            h = x @ (w + i)                     # a matmul of its own per region
            first, second = h[:, :ROWS // 2], h[:, ROWS // 2:]
            outs.append(torch.cat([first * c - second * s, second * c + first * s], dim=1) @ w)
        return outs
    return fn


def _rotary_ops(regions: int, concat: bool = True) -> list[GraphOp]:
    """``_rotary(regions)`` as the kernel model sees it (the ``w + i`` loops left out: the matmuls
    read graph inputs of their own)."""
    ops = []
    for i in range(regions):
        ops += [
            GraphOp(f"h{i}", EXTERN, ("x", f"w{i}"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=2),
            GraphOp(f"a{i}", POINTWISE, (f"h{i}", "c", "s"), HALF, ROWS * ROWS // 2, ROWS * ROWS // 2, users=1),
            GraphOp(f"b{i}", POINTWISE, (f"h{i}", "c", "s"), HALF, ROWS * ROWS // 2, ROWS * ROWS // 2, users=1),
            GraphOp(f"cat{i}", POINTWISE, (f"a{i}", f"b{i}"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1,
                    extern_user=True, concat=concat),
            GraphOp(f"o{i}", EXTERN, (f"cat{i}", "w"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, is_output=True),
        ]
    return ops


def _cat_kernels(regions: int, concat: bool = True) -> int:
    inputs = {"x": NBYTES, "w": NBYTES, "c": HALF, "s": HALF} | {f"w{i}": NBYTES for i in range(regions)}
    schedule = schedule_kernels(_rotary_ops(regions, concat), inputs)
    return sum(1 for k in schedule.kernels if not k.extern and any(op.startswith("cat") for op in k.ops))


def test_the_cpu_backend_fuses_at_most_16_scheduler_nodes_horizontally_as_in_inductors_code():
    """Each region's cat shares ``c`` and ``s`` with the others: Inductor fuses 8 regions' cats (two
    loops each, 16 nodes) into one kernel, and a 9th region's into a second."""
    x, w = torch.randn(ROWS, ROWS), torch.randn(ROWS, ROWS)
    c, s = torch.randn(ROWS, ROWS // 2), torch.randn(ROWS, ROWS // 2)
    inductor = {n: _inductor_code(_rotary(n), x, w, c, s).count("cpp_fused_add_mul_slice_sub_") for n in (8, 9)}
    assert inductor == {8: 1, 9: 2}                     # one call per kernel
    assert {n: _cat_kernels(n) for n in (8, 9)} == inductor
    assert _cat_kernels(9, concat=False) == 1           # counted as one node each, the nine fused


# ---- under fallback_random, seeded ops run in program order -------------------------------------

def _attention_pair(x, q, k, v):
    """``sin(x)`` feeds one attention, ``cos(x)`` reads another's result: two loops that share ``x``
    and are independent, unless the second attention must follow the first."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    first = sdpa(torch.sin(x), k, v)
    second = sdpa(q, k, v)
    return first, torch.cos(x) + second


def _attention_pair_ops() -> list[GraphOp]:
    return [
        GraphOp("a", POINTWISE, ("x",), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, extern_user=True),
        GraphOp("s1", EXTERN, ("a", "k", "v"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, is_output=True, seeded=True),
        GraphOp("s2", EXTERN, ("q", "k", "v"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, seeded=True),
        GraphOp("b", POINTWISE, ("x", "s2"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, is_output=True),
    ]


def _model_fuses_sin_cos(fallback_random: bool) -> bool:
    config = dataclasses.replace(inductor_config(), fallback_random=fallback_random)
    schedule = schedule_kernels(_attention_pair_ops(), {n: NBYTES for n in "xqkv"}, config=config)
    return any({"a", "b"} <= set(k.ops) for k in schedule.kernels)


def test_under_fallback_random_attention_calls_keep_their_order_and_the_loops_around_them_do_not_fuse():
    """``post_grad._chain_random_ops_for_ordering`` makes the second attention (SDPA is tagged
    ``nondeterministic_seeded``) wait for the first, so ``cos(x) + second`` depends on ``sin(x)``
    through both calls: no horizontal fusion, as in Inductor's code."""
    x, q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(4))
    for fallback_random in (False, True):
        with torch._inductor.config.patch(fallback_random=fallback_random):
            fused = re.search(r"cpp_fused_\w*_cos_sin_", _inductor_code(_attention_pair, x, q, k, v)) is not None
        assert fused == (not fallback_random) == _model_fuses_sin_cos(fallback_random), fallback_random
