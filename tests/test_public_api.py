"""The public surface is exactly ``remat.__all__``, and ``backend="remat"`` works by name."""

from __future__ import annotations

import json
import types

import pytest
import torch

import remat

EXPECTED_PUBLIC = {
    "BUDGET_ENV_VAR",
    "BudgetInfeasibleError",
    "CompiledGraph",
    "MonitorOptions",
    "ParetoCurve",
    "ParetoPoint",
    "PeakMeasurement",
    "Plan",
    "RematBackend",
    "RematError",
    "RematOptions",
    "SizeFit",
    "StepMetrics",
    "StepMonitor",
    "backend",
    "max_size_that_fits",
    "measure_peak_bytes",
    "pareto",
}


def test_all_names_exist_once():
    assert len(remat.__all__) == len(set(remat.__all__)), "duplicates in remat.__all__"
    missing = [name for name in remat.__all__ if not hasattr(remat, name)]
    assert not missing, f"remat.__all__ names missing attributes: {missing}"


def test_all_is_exactly_the_public_surface():
    public = {
        name for name, value in vars(remat).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(remat.__all__), (
        f"public but not in __all__: {sorted(public - set(remat.__all__))}; "
        f"in __all__ but not public: {sorted(set(remat.__all__) - public)}"
    )


def test_all_is_what_we_document():
    assert set(remat.__all__) == EXPECTED_PUBLIC


def test_exported_members_say_where_they_live():
    """Every exported class or function is defined inside the remat package."""
    for name in remat.__all__:
        value = getattr(remat, name)
        if isinstance(value, (type, types.FunctionType)):
            assert value.__module__.split(".")[0] == "remat", f"remat.{name} comes from {value.__module__}"


def test_error_tree():
    assert issubclass(remat.BudgetInfeasibleError, remat.RematError)
    assert issubclass(remat.RematError, RuntimeError)


def test_backend_is_registered_by_name():
    assert "remat" in torch._dynamo.list_backends(exclude_tags=())
    from remat.backend_registry import remat_backend_from_env

    assert torch._dynamo.lookup_backend("remat") is remat_backend_from_env


def test_backend_returns_a_remat_backend():
    backend = remat.backend(0.5)
    assert isinstance(backend, remat.RematBackend)
    assert isinstance(backend.options, remat.RematOptions)
    assert callable(backend)


class _TinyMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).sin())


@pytest.mark.e2e
def test_compile_by_name_reads_the_env_budget(monkeypatch, tmp_path):
    """``backend="remat"`` takes its budget from REMAT_BUDGET_GB (and its dump dir from
    REMAT_DUMP_DIR), plans the graph, and the gradients match eager's."""
    torch._dynamo.reset()
    monkeypatch.setenv("REMAT_BUDGET_GB", "0.5")
    monkeypatch.setenv("REMAT_DUMP_DIR", str(tmp_path))
    torch.manual_seed(0)
    model, x = _TinyMLP(), torch.randn(32, 64)
    eager = _TinyMLP()
    eager.load_state_dict(model.state_dict())

    torch.compile(model, backend="remat")(x).sum().backward()
    eager(x).sum().backward()

    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    plans = sorted(tmp_path.glob("*/plan.json"))
    assert len(plans) == 1, f"expected one dump under {tmp_path}, found {plans}"
    assert json.loads(plans[0].read_text())["budget_bytes"] == 500_000_000


@pytest.mark.e2e
def test_compile_by_name_enforces_the_env_budget(monkeypatch):
    """An infeasible REMAT_BUDGET_GB surfaces as BudgetInfeasibleError at the first call."""
    torch._dynamo.reset()
    monkeypatch.setenv("REMAT_BUDGET_GB", "1e-9")
    monkeypatch.delenv("REMAT_DUMP_DIR", raising=False)
    torch.manual_seed(0)
    model, x = _TinyMLP(), torch.randn(32, 64)
    with pytest.raises(remat.BudgetInfeasibleError, match=r"budget 1 B is below the smallest feasible budget"):
        torch.compile(model, backend="remat")(x).sum().backward()
