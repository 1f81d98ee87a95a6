"""remat's compile cache (remat/plan_cache.py, remat/compile_cache.py): an AOTAutograd cache hit restores
the plan record and the dump; a plan re-used from the plan cache gives the record and dump a fresh solve
gives; changing the budget, the headroom or the planner's code misses both caches.

Runs in a cache directory of its own (``REMAT_CACHE_DIR``, the measured CPU profile copied into it so
nothing is measured again) and an Inductor cache directory of its own (``TORCHINDUCTOR_CACHE_DIR``).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
from torch._dynamo.utils import counters

import remat
from remat.testing.zoo import MLP
from remat import caches as caches_cli, compile_cache, plan_cache
from remat.cost_model.hardware import cache_dir, get_profile

BUDGET_GB = 0.004


@pytest.fixture
def caches(tmp_path, monkeypatch):
    get_profile("cpu")      # measured (or read) in the developer's cache, then copied into the test's
    profiles = list(cache_dir().glob("profile_*.json"))
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path / "remat_cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setenv("REMAT_COMPILE_CACHE", "1")
    (tmp_path / "remat_cache").mkdir()
    for profile in profiles:
        shutil.copy(profile, tmp_path / "remat_cache" / profile.name)
    yield tmp_path
    torch._dynamo.reset()


def _compile(dump_dir: Path, budget_gb: float = BUDGET_GB, headroom: Optional[float] = None):
    """One fresh compile and step of a small MLP; its record and AOTAutograd's (hits, misses) in it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = MLP(d_in=64, d_hidden=128, n_layers=3), torch.randn(256, 64)
    backend = remat.backend(budget_gb, dump_dir=dump_dir, verify_peak=0, headroom_fraction=headroom)
    hits, misses = (counters["aot_autograd"][k] for k in ("autograd_cache_hit", "autograd_cache_miss"))
    torch.compile(model, backend=backend)(x).sum().backward()
    (record,) = backend.compiled_graphs
    return record, (counters["aot_autograd"]["autograd_cache_hit"] - hits,
                    counters["aot_autograd"]["autograd_cache_miss"] - misses)


def _files(directory: str) -> dict[str, bytes]:
    root = Path(directory)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _same_plan(a, b) -> None:
    volatile = dict(compile_id="", dump_path="", cache="")
    assert dataclasses.replace(a, **volatile) == dataclasses.replace(b, **volatile)
    assert _files(a.dump_path) == _files(b.dump_path)
    assert set(_files(a.dump_path)) >= {"forward.py", "backward.py", "plan.json", "report.md"}


def test_a_hit_restores_the_record_and_the_dump_and_changes_miss(caches, monkeypatch):
    fresh, (hits, misses) = _compile(caches / "cold")
    assert (hits, misses, fresh.cache) == (0, 1, "")
    assert fresh.plan.fits_budget and fresh.plan.recomputed, "the budget must make the planner recompute"

    warm, (hits, misses) = _compile(caches / "warm")
    assert (hits, misses) == (1, 0)
    assert warm.cache.startswith("autograd-cache hit: ") and warm.dump_path == str(caches / "warm" / "graph_000")
    _same_plan(fresh, warm)

    # remat's records cleared, Inductor's cache kept: the hit is compiled again without AOTAutograd's
    # cache, and the plan comes from the plan cache, with the same record and dump as the fresh solve
    shutil.rmtree(plan_cache.compile_cache_dir() / "graphs")
    replanned, _ = _compile(caches / "replanned")
    assert replanned.cache.startswith("plan cache: ")
    _same_plan(fresh, replanned)

    other_budget, (hits, misses) = _compile(caches / "budget", budget_gb=2 * BUDGET_GB)
    assert (hits, misses, other_budget.cache) == (0, 1, "")
    other_headroom, (hits, misses) = _compile(caches / "headroom", headroom=0.2)
    assert (hits, misses, other_headroom.cache) == (0, 1, "")
    monkeypatch.setattr(plan_cache, "planner_source_hash", lambda: "an edited planner")
    edited, (hits, misses) = _compile(caches / "edited")
    assert (hits, misses, edited.cache) == (0, 1, "")


def test_the_cache_can_be_turned_off_and_cleared(caches, monkeypatch):
    monkeypatch.setenv("REMAT_COMPILE_CACHE", "0")
    assert plan_cache.write_entry("plans", "k", 1) is None and plan_cache.read_entry("plans", "k") is None
    monkeypatch.setenv("REMAT_COMPILE_CACHE", "1")
    assert plan_cache.write_entry("plans", "k", 1) is not None and plan_cache.read_entry("plans", "k") == 1
    plan_cache.entry_path("plans", "torn").write_bytes(b"\x80\x05truncated")   # a torn write reads as a miss
    assert plan_cache.read_entry("plans", "torn") is None
    assert caches_cli.main(["clear"]) == 0 and plan_cache.read_entry("plans", "k") is None


def test_the_partitioner_uuid_covers_what_changes_a_plan(caches):
    options = remat.backend(BUDGET_GB).options
    base = compile_cache.partitioner_uuid(options, {})
    assert base == compile_cache.partitioner_uuid(options, {})
    changed = [remat.backend(2 * BUDGET_GB).options, remat.backend(BUDGET_GB, headroom_fraction=0.2).options,
               remat.backend(BUDGET_GB, solver="milp").options, remat.backend(BUDGET_GB, dump_dir=caches / "d").options]
    assert len({base} | {compile_cache.partitioner_uuid(o, {}) for o in changed}) == 1 + len(changed)
    assert compile_cache.partitioner_uuid(options, {"key": "a correction"}) != base


def test_a_refusal_is_kept_and_raised_afresh(caches):
    """A planner's refusal is stored like a plan: another process (a new ``CachedPlanner``) raises the
    same error without solving, a new error object each time (callers add to its message)."""
    from remat.errors import BudgetInfeasibleError
    from remat.pipeline import PlanningRequest

    calls = []

    def refuse(request):
        calls.append(request)
        raise BudgetInfeasibleError("no plan fits", budget_bytes=10, min_feasible_bytes=20, min_budget_bytes=22,
                                    reasons=("a reason",))

    options = remat.backend(BUDGET_GB).options
    request = PlanningRequest(10, 9)
    errors = []
    for _ in range(2):      # two "processes": the second reads the first's entry
        planner = compile_cache.CachedPlanner("graph", options, "profile", "cpu", True, None, refuse)
        for _ in range(2):
            with pytest.raises(BudgetInfeasibleError) as caught:
                planner(request)
            errors.append(caught.value)
    assert len(calls) == 1
    assert len({id(e) for e in errors}) == 4
    assert {(str(e), e.budget_bytes, e.min_feasible_bytes, e.min_budget_bytes, e.reasons) for e in errors} == {
        ("no plan fits", 10, 20, 22, ("a reason",))}
    other = compile_cache.CachedPlanner("graph", options, "profile", "cpu", True, None, refuse)
    with pytest.raises(BudgetInfeasibleError):
        other(PlanningRequest(10, 9, saved_cap_bytes=0))     # another request: solved
    assert len(calls) == 2
    # the same graph and request with other measured library-call scratch (another machine): solved
    measured = compile_cache.CachedPlanner("graph", options, "profile", "cpu", True, None, refuse,
                                           measured="[('convolution_backward', 73728)]")
    with pytest.raises(BudgetInfeasibleError):
        measured(request)
    assert len(calls) == 3


def test_a_refusals_best_effort_plan_is_the_best_effort_answer_without_a_second_search():
    """A refused target's error carries the plan ``best_effort=True`` runs there (one smallest-peak
    search makes both), equal to what a best-effort solve of the same target gives; the planner's
    cache answers the best-effort request from the refusal without solving again."""
    import dataclasses

    from remat.errors import BudgetInfeasibleError
    from remat.passes.plan import make_plan
    from remat.pipeline import PlanningRequest
    from test_solvers import facts_of

    facts = facts_of("attention")
    smallest = make_plan(facts, 1, best_effort=True)
    assert not smallest.fits_budget
    with pytest.raises(BudgetInfeasibleError) as caught:
        make_plan(facts, 1)
    same = dataclasses.replace(caught.value.best_effort_plan, plan_time_s=smallest.plan_time_s)
    assert same == smallest

    calls = []

    def solve(request):
        calls.append(request.best_effort)
        return make_plan(facts, request.budget_bytes, target_bytes=request.target_bytes, best_effort=request.best_effort)

    planner = compile_cache.CachedPlanner("graph", remat.backend(BUDGET_GB).options, "profile", "cpu", True, None,
                                          solve, enabled=False)
    request = PlanningRequest(1, 1)
    with pytest.raises(BudgetInfeasibleError):
        planner(request)
    plan = planner(request.at(1, best_effort=True))
    assert calls == [False]
    assert dataclasses.replace(plan, plan_time_s=smallest.plan_time_s) == smallest
    planner(request.at(2, best_effort=True))     # another target: solved
    assert calls == [False, True]


def _count_solves(monkeypatch) -> list:
    """The requests the backend's planner solves from now on (not those read from the plan cache)."""
    import importlib

    backend_module = importlib.import_module("remat.backend")    # the module, not remat.backend()
    solved: list = []
    solve = backend_module.plan_graph
    monkeypatch.setattr(backend_module, "plan_graph", lambda facts, request: solved.append(request) or solve(facts, request))
    return solved


def test_graphs_at_graph_breaks_reuse_every_answer_on_a_warm_run(caches, monkeypatch):
    """Graphs sharing a step at graph breaks search their share anew each compile; on a warm run every
    plan the search asks for is read from the plan cache, and the plans are the ones the cold run made."""
    from test_graph_breaks import BrokenBlocks

    solved = _count_solves(monkeypatch)

    def run(dump: str):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = BrokenBlocks(breaks=1, width=64, hidden=128), torch.randn(128, 64)
        backend = remat.backend(0.0006, dump_dir=caches / dump, verify_peak=0, inductor_check=False)
        torch.compile(model, backend=backend)(x).sum().backward()
        return backend.compiled_graphs

    cold = run("cold")
    assert len(cold) == 2 and all(r.step_share is not None for r in cold), "the graphs must share the step"
    cold_solves = len(solved)
    assert cold_solves > 2, "the step's search asks for several plans"
    warm = run("warm")
    assert len(solved) == cold_solves, "the warm run solved again"
    assert [r.plan for r in warm] == [r.plan for r in cold]
    assert all(r.cache.startswith("plan cache: ") for r in warm)


def test_a_settled_step_is_remembered_and_a_warm_first_step_plans_it_at_once(caches, monkeypatch):
    """A step split at a graph break is planned provisionally in step 1 and re-planned once it completes
    (cold). A later process plans each graph at the share the settled step gave it (remat/step_memory.py):
    its first step runs the cold run's final plans, none provisional, nothing solved and nothing
    re-planned."""
    from test_graph_breaks import BrokenBlocks

    solved = _count_solves(monkeypatch)

    def run(steps: int):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = BrokenBlocks(breaks=1, width=64, hidden=128), torch.randn(128, 64)
        backend = remat.backend(0.0008, verify_peak=0, inductor_check=False)
        step = torch.compile(model, backend=backend)
        for _ in range(steps):
            step(x).sum().backward()
        return backend

    cold = run(3)
    ids = [r.graph_id for r in cold.compiled_graphs]
    assert any(i.endswith("_r1") for i in ids), f"the case must re-plan after step 1: {ids}"
    final = {r.graph_id.split("_r")[0]: r for r in cold.compiled_graphs}    # the last plan of each graph
    assert all(r.step_share.kind == "break" for r in final.values())
    cold_solves = len(solved)
    warm = run(2)
    assert [r.graph_id for r in warm.compiled_graphs] == sorted(final), "the warm run re-planned"
    assert [r.plan for r in warm.compiled_graphs] == [final[k].plan for k in sorted(final)]
    assert not any(warm.step_account.plan_of(r.graph_id).provisional for r in warm.compiled_graphs)
    assert len(solved) == cold_solves, "the warm run solved again"


def test_a_remembered_step_is_recalled_only_where_it_rests_on_this_processs_graphs():
    """``recall_share``: the graphs pending before and the graph planned must be the remembered step's
    first graphs, and the numbers its share was computed from (step target, held bytes, inputs,
    gradients) this process's; anything else is planned as in a cold process."""
    from remat.distributed import piece_target
    from remat.step_budget import StepGraph
    from remat import step_memory

    def graph(key: str, held: int, share=None) -> StepGraph:
        return StepGraph(f"g_{key}", f"g_{key}", held, 5, 7, 10, 40, 100, graph_key=key, asked_share=share)

    shares = [piece_target(step_target_bytes=100, index=i, needs=(10, 10), held_before_bytes=held,
                           input_activation_bytes=inputs, total_grad_bytes=14, grads_so_far_bytes=7 * (i + 1),
                           kind="break", own_grad_bytes=7) for i, held, inputs in ((0, 0, 0), (1, 20, 5))]
    step = step_memory.settled([graph("a", 20, shares[0]), graph("b", 15, shares[1])])
    assert step is not None and step_memory.settled([graph("a", 20, shares[0]), graph("b", 15)]) is None
    stored = {}
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(step_memory.plan_cache, "write_entry", lambda kind, key, value: stored.__setitem__(key, value))
    monkeypatch.setattr(step_memory.plan_cache, "read_entry", lambda kind, key: stored.get(key))
    try:
        step_memory.remember_step(step)
        recall = step_memory.recall_share
        assert recall([], "a", 100, 0, 7) == shares[0]
        assert recall([graph("a", 20)], "b", 100, 5, 7) == shares[1]
        assert recall([], "b", 100, 0, 7) is None, "another first graph"
        assert recall([], "a", 90, 0, 7) is None, "another step target"
        assert recall([graph("a", 21)], "b", 100, 5, 7) is None, "the earlier graph holds another amount"
        assert recall([graph("a", 20)], "c", 100, 5, 7) is None, "another second graph"
        assert recall([graph("a", 20)], "b", 100, 6, 7) is None, "other inputs"
        assert recall([graph("a", 20), graph("b", 15)], "c", 100, 5, 7) is None, "past the remembered step"
    finally:
        monkeypatch.undo()


def test_re_plans_made_while_the_step_runs_use_inductors_fx_graph_cache(caches):
    """A graph-break step's graphs are re-planned once the step's graphs are known, compiled outside
    Dynamo's compile (no tracing context of its own): a warm run's re-plans are FX graph cache hits, none
    bypasses the cache (without a shape environment Inductor bypassed it: "No shape env")."""
    from test_graph_breaks import BrokenBlocks

    def run() -> tuple[list[str], dict[str, int]]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = BrokenBlocks(breaks=1, width=64, hidden=128), torch.randn(128, 64)
        backend = remat.backend(0.0008, verify_peak=0, inductor_check=False)
        step = torch.compile(model, backend=backend)
        step(x).sum().backward()
        before = dict(counters["inductor"])
        step(x).sum().backward()       # the re-plans are compiled before this step's first graph runs
        second = {k: counters["inductor"][k] - before.get(k, 0)
                  for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
        return [r.graph_id for r in backend.compiled_graphs], second

    cold_ids, cold = run()
    assert any(i.endswith("_r1") for i in cold_ids), f"the case must re-plan: {cold_ids}"
    assert cold["fxgraph_cache_bypass"] == 0 and cold["fxgraph_cache_miss"] > 0
    shutil.rmtree(plan_cache.compile_cache_dir() / "steps")   # the settled step forgotten: the warm run re-plans too
    warm_ids, warm = run()
    assert warm_ids == cold_ids
    assert (warm["fxgraph_cache_bypass"], warm["fxgraph_cache_miss"]) == (0, 0) and warm["fxgraph_cache_hit"] > 0


def test_the_inductor_settings_the_simulator_reads_are_keyed(caches):
    """A plan made under other Inductor settings (the simulator models the fusion, reuse and reordering
    they switch) is not re-used: the same request under ``reorder_for_peak_memory`` off is solved again."""
    from remat.pipeline import PlanningRequest

    calls = []
    options = remat.backend(BUDGET_GB).options

    def ask() -> None:
        planner = compile_cache.CachedPlanner("graph", options, "profile", "cpu", True, None,
                                              lambda request: calls.append(request) or "a plan")
        assert planner(PlanningRequest(10, 9)) == "a plan"

    ask()
    ask()
    assert len(calls) == 1
    with torch._inductor.config.patch(reorder_for_peak_memory=not torch._inductor.config.reorder_for_peak_memory):
        ask()
    assert len(calls) == 2


def test_a_remembered_steps_graphs_are_autograd_cache_hits_in_the_next_process(caches, monkeypatch):
    """A step split at a graph break: the cold process's final plans (its re-plans once step 1 showed the
    step) are compiled with AOTAutograd's cache on, keyed by their share of the step; the next process
    recalls the settled step as Dynamo hands it each graph, computes the same keys and hits both graphs,
    with the cold run's records, dumps and step numbers restored: nothing is traced, solved or re-planned,
    and the gradients are the cold run's. Another budget, or a share other than the key's, never hits."""
    import importlib

    from test_graph_breaks import BrokenBlocks

    solved = _count_solves(monkeypatch)
    aot = counters["aot_autograd"]

    def run(steps: int, dump: str, budget_gb: float = 0.0008):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, x = BrokenBlocks(breaks=1, width=64, hidden=128), torch.randn(128, 64)
        backend = remat.backend(budget_gb, dump_dir=caches / dump, verify_peak=0, inductor_check=False)
        step, grads = torch.compile(model, backend=backend), []
        before = (aot["autograd_cache_hit"], aot["autograd_cache_saved"])
        for _ in range(steps):
            model.zero_grad()
            step(x).sum().backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        return backend, grads, (aot["autograd_cache_hit"] - before[0], aot["autograd_cache_saved"] - before[1])

    cold, cold_grads, (hits, saved) = run(2, "cold")
    ids = [r.graph_id for r in cold.compiled_graphs]
    assert ids == ["graph_000", "graph_001", "graph_000_r1", "graph_001_r1"], ids
    assert (hits, saved) == (0, 2), "the re-plans under the step's shares are stored in AOTAutograd's cache"
    cold_solves = len(solved)

    warm, warm_grads, (hits, saved) = run(2, "warm")
    assert [r.graph_id for r in warm.compiled_graphs] == ["graph_000", "graph_001"], "the warm run re-planned"
    assert (hits, saved) == (2, 0) and len(solved) == cold_solves
    assert all(r.cache.startswith("autograd-cache hit: ") for r in warm.compiled_graphs)
    volatile = dict(graph_id="", compile_id="", dump_path="", cache="")
    for record, final in zip(warm.compiled_graphs, cold.compiled_graphs[2:]):
        assert dataclasses.replace(record, **volatile) == dataclasses.replace(final, **volatile)
        assert record.dump_path == str(caches / "warm" / record.graph_id)
        renamed = {name: data.replace(final.graph_id.encode(), record.graph_id.encode())
                   for name, data in _files(final.dump_path).items()}
        assert _files(record.dump_path) == renamed
        assert {"forward.py", "backward.py", "plan.json", "report.md"} <= set(renamed)
        noted = warm.step_account.plan_of(record.graph_id)
        assert noted == dataclasses.replace(cold.step_account.plan_of(final.graph_id), graph_id=record.graph_id,
                                            slot=record.graph_id)
        assert not noted.provisional and warm.step_account.floor_of(record.graph_id) == cold.step_account.floor_of(
            final.graph_id.split("_r")[0])
    for warm_step in warm_grads:      # both steps run the cold run's final plans, as its second step did
        assert all(torch.equal(a, b) for a, b in zip(warm_step, cold_grads[1]))

    # a share the partitioner does not plan at (here: the key's share altered) is compiled unkeyed, without
    # AOTAutograd's cache, and nothing is stored under that key
    step_loop = importlib.import_module("remat.step_loop")
    recalled = step_loop.expected_share
    monkeypatch.setattr(step_loop, "expected_share", lambda *a: (s := recalled(*a)) and dataclasses.replace(
        s, target_bytes=s.target_bytes + 1))
    wrong, _, (hits, saved) = run(1, "wrong")
    assert (hits, saved) == (0, 0)
    assert [r.plan for r in wrong.compiled_graphs] == [r.plan for r in warm.compiled_graphs]
    assert all(r.cache.startswith("plan cache: ") for r in wrong.compiled_graphs)
    monkeypatch.setattr(step_loop, "expected_share", recalled)

    other, _, (hits, _) = run(1, "budget", budget_gb=0.0009)
    assert hits == 0 and not any(r.cache.startswith("autograd-cache hit") for r in other.compiled_graphs)
