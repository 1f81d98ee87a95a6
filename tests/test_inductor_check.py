"""Inductor judges the plan (issue 11 item 2): the step's peak read from Inductor's generated code,
and a plan over its target repaired before the first step runs."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re

import pytest
import torch

import remat
from remat._torch_deferred import DeferredModule
from remat.measure import close_open_window
from remat.graph_code import GraphCode
from remat.inductor_check import InputStorage, checked_step_peak, replay_wrapper
from remat.simulator.kernel_lowering import EXTERN
from remat.simulator.schedule import memory_steps, partition_nodes
from remat.wrapper_text import call_body
from remat.inductor_verdict import judge_plan
from remat import judge_loop
from conftest import WITHIN_BUDGET_ACTIONS, assert_grads_close, grads_of, prime_loss_weights, run_step, scale_simulated_peaks
from remat.testing.zoo import MLP

MiB = 1 << 20

BACKWARD = '''
class Runner:
    def call(self, args):
        primals_1, saved_a, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cpu((512, 512), (512, 1), torch.float32)
        buf1 = empty_strided_cpu((256, ), (1, ), torch.float32)
        cpp_fused_kernel_0(saved_a, buf0, buf1)
        del saved_a
        buf2 = reinterpret_tensor(buf0, (262144, ), (1, ), 0); del buf0  # reuse
        buf3 = extern_kernels.convolution(buf2, primals_1)
        assert_size_stride(buf3, (2, 256), (256, 1))
        del buf2
        return (buf1, buf3, None, )
'''


def test_replay_counts_allocations_reuse_library_outputs_and_donated_inputs():
    """1 MiB and 1 KiB allocated over a donated 2 MiB input and a 4 KiB gradient; the input is
    freed at its ``del``, the 1 MiB buffer only when its reusing view is deleted; a library call's
    output is sized by its assert (2 x 256 fp32 = 2 KiB)."""
    inputs = {"saved_a": InputStorage("forward:a", 2 * MiB, True), "tangents_1": InputStorage("t", 4096, True)}
    replay = replay_wrapper(BACKWARD, inputs, "cpu")
    assert replay.start_bytes == 2 * MiB + 4096
    assert replay.peak_bytes == 3 * MiB + 4096 + 1024
    assert replay.end_bytes == 4096 + 1024 + 2048
    assert replay.outputs[2] is None and replay.unsized == ()
    assert [replay.storage_bytes[s] for s in replay.outputs[:2]] == [1024, 2048]
    kept = replay_wrapper(BACKWARD, {**inputs, "saved_a": InputStorage("forward:a", 2 * MiB, False)}, "cpu")
    assert kept.end_bytes == replay.end_bytes + 2 * MiB        # not donated: never freed by the backward
    assert replay_wrapper(BACKWARD, inputs, "cuda").end_bytes == 4096 + 1024 + 2048   # 512-byte blocks
    assert replay_wrapper(BACKWARD.replace("(512, 512)", "(s0, 512)"), inputs, "cpu") is None
    assert replay_wrapper("def f():\n    pass\n", inputs, "cpu") is None


LIBRARY_TUPLE = '''
class Runner:
    def call(self, args):
        saved_q, saved_k, tangents_1 = args
        args.clear()
        buf0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(tangents_1, saved_q, saved_k, 0.0, True)
        del saved_q
        del saved_k
        buf1 = buf0[0]
        assert_size_stride(buf1, (256, 1024), (1024, 1), 'torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default')
        # buffer buf1 (op: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default) is assumed to be not aligned
        buf2 = buf0[1]
        assert_size_stride(buf2, (256, 1024), (1024, 1), 'torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default')
        del buf0
        return (buf1, buf2, )
'''


def test_a_library_calls_outputs_are_live_with_its_inputs():
    """The generated code frees a library call's inputs (the ``del``s right after it) before the
    statements that size its outputs; the call allocated its outputs while its inputs were alive, so
    the peak holds both: two 1 MiB donated inputs, the 4 KiB gradient and two 1 MiB outputs (read in
    statement order, the inputs were gone before the outputs were counted: 2 MiB less)."""
    inputs = {"saved_q": InputStorage("forward:q", MiB, True), "saved_k": InputStorage("forward:k", MiB, True),
              "tangents_1": InputStorage("t", 4096, True)}
    replay = replay_wrapper(LIBRARY_TUPLE, inputs, "cpu")
    assert replay.peak_bytes == 4 * MiB + 4096
    assert replay.end_bytes == 2 * MiB + 4096


LIBRARY_TUPLE_TAKEN_LATE = LIBRARY_TUPLE.replace('''        buf2 = buf0[1]
''', '''        buf3 = empty_strided_cpu((256, 1024), (1024, 1), torch.float32)
        kernel(buf1, buf3)
        buf2 = buf0[1]
''')


def test_a_library_calls_tuple_elements_are_live_from_the_call():
    """The wrapper takes a tuple's second element out after a kernel that allocates 1 MiB; the call
    made both elements, so they are live from it: the peak is the inputs, the gradient and both
    outputs, 4 MiB + 4 KiB (in statement order the second output was counted after the inputs' frees
    and the kernel's buffer: 3 MiB + 4 KiB)."""
    inputs = {"saved_q": InputStorage("forward:q", MiB, True), "saved_k": InputStorage("forward:k", MiB, True),
              "tangents_1": InputStorage("t", 4096, True)}
    assert "buf3 = empty_strided_cpu" in LIBRARY_TUPLE_TAKEN_LATE
    replay = replay_wrapper(LIBRARY_TUPLE_TAKEN_LATE, inputs, "cpu")
    assert replay.peak_bytes == 4 * MiB + 4096


FORWARD = '''
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        buf0 = empty_strided_cpu((1024, ), (1, ), torch.float32)
        buf1 = empty_strided_cpu((256, 1024), (1024, 1), torch.float32)
        buf2 = empty_strided_cpu((1024, ), (1, ), torch.float32)
        kernel(primals_1, primals_2, buf0, buf1, buf2)
        del buf2
        return (buf0, reinterpret_tensor(buf1, (1024, 256), (1, 1024), 0), primals_2, )
'''


def test_a_step_peak_composes_the_forward_and_the_backward():
    """The forward peaks at 1 MiB + 8 KiB and hands 1 MiB + 4 KiB to the backward (its user output
    stays, the saved view of buf1 is donated; the saved input costs nothing). The backward starts
    from that plus its 4 KiB gradient, and reuses buf15 named like a forward buffer: storages of
    the two graphs never collide."""
    forward = GraphCode(FORWARD, ("primals_1", "primals_2"), ("out", "saved_a", "primals_2"), (0, 0))
    backward = GraphCode(BACKWARD.replace("buf1", "buf15"), ("primals_1", "saved_a", "tangents_1"),
                         ("", "", ""), (0, 0, 4096))
    checked = checked_step_peak(forward, backward, "cpu", outputs_held=True)
    assert checked.forward_peak_bytes == MiB + 8192
    assert checked.handed_bytes == MiB + 4096 and checked.tangent_bytes == 4096
    assert checked.backward_peak_bytes == (MiB + 4096 + 4096) + MiB + 1024
    assert checked.peak_bytes == checked.backward_peak_bytes and checked.unsized == 0
    assert checked.held_output_bytes == 4096           # the user output, 1024 fp32


def test_a_caller_that_drops_its_outputs_frees_them_before_the_backward():
    """The default convention (``outputs_held=False``): the user output the backward does not read
    died when the forward returned, so the backward starts 4 KiB lower; the forward is unchanged."""
    forward = GraphCode(FORWARD, ("primals_1", "primals_2"), ("out", "saved_a", "primals_2"), (0, 0))
    backward = GraphCode(BACKWARD.replace("buf1", "buf15"), ("primals_1", "saved_a", "tangents_1"),
                         ("", "", ""), (0, 0, 4096))
    held = checked_step_peak(forward, backward, "cpu", outputs_held=True)
    dropped = checked_step_peak(forward, backward, "cpu")
    assert dropped.forward_peak_bytes == held.forward_peak_bytes
    assert dropped.backward_peak_bytes == held.backward_peak_bytes - 4096
    assert dropped.held_output_bytes == 0


JUDGE_TABLE = [
    # (simulated, checked, target, budget, may re-plan) -> action, new target
    ((900, 940, 950, 1000, True), "accepted", None),
    ((900, 1200, 950, 1000, True), "re-plan", int(950 / (1200 / 900))),
    ((900, 980, 950, 1000, False), "accepted over target", None),
    ((900, 1200, 950, 1000, False), "over budget", int(950 / (1200 / 900))),
    ((900, None, 950, 1000, True), "unchecked", None),
    ((900, 5000, None, None, True), "accepted", None),
]


@pytest.mark.parametrize(("args", "action", "new_target"), JUDGE_TABLE)
def test_judge_table(args, action, new_target):
    verdict = judge_plan(*args)
    assert (verdict.action, verdict.new_target_bytes) == (action, new_target)
    assert verdict.accepted_on == ("simulated peak" if args[1] is None else "Inductor-checked peak")
    if new_target is not None:
        assert new_target < args[2]


def _no_replans_and_the_mlp_budget_gb(tmp_path, monkeypatch) -> float:
    """No re-plan allowed (``MAX_JUDGED_REPLANS`` 0), a fresh feedback store, and the budget: BUDGET_FRACTION of
    plain Inductor's measured peak on the MLP."""
    monkeypatch.setattr(judge_loop, "MAX_JUDGED_REPLANS", 0)
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    model, inputs = make_mlp()
    compiled = torch.compile(model, backend="inductor")
    run_step(compiled, model, inputs)
    return BUDGET_FRACTION * remat.measure_peak_bytes(lambda: run_step(compiled, model, inputs)).peak_bytes / 1e9


def test_a_plan_over_its_budget_when_the_re_plans_have_run_out_does_not_run(scaled_simulator, tmp_path, monkeypatch):
    """No re-plan allowed (``MAX_JUDGED_REPLANS`` 0): the wrong simulator's plan checks over the budget and,
    before session 39, ran so (hf-1491, a T5 with an eager cross-entropy: 1.042x its budget at step 1, after
    three re-plans). Now it is judged as a refused budget is: a plan that checks under the target runs and
    the step fits, or the budget is refused naming one that the backend then accepts and fits."""
    budget_gb = _no_replans_and_the_mlp_budget_gb(tmp_path, monkeypatch)
    refused_once = False
    for _ in range(2):
        torch._dynamo.reset()
        model, inputs = make_mlp()
        backend = remat.backend(budget_gb, inductor_check=True)
        try:
            run_step(torch.compile(model, backend=backend), model, inputs)
        except remat.BudgetInfeasibleError as refused:
            assert not refused_once and refused.min_budget_gb > budget_gb, "the named budget must be accepted"
            refused_once, budget_gb = True, refused.min_budget_gb
            continue
        close_open_window()
        break
    graph = backend.compiled_graphs[0]
    assert graph.judgement.action != "over budget"
    assert refused_once or any(v.action == "over budget" for v in graph.judgement.rejected), graph.judgement
    # the plan kept carries the correction of the check's re-plan (a later re-plan starts from it), not the
    # 1-byte target its smallest-peak plan was searched at
    assert graph.correction is None or graph.correction.factor < 10, graph.correction
    (event,) = backend.feedback_events
    assert event.measured_peak_bytes <= backend.options.budget_bytes, (event, graph.judgement)


def test_a_smallest_peak_plan_the_blind_simulator_fits_and_the_check_puts_over_the_budget_is_refused(
        tmp_path, monkeypatch):
    """A simulator that puts every plan at 0 bytes (``scale_simulated_peaks`` at 0) with no re-plan allowed: the
    ran-out route's smallest-peak plan, planned at a 1-byte target to come back refused, is accepted by that
    simulator and checks over the budget again. It must not run: the budget is refused
    (``judge_loop._over_budget_again``), naming a budget at least the checked peak."""
    scale_simulated_peaks(monkeypatch, 0.0)
    budget_gb = _no_replans_and_the_mlp_budget_gb(tmp_path, monkeypatch)
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with pytest.raises(remat.BudgetInfeasibleError) as refused:
        run_step(torch.compile(model, backend=remat.backend(budget_gb, inductor_check=True)), model, inputs)
    assert "smallest-peak plan's generated code peaks at" in str(refused.value), refused.value
    assert refused.value.min_budget_bytes >= refused.value.min_feasible_bytes > budget_gb * 1e9


# ---- a small MLP planned by a simulator that is wrong on purpose ------------------------------

SIM_SCALE = 0.7             # the wrong simulator's peaks are 70% of the real simulator's
BUDGET_FRACTION = 0.8       # of plain Inductor's measured peak


def make_mlp():
    torch.manual_seed(0)
    return MLP(d_in=64, d_hidden=256, n_layers=4), (torch.randn(512, 64),)


@pytest.fixture
def scaled_simulator(monkeypatch):
    """Every simulated peak and timeline scaled by SIM_SCALE (as tests/test_feedback.py does)."""
    scale_simulated_peaks(monkeypatch, SIM_SCALE)


def test_the_judge_repairs_a_wrong_plan_before_the_first_step(scaled_simulator, tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(model, backend="inductor")
        run_step(compiled, model, inputs)
        plain_grads = grads_of(model)
        plain_peak = remat.measure_peak_bytes(lambda: run_step(compiled, model, inputs)).peak_bytes
        torch._dynamo.reset()
        model, inputs = make_mlp()
        backend = remat.backend(BUDGET_FRACTION * plain_peak / 1e9, dump_dir=str(tmp_path / "dump"), inductor_check=True)
        compiled = torch.compile(model, backend=backend)
        run_step(compiled, model, inputs)      # the first step, measured by the feedback loop's window
        close_open_window()
        first_grads = grads_of(model)
    (event,) = backend.feedback_events
    first_peak, budget = event.measured_peak_bytes, backend.options.budget_bytes
    assert event.action in WITHIN_BUDGET_ACTIONS and event.step == 0
    accepted = backend.compiled_graphs[0]          # the plans the judge rejected leave the list (a re-plan for
    assert len(backend.compiled_graphs) == 1 or event.action != "within budget"   # the eager loss may follow)
    first = accepted.judgement.rejected[0]
    assert first.graph_id == "graph_000" and first.action == "re-plan", first
    assert first.simulated_peak_bytes <= first.target_bytes < first.checked_peak_bytes, first
    assert first.checked_peak_bytes > budget, "the wrong simulator's plan should be over the budget, as Inductor sees it"
    assert accepted.graph_id.startswith("graph_000_r") and accepted.judgement.action == "accepted"
    # alone in its step, the plan is judged against the budget less the check's own headroom (1% on CPU)
    assert accepted.judgement.checked_peak_bytes <= accepted.judgement.target_bytes == accepted.check_target_bytes \
        == backend.options.check_target_for(budget, "cpu") < budget
    if len(accepted.judgement.rejected) == 1:
        assert abs(accepted.plan.target_bytes - first.new_target_bytes) <= 1
    assert first_peak <= budget, (first_peak, budget)
    # this step drops the model's output before its backward (conftest.run_step), as the check assumes
    # by default (outputs_held=False); what the check cannot see is the eager loss's few bytes
    assert abs(accepted.judgement.checked_peak_bytes - first_peak) <= 0.01 * first_peak, \
        (accepted.judgement.checked_peak_bytes, first_peak)
    assert_grads_close(first_grads, plain_grads)
    directory = tmp_path / "dump" / accepted.graph_id
    report = (directory / "report.md").read_text()
    assert "accepted on the Inductor-checked peak: " \
        f"{accepted.judgement.checked_peak_bytes / 1e9:.6f} GB" in report.splitlines()[2]
    rejected = (tmp_path / "dump" / "graph_000" / "report.md").read_text().splitlines()[2]
    assert rejected.startswith("rejected by Inductor's check: ") and "re-planned at a simulated target of " \
        f"{first.new_target_bytes / 1e9:.6f} GB" in rejected
    plan_json = json.loads((directory / "plan.json").read_text())
    assert plan_json["accepted_on"] == "Inductor-checked peak"
    assert plan_json["inductor_check"]["checked_peak_bytes"] == accepted.judgement.checked_peak_bytes


def test_a_budget_no_checked_plan_meets_is_refused_naming_one_that_fits(scaled_simulator, tmp_path, monkeypatch):
    """The wrong simulator under-predicts every plan. A budget under every plan is refused naming the
    budget whose target holds the smallest-peak plan's checked peak (above the simulator's figure,
    which names a budget that plan is known to exceed); at that budget the first plans check over it,
    the corrected re-plan finds no plan, and the smallest-peak plan, compiled and checked again, is
    accepted: the named budget runs, and the first step fits."""
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with pytest.raises(remat.BudgetInfeasibleError) as probe:
        run_step(torch.compile(model, backend=remat.backend(1e-6, inductor_check=True)), model, inputs)
    assert "the lowest-checked plan's generated code peaks at" in str(probe.value)
    assert probe.value.min_feasible_bytes > probe.value.budget_bytes
    torch._dynamo.reset()
    model, inputs = make_mlp()
    backend = remat.backend(probe.value.min_budget_gb, inductor_check=True)
    run_step(torch.compile(model, backend=backend), model, inputs)
    close_open_window()
    graph = backend.compiled_graphs[0]
    (event,) = backend.feedback_events
    assert graph.judgement.action.startswith("accepted"), graph.judgement
    assert graph.judgement.target_bytes == backend.options.check_target_for(backend.options.budget_bytes, "cpu")
    assert graph.judgement.checked_peak_bytes <= graph.judgement.target_bytes or graph.judgement.action == "accepted over target"
    assert event.action in WITHIN_BUDGET_ACTIONS and event.measured_peak_bytes <= backend.options.budget_bytes, (event, graph.judgement)



def test_candidates_after_a_refused_corrected_re_plan_are_planned_at_the_corrected_target(tmp_path, monkeypatch):
    """A budget between the wrong simulator's floor and the real one: the first plan simulates under the
    target and checks over it; the re-plan at the corrected target is refused; the smallest-peak plan
    checks over that target, so the refusal's candidates are compiled. Each is planned at the corrected
    target the refusal was made at (``RematBackend.compile_candidate`` hands the refusal's correction on):
    planned afresh at the first target, the free min-cut plan fitted there, came back with no refusal and
    failed an assertion in ``overrule_or_refuse`` (the Hugging Face Qwen2 benchmark at its named floor,
    before 2f6fca5). Every plan is over this budget as Inductor compiles it: the refusal names a budget."""
    import importlib

    backend_module = importlib.import_module("remat.backend")
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("REMAT_COMPILE_CACHE", "0")
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with pytest.raises(remat.BudgetInfeasibleError) as real_floor:
        run_step(torch.compile(model, backend=remat.backend(1e-6, inductor_check=False)), model, inputs)
    scale_simulated_peaks(monkeypatch, SIM_SCALE)
    targets = []
    plan_graph = backend_module.plan_graph
    monkeypatch.setattr(backend_module, "plan_graph",
                        lambda facts, request: targets.append(request.target_bytes) or plan_graph(facts, request))
    budget_gb = 0.5 * (SIM_SCALE + 1.0) * real_floor.value.min_budget_gb    # the first plan fits the wrong simulator
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with pytest.raises(remat.BudgetInfeasibleError) as refused:
        run_step(torch.compile(model, backend=remat.backend(budget_gb, dump_dir=str(tmp_path / "dump"))), model, inputs)
    assert "as Inductor compiled it" in str(refused.value)
    assert refused.value.min_budget_bytes > refused.value.budget_bytes
    first, corrected = targets[0], targets[1]
    assert corrected < first
    # the candidates too, except the lean code generation's smallest-peak plan (1 byte: whatever the target) and the
    # named budget's plan, planned at that budget's own target (``_checked_retry``)
    named_plan = [t for t in targets[1:] if t not in (corrected, 1)]
    assert len(targets) >= 3 and targets[1] == corrected and len(named_plan) <= 1, targets
    assert all(t > corrected for t in named_plan) and targets[-1] in named_plan + [corrected], targets

def test_a_refusal_searches_once_with_its_free_min_cut_candidate_checked(tmp_path, monkeypatch):
    """With the compile cache off (as for symbolic shapes), a refused budget runs the planner's search
    once: the refusal's best-effort plan and the free min-cut candidate Inductor's check compiles next
    reuse that refusal (the candidate's compile searched the refused target again: 35% of the zoo
    GPT's refusal at 1 kB)."""
    import importlib

    backend_module = importlib.import_module("remat.backend")   # the module: ``remat.backend`` is the function
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("REMAT_COMPILE_CACHE", "0")
    searched = []
    plan_graph = backend_module.plan_graph
    monkeypatch.setattr(backend_module, "plan_graph", lambda facts, request: searched.append(request) or plan_graph(facts, request))
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with pytest.raises(remat.BudgetInfeasibleError) as refused:
        run_step(torch.compile(model, backend=remat.backend(1e-6, inductor_check=True)), model, inputs)
    assert refused.value.min_budget_bytes > refused.value.budget_bytes
    # (the lean code generation's candidate runs a search of its own, under its bound, for its smallest peak: 1 byte)
    assert [r.best_effort for r in searched if r.target_bytes != 1] == [False], searched


def test_a_library_output_of_unstated_size_leaves_the_plan_on_its_simulated_peak():
    from remat.inductor_check import checked_peak_of

    forward = GraphCode(FORWARD, ("primals_1", "primals_2"), ("out", "saved_a", "primals_2"), (0, 0))
    backward = GraphCode(BACKWARD, ("primals_1", "saved_a", "tangents_1"), ("", "", ""), (0, 0, 4096))
    assert checked_peak_of([(False, forward, 4), (True, backward, 4)], "cpu") is not None
    unstated = dataclasses.replace(backward, source_code=BACKWARD.replace("assert_size_stride(buf3", "check(buf3"))
    assert checked_step_peak(forward, unstated, "cpu").unsized == 1
    assert checked_peak_of([(False, forward, 4), (True, unstated, 4)], "cpu") is None
    assert checked_peak_of([(False, forward, 4)], "cpu") is None     # no backward compiled


def _one_mlp_step(backend):
    """A fresh MLP's first step compiled with ``backend``, measured: ``((model, inputs), its one
    record, its one feedback event)``. ``run_step``'s loss weights are made first, outside the step, as
    every later step finds them (``prime_loss_weights``)."""
    torch._dynamo.reset()
    model, inputs = make_mlp()
    prime_loss_weights(model, inputs)
    run_step(torch.compile(model, backend=backend), model, inputs)
    close_open_window()
    (graph,) = backend.compiled_graphs
    (event,) = backend.feedback_events
    return (model, inputs), graph, event


OVER_SCALE = 1.4            # a simulator that over-predicts: its peaks are 140% of the real simulator's


def test_a_budget_the_simulator_refuses_runs_when_inductors_check_fits_it(tmp_path, monkeypatch):
    """A simulator that over-predicts refuses a budget the plan fits: Inductor's check of the
    smallest-peak plan overrules it (the plan runs, and its first step measures under the budget);
    a budget the check refuses too names one the check accepts, which then fits. Without the
    check (``inductor_check=False``) the simulator's refusal stands."""
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with pytest.raises(remat.BudgetInfeasibleError) as real_floor:
        run_step(torch.compile(model, backend=remat.backend(1e-6, inductor_check=False)), model, inputs)
    scale_simulated_peaks(monkeypatch, OVER_SCALE)
    budget_gb = 1.1 * real_floor.value.min_budget_gb     # above the real floor, below the over-predicted one
    torch._dynamo.reset()
    model, inputs = make_mlp()
    with pytest.raises(remat.BudgetInfeasibleError):
        run_step(torch.compile(model, backend=remat.backend(budget_gb, inductor_check=False)), model, inputs)

    planned = {"estimated": [], "partitioned": []}     # the requests each planned, as PlanningRequest.cache_repr

    def counted(where, plan_graph):
        return lambda facts, request: planned[where].append(request.cache_repr()) or plan_graph(facts, request)
    pipeline, backend_module = importlib.import_module("remat.pipeline"), importlib.import_module("remat.backend")
    monkeypatch.setattr(pipeline, "plan_graph", counted("estimated", pipeline.plan_graph))
    monkeypatch.setattr(backend_module, "plan_graph", counted("partitioned", backend_module.plan_graph))
    deferred, loaded = [], []      # the judged compiles' wrapper modules, and those loaded (kernels built)
    real_init = DeferredModule.__init__

    def counted_init(module, source, path, load):
        real_init(module, source, path, lambda: loaded.append(module) or load())
        deferred.append(module)
    monkeypatch.setattr(DeferredModule, "__init__", counted_init)
    backend = remat.backend(budget_gb, dump_dir=str(tmp_path / "dump"))
    _, graph, event = _one_mlp_step(backend)
    # a room-search try estimated before its compile is not planned again by the compile's partitioner
    assert "a faster plan in the room" in graph.judgement.action and planned["estimated"], graph.judgement
    assert not set(planned["estimated"]) & set(planned["partitioned"]), planned
    # the first compile (the overruled plan) and the room-search try that replaced it were generated without
    # loading; only the try's forward and backward were loaded (kernels built), before the step
    assert len(deferred) == 4 and loaded == deferred[2:], (deferred, loaded)
    # the overruled plan runs, or a faster one the room search found under the check's target replaced it
    overruled = [v for v in (graph.judgement, *graph.judgement.rejected)
                 if v.action.startswith("accepted: Inductor's check overrules the simulator")]
    assert len(overruled) == 1, graph.judgement
    assert graph.judgement.checked_peak_bytes <= graph.judgement.target_bytes \
        == backend.options.check_target_for(backend.options.budget_bytes, "cpu")
    assert overruled[0].checked_peak_bytes <= overruled[0].target_bytes < overruled[0].simulated_peak_bytes
    assert event.measured_peak_bytes <= backend.options.budget_bytes, event
    # the first step in the process measures what the check said (the room search's tries plan above the
    # planning target and rely on that): the 8 bytes are the eager loss's scalar
    assert 0 <= event.measured_peak_bytes - graph.judgement.checked_peak_bytes <= 64, (graph.judgement, event)
    assert "overrules the simulator" in (tmp_path / "dump" / overruled[0].graph_id / "report.md").read_text()

    torch._dynamo.reset()
    model, inputs = make_mlp()
    deferred.clear(), loaded.clear()
    with pytest.raises(remat.BudgetInfeasibleError) as refused:
        run_step(torch.compile(model, backend=remat.backend(1e-6)), model, inputs)
    assert "as Inductor compiled it" in str(refused.value)
    assert deferred and not loaded     # the candidates the check refused: none of their kernels built
    assert refused.value.min_budget_gb <= real_floor.value.min_budget_gb * 1.01
    torch._dynamo.reset()
    model, inputs = make_mlp()
    backend = remat.backend(refused.value.min_budget_gb)
    run_step(torch.compile(model, backend=backend), model, inputs)
    close_open_window()
    (event,) = backend.feedback_events
    assert event.measured_peak_bytes <= backend.options.budget_bytes, event


TUPLE_CALL = '''
class Runner:
    def call(self, args):
        primals_1, tangents_1 = args
        args.clear()
        buf0 = torch.ops.aten.max_pool2d_with_indices.default(primals_1, [2, 2], [2, 2])
        buf1 = buf0[0]
        assert_size_stride(buf1, (1, 4, 8, 8), (256, 64, 8, 1), 'torch.ops.aten.max_pool2d_with_indices.default')
        buf2 = buf0[1]
        assert_size_stride(buf2, (1, 4, 8, 8), (256, 64, 8, 1), 'torch.ops.aten.max_pool2d_with_indices.default')
        del buf0
        return (buf1, buf2, )
'''


def test_a_library_calls_tuple_is_sized_by_the_dtypes_the_fx_graph_states():
    """max-pool's indices are int64: the code states their size, the FX graph their dtype. Without the
    FX graph's dtypes the elements are unsized (the check declines); with them, 256 x 4 + 256 x 8 bytes.
    An op whose FX nodes disagree on a dtype is left out of the table."""
    from remat.graph_code import library_itemsizes

    x = torch.randn(1, 4, 16, 16)
    gm = torch.fx.experimental.proxy_tensor.make_fx(
        lambda t: torch.ops.aten.max_pool2d_with_indices.default(t, [2, 2], [2, 2]))(x)
    table = library_itemsizes(gm)
    assert table[("aten.max_pool2d_with_indices.default", 0)] == 4
    assert table[("aten.max_pool2d_with_indices.default", 1)] == 8
    inputs = {"tangents_1": InputStorage("t", 0, False)}
    assert replay_wrapper(TUPLE_CALL, inputs, "cpu").unsized == ("buf1", "buf2")
    replay = replay_wrapper(TUPLE_CALL, inputs, "cpu", library_itemsizes=table)
    assert replay.unsized == () and replay.peak_bytes == 256 * 4 + 256 * 8
    mixed = torch.fx.experimental.proxy_tensor.make_fx(lambda a, b: (
        torch.ops.aten.max_pool2d_with_indices.default(a, [2, 2], [2, 2])[0],
        torch.ops.aten.max_pool2d_with_indices.default(b, [2, 2], [2, 2])[0]))(x, x.double())
    assert ("aten.max_pool2d_with_indices.default", 0) not in library_itemsizes(mixed)
    assert library_itemsizes(mixed)[("aten.max_pool2d_with_indices.default", 1)] == 8


class _PoolCNN(torch.nn.Module):
    """Convolutions, BatchNorm, max pooling and dropout: library calls that return tuples
    (``convolution_backward``, ``max_pool2d_with_indices``) in both graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Dropout(0.1), torch.nn.Conv2d(16, 24, 3, padding=1), torch.nn.BatchNorm2d(24), torch.nn.ReLU(),
            torch.nn.MaxPool2d(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x).flatten(1)


def test_a_cnn_with_pooling_is_checked_and_its_check_is_what_the_step_measures(tmp_path, monkeypatch):
    """A CNN's graphs (convolution_backward's and max-pool's tuples) are read by the check, and the
    checked peak is the step's measured peak but for what the eager loss allocates in the step
    (``run_step``'s weights, one output-sized fp32 tensor, and the scalars). The graphs call oneDNN
    convolutions, which allocate inside themselves (a corpus CNN measured 8.3% above its check before
    that was measured, ``simulator/library_scratch.py``); measured and counted, the check is trusted
    (``inductor_check.trusted_peak_bytes``)."""
    from remat._torch_compile import CodeCapture
    from remat.inductor_check import checked_peak_of, trusted_peak_bytes

    captures = []
    compile_graph = CodeCapture.inner_compile

    def keep(capture, *args, **kwargs):
        captures.append(capture)
        return compile_graph(capture, *args, **kwargs)

    monkeypatch.setattr(CodeCapture, "inner_compile", keep)
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path))
    torch.manual_seed(0)
    model = _PoolCNN().train()
    x = torch.randn(8, 3, 24, 24)
    backend = remat.backend(budget_gb=1.0, verify_peak=1)
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):
        run_step(compiled, model, (x,))
    close_open_window()
    graph = backend.compiled_graphs[-1]
    checked = checked_peak_of(captures[-1].graphs, "cpu")
    assert checked is not None and checked.unsized == 0 and "convolution_backward" in checked.library_calls, checked
    measured = backend.feedback_events[-1].measured_peak_bytes
    loss_weights_bytes = model(x).numel() * 4
    assert checked.peak_bytes <= measured <= checked.peak_bytes + loss_weights_bytes + 64, (checked, measured)
    # the plan was judged with the reserve for an eager loss on its outputs (remat/eager_loss.py)
    reserved = checked_peak_of(captures[-1].graphs, "cpu", eager_loss_bytes=graph.eager_loss_bytes)
    trusted = trusted_peak_bytes(reserved, graph.plan.predicted_peak_bytes)
    assert graph.judgement.checked_peak_bytes == trusted
    # every convolution's working memory was measured and counted, and so was max-pool's backward, which
    # is Inductor's in-place scatter_reduce_ in the generated code only (no FX node of its own: measured in
    # the layouts the wrapper hands it, ``wrapper_call_scratch``), so the check is trusted either way
    assert {"convolution", "convolution_backward", "scatter_reduce_"} <= checked.measured_calls
    assert checked.library_calls - checked.measured_calls == {"randint"}
    assert trusted == reserved.peak_bytes


def test_with_no_budget_the_check_reports_the_plans_peak(tmp_path, monkeypatch):
    """No budget: nothing to accept or refuse, but the plan's record and report.md carry the peak read
    from Inductor's code, the number the step then measures (but for the eager loss's scalar)."""
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    (model, inputs), graph, event = _one_mlp_step(remat.backend(None, dump_dir=str(tmp_path / "dump")))
    assert graph.judgement is not None and graph.judgement.action == "accepted" and graph.judgement.target_bytes is None
    assert 0 <= event.measured_peak_bytes - graph.judgement.checked_peak_bytes <= 64, (graph.judgement, event)
    assert "accepted on the Inductor-checked peak" in (tmp_path / "dump" / "graph_000" / "report.md").read_text()


def test_a_library_result_renamed_before_its_assert_is_sized_once():
    """``buf5 = cumsum(...)``, ``buf6 = buf5``, the assert on ``buf6``: one int64 storage, nothing unsized."""
    code = '''
class Runner:
    def call(self, args):
        primals_1, = args
        args.clear()
        buf5 = torch.ops.aten.cumsum.default(primals_1, dim=-1, dtype=torch.int64)
        buf6 = buf5
        assert_size_stride(buf6, (4, 64), (64, 1), 'torch.ops.aten.cumsum.default')
        del buf5
        buf84 = buf6
        del buf6
        return (buf84, )
'''
    replay = replay_wrapper(code, {}, "cpu", library_itemsizes={("aten.cumsum.default", -1): 8})
    assert replay.unsized == () and replay.peak_bytes == replay.end_bytes == 4 * 64 * 8


def test_another_name_for_an_int_input_allocates_nothing():
    """A graph of dynamic shapes compiled again for one call's sizes keeps its size input, bound to its symbol's name
    (``s72 = primals_2``) and never read: no storage, nothing unsized (it was counted as a library call's result
    whose size the code never states, and the whole check read as unknown)."""
    code = '''
class Runner:
    def call(self, args):
        primals_1, primals_2 = args
        args.clear()
        s72 = primals_2
        assert_size_stride(primals_1, (16, 8), (8, 1), 'input')
        buf0 = empty_strided_cpu((16, 8), (8, 1), torch.float32)
        cpp_fused_0(primals_1, buf0)
        return (buf0, )
'''
    replay = replay_wrapper(code, {}, "cpu")
    assert replay is not None and replay.unsized == () and replay.peak_bytes == replay.end_bytes == 16 * 8 * 4



def test_the_check_lowers_a_plans_number_only_where_it_sees_every_allocation():
    """The library calls of a wrapper are read from its code. A checked peak under the simulated one is
    trusted only when every library call is one that allocates nothing unseen (matrix products, the
    RNG seed draw) or one whose working memory was measured; above the simulated one it always counts."""
    from remat.inductor_check import CheckedPeak, trusted_peak_bytes
    from remat.wrapper_text import library_calls

    assert library_calls(BACKWARD) == {"convolution"}
    assert library_calls(TUPLE_CALL) == {"max_pool2d_with_indices"}

    def checked(peak_bytes, *calls):
        return CheckedPeak(peak_bytes, peak_bytes, peak_bytes, 0, 0, 0, library_calls=frozenset(calls))

    assert trusted_peak_bytes(checked(900, "mm", "addmm", "randint"), 1000) == 900
    assert trusted_peak_bytes(checked(900, "mm", "convolution"), 1000) is None
    assert trusted_peak_bytes(checked(1100, "mm", "convolution"), 1000) == 1100
    assert trusted_peak_bytes(None, 1000) is None
    # a call whose working memory was measured (and counted by the check) is seen too
    measured = CheckedPeak(900, 900, 900, 0, 0, 0, library_calls=frozenset({"mm", "convolution"}),
                           measured_calls=frozenset({"convolution"}))
    assert trusted_peak_bytes(measured, 1000) == 900
    # a matrix product allocates nothing in float32 only: one in bfloat16 that was not measured (some node of
    # it in ``unmeasured_calls``) leaves the simulated peak standing
    unmeasured_bf16 = dataclasses.replace(measured, unmeasured_calls=frozenset({"mm"}))
    assert trusted_peak_bytes(unmeasured_bf16, 1000) is None


class _TiedLM(torch.nn.Module):
    """A tied LM head (``h @ emb.weight.t()``) with its cross-entropy inside the graph: the head's
    weight gradient is added to the embedding's at the backward's end, where Inductor's addmm fusion
    would run the head's product (``simulator/addmm_fusion.py``)."""

    def __init__(self, vocab: int = 2048, d: int = 256, bias: bool = True) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.up, self.down = torch.nn.Linear(d, 2 * d, bias=bias), torch.nn.Linear(2 * d, d, bias=bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.down(torch.tanh(self.up(h)))
        return torch.nn.functional.cross_entropy((h @ self.emb.weight.t()).flatten(0, 1), idx.flatten())


def test_a_tied_heads_gradient_is_simulated_where_inductor_runs_it(tmp_path, monkeypatch):
    """The simulated peak of a tied LM is the one read from Inductor's code, wherever the head's
    weight-gradient product runs (before the simulator followed Inductor's addmm fusion, it freed the
    logits' gradient at the start of the backward while the code held it to the end: 28% under the
    checked peak). Without biases: with them, Inductor also runs the first layer's bias gradient (a
    sum) inside the embedding gradient's scatter kernel at the backward's end, which the simulator
    does not model (8% under; docs/limitations.md)."""
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, idx = _TiedLM(bias=False), torch.randint(0, 2048, (4, 64))
    backend = remat.backend(None, verify_peak=0)
    torch.compile(model, backend=backend)(idx).backward()
    (graph,) = backend.compiled_graphs
    judgement = graph.judgement
    assert judgement is not None and judgement.checked_peak_bytes is not None
    assert abs(judgement.checked_peak_bytes - judgement.simulated_peak_bytes) <= 0.01 * judgement.checked_peak_bytes, judgement


def test_a_tied_heads_weight_gradient_product_runs_at_its_own_place(tmp_path, monkeypatch):
    """remat writes the tied weight's gradient sum so Inductor's addmm fusion does not move the head's
    product to the embedding's gradient at the backward's end: the logits' gradient (256 x 2048 floats,
    2 MiB) dies at the start of the backward, the product's 512 KiB lives instead (measured:
    2,883,584 B against 3,276,800 B). Inductor's code has
    no ``addmm`` (the model has no biases), the checked and measured peaks are lower than with the fusion
    (``products_kept_apart`` answering nothing, as before), simulated = checked, and the gradients are
    plain Inductor's. The embedding's part is a scatter into zeros, which ``passes/gradient_sums.py``
    now turns into a scatter into the product (no add left to fuse): it is turned off here, so the
    sum is the add this test is about."""
    from remat import pipeline
    from remat.simulator import kernel_steps
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(pipeline, "accumulate_into_scatters", lambda graph: 0)
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch.manual_seed(0)
    model, idx = _TiedLM(d=64, bias=False), torch.randint(0, 2048, (4, 64))

    def step(backend):
        torch._dynamo.reset()
        model.zero_grad(set_to_none=True)
        compiled = torch.compile(model, backend=backend)
        _, code = run_and_get_code(lambda: compiled(idx).backward())
        model.zero_grad(set_to_none=True)
        peak = remat.measure_peak_bytes(lambda: compiled(idx).backward(), "cpu").peak_bytes
        return code, peak, {name: p.grad.clone() for name, p in model.named_parameters()}

    apart = remat.backend(None, verify_peak=0, dump_dir=str(tmp_path / "dump"))
    code, apart_peak, grads = step(apart)
    assert code and not any("addmm" in c for c in code)
    dumped = (tmp_path / "dump" / "graph_000" / "backward.py").read_text()
    assert dumped.count("# kept apart from Inductor's addmm fusion") == 1, dumped
    (graph,) = apart.compiled_graphs
    checked = graph.judgement.checked_peak_bytes
    assert abs(checked - graph.judgement.simulated_peak_bytes) <= 0.01 * checked, graph.judgement
    _, _, plain_grads = step("inductor")
    assert_grads_close(grads, plain_grads)

    monkeypatch.setattr(kernel_steps, "products_kept_apart", lambda *args: frozenset())
    fused = remat.backend(None, verify_peak=0)
    code, fused_peak, _ = step(fused)
    assert any("addmm" in c for c in code)
    (fused_graph,) = fused.compiled_graphs
    assert checked <= fused_graph.judgement.checked_peak_bytes - MiB // 4, (checked, fused_graph.judgement)
    assert apart_peak <= fused_peak - MiB // 4, (apart_peak, fused_peak)


def test_a_saved_tensor_a_dropped_user_output_shares_is_freed_at_its_last_reader():
    """A saved tensor in the storage of a user output (an LM's logits, saved for the loss's
    backward): when the caller dropped its outputs it dies at the backward's ``del`` like any saved
    tensor (AOTAutograd's backward clears its saved tensors before calling the code; measured: HF
    BERT's remat plan measured its simulated 40,816,900 B where this check said 2 MiB more); when
    the caller holds its outputs it stays to the end."""
    forward = GraphCode(FORWARD.replace("return (buf0, ", "return (buf1, "), ("primals_1", "primals_2"),
                        ("out", "saved_a", "primals_2"), (0, 0))
    backward = GraphCode(BACKWARD.replace("buf1", "buf15"), ("primals_1", "saved_a", "tangents_1"),
                         ("", "", ""), (0, 0, 4096))
    held = checked_step_peak(forward, backward, "cpu", outputs_held=True)
    dropped = checked_step_peak(forward, backward, "cpu")
    # the backward's peak is its last allocation (buf3, 2 KiB, while buf2 still holds 1 MiB): the
    # saved 1 MiB is still there only when held
    assert held.backward_peak_bytes == MiB + 4096 + MiB + 1024 + 2048
    assert dropped.backward_peak_bytes == MiB + 4096 + MiB + 1024     # before the del of saved_a


class _SharedScoreBias(torch.nn.Module):
    """Attention layers that add one shared bias to their scores (T5's relative position bias): the
    bias's gradient sums every layer's score gradient over the batch."""

    def __init__(self, d: int = 32, n: int = 128, layers: int = 3) -> None:
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(1, 1, n, n) * 0.1)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(d, 3 * d, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for project in self.qkv:
            q, k, v = project(h).chunk(3, -1)
            h = h + torch.softmax(q @ k.transpose(-1, -2) + self.bias, -1) @ v
        return h.square().sum()


def _calls_before_last_read(lines: list[str], name: str) -> int:
    """Library calls (``extern_kernels.``) in a wrapper's lines before its last line naming ``name``."""
    last = max(i for i, line in enumerate(lines) if re.search(rf"\b{name}\b", line))
    return sum("extern_kernels." in line for line in lines[:last])


@pytest.mark.parametrize("batch", [4, 8])
def test_a_reduction_over_a_small_batch_is_inlined_where_inductor_inlines_it(tmp_path, monkeypatch, batch):
    """Inductor lowers a reduction over fewer than ``unroll_reductions_threshold`` (8) elements as a
    pointwise loop (``ir.Reduction.create``), which its reader inlines: with a batch of 4 the shared
    bias's gradient is computed in the kernel that adds the first layer's term, reading the last
    layer's attention probabilities there, so Inductor's code holds them through the whole backward
    (10 of its 12 library calls run before their last read). The simulator follows it (before, it ran
    each layer's sum at its place: 2 calls; it now reads them in the kernel of the last add, after all
    12, where Inductor fuses that add into the first layer's softmax-backward kernel: not modelled).
    With a batch of 8 each sum is a reduction Inductor runs at its place; the simulator fuses it with the
    add that sums the layers' terms, at the first layer, which Inductor does not (docs/limitations.md:
    it over-counts, 4,608,000 B simulated against 4,395,008 B checked here)."""
    from torch._inductor.utils import run_and_get_code

    from remat.simulator.kernel_facts import kernel_facts_of

    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x = _SharedScoreBias(), torch.randn(batch, 1, 128, 32)
    backend = remat.backend(None, verify_peak=0)
    compiled = torch.compile(model, backend=backend)
    _, code = run_and_get_code(lambda: compiled(x).backward())
    (graph,) = backend.compiled_graphs
    facts, plan = graph.facts, graph.plan
    # the last layer's attention probabilities: the last forward softmax output the backward reads
    probabilities = [n for n in facts.order if facts.nodes[n].role == "forward" and facts.nodes[n].op == "aten.div.Tensor"
                     and facts.nodes[n].numel == batch * 128 * 128]
    assert len(probabilities) == 3, probabilities
    last_layer = probabilities[-1]
    static = kernel_facts_of(facts).static
    bias_sums = [n for n in facts.order if facts.nodes[n].role == "backward" and facts.nodes[n].op == "aten.sum.dim_IntList"
                 and facts.nodes[n].numel == 128 * 128]
    assert len(bias_sums) == 3, bias_sums
    assert {static[n].unrolled for n in bias_sums} == ({batch} if batch < 8 else {0})

    body = call_body(code[-1])
    assert body is not None
    inductor_calls = _calls_before_last_read(body, last_layer)
    steps, _ = memory_steps(facts, partition_nodes(facts, set(plan.saved)))
    backward = [s for s in steps if s.phase == "backward"]
    last_use = max(i for i, s in enumerate(backward) if last_layer in s.uses)
    simulated_calls = sum(static[s.name.split("@")[0]].kind == EXTERN for s in backward[:last_use]
                          if s.name.split("@")[0] in static)
    if batch < 8:   # held past the first layer's first library call (of 12, four per layer)
        assert inductor_calls >= 9 and simulated_calls >= 9, (inductor_calls, simulated_calls)
    else:           # freed after the last layer's two (the simulator holds them longer: see the docstring)
        assert inductor_calls == 2, inductor_calls


class _LossAndLogits(torch.nn.Module):
    """A head whose step returns its logits beside the cross-entropy (as Hugging Face models do), so the
    logits stay alive through the loss's kernel."""

    def __init__(self, d: int = 64, vocab: int = 2048) -> None:
        super().__init__()
        self.up, self.head = torch.nn.Linear(d, d), torch.nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(torch.relu(self.up(x)))
        return torch.nn.functional.cross_entropy(logits, target), logits


def test_a_cross_entropys_log_of_row_sums_is_stored_as_inductor_stores_it(tmp_path, monkeypatch):
    """The log-softmax inside the cross-entropy: Inductor stores the ``log`` of the row sums (heavy,
    read once per logit through a broadcast: ``lowering.expand`` marks it reused) and inlines the shifted
    logits into their two readers, so the loss's kernel allocates no logits-sized buffer of them. The
    simulator stored the shifted logits instead (6,359,056 B simulated against 4,261,904 B checked on
    this model: the returned logits cannot be overwritten); it now follows Inductor."""
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, x, target = _LossAndLogits(), torch.randn(256, 64), torch.randint(0, 2048, (256,))
    backend = remat.backend(None, verify_peak=0)
    torch.compile(model, backend=backend)(x, target)[0].backward()
    (graph,) = backend.compiled_graphs
    judgement = graph.judgement
    assert judgement.checked_peak_bytes is not None
    assert judgement.simulated_peak_bytes == judgement.checked_peak_bytes, judgement


class _EmbeddingNormHead(torch.nn.Module):
    """Token and position embeddings, a layer norm, a head: the backward's last layer norm backward
    produces both embeddings' gradients, which two accumulating index_puts scatter."""

    def __init__(self, vocab: int = 1024, positions: int = 128, width: int = 64) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(positions, width)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(torch.arange(ids.shape[1]))
        return self.head(torch.nn.functional.gelu(self.norm(h))).logsumexp(-1).sum()


def test_an_embeddings_gradient_scatter_runs_in_the_call_of_the_loops_next_to_it(tmp_path, monkeypatch):
    """Inductor lowers an accumulating index_put (an embedding's gradient) as a loop writing into its
    zeroed buffer (``lowering.index_put_impl_``: an ``ir.Scatter``), not a fallback: it runs in the C++
    call of the loops next to it, its buffer allocated with theirs before the call, while what they read
    is still alive. The simulator ran it as a call of its own after them (hf-1361, a GPT-2: a lean plan
    simulated 14.6% under its check, 511,744 against 599,296 B); it now follows Inductor."""
    monkeypatch.setenv("REMAT_FEEDBACK_DIR", str(tmp_path / "store"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, ids = _EmbeddingNormHead(), torch.randint(0, 1024, (8, 128))
    backend = remat.backend(None, verify_peak=0)
    torch.compile(model, backend=backend)(ids).backward()
    (graph,) = backend.compiled_graphs
    judgement = graph.judgement
    assert judgement.checked_peak_bytes is not None
    assert judgement.simulated_peak_bytes == judgement.checked_peak_bytes, judgement
