"""The memory simulator, the Inductor kernel model, and the steps they make of joint graphs.

Three layers, each on plain inputs with small exact numbers:
- ``simulate_memory`` on hand-built steps (lifetimes, in-place writes, Inductor's reuse pool);
- ``schedule_kernels`` on hand-built ``GraphOp`` lists (realization, fusion, order, phantoms);
- ``memory_steps`` on joint graphs captured with ``aot_function`` (no Inductor codegen).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remat._torch_inductor import inductor_config
from remat.simulator.kernel_lowering import ALIAS, EXTERN, POINTWISE, REDUCTION, GraphOp
from remat.simulator.kernel_schedule import schedule_kernels
from remat.simulator.memory_timeline import Step, _inductor_estimate, _lifetimes, simulate_memory
from remat.simulator.kernel_facts import RECOMPUTE_SUFFIX, kernel_kinds
from remat.simulator.schedule import memory_steps, partition_nodes, recompute_instance

from joint_graphs import capture_joint

MIB = 1 << 20


def step(name, allocs=(), uses=(), phase="backward", **kw):
    return Step(name, phase, tuple(allocs), tuple(uses), **kw)


# -- simulate_memory ---------------------------------------------------------------------------


def test_storage_lives_from_allocation_to_last_reader():
    steps = [step("a", [("a", 100)]), step("b", [("b", 200)], ["a"]), step("c", [("c", 50)], ["b"])]
    sim = simulate_memory(steps)
    # sampled after each step allocates, while its inputs are still live
    assert sim.timeline_bytes == (100, 300, 250)
    assert (sim.peak_bytes, sim.peak_step, sim.peak_step_name) == (300, 1, "b")
    assert dict(sim.live_at_peak) == {"a": 100, "b": 200}
    assert sim.end_bytes == 0


def test_pinned_storages_are_never_freed():
    steps = [step("a", [("a", 100)]), step("b", [("b", 10)], ["a"]), step("c", [("c", 1)], ["b"])]
    sim = simulate_memory(steps, pinned={"a"})
    assert sim.timeline_bytes == (100, 110, 111)
    assert sim.end_bytes == 100   # a, pinned; c is read by nobody, so it dies at its own step
    assert simulate_memory([]).peak_bytes == 0


def test_inplace_write_takes_over_a_dying_input_of_its_size():
    base = [step("a", [("a", 100)]), step("b", [("b", 100)], ["a"], inplace=(("b", "a"),))]
    assert simulate_memory(base).timeline_bytes == (100, 100)
    # no takeover when the input is read later, or its size differs
    read_later = base + [step("c", [("c", 1)], ["a", "b"])]
    assert simulate_memory(read_later).timeline_bytes[:2] == (100, 200)
    other_size = [step("a", [("a", 100)]), step("b", [("b", 60)], ["a"], inplace=(("b", "a"),))]
    assert simulate_memory(other_size).timeline_bytes == (100, 160)


def test_inplace_write_over_a_value_the_same_kernel_made():
    # Inductor's sigmoid then silu-backward in one kernel: the second output overwrites the first
    kernel = step("k", [("a", 100), ("b", 100)], inplace=(("b", "a"),))
    assert simulate_memory([kernel]).timeline_bytes == (100,)
    read_later = [kernel, step("c", [("c", 1)], ["a"])]
    assert simulate_memory(read_later).timeline_bytes == (200, 101)   # b, read by nobody, dies at once


def _pool_steps(phantom: int):
    """x (100) dies after y; w (100) is allocated two steps later: may w take x's buffer?"""
    return [
        step("x", [("x", 100)]),
        step("y", [("y", 10)], ["x"], phantom_bytes=phantom),
        step("z", [("z", 10)], ["y"]),
        step("w", [("w", 100)], ["z"]),
        step("end", [("e", 1)], ["w"]),
    ]


def test_reuse_pool_holds_a_freed_buffer_when_inductors_estimate_allows():
    # Inductor's estimate peaks at y: 110 + 50 removed bytes = 160; holding x over z keeps
    # it at 20 + 100 = 120 <= 160, so x is held and renamed to w instead of freed.
    held = simulate_memory(_pool_steps(phantom=50))
    assert held.timeline_bytes == (100, 110, 120, 110, 101)
    assert held.peak_bytes == 120
    assert simulate_memory(_pool_steps(phantom=50), reuse_freed=False).timeline_bytes == (100, 110, 20, 110, 101)


def test_reuse_pool_frees_the_buffer_when_holding_it_would_raise_the_estimate():
    # estimate peak 110; holding x over z would make it 120 > 110: x is freed
    assert simulate_memory(_pool_steps(phantom=0)).timeline_bytes == (100, 110, 20, 110, 101)


def test_reuse_pool_always_reuses_into_the_next_kernel():
    steps = [step("x", [("x", 100)]), step("y", [("y", 1)], ["x"]), step("w", [("w", 100)], ["y"])]
    assert simulate_memory(steps).timeline_bytes == (100, 101, 101)   # x becomes w: no new bytes
    # marker steps (no allocations, no reads) are not kernels: w is still in the next kernel,
    # so x is held through the marker and becomes w
    marked = steps[:2] + [step("view")] + steps[2:]
    assert simulate_memory(marked).timeline_bytes == (100, 101, 101, 101)
    assert simulate_memory(marked, reuse_freed=False).timeline_bytes == (100, 101, 1, 101)


def test_reuse_pool_never_holds_external_untracked_or_other_graph_storages():
    tail = [step("z", [("z", 10)], ["y"]), step("w", [("w", 100)], ["z"]), step("end", [("e", 1)], ["w"])]
    for first in (step("x", [("x", 100)], external=True), step("x", [("x", 100)], pooled=False),
                  step("x", [("x", 100)], phase="forward")):
        steps = [first, step("y", [("y", 10)], ["x"], phantom_bytes=50)] + tail
        assert simulate_memory(steps).timeline_bytes[2] == 20, first


def test_each_graphs_estimate_counts_only_its_own_buffers_and_its_inputs():
    # Inductor estimates the backward from the backward's graph alone: the forward's output (alive
    # for the loss, never read by the backward) is not in it; a saved value is, until its last reader.
    steps = [
        step("out", [("out", 500)], phase="forward"),
        step("saved", [("saved", 100)], phase="forward"),
        step("g1", [("g1", 10)], ["saved"]),
        step("g2", [("g2", 10)], ["g1"]),
    ]
    pinned = {"out", "g2"}
    estimate = _inductor_estimate(steps, _lifetimes(steps, pinned))
    assert estimate == [500, 600, 110, 20]
    assert simulate_memory(steps, pinned).timeline_bytes == (500, 600, 610, 520)


def test_reuse_pool_offers_the_most_recently_freed_buffer():
    steps = [
        step("a", [("a", 100)]), step("b", [("b", 100)], phantom_bytes=200),
        step("use_a", [("u", 1)], ["a"]), step("use_b", [("v", 1)], ["b", "u"]),
        step("w", [("w", 100)], ["v"]),
    ]
    # The estimate (peak 400) would allow holding either. w takes b (freed last); a is freed
    # where it died. Taking a instead would hold it over use_b (202).
    assert simulate_memory(steps).timeline_bytes == (100, 200, 201, 102, 101)


# -- schedule_kernels ----------------------------------------------------------------------------


def op(name, kind=POINTWISE, inputs=(), nbytes=MIB, numel=MIB // 4, **kw):
    kw.setdefault("loop_numel", numel)
    return GraphOp(name, kind, tuple(inputs), nbytes, numel, **kw)


def kernels_of(schedule):
    return [(k.ops, k.buffers, k.phantoms) for k in schedule.kernels]


def test_cheap_pointwise_value_read_twice_is_inlined_an_expensive_one_stored():
    for heavy, stored in ((False, False), (True, True)):
        ops = [op("p", inputs=("x",), users=2, heavy=heavy), op("e1", EXTERN, ("p",), users=0),
               op("e2", EXTERN, ("p",), users=0)]
        schedule = schedule_kernels(ops, {"x": MIB})
        if stored:
            assert kernels_of(schedule)[0] == (("p",), ("p",), ())
            assert schedule.kernels[1].loads == ("p",)
        else:
            # an extern reads it, so it is stored, but only where the first extern needs it
            assert [k.ops for k in schedule.kernels] == [("p",), ("e1",), ("e2",)]
    inlined = schedule_kernels([op("p", inputs=("x",), users=2), op("s1", REDUCTION, ("p",), numel=1),
                                op("s2", REDUCTION, ("p",), numel=1)], {"x": MIB})
    assert "p" in inlined.stands_for and inlined.stands_for["p"] == ("x",)
    assert all(k.loads == ("x",) for k in inlined.kernels)


def test_a_heavy_value_read_broadcast_is_stored_and_its_reader_inlined():
    """A log-softmax's tail: ``log`` of the row sums (heavy, one value per row) is read by a loop over
    every logit, which broadcasts it; Inductor's ``expand`` marks it reused once per logit of its row
    (``graph_reuse=False``), so it is stored, and the shifted logits, with two readers and nothing heavy
    left inlined, are not: no logits-sized buffer of theirs. A cheap broadcast value stays inlined."""
    rows, logits = 128, 128 * 512
    for heavy in (True, False):
        ops = [op("m", EXTERN, ("x",), nbytes=4 * logits, numel=logits, users=2),
               op("a", REDUCTION, ("m",), nbytes=4 * rows, numel=rows, loop_numel=logits, users=1),
               op("t", inputs=("m", "a"), nbytes=4 * logits, numel=logits, users=2),
               op("s", REDUCTION, ("t",), nbytes=4 * rows, numel=rows, loop_numel=logits, users=1, inner_reduction=True),
               op("l", inputs=("s",), nbytes=4 * rows, numel=rows, users=1, heavy=heavy),
               op("u", inputs=("t", "l"), nbytes=4 * logits, numel=logits, users=2),
               op("e", inputs=("u",), nbytes=4 * logits, numel=logits, users=1, is_output=True, heavy=True),
               op("g", REDUCTION, ("u",), nbytes=4, numel=1, loop_numel=logits, users=1, is_output=True)]
        schedule = schedule_kernels(ops, {"x": MIB})
        stored = {b for k in schedule.kernels for b in k.buffers}
        assert ("l" in stored) == heavy and "u" not in stored, (heavy, stored)


def test_a_scatters_fill_is_its_own_node_in_the_peak_memory_orders():
    """Inductor runs a scatter as two scheduler nodes: the loop filling its buffer (zeros, for an
    embedding's gradient), which allocates and frees nothing, and the fallback scattering the values
    into it, which frees them. Its LPMF order therefore runs the weight gradients (graph outputs that
    free their inputs) before the fill, not after one node that both allocates and frees (hf-1353, a
    tied Mistral: its backward kept the weight gradients where they were, 4,214,528 B; the model, one
    node, ran them after the scatter and simulated 3,821,312 B)."""
    from remat.simulator.peak_reorder import _SchedulerNodes

    members = {n: [n] for n in ("w1", "w2", "s", "a")}
    loads = {"w1": frozenset({"x1"}), "w2": frozenset({"x2"}), "s": frozenset({"v"}), "a": frozenset({"s", "l"})}
    nbytes = dict.fromkeys(members, 393216)
    inputs = {"x1": 180224, "x2": 180224, "v": 246272, "l": 131072}
    args = (["s", "w1", "w2", "a"], members, loads, nbytes, frozenset({"w1", "w2", "a"}), {}, inputs)
    assert _SchedulerNodes(*args).lpmf() == ["s", "a", "w1", "w2"]
    assert _SchedulerNodes(*args, fills={"s": frozenset()}).lpmf() == ["w1", "w2", "s#fill", "s", "a"]


def test_loops_sharing_an_input_fuse_and_allocate_together():
    ops = [op("a", inputs=("x",), users=1), op("b", inputs=("x",), users=1),
           op("ea", EXTERN, ("a",), users=0), op("eb", EXTERN, ("b",), users=0)]
    schedule = schedule_kernels(ops, {"x": MIB})
    assert kernels_of(schedule)[0] == (("a", "b"), ("a", "b"), ())
    # a loop over another number of elements does not fuse
    ops[1] = op("b", inputs=("x",), users=1, numel=MIB // 8, nbytes=MIB // 2)
    kernels = [k.ops for k in schedule_kernels(ops, {"x": MIB}).kernels]
    assert ("a",) in kernels and ("b",) in kernels     # (reorder_for_peak_memory runs the smaller b first)


def test_kernels_in_the_order_reorder_for_peak_memory_keeps():
    # A backward: g (a weight gradient, 2 MiB, returned) comes first in graph order, then t and u
    # (the input gradient, returned). Inductor's reorder_for_peak_memory runs g last (its LPMF
    # order: 3 MiB where graph order peaks at 4 MiB); the kernel model kept graph order until the
    # reorder was modelled (corpus rand-1101: plain Inductor's partition measured 409,128 B with the
    # reorder, 464,424 B without, the simulation said 466,464 B).
    ops = [op("g", EXTERN, ("tangents_1",), nbytes=2 * MIB, users=1, is_output=True),
           op("t", EXTERN, ("tangents_1",), users=1), op("u", EXTERN, ("t",), users=1, is_output=True)]
    order = [k.ops for k in schedule_kernels(ops, {"tangents_1": MIB}).kernels]
    assert order == [("t",), ("u",), ("g",)]
    config = dataclasses.replace(inductor_config(), reorder_for_peak_memory=False)
    assert [k.ops for k in schedule_kernels(ops, {"tangents_1": MIB}, config=config).kernels] == [("g",), ("t",), ("u",)]


def test_fusion_never_makes_a_cycle_through_an_extern():
    # a -> e -> b and both read x: fusing a with b would need e inside the kernel
    ops = [op("a", inputs=("x",), users=1), op("e", EXTERN, ("a",), users=1),
           op("b", inputs=("x", "e"), users=1), op("f", EXTERN, ("b",), users=0)]
    assert [k.ops for k in schedule_kernels(ops, {"x": MIB}).kernels] == [("a",), ("e",), ("b",), ("f",)]


def test_fused_kernel_runs_where_its_earliest_member_was_after_its_producers():
    # Llama's MLP backward: p1 feeds e2, p2 needs m1; p1 and p2 share x and fuse, so the
    # kernel sits at p1's place and pulls m1 (graph-later) before it.
    ops = [
        op("p1", inputs=("x",), users=1), op("e2", EXTERN, ("p1",), users=0),
        op("m1", EXTERN, ("y",), users=1), op("p2", inputs=("x", "m1"), users=1),
        op("e3", EXTERN, ("p2",), users=0),
    ]
    order = [k.ops for k in schedule_kernels(ops, {"x": MIB, "y": MIB}).kernels]
    assert order == [("m1",), ("p1", "p2"), ("e2",), ("e3",)]


def test_stored_value_read_only_inside_its_kernel_is_a_phantom():
    # h: exp, read twice, both readers fuse with it: Inductor's estimate counts h, codegen drops it
    ops = [op("h", inputs=("x",), users=2, heavy=True), op("a", inputs=("h",), users=1),
           op("b", inputs=("h", "x"), users=1), op("ea", EXTERN, ("a",), users=0), op("eb", EXTERN, ("b",), users=0)]
    first = schedule_kernels(ops, {"x": MIB}).kernels[0]
    assert (first.ops, first.buffers, first.phantoms) == (("h", "a", "b"), ("a", "b"), ("h",))
    assert first.loads == ("x",)
    # a reduction's result is never dropped: a second loop nest reads it
    ops = [op("r", REDUCTION, ("x",), numel=1024, nbytes=4096, loop_numel=MIB // 4, inner_reduction=True, users=1),
           op("n", inputs=("x", "r"), users=1), op("e", EXTERN, ("n",), users=0)]
    assert kernels_of(schedule_kernels(ops, {"x": MIB}))[0] == (("r", "n"), ("r", "n"), ())


def test_loop_overwrites_a_buffer_when_it_is_its_last_reader():
    ops = [op("m", EXTERN, ("x",), users=1), op("p", inputs=("m",), users=1), op("e", EXTERN, ("p",), users=0)]
    assert schedule_kernels(ops, {"x": MIB}).kernels[1].inplace == (("p", "m"),)
    # not a graph input unless donated, and not a buffer another kernel reads later
    ops = [op("p", inputs=("x",), users=1), op("e", EXTERN, ("p",), users=0)]
    assert schedule_kernels(ops, {"x": MIB}).kernels[0].inplace == ()
    assert schedule_kernels(ops, {"x": MIB}, donated=frozenset({"x"})).kernels[0].inplace == (("p", "x"),)
    ops = [op("m", EXTERN, ("x",), users=2), op("p", inputs=("m",), users=1), op("e", EXTERN, ("p", "m"), users=0)]
    assert schedule_kernels(ops, {"x": MIB}).kernels[1].inplace == ()


# -- memory_steps on captured joint graphs --------------------------------------------------------

ROWS, WIDTH = 512, 512   # 512 x 512 fp32 = 1 MiB


def _steps(fn, *inputs, saved=None):
    facts = capture_joint(fn, *inputs).facts()
    chosen = {n for n in facts.needed_by_backward if facts.nodes[n].role == "forward"} if saved is None else saved
    steps, pinned = memory_steps(facts, partition_nodes(facts, chosen))
    return facts, steps, pinned


def _alloc_steps(steps, phase):
    return [(s.name, tuple(sorted(n for _, n in s.allocs))) for s in steps if s.phase == phase and s.allocs]


@pytest.fixture(scope="module")
def tensors():
    torch.manual_seed(0)
    return torch.randn(ROWS, WIDTH), [torch.randn(WIDTH, WIDTH, requires_grad=True) for _ in range(3)]


def test_sin_and_cos_of_one_input_fuse_into_one_kernel(tensors):
    x, (w1, w2, _) = tensors

    def f(x, w1, w2):
        return (torch.sin(x) @ w1 + torch.cos(x) @ w2).sum()

    facts, steps, _ = _steps(f, x, w1, w2)
    forward = _alloc_steps(steps, "forward")
    # both loop values are allocated by one kernel call, before either matmul runs
    assert forward[0][1] == (MIB, MIB)
    # then the first matmul, and the second as Inductor's addmm into the sum: one call, at the add
    assert [facts.nodes[name].op for name, _ in forward[1:3]] == ["aten.mm.default", "aten.add.Tensor"]


def test_backward_relu_writes_over_the_matmul_gradient_it_masks(tensors):
    x, (w1, w2, _) = tensors

    def f(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).sum()

    facts, steps, _ = _steps(f, x, w1, w2)
    masked = [s for s in steps if s.phase == "backward" and s.inplace]
    assert len(masked) == 1
    written, overwritten = masked[0].inplace[0]
    assert facts.nodes[overwritten].op == "aten.mm.default" and dict(masked[0].allocs)[written] == MIB


def test_saved_transposes_of_inputs_count_in_inductors_estimate_until_their_last_reader(tensors):
    # x.t() and w2.t() are backward inputs whose memory is the step's inputs', not the step's own:
    # the window does not hold them, but Inductor's peak estimate (which gates its buffer reuse)
    # counts every input not named primals_*/tangents_* until its last reader.
    x, (w1, w2, _) = tensors

    def f(x, w1, w2):
        return (torch.relu(x @ w1) @ w2).sum()

    facts, steps, _ = _steps(f, x, w1, w2)
    primals = {n for n in facts.order if facts.nodes[n].role == "primal"}
    transposes = [n for n in facts.order if facts.nodes[n].is_view and facts.nodes[n].inputs[0] in primals]
    assert len(transposes) == 2
    backward = [s for s in steps if s.phase == "backward" and s.name != "<tangents>"]
    # a view of a saved value is rebuilt in the backward (each storage saved once): its step is named <node>@r0
    node_of = {s.name: facts.nodes[s.name.split(RECOMPUTE_SUFFIX)[0]] for s in backward}
    last = {t: max(i for i, s in enumerate(backward) if t in node_of[s.name].inputs) for t in transposes}
    assert [s.phantom_bytes for s in backward] == [MIB * sum(i <= end for end in last.values()) for i in range(len(backward))]
    assert backward[0].phantom_bytes == 2 * MIB and backward[-1].phantom_bytes <= MIB


def test_recomputed_values_are_suffixed_and_outputs_pinned(tensors):
    x, (w1, w2, _) = tensors

    def f(x, w1, w2):
        return (torch.tanh(x @ w1) @ w2).sum()

    facts = capture_joint(f, x, w1, w2).facts()
    mm = next(n for n in facts.order if facts.nodes[n].op == "aten.mm.default")
    partition = partition_nodes(facts, set())   # save nothing: the backward recomputes x @ w1
    assert mm in partition.recomputed
    steps, pinned = memory_steps(facts, partition)
    allocated = {sid for s in steps if s.phase == "backward" for sid, _ in s.allocs}
    assert recompute_instance(mm, 0) in allocated    # its first (here only) recomputation: mm@r0
    grads = {s for o in facts.bwd_outputs for s in facts.nodes[o].value_storages}
    assert grads and grads <= pinned
    sim = simulate_memory(steps, pinned)
    assert sim.end_bytes >= 2 * MIB     # the two weight gradients outlive the step


def test_every_read_storage_is_allocated_before_it_is_read(tensors):
    x, (w1, w2, w3) = tensors

    def f(x, w1, w2, w3):
        h = torch.nn.functional.gelu(x @ w1)
        g = torch.sigmoid(h @ w2) * h
        return torch.nn.functional.layer_norm(g @ w3, (WIDTH,)).sum()

    facts = capture_joint(f, x, w1, w2, w3).facts()
    for saved in ({n for n in facts.needed_by_backward if facts.nodes[n].role == "forward"}, set()):
        steps, _ = memory_steps(facts, partition_nodes(facts, saved))
        made: set[str] = set()
        outside = {s for n in facts.order if facts.nodes[n].role in ("primal", "tangent") for s in facts.nodes[n].value_storages}
        for s in steps:
            made |= {sid for sid, _ in s.allocs}
            assert set(s.uses) <= made | outside, s.name


def test_cpu_convolution_gets_channels_last_copies_and_flattening_it_copies(tensors):
    # Inductor's CPU layout optimization: the weight and the input are copied to channels-last
    # up front; a flatten of the channels-last output cannot be a view, so the matmul gets a copy.
    torch.manual_seed(0)
    x = torch.randn(8, 4, 16, 16)                       # 32 KiB
    w = torch.randn(8, 4, 3, 3, requires_grad=True)     # 1152 B
    w2 = torch.randn(8 * 16 * 16, 4, requires_grad=True)

    def f(x, w, w2):
        y = torch.nn.functional.conv2d(x, w, padding=1)   # 8 x 8 x 16 x 16 fp32 = 64 KiB
        return (y.view(8, -1) @ w2).sum()

    facts, steps, _ = _steps(f, x, w, w2)
    first = steps[0]
    assert first.name == "<channels_last>"
    assert sorted(n for _, n in first.allocs) == [1152, 32 * 1024]
    copies = [(sid, n) for s in steps if s.phase == "forward" for sid, n in s.allocs if sid.endswith("#copy")]
    assert copies == [(copies[0][0], 64 * 1024)]


def test_viewability_under_channels_last_matches_torch():
    from remat.simulator.kernel_facts import _viewable_in_channels_last

    for shape, target in [((16, 16, 16, 16), (256, 256)), ((16, 16, 16, 16), (16, 16, 256)), ((16, 32, 1, 1), (16, 32)),
                          ((8, 3, 4, 5), (8, 60)), ((8, 3, 4, 5), (8, 3, 20)), ((2, 3, 4, 5), (2, 3, 4, 5))]:
        tensor = torch.empty(shape).contiguous(memory_format=torch.channels_last)
        try:
            tensor.view(target)
            viewable = True
        except RuntimeError:
            viewable = False
        assert _viewable_in_channels_last(shape, target) == viewable, (shape, target)


def test_a_buffer_written_in_place_over_a_graph_input_is_never_reused_on_cpu():
    # Off GPU every graph input is unaligned (``utils.should_assume_input_aligned``), an in-place
    # output inherits that (``KernelArgs.make_inplace``), and the reuse key holds the alignment:
    # no fresh (aligned) allocation takes the buffer over, so it is freed at its last reader.
    def steps(donor_phase):
        return [
            step("saved", [("saved", 100)], phase=donor_phase),
            step("g", [("g", 100)], ["saved"], inplace=(("g", "saved"),)),   # g overwrites saved
            step("y", [("y", 10)], ["g"], phantom_bytes=50),
            step("z", [("z", 10)], ["y"]),
            step("w", [("w", 100)], ["z"]),
            step("end", [("e", 1)], ["w"]),
        ]
    # saved made by the forward: an input of the backward; g is freed after y, not held for w
    assert simulate_memory(steps("forward")).timeline_bytes == (100, 100, 110, 20, 110, 101)
    assert simulate_memory(steps("forward"), aligned_inputs=True).timeline_bytes == (100, 100, 110, 120, 110, 101)
    # saved made by this graph: aligned, so g is held and renamed to w as before
    assert simulate_memory(steps("backward")).timeline_bytes == (100, 100, 110, 120, 110, 101)


def test_the_pieces_of_a_split_are_views_not_buffers():
    # ``lowering.split`` slices its input: a getitem of it is a view (no scheduler node), unlike a
    # getitem of a multi-output loop (one buffer each). As loops, GPT's q/k/v pieces added three
    # nodes per recompute region to the horizontal-fusion distance Inductor measures.
    def f(x, w):
        q, k, v = (x @ w).split(8, dim=-1)
        return (q * 2 + k * 3 + v).sum()

    facts = capture_joint(f, torch.randn(16, 8), torch.randn(8, 24, requires_grad=True)).facts()
    kinds = kernel_kinds(facts)
    pieces = [n for n in facts.order if facts.nodes[n].is_getitem
              and facts.nodes[facts.nodes[n].inputs[0]].op.startswith("aten.split")]
    assert len(pieces) == 3 and {kinds[n] for n in pieces} == {ALIAS}


@pytest.mark.parametrize("tokens", [64, 4])
def test_a_tied_weights_gradient_product_runs_apart_when_fusing_it_would_hold_more(tokens):
    # The weight of a tied LM head is also the embedding's: its gradient is
    # add(mm(grad_logits^T, h), embedding_grad). Inductor's post-grad pass makes that one call,
    # addmm(embedding_grad, grad_logits^T, h), at the add's place (after the embedding's backward), so
    # grad_logits (tokens x vocab) would stay live until then. remat keeps the product apart when its
    # operands that would die early are more bytes than the product (64 tokens: 64 KiB + 8 KiB against
    # 32 KiB), and lets Inductor fuse it otherwise (4 tokens: 4 KiB + 512 B): then the product has no
    # buffer of its own and the add is that call, reading the product's operands. (The real pipeline's
    # joint graph passes cancel the transposes ``h @ w.t()`` leaves around the product; this capture
    # runs none, so the model is written without them.) rand-1277 of the corpus (a tied head, the loss
    # outside): the product's buffer next to the sum's made its no-budget plan simulate 7.8% over.
    torch.manual_seed(0)
    idx, w, w1 = torch.randint(0, 256, (tokens,)), torch.randn(256, 32, requires_grad=True), torch.randn(32, 32, requires_grad=True)

    def f(idx, w, w1):
        h = torch.tanh(torch.nn.functional.embedding(idx, w) @ w1)
        return torch.nn.functional.cross_entropy((w @ h.t()).t(), idx)   # dw = mm(grad_logits^T, h) + ...

    facts, steps, _ = _steps(f, idx, w, w1)
    (grad,) = [facts.nodes[o] for o in facts.bwd_outputs if facts.nodes[o].op == "aten.add.Tensor"]   # w's
    (product, other), = [(a, b) for a, b in (grad.inputs, grad.inputs[::-1]) if facts.nodes[a].op == "aten.mm.default"]
    order = [s.name for s in steps if s.phase == "backward"]
    at = next(i for i, s in enumerate(steps) if s.name == grad.name)
    sizes = {sid: n for s in steps for sid, n in s.allocs}
    logits_grads = [sid for s in steps for sid, n in s.allocs if n == tokens * 256 * 4 and s.phase == "backward"]
    if tokens == 4:     # fused: one buffer for the product and the sum, allocated at the add
        assert product not in order and order.index(other) < order.index(grad.name)
        assert not any(sid.startswith(product) for s in steps for sid, _ in s.allocs)
        assert [n for _, n in steps[at].allocs] == [256 * 32 * 4]
        # the logits' gradient (tokens x 256 floats) is read by the add, and by nothing after it
        (logits_grad,) = [sid for sid in steps[at].uses if sizes.get(sid) == tokens * 256 * 4]
        assert not any(logits_grad in s.uses for s in steps[at + 1:])
    else:               # apart: the product has its own buffer, before the embedding's gradient
        assert order.index(product) < order.index(other) < order.index(grad.name)
        assert any(sid.startswith(product) for s in steps for sid, _ in s.allocs)
        # the logits' gradient is dead before the add
        assert logits_grads and not any(sid in s.uses for sid in logits_grads for s in steps[at:])


@pytest.mark.parametrize("permuted", [True, False])
def test_a_saved_expand_of_a_permuted_loop_value_is_copied_at_its_expanded_size(permuted):
    # Llama's GQA: keys rotated (a loop over a transposed projection) then repeated (repeat_kv's
    # expand). Inductor returns a view with its traced stride order; the loop's buffer is row-major,
    # so a view of a permuted value cannot be expressed and Inductor copies it at the view's size
    # (2 x 64 x 2 x 32 floats here, twice the keys). A row-major value's view stays a view.
    torch.manual_seed(0)
    x, w = torch.randn(64, 32), torch.randn(32, 64, requires_grad=True)

    def f(x, w):
        k = (x @ w).view(64, 2, 32)
        k = k.transpose(0, 1) if permuted else k.view(2, 64, 32)
        k = k * 2.0 + torch.cat([-k[..., 16:], k[..., :16]], -1)
        e = k[:, None].expand(2, 2, 64, 32)
        return (e.reshape(4, 64, 32) @ e.reshape(4, 64, 32).transpose(1, 2)).sum()

    facts = capture_joint(f, x, w).facts()
    (expand,) = [n for n in facts.order if facts.nodes[n].op == "aten.expand.default"
                 and facts.nodes[n].shape == (2, 2, 64, 32) and facts.nodes[n].role == "forward"]
    steps, _ = memory_steps(facts, partition_nodes(facts, {expand}))
    copies = [(sid, n) for s in steps if s.phase == "forward" for sid, n in s.allocs if sid.startswith(expand)]
    if permuted:
        assert copies == [(expand + "#copy", 2 * 2 * 64 * 32 * 4)]
        assert any(expand + "#copy" in s.uses for s in steps if s.phase == "backward")
    else:
        assert copies == []
