"""Does the budget hold on models remat was never tuned on? Predicted vs measured peak over a corpus.

    PYTHONHASHSEED=0 python benchmarks/fidelity.py                      # the whole corpus -> results/
    python benchmarks/fidelity.py --only rand-1003 hf-t5                # some models
    python benchmarks/fidelity.py --limit 3 --seeds 1000-1002 --out /tmp/fid.jsonl
    python benchmarks/fidelity.py --report-only                         # rewrite the .md from the .jsonl

The corpus is ``remat.testing.corpus``: random nets for ``--seeds`` (default
``BENCHMARK_SEEDS``), CNNs with BatchNorm and pooling, tiny Hugging Face models (when
``transformers`` is importable), and CNNs and Hugging Face configurations drawn from
``--cnn-seeds`` and ``--hf-seeds`` (``cnn-<seed>``, ``hf-<seed>``; none by default). Each model runs in its own worker process (``PYTHONHASHSEED``
inherited, a fresh ``torch._dynamo.reset()`` before every compile), and every variant below is
built fresh from the entry's seed (same parameters and inputs) and run for three steps, each
``torch.manual_seed(STEP_SEED)``, gradients set to None before it, the loss and backward inside:

- ``plain``: ``torch.compile(backend="inductor")``. Its step-3 measured peak is "plain's peak",
  the base of the budgets; its step-1 gradients are the reference.
- ``probe``: remat at a 1 kB budget, which no plan meets: the ``BudgetInfeasibleError`` names
  the floor, the smallest budget remat accepts (``min_budget_bytes`` when the error has it,
  else ``min_feasible_bytes``). A single graph is only traced and planned, no code generated; a
  step split at graph breaks runs two steps (it refuses at the second, once its graphs are known).
- ``none``, ``0.9``, ``0.7``, ``0.5``: ``remat.backend(budget_gb=...)`` at no budget and at
  those fractions of plain's peak (a fraction below the floor is recorded as infeasible, from
  the probe, without compiling; ``--fractions`` names others, ``--fractions none`` none), and with
  ``--floor-point``, ``floor``: at the floor itself, and
  ``floor-named``, where the floor was refused once its steps ran (the closed loop's refusal, naming a
  budget): at the budget that refusal named, as a user retrying would; with ``--floor-retries N``, up to N
  such retries (``floor-named-2`` at what ``floor-named``'s refusal named, ...), until one is accepted.
- ``checkpoint``: full per-block checkpointing (``entry.build(checkpoint_blocks=True)``, non-
  reentrant ``torch.utils.checkpoint``) under plain Inductor, for models with repeated blocks.

With ``--autocast bf16`` every variant runs its forward and loss under
``torch.autocast("cpu", dtype=torch.bfloat16)`` (the backward outside it, as mixed-precision training
does), and one more variant runs first: ``plain-fp32``, plain Inductor without autocast, whose step-1
gradients are the reference for the accuracy of every bf16 variant. In bf16 no two compiled
variants agree to 1e-4 (eager and plain Inductor do not: they round different intermediates), so
each point also records its gradient error against the fp32 reference (``grad_rel_err_fp32``, the
largest per parameter; ``grad_global_err_fp32``, over all parameters at once), which the report puts next
to plain Inductor's own under autocast.

With ``--freeze bottom-half``, ``matrices`` or ``lora`` every variant fine-tunes as that regime of
``remat.testing.finetune`` says (the leading half of the parameters frozen; every weight matrix, convolution
kernel and embedding frozen; or everything frozen and every ``nn.Linear`` given a rank-4 adapter), and
gradients are compared over the parameters that train.

With ``--user-checkpointing`` every variant's model checkpoints its own blocks (``entry.build(
checkpoint_blocks=True)``, as a user who already runs ``torch.utils.checkpoint`` or Hugging Face's
``gradient_checkpointing_enable()`` and adds remat): models without repeated blocks are left out, ``plain``
is plain Inductor on that model, and there is no separate ``checkpoint`` point. With ``--profile-first-step``
step 1 is measured inside ``remat.measure_peak_bytes``'s profiler even where the closed loop measures it, as a
user checking the budget with ``docs/design.md``'s method would: remat compiles inside that profiler (since
session 49 its loop measures the step there too, ``remat/measure_host.py``). With ``--profile-every-step`` every
step is, the second included (``measured_second_bytes``), as a user checking each step would: until session 49 the
loop then measured no step at all.

With ``--runs-per-step N`` every variant's step calls the model ``N`` times and sums the losses before the
backward (a model run on two views of a batch): the runs stack, each keeping what it holds for its backward
while the next runs. Nothing tells a compile that its graph will run again, so step 1 is the one that
discovers it (remat's loop measures the runs as one window and re-plans the graph for them,
``remat/feedback.py``); the probe's floor is one run's.

With ``--micro-batches N`` every variant's step accumulates gradients over ``N`` forward and backward passes
(gradient accumulation; the same inputs each time), its gradients set to None once, before the first: from the
second pass on, the parameters hold the gradients of the earlier ones, part of the step's peak. Step 1 is the
one that discovers it (remat's loop finds them at the second pass's entry, re-plans next to them before it runs
where its plan would run over next to them, and measures that pass too: ``remat/accumulated_grads.py``); the probe's
floor is one pass's. Where step 1 is measured inside a profiler (``--profile-first-step``, a step split at graph
breaks), the loop cannot measure it, and the discovery moves to step 2: every variant then runs four steps, the
fourth measured ("step 3" in the table).

With ``--channels-last`` every variant's model and 4-D inputs are in the channels-last memory format
(``remat.testing.corpus.to_channels_last``), as PyTorch's performance guide has CNN users train; a model with
no 4-D tensor (the language models) runs as without it.

With ``--model-dtype bf16`` every variant's model and floating inputs are in bfloat16 throughout (a pure
bfloat16 model, no autocast: ``remat.testing.corpus.to_dtype``), and, as under ``--autocast``, a ``plain-fp32``
variant runs first (plain Inductor on the float32 model) whose gradients are the reference for each point's
accuracy.

With ``--eager-cross-entropy`` every variant's loss is a cross-entropy computed outside the compiled model, on
its output taken as class logits (``remat.testing.corpus.to_eager_cross_entropy``; a Hugging Face model's
``logits`` against its labels, the model no longer computing its loss), as most training loops write
``F.cross_entropy(model(x), y)`` next to a compiled model: eager memory in the step that no graph's plan sees.

With ``--break-seeds`` the corpus adds random nets with graph breaks (``rand-brk-<seed>``: the net ``rand-<seed>``
with breaks drawn by ``remat.testing.random_nets.with_graph_breaks``: in the model's own forward, or inside blocks
called from a loop, so the model's own forward runs eagerly; nothing, a finiteness check or an eager autograd
function at each break): steps of several graphs, with eager code between them.

With ``--hf-vocab N`` the drawn Hugging Face language models (``hf-<seed>``) have an ``N``-token vocabulary
(``remat.testing.hf_models.hf_spec``; the default 512 keeps the logits small): at a real model's 32,000-50,257 the
logits, the loss and their gradients are the step's largest tensors, and a GPT-2 split before its loss is dominated
by its loss graph.

Per remat point: the plans' predicted step peak (one graph: its ``predicted_peak_bytes``; several,
in compile (= forward) order, composed as remat composes a step split at graph breaks:
``max_k(held by graphs before k + k's activation inputs + later graphs' gradients + peak of k)``,
``predicted_step_peak``; and remat's own prediction of such a step, ``step_predicted_bytes``: the
same composition next to what the step's eager code was measured to hold, which the report takes as
the accepted prediction where a row has it),
the measured peak of step 1 (the compiling step, measured around the call) and of step 3
(``remat.measure_peak_bytes``), measured / budget, and the largest relative gradient error of
steps 1 and 3 against plain's (``benchmarks/common.max_relative_grad_error``). When
``remat.backend`` takes ``verify_peak`` (the closed loop on the measured peak), it is passed
``verify_peak=1``, step 1 is not wrapped in a second profiler (its peak is the loop's own
measurement), except where the loop did not measure step 1 at no budget (a step split at graph breaks:
its graphs are known only once step 1 ends, and until session 33 such points had no step-1 figure), and
``backend.feedback_events`` is recorded; every point starts from empty remat
caches (``$REMAT_CACHE_DIR``: no probe results, plans or corrections of an earlier point), as a
first run does (``fresh_caches``). Writes one JSON line per point as it goes (a model with a ``done`` line is skipped
on a rerun), then ``benchmarks/results/fidelity-cpu.md`` (``fidelity_report.py``). Units: bytes
in the JSON, MB (1e6 bytes) in the tables; 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = RESULTS / "fidelity-cpu.jsonl"
FRACTIONS = (0.9, 0.7, 0.5)
PROBE_BUDGET_GB = 1e-6          # 1 kB: below any model's floor
STEP_SEED = 1234
DTYPES = {"bf16": torch.bfloat16}     # the names --autocast and --model-dtype take
WORKER_TIMEOUT_S = 3600
# The environment of the committed run of 9da0372, whose header predates "environment" (run from a
# `git archive` snapshot of that commit in /tmp/snap).
RUN_ENVIRONMENT_BEFORE_IT_WAS_RECORDED = {"REMAT_SOURCE_COMMIT": "9da0372", "TORCHINDUCTOR_COMPILE_THREADS": "1",
                                          "PYTHONHASHSEED": "0", "PYTHONPATH": "/tmp/snap"}
ENV_RECORDED = ("PYTHONHASHSEED", "TORCHINDUCTOR_COMPILE_THREADS", "REMAT_SOURCE_COMMIT", "PYTHONPATH", "OMP_NUM_THREADS")

import remat  # noqa: E402
from common import global_relative_grad_error, grads_of, machine_info, max_relative_grad_error, source_info  # noqa: E402  (run as a script: benchmarks/ is sys.path[0])
from remat.testing import corpus as corpus_mod, finetune, hf_models  # noqa: E402


# ---- one variant ---------------------------------------------------------------------------------


def loop_supported() -> bool:
    """Whether this remat has the closed loop on the measured peak (``remat.backend(verify_peak=...)``)."""
    return "verify_peak" in inspect.signature(remat.backend).parameters


def make_backend(budget_gb: Optional[float]) -> remat.RematBackend:
    if loop_supported():
        return remat.backend(budget_gb, verify_peak=1)
    return remat.backend(budget_gb)


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def predicted_step_peak(peaks: list[int], saved: list[int], inputs: Optional[list[int]] = None,
                        grads: Optional[list[int]] = None) -> Optional[int]:
    """The step's predicted peak from its graphs' peaks, saved bytes, activation inputs and parameter
    gradients, in compile (= forward) order, composed as remat composes a step split at graph breaks
    (``remat.step_budget.composed_peak_bytes``: while graph k runs, the graphs before it hold their saved
    values and activation inputs, its own inputs are live, and the later graphs' gradients exist).
    Rows written before the records carried inputs and gradients count them 0. None for no graphs."""
    from remat.step_budget import composed_peak_bytes

    if not peaks:
        return None
    inputs, grads = inputs or [0] * len(peaks), grads or [0] * len(peaks)
    return composed_peak_bytes([(s + a, a, g, p) for p, s, a, g in zip(peaks, saved, inputs, grads)])


def base_graph_id(graph_id: str) -> str:
    """``graph_000_r2`` (the second re-plan of graph_000, remat's naming) -> ``graph_000``."""
    return graph_id.split("_r")[0]


def _plans_summary(backend: Any) -> dict[str, Any]:
    """The plans as accepted: the last record of each graph (a re-plan or a recompile of the same graph
    replaces its record), in the order the graphs were first compiled. ``checked``: Inductor's check of the plan, when this
    remat has one (``CompiledGraph.judgement``); ``accepted``: the checked peak where there is one,
    else the simulated one."""
    latest: dict[str, Any] = {}
    for record in getattr(backend, "compiled_graphs", []):
        # a recompile of the same graph (same feedback-store key: its code and inputs) is not another
        # graph of the step: Dynamo compiled Hugging Face ViT twice, and summing both put its predicted
        # step peak at 1.9x its measured one
        latest[getattr(record, "graph_key", "") or base_graph_id(record.graph_id)] = record
    records = list(latest.values())
    plans = [g.plan for g in records]
    judgements = [getattr(g, "judgement", None) for g in records]
    checked = [getattr(j, "checked_peak_bytes", None) for j in judgements]
    accepted = [c if c is not None else p.predicted_peak_bytes for c, p in zip(checked, plans)]
    saved = [p.saved_bytes for p in plans]
    inputs = [getattr(g, "input_activation_bytes", 0) for g in records]
    grads = [getattr(g, "param_grad_bytes", 0) for g in records]
    step_predicted = getattr(backend, "predicted_step_peak_bytes", None)
    return {
        "graphs": [g.graph_id for g in records],
        # remat's own prediction of a step of several graphs: the running plans composed next to the eager memory
        # its steps measured (RematBackend.predicted_step_peak_bytes); None for one graph, or a remat without it
        "step_predicted_bytes": step_predicted() if callable(step_predicted) else None,
        "records": len(getattr(backend, "compiled_graphs", [])),
        "predicted_peak_bytes": predicted_step_peak([p.predicted_peak_bytes for p in plans], saved, inputs, grads),
        "accepted_peak_bytes": predicted_step_peak(accepted, saved, inputs, grads),
        "graph_predicted_peak_bytes": [p.predicted_peak_bytes for p in plans],
        "graph_checked_peak_bytes": checked,
        "judgement": [getattr(j, "action", None) for j in judgements],
        "graph_saved_bytes": saved,
        "graph_input_activation_bytes": inputs,
        "graph_param_grad_bytes": grads,
        "no_remat_peak_bytes": [p.no_remat_peak_bytes for p in plans],
        "peak_step": [p.peak_step_name for p in plans],
        "fits_budget": [p.fits_budget for p in plans],
        "code_generation": [getattr(g, "code_generation", "default") for g in records],
    }


LOOP_ACTED = ("re-planned", "over budget", "stored for the next compile", "re-plan failed", "infeasible")


def loop_summary(backend: Any) -> dict[str, Any]:
    """What ``backend``'s closed loop measured and did: step 1's measured peak (the largest of the graphs'
    first measured calls) and how many of its events acted on an overshoot; nothing for a backend that is
    not remat's."""
    if not isinstance(backend, remat.RematBackend):
        return {}
    events = list(getattr(backend, "feedback_events", []) or [])
    first = [e.measured_peak_bytes for e in events if getattr(e, "step", None) == 0 and e.measured_peak_bytes is not None]
    acted = [e for e in events if str(getattr(e, "action", "")).startswith(LOOP_ACTED)]
    return {"loop_first_step_bytes": max(first) if first else None, "loop_events": len(acted),
            "feedback_events": events}


def fresh_caches() -> None:
    """Point remat's caches (``$REMAT_CACHE_DIR``: the library-scratch probes, the compile and plan
    caches, the closed loop's corrections) at a new empty directory, keeping only a measured hardware
    profile if the current one holds one (the time model stays the same): every point compiles as a
    first run does, its probes measured while it compiles (inside the first step, which they count in:
    with their results cached by an earlier point, the first step of each later point measured less than
    a first run's), untouched by corrections an earlier point or run stored."""
    import shutil
    import tempfile

    from remat.cost_model.hardware import cache_dir

    fresh = Path(tempfile.mkdtemp(prefix="remat-fidelity-cache-"))
    for profile in cache_dir().glob("profile_v*.json"):
        shutil.copy(profile, fresh / profile.name)
    os.environ["REMAT_CACHE_DIR"] = str(fresh)
    os.environ.pop("REMAT_FEEDBACK_DIR", None)      # the corrections under the new directory: none


def autocast_to(dtype: Optional[torch.dtype]) -> Any:
    """CPU autocast to ``dtype`` for a step's forward and loss; with None, a context that changes nothing."""
    return torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)


def step_loss(built: Any, compiled: Any, runs: int) -> torch.Tensor:
    """The step's loss: ``built.loss`` of ``runs`` calls of ``compiled``, summed (every call's forward runs
    before any backward: their runs stack, as a model called on two views of a batch does)."""
    loss = built.loss(compiled)
    for _ in range(runs - 1):
        loss = loss + built.loss(compiled)
    return loss


def run_variant(entry: corpus_mod.CorpusEntry, backend: Any, *, checkpoint_blocks: bool = False,
                measure_first: bool = True, autocast_dtype: Optional[torch.dtype] = None,
                freeze: Optional[str] = None, runs: int = 1, micro_batches: int = 1,
                channels_last: bool = False, model_dtype: Optional[torch.dtype] = None,
                eager_cross_entropy: bool = False, measure_all: bool = False) -> dict[str, Any]:
    """Compile a fresh copy of ``entry`` with ``backend`` and run three steps, the forward and loss under
    CPU autocast to ``autocast_dtype`` when given, the parameters ``freeze`` names frozen, the model called
    ``runs`` times per step (``step_loss``), the gradients accumulated over ``micro_batches`` forward and
    backward passes per step, in the channels-last memory format with ``channels_last``, model and inputs in
    ``model_dtype`` when given, the loss a cross-entropy outside the model with ``eager_cross_entropy``, every step
    inside ``remat.measure_peak_bytes`` with ``measure_all`` (step 2's peak then in ``measured_second_bytes``); see
    the module docstring."""
    fresh_caches()
    torch._dynamo.reset()
    built = entry.build(checkpoint_blocks, freeze, channels_last, model_dtype, eager_cross_entropy)
    compiled = torch.compile(built.model, backend=backend)

    def prepare() -> None:
        built.model.zero_grad(set_to_none=True)
        torch.manual_seed(STEP_SEED)

    def step() -> float:
        total = 0.0
        for _ in range(micro_batches):
            with autocast_to(autocast_dtype):
                loss = step_loss(built, compiled, runs)
            loss.backward()
            total += float(loss.detach())
            del loss
        return total

    record: dict[str, Any] = {}
    prepare()
    if measure_first:
        first = remat.measure_peak_bytes(step, "cpu")
        record["measured_first_bytes"], loss = first.peak_bytes, first.result
    else:
        record["measured_first_bytes"], loss = None, step()
    record["plans_first"] = _plans_summary(backend) if isinstance(backend, remat.RematBackend) else None
    grads_first = grads_of(built.model)
    for _ in range(2 if micro_batches > 1 else 1):   # accumulation found in a profiled step 1: found in step 2
        prepare()
        if measure_all:
            record["measured_second_bytes"] = remat.measure_peak_bytes(step, "cpu").peak_bytes
        else:
            step()
    prepare()
    later = remat.measure_peak_bytes(step, "cpu")
    record.update(measured_later_bytes=later.peak_bytes, loss_first=loss, loss_later=later.result,
                  grads_first=grads_first, grads_later=grads_of(built.model))
    return record


# ---- one model -----------------------------------------------------------------------------------


class ModelRun:
    """Every point of one corpus model, each written as a JSON line the moment it is known."""

    def __init__(self, entry: corpus_mod.CorpusEntry, out: Path, autocast_dtype: Optional[torch.dtype] = None,
                 freeze: Optional[str] = None, user_checkpointing: bool = False, profile_first_step: bool = False,
                 runs_per_step: int = 1, micro_batches: int = 1, channels_last: bool = False,
                 model_dtype: Optional[torch.dtype] = None, eager_cross_entropy: bool = False,
                 profile_every_step: bool = False) -> None:
        self.entry, self.out, self.autocast_dtype, self.freeze = entry, out, autocast_dtype, freeze
        self.runs_per_step = runs_per_step      # calls of the model per step, before any backward (step_loss)
        self.micro_batches = micro_batches      # forward and backward passes per step, gradients accumulated
        self.channels_last = channels_last      # model and 4-D inputs in the channels-last memory format
        self.model_dtype = model_dtype          # model and floating inputs in this dtype (None: as built, float32)
        self.eager_cross_entropy = eager_cross_entropy   # the loss a cross-entropy outside the compiled model
        # the model checkpoints its own blocks in every variant; step 1 runs inside a profiler even with the loop on
        self.user_checkpointing, self.profile_first_step = user_checkpointing, profile_first_step or profile_every_step
        self.profile_every_step = profile_every_step     # every step inside a profiler (a user checking each one)
        self.reference: Optional[dict[str, torch.Tensor]] = None        # plain Inductor's step-1 gradients
        self.fp32_reference: Optional[dict[str, torch.Tensor]] = None   # plain-fp32's, under --autocast
        self.plain_peak: Optional[int] = None

    def write(self, point: str, **fields: Any) -> dict[str, Any]:
        row = {"model": self.entry.name, "family": self.entry.family, "point": point, **fields}
        with open(self.out, "a") as f:
            f.write(json.dumps(_jsonable(row)) + "\n")
        return row

    def _grad_error(self, record: dict[str, Any]) -> dict[str, Any]:
        """The largest gradient error of steps 1 and 3 against plain Inductor's (none before plain ran: the
        plain-fp32 reference) and, under autocast, against the plain-fp32 reference."""
        fields: dict[str, Any] = {}
        for reference, suffix in ((self.reference, ""), (self.fp32_reference, "_fp32")):
            if reference is None:
                continue
            errors = [max_relative_grad_error(record[k], reference) for k in ("grads_first", "grads_later")]
            worst = max(errors, key=lambda e: (e[0] != e[0], e[0]))   # NaN counts as the worst
            fields.update({f"grad_rel_err{suffix}": worst[0], f"grad_worst_param{suffix}": worst[1]})
        if self.fp32_reference is not None:
            fields["grad_global_err_fp32"] = max(global_relative_grad_error(record[k], self.fp32_reference)
                                                 for k in ("grads_first", "grads_later"))
        return fields

    def measure(self, point: str, backend: Any, budget_bytes: Optional[int], **kwargs: Any) -> dict[str, Any]:
        start = time.perf_counter()
        kwargs.setdefault("autocast_dtype", self.autocast_dtype)
        kwargs.setdefault("freeze", self.freeze)
        kwargs.setdefault("checkpoint_blocks", self.user_checkpointing)
        kwargs.setdefault("runs", self.runs_per_step)
        kwargs.setdefault("micro_batches", self.micro_batches)
        kwargs.setdefault("channels_last", self.channels_last)
        kwargs.setdefault("model_dtype", self.model_dtype)
        kwargs.setdefault("eager_cross_entropy", self.eager_cross_entropy)
        kwargs.setdefault("measure_all", self.profile_every_step)
        try:
            record = run_variant(self.entry, backend, **kwargs)
        except remat.BudgetInfeasibleError as error:
            # a refusal after a measured step (the loop's) keeps what that step measured
            return self.write(point, budget_bytes=budget_bytes, error=f"infeasible: {str(error)[:600]}",
                              min_budget_bytes=getattr(error, "min_budget_bytes", None),
                              min_feasible_bytes=error.min_feasible_bytes, **loop_summary(backend))
        except Exception as error:  # noqa: BLE001 - a failing point is recorded, the others go on
            return self.write(point, budget_bytes=budget_bytes, error=f"failed: {type(error).__name__}: {str(error)[:600]}",
                              traceback=traceback.format_exc()[-2000:])
        if point == "plain-fp32":
            self.fp32_reference = record["grads_first"]
        if point == "plain":
            self.reference = record["grads_first"]
        fields = {k: v for k, v in record.items() if not k.startswith("grads_")}
        fields.update(self._grad_error(record))
        if isinstance(backend, remat.RematBackend):
            fields.update(plans_final=_plans_summary(backend), **loop_summary(backend))
            if fields.get("measured_first_bytes") is None:
                fields["measured_first_bytes"] = fields["loop_first_step_bytes"]
        return self.write(point, budget_bytes=budget_bytes, seconds=round(time.perf_counter() - start, 1), **fields)

    def probe_floor(self) -> Optional[int]:
        """The smallest budget remat accepts, from the error a 1 kB budget raises (None if it did not raise).
        Two steps: a step split at graph breaks refuses the budget at its second (``remat/step_budget.py``)."""
        fresh_caches()
        torch._dynamo.reset()
        built = self.entry.build(self.user_checkpointing, self.freeze, self.channels_last, self.model_dtype,
                                 self.eager_cross_entropy)
        compiled = torch.compile(built.model, backend=remat.backend(PROBE_BUDGET_GB))
        try:
            for _ in range(2):
                built.model.zero_grad(set_to_none=True)
                with autocast_to(self.autocast_dtype):
                    loss = step_loss(built, compiled, self.runs_per_step)
                loss.backward()
        except remat.BudgetInfeasibleError as error:
            named = getattr(error, "min_budget_bytes", None)
            floor = int(named if named is not None else error.min_feasible_bytes)
            self.write("probe", floor_bytes=floor, min_budget_bytes=named, min_feasible_bytes=error.min_feasible_bytes,
                       reasons=list(error.reasons))
            return floor
        except Exception as error:  # noqa: BLE001
            self.write("probe", error=f"failed: {type(error).__name__}: {str(error)[:600]}")
            return None
        self.write("probe", error="a 1 kB budget was accepted")
        return None

    def run(self, fractions: tuple[float, ...], floor_point: bool, retries: int = 1) -> None:
        loop = loop_supported()
        measure_first = not loop or self.profile_first_step
        if self.autocast_dtype is not None or self.model_dtype is not None:
            reference = self.measure("plain-fp32", "inductor", None, autocast_dtype=None, model_dtype=None)
            if reference.get("error"):
                self.write("done", error="plain Inductor in float32 without autocast failed")
                return
        plain = self.measure("plain", "inductor", None)
        if plain.get("error"):
            self.write("done", error="plain Inductor failed")
            return
        self.plain_peak = plain["measured_later_bytes"]
        floor = self.probe_floor()
        # (until session 44, a step split at graph breaks had its budgeted points' step 1 measured inside a profiler,
        # which kept the loop from measuring it: since then the loop measures such a step whole, as a user's runs)
        self.measure("none", make_backend(None), None, measure_first=True)
        for fraction in fractions:
            budget = int(fraction * self.plain_peak)
            if floor is not None and budget < floor:
                self.write(f"{fraction:g}", budget_bytes=budget, error="infeasible: below the probe's floor", floor_bytes=floor)
                continue
            self.measure(f"{fraction:g}", make_backend(budget / 1e9), budget, measure_first=measure_first)
        if floor_point and floor is not None:
            from fidelity_report import RETRY_POINTS

            row, budget = self.measure("floor", make_backend(floor / 1e9), floor, measure_first=measure_first), floor
            for point in RETRY_POINTS[:retries]:
                named = row.get("min_budget_bytes")
                if not (str(row.get("error", "")).startswith("infeasible") and named and named > budget):
                    break
                # refused once its steps ran (the probe cannot see what only a run shows, e.g. runs that stack, or a
                # step's later graphs): the budget that refusal named, as a user retrying would
                row, budget = self.measure(point, make_backend(named / 1e9), named, measure_first=measure_first), named
        if self.entry.has_repeated_blocks and not self.user_checkpointing:   # (plain is checkpointed already)
            self.measure("checkpoint", "inductor", None, checkpoint_blocks=True)
        self.write("done", plain_peak_bytes=self.plain_peak, floor_bytes=floor, loop_supported=loop,
                   description=self.entry.description, seed=self.entry.seed,
                   autocast=str(self.autocast_dtype) if self.autocast_dtype is not None else None, freeze=self.freeze,
                   user_checkpointing=self.user_checkpointing, profile_first_step=self.profile_first_step,
                   runs_per_step=self.runs_per_step, micro_batches=self.micro_batches, channels_last=self.channels_last,
                   model_dtype=str(self.model_dtype) if self.model_dtype is not None else None,
                   eager_cross_entropy=self.eager_cross_entropy)


# ---- the driver ----------------------------------------------------------------------------------


def parse_fractions(text: str) -> tuple[float, ...]:
    """``0.9,0.7`` -> (0.9, 0.7); ``none`` -> (): each in (0, 1]."""
    if text.strip().lower() == "none":
        return ()
    fractions = tuple(float(part) for part in text.split(",") if part.strip())
    if not fractions or any(not 0 < f <= 1 for f in fractions):
        raise argparse.ArgumentTypeError(f"--fractions {text!r}: give fractions in (0, 1] separated by commas, or 'none'")
    return fractions


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"1000-1031"`` or ``"3,5,9"`` (or both, comma separated) -> the seeds."""
    seeds: list[int] = []
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        seeds += range(int(low), int(high or low) + 1)
    return tuple(seeds)


def done_models(out: Path, *, retry_dead: bool = False) -> set[str]:
    """The models with a ``done`` line; with ``retry_dead``, not those whose worker died (run them again)."""
    if not out.exists():
        return set()
    return {row["model"] for row in map(json.loads, out.read_text().splitlines()) if row["point"] == "done"
            and not (retry_dead and str(row.get("error", "")).startswith("worker "))}


def drop_unfinished(out: Path, finished: set[str]) -> None:
    """Remove the lines of models a killed run left half done (they are run again from the start)."""
    if out.exists():
        lines = [line for line in out.read_text().splitlines() if json.loads(line)["model"] in finished
                 or json.loads(line)["model"] == "_run"]
        out.write_text("".join(line + "\n" for line in lines))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=parse_seeds, default=corpus_mod.BENCHMARK_SEEDS, help="random-net seeds, e.g. 1000-1031")
    parser.add_argument("--cnn-seeds", type=parse_seeds, default=(), help="CNNs drawn from these seeds (cnn-<seed>)")
    parser.add_argument("--hf-seeds", type=parse_seeds, default=(), help="Hugging Face configurations drawn from these seeds (hf-<seed>)")
    parser.add_argument("--break-seeds", type=parse_seeds, default=(),
                        help="random nets with graph breaks drawn from these seeds (rand-brk-<seed>)")
    parser.add_argument("--only", nargs="*", default=None, help="run only these corpus names")
    parser.add_argument("--limit", type=int, default=None, help="run at most this many models")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--md", type=Path, default=None, help="the table (default: the .jsonl's name with .md)")
    parser.add_argument("--floor-point", action="store_true", help="also compile and measure at the floor itself")
    parser.add_argument("--floor-retries", type=int, default=1, choices=range(1, 6),
                        help="with --floor-point: retries at the budget each refusal names, until one is accepted")
    parser.add_argument("--fractions", type=parse_fractions, default=FRACTIONS,
                        help="budgets as fractions of plain's peak, e.g. 0.9,0.7 (default 0.9,0.7,0.5); 'none': "
                             "no fraction (with --floor-point: plain, no budget, the floor and checkpointing)")
    parser.add_argument("--jobs", type=int, default=1, help="models run at once (each in its own worker process)")
    parser.add_argument("--autocast", choices=sorted(DTYPES), default=None,
                        help="run every variant's forward under CPU autocast to this dtype (plus a plain-fp32 reference)")
    parser.add_argument("--freeze", choices=finetune.FREEZE_REGIMES, default=None,
                        help="fine-tune every variant so (remat.testing.finetune.freeze_parameters)")
    parser.add_argument("--user-checkpointing", action="store_true",
                        help="every variant's model checkpoints its own blocks (models without repeated blocks are left out)")
    parser.add_argument("--profile-first-step", action="store_true",
                        help="measure step 1 inside a profiler even where the closed loop measures it (as a user checking it would)")
    parser.add_argument("--profile-every-step", action="store_true",
                        help="measure every step inside a profiler, the unmeasured second included (a user checking each step)")
    parser.add_argument("--runs-per-step", type=int, default=1,
                        help="call the model this many times per step before the backward (their runs stack)")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="accumulate gradients over this many forward and backward passes per step")
    parser.add_argument("--channels-last", action="store_true",
                        help="every variant's model and 4-D inputs in the channels-last memory format (CNN training)")
    parser.add_argument("--model-dtype", choices=sorted(DTYPES), default=None,
                        help="every variant's model and floating inputs in this dtype, no autocast (plus a plain-fp32 reference)")
    parser.add_argument("--eager-cross-entropy", action="store_true",
                        help="every variant's loss a cross-entropy outside the compiled model, on its output as logits")
    parser.add_argument("--hf-vocab", type=int, default=hf_models.VOCAB,
                        help=f"the drawn Hugging Face language models' vocabulary (default {hf_models.VOCAB}; real "
                             "models' 32,000-50,257 make the logits and the loss the step's largest tensors)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--retry-dead", action="store_true", help="run again the models whose worker died in an earlier run")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    entries = corpus_mod.entries(args.seeds, cnn_seeds=args.cnn_seeds, hf_seeds=args.hf_seeds, hf_vocab=args.hf_vocab,
                                 break_seeds=args.break_seeds)
    md = args.md or args.out.with_suffix(".md")
    if args.worker is not None:
        entry = next(e for e in entries if e.name == args.worker)
        ModelRun(entry, args.out, DTYPES.get(args.autocast), args.freeze, args.user_checkpointing,
                 args.profile_first_step, args.runs_per_step, args.micro_batches, args.channels_last,
                 DTYPES.get(args.model_dtype), args.eager_cross_entropy, args.profile_every_step).run(
                     args.fractions, args.floor_point, args.floor_retries)
        return 0
    if not args.report_only:
        run_all(args, entries)
    from fidelity_report import write_report

    write_report(args.out, md, {"seeds": list(args.seeds), "cnn_seeds": list(args.cnn_seeds),
                                "hf_seeds": list(args.hf_seeds), "break_seeds": list(args.break_seeds), "hf_skip_reason": corpus_mod.hf_skip_reason(),
                                "environment": RUN_ENVIRONMENT_BEFORE_IT_WAS_RECORDED})
    print(f"wrote {md}")
    return 0


def run_all(args: argparse.Namespace, entries: list[corpus_mod.CorpusEntry]) -> None:
    """Each model in its own worker process (``--jobs`` at a time); models finished in an earlier run are skipped."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = [e for e in entries if (args.only is None or e.name in args.only)
              and (e.has_repeated_blocks or not args.user_checkpointing)][: args.limit]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    finished = done_models(args.out, retry_dead=args.retry_dead)
    drop_unfinished(args.out, finished)
    # every invocation records its own source: a resumed run may run later code than the rows before it
    if chosen and any(e.name not in finished for e in chosen):
        _append(args.out, {"model": "_run", "family": "", "point": "done", "source": source_info(),
                           "machine": machine_info(torch.device("cpu")), "loop_supported": loop_supported(),
                           "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                           "autocast": args.autocast, "freeze": args.freeze,
                           "user_checkpointing": args.user_checkpointing, "profile_first_step": args.profile_first_step,
                           "profile_every_step": args.profile_every_step,
                           "runs_per_step": args.runs_per_step, "micro_batches": args.micro_batches,
                           "channels_last": args.channels_last, "fractions": list(args.fractions),
                           "model_dtype": args.model_dtype, "eager_cross_entropy": args.eager_cross_entropy,
                           "hf_vocab": args.hf_vocab,
                           "environment": {k: os.environ.get(k) for k in ENV_RECORDED if k in os.environ}})
    todo = interleave_families([e for e in chosen if e.name not in finished])
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        list(pool.map(lambda entry: _run_worker(args, entry), todo))


def interleave_families(entries: list[corpus_mod.CorpusEntry]) -> list[corpus_mod.CorpusEntry]:
    """Round robin over the families (random, cnn, hf), so a run cut short has some of each."""
    by_family: dict[str, list[corpus_mod.CorpusEntry]] = {}
    for entry in entries:
        by_family.setdefault(entry.family, []).append(entry)
    queues = list(by_family.values())
    order: list[corpus_mod.CorpusEntry] = []
    while any(queues):
        order += [q.pop(0) for q in queues if q]
    return order


def _append(out: Path, row: dict[str, Any]) -> None:
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")


def _run_worker(args: argparse.Namespace, entry: corpus_mod.CorpusEntry) -> None:
    """One model in a worker process; a worker that dies (a crash in compiled code, a timeout) leaves
    a ``done`` line saying so, with its exit status (-11: SIGSEGV), and Python's fault handler prints
    where it crashed to this process's stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {entry.name}: {entry.description}", flush=True)
    command = [sys.executable, "-X", "faulthandler", __file__, "--worker", entry.name, "--out", str(args.out),
               "--seeds", ",".join(map(str, args.seeds)), "--cnn-seeds", ",".join(map(str, args.cnn_seeds)),
               "--hf-seeds", ",".join(map(str, args.hf_seeds)), "--hf-vocab", str(args.hf_vocab),
               "--break-seeds", ",".join(map(str, args.break_seeds))] \
        + (["--floor-point", "--floor-retries", str(args.floor_retries)] if args.floor_point else []) \
        + ["--fractions", ",".join(map(str, args.fractions)) or "none"] \
        + (["--autocast", args.autocast] if args.autocast else []) + (["--freeze", args.freeze] if args.freeze else []) \
        + (["--user-checkpointing"] if args.user_checkpointing else []) + (["--profile-first-step"] if args.profile_first_step else []) \
        + ["--runs-per-step", str(args.runs_per_step), "--micro-batches", str(args.micro_batches)] \
        + (["--channels-last"] if args.channels_last else []) + (["--model-dtype", args.model_dtype] if args.model_dtype else []) \
        + (["--eager-cross-entropy"] if args.eager_cross_entropy else []) \
        + (["--profile-every-step"] if args.profile_every_step else [])
    try:
        status: Any = subprocess.run(command, timeout=WORKER_TIMEOUT_S, check=False).returncode
    except subprocess.TimeoutExpired:
        status = f"timed out after {WORKER_TIMEOUT_S} s"
    if entry.name not in done_models(args.out):   # the worker died without its done line
        _append(args.out, {"model": entry.name, "family": entry.family, "point": "done",
                           "error": f"worker exited without finishing (status {status})"})
    print(f"[{time.strftime('%H:%M:%S')}] {entry.name} done (status {status})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
