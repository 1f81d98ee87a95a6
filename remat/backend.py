"""The torch.compile backend: ``remat.backend(budget_gb=...)`` and ``torch.compile(backend="remat")``.

``RematBackend`` compiles each graph Dynamo hands it with Inductor, remat's partitioner in Inductor's
config (``_torch_compile.py``: every private torch API of that path), and plans each joint graph
through ``pipeline.py``; it then has the plan judged on Inductor's generated code (``judge_loop.py``),
hooks the measured steps (``feedback.py``, ``step_loop.py``) and keeps one ``CompiledGraph`` per
graph planned. The step's graphs share one budget (``step_budget.py``; DDP/FSDP2 pieces: ``distributed*.py``);
dynamic shapes are planned at their largest sizes (``dynamic.py``); compiles are cached (``compile_cache.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from torch import fx

from ._torch_compile import CodeCapture, make_partitioner, split_by_default, split_joint, watch_compiled_backward
from ._torch_dynamo import copy_dynamo_graph, copy_dynamo_graph_or_none, current_compile_id, passthrough_error_class
from ._torch_graph_breaks import called_from_eager_code, caller_resumes_after, graph_break_follows
from ._torch_inductor import DEFAULT_CODE_GENERATION, LEAN_CODE_GENERATION
from ._torch_inductor import code_generation as inductor_code_generation
from .compile_cache import (CachedPlanner, CallCache, StepKey, cache_possible, call_cacheable, compile_cached,
                            graph_identity, partitioner_uuid, store_call)
from .compiled_graph import CompiledGraph
from .cost_model.tensors import has_symbolic_shapes
from .devices import device_of, free_device_bytes
from .distributed import StepLedger
from .distributed_fit import fit_plan, held_bytes_of, record_graph, share_for_graph
from .distributed_errors import ShareInfeasibleError
from .errors import BudgetInfeasibleError
from .measure import mark_compile
from .window_runs import abandon_step
from .feedback import FeedbackEvent, VerifiedGraph
from .feedback_store import Correction, graph_key, read_correction, write_correction
from .inductor_verdict import check_may_overrule, check_rule, refusal_for, share_check_target
from .judge_loop import judge_compiled, refused_at
from .options import DEFAULT_MILP_TIME_LIMIT_S, BudgetSpec, RematOptions, make_options
from .passes.plan import Plan
from .passes.rewrite import place_recompute_regions
from .pipeline import (LEAN_CODE_GENERATION_CANDIDATE, NAMED_BUDGET_CANDIDATE, REFUSAL_CANDIDATE_KINDS,
                       SEARCHED_CANDIDATE_KINDS, as_candidate, candidate_plan, estimated_plan_for, plan_graph, prepare_graph,
                       replan_estimate, request_for, with_eager_loss_reserve)
from .simulator.library_scratch import scratch_key
from .size_dispatch import at_call_sizes
from .step_budget import StepAccount, slot_of
from .step_fit import eager_code_follows, fit_in_step, need_of, note_step_plan
from .step_loop import StepHooks

log = logging.getLogger("remat")


class RematBackend:
    """A ``torch.compile`` backend that plans every joint graph under one budget. ``compiled_graphs`` lists,
    in compile order, the plan remat made for each graph it partitioned (inference graphs have none)."""

    def __init__(self, options: RematOptions) -> None:
        self.options = options
        self.compiled_graphs: list[CompiledGraph] = []
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._step_ledger = StepLedger()  # what earlier DDP pieces of a step keep for their backward
        self.partitioner = make_partitioner(self._partition_at_planned_sizes, self.cache_key)
        self.feedback_events: list[FeedbackEvent] = []     # what the feedback loop did (remat/feedback.py)
        # graph breaks: the step's graphs at run time, its re-plans and measured steps (remat/step_loop.py)
        self._step_hooks = StepHooks(StepAccount(), options.verify_peak, self.feedback_events, options.cache_key(),
                                     refuses=not options.best_effort)     # a step no plan fits: refused
        self.verified_graphs: list[VerifiedGraph] = []     # the wrappers the loop runs, in compile order
        self._corrections: dict[str, Correction] = {}      # by graph key: this backend's, stored or not
        self._replan = threading.local()                   # the correction a re-plan on this thread applies
        self._replan_rounds: dict[str, int] = {}           # re-plans made so far, by first graph id (ids _r1, _r2, ...)

    def cache_key(self) -> str:
        """The partitioner's uuid (``compile_cache.partitioner_uuid``: the budget, options, profile, planner
        source, feedback corrections, dump settings; in a compile keyed by a step's share, ``StepKey``)."""
        return partitioner_uuid(self.options, dict(self._corrections), getattr(self._replan, "step_key", None))

    step_account = property(lambda self: self._step_hooks.account)   # the step's graphs' (remat/step_budget.py)

    def predicted_step_peak_bytes(self) -> Optional[int]:
        """The predicted peak of the last complete training step, where it ran several of this backend's graphs
        (graph breaks): their running plans at the peaks they were accepted on, composed, next to what the step's
        eager code was measured to hold (``step_eager.StepEagerHooks.predicted_step_peak_bytes``). None for a step of
        one graph: its record's plan (``compiled_graphs``) is the prediction."""
        return self._step_hooks.predicted_step_peak_bytes()

    def new_graph_id(self) -> str:     # graph_000, graph_001, ...
        with self._lock:
            return f"graph_{next(self._counter):03d}"

    def _partition_at_planned_sizes(self, joint: fx.GraphModule, joint_inputs: Sequence[object],
                                    kwargs: dict[str, Any]) -> tuple[fx.GraphModule, fx.GraphModule]:
        """``partition`` at the sizes dynamic shapes are planned at, no guard added (``dynamic.py``)."""
        from .dynamic import partition_at_planned_sizes
        return partition_at_planned_sizes(self.partition, self.options, self.compiled_graphs, joint, joint_inputs, kwargs)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # at a graph break (its frame's, or a caller's yet to resume) or called from eager code (an enclosing
        # frame Dynamo skipped) a graph plans lean until its step is known
        self._replan.follows = graph_break_follows(gm) or caller_resumes_after() or called_from_eager_code()
        mark_compile(started=True)     # inside a measured step (its first run): not the step's memory
        try:
            return self._compile(gm, example_inputs)
        except BudgetInfeasibleError:
            # a refusal leaves the step (not Dynamo's own exceptions: a RestartAnalysis raised from inside the
            # compile, e.g. TensorifyScalarRestartAnalysis, is retried by Dynamo and the step goes on)
            abandon_step("its step was abandoned: a refusal left a graph's compile")
            raise
        finally:
            self._replan.follows = False
            mark_compile(started=False)

    def _compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        verify = self.options.verify_peak > 0
        judge = self.options.inductor_check   # with no budget, the check only reports the plan's peak
        budget = self.options.budget_bytes is not None   # the step's account re-plans graphs (remat/step_budget.py)
        # AOTAutograd's cache skips the partitioner on a hit: record and dump restored from the entry (compile_cache.py),
        # where that is safe: a graph alone in its step, or one a remembered step gives a share (keyed by it: StepKey)
        identity = graph_identity(gm, example_inputs)
        step_key = self._step_hooks.key_at_compile(identity) if budget and cache_possible(example_inputs) else None
        call_cache = (CallCache(identity, partitioner_uuid(self.options, dict(self._corrections), step_key))
                      if call_cacheable(self.options, len(self.compiled_graphs), example_inputs, self._replan.follows,
                                        step_key) else None)
        pristine = copy_dynamo_graph_or_none(gm) if verify or judge or budget or call_cache else None   # compile_fx's pre-grad passes rewrite gm in place
        before, capture, graphs = len(self.compiled_graphs), CodeCapture(defer_loading=judge), [gm]
        # The backward is compiled now, not at its first call, so a measured step's window holds no
        # compilation and Inductor can judge the plan (and a re-plan's cache key is the first compile's).
        fn, entry, call_cache = compile_cached(
            lambda: graphs.pop() if graphs else copy_dynamo_graph(pristine), example_inputs, self.partitioner, capture,
            self._replan, verify or judge or budget, call_cache, step_key or StepKey(),
            lambda cache: cache.restore(self.new_graph_id, self.options.dump_dir, self.step_account,
                                        current_compile_id()))
        restored = entry is not None      # an inference graph's entry has no record
        if entry is not None and entry.record is not None:
            self.compiled_graphs.append(entry.record)
        records = self.compiled_graphs[before:]
        if len(records) != 1:
            if call_cache is not None:
                call_cache.store(None, None)
            capture.load()
            return fn       # an inference graph (no plan)
        first = fn
        in_step = budget and records[0].distributed is None   # DDP / FSDP2 pieces: their own ledger
        # a dynamic-shape graph is checked and re-planned only at one call's sizes (size_dispatch.py), in a budgeted step
        dynamic = has_symbolic_shapes(example_inputs)
        checked = pristine is not None and not dynamic and records[0].distributed is None
        in_place = checked or (pristine is not None and dynamic and in_step)
        if not restored:    # a restored record is final: judged (and any refusal overruled) when it was made
            if records[0].refusal is not None and not (judge and checked):
                self.compiled_graphs.pop()      # no check to overrule the simulator's refusal: it stands
                raise passthrough_error_class(BudgetInfeasibleError)(records[0].refusal.error)
            if judge and checked:
                fn = self._judged(fn, capture, pristine, list(example_inputs))
            if call_cache is not None:
                store_call(call_cache, self.compiled_graphs[-1], records[0].graph_id, self.step_account)
        if fn is first:     # its kernels built now: the check kept it (a refusal that stands builds none)
            capture.load()
        if not verify and not in_step:
            return fn

        def recompile(args: list, correction: Correction) -> tuple[Callable[..., Any], CompiledGraph]:
            replanned = CodeCapture()
            # a re-plan under its share of the known step: cached under the key a later process computes
            step_key = (self._step_hooks.key_at_replan(wrapper, correction)
                        if in_step and not dynamic and cache_possible(args) else None)
            fn, record, cache = self._recompile(pristine, args, correction, wrapper.record.graph_key, replanned,
                                                identity=identity, step_key=step_key,
                                                code_generation=wrapper.record.code_generation)
            if record.cache.startswith("autograd-cache hit"):
                return fn, record      # restored: judged when it was made
            if judge:
                fn = self._judged(fn, replanned, pristine, args)
            if cache is not None:
                store_call(cache, self.compiled_graphs[-1], record.graph_id, self.step_account)
            # a dynamic graph's re-plan is static code for this call's sizes; other sizes keep the dynamic code
            return (at_call_sizes(first, args, fn) if dynamic else fn), self.compiled_graphs[-1]

        wrapper = VerifiedGraph(fn, self.compiled_graphs[-1], device=device_of(example_inputs),
                                verify_peak=self.options.verify_peak, events=self.feedback_events, runs_stack=in_step,
                                recompile=recompile if in_place else None, watch_backward=watch_compiled_backward,
                                store=self._remember, step=self._step_hooks if in_step else None,
                                outputs_held=self.options.outputs_held, dynamic=dynamic)
        if in_step:
            self._step_hooks.register(wrapper, identity)
        if verify:
            self.verified_graphs.append(wrapper)
        return wrapper

    def _judged(self, fn: Callable[..., Any], capture: CodeCapture, gm: fx.GraphModule,
                args: list) -> Callable[..., Any]:
        """Inductor's verdict on the plan just compiled (``judge_loop.judge_compiled``); a re-plan is compiled
        from a copy of Dynamo's graph ``gm`` for the real inputs ``args``, loaded only if it is kept."""
        compiled: list[tuple[Callable[..., Any], CodeCapture]] = []    # loaded only if kept (_torch_deferred.py)

        def recompile(correction: Correction, key: str, candidate: Optional[str] = None) -> tuple[Callable[..., Any], CodeCapture]:
            replanned = CodeCapture(defer_loading=True)   # re-plans: under the judged plan's key, for its step's use
            # a re-plan keeps the judged plan's code generation; a candidate has its own
            generation = (LEAN_CODE_GENERATION if candidate == LEAN_CODE_GENERATION_CANDIDATE else DEFAULT_CODE_GENERATION
                          if candidate in REFUSAL_CANDIDATE_KINDS + (NAMED_BUDGET_CANDIDATE,)
                          else self.compiled_graphs[-1].code_generation)
            compiled.append((self._recompile(gm, args, correction.keeping_step_use(made_for), key, replanned, candidate,
                                             code_generation=generation)[0], replanned))
            return compiled[-1]

        def compile_candidate(refused: CompiledGraph, kind: str,
                              target_bytes: Optional[int] = None) -> tuple[Callable[..., Any], CodeCapture]:
            # candidate ``kind`` at the refused target, the refusal handed on (judge_loop.refused_at): no 2nd search;
            # the named budget's plan at ``target_bytes``
            same = refused.correction or Correction(1.0, self.options.budget_bytes, 0, 0, refused.graph_id, "a candidate plan")
            assert refused.refusal is not None
            self._replan.refused = (refused.plan.target_bytes, refused.refusal.error, refused.plan)
            self._replan.candidate_target = target_bytes
            return recompile(same, refused.graph_key, kind)

        device, key, made_for = device_of(args).type, self.compiled_graphs[-1].graph_key, self.compiled_graphs[-1].correction
        def estimate(facts: Any, correction: Correction) -> Plan:   # a room-search try: its compile takes this plan
            self._replan.estimated = replan_estimate(self.options, device, key, facts, correction)
            return self._replan.estimated.plan

        kept = judge_compiled(fn, capture, device, self.options.outputs_held, self.compiled_graphs, recompile,
                              compile_candidate, estimate)
        judged = self.compiled_graphs[-1].judgement
        if judged is not None and judged.checked_peak_bytes is not None:     # (a graph of a step: step_budget.py)
            self.step_account.note_checked(self.compiled_graphs[-1].graph_id, judged.checked_peak_bytes)
        for made, replanned in compiled:
            if made is kept:
                replanned.load()      # the kept plan's kernels are built now, before its first call
        return kept

    def _remember(self, key: str, correction: Correction) -> Optional[str]:
        self._corrections[key] = correction
        path = write_correction(key, correction)
        return None if path is None else str(path)

    def _recompile(self, gm: fx.GraphModule, args: list, correction: Correction, key: str,
                   capture: Optional[CodeCapture] = None, candidate: Optional[str] = None, identity: str = "",
                   step_key: Optional[StepKey] = None,
                   code_generation: str = DEFAULT_CODE_GENERATION) -> tuple[Callable[..., Any], CompiledGraph, Optional[CallCache]]:
        """Compile a copy of Dynamo's graph ``gm`` for the real inputs ``args`` (static shapes, as traced),
        planning at the target ``correction`` gives (or, with ``candidate``, that candidate when the target is
        refused: ``partition``); returns the callable, its record (which keeps the graph's store ``key``: the
        next process's) and the call cache to store the record in once judged (or None). With ``step_key`` (its
        share of the known step: ``StepHooks.key_at_replan``) AOTAutograd's cache is on, keyed as the graph's
        compile in a later process recalling the step is (with its call ``identity``): a hit restores the
        stored record (its ``cache`` says so; judged when made). Planned and compiled under ``code_generation``."""
        self._replan.correction, self._replan.key, self._replan.candidate = correction, key, candidate
        self._replan.code_generation = code_generation
        try:
            with inductor_code_generation(code_generation, device_of(args).type):
                fn, entry, call_cache = compile_cached(
                    lambda: copy_dynamo_graph(gm), args, self.partitioner, capture, self._replan, True,
                    CallCache(identity, partitioner_uuid(self.options, dict(self._corrections), step_key))
                    if step_key is not None and identity else None, step_key,
                    lambda cache: cache.restore(lambda: self._replan_id(correction), self.options.dump_dir,
                                                self.step_account, current_compile_id()))
        finally:
            self._replan.correction, self._replan.candidate, self._replan.refused, self._replan.estimated = (None,) * 4
            self._replan.code_generation, self._replan.candidate_target = DEFAULT_CODE_GENERATION, None
        if entry is not None and entry.record is not None:
            self.compiled_graphs.append(entry.record)
        return fn, self.compiled_graphs[-1], call_cache

    def _correction_for_code(self, code: str, joint_inputs: Sequence[object]) -> tuple[str, str, Optional[Correction]]:
        """The graph id, feedback-store key and correction of a joint graph (its ``code``) about to be planned:
        a re-plan's (the id ``<first>_r1``, ...), else one this backend or an earlier process measured."""
        correction = getattr(self._replan, "correction", None)
        key = self._replan.key if correction is not None else graph_key(code, joint_inputs, self.options)
        if correction is None:
            return self.new_graph_id(), key, self._corrections.get(key) or read_correction(key)
        return self._replan_id(correction), key, correction

    def _replan_id(self, correction: Correction) -> str:
        """The id of the next re-plan a ``correction`` of ``correction.graph_id`` makes: ``graph_001_r1``, ..."""
        with self._lock:
            first = correction.graph_id.split("_r")[0]
            self._replan_rounds[first] = rounds = self._replan_rounds.get(first, 0) + 1
        return f"{first}_r{rounds}"

    def partition(self, joint: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        num_fwd_outputs = int(kwargs["num_fwd_outputs"])
        key_code = joint.code        # before prepare_graph edits the graph: the key the next process computes
        static_indices = kwargs.get("static_lifetime_input_indices")
        prepared = prepare_graph(joint, joint_inputs, num_fwd_outputs, self.options.hardware, self.options.estimator,
                                 self.options.outputs_held, static_indices)
        facts, profile, device_type, modeled = prepared.facts, prepared.profile, prepared.device_type, prepared.modeled
        if not prepared.has_backward:
            return split_by_default(joint, joint_inputs, num_fwd_outputs, static_indices)
        graph_id, key, correction = self._correction_for_code(key_code, joint_inputs)
        base_target_bytes = self.options.planning_target_bytes(device_type, modeled)
        request = request_for(self.options, prepared, correction)   # the target includes the correction
        target_bytes = request.target_bytes
        # Under DDP / FSDP2 the per-rank budget is split across the step's graphs (remat/distributed.py).
        share = share_for_graph(self._step_ledger, target_bytes, joint, num_fwd_outputs, static_indices)
        held_of = lambda p: held_bytes_of(joint, static_indices, p.saved_bytes, p.saved_primals)  # noqa: E731
        follows = getattr(self._replan, "follows", False)   # a graph break follows this graph
        if share is None and target_bytes is not None:   # graph breaks: one budget per step (remat/step_budget.py)
            step = self._step_hooks.account
            share = step.share_for_joint(slot_of(graph_id), target_bytes, joint, need_of(facts), num_fwd_outputs, static_indices,
                                         follows, key, correction, request.headroom_fraction, eager_code_follows(facts))
            held_of = step.held_of(slot_of(graph_id), joint, num_fwd_outputs, static_indices)
        if getattr(self._replan, "step_key", None) is not None:   # a compile keyed by its share plans at it, or stops
            self._replan.step_key.check(share)
        # alone in its step: an eager loss on its outputs (none where a graph break follows: the next graph takes them)
        facts = with_eager_loss_reserve(facts, share, correction, follows)

        # every answer kept by its request, here and on disk (compile_cache.CachedPlanner)
        planner = CachedPlanner(key, self.options, profile, device_type, modeled, static_indices,
                                lambda asked: plan_graph(facts, asked), enabled=not has_symbolic_shapes(joint_inputs),
                                measured=scratch_key(facts))

        def plan_at(target_bytes: Optional[int], saved_cap_bytes: Optional[int] = None,
                    best_effort: Optional[bool] = None, saved_cap_search: str = "greedy") -> Plan:
            return planner(request.at(target_bytes, saved_cap_bytes, best_effort, saved_cap_search))
        refusal, refused_by, asked_share = None, None, share    # refused_by: the refusal the plan compiled is for
        planning_rule = functools.partial(self.options.planning_target_for, device_type=device_type, modeled=modeled)
        judged_by = lambda sh: check_rule(sh, correction, self.options, device_type, modeled)  # noqa: E731
        candidate = getattr(self._replan, "candidate", None)   # Inductor's check asks for another plan
        try:
            if candidate in REFUSAL_CANDIDATE_KINDS and refused_at(self._replan, target_bytes, shared=share is not None):
                raise self._replan.refused[1]   # the refusal the candidate is for: known, not searched again
            if share is None and candidate == LEAN_CODE_GENERATION_CANDIDATE:   # its smallest peak, whatever the target
                plan = as_candidate(plan_at(1, best_effort=True), request.at(target_bytes))
                if plan.predicted_peak_bytes >= self._replan.refused[2].predicted_peak_bytes:
                    raise self._replan.refused[1]     # no lower than the default's smallest: not compiled
            elif share is None and candidate == NAMED_BUDGET_CANDIDATE:    # what a retry at that budget plans first
                plan = as_candidate(plan_at(self._replan.candidate_target), request.at(target_bytes))
            elif share is None:   # alone in its step (a room-search try estimated moments ago is not planned again)
                plan = estimated_plan_for(getattr(self._replan, "estimated", None), key, request.at(target_bytes)) \
                    or plan_at(target_bytes)
            else:  # the largest target the step's ledger admits (remat/distributed.py)
                plan, share = fit_in_step(share, lambda share: fit_plan(share, held_of, plan_at, self.options.budget_bytes,
                    request.target_for, plan_capped=plan_at, ledger=self._step_ledger), plan_at, held_of,
                    None if self.options.best_effort else self.options.budget_bytes)   # best effort: runs, not refused
        except BudgetInfeasibleError as error:
            if (correction and correction.factor != 1.0 and not correction.foreseen    # (a candidate's error: never shown)
                    and candidate not in REFUSAL_CANDIDATE_KINDS + SEARCHED_CANDIDATE_KINDS):
                error.args = (f"{error.args[0]} The planning target includes the feedback loop's correction: "
                              f"{correction.graph_id} measured {correction.measured_peak_bytes / 1e9:.6f} GB where "
                              f"its plan predicted {correction.predicted_peak_bytes / 1e9:.6f} GB, "
                              f"{correction.factor:.3f}x ({correction.source}).",) + error.args[1:]
            if (candidate is None and not check_may_overrule(self.options, share, joint, joint_inputs, error,
                                                             getattr(self._replan, "correction", None) is not None)
                    or candidate in SEARCHED_CANDIDATE_KINDS):    # no (lower) plan there: no such candidate
                raise passthrough_error_class(BudgetInfeasibleError)(error) from None
            if candidate in REFUSAL_CANDIDATE_KINDS:
                plan = candidate_plan(candidate, facts, request, self._replan.refused[2] if self._replan.refused else None)
            elif isinstance(error, ShareInfeasibleError):
                plan = error.named_plan       # the plan the named budget rests on
            else:
                plan = plan_at(target_bytes, best_effort=True)
            refused_by = error
        if candidate in SEARCHED_CANDIDATE_KINDS:    # fits as simulated: still the refusal's candidate
            refused_by = self._replan.refused[1]
        if refused_by is not None:
            judged_share, target_of = judged_by(share)
            refusal = refusal_for(refused_by, plan, judged_share, held_of, target_of, self.options.budget_bytes, planning_rule,
                                  self._step_hooks.step_peak_with(slot_of(graph_id)))
        generation = getattr(self._replan, "code_generation", DEFAULT_CODE_GENERATION)
        cache = planner.source(plan)
        if generation != DEFAULT_CODE_GENERATION:   # the record, its dump and report say which code it is planned for
            plan = dataclasses.replace(plan, solver=f"{plan.solver}; Inductor's {generation} code generation "
                                                    "(remat/_torch_inductor.py)")
        if not plan.fits_budget and refusal is None:
            warnings.warn(f"remat {graph_id}: budget {plan.budget_bytes / 1e9:.4f} GB cannot be met; running the smallest-peak "
                          f"plan found, predicted peak {plan.predicted_peak_bytes / 1e9:.4f} GB (best_effort=True).", stacklevel=2)
        fw, bw = split_joint(joint, plan.saved_primals + plan.saved, num_fwd_outputs)
        bw, regions = place_recompute_regions(bw, facts, plan)
        dump_path = None
        if self.options.dump_dir is not None:
            from .dump import write_dump

            dump_path = write_dump(Path(self.options.dump_dir) / graph_id, graph_id, plan, regions, fw, bw, facts, profile,
                                   pareto_points=self.options.pareto_points, correction=correction)
        step_share = share if share is not None and share.in_step else None
        distributed = None if step_share is not None else record_graph(self._step_ledger, share, joint, plan.saved_bytes,
                                                                       plan.saved_primals, fw, bw, num_fwd_outputs, static_indices, dump_path)
        if target_bytes is not None and (share is None or step_share is not None):
            note_step_plan(self._step_hooks.account, graph_id, step_share, plan, plan_at, joint, facts,
                           num_fwd_outputs, static_indices, target_bytes, dump_path, key, asked_share)
        judged_share, check_target_of = judged_by(step_share or share)   # alone: the budget less the check's headroom
        check_target = None if refusal is not None or base_target_bytes is None else check_target_of(self.options.budget_bytes) \
            if share is None else share_check_target(step_share and judged_share, held_of(plan), check_target_of(self.options.budget_bytes))
        inputs, grads = self._step_hooks.account.io_bytes(slot_of(graph_id), joint, num_fwd_outputs, static_indices)
        record = CompiledGraph(graph_id, current_compile_id(), plan, regions, dump_path, distributed, key, base_target_bytes,
                               correction, step_share=step_share, check_target_bytes=check_target, cache=cache, refusal=refusal,
                               input_activation_bytes=inputs, param_grad_bytes=grads, facts=facts, eager_loss_bytes=facts.eager_loss_bytes,
                               code_generation=generation)
        self.compiled_graphs.append(record)
        facts.analysis.forget_simulations()     # planned: the record keeps its facts, not the search's simulations
        log.info("remat %s: predicted peak %d bytes, budget %s", graph_id, plan.predicted_peak_bytes, plan.budget_bytes)
        return fw, bw


def backend(
    budget_gb: BudgetSpec = None,
    *,
    dump_dir: Optional[os.PathLike | str] = None,
    hardware: str = "auto",
    solver: str = "greedy",
    milp_time_limit_s: float = DEFAULT_MILP_TIME_LIMIT_S,
    best_effort: bool = False,
    headroom_fraction: Optional[float] = None,
    pareto_points: int = 0,
    estimator: str = "roofline",
    verify_peak: int = 1,
    inductor_check: bool = True,
    outputs_held: bool = False,
) -> RematBackend:
    """A torch.compile backend that fits each compiled forward+backward under ``budget_gb``.

    ``budget_gb`` bounds the peak memory (decimal GB, 1 GB = 1e9 bytes) that one
    compiled forward + backward allocates above what was resident when the step
    began. None: no budget, save the least bytes that cost no extra compute.
    "auto": the device's free memory. Arguments are validated here, before any
    tracing; a budget no plan can meet raises ``BudgetInfeasibleError`` at compile
    time (or, with ``best_effort=True``, warns and runs the smallest-peak plan).
    The plan keeps its simulated peak ``headroom_fraction`` under the budget (None: 5% for graphs on
    the CPU, where the simulator is checked within 5% of the measured peak, 15% on other devices;
    ``RematOptions.headroom_for``).
    ``dump_dir`` is created and checked writable here, before any tracing (ValueError naming it
    and why: an existing file, a path under /proc, no permission).
    ``pareto_points > 0`` adds each graph's Pareto curve (that many budgets) to its dump.
    ``hardware`` picks the cost profile ("auto", "cpu", "cuda", "a100", "h100", "h200");
    ``estimator="profile"`` times each graph's real kernels once instead of the roofline.
    ``verify_peak``: the steps measured after each compile; a graph measured over its budget is
    re-planned with the simulator's error it now knows (remat/feedback.py); 0 turns that off.
    ``inductor_check`` (default True): before its first step, each plan's peak is read from the code
    Inductor generated for it and a plan over its target is re-planned (remat/inductor_check.py); the
    plan is accepted on that Inductor-checked peak. False: the simulated peak stands and the feedback
    loop corrects it from the measured step.
    ``outputs_held=True``: the training step keeps the model's outputs alive through its backward
    (``out = step(x); loss_fn(out).backward(); print(out)``); by default they are planned to die
    when the forward returns, as in ``loss_fn(step(x)).backward()``, unless the backward reads them.
    ``solver``: "greedy" (default, fast) or "milp" (exact, small graphs only: larger ones raise
    ValueError at compile time; it keeps its best verified plan after ``milp_time_limit_s`` seconds
    and falls back to "greedy" on failure, and ``Plan.solver`` says which answered and why).
    """
    needs_free = isinstance(budget_gb, str) and budget_gb.strip().lower() == "auto"
    return RematBackend(make_options(
        budget_gb, dump_dir=dump_dir, hardware=hardware, solver=solver, milp_time_limit_s=milp_time_limit_s,
        best_effort=best_effort, headroom_fraction=headroom_fraction, pareto_points=pareto_points, estimator=estimator,
        free_bytes_for_auto=free_device_bytes() if needs_free else None, verify_peak=verify_peak,
        inductor_check=inductor_check, outputs_held=outputs_held))
