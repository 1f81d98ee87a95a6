"""Inductor fuses two loops that share a buffer but neither reads the other's result (a horizontal
fusion) only when they share at least ``score_fusion_memory_threshold`` bytes and lie at most
``HORIZONTAL_FUSION_MAX_DISTANCE`` scheduler nodes apart (``choices.py: can_fuse_horizontal``).
The kernel model follows both rules, and agrees with the code Inductor generates: without the
distance rule it fused the recomputed loops of distant backward regions (T5's dropout draws all read
one seed buffer) into the earliest region, holding their outputs through the whole backward.

A loop and a loop reading its result (a vertical fusion) fuse at any distance in Inductor; remat's
compiles refuse it past the same distance (``_torch_inductor.fusion_choices``), and the kernel model
follows what the compile runs under (``InductorConfig.vertical_fusion_max_distance``)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from remat._torch_inductor import (HORIZONTAL_FUSION_MAX_DISTANCE, VERTICAL_FUSION_MAX_DISTANCE, fusion_choices,
                                   fusion_choices_class, inductor_config)
from remat.simulator.kernel_lowering import EXTERN, POINTWISE, GraphOp
from remat.simulator.kernel_schedule import schedule_kernels

ROWS = 64
NBYTES = ROWS * ROWS * 4


def _ops(between: int) -> list[GraphOp]:
    """``sin(x)`` fed to a chain of ``between`` matmuls, then ``cos(x)``: two loops reading ``x``
    ``between + 1`` scheduler nodes apart."""
    ops = [GraphOp("a", POINTWISE, ("x",), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, extern_user=True)]
    previous = "a"
    for i in range(between):
        ops.append(GraphOp(f"m{i}", EXTERN, (previous, "w"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1,
                           is_output=i == between - 1))
        previous = f"m{i}"
    ops.append(GraphOp("b", POINTWISE, ("x",), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, is_output=True))
    return ops


def _model_fuses(between: int, **config) -> bool:
    schedule = schedule_kernels(_ops(between), {"x": NBYTES, "w": NBYTES},
                                config=dataclasses.replace(inductor_config(), **config))
    return any({"a", "b"} <= set(k.ops) for k in schedule.kernels)


def _inductor_fuses(between: int) -> bool:
    from torch._inductor.utils import run_and_get_code

    def f(x, w):
        h = torch.sin(x)
        for _ in range(between):
            h = h @ w
        return h, torch.cos(x)

    torch._dynamo.reset()
    x, w = torch.randn(ROWS, ROWS), torch.randn(ROWS, ROWS)
    _, code = run_and_get_code(torch.compile(f, backend="inductor"), x, w)
    torch._dynamo.reset()
    return "cpp_fused_cos_sin" in "\n".join(code)


def test_distant_loops_sharing_an_input_do_not_fuse_as_in_inductors_code():
    near, far = 3, HORIZONTAL_FUSION_MAX_DISTANCE + 6
    assert _model_fuses(near) and _inductor_fuses(near)
    assert not _model_fuses(far) and not _inductor_fuses(far)


def test_horizontal_fusion_follows_the_distance_and_the_shared_bytes_threshold():
    far = HORIZONTAL_FUSION_MAX_DISTANCE + 6
    assert _model_fuses(far, horizontal_fusion_max_distance=far + 1)
    assert not _model_fuses(3, score_fusion_memory_threshold=NBYTES + 1)   # they share x only
    assert _model_fuses(3, score_fusion_memory_threshold=NBYTES)


def _far_pair_ops() -> list[GraphOp]:
    """A stored loop ``a`` and a loop ``b`` reading its result ``HORIZONTAL_FUSION_MAX_DISTANCE + 6``
    scheduler nodes later: a vertical pair."""
    ops = _ops(HORIZONTAL_FUSION_MAX_DISTANCE + 6)
    ops[0] = ops[0]._replace(users=2, heavy=True, extern_user=False)   # stored: exp-like, two readers
    ops[1] = ops[1]._replace(inputs=("x", "w"))                        # the chain no longer reads a
    ops.append(GraphOp("c", POINTWISE, ("a", "m0"), NBYTES, ROWS * ROWS, ROWS * ROWS, users=1, is_output=True))
    ops[-2] = ops[-2]._replace(inputs=("a",))                          # b reads a: a vertical pair
    return ops


def test_a_consumer_fuses_with_its_far_producer_in_inductor_alone_not_under_remats_choices():
    """Inductor alone has no distance rule for vertical fusion (``vertical_fusion_max_distance=None``);
    remat's compiles refuse it past the horizontal rule's distance where the reader also needs work done
    after the producer (``_torch_inductor.fusion_choices``)."""
    def fused(**config) -> bool:
        schedule = schedule_kernels(_far_pair_ops(), {"x": NBYTES, "w": NBYTES},
                                    config=dataclasses.replace(inductor_config(), **config))
        return any({"a", "b"} <= set(k.ops) for k in schedule.kernels)

    assert inductor_config().vertical_fusion_max_distance == VERTICAL_FUSION_MAX_DISTANCE
    assert fused(vertical_fusion_max_distance=None)
    assert not fused()          # b fuses with c, which also reads m0, computed after a
    assert fused(vertical_fusion_max_distance=HORIZONTAL_FUSION_MAX_DISTANCE + 8)
    # a far reader that needs nothing computed after the producer still fuses (it runs where the producer runs)
    alone = [op for op in _far_pair_ops() if op.name != "c"]     # a stays stored (marked as read twice)
    schedule = schedule_kernels(alone, {"x": NBYTES, "w": NBYTES})
    assert any({"a", "b"} <= set(k.ops) for k in schedule.kernels)


def _reduction_fused_with_far_reader(choices: bool) -> bool:
    """Inductor's code for a row sum whose only reader comes after a chain of matmuls: one kernel for both?"""
    from torch._inductor.utils import run_and_get_code

    def f(x, w):
        s = x.sum(1, keepdim=True)
        h = x
        for _ in range(HORIZONTAL_FUSION_MAX_DISTANCE + 6):
            h = h @ w
        return torch.cos(h) * s

    torch._dynamo.reset()
    x, w = torch.randn(ROWS, ROWS), torch.randn(ROWS, ROWS)
    # as in a training graph: Inductor moves a producer next to its reader only in inference graphs
    with torch._inductor.config.patch(reorder_for_locality=False), (
            fusion_choices() if choices else contextlib.nullcontext()):
        _, code = run_and_get_code(torch.compile(f, backend="inductor"), x, w)
    torch._dynamo.reset()
    return "cpp_fused_cos_mul_sum" in "\n".join(code)


def test_inductors_code_fuses_a_far_reduction_into_its_reader_except_under_remats_choices():
    """The rule the kernel model follows is the one Inductor's generated code shows: the row sum fused
    into its far reader (run there, its input held until then), and kept apart under ``fusion_choices``;
    the choices change the FX graph cache's key, so neither compile is served the other's code."""
    assert _reduction_fused_with_far_reader(choices=False)
    assert not _reduction_fused_with_far_reader(choices=True)
    assert _reduction_fused_with_far_reader(choices=False)


def test_remats_choices_leave_a_threads_handler_as_they_found_it():
    """A thread whose first Inductor compile is remat's keeps Inductor's own handler after it (found by CI: the
    handler Inductor makes lazily was made under remat's patched config, and every later plain compile in
    that thread ran under remat's rule)."""
    import threading

    from torch._inductor.virtualized import V

    seen = []

    def first_compile_is_remats() -> None:
        with fusion_choices():
            seen.append(type(V.choices))
        seen.append(type(V.choices))

    thread = threading.Thread(target=first_compile_is_remats)
    thread.start()
    thread.join()
    assert seen[0] is fusion_choices_class() and seen[1] is not fusion_choices_class(), seen
