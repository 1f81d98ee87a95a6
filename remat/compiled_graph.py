"""``CompiledGraph``: the record of what remat decided for one joint graph it partitioned.

Its own module so that what reads the records (the compile cache, dynamic shapes, the tools)
does not import the backend that makes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .distributed import GraphShare
    from .distributed_record import DistributedGraphRecord
    from .feedback_store import Correction
    from .inductor_verdict import Judgement, Refusal
    from .passes.joint_graph import JointGraphFacts
    from .passes.plan import Plan
    from .passes.rewrite import RegionSummary


@dataclass(frozen=True)
class CompiledGraph:
    """What remat decided for one joint graph it partitioned."""

    graph_id: str
    compile_id: str
    plan: "Plan"
    regions: tuple["RegionSummary", ...]
    dump_path: Optional[str]
    distributed: Optional["DistributedGraphRecord"] = None  # set under torch.distributed (remat/distributed.py)
    graph_key: str = ""                        # the feedback store's key for this graph (remat/feedback_store.py)
    base_target_bytes: Optional[int] = None    # the planning target before any correction
    correction: Optional["Correction"] = None  # the feedback loop's correction the plan was made with
    judgement: Optional["Judgement"] = None    # Inductor's verdict on the plan (remat/inductor_verdict.py)
    step_share: Optional["GraphShare"] = None  # its share of a step split at graph breaks (remat/step_budget.py)
    # the peak Inductor's check judges the plan against when it is not ``base_target_bytes``: for a graph
    # alone in its step, the budget less the check's headroom (``RematOptions.check_target_for``); under a
    # known step's share, the largest peak the share admits next to what the plan holds
    check_target_bytes: Optional[int] = None
    # "" (solved in this compile), "plan cache: <entry>" (the plan re-used, the rest made now) or
    # "autograd-cache hit: <entry>" (AOTAutograd's cache served the compile; this record restored)
    cache: str = ""
    # the simulator refused the budget and this is its smallest-peak plan (or, when that one checked over
    # its target, the free min-cut candidate), compiled for Inductor's check to overrule the refusal or
    # let it stand (``judge_loop.overrule_or_refuse``)
    refusal: Optional["Refusal"] = None
    # its activation inputs and its parameters' gradients (bytes, ``step_budget.graph_io_bytes``): what
    # composing it into a step split at graph breaks adds to its peak (``step_budget.step_totals``)
    input_activation_bytes: int = 0
    param_grad_bytes: int = 0
    # what an eager loss on its outputs is taken to hold between its forward and backward (a graph alone in its
    # step: ``passes.joint_graph.eager_loss_reserve_bytes``), in its simulated peaks and Inductor's checked ones
    eager_loss_bytes: int = 0
    # the Inductor code generation its plan was made and its code generated under ("default" or "lean":
    # ``_torch_inductor.code_generation_patches``); its re-plans keep it
    code_generation: str = "default"
    # the facts the plan was made on (what the tools simulate the plan with). Not part of the record's
    # identity, not stored by the compile cache: None on a record an AOTAutograd cache hit restored.
    # Held for the backend's lifetime, in host memory (Python objects, no tensor storage).
    facts: Optional["JointGraphFacts"] = field(default=None, compare=False, repr=False)


__all__ = ["CompiledGraph"]
