"""Per-graph analysis lives with its graph (``JointGraphFacts.analysis``), not in module globals:
each part is computed once and kept there, a new facts object (``replace`` included) starts
empty, and nothing outside the facts keeps them alive."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import torch

from remat.passes.graph_analysis import GraphAnalysis
from remat.simulator.kernel_facts import graph_inductor_config
from remat.passes.mincut import min_cut_saved
from remat.passes.recompute_bans import why_not_recomputable
from remat.simulator.schedule import partition_nodes, register_only, simulate_partition

from joint_graphs import capture_joint


def _facts():
    w1, w2 = torch.randn(16, 32, requires_grad=True), torch.randn(32, 8, requires_grad=True)
    step = capture_joint(lambda x, a, b: (torch.tanh(x @ a).exp() @ b).sum(), torch.randn(4, 16), w1, w2)
    return step.facts("cpu")


def test_each_part_is_computed_once_and_kept_with_its_graph():
    facts = _facts()
    assert facts.analysis == GraphAnalysis()
    saved = min_cut_saved(facts)
    assert facts.analysis.min_cut_saved is saved and min_cut_saved(facts) is saved
    assert register_only(facts) is facts.analysis.register_only
    name = facts.order[-1]
    assert why_not_recomputable(facts, name) == facts.analysis.bans[name]
    partition = partition_nodes(facts, set(saved))
    simulate_partition(facts, partition)
    assert (partition.saved, partition.recomputed) in facts.analysis.rebuilds
    assert graph_inductor_config(facts) is facts.analysis.kernel_facts.inductor


def test_a_new_facts_object_starts_empty_and_nothing_else_holds_a_graph():
    facts = _facts()
    min_cut_saved(facts)
    simulate_partition(facts, partition_nodes(facts, set(min_cut_saved(facts))))
    held = replace(facts, outputs_held=True)
    assert held.analysis is not facts.analysis and held.analysis == GraphAnalysis()
    assert min_cut_saved(held) == facts.analysis.min_cut_saved
    gone = weakref.ref(facts)
    analysis = weakref.ref(facts.analysis)
    del facts
    gc.collect()
    assert gone() is None and analysis() is None


def test_a_simulation_is_remembered_until_the_graph_is_planned_and_its_schedule_decided_again():
    """``evaluate`` remembers each partition's simulation in the analysis (at most ``SIMULATION_ENTRIES``, least
    recently used dropped first): asked again it gives the same answer without simulating; a new facts object's
    simulation of it is equal; ``hold_intermediates`` forgets that partition's (its schedule may change), and
    ``forget_simulations`` all of them."""
    from remat.passes.graph_analysis import SIMULATION_ENTRIES
    from remat.simulator import evaluate
    from remat.simulator.schedule import hold_intermediates

    facts = _facts()
    saved = frozenset(min_cut_saved(facts))
    first = evaluate(facts, saved)
    again = evaluate(facts, saved)
    assert again.simulation is first.simulation and len(facts.analysis.simulations) == 1
    fresh = evaluate(_facts(), saved)
    assert (fresh.simulation, fresh.extra_time_s, fresh.backward_order) == (
        first.simulation, first.extra_time_s, first.backward_order)
    hold_intermediates(facts, first.partition)
    assert not facts.analysis.simulations
    evaluate(facts, saved)
    for name in facts.order[:SIMULATION_ENTRIES + 2]:
        evaluate(facts, saved | {name})
    assert 0 < len(facts.analysis.simulations) <= SIMULATION_ENTRIES
    facts.analysis.forget_simulations()
    assert not facts.analysis.simulations
