"""No two saved values share a storage (issue 15).

AOTAutograd donates every saved tensor that does not alias a forward input or output to the
backward, and Inductor may write into a donated buffer once its last reader ran; it does not
know that two saved tensors alias each other. A plan that saved ``relu`` and a view of it got
``buf41 = relu; del relu  # reuse`` in Inductor's backward, scheduled before the matmul that
read the view: a weight's gradient was 100% off while the loss was equal.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from joint_graphs import capture_joint
from remat.simulator.schedule import partition_nodes
from remat.simulator.shared_storage import shared_storage_groups


def _relu_and_view(x, w1, w2):
    r = torch.relu(x @ w1)
    v = r.view(-1, 16)
    return (v @ w2).sum() + r.amax()


def _two_views(x, w1, w2):
    h = x @ w1
    a, b = h.view(2, -1, 16).unbind(0)
    return ((torch.tanh(a) @ w2).sum() + (torch.sigmoid(b) @ w2).sum())


def _facts(fn):
    torch.manual_seed(0)
    x = torch.randn(64, 32)
    w1 = torch.randn(32, 32, requires_grad=True)
    w2 = torch.randn(16, 8, requires_grad=True)
    return capture_joint(fn, x, w1, w2).facts()


def _storage_of_each(facts, names):
    return {name: facts.nodes[name].value_storages for name in names}


def test_a_value_and_its_view_are_not_both_saved():
    facts = _facts(_relu_and_view)
    relu = next(n for n in facts.order if facts.nodes[n].op == "aten.relu.default")
    views = [n for n in facts.needed_by_backward if facts.nodes[n].is_view
             and facts.nodes[n].value_storages == facts.nodes[relu].value_storages]
    assert views, "the capture should hand the backward a view of relu"
    partition = partition_nodes(facts, {relu, *views})
    assert relu in partition.saved
    assert not set(views) & partition.saved, _storage_of_each(facts, partition.saved)
    assert set(views) <= partition.recomputed


def test_two_views_of_an_unsaved_base_save_the_base_once():
    facts = _facts(_two_views)
    views = [n for n in facts.order if facts.nodes[n].role == "forward" and facts.nodes[n].is_view
             and facts.nodes[n].op == "aten.unbind.int"] or \
            [n for n in facts.order if facts.nodes[n].is_getitem and facts.nodes[n].role == "forward"]
    chosen = {n for n in facts.needed_by_backward if facts.nodes[n].role == "forward" and facts.nodes[n].is_view}
    chosen |= set(views)
    partition = partition_nodes(facts, chosen)
    assert not shared_storage_groups(facts, partition.saved), _storage_of_each(facts, partition.saved)


def _attention_block(x, wqkv, wo):
    b, t, d = x.shape
    q, k, v = (x @ wqkv).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4).unbind(0)
    att = F.dropout((q @ k.transpose(-2, -1)).softmax(-1), p=0.1)
    h = (att @ v).transpose(1, 2).reshape(b, t, d)
    y = torch.relu(h @ wo)
    return (y.view(-1, d) * y.view(-1, d).amax(-1, keepdim=True)).sum() + x.mean()


def test_no_saved_set_makes_two_saved_values_share_a_storage():
    """Random saved sets on an attention block full of views: every partition saves each
    storage at most once (60 sets, fixed seed)."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 32)
    facts = capture_joint(_attention_block, x, torch.randn(32, 96, requires_grad=True),
                          torch.randn(32, 32, requires_grad=True)).facts()
    candidates = [n for n in facts.order if facts.nodes[n].role == "forward" and facts.nodes[n].is_tensor]
    rng = random.Random(15)
    shared_before = 0
    for _ in range(60):
        chosen = {n for n in candidates if rng.random() < 0.5}
        shared_before += bool(shared_storage_groups(facts, chosen))
        partition = partition_nodes(facts, chosen)
        assert not shared_storage_groups(facts, partition.saved)
        assert not partition.saved & partition.recomputed
    assert shared_before > 0, "the sets should include values sharing a storage, or the test checks nothing"


# ---- the model of issue 15 and its neighbours, compiled end to end ---------------------------------------------

import copy  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402
from torch import nn  # noqa: E402

import remat  # noqa: E402
from conftest import assert_grads_close  # noqa: E402

B, T, D, H, V = 4, 32, 32, 4, 64
ABOVE_SMALLEST = 1.1        # "between": 10% above the smallest budget the simulator names (a plan with slack,
                            # not the smallest; it was a fixed 0.00046 GB, ~70% of plain Inductor's measured
                            # 656,908 B, until the kernel model's CPU-cat rule put the floor above it)
TOO_SMALL_GB = 0.0002       # below the smallest feasible budget: the error names the one to retry with


class _Attn(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.qkv, self.proj, self.drop = nn.Linear(D, 3 * D), nn.Linear(D, D), nn.Dropout(p)

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4).unbind(0)
        att = self.drop(((q @ k.transpose(-2, -1)) / math.sqrt(D // H)).softmax(-1))
        return x + self.proj((att @ v).transpose(1, 2).reshape(B, T, D))


class _BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(D)

    def forward(self, x):
        return self.bn(x.transpose(1, 2)).transpose(1, 2)


class _NoGradScale(nn.Module):
    def __init__(self, rescale: bool):
        super().__init__()
        self.fc1, self.fc2, self.rescale = nn.Linear(D, D), nn.Linear(D, D), rescale

    def forward(self, x):
        with torch.no_grad():
            s = x.abs().amax(-1, keepdim=True) + 1.0 if self.rescale else torch.ones_like(x[..., :1])
        return self.fc2(F.relu(self.fc1(x / s))) + x


class _Net(nn.Module):
    """Attention with dropout applied twice, BatchNorm over channels, a no_grad rescale, tied LM head."""

    def __init__(self, dropout: float = 0.1, rescale: bool = True, repeat: bool = True):
        super().__init__()
        self.emb, self.pos = nn.Embedding(V, D), nn.Parameter(0.02 * torch.randn(T, D))
        self.blocks = nn.ModuleList([_Attn(dropout), _BN(), _NoGradScale(rescale), _BN()])
        self.norm_f, self.repeat = nn.LayerNorm(D), repeat

    def forward(self, x, tgt):
        h = self.emb(x) + self.pos
        for blk in list(self.blocks) + ([self.blocks[0]] if self.repeat else []):
            h = blk(h)
        h = self.norm_f(h)
        loss = F.cross_entropy((h @ self.emb.weight.t()).reshape(-1, V), tgt.reshape(-1))
        return loss, h.mean(-1)


def _step(model, x, tgt) -> float:
    torch.manual_seed(7)
    model.zero_grad(set_to_none=True)
    loss, aux = model(x, tgt)
    (loss + 0.0 * aux.sum()).backward()
    return float(loss.detach())


def _run(variant: dict, backend, fallback_random: bool):
    """(loss, gradients) of one step of a fresh copy of the variant compiled with ``backend``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Net(**variant).train()
    g = torch.Generator().manual_seed(103000)
    x, tgt = torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)
    with torch._inductor.config.patch(fallback_random=fallback_random):
        loss = _step(torch.compile(model, backend=backend), x, tgt)
    return loss, {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _smallest_budget_gb(variant: dict, fallback_random: bool) -> float:
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        _run(variant, remat.backend(budget_gb=TOO_SMALL_GB, inductor_check=False), fallback_random)
    # the budget the simulator names, as printed (rounded up): the test plans with the simulator alone
    # (with Inductor's check on, the check may name a lower budget the simulator alone refuses)
    return info.value.min_budget_gb


VARIANTS = {"issue15": {}, "no-dropout": {"dropout": 0.0}, "no-rescale": {"rescale": False},
            "no-repeat": {"repeat": False}}
# (Inductor's RNG at "between" too until session 41: its plans lie between the two kept here)
CASES = [("issue15", True, None), ("issue15", True, "between"), ("issue15", True, "smallest"),
         ("issue15", False, "smallest"),
         ("no-dropout", True, "between"), ("no-rescale", True, "between"), ("no-repeat", True, "between")]


@pytest.fixture(scope="module")
def plain_inductor():
    runs: dict[tuple[str, bool], tuple[float, dict]] = {}

    def get(name: str, fallback_random: bool):
        if (name, fallback_random) not in runs:
            runs[(name, fallback_random)] = _run(VARIANTS[name], "inductor", fallback_random)
        return runs[(name, fallback_random)]
    return get


@pytest.mark.e2e
@pytest.mark.parametrize("name,fallback_random,budget_gb", CASES)
def test_issue15_gradients_equal_plain_inductors(plain_inductor, name, fallback_random, budget_gb):
    if budget_gb in ("smallest", "between"):
        # probed again by every case, never shared: an earlier case's measured step can store a feedback correction
        # that raises the floor (session 42: sharing the probe, "smallest" ran at a floor "between" had corrected)
        budget_gb = _smallest_budget_gb(VARIANTS[name], fallback_random) * (ABOVE_SMALLEST if budget_gb == "between" else 1)
    # the plans of issue 15 as the simulator makes them (Inductor's check, remat/inductor_check.py, off:
    # it names higher budgets on this model, where these plans measure over)
    loss, grads = _run(VARIANTS[name], remat.backend(budget_gb=budget_gb, inductor_check=False), fallback_random)
    plain_loss, plain_grads = plain_inductor(name, fallback_random)
    # within a few float32 ulps, not bit-equal: the forward returns what the plan saves, which changes
    # the loops Inductor generates for it (on an AVX-512 machine the "no-dropout" plan's loss is 1 ulp
    # from plain Inductor's); a dropout mask drawn again with other randomness moves it by far more
    assert loss == pytest.approx(plain_loss, rel=1e-6, abs=0.0)
    assert_grads_close(grads, plain_grads)
