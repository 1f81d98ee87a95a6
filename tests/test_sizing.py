"""remat.max_size_that_fits: the size it returns fits, the next one does not, checked on static traces."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import remat
from remat.cost_model.tensors import sizes_evaluated_at
from remat.options import DEFAULT_HEADROOM_BY_DEVICE
from remat.passes.plan import make_plan
from remat.pipeline import facts_at_sizes, prepare_graph, trace_joint_facts

BUDGET_GB = 0.02


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256))


MODEL = _model()
CPU_HEADROOM = DEFAULT_HEADROOM_BY_DEVICE["cpu"]   # what max_size_that_fits plans a CPU model with


def step(x: torch.Tensor) -> torch.Tensor:
    return MODEL(x).sum()


def _static_plan_fits(batch: int, budget_gb: float = BUDGET_GB, headroom: float = CPU_HEADROOM) -> bool:
    """Trace at a static batch, as a compile at that size would, and plan it."""
    (facts,) = trace_joint_facts(step, (torch.randn(batch, 256),))
    budget = int(budget_gb * 1e9)
    plan = make_plan(facts, budget, target_bytes=int(budget * (1 - headroom)), best_effort=True)
    return plan.fits_budget


@pytest.fixture(scope="module")
def fit() -> remat.SizeFit:
    return remat.max_size_that_fits(step, (torch.randn(64, 256),), BUDGET_GB, dynamic=[(0, 0)])


def test_the_size_fits_and_the_next_does_not_on_static_traces(fit):
    assert fit.traced_size == 64 and fit.sources == ("L['x'].size()[0]",) and fit.replanned
    assert 64 < fit.size < 1 << 20
    assert fit.peak_bytes <= fit.target_bytes == int(BUDGET_GB * 1e9 * (1 - CPU_HEADROOM))
    assert fit.next_size == fit.size + 1 and fit.next_peak_bytes > fit.target_bytes
    assert _static_plan_fits(fit.size)
    assert not _static_plan_fits(fit.size + 1)
    assert (fit.size, True) in fit.sizes_tried and (fit.size + 1, False) in fit.sizes_tried
    assert "largest size that fits" in fit.describe()


def test_facts_at_a_size_equal_a_static_trace_at_that_size():
    kept = []

    def keep(joint, joint_inputs, n):
        prepared = prepare_graph(joint, joint_inputs, n, "cpu")
        kept.append((joint, n, prepared))
        return prepared.facts

    x = torch.randn(64, 256)
    torch._dynamo.mark_dynamic(x, 0)
    (dynamic_facts,) = trace_joint_facts(step, (x,), hardware="cpu", read=keep)
    (joint, n_outputs, prepared), = kept
    (symbol,) = {str(s) for n in joint.graph.nodes
                 for t in ([n.meta["val"]] if isinstance(n.meta.get("val"), torch.Tensor) else [])
                 for d in t.shape if isinstance(d, torch.SymInt) for s in d.node.expr.free_symbols}
    (static,) = trace_joint_facts(step, (torch.randn(300, 256),), hardware="cpu")
    at_300 = facts_at_sizes(joint, n_outputs, prepared.profile, {symbol: 300})

    def totals(facts):
        tensor_nodes = [n for n in facts.nodes.values() if n.is_tensor]
        return (sum(n.alloc_bytes for n in tensor_nodes), sum(n.cost.flops for n in tensor_nodes),
                sorted(n.numel for n in tensor_nodes if n.numel))

    assert totals(at_300) == totals(static)
    assert totals(facts_at_sizes(joint, n_outputs, prepared.profile, {symbol: 64})) == totals(dynamic_facts)
    with sizes_evaluated_at({symbol: 300}):
        pass
    assert totals(prepared.facts) == totals(dynamic_facts)   # the context leaves nothing behind


def test_the_plan_made_at_the_traced_size_stretches_less_or_as_far(fit):
    fixed = remat.max_size_that_fits(step, (torch.randn(64, 256),), BUDGET_GB, dynamic=[(0, 0)], replan=False)
    assert not fixed.replanned and fixed.size <= fit.size
    assert fixed.peak_bytes <= fixed.target_bytes < fixed.next_peak_bytes


def test_step_and_highest_bound_the_search():
    capped = remat.max_size_that_fits(step, (torch.randn(64, 256),), BUDGET_GB, dynamic=[(0, 0)], highest=100)
    assert capped.size == 100 and capped.next_size is None and capped.next_peak_bytes is None
    stepped = remat.max_size_that_fits(step, (torch.randn(64, 256),), BUDGET_GB, dynamic=[(0, 0)], step=32)
    assert stepped.size % 32 == 0 and stepped.next_size == stepped.size + 32
    assert stepped.next_peak_bytes > stepped.target_bytes


def test_a_budget_too_small_for_the_smallest_size_names_the_budget_that_fits():
    with pytest.raises(remat.BudgetInfeasibleError, match="even the smallest size 1 does not fit") as info:
        remat.max_size_that_fits(step, (torch.randn(64, 256),), 1e-6, dynamic=[(0, 0)])
    assert info.value.min_feasible_bytes > 1000


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(budget_gb=None, dynamic=[(0, 0)]), ValueError, "needs a budget"),
    (dict(budget_gb="8GB", dynamic=[(0, 0)]), ValueError, "budget_gb='8GB'"),
    (dict(budget_gb=1, dynamic=[(1, 0)]), ValueError, r"example_inputs\[1\] is not a tensor"),
    (dict(budget_gb=1, dynamic=[(0, 2)]), ValueError, "has 2 dims"),
    (dict(budget_gb=1, dynamic=[0]), TypeError, r"\(input index, dim\) pair"),
    (dict(budget_gb=1, dynamic=[(0, 0)], step=0), ValueError, "step=0 must be a positive int"),
    (dict(budget_gb=1, dynamic=[(0, 0)], lowest=10, highest=5), ValueError, "highest=5 must be >= lowest=10"),
])
def test_bad_arguments_fail_before_tracing(kwargs, error, match):
    budget = kwargs.pop("budget_gb")
    with pytest.raises(error, match=match):
        remat.max_size_that_fits(step, (torch.randn(64, 256),), budget, **kwargs)


def test_no_dynamic_size_says_how_to_mark_one():
    with pytest.raises(ValueError, match="no dynamic size"):
        remat.max_size_that_fits(step, (torch.randn(64, 256),), 1)


def test_batch_norm_counters_are_not_sizes():
    """BatchNorm's num_batches_tracked becomes a symbol too (an ``.item()`` value, not a size): only
    symbols in tensor sizes grow."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                          nn.BatchNorm2d(8))
    fit = remat.max_size_that_fits(lambda x: model(x).sum(), (torch.randn(4, 3, 16, 16),), 0.01, dynamic=[(0, 0)])
    assert len(fit.symbols) == 1 and fit.sources[0].endswith(".size()[0]") and fit.traced_size == 4
    assert fit.peak_bytes <= fit.target_bytes < fit.next_peak_bytes
