"""The backend's side of the compile cache: plans re-used by graph, and AOTAutograd's cache on.

Two things, both stored by ``remat/plan_cache.py`` (``$REMAT_CACHE_DIR/compile``, atomic writes,
``REMAT_COMPILE_CACHE=0`` turns both off, ``python -m remat.caches clear`` empties them):

- ``CachedPlanner``: the partitioner asks for each plan (each target, cap and best effort a
  search tries) by ``plan_cache.plan_key``; a stored answer (a plan or a refusal) is re-used
  without solving. Everything after the solve (the forward/backward split, the recompute
  regions, the dump) runs as for a fresh plan, so the record and the dump are the same.
- ``CallCache``: AOTAutograd's cache of whole compiles. A hit skips the partitioner, so what the
  partitioner would have left behind is stored with each compile it did run, keyed by what the
  backend is handed (``graph_identity``: Dynamo's graph code, its inputs' shapes, strides, dtypes,
  devices and ``requires_grad``, grad mode; and the partitioner's ``uuid``), and restored on a hit: the
  ``CompiledGraph`` record (with this compile's graph id, compile id and dump path, and
  ``cache="autograd-cache hit: ..."``), the dump's files (the stored graph id replaced by the new
  one where they differ) and the plan's numbers on the step's account. A hit with no stored record
  (remat's cache cleared, Inductor's not) is compiled again with AOTAutograd's cache off.

``partitioner_uuid`` is what AOTAutograd's key sees of remat: the options with the budget and the
headroom, the hardware profile, remat's source, the thread count, the feedback corrections stored
on disk and held by the backend, whether a dump is written and with how many Pareto points.
AOTAutograd's cache is used only where that covers every input of the plan (``call_cacheable``):
not under torch.distributed (a piece's share depends on the other pieces' plans), not with symbolic
shapes, and for a graph that shares its step's budget with other graphs (graph breaks) only when its
share is known before AOTAutograd traces it: a step an earlier process settled (``step_memory``) gives
the share (``StepHooks.key_at_compile``), or, for a re-plan under its share of the known step, the
step's account does (``StepHooks.key_at_replan``). The compile is then keyed by a ``StepKey`` (the
share, the graph's position, the graphs before it: what they are and hold), which joins the uuid;
the partitioner plans at that share or raises ``KeyedShareMismatch`` before planning (``compile_cached``
then compiles again, unkeyed, with the cache off, and stores nothing), so an entry is only ever
stored with a plan made at its key's share. A cold process's re-plans are stored under the key the next
process computes for the same graph, share and earlier graphs, so its graphs hit.
With ``inductor_check`` the record stored is the judged one (its verdict in the record and the dump);
a plan the check replaced is not restored (AOTAutograd cached the replaced plan's code): a hit on it
compiles again without the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from . import plan_cache
from .cost_model.hardware import get_profile
from .cost_model.tensors import has_symbolic_shapes
from ._torch_inductor import inductor_config
from .errors import BudgetInfeasibleError
from .feedback_store import store_dir

if TYPE_CHECKING:
    from torch import fx

    from .compiled_graph import CompiledGraph
    from .distributed import GraphShare
    from .options import RematOptions
    from .passes.plan import Plan
    from .pipeline import PlanningRequest
    from .step_budget import StepAccount
    from .step_graph import StepGraph

_TEXT_SUFFIXES = (".py", ".json", ".md", ".txt", ".csv")


class CachedPlanner:
    """A graph's planner with its answers kept: ``planner(request)`` is ``solve(request)`` (a
    ``Plan``, or a ``BudgetInfeasibleError`` raised), read from the plan cache when this request
    was answered before for this graph, options and profile, in this process or an earlier one;
    else solved and stored. Refusals are kept too: a step's share search (graph breaks, DDP/FSDP2
    pieces) asks many targets, and a warm run asks the same ones again.

    The key (``plan_cache.plan_key``) covers the graph, the options, the profile, the request (its
    target, cap, best effort, headroom and feedback correction's factor), the device type, whether the
    simulator models the graph, the static-lifetime inputs, the Inductor settings the simulator reads
    (``_torch_inductor.inductor_config``, read when the planner is made, as the simulation reads them
    in the same partitioner call), what was measured of the graph on this machine (``measured``: its
    library calls' working memory, ``library_scratch.scratch_key``) and remat's source: everything a
    plan is a function of.

    Off (``enabled`` False: symbolic shapes, whose plan depends on the sizes it is planned at) or with
    the cache turned off (``REMAT_COMPILE_CACHE=0``): every request is solved once, and only this
    object remembers it. One object per partitioner call: no state outlives the graph it plans."""

    def __init__(self, graph_key: str, options: "RematOptions", profile: object, device_type: str, modeled: bool,
                 static_indices: object, solve: "Callable[[PlanningRequest], Plan]", enabled: bool = True,
                 measured: str = "") -> None:
        self._parts = (graph_key, options.cache_key(), repr(profile), device_type, modeled,
                       f"{static_indices!r};{inductor_config()!r};{measured}")
        self._solve, self._enabled = solve, enabled
        self._answers: dict[str, Any] = {}      # key -> Plan or ("refused", message, fields)
        self._sources: dict[int, str] = {}      # id(plan) -> the entry it was read from

    def __call__(self, request: "PlanningRequest") -> "Plan":
        key = plan_cache.plan_key(*self._parts, request=request.cache_repr())
        if key not in self._answers:
            stored = plan_cache.read_entry("plans", key) if self._enabled else None
            if stored is not None:
                self._answers[key] = stored
                plan = stored[2].get("best_effort_plan") if isinstance(stored, tuple) else stored
                if plan is not None:     # a refusal's best-effort plan was read with it
                    self._sources[id(plan)] = f"plan cache: {plan_cache.entry_path('plans', key)}"
            else:
                self._answers[key] = self._refusals_plan(request) or self._answer(request)
                if self._enabled:
                    plan_cache.write_entry("plans", key, self._answers[key])
        answer = self._answers[key]
        if isinstance(answer, tuple):     # a fresh error each time: callers add to its message
            _, message, fields = answer
            raise BudgetInfeasibleError(message, **fields)
        return answer

    def _refusals_plan(self, request: "PlanningRequest") -> Optional["Plan"]:
        """For a best-effort request, the best-effort plan of the same request's refusal answered in this
        process (``BudgetInfeasibleError.best_effort_plan``): the planner runs one search for both, where
        asking again ran the whole smallest-peak search a second time (17 s of a zoo Llama's refusal at
        1 kB on the 2-core VM). None otherwise."""
        if not request.best_effort:
            return None
        refused = self._answers.get(plan_cache.plan_key(*self._parts, request=request.at(
            request.target_bytes, request.saved_cap_bytes, False, request.saved_cap_search).cache_repr()))
        return refused[2].get("best_effort_plan") if isinstance(refused, tuple) else None

    def _answer(self, request: "PlanningRequest") -> Any:
        try:
            return self._solve(request)
        except BudgetInfeasibleError as error:
            if type(error) is not BudgetInfeasibleError:   # a subclass carries more than these fields
                raise
            return ("refused", str(error.args[0]), dict(budget_bytes=error.budget_bytes,
                                                          min_feasible_bytes=error.min_feasible_bytes,
                                                          min_budget_bytes=error.min_budget_bytes,
                                                          reasons=tuple(error.reasons),
                                                          best_effort_plan=error.best_effort_plan))

    def source(self, plan: "Plan") -> str:
        """Where ``plan`` came from: "plan cache: <entry>" when read from disk, "" when solved now."""
        return self._sources.get(id(plan), "")


def _profiles_key(hardware: str) -> str:
    """The profiles a graph may be planned with: the named one, or for "auto" the CPU's and each
    visible GPU's (``get_profile("auto", device)``). GPUs only once CUDA is initialized (a graph on a GPU
    has initialized it by the time it compiles): reading a GPU's name would otherwise create a CUDA
    context in a process that only runs on the CPU."""
    if hardware != "auto":
        return repr(get_profile(hardware))
    gpus = range(torch.cuda.device_count()) if torch.cuda.is_initialized() else range(0)
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in gpus]
    return ";".join(repr(get_profile("auto", device)) for device in devices)


def _stored_corrections_digest() -> str:
    directory = store_dir()
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
        try:
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        except OSError:
            digest.update(path.name.encode() + b"\0unreadable\0")
    return digest.hexdigest()[:16]


def partitioner_uuid(options: "RematOptions", corrections: dict[str, Any], step_key: Optional["StepKey"] = None) -> str:
    """Changes whenever the budget, options, hardware profile, planner source, thread count, a feedback
    correction (stored or held: ``corrections``) or what the dump holds change, and with the share of its
    step a compile is keyed by (``step_key``: the share, its position, the graphs before it)."""
    return (f"remat:{options.cache_key()}:dump={options.dump_dir is not None},pareto={options.pareto_points}:"
            f"threads={torch.get_num_threads()}:{_profiles_key(options.hardware)}:{plan_cache.planner_source_hash()}:"
            f"corrections={_stored_corrections_digest()}/{sorted((k, repr(c)) for k, c in corrections.items())}"
            + (step_key.uuid_part() if step_key is not None else ""))


def cache_possible(example_inputs: Sequence[Any]) -> bool:
    """Whether AOTAutograd's cache may serve any compile of these inputs: caching on, no torch.distributed
    (a piece's share depends on the other pieces' plans), static shapes."""
    if not plan_cache.caching_enabled():
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return False
    return not has_symbolic_shapes(example_inputs)


def call_cacheable(options: "RematOptions", graphs_planned: int, example_inputs: Sequence[Any],
                   follows: bool = False, step_key: Optional["StepKey"] = None) -> bool:
    """Whether AOTAutograd's cache may serve this compile (see the module docstring), for a backend
    with ``options`` that planned ``graphs_planned`` graphs before it, a graph a graph break ``follows``
    (when known) and the share of a remembered step it will be planned at (``step_key``, if any)."""
    if not cache_possible(example_inputs):
        return False
    if step_key is not None and step_key.share is not None:
        return True
    return not follows and (options.budget_bytes is None or not graphs_planned)


class KeyedShareMismatch(Exception):
    """Raised by the partitioner of a compile keyed by a ``StepKey`` when the graph would be planned at
    another share than the key's: the compile stops before any plan is made (AOTAutograd stores nothing)
    and ``compile_cached`` compiles it again, unkeyed, with AOTAutograd's cache off."""


@dataclass(frozen=True)
class StepKey:
    """What a compile with AOTAutograd's cache on is keyed by beyond ``partitioner_uuid``: the share of its
    step the partitioner must plan the graph at (None: none, the graph alone in its step), its position
    in the step and the graphs before it there (call identity, graph key, held bytes). The partitioner
    raises ``KeyedShareMismatch`` where the share it would plan at is not ``share`` (``check``), so a
    compile stored under this key is planned at this share, and only at it."""

    share: Optional["GraphShare"] = None
    position: int = 0
    earlier: tuple[tuple[str, str, int], ...] = ()

    def uuid_part(self) -> str:
        """What the partitioner's uuid adds for this key ("" for a graph planned alone)."""
        return "" if self.share is None else f":step[{self.position}]={self.earlier!r}/{self.share!r}"

    def check(self, asked_share: Optional["GraphShare"]) -> None:
        """Raise ``KeyedShareMismatch`` unless ``asked_share`` (the share the partitioner got) is this key's."""
        if asked_share != self.share:
            raise KeyedShareMismatch(f"keyed by {self.share!r}, planned at {asked_share!r}")


def step_key_of(share: Optional["GraphShare"], earlier: Sequence[tuple[str, "StepGraph"]]) -> Optional[StepKey]:
    """The ``StepKey`` of a graph to be planned at ``share`` after ``earlier`` ((call identity, running plan)
    of each graph before it in the step, forward order); None when ``share`` is None."""
    if share is None:
        return None
    return StepKey(share, len(earlier), tuple((i, g.graph_key, g.held_bytes) for i, g in earlier))


def _input_meta(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device}{value.requires_grad}"
    return f"{type(value).__name__}:{value!r}" if isinstance(value, (int, float, bool)) else type(value).__name__


@dataclass(frozen=True)
class CachedCompile:
    """What one compile's partitioner left behind, stored to be restored on an AOTAutograd hit."""

    record: Optional["CompiledGraph"]             # None: a graph the partitioner made no plan for
    step_graph: Optional["StepGraph"]             # its numbers on the step's account, if noted
    dump_files: tuple[tuple[str, bytes], ...]     # (path relative to the graph's dump directory, bytes)
    replanned: bool = False                       # Inductor's check replaced the plan AOTAutograd cached


def _read_dump(dump_path: Optional[str]) -> tuple[tuple[str, bytes], ...]:
    if dump_path is None:
        return ()
    root = Path(dump_path)
    return tuple((p.relative_to(root).as_posix(), p.read_bytes()) for p in sorted(root.rglob("*")) if p.is_file())


def _write_dump(root: Path, files: tuple[tuple[str, bytes], ...], old_id: str, new_id: str) -> None:
    for name, data in files:
        if old_id != new_id and name.endswith(_TEXT_SUFFIXES):
            data = data.replace(old_id.encode(), new_id.encode())
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def graph_identity(gm: "fx.GraphModule", example_inputs: Sequence[Any]) -> str:
    """The call identity of Dynamo's graph ``gm`` (its code, before Inductor's pre-grad passes edit it) for
    ``example_inputs`` (shapes, strides, dtypes, devices, ``requires_grad``), grad mode and torch version:
    the same graph compiled in another process, or again from a copy (a re-plan), has the same one."""
    code = gm.graph.python_code(root_module="self").src   # gm.code's text; reading gm.code would generate it
    # on a lazy module, adding attributes AOTAutograd's key reads (_torch_dynamo.copy_dynamo_graph)
    return plan_cache.digest_of("graph", code, ",".join(map(_input_meta, example_inputs)),
                                torch.is_grad_enabled(), torch.__version__)


class CallCache:
    """One backend call's entry: ``store`` after a compile whose partitioner ran, ``restore`` after an
    AOTAutograd hit. Keyed by the graph's call identity (``graph_identity``) and the partitioner's ``uuid``."""

    def __init__(self, identity: str, uuid: str) -> None:
        self.key = plan_cache.digest_of("call", identity, uuid)

    def store(self, record: Optional["CompiledGraph"], step_graph: Optional["StepGraph"],
              replanned: bool = False) -> None:
        dump = _read_dump(record.dump_path) if record is not None else ()
        kept = dataclasses.replace(record, facts=None) if record is not None else None   # facts are not stored
        plan_cache.write_entry("graphs", self.key, CachedCompile(kept, step_graph, dump, replanned))

    def restore(self, new_graph_id: Callable[[], str], dump_dir: Optional[str], step_account: "StepAccount",
                compile_id: str) -> Optional["CachedCompile"]:
        """The stored entry with its record re-issued for this compile (a graph id from ``new_graph_id()``,
        ``compile_id``, its dump path under ``dump_dir``, ``cache`` saying where it came from), its dump
        written and its step numbers noted on ``step_account``; the caller keeps the record. None when
        nothing is stored, or when what AOTAutograd cached is a plan Inductor's check replaced: the
        caller then compiles again."""
        from .step_budget import slot_of

        entry = plan_cache.read_entry("graphs", self.key)
        if entry is None or entry.replanned or entry.record is None:
            return None if entry is None or entry.replanned else entry
        old = entry.record
        graph_id = new_graph_id()
        dump_path = None
        if dump_dir is not None and old.dump_path is not None:
            dump_path = str(Path(dump_dir) / graph_id)
            _write_dump(Path(dump_path), entry.dump_files, old.graph_id, graph_id)
        record = dataclasses.replace(old, graph_id=graph_id, compile_id=compile_id, dump_path=dump_path,
                                     cache=f"autograd-cache hit: {plan_cache.entry_path('graphs', self.key)}")
        if entry.step_graph is not None:    # the step's account as the partitioner leaves it (note_step_plan)
            graph = dataclasses.replace(entry.step_graph, graph_id=graph_id, slot=slot_of(graph_id))
            step_account.note_plan(graph)
            if graph.asked_share is not None and step_account.floor_of(graph.slot) is None:
                step_account.set_floor(graph.slot, graph.floor_peak_bytes, graph.floor_held_bytes)
        return dataclasses.replace(entry, record=record)


def store_call(call_cache: CallCache, final: "CompiledGraph", first_id: str, step_account: "StepAccount") -> None:
    """After a compile AOTAutograd's cache missed: store the record it ended with (``final``), its dump and step
    numbers, for a later hit to restore. A plan Inductor's check replaced (``first_id``, the compile's own
    plan, is not ``final``) is stored as such: the cached code is the replaced plan's, so a hit compiles again."""
    if final.graph_id != first_id:
        call_cache.store(None, None, replanned=True)
    else:
        call_cache.store(final, step_account.plan_of(final.graph_id))


def compile_cached(source: Callable[[], "fx.GraphModule"], args: Sequence[Any], partitioner: Any, capture: Any,
                   keyed: Any, non_lazy: bool, call_cache: Optional[CallCache], step_key: Optional[StepKey],
                   restore: Callable[[CallCache], Optional[CachedCompile]]) -> tuple[Any, Optional[CachedCompile],
                                                                                    Optional[CallCache]]:
    """Inductor's compile of ``source()`` (Dynamo's graph, or a copy of it: called once per attempt) for
    ``args`` with ``partitioner`` (``_torch_compile.compile_with_partitioner``, each generated graph kept by
    ``capture``; the backward compiled now when ``non_lazy``), with AOTAutograd's cache where ``call_cache``
    is given: the attempt sets ``keyed.step_key`` to ``step_key`` for the partitioner, whose uuid then
    covers it and which raises ``KeyedShareMismatch`` at another share (``StepKey.check``). Returns the
    compiled function, the entry ``restore`` gave on a hit (its record then stands for the partitioner's)
    and the cache to store the partitioner's record in (None: nothing to store). A hit with nothing usable
    stored is compiled again with the cache off, still keyed, and stored; a compile whose share is not its
    key's is compiled again unkeyed with the cache off and not stored: no entry is ever stored under a
    share its plan was not made at."""
    from ._torch_cache import autograd_cache, autograd_cache_hits
    from ._torch_compile import compile_with_partitioner

    def attempt(key: Optional[StepKey], cache_on: bool) -> Any:
        keyed.step_key = key
        try:
            with autograd_cache(cache_on, non_lazy_backward=non_lazy):
                return compile_with_partitioner(source(), args, partitioner, capture)
        finally:
            keyed.step_key = None

    if call_cache is None:
        return attempt(None, False), None, None
    try:
        hits = autograd_cache_hits()
        fn = attempt(step_key, True)
        if autograd_cache_hits() == hits:
            return fn, None, call_cache
        entry = restore(call_cache)
        if entry is not None:
            return fn, entry, None
        return attempt(step_key, False), None, call_cache
    except Exception as error:      # the partitioner's error, as it reaches compile_fx's caller
        if not _mismatch_in(error):
            raise
        return attempt(None, False), None, None


def _mismatch_in(error: BaseException) -> bool:
    seen: list[BaseException] = []
    while error is not None and not any(error is e for e in seen):
        if isinstance(error, KeyedShareMismatch):
            return True
        seen.append(error)
        error = error.__cause__ or error.__context__     # type: ignore[assignment]
    return False
