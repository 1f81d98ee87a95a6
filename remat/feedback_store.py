"""Corrections the feedback loop measured, kept on disk so the next process plans right.

One JSON file per graph, ``<store>/<key>.json``, where ``<store>`` is ``$REMAT_FEEDBACK_DIR``,
else ``$REMAT_CACHE_DIR/feedback`` (default ``~/.cache/remat/feedback``), and ``<key>`` hashes
what makes a graph's simulation error repeat (``graph_key``): the joint graph's code as
Inductor hands it to the partitioner, its inputs' shapes, strides, dtypes and devices, the
torch version, the torch thread count (Inductor's CPU code depends on it), and the options
that choose the plan (``RematOptions.cache_key``, less the budget and ``verify_peak``: the
error is the simulator's on this graph, whatever budget it was asked for).

A file holds one ``Correction``: the factor ``measured / predicted`` peak of the plan that
measured over its budget, and where it was measured. ``clear_corrections()`` deletes the
store. A corrupt or foreign file reads as no correction.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .cost_model.hardware import cache_dir, write_atomically
from .options import RematOptions

FEEDBACK_DIR_ENV_VAR = "REMAT_FEEDBACK_DIR"
CHECK_SOURCE = "Inductor-checked: "   # a correction's source where Inductor's check made it (judge_loop), not a measurement
STORE_SCHEMA = 1


@dataclass(frozen=True)
class Correction:
    """How much a graph's simulated peaks must be scaled to match what was measured.

    A plan for the graph is made at ``target / factor`` (never above the target unless the correction
    ``loosens``: only a try of the room search, which Inductor's check judges before it runs). ``source``
    says where the factor comes from, e.g. "measured in this process: graph_000 step 0" or
    "stored: /root/.cache/remat/feedback/ab12.json".
    """

    factor: float
    budget_bytes: Optional[int]
    predicted_peak_bytes: int
    measured_peak_bytes: int
    graph_id: str
    source: str
    # above the target too (a factor under 1): only a try of Inductor's room search, which the check
    # judges before it runs (``judge_loop.faster_within_check``); a measured correction never raises it
    loosens: bool = False
    # the graph's runs the measured step held before their backwards (its plan is then made for that many
    # runs per step: runs_share.runs_share); 1 for a graph run once per step
    runs: int = 1
    # the gradients earlier backwards of the measured step had left in the graph's parameters when its forward
    # entered (gradient accumulation: accumulated_grads.py); its plan is then made next to them (runs_share.runs_share)
    accumulated_grad_bytes: int = 0
    # made before any step measured it (the foresight next to accumulated gradients, a step's re-plan of a plan
    # with no correction): ``measured_peak_bytes`` is then a prediction, and an event about it says nothing measured
    foreseen: bool = False
    # what the eager loss on the graph's outputs was measured to hold between its forward and backward (bytes), which
    # its plan is then made for instead of the reserve assumed (``passes.joint_graph.eager_loss_reserve_bytes``);
    # None: not measured
    eager_loss_bytes: Optional[int] = None
    # what a measured step of several graphs held outside every graph's plan (bytes): its peak less the graphs'
    # composed prediction, where each graph was accepted on its Inductor-checked peak (eager code between or around
    # the graphs, which no generated code states); the graph's plan is then made next to it (its share's outside
    # bytes, ``step_budget.StepAccount.share_for``). Not stored: the step's measurement, not the graph's
    eager_step_bytes: int = 0

    def keeping_step_use(self, made_for: Optional["Correction"]) -> "Correction":
        """This correction for a graph whose plan was made under ``made_for`` (None: none): a correction made for
        another reason (the check's re-plan of a plan made for stacked runs or accumulated gradients) keeps them, and
        the eager loss's bytes measured where it measured none, and the step's eager bytes."""
        if made_for is None:
            return self
        return replace(self, runs=max(self.runs, made_for.runs),
                       accumulated_grad_bytes=max(self.accumulated_grad_bytes, made_for.accumulated_grad_bytes),
                       eager_step_bytes=max(self.eager_step_bytes, made_for.eager_step_bytes),
                       eager_loss_bytes=made_for.eager_loss_bytes if self.eager_loss_bytes is None
                       else self.eager_loss_bytes)

    def corrected_target(self, target_bytes: int) -> int:
        """The planning target once the simulator's error is known: ``target / factor``, floored,
        never above ``target_bytes`` unless the correction ``loosens``."""
        corrected = math.floor(Fraction(target_bytes) / Fraction(self.factor))   # exact: any budget
        return corrected if self.loosens else min(target_bytes, corrected)


def store_dir() -> Path:
    """Where corrections live: ``$REMAT_FEEDBACK_DIR``, else ``<remat cache dir>/feedback``."""
    explicit = os.environ.get(FEEDBACK_DIR_ENV_VAR)
    return Path(explicit) if explicit else cache_dir() / "feedback"


def _input_meta(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device.type}"
    return type(value).__name__


def graph_key(joint_code: str, joint_inputs: Sequence[object], options: RematOptions) -> str:
    """The store key of a joint graph planned under ``options`` (see the module docstring)."""
    plan_options = replace(options, budget_bytes=None, budget_is_auto=False, verify_peak=0)
    digest = hashlib.sha256()
    for part in (joint_code, ",".join(_input_meta(v) for v in joint_inputs), torch.__version__,
                 str(torch.get_num_threads()), plan_options.cache_key()):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:32]


def read_correction(key: str) -> Optional[Correction]:
    """The stored correction for ``key``, or None (none stored, or an unreadable file)."""
    path = store_dir() / f"{key}.json"
    try:
        data: Any = json.loads(path.read_text())
        if data.get("schema") != STORE_SCHEMA or not float(data["factor"]) >= 1.0:
            return None
        fields = {k: data[k] for k in ("factor", "budget_bytes", "predicted_peak_bytes", "measured_peak_bytes",
                                       "graph_id")}
        return Correction(**fields, source=f"stored: {path}", runs=max(int(data.get("runs", 1)), 1),
                          accumulated_grad_bytes=max(int(data.get("accumulated_grad_bytes", 0)), 0),
                          foreseen=bool(data.get("foreseen", False)),
                          eager_loss_bytes=None if data.get("eager_loss_bytes") is None
                          else max(int(data["eager_loss_bytes"]), 0))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_correction(key: str, correction: Correction) -> Optional[Path]:
    """Store ``correction`` under ``key``; the path written, or None if the store is not writable
    (the correction then lives only in this process's backend)."""
    path = store_dir() / f"{key}.json"
    payload = {"schema": STORE_SCHEMA, **asdict(correction), "units": "bytes; factor = measured / predicted peak"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps(payload, indent=1, sort_keys=True) + "\n")
    except OSError:
        return None
    return path


def clear_corrections() -> int:
    """Delete every stored correction; returns how many there were."""
    directory = store_dir()
    count = len(list(directory.glob("*.json"))) if directory.is_dir() else 0
    shutil.rmtree(directory, ignore_errors=True)
    return count
