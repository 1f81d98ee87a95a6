"""A first step run inside the user's own ``torch.profiler`` (``docs/design.md``'s way to measure a CPU step):
remat compiles there, where no other profiler can record on the thread, so the library calls' working
memory is measured in a child process (``remat/child_call.py``) and the closed loop says it
cannot measure that step. Before, every library call kept 0 bytes there, and a drawn ResNet-style CNN's
plan measured 1.061x its budget on every step, silently.
"""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

import remat
from remat.cost_model.hardware import cache_dir, get_profile
from remat.measure import PROFILER_RUNNING_WARNING, cpu_allocation_events, window_peak
from remat.simulator import library_scratch


class TwoConvolutions(torch.nn.Module):
    """Two 64-channel 3x3 convolutions: oneDNN's backward of each allocates working memory (about 295 kB
    at 8 x 64 x 8 x 8 on this machine) beyond its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Conv2d(64, 64, 3, padding=1)
        self.second = torch.nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).relu()).relu().sum()


def _conv_backward_node() -> torch.fx.Node:
    from torch.fx.experimental.proxy_tensor import make_fx

    def grads(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.ops.aten.convolution_backward.default(grad, x, w, [64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                           [True, True, False])[:2]

    x = torch.randn(8, 64, 8, 8)
    gm = make_fx(grads, tracing_mode="fake")(x, x, torch.randn(64, 64, 3, 3))
    (node,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.convolution_backward.default]
    return node


def _profiling() -> torch.profiler.profile:
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


def test_a_probe_inside_a_profiler_is_measured_in_a_child_process_as_outside_it():
    node = _conv_backward_node()
    ((outside, _),) = library_scratch._probe_all([node], torch.device("cpu"))
    with _profiling():
        ((inside, why),) = library_scratch._probe_all([node], torch.device("cpu"))
    assert outside is not None and outside > 0, "oneDNN's convolution backward allocates working memory here"
    assert inside == outside, why


def test_a_step_compiled_inside_the_users_profiler_plans_and_checks_as_one_compiled_outside_it(tmp_path, monkeypatch):
    """The same model and budget (its floor, the budget remat names) compiled with its first step outside
    and inside the user's own profiler: the same
    predicted and checked peaks (before, inside one every convolution's working memory counted 0), the
    step inside it within the budget, and the closed loop's warning that it could not measure that step."""
    inputs = (torch.randn(8, 64, 8, 8, generator=torch.Generator().manual_seed(0)),)
    get_profile("cpu")      # measured (or read) in the developer's cache, then copied into each compile's
    profiles = list(cache_dir().glob("profile_*.json"))

    def compiled_step(budget_bytes: int, inside: bool) -> tuple[remat.RematBackend, int]:
        # remat's caches of its own: neither compile reads the other's probes
        fresh = tmp_path / ("inside" if inside else "outside")
        fresh.mkdir()
        for profile in profiles:
            shutil.copy(profile, fresh / profile.name)
        monkeypatch.setenv("REMAT_CACHE_DIR", str(fresh))
        torch.manual_seed(0)
        model = TwoConvolutions()
        torch._dynamo.reset()
        backend = remat.backend(budget_bytes / 1e9, verify_peak=1)
        compiled = torch.compile(model, backend=backend)

        def step() -> None:
            model.zero_grad(set_to_none=True)
            compiled(*inputs).backward()

        if inside:    # the user's own profiler (remat's ``measure_peak_bytes`` hosts the loop's window instead)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with _profiling() as prof:
                    step()
            measured = window_peak(cpu_allocation_events(prof)).peak_bytes
            assert any(str(w.message) == PROFILER_RUNNING_WARNING for w in caught)
        else:
            step()
            measured = remat.measure_peak_bytes(step).peak_bytes
        return backend, measured

    torch.manual_seed(0)
    model = TwoConvolutions()
    torch._dynamo.reset()
    with pytest.raises(remat.BudgetInfeasibleError) as refused:    # the floor: the budget remat names
        model.zero_grad(set_to_none=True)
        torch.compile(model, backend=remat.backend(1e-6))(*inputs).backward()
    budget_bytes = refused.value.min_budget_bytes
    inside, measured_inside = compiled_step(budget_bytes, inside=True)
    outside, _ = compiled_step(budget_bytes, inside=False)
    torch._dynamo.reset()
    first, second = outside.compiled_graphs[-1], inside.compiled_graphs[-1]
    assert second.plan.predicted_peak_bytes == first.plan.predicted_peak_bytes
    assert second.judgement.checked_peak_bytes == first.judgement.checked_peak_bytes
    assert measured_inside <= budget_bytes
    assert measured_inside == pytest.approx(second.judgement.checked_peak_bytes, rel=0.01)
