"""Inductor's rules in one home (``cost_model/inductor_rules.py``) and its config read at plan time
(``remat/_torch_inductor.py``): the families name real ops and do not overlap, the config record is
what ``torch._inductor.config`` says now, and the kernel model follows a patched config."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch._inductor.inductor_prims  # registers prims.inductor_random & co.
from torch._inductor import config as inductor_settings

from remat._torch_inductor import InductorConfig, inductor_config
from remat.cost_model import inductor_rules as rules
from remat.simulator.kernel_lowering import EXTERN, POINTWISE, REDUCTION, GraphOp
from remat.simulator.kernel_schedule import schedule_kernels

MIB = 1 << 20
NOT_OP_FAMILIES = ("COLLECTIVE_NAMESPACES", "EXACT_MATMUL_DTYPES", "allocates_nothing")   # namespaces, dtypes, a rule
OP_FAMILIES = [name for name in rules.__all__ if name not in NOT_OP_FAMILIES]


@pytest.mark.parametrize("family", OP_FAMILIES)
def test_every_family_names_real_ops(family):
    """A misspelt name (``logsigmoid`` for ``log_sigmoid_forward``) would never match a node."""
    missing = [n for n in getattr(rules, family)
               if not any(hasattr(getattr(torch.ops, ns), n) for ns in ("aten", "prims"))]
    assert not missing, f"{family} names ops torch does not have: {missing}"


def test_a_matrix_product_allocates_nothing_in_float32_only():
    """oneDNN packs reduced-precision operands (a bfloat16 ``mm`` allocates working memory); the seed draw
    never allocates; other library calls are always measured."""
    assert rules.allocates_nothing("mm", torch.float32) and rules.allocates_nothing("baddbmm", torch.float64)
    assert not rules.allocates_nothing("mm", torch.bfloat16) and not rules.allocates_nothing("addmm", torch.float16)
    assert not rules.allocates_nothing("bmm", None)
    assert rules.allocates_nothing("randint", torch.int64) and rules.allocates_nothing("randint", None)
    assert not rules.allocates_nothing("convolution", torch.float32)


def test_how_a_loop_is_lowered_is_decided_once():
    """An op is a loop, a stored loop, a scatter, a mutation or a reduction: never two of them."""
    families = {name: getattr(rules, name) for name in
                ("LOOP_OPS", "ALWAYS_STORED_LOOPS", "SCATTER_OPS", "MUTATIONS", "REDUCTION_OPS")}
    for (a, ops_a), (b, ops_b) in itertools.combinations(families.items(), 2):
        assert not ops_a & ops_b, f"{a} and {b} share {sorted(ops_a & ops_b)}"
    assert rules.INDEX_REDUCTIONS <= rules.REDUCTION_OPS
    assert rules.WELFORD_OPS <= rules.REDUCTION_OPS | {"std_mean"}
    assert set(rules.HEAVY_IR_OPS) <= rules.HEAVY_OPS


def test_config_record_is_read_now_not_at_import():
    record = inductor_config()
    assert record.max_fusion_size == inductor_settings.max_fusion_size
    assert record.realize_reads_threshold == inductor_settings.realize_reads_threshold
    assert record.cpu_acc_reads_threshold == (inductor_settings.realize_acc_reads_threshold
                                              or inductor_settings.realize_cpu_acc_reads_threshold)
    with inductor_settings.patch(max_fusion_size=7, realize_opcount_threshold=9, allow_buffer_reuse=False):
        patched = inductor_config()
    assert (patched.max_fusion_size, patched.cpu_opcount_threshold, patched.allow_buffer_reuse) == (7, 9, False)
    assert inductor_config() == record
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.max_fusion_size = 1  # type: ignore[misc]


def _config(**changes) -> InductorConfig:
    return dataclasses.replace(inductor_config(), **changes)


def op(name, kind=POINTWISE, inputs=(), **kw):
    return GraphOp(name, kind, tuple(inputs), MIB, MIB // 4, MIB // 4, **kw)


def test_kernel_model_follows_the_fusion_size_and_inplace_switch():
    """Six stored loops in a chain fuse into one kernel whose values stay in it (phantoms); at a
    ``max_fusion_size`` of 2 they fuse in pairs, and each pair's last value reaches memory."""
    chain = [op("p0", inputs=("x",), users=2, heavy=True)]
    chain += [op(f"p{i}", inputs=(f"p{i - 1}",), users=2, heavy=True) for i in range(1, 6)]
    chain += [op("e", EXTERN, ("p5",), users=0)]
    fused = schedule_kernels(chain, {"x": MIB}).kernels[0]
    assert (fused.buffers, fused.phantoms) == (("p5",), ("p0", "p1", "p2", "p3", "p4"))
    paired = schedule_kernels(chain, {"x": MIB}, config=_config(max_fusion_size=2)).kernels[0]
    assert (paired.buffers, paired.phantoms) == (("p1", "p3", "p5"), ("p0", "p2", "p4"))
    inplace = [op("m", EXTERN, ("x",), users=1), op("p", inputs=("m",), users=1), op("e", EXTERN, ("p",), users=0)]
    assert schedule_kernels(inplace, {"x": MIB}).kernels[1].inplace == (("p", "m"),)
    assert schedule_kernels(inplace, {"x": MIB}, config=_config(inplace_buffers=False)).kernels[1].inplace == ()


def test_kernel_model_follows_the_realize_thresholds():
    """A value two reductions read that loads 5 buffers is stored (more than
    ``realize_reads_threshold`` = 4), inlined at a threshold of 5; one loading 3 buffers and read
    once is inlined, stored at an acc-reads threshold of 2."""
    inputs = {f"x{i}": MIB for i in range(5)}

    def stored(ops, **changes):
        schedule = schedule_kernels(ops, inputs, config=_config(**changes))
        return "p" in {b for k in schedule.kernels for b in k.buffers + k.phantoms}

    def reduction(name, source):
        return GraphOp(name, REDUCTION, (source,), 4, 1, MIB // 4, users=1, is_output=True)

    wide = [op("p", inputs=tuple(inputs), users=2), reduction("s1", "p"), reduction("s2", "p")]
    assert stored(wide) and not stored(wide, realize_reads_threshold=5)
    narrow = [op("p", inputs=("x0", "x1", "x2"), users=1), reduction("s", "p")]
    assert not stored(narrow) and stored(narrow, realize_acc_reads_threshold=2)


def test_lean_code_generation_lowers_the_accumulated_reads_bound_to_the_reuse_bound():
    """"lean" sets ``realize_acc_reads_threshold`` to ``realize_reads_threshold`` where that is lower than the
    device's current bound (CPU 12, GPU 8 in torch 2.13), and nothing where it is not; "default" sets nothing; the
    context patches Inductor's config, which the simulator's record then reads, and restores it."""
    from remat._torch_inductor import code_generation, code_generation_patches

    reuse = inductor_settings.realize_reads_threshold
    assert code_generation_patches("default", "cpu") == {} == code_generation_patches("default", "cuda")
    for device in ("cpu", "cuda"):
        assert code_generation_patches("lean", device) == {"realize_acc_reads_threshold": reuse}
    with inductor_settings.patch(realize_acc_reads_threshold=reuse):    # the user's bound is lean already
        assert code_generation_patches("lean", "cpu") == {}
    with inductor_settings.patch(realize_cpu_acc_reads_threshold=reuse + 1):
        assert code_generation_patches("lean", "cpu") == {"realize_acc_reads_threshold": reuse}
    with pytest.raises(ValueError, match="unknown code generation 'fast'"):
        code_generation_patches("fast", "cpu")
    before = inductor_config()
    with code_generation("lean", "cpu"):
        assert inductor_config().cpu_acc_reads_threshold == reuse
    assert inductor_config() == before
