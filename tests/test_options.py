"""Argument validation at the API boundary: bad input fails in ``remat.backend(...)`` with the
value in the message, before ``torch.compile`` ever sees a model."""

from __future__ import annotations

import math

import pytest
import torch

import remat
from remat.options import (DEFAULT_HEADROOM_BY_DEVICE, DEFAULT_HEADROOM_FRACTION, budget_from_env, make_options,
                           validate_budget_gb)


class _NeverTraced(torch.nn.Module):
    """A model whose forward fails loudly if anything traces or runs it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - must never run
        raise AssertionError("the model was traced although the backend's arguments were invalid")


@pytest.mark.parametrize(
    ("budget_gb", "error", "shown"),
    [
        (0, ValueError, "budget_gb=0 "),
        (0.0, ValueError, "budget_gb=0.0 "),
        (-1, ValueError, "budget_gb=-1 "),
        (-0.5, ValueError, "budget_gb=-0.5 "),
        (math.nan, ValueError, "budget_gb=nan "),
        (math.inf, ValueError, "budget_gb=inf "),
        (-math.inf, ValueError, "budget_gb=-inf "),
        ("8GB", ValueError, "budget_gb='8GB' "),
        ("", ValueError, "budget_gb='' "),
        (True, TypeError, "budget_gb=True "),
        ([8], TypeError, "budget_gb=[8] "),
    ],
)
def test_bad_budget_fails_before_tracing(budget_gb, error, shown):
    model = _NeverTraced()
    with pytest.raises(error) as info:
        torch.compile(model, backend=remat.backend(budget_gb))(torch.ones(2))
    assert shown in str(info.value)


def test_string_budget_message_says_what_to_pass():
    with pytest.raises(ValueError) as info:
        remat.backend("8GB")
    message = str(info.value)
    assert "budget_gb='8GB' is a string" in message
    assert "budget_gb=8" in message and "'auto'" in message
    assert "1 GB = 1e9 bytes" in message


def test_negative_budget_message_says_what_the_budget_bounds():
    with pytest.raises(ValueError, match=r"budget_gb=-1 must be positive: it bounds the memory"):
        remat.backend(-1)


@pytest.mark.parametrize(
    ("budget_gb", "expected_bytes"),
    [(8, 8_000_000_000), (0.5, 500_000_000), (0.08, 80_000_000), (1e-6, 1_000), (24.0, 24_000_000_000)],
)
def test_budget_is_decimal_gb(budget_gb, expected_bytes):
    backend = remat.backend(budget_gb)
    assert backend.options.budget_bytes == expected_bytes
    assert isinstance(backend.options.budget_bytes, int)
    assert backend.options.budget_is_auto is False
    assert backend.compiled_graphs == []


def test_no_budget():
    options = remat.backend().options
    assert options.budget_bytes is None
    assert options.planning_target_bytes("cpu") is None


def test_headroom_sets_the_planning_target():
    assert remat.backend(1, headroom_fraction=0.10).options.planning_target_bytes("cpu") == 900_000_000
    assert remat.backend(1, headroom_fraction=0.0).options.planning_target_bytes("cuda") == 1_000_000_000


def test_default_headroom_depends_on_the_device():
    options = remat.backend(1).options
    assert options.headroom_fraction is None
    assert options.headroom_for("cpu") == DEFAULT_HEADROOM_BY_DEVICE["cpu"] == 0.05
    assert options.headroom_for("cuda") == DEFAULT_HEADROOM_FRACTION == 0.15
    assert options.planning_target_bytes("cpu") == 950_000_000
    assert options.planning_target_bytes("cuda") == 850_000_000
    # a graph whose generated code the simulator is known not to model keeps the larger headroom
    assert options.headroom_for("cpu", modeled=False) == 0.15 and options.headroom_for("cpu", modeled=True) == 0.05
    # an explicit headroom is used on every device, and the plan cache tells the two apart
    assert remat.backend(1, headroom_fraction=0.05).options.headroom_for("cuda") == 0.05
    assert remat.backend(1).options.cache_key() != remat.backend(1, headroom_fraction=0.05).options.cache_key()


def test_inductor_checks_a_graph_alone_against_its_own_headroom():
    """1% on the CPU where the simulator models the code (what the check reads is the generated code
    itself), the planning headroom elsewhere and for unmodelled code; an explicit headroom sets both."""
    options = remat.backend(1).options
    assert options.check_headroom_for("cpu") == 0.01 and options.check_target_for(10**9, "cpu") == 990_000_000
    assert options.check_headroom_for("cpu", modeled=False) == 0.15 == options.check_headroom_for("cuda")
    assert options.check_target_for(10**9, "cuda") == options.planning_target_for(10**9, "cuda") == 850_000_000
    explicit = remat.backend(1, headroom_fraction=0.2).options
    assert explicit.check_target_for(10**9, "cpu") == explicit.planning_target_for(10**9, "cpu") == 800_000_000
    assert all(options.check_target_for(b, "cpu") >= options.planning_target_for(b, "cpu") for b in (0, 1, 99, 10**6))


@pytest.mark.parametrize("spelling", ["auto", "AUTO", " Auto "])
def test_auto_budget_is_the_free_memory(spelling):
    options = remat.backend(spelling).options
    assert options.budget_is_auto is True
    assert isinstance(options.budget_bytes, int) and options.budget_bytes > 0


def test_auto_needs_the_free_memory():
    with pytest.raises(ValueError, match="budget_gb='auto' needs the device's free memory"):
        make_options("auto", free_bytes_for_auto=None)
    assert make_options("auto", free_bytes_for_auto=123_456).budget_bytes == 123_456


@pytest.mark.parametrize(
    ("kwargs", "error", "shown"),
    [
        ({"hardware": "tpu"}, ValueError, "hardware='tpu'"),
        ({"solver": "ilp"}, ValueError, "solver='ilp'"),
        ({"best_effort": "yes"}, TypeError, "best_effort='yes'"),
        ({"headroom_fraction": 0.95}, ValueError, "headroom_fraction=0.95"),
        ({"headroom_fraction": -0.1}, ValueError, "headroom_fraction=-0.1"),
        ({"headroom_fraction": True}, ValueError, "headroom_fraction=True"),
    ],
)
def test_bad_option_shows_the_value(kwargs, error, shown):
    with pytest.raises(error) as info:
        remat.backend(1, **kwargs)
    assert shown in str(info.value)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("8", 8.0), ("0.5", 0.5), (" 24 ", 24.0), ("1e-3", 0.001), ("auto", "auto"), ("AUTO", "auto"), ("", None), ("  ", None)],
)
def test_env_budget_parsing(raw, expected):
    assert budget_from_env({remat.BUDGET_ENV_VAR: raw}) == expected


def test_env_budget_unset_means_no_budget():
    assert budget_from_env({}) is None


@pytest.mark.parametrize(
    ("raw", "shown"),
    [("8GB", "REMAT_BUDGET_GB='8GB' is not a number"), ("eight", "REMAT_BUDGET_GB='eight' is not a number"),
     ("0", "REMAT_BUDGET_GB=0 must be a positive number of GB"), ("-1", "REMAT_BUDGET_GB=-1 must be a positive number of GB"),
     ("-0.5", "REMAT_BUDGET_GB=-0.5 must be a positive number of GB"),
     ("nan", "REMAT_BUDGET_GB=nan is not a finite number"), ("inf", "REMAT_BUDGET_GB=inf is not a finite number"),
     ("-inf", "REMAT_BUDGET_GB=-inf is not a finite number")],
)
def test_env_budget_rejects_bad_values(raw, shown):
    with pytest.raises(ValueError) as info:
        budget_from_env({remat.BUDGET_ENV_VAR: raw})
    assert shown in str(info.value)


def test_env_budget_reads_the_process_environment(monkeypatch):
    assert remat.BUDGET_ENV_VAR == "REMAT_BUDGET_GB"
    monkeypatch.setenv("REMAT_BUDGET_GB", "0.25")
    assert budget_from_env() == 0.25
    monkeypatch.delenv("REMAT_BUDGET_GB")
    assert budget_from_env() is None


def test_validate_returns_floats():
    assert validate_budget_gb(3) == 3.0 and isinstance(validate_budget_gb(3), float)
    assert validate_budget_gb(None) is None


def test_cache_key_changes_with_every_plan_option():
    """Inductor's compile cache keys on the partitioner's uuid(): a stale plan must never be replayed."""
    keys = {
        remat.backend(None).partitioner.uuid(),
        remat.backend(1).partitioner.uuid(),
        remat.backend(2).partitioner.uuid(),
        remat.backend(1, headroom_fraction=0.2).partitioner.uuid(),
        remat.backend(1, best_effort=True).partitioner.uuid(),
        remat.backend(1, hardware="h100").partitioner.uuid(),
    }
    assert len(keys) == 6
    assert remat.backend(1).partitioner.uuid() == remat.backend(1.0).partitioner.uuid()


def test_solver_milp_and_its_time_limit_are_options():
    options = remat.backend(1, solver="milp", milp_time_limit_s=2.5).options
    assert (options.solver, options.milp_time_limit_s) == ("milp", 2.5)
    assert "solver=milp;milp_s=2.5" in options.cache_key()
    assert remat.backend(1).options.solver == "greedy"


@pytest.mark.parametrize("limit", [0, -1.0, math.nan, math.inf, "10", True])
def test_bad_milp_time_limit_fails_at_the_boundary(limit):
    with pytest.raises(ValueError, match=rf"milp_time_limit_s={limit!r} must be a positive finite number of seconds"):
        remat.backend(1, solver="milp", milp_time_limit_s=limit)


def test_unknown_solver_fails_at_the_boundary():
    with pytest.raises(ValueError, match=r"solver='ilp' is not one of \('greedy', 'milp', 'save-all'\)"):
        remat.backend(1, solver="ilp")


def test_single_threaded_cpu_scatter_sums_keep_the_larger_headroom():
    # Inductor lowers a CPU scatter sum as a loop when its code runs on one thread, and as a
    # library call otherwise; the simulator models the library call only.
    from joint_graphs import capture_joint

    from remat.pipeline import simulator_models

    def scatter(x, index):
        return torch.zeros(2, 8).scatter_add(0, index, x.exp()).sum()

    index = torch.tensor([0, 1, 0, 1])[:, None].expand(4, 8).contiguous()
    facts = capture_joint(scatter, torch.randn(4, 8, requires_grad=True), index).facts()
    plain = capture_joint(lambda x: x.exp().sum(), torch.randn(4, 8, requires_grad=True)).facts()
    assert any(n.op == "aten.scatter_add.default" for n in facts.nodes.values())
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert not simulator_models(facts, "cpu") and simulator_models(plain, "cpu")
        assert simulator_models(facts, "cuda")
        torch.set_num_threads(2)
        assert simulator_models(facts, "cpu")
    finally:
        torch.set_num_threads(threads)
