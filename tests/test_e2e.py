"""End to end (issue 2): every zoo model, compiled with remat at budget None, at ~50% of its
measured peak without remat (the run that saves every value the backward reads and recomputes
nothing, ``no_remat_peak`` in conftest.py), and at the smallest feasible budget the planner
names ("min"; gpt's under Inductor's RNG, ``test_dropout_masks_survive_recomputation``), against eager and
against plain Inductor. (Until session 41 also at ~70%: cut to
keep the suite near 15 minutes; budgets at 90%, 70% and 50% of plain Inductor's peak are measured,
gradients included, on every model of the fidelity corpus, ``benchmarks/fidelity.py``.)

Each (model, budget) is compiled once per session (``_RUNS``); the checks on it are separate
tests so one failure does not hide the others. Every compile here takes 10-40 s on two
CPU cores, so compiles are shared wherever a check can reuse one.
"""

from __future__ import annotations

import ast
import copy
import json
from pathlib import Path
from typing import Optional

import pytest
import torch

import remat
from remat import judge_loop
from remat.eager_loss import LOOSENED_ACTION
from conftest import (
    BaselineCache, CompiledRun, assert_grads_close, assert_tensors_close, compile_and_run, fresh_model, grads_of,
    run_step, zero_grads,
)
from remat.testing.zoo import ZOO
from remat.units import format_gb_up

pytestmark = pytest.mark.e2e

SMALLEST = 0.0   # "min": ask for 1 kB, test at the smallest feasible budget the error names
FRACTIONS = (None, 0.5, SMALLEST)
# gpt's floor is tested under Inductor's own RNG instead, by ``test_dropout_masks_survive_recomputation`` (the
# same 1 kB probe, the budget it names run, measured within it, gradients equal plain Inductor's): the two probes
# of one model cost ~110 s of the suite (session 42)
FLOOR_TESTED_ELSEWHERE = frozenset({"gpt"})
CASES = [(name, fraction) for name in ZOO for fraction in FRACTIONS
         if not (fraction == SMALLEST and name in FLOOR_TESTED_ELSEWHERE)]


def _case_id(fraction: Optional[float]) -> str:
    return "none" if fraction is None else "min" if fraction == SMALLEST else f"{round(100 * fraction)}pct"


CASE_IDS = [f"{name}-{_case_id(f)}" for name, f in CASES]
RANDOM_OP = "prims.inductor_random.default"
PLAN_KEYS = {
    "budget_bytes", "predicted_peak_bytes", "no_remat_peak_bytes", "saved_bytes", "recompute_flops",
    "est_extra_time_s", "plan_time_s", "nodes",
}
NODE_KEYS = {"name", "op", "flops", "bytes", "decision", "reason"}

_RUNS: dict[tuple[str, Optional[float]], CompiledRun | BaseException] = {}
# (model, fraction) -> (requested budget GB, smallest feasible budget GB) where the fraction is out of reach
CLAMPED: dict[tuple[str, Optional[float]], tuple[float, float]] = {}


def _run(baseline: BaselineCache, tmp_factory: pytest.TempPathFactory, name: str, fraction: Optional[float]) -> CompiledRun:
    """The compiled run of ``name`` at ``fraction`` of its no-remat peak, made once per session.

    ``SMALLEST``: a 1 kB budget must raise ``BudgetInfeasibleError``, and the run is made at the
    smallest feasible budget it names (printed), so the invariants are tested at the tightest
    budget remat reaches. At ~50% an infeasible budget is replaced by the smallest
    feasible budget it names, recorded in ``CLAMPED`` and printed.

    A compile that fails is remembered and re-raised by every test of that case, so each
    reports the same error instead of compiling again.
    """
    key = (name, fraction)
    if key not in _RUNS:
        try:
            if fraction is None:
                _RUNS[key] = baseline.run(name)
            elif fraction == SMALLEST:
                dump_dir = str(tmp_factory.mktemp(f"dump_{name}_min"))
                with pytest.raises(remat.BudgetInfeasibleError) as info:
                    compile_and_run(name, 1e-6, dump_dir, fallback_random=True)
                smallest_gb = info.value.min_budget_gb
                print(f"{name}: smallest feasible budget {smallest_gb:.6f} GB "
                      f"({smallest_gb * 1e9 / baseline.peak_bytes(name):.0%} of the measured no-remat peak)")
                torch._dynamo.reset()
                _RUNS[key] = compile_and_run(name, smallest_gb, dump_dir, fallback_random=True)
            else:
                dump_dir = str(tmp_factory.mktemp(f"dump_{name}_{round(100 * fraction)}"))
                budget_gb = baseline.budget_gb(name, fraction)
                try:
                    _RUNS[key] = compile_and_run(name, budget_gb, dump_dir, fallback_random=True)
                except remat.BudgetInfeasibleError as error:
                    # Out of reach (benchmarks/results/min_feasible-cpu.md lists each model's
                    # smallest feasible target): test at the smallest budget the planner names
                    # instead, and record the gap.
                    smallest_gb = error.min_budget_gb
                    CLAMPED[key] = (budget_gb, smallest_gb)
                    print(f"{name} at {fraction:.0%}: {budget_gb:.6f} GB is infeasible; testing at the "
                          f"smallest feasible budget {smallest_gb:.6f} GB")
                    torch._dynamo.reset()
                    _RUNS[key] = compile_and_run(name, smallest_gb, dump_dir, fallback_random=True)
        except (Exception, pytest.fail.Exception) as error:  # noqa: BLE001 - re-raised by every test of this case
            _RUNS[key] = error
    run = _RUNS[key]
    if isinstance(run, BaseException):
        raise run
    return run


def test_the_no_remat_baseline_recomputes_nothing(no_remat_peak):
    """The base of the ~50% budgets is a no-recomputation run (only values the forward
    keeps in registers are rebuilt by the backward's kernels, and views of a saved value, which
    cost nothing: each storage is saved once), with eager's gradients."""
    for name in ZOO:
        run = no_remat_peak.save_all_run(name)
        plan = _only_plan(run)
        assert plan.solver.startswith("save-all") and plan.budget_bytes is None
        rebuilt = {d.name: d.reason for d in plan.decisions if d.decision == "recompute"}
        assert all(r.startswith(("kept in registers", "a view of a saved value")) for r in rebuilt.values()), \
            f"{name}: {rebuilt}"
        assert plan.predicted_peak_bytes == plan.no_remat_peak_bytes
        assert_grads_close(run.grads, run.eager_grads)


def _only_plan(run: CompiledRun) -> remat.Plan:
    """The plan the run's one graph ran last: its first, or the re-plan the feedback loop made for what the step's
    eager loss held (a weighted sum of the outputs holds their gradient, less than remat reserves for an eager
    cross-entropy: remat/eager_loss.py)."""
    graphs = run.backend.compiled_graphs
    replanned = [e for e in run.backend.feedback_events if e.action == LOOSENED_ACTION]
    assert len(graphs) == 1 + len(replanned) <= 2, \
        f"{run.name}: expected one partitioned graph, got {[g.graph_id for g in graphs]}"
    return graphs[-1].plan


def _numbers(run: CompiledRun, plan: remat.Plan) -> str:
    return (
        f"{run.name} budget {plan.budget_bytes} B, target {plan.target_bytes} B, predicted peak "
        f"{plan.predicted_peak_bytes} B, measured peak {run.measured_peak_bytes} B, "
        f"simulated no-remat peak {plan.no_remat_peak_bytes} B (1 GB = 1e9 bytes)"
    )


@pytest.mark.parametrize(("name", "fraction"), CASES, ids=CASE_IDS)
def test_gradients_equal_eager(name, fraction, no_remat_peak, tmp_path_factory):
    """With eager's RNG (fallback_random=True) the compiled step's gradients equal eager's."""
    case_run = _run(no_remat_peak, tmp_path_factory, name, fraction)
    _only_plan(case_run)
    assert abs(case_run.loss - case_run.eager_loss) <= 1e-4 * max(abs(case_run.eager_loss), 1.0), (
        f"loss {case_run.loss} != eager {case_run.eager_loss}"
    )
    assert_grads_close(case_run.grads, case_run.eager_grads)


@pytest.mark.parametrize(("name", "fraction"), CASES, ids=CASE_IDS)
def test_measured_peak_within_budget(name, fraction, no_remat_peak, tmp_path_factory):
    case_run = _run(no_remat_peak, tmp_path_factory, name, fraction)
    plan = _only_plan(case_run)
    assert case_run.measured_peak_bytes > 0
    if case_run.budget_gb is None:
        assert plan.budget_bytes is None and plan.target_bytes is None and plan.fits_budget
        assert plan.predicted_peak_bytes == plan.mincut_peak_bytes
        return
    assert plan.budget_bytes == round(case_run.budget_gb * 1e9)
    # accepted on the simulator's number, or on Inductor's check where the simulator refused the budget
    verdict = case_run.backend.compiled_graphs[-1].judgement
    if plan.fits_budget:
        assert plan.predicted_peak_bytes <= plan.target_bytes, _numbers(case_run, plan)
    else:
        assert verdict is not None and verdict.action.startswith("accepted: Inductor's check"), (verdict, _numbers(case_run, plan))
        assert verdict.checked_peak_bytes <= verdict.target_bytes, (verdict, _numbers(case_run, plan))
    assert case_run.measured_peak_bytes <= plan.budget_bytes, _numbers(case_run, plan)


BUFFER_CASES = [case for case in CASES if case[0] in ("cnn", "llama")]  # the zoo models that have buffers
BUFFER_IDS = [i for case, i in zip(CASES, CASE_IDS) if case in BUFFER_CASES]


@pytest.mark.parametrize(("name", "fraction"), BUFFER_CASES, ids=BUFFER_IDS)
def test_buffers_equal_eager_after_one_step(name, fraction, no_remat_peak, tmp_path_factory):
    """BatchNorm running stats (and every other buffer) match eager's: updated once, same values."""
    case_run = _run(no_remat_peak, tmp_path_factory, name, fraction)
    assert case_run.eager_buffers, f"{case_run.name} has no buffers"
    assert_tensors_close(case_run.buffers, case_run.eager_buffers)
    tracked = {k: v for k, v in case_run.buffers.items() if k.endswith("num_batches_tracked")}
    assert all(v.item() == 1 for v in tracked.values()), tracked
    if case_run.name == "cnn":
        assert len(tracked) == 6
        fresh, _ = ZOO["cnn"]()
        start = dict(fresh.named_buffers())
        moved = [k for k in case_run.buffers if k.endswith("running_mean") and not torch.equal(case_run.buffers[k], start[k])]
        assert len(moved) == 6, f"running means not updated: {sorted(set(start) - set(moved))}"


@pytest.mark.parametrize(("name", "fraction"), CASES, ids=CASE_IDS)
def test_dump_is_written_and_parses(name, fraction, no_remat_peak, tmp_path_factory):
    case_run = _run(no_remat_peak, tmp_path_factory, name, fraction)
    plan = _only_plan(case_run)
    graph = case_run.backend.compiled_graphs[-1]
    directory = Path(case_run.dump_dir) / graph.graph_id
    assert graph.dump_path == str(directory)
    for file in ("forward.py", "backward.py", "plan.json", "report.md"):
        assert (directory / file).is_file(), f"{directory / file} missing"

    payload = json.loads((directory / "plan.json").read_text())
    assert PLAN_KEYS <= payload.keys(), f"plan.json lacks {sorted(PLAN_KEYS - payload.keys())}"
    assert payload["budget_bytes"] == plan.budget_bytes
    assert payload["predicted_peak_bytes"] == plan.predicted_peak_bytes
    assert payload["no_remat_peak_bytes"] == plan.no_remat_peak_bytes
    assert payload["saved_bytes"] == plan.saved_bytes
    assert payload["recompute_flops"] == plan.recompute_flops
    assert payload["plan_time_s"] > 0 and payload["est_extra_time_s"] >= 0
    nodes = payload["nodes"]
    assert nodes, "plan.json has no nodes"
    for node in nodes:
        assert NODE_KEYS <= node.keys(), f"node {node} lacks {sorted(NODE_KEYS - node.keys())}"
        assert node["decision"] in {"save", "recompute", "none"}, node
        assert isinstance(node["reason"], str) and node["reason"], node
        assert isinstance(node["flops"], int) and isinstance(node["bytes"], int), node
    by_decision = {d: {n["name"] for n in nodes if n["decision"] == d} for d in ("save", "recompute")}
    assert by_decision["recompute"] == set(plan.recomputed)
    assert by_decision["save"] == set(plan.saved)

    forward = (directory / "forward.py").read_text()
    backward = (directory / "backward.py").read_text()
    ast.parse(forward)
    ast.parse(backward)
    for region in graph.regions:
        assert f"# ---- recompute region {region.region}: rebuilds" in backward
        assert f"# ---- end of recompute region {region.region}" in backward
    report = (directory / "report.md").read_text()
    assert report.startswith(f"# remat report: {graph.graph_id}\n")
    assert "1 GB = 1e9 bytes" in report


@pytest.mark.parametrize("name", [name for name in ZOO if name not in FLOOR_TESTED_ELSEWHERE])
def test_planned_peak_is_monotone_in_budget(name, no_remat_peak, tmp_path_factory):
    """Larger budget, larger-or-equal predicted peak.

    No budget is not the largest budget: it plans the free min-cut, and a budget above the
    min-cut's peak buys recompute time back with memory (a higher peak), so it is left out.
    Ordered by the budget each run actually got: a fraction out of reach runs at the smallest
    feasible budget the planner named, which can differ by a few bytes between two attempts."""
    plans = [_only_plan(_run(no_remat_peak, tmp_path_factory, name, f)) for n, f in CASES if n == name]
    ordered = sorted((p for p in plans if p.budget_bytes is not None), key=lambda p: p.budget_bytes, reverse=True)
    peaks = [p.predicted_peak_bytes for p in ordered]
    budgets = [p.budget_bytes for p in ordered]
    assert peaks == sorted(peaks, reverse=True), f"{name}: predicted peaks {peaks} at budgets {budgets}"


# ---- Inductor's own RNG (the default): against plain backend="inductor", same seed ----------


@pytest.fixture(scope="module")
def inductor_gpt_grads() -> dict[str, torch.Tensor]:
    """Gradients of one gpt step compiled with plain Inductor (its own RNG), seed STEP_SEED."""
    model, inputs = fresh_model("gpt")
    run_step(torch.compile(model, backend="inductor"), model, inputs)
    return grads_of(model)


@pytest.fixture(scope="module")
def gpt_infeasible(tmp_path_factory) -> remat.BudgetInfeasibleError:
    """The error a 1 kB budget raises on gpt (the simulator refuses it; Inductor's check of the
    smallest-peak plan, compiled for it, names the budget), with no correction stored: an earlier test's
    measured eager loss (``Correction.eager_loss_bytes``) would name a budget only its options' plans meet."""
    model, inputs = fresh_model("gpt")
    with pytest.MonkeyPatch.context() as patch, pytest.raises(remat.BudgetInfeasibleError) as info:
        patch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path_factory.mktemp("gpt_infeasible_store")))
        run_step(torch.compile(model, backend=remat.backend(1e-6)), model, inputs)
    return info.value


def test_infeasible_budget_names_the_smallest_feasible_budget(gpt_infeasible):
    error = gpt_infeasible
    assert error.budget_bytes == 1_000
    assert error.min_budget_bytes > error.min_feasible_bytes > error.budget_bytes   # the budget adds the headroom
    message = str(error)
    assert message.startswith("budget 1.00 kB is below the smallest feasible budget ")
    assert f"Raise the budget to at least {format_gb_up(error.min_budget_bytes)} GB (1 GB = 1e9 bytes" in message
    assert "best_effort=True" in message
    assert error.reasons and all(reason in message for reason in error.reasons)


def _gpt_step_at(budget_gb: float, dump_dir: Path) -> tuple[remat.Plan, dict[str, torch.Tensor], int]:
    """One compiled gpt step at ``budget_gb``: its plan, its gradients and the measured peak of a second step."""
    model, inputs = fresh_model("gpt")
    backend = remat.backend(budget_gb, dump_dir=dump_dir)
    compiled = torch.compile(model, backend=backend)
    run_step(compiled, model, inputs)
    grads = grads_of(model)
    zero_grads(model)
    measured = remat.measure_peak_bytes(lambda: run_step(compiled, model, inputs)).peak_bytes
    assert len(backend.compiled_graphs) <= 2     # (a re-plan for what the eager loss held: remat/eager_loss.py)
    return backend.compiled_graphs[-1].plan, grads, measured


def _recomputed_random(plan: remat.Plan) -> list[str]:
    ops = {d.name: d.op for d in plan.decisions}
    return [n for n in plan.recomputed if ops.get(n) == RANDOM_OP]


def test_dropout_masks_survive_recomputation(gpt_infeasible, inductor_gpt_grads, tmp_path, monkeypatch):
    """The budget the error names is met by the measured peak, and near it the planner recomputes
    gpt's dropout (an Inductor random op, seeded) with gradients equal to plain Inductor's: the masks
    are identical. The smallest-peak plan need not recompute a mask (saving one may not move the
    peak), so the budget rises in 2% steps, up to 10%, until a plan does. Inductor's room search is
    off here: it replaces the planner's plan near the floor with a faster one that saves the mask
    (``judge_loop.faster_within_check``), and this test is about the mask recomputed."""
    monkeypatch.setattr(judge_loop, "MAX_ROOM_REPLANS", 0)
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))   # as the error's: nothing stored
    budget_gb = gpt_infeasible.min_budget_gb
    plan, grads, measured = _gpt_step_at(budget_gb, tmp_path / "named")
    assert measured <= plan.budget_bytes, (
        f"gpt at the smallest feasible budget {plan.budget_bytes} B: predicted peak {plan.predicted_peak_bytes} B, "
        f"measured peak {measured} B (1 GB = 1e9 bytes)"
    )
    assert_grads_close(grads, inductor_gpt_grads, what="gradient vs plain inductor")
    tried = [(plan.budget_bytes, len(plan.recomputed))]   # (budget, nodes recomputed) per plan tried
    step = 0
    while not _recomputed_random(plan):
        step += 1
        assert step <= 5, f"no {RANDOM_OP} recomputed within 10% above the smallest feasible budget: {tried}"
        plan, grads, measured = _gpt_step_at(budget_gb * (1 + 0.02 * step), tmp_path / f"step{step}")
        tried.append((plan.budget_bytes, len(plan.recomputed)))
    assert_grads_close(grads, inductor_gpt_grads, what=f"gradient vs plain inductor at {plan.budget_bytes} B")
    assert measured <= plan.budget_bytes


# ---- inference --------------------------------------------------------------------------------


def test_inference_under_no_grad_is_not_planned(tmp_path):
    """A forward under torch.no_grad() has no backward: remat plans nothing and writes no dump,
    even with a budget no training step could meet."""
    model, (x,) = fresh_model("mlp")
    eager = copy.deepcopy(model)
    backend = remat.backend(1e-6, dump_dir=tmp_path / "dump")
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        out = compiled(x)
        out_again = compiled(x)
        expected = eager(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out_again, expected, rtol=1e-4, atol=1e-5)
    assert backend.compiled_graphs == []
    assert not (tmp_path / "dump").exists() or not any((tmp_path / "dump").iterdir())
