"""The dropout split: only the mask of a random op has to be saved."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

from joint_graphs import capture_joint
from remat.passes.plan import make_plan
from remat.passes.random_ops import split_dropout_outputs


def net(x, w):
    return F.dropout(torch.relu(x @ w), p=0.25, training=True).sum()


def _joint():
    torch.manual_seed(0)
    x = torch.randn(256, 128)
    w = torch.randn(128, 128, requires_grad=True)
    captured = capture_joint(net, x, w)
    primals = [x, w]
    tangents = [torch.ones(())]
    return captured, primals, tangents


def test_split_rewrites_every_dropout_output_and_keeps_values():
    captured, primals, tangents = _joint()
    gm = captured.graph_module
    dropouts = [n for n in gm.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    assert len(dropouts) == 1
    torch.manual_seed(7)
    before = gm(primals, tangents)
    assert split_dropout_outputs(gm.graph) == 1
    gm.recompile()
    torch.manual_seed(7)
    after = gm(primals, tangents)
    for a, b in zip(before, after):
        if isinstance(a, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    (dropout,) = [n for n in gm.graph.nodes if n.target is torch.ops.aten.native_dropout.default]
    used = {u.args[1] for u in dropout.users if u.target is operator.getitem}
    assert used == {1}, "only the mask of the dropout is read after the split"


def test_after_the_split_only_the_mask_is_forced():
    captured, _, _ = _joint()
    split_dropout_outputs(captured.graph_module.graph)
    facts = captured.facts()
    plan = make_plan(facts, None)
    nodes = {n.name: n for n in captured.graph_module.graph.nodes}
    forced_random = [n for n, reason in plan.forced if reason.startswith("random")]
    assert forced_random
    assert all(nodes[name].meta["val"].dtype == torch.bool for name in forced_random), (
        "only the bool mask is saved for the random op; its float output is recomputed"
    )


def test_eval_mode_dropout_is_left_alone():
    def eval_net(x, w):
        return F.dropout(x @ w, p=0.5, training=False).sum()

    torch.manual_seed(0)
    captured = capture_joint(eval_net, torch.randn(8, 8), torch.randn(8, 8, requires_grad=True))
    assert split_dropout_outputs(captured.graph_module.graph) == 0
