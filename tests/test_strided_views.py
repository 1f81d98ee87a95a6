"""Views given explicit strides (``as_strided``) are never recomputed: their values depend on the
memory layout of their input, and Inductor lays out what the backward computes (and the saved values
it hands the backward) as it chooses. Found on a drawn corpus CNN (a VGG with GroupNorm, whose
decomposition makes such views): recomputed, the gradients were 32% off plain Inductor's."""

from __future__ import annotations

import pytest
import torch

import remat
from conftest import assert_grads_close, grads_of
from joint_graphs import capture_joint
from remat.errors import BudgetInfeasibleError
from remat.passes.plan import make_plan
from remat.testing import cnns, corpus

STRIDED = "aten.as_strided.default"


def strided_net(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scale = torch.as_strided(x.sum(0) * w, (8, 16), (16, 1))        # a computed base, explicit strides
    h = (v @ v.t()).relu().reshape(-1, 8, 16) * scale
    h = h.sin() * scale
    return ((h.cos() + h).reshape(v.shape[0], -1) @ v).tanh().sum()


def test_a_strided_view_is_banned_and_never_recomputed_at_any_budget():
    torch.manual_seed(0)
    x, v = torch.randn(4, 128), torch.randn(128, 128)
    w, v = torch.randn(128, requires_grad=True), v.requires_grad_()
    facts = capture_joint(strided_net, x, w, v).facts()
    strided = {n for n, f in facts.nodes.items() if f.op == STRIDED and f.role == "forward"}
    assert strided, "the captured graph should hold an as_strided view"
    assert all("explicit strides" in (facts.nodes[n].recompute_ban or "") for n in strided)
    no_budget = make_plan(facts, None)
    planned = 0
    for fraction in (1.0, 0.8, 0.6):
        try:
            plan = make_plan(facts, int(no_budget.predicted_peak_bytes * fraction))
        except BudgetInfeasibleError:
            continue
        planned += 1
        assert not strided & set(plan.recomputed)
    assert planned >= 2


@pytest.mark.e2e
def test_a_groupnorm_cnn_keeps_plain_inductors_gradients():
    """conv-GroupNorm-ReLU x3 on 48x48 images: Inductor lays the convolutions' outputs out channels-last
    on the CPU, GroupNorm's decomposition views its per-channel scale through as_strided; with no
    budget, remat's gradients equal plain Inductor's and no such view is recomputed."""
    shape = cnns.CNNShape("vgg", 2, 48, 8, 1, "relu", "group", seed=0)
    loss = corpus.weighted_sum((shape.batch, 10))

    def step(backend) -> dict[str, torch.Tensor]:
        torch._dynamo.reset()
        model, (x,) = cnns.build_cnn(shape, 0)
        loss(torch.compile(model, backend=backend)(x)).backward()
        return grads_of(model)

    expected = step("inductor")
    backend = remat.backend(None)
    got = step(backend)
    plan = backend.compiled_graphs[0].plan
    ops = {d.name: d.op for d in plan.decisions}
    assert not [n for n in plan.recomputed if ops.get(n) == STRIDED]
    assert_grads_close(got, expected, what="gradient vs plain inductor")
