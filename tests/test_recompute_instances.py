"""Recomputing a value more than once: per-use recompute instances (issue 2's low budgets).

A stack of layers whose backward recomputes everything from the inputs: with every
recomputed value held until its last backward reader, the first region (for the last
layer) rebuilds the whole chain and keeps it alive through the rest of the backward.
Rebuilding a chain's intermediates for each layer that needs them lowers the simulated
peak; the rewritten backward holds one copy of the node per recomputation, and its
gradients equal eager's.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remat._torch_compile import split_joint
from remat.dump import annotated_code
from remat.simulator.memory_timeline import simulate_memory
from remat.simulator.kernel_steps import kernel_steps
from remat.simulator.kernel_facts import storage_owner
from remat.passes.plan import make_plan
from remat.passes.rewrite import REMAT_KEY, RecomputeTag, place_recompute_regions
from remat.simulator.schedule import (
    backward_order, forward_order, memory_steps, partition_nodes, rebuilds_intermediates, recompute_instance,
    recompute_time_s,
)

from joint_graphs import capture_joint

MIB = 1 << 20
LAYERS = 4


def layers(x, w1, w2, w3, w4):
    for w in (w1, w2, w3, w4):
        x = torch.tanh(x @ w)
    return x.sum()


@pytest.fixture(scope="module")
def chain():
    torch.manual_seed(0)
    x = torch.randn(2048, 512)                                   # activations 2048 x 512 fp32 = 4 MiB
    ws = [torch.randn(512, 512, requires_grad=True) for _ in range(LAYERS)]   # 1 MiB each
    captured = capture_joint(layers, x, *ws)
    facts = captured.facts()
    partition = partition_nodes(facts, set())                    # save nothing: recompute every layer
    return captured, facts, partition, (x, *ws)


def _peak(facts, partition, rebuild):
    steps, pinned = kernel_steps(facts, partition, forward_order(facts, partition),
                                 backward_order(facts, partition, rebuild))
    return simulate_memory(steps, pinned)


def test_rebuilding_intermediates_recomputes_a_value_twice(chain):
    _, facts, partition, _ = chain
    held = backward_order(facts, partition, rebuild=False)
    rebuilt = backward_order(facts, partition, rebuild=True)
    held_counts = {}
    for s in held:
        if s.region >= 0:
            held_counts[s.name] = held_counts.get(s.name, 0) + 1
    assert set(held_counts.values()) == {1}, "held: every value is recomputed once"
    counts = {}
    for s in rebuilt:
        if s.region >= 0:
            assert s.instance == recompute_instance(s.name, counts.get(s.name, 0))
            counts[s.name] = counts.get(s.name, 0) + 1
    first_mm = next(n for n in facts.order if facts.nodes[n].op == "aten.mm.default")
    # the first layer's matmul feeds every later layer: rebuilt for each layer's weight gradient
    assert counts[first_mm] == LAYERS
    # every copy reads instances made before it, every recomputed instance is read later
    made, read = set(), set()
    for s in rebuilt:
        for _, inst in s.reads:
            assert inst in made
            read.add(inst)
        made.add(s.instance)
    assert {s.instance for s in rebuilt if s.region >= 0} == read


def test_rebuilding_lowers_the_chain_peak_and_costs_the_extra_recomputations(chain):
    _, facts, partition, _ = chain
    held, rebuilt = _peak(facts, partition, False), _peak(facts, partition, True)
    # held: the last layer's region rebuilds the whole chain (4 MiB per matmul and tanh)
    # and keeps what the earlier layers' gradients read
    assert rebuilt.peak_bytes < held.peak_bytes
    assert held.peak_bytes - rebuilt.peak_bytes >= 4 * MIB
    instances_at_peak = {sid for sid, _ in rebuilt.live_at_peak if "@r" in sid}
    assert len({storage_owner(s) for s in instances_at_peak}) <= len(instances_at_peak)
    assert rebuilds_intermediates(facts, partition)
    steps, pinned = memory_steps(facts, partition)             # what the planner simulates
    assert simulate_memory(steps, pinned).peak_bytes == rebuilt.peak_bytes
    once = sum(facts.nodes[n].cost.est_time_s for n in partition.recomputed)
    per_instance = sum(facts.nodes[s.name].cost.est_time_s
                       for s in backward_order(facts, partition, rebuild=True) if s.region >= 0)
    assert recompute_time_s(facts, partition) == pytest.approx(per_instance)
    assert per_instance > once


def test_holding_is_kept_when_rebuilding_does_not_lower_the_peak():
    torch.manual_seed(0)
    x = torch.randn(512, 512)
    w = torch.randn(512, 512, requires_grad=True)
    facts = capture_joint(lambda x, w: torch.tanh(x @ w).sum(), x, w).facts()
    partition = partition_nodes(facts, set())
    assert not rebuilds_intermediates(facts, partition)
    assert all(s.instance == recompute_instance(s.name, 0) for s in backward_order(facts, partition) if s.region >= 0)


def test_rewritten_backward_holds_one_copy_per_instance_and_gradients_equal_eager(chain):
    captured, facts, partition, inputs = chain
    plan = make_plan(facts, None)
    plan = dataclasses.replace(plan, saved=tuple(sorted(partition.saved)),
                               recomputed=tuple(sorted(partition.recomputed)),
                               saved_primals=tuple(sorted(partition.saved_primals)),
                               backward_order=tuple(backward_order(facts, partition)))
    joint = captured.graph_module
    fw, bw = split_joint(joint, plan.saved_primals + plan.saved, captured.num_fwd_outputs)
    bw, regions = place_recompute_regions(bw, facts, plan)

    order = backward_order(facts, partition)
    copies = {}
    for node in bw.graph.nodes:
        tag = node.meta.get(REMAT_KEY)
        if isinstance(tag, RecomputeTag):
            copies.setdefault(tag.source, []).append((tag.instance, tag.region))
    expected = {}
    for s in order:
        if s.region >= 0:
            expected.setdefault(s.name, []).append((int(s.instance.rsplit("@r", 1)[1]), s.region))
    assert copies == expected
    first_mm = next(n for n in facts.order if facts.nodes[n].op == "aten.mm.default")
    assert len(copies[first_mm]) == LAYERS, "the first matmul appears once per layer that rebuilds it"
    assert [r.region for r in regions] == sorted({s.region for s in order if s.region >= 0})
    # the dump fences every region, second copies included, and each copy sits inside its fence
    code = annotated_code(bw, regions).splitlines()
    for region in regions:
        start = code.index(next(line for line in code if line.startswith(f"    # ---- recompute region {region.region}:")))
        end = code.index(f"    # ---- end of recompute region {region.region}")
        inside = {line.strip().split(" = ", 1)[0] for line in code[start:end]}
        assert set(region.nodes) <= inside
    assert any(name.endswith("_r1") for region in regions for name in region.nodes)

    # run the two graphs as plain Python: the gradients equal eager autograd's, bit for bit
    x, *ws = inputs
    fw_out = fw(x, *[w.detach() for w in ws])
    n_out = captured.num_fwd_outputs
    outputs, saved = fw_out[:n_out], fw_out[n_out:]
    grads = bw(*saved, torch.ones_like(outputs[0]))
    grads = [g for g in grads if g is not None]
    loss = layers(x, *ws)
    expected_grads = torch.autograd.grad(loss, ws)
    assert len(grads) == len(expected_grads)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)


def test_the_rewrite_emits_the_plans_own_schedule_and_refuses_one_simulated_for_another_saved_set(chain):
    """``Plan.backward_order`` is the schedule the plan's peak was simulated on; the rewrite emits it
    (it no longer works the schedule out again from the facts), and a plan whose saved set was edited
    after planning, its schedule left as it was, is an error rather than a backward nobody simulated."""
    captured, facts, _, _ = chain
    plan = make_plan(facts, None)
    copies = [(s.name, int(s.instance.rsplit("@r", 1)[1])) for s in plan.backward_order if s.region >= 0]
    assert copies, "the plan recomputes nothing: nothing to check"
    _, bw = split_joint(captured.graph_module, plan.saved_primals + plan.saved, captured.num_fwd_outputs)
    bw, _ = place_recompute_regions(bw, facts, plan)
    emitted = [(n.meta[REMAT_KEY].source, n.meta[REMAT_KEY].instance) for n in bw.graph.nodes
               if isinstance(n.meta.get(REMAT_KEY), RecomputeTag)]
    assert emitted == copies

    everything = tuple(sorted(set(plan.saved) | set(plan.recomputed)))
    edited = dataclasses.replace(plan, saved=everything, recomputed=())   # its old schedule left as it was
    _, bw = split_joint(captured.graph_module, edited.saved_primals + edited.saved, captured.num_fwd_outputs)
    with pytest.raises(ValueError, match="simulated for another saved set"):
        place_recompute_regions(bw, facts, edited)
