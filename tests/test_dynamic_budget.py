"""Dynamic shapes with a budget (issue 12, item 2): one compile, every size within the budget.

- ``mark_dynamic(x, 1, max=64)``: compiled once, planned at the declared max without adding a
  guard (any guard while partitioning raises here), three sizes up to the max each measured at
  or under the budget, gradients equal plain Inductor's.
- ``torch.compile(dynamic=True)``: compiled once for several lengths; with no upper bound the plan
  is made at the traced size and one warning names the largest size it fits (measured there too).
- Dynamo's recompile limit: the last compile it allows warns, naming remat and the budget.

The budget is a fraction of plain Inductor's measured peak at the largest size, on a net written here.
"""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import remat
from conftest import assert_grads_close, grads_of, run_step, zero_grads
from remat import _torch_shapes
from remat.dynamic import size_environment

MAX_LEN = 64
LENGTHS = (16, 40, MAX_LEN)
BUDGET_FRACTION = 0.7   # of plain Inductor's measured peak at MAX_LEN; the plan made at length 16 measures over it at 64


class ResidualMLP(nn.Module):
    """LayerNorm, six linears, GELU and dropout over (batch, length, 64), with a residual."""

    def __init__(self, d: int = 64, hidden: int = 256, depth: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc_in, self.fc_out = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.hidden = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(depth))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(F.gelu(self.fc_in(self.norm(x))))
        for layer in self.hidden:
            h = F.gelu(layer(h))
        return x + self.fc_out(h)


def _batch(length: int, max_len: int | None = MAX_LEN) -> torch.Tensor:
    x = torch.randn(4, length, 64, generator=torch.Generator().manual_seed(length))
    if max_len is not None:
        torch._dynamo.mark_dynamic(x, 1, min=2, max=max_len)
    return x


def _peak(compiled, model: nn.Module, x: torch.Tensor) -> int:
    zero_grads(model)   # the baseline holds no gradients: the budget covers the ones the step makes
    return remat.measure_peak_bytes(lambda: run_step(compiled, model, (x,)), "cpu").peak_bytes


class Counting:
    """A backend wrapper that counts Dynamo's compiles by their CompileId (a restarted analysis,
    as ``dynamic=True`` makes for Python float scalars, calls the backend again under the same id)."""

    def __init__(self, backend) -> None:
        self.backend, self.compile_ids = backend, set()

    @property
    def compiles(self) -> int:
        return len(self.compile_ids)

    def __call__(self, gm, example_inputs):
        from torch._guards import CompileContext

        self.compile_ids.add(str(CompileContext.current_compile_id()))
        return self.backend(gm, example_inputs)


@pytest.fixture(scope="module")
def plain():
    """Plain Inductor on a copy of the net (same seed), compiled for dynamic lengths; its peak at MAX_LEN."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ResidualMLP()
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(copy.deepcopy(model), backend="inductor")
        reference = compiled._orig_mod
        run_step(compiled, reference, (_batch(MAX_LEN),))
        peak = _peak(compiled, reference, _batch(MAX_LEN))
    return model, compiled, reference, peak


def test_mark_dynamic_with_max_compiles_once_and_every_size_fits(plain, tmp_path, monkeypatch):
    model, plain_compiled, reference, plain_peak = plain
    budget_gb = BUDGET_FRACTION * plain_peak / 1e9
    # any guard added while remat partitions now raises instead of specialising the graph
    monkeypatch.setattr(_torch_shapes, "guards_suppressed", _torch_shapes.guards_forbidden)
    backend = remat.backend(budget_gb, dump_dir=tmp_path)
    counting = Counting(backend)
    compiled = torch.compile(model, backend=counting)
    with torch._inductor.config.patch(fallback_random=True), warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # a declared max leaves nothing to warn about
        for length in LENGTHS:
            run_step(compiled, model, (_batch(length),))
            grads = grads_of(model)
            run_step(plain_compiled, reference, (_batch(length),))
            assert_grads_close(grads, grads_of(reference))
            peak = _peak(compiled, model, _batch(length))
            assert peak <= budget_gb * 1e9, f"length {length}: measured {peak:,} B over the budget {budget_gb * 1e9:,.0f} B"
    assert counting.compiles == 1 and len(backend.compiled_graphs) == 1
    (record,) = backend.compiled_graphs
    report = (Path(record.dump_path) / "report.md").read_text()
    assert re.search(r"- `s\d+` = `L\['x'\]\.size\(\)\[1\]`, traced at 16, planned at 64 \(its upper bound\)\n", report)
    assert "at the planned sizes" in report and "the plan counts" not in report


def test_dynamic_true_compiles_once_and_names_the_largest_size_that_fits(plain, tmp_path):
    model, _, _, plain_peak = plain
    model = copy.deepcopy(model)
    budget_gb = BUDGET_FRACTION * plain_peak / 1e9
    backend = remat.backend(budget_gb, dump_dir=tmp_path)
    counting = Counting(backend)
    compiled = torch.compile(model, backend=counting, dynamic=True)
    with torch._inductor.config.patch(fallback_random=True):
        with pytest.warns(UserWarning, match=r"has no upper bound") as caught:
            run_step(compiled, model, (_batch(16, max_len=None),))
        for length in (24, 40):
            run_step(compiled, model, (_batch(length, max_len=None),))
    assert counting.compiles == 1 and len(backend.compiled_graphs) == 1
    (message,) = [str(w.message) for w in caught if "has no upper bound" in str(w.message)]
    fits = re.search(r"L\['x'\]\.size\(\)\[1\] \((s\d+), traced at 16\) has no upper bound; the plan meets its "
                     r"target of [\d.]+ [kMG]?B up to (s\d+) = (\d+) ", message)
    assert fits and fits.group(1) == fits.group(2), message
    largest = int(fits.group(3))
    assert "mark_dynamic(x, dim, max=...)" in message and "L['x'].size()[0]" in message   # the batch dim too
    assert 16 <= largest < MAX_LEN   # the plan made at 16 saves more than the one made at 64 does
    assert "## Sizes above the traced size" in (Path(backend.compiled_graphs[0].dump_path) / "report.md").read_text()
    with torch._inductor.config.patch(fallback_random=True):
        run_step(compiled, model, (_batch(largest, max_len=None),))
        peak = _peak(compiled, model, _batch(largest, max_len=None))
    assert peak <= budget_gb * 1e9 and counting.compiles == 1


def test_the_last_compile_dynamo_allows_warns_naming_remat_and_the_budget():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    counting = Counting(remat.backend(0.01))
    compiled = torch.compile(model, backend=counting, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (8, 12, 16):   # static shapes: each new batch recompiles until the limit, then eager
            compiled(torch.randn(batch, 32)).sum().backward()
    ours = [str(w.message) for w in caught if str(w.message).startswith("remat: this is compile")]
    assert counting.compiles == 2 and len(ours) == 1, ours
    assert "compile 2 of frame" in ours[0] and "recompile_limit=2" in ours[0]
    assert "without remat and its budget of 10.00 MB" in ours[0] and "runs it in eager" in ours[0]
    torch._dynamo.reset()


def test_a_declared_max_too_large_for_the_budget_says_where_it_was_planned():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ResidualMLP()
    x = _batch(16, max_len=1 << 16)
    with pytest.raises(remat.BudgetInfeasibleError) as info:
        torch.compile(model, backend=remat.backend(0.001))(x).sum().backward()
    message = str(info.value)
    assert re.search(r"Planned at the largest sizes the graph admits: s\d+ = 65536 \(L\['x'\]\.size\(\)\[1\]: its "
                     r"upper bound; traced at 16\)", message), message
    assert info.value.min_feasible_bytes > 1e6   # the smallest peak at the max, not at the traced size
    torch._dynamo.reset()


def test_size_environment_reads_declared_bounds_without_guards():
    from remat.pipeline import trace_joint_facts

    torch.manual_seed(0)
    model = ResidualMLP()
    x = torch.randn(4, 16, 64)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(x, 1, min=2, max=48)

    def read(joint, joint_inputs, num_fwd_outputs):
        with _torch_shapes.guards_forbidden(_torch_shapes.shape_env_of(joint.graph)):
            return size_environment([joint.graph])

    (env,) = trace_joint_facts(lambda t: model(t).sum(), (x,), read=read)
    by_source = {s.source: s for s in env.symbols}
    assert set(by_source) == {"L['t'].size()[0]", "L['t'].size()[1]"}
    batch, length = by_source["L['t'].size()[0]"], by_source["L['t'].size()[1]"]
    assert (batch.traced, batch.upper, batch.planned) == (4, None, 4)
    assert (length.traced, length.upper, length.planned) == (16, 48, 48)
    assert env.unbounded == (batch,) and env.above_traced == (length,)
    assert env.values == {batch.name: 4, length.name: 48}
