"""One joint graph from Inductor's hands to a plan: prepare it, then plan it for one request.

Every entry point goes through here: the backend's partitioner, ``remat.pareto`` and the dump's
Pareto curve, ``remat.max_size_that_fits`` and dynamic shapes' size search, and the tools (which
read the facts and plan a ``CompiledGraph`` keeps). Two steps:

- ``prepare_graph``: dead code out, dropout split into mask and scaling, the hardware profile of
  the graph's device, costs on every node, the facts the planner reads (``read_joint_graph``) with
  the values PyTorch's default partitioner saves (``JointGraphFacts.default_saved``),
  and whether the simulator models the code Inductor will generate for it (``simulator_models``).
  Edits the joint graph in place (the backend partitions that same graph).
- ``plan_graph``: ``passes.plan.make_plan`` for one frozen ``PlanningRequest``: the budget, the
  planning target (the budget less the headroom, less a feedback correction), the solver, best
  effort, the saved-bytes cap, and the rule that names budgets in an infeasibility error.

``trace_joint_facts`` traces a model once, without generating code, and prepares each joint
graph as the backend would (``remat.pareto``, ``remat.sizing``, tests).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import fx

from ._torch_compile import default_partition_saved
from ._torch_dynamo import trace_joint_graphs
from ._torch_inductor import LEAN_CODE_GENERATION, code_generation_patches
from .cost_model.calibrate import measure_node_times
from .cost_model.costs import annotate_costs
from .cost_model.hardware import HardwareProfile, get_profile
from .cost_model.tensors import sizes_evaluated_at
from .devices import device_of
from .feedback_store import Correction
from .options import DEFAULT_MILP_TIME_LIMIT_S, RematOptions, target_for_budget
from .passes.block_start import block_checkpoint_saved
from .passes.joint_graph import JointGraphFacts, eager_loss_reserve_bytes, read_joint_graph
from .passes.plan import Plan, block_checkpoint_plan, make_plan, saved_set_plan
from .passes.gradient_sums import accumulate_into_scatters
from .passes.random_ops import split_dropout_outputs
from .simulator.library_scratch import measure_library_scratch, probes_apply, with_library_scratch

# Scatter sums Inductor's CPU backend sends to the library call when more than one thread runs
# its code (torch/_inductor/utils.py: needs_fallback_due_to_atomic_add_limitations) and lowers as
# loops with one thread: the kernel model knows the library call only.
_SCATTER_SUM_OPS = frozenset({"aten.scatter_add.default", "aten.scatter_reduce.two"})


def simulator_models(facts: JointGraphFacts, device_type: str) -> bool:
    """False when the graph's generated code is one the memory simulator is known not to model:
    a scatter sum compiled for a single-threaded CPU (the zoo CNN's max-pool backward then
    measures 10% over its simulation). The plan then keeps the larger default headroom."""
    if device_type != "cpu" or torch.get_num_threads() != 1:
        return True
    return not any(node.op in _SCATTER_SUM_OPS for node in facts.nodes.values())


@dataclass(frozen=True)
class PreparedGraph:
    """One joint graph ready to plan: its facts, the profile its costs came from, its device."""

    facts: JointGraphFacts
    profile: HardwareProfile
    device_type: str      # "cpu", "cuda", ...: the device its tensors are on (``devices.device_of``)
    modeled: bool         # ``simulator_models``: False keeps the larger default headroom

    @property
    def has_backward(self) -> bool:
        """Whether any node belongs to the backward (an inference graph has nothing to plan)."""
        return any(n.role == "backward" for n in self.facts.nodes.values())


def prepare_graph(joint: fx.GraphModule, joint_inputs: Sequence[object], num_fwd_outputs: int, hardware: str,
                  estimator: str = "roofline", outputs_held: bool = False,
                  static_lifetime_input_indices: Optional[Sequence[int]] = None) -> PreparedGraph:
    """Prepare a joint graph for planning (dead code out, dropout split, gradient sums scattered into:
    ``passes/gradient_sums.py``; ``joint`` is edited in place)
    and read its facts. ``outputs_held``: ``JointGraphFacts.outputs_held``. ``static_lifetime_input_indices``:
    what AOTAutograd hands a partitioner (the parameters), for the default partition's saved set
    (``default_partition_saved``; without it, the inputs with a gradient are taken as the parameters).

    ``estimator="profile"`` times the graph's real kernels once (cached by graph hash)
    and uses those times instead of the roofline. Library calls' working memory is measured on
    this machine when the profile is the graph's device's kind (``simulator/library_scratch.py``).
    """
    joint.graph.eliminate_dead_code()
    split_dropout_outputs(joint.graph)
    accumulate_into_scatters(joint.graph)
    joint.recompile()
    device = device_of(joint_inputs)
    profile = get_profile(hardware, device)
    measured = measure_node_times(joint.graph) if estimator == "profile" else None
    costs = annotate_costs(joint.graph, profile, measured_times=measured)
    facts = read_joint_graph(joint.graph, costs, num_fwd_outputs, outputs_held)
    if probes_apply(profile, device):
        facts = with_library_scratch(facts, joint.graph, measure_library_scratch(joint.graph, facts, device))
    default = default_partition_saved(joint, joint_inputs, num_fwd_outputs, static_lifetime_input_indices)
    if default is not None:
        facts = dataclasses.replace(facts, default_saved=default)
    return PreparedGraph(facts, profile, device.type, simulator_models(facts, device.type))


def with_eager_loss_reserve(facts: JointGraphFacts, share: Any,
                            correction: Optional[Correction] = None, break_follows: bool = False) -> JointGraphFacts:
    """``facts`` of a graph alone in its step (``share`` None, or a share of its own stacked runs or of the
    step's accumulated gradients: ``distributed.SINGLE_GRAPH_SHARE_KINDS``) with the reserve for an eager
    loss on its outputs (``JointGraphFacts.eager_loss_bytes``): what ``correction`` measured the loss to hold,
    else ``eager_loss_reserve_bytes`` (``remat/eager_loss.py``). Its simulated peaks and Inductor's checked ones
    then count it between its forward and its backward. Any other graph's unchanged: a graph at a break hands
    its outputs to the next graph (``break_follows``: a graph break follows it, also with no budget, where no
    share says so; a GPT-2 split before its loss predicted 202 MB for a 136 MB step, its logits taken twice
    for an eager loss the loss graph computes), and a DDP step's loss is in its last piece's share; a graph of a
    step split at graph breaks gets what a measured step's eager code held after its forward returned, once
    ``correction`` says so (``step_eager.eager_by_graph``)."""
    from .distributed import SINGLE_GRAPH_SHARE_KINDS, STEP_SHARE_KINDS

    measured = correction.eager_loss_bytes if correction is not None else None
    if break_follows or (share is not None and share.kind not in SINGLE_GRAPH_SHARE_KINDS):
        in_step = share is None or share.kind in STEP_SHARE_KINDS
        if not (in_step and measured):
            return facts
        return dataclasses.replace(facts, eager_loss_bytes=measured)   # what eager code after it held, measured
    reserve = eager_loss_reserve_bytes(facts) if measured is None else measured
    return dataclasses.replace(facts, eager_loss_bytes=reserve) if reserve != facts.eager_loss_bytes else facts


def facts_at_sizes(joint: fx.GraphModule, num_fwd_outputs: int, profile: HardwareProfile,
                   sizes: Mapping[str, int]) -> JointGraphFacts:
    """The facts of a prepared joint graph with symbolic sizes evaluated at ``sizes`` (symbol ->
    value). Re-annotates ``joint``'s costs at those sizes."""
    with sizes_evaluated_at(dict(sizes)):
        return read_joint_graph(joint.graph, annotate_costs(joint.graph, profile), num_fwd_outputs)


@dataclass(frozen=True)
class PlanningRequest:
    """What one plan is asked for. ``target_bytes`` is what the simulated peak must meet (None:
    no budget); ``target_for`` is the rule it comes from, which also names the smallest feasible
    budget in an infeasibility error: the budget less ``headroom_fraction``, less ``correction``."""

    budget_bytes: Optional[int]
    target_bytes: Optional[int]
    headroom_fraction: float = 0.0
    correction: Optional[Correction] = None   # the feedback loop's correction (remat/feedback_store.py)
    best_effort: bool = False
    solver: str = "greedy"
    milp_time_limit_s: float = DEFAULT_MILP_TIME_LIMIT_S
    saved_cap_bytes: Optional[int] = None     # DDP / FSDP2: the saved bytes a held graph may keep
    saved_cap_search: str = "greedy"          # how the cap is met (``held_cap.SAVED_CAP_SEARCHES``)

    def target_for(self, budget_bytes: int) -> int:
        """The planning target this request's rule gives a budget of ``budget_bytes``. Non-decreasing."""
        target = target_for_budget(budget_bytes, self.headroom_fraction)
        return target if self.correction is None else self.correction.corrected_target(target)

    def cache_repr(self) -> str:
        """What the plan cache keys this request by: every field, the correction by its factor alone (all
        the planner reads of it, through ``target_for``; a factor of 1 is no correction). A step's re-plan
        (a factor-1 correction naming why) and a later process's plan of the same share key alike."""
        factor = None if self.correction is None or self.correction.factor == 1.0 else self.correction.factor
        return f"{dataclasses.replace(self, correction=None)!r}, correction factor {factor!r}"

    def at(self, target_bytes: Optional[int], saved_cap_bytes: Optional[int] = None,
           best_effort: Optional[bool] = None, saved_cap_search: str = "greedy") -> "PlanningRequest":
        """The same request at another target (and cap and its search; and best effort: unchanged when None)."""
        return dataclasses.replace(self, target_bytes=target_bytes, saved_cap_bytes=saved_cap_bytes,
                                   best_effort=self.best_effort if best_effort is None else best_effort,
                                   saved_cap_search=saved_cap_search)


def budget_request(budget_bytes: Optional[int], best_effort: bool = False) -> PlanningRequest:
    """A request whose target is the budget itself (no headroom): what ``remat.pareto``, the dump's
    curve and the plan-hash test plan at."""
    return PlanningRequest(budget_bytes, budget_bytes, best_effort=best_effort)


def request_for(options: RematOptions, graph: PreparedGraph, correction: Optional[Correction] = None,
                budget_bytes: Optional[int] = None) -> PlanningRequest:
    """The request the backend's ``options`` make for ``graph``: at ``budget_bytes`` (default: the
    options' budget), less the headroom of the graph's device (``RematOptions.headroom_for``), less
    ``correction``; the options' solver and best effort."""
    return device_request(options, graph.device_type, graph.modeled, correction, budget_bytes)


def device_request(options: RematOptions, device_type: str, modeled: bool, correction: Optional[Correction] = None,
                   budget_bytes: Optional[int] = None) -> PlanningRequest:
    """``request_for`` a graph on ``device_type`` whose code the simulator does (``modeled``) or does not model."""
    budget = options.budget_bytes if budget_bytes is None else budget_bytes
    request = PlanningRequest(budget, None, options.headroom_for(device_type, modeled), correction,
                              options.best_effort, options.solver, options.milp_time_limit_s)
    return request if budget is None else dataclasses.replace(request, target_bytes=request.target_for(budget))


@dataclass(frozen=True)
class EstimatedPlan:
    """A plan made for a graph's ``facts`` without tracing it (``replan_estimate``), with the graph's store
    key and the request it answers (``PlanningRequest.cache_repr``): the partitioner that then compiles the
    same graph for the same request takes it instead of planning again (``estimated_plan_for``)."""

    graph_key: str
    request_repr: str
    plan: Plan


def replan_estimate(options: RematOptions, device_type: str, graph_key: str, facts: JointGraphFacts,
                    correction: Correction) -> EstimatedPlan:
    """The plan the backend's partitioner would make for the graph of ``facts`` (store key ``graph_key``)
    re-planned at ``correction``, without tracing or compiling it (``judge_loop.faster_within_check`` reads
    its estimated time first)."""
    request = device_request(options, device_type, simulator_models(facts, device_type), correction)
    try:
        return EstimatedPlan(graph_key, request.cache_repr(), plan_graph(facts, request))
    finally:
        facts.analysis.forget_simulations()    # the facts of a graph already planned: keep none of this search's


def estimated_plan_for(estimated: Optional[EstimatedPlan], graph_key: str, request: PlanningRequest) -> Optional[Plan]:
    """``estimated``'s plan where it is of the graph ``graph_key`` and answers ``request`` (the same target,
    cap, headroom, correction factor, solver and best effort), else None: the caller plans."""
    if estimated is None or estimated.graph_key != graph_key or estimated.request_repr != request.cache_repr():
        return None
    return estimated.plan


def plan_graph(facts: JointGraphFacts, request: PlanningRequest) -> Plan:
    """``make_plan`` for ``request`` (see there for what the plan guarantees and what it raises)."""
    return make_plan(facts, request.budget_bytes, target_bytes=request.target_bytes, best_effort=request.best_effort,
                     solver=request.solver, milp_time_limit_s=request.milp_time_limit_s,
                     saved_cap_bytes=request.saved_cap_bytes, target_for_budget=request.target_for,
                     saved_cap_search=request.saved_cap_search)


FREE_MINCUT_CANDIDATE = "free min-cut"
# A corrected re-plan the simulator refused: its smallest-peak plan, for Inductor's check (``judge_loop``).
SMALLEST_PEAK_CANDIDATE = "smallest peak"


BLOCK_CHECKPOINT_CANDIDATE = "per-block checkpointing"
# The refused plan's search, before it refined its lowest plan for time (``Plan.chase_saved``).
CHASE_CANDIDATE = "least-peak chase"
REFUSAL_CANDIDATE_KINDS = (FREE_MINCUT_CANDIDATE, BLOCK_CHECKPOINT_CANDIDATE, CHASE_CANDIDATE)
# The graph planned again, and compiled, under Inductor's lean code generation (``_torch_inductor``): the
# smallest-peak plan the search finds there, whatever the target (so a retry meets the same candidate).
LEAN_CODE_GENERATION_CANDIDATE = "lean code generation"
# The plan the search makes at the planning target of the budget the refusal would name (what a retry there plans
# first), judged after every other candidate (``judge_loop._checked_retry``).
NAMED_BUDGET_CANDIDATE = "named budget's"
SEARCHED_CANDIDATE_KINDS = (LEAN_CODE_GENERATION_CANDIDATE, NAMED_BUDGET_CANDIDATE)   # planned by the search, not built


def refusal_candidates(facts: JointGraphFacts, refused: Optional[Plan] = None,
                       device_type: Optional[str] = None) -> tuple[str, ...]:
    """The plans Inductor's check judges, in this order, after a refused budget's smallest-peak plan
    (``refused``) checks over its target (``judge_loop.overrule_or_refuse``): the free min-cut, then
    checkpointing every repeated block where the graph has two or more (``passes/block_start.py``),
    then the search's lowest plan before it was refined for time, where that differs
    (``refused.chase_saved``): the simulator ranks the refined one lower, by an error of its own; last,
    with ``device_type`` given, the budget planned under lean code generation where that differs from the
    current config on the device (``LEAN_CODE_GENERATION_CANDIDATE``: its code generated only where the search under
    the lean bound finds a plan simulated lower than ``refused``, the default's smallest-peak plan, which on a stack of
    attention layers sharing one bias saves everything: the bias's gradient, a sum over layers inlined into one kernel,
    holds every layer's probabilities anyway, and the lean search recomputes them; the others keep the code
    generation the refused plan was compiled under, the default)."""
    kinds = (FREE_MINCUT_CANDIDATE,)
    if block_checkpoint_saved(facts) is not None:
        kinds += (BLOCK_CHECKPOINT_CANDIDATE,)
    if refused is not None and refused.chase_saved:
        kinds += (CHASE_CANDIDATE,)
    if device_type is not None and code_generation_patches(LEAN_CODE_GENERATION, device_type):
        kinds += (LEAN_CODE_GENERATION_CANDIDATE,)
    return kinds


def candidate_plan(kind: str, facts: JointGraphFacts, request: PlanningRequest, refused: Optional[Plan] = None) -> Plan:
    """The plan of candidate ``kind`` (one of ``refusal_candidates(facts, refused)``) for ``request``'s
    refused budget."""
    if kind == FREE_MINCUT_CANDIDATE:
        return free_mincut_candidate(facts, request)
    plan = None
    if kind == BLOCK_CHECKPOINT_CANDIDATE:
        plan = block_checkpoint_plan(facts, request.budget_bytes, request.target_bytes)
    elif kind == CHASE_CANDIDATE and refused is not None and refused.chase_saved:
        plan = saved_set_plan(facts, set(refused.chase_saved), request.budget_bytes, request.target_bytes,
                              "the least-peak search's plan before its time refinements (a candidate for Inductor's check)")
    if plan is None:
        raise ValueError(f"no {kind!r} candidate plan for this graph (its candidates: {refusal_candidates(facts, refused)})")
    return plan


def free_mincut_candidate(facts: JointGraphFacts, request: PlanningRequest) -> Plan:
    """The free min-cut plan (what the graph saves with no budget) as a candidate for ``request``'s
    budget, which the simulator refused: Inductor's check judges it when the smallest-peak plan checks
    over the target (``judge_loop.overrule_or_refuse``). It carries the request's budget and target and
    ``fits_budget=False`` (the simulator does not say it fits; only the check can)."""
    return as_candidate(plan_graph(facts, dataclasses.replace(request, budget_bytes=None, target_bytes=None,
                                                              best_effort=True)), request)


def as_candidate(plan: Plan, request: PlanningRequest) -> Plan:
    """``plan``, made at another target, as a candidate for ``request``'s refused budget: it carries the request's
    budget and target and ``fits_budget=False`` (the simulator does not say it fits; only the check can)."""
    return dataclasses.replace(plan, budget_bytes=request.budget_bytes, target_bytes=request.target_bytes,
                               fits_budget=False, solver=f"{plan.solver}; a candidate for Inductor's check")


def trace_joint_facts(model: Callable[..., Any], example_inputs: Sequence[Any], *, hardware: str = "auto",
                      read: Optional[Callable[[fx.GraphModule, Sequence[object], int], Any]] = None) -> list[Any]:
    """Trace ``model`` once, as torch.compile with Inductor would, and return the facts of every
    joint graph (``prepare_graph``'s, with ``hardware``'s profile), without planning or generating
    code (``_torch_dynamo.trace_joint_graphs``). ``read``, if given, is called as
    ``read(joint, joint_inputs, num_fwd_outputs)`` instead, and its results are returned
    (``remat.sizing`` keeps the joint graphs)."""
    if read is None:
        return trace_joint_graphs(model, example_inputs, lambda j, i, n: prepare_graph(j, i, n, hardware).facts)
    return trace_joint_graphs(model, example_inputs, read)


__all__ = ["BLOCK_CHECKPOINT_CANDIDATE", "CHASE_CANDIDATE", "FREE_MINCUT_CANDIDATE", "LEAN_CODE_GENERATION_CANDIDATE",
           "NAMED_BUDGET_CANDIDATE", "SEARCHED_CANDIDATE_KINDS", "SMALLEST_PEAK_CANDIDATE", "as_candidate",
           "PlanningRequest", "REFUSAL_CANDIDATE_KINDS", "candidate_plan", "device_request",
           "free_mincut_candidate",
           "refusal_candidates", "PreparedGraph", "budget_request", "facts_at_sizes", "plan_graph", "prepare_graph",
           "replan_estimate", "EstimatedPlan", "estimated_plan_for", "request_for", "simulator_models",
           "trace_joint_facts", "with_eager_loss_reserve"]
