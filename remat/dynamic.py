"""Dynamic shapes under a budget: which sizes a graph is planned for, and what is said about the others.

A graph compiled with ``torch._dynamo.mark_dynamic`` or ``torch.compile(dynamic=True)`` runs at
every size its guards admit, with one plan. remat plans it once, without adding a guard, at one
point of its sizes, its ``SizeEnvironment`` (symbol -> value):

- a symbol with an upper bound (``mark_dynamic(x, dim, max=...)``, or a guard such as ``s0 <= 128``)
  is planned at that bound. A plan's memory grows with every size (storage bytes are
  non-decreasing in each symbol), so a plan whose simulated peak fits at the largest sizes fits
  at every smaller one;
- a symbol with no upper bound is planned at its traced size. Larger sizes may then exceed the
  budget: one warning (and the graph's ``report.md``) names the largest size the plan still fits,
  found by simulating that plan at larger sizes (``remat.sizing``'s search), and how to declare a max.

Planning reads sizes only at these values (``cost_model.tensors.sizes_evaluated_at``) and with
the ShapeEnv's guards suppressed, so no comparison made while planning specialises the graph
(Inductor's own guards, added when it generates code, are not touched).

In a step of several graphs (graph breaks), a dynamic-shape graph the step's measurement asks to change is
re-planned at the sizes of the call that asks, as static code run for calls of exactly those sizes
(``size_dispatch.py``); its dynamic plan stays for every other size.

When Dynamo compiles a frame for the last time its recompile limit allows, remat warns: a later
guard failure would run that frame in eager, without remat's plan or budget, and Dynamo only logs it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

from torch import fx

from . import _torch_shapes
from ._torch_dynamo import passthrough_error_class
from .cost_model.tensors import sizes_evaluated_at
from .devices import device_of
from .errors import BudgetInfeasibleError
from .units import format_bytes

if TYPE_CHECKING:
    from .compiled_graph import CompiledGraph
    from .options import RematOptions
    from .passes.plan import Plan

# How far past its traced size an unbounded symbol is searched for the largest size its plan fits.
SEARCH_FACTOR = 1024


@dataclass(frozen=True)
class SizeSymbol:
    """One shape symbol of a graph and the value remat plans it at."""

    name: str                 # "s50"
    source: str               # "L['x'].size()[1]"
    traced: int               # the size the graph was traced with
    upper: Optional[int]      # the largest size the guards allow or the user declared; None: unbounded

    @property
    def planned(self) -> int:
        return self.upper if self.upper is not None else self.traced

    def describe(self) -> str:
        if self.upper is None:
            return f"{self.name} = {self.planned} ({self.source}: no upper bound, its traced size)"
        return f"{self.name} = {self.planned} ({self.source}: its upper bound; traced at {self.traced})"


@dataclass(frozen=True)
class SizeEnvironment:
    """The sizes a graph is planned at: every shape symbol in its tensor sizes, by name."""

    symbols: tuple[SizeSymbol, ...] = ()

    @property
    def values(self) -> dict[str, int]:
        """Symbol name -> planned value, for ``sizes_evaluated_at``."""
        return {s.name: s.planned for s in self.symbols}

    @property
    def unbounded(self) -> tuple[SizeSymbol, ...]:
        return tuple(s for s in self.symbols if s.upper is None)

    @property
    def above_traced(self) -> tuple[SizeSymbol, ...]:
        return tuple(s for s in self.symbols if s.planned != s.traced)

    def describe(self) -> str:
        return ", ".join(s.describe() for s in self.symbols)


def size_environment(graphs: Sequence[fx.Graph]) -> SizeEnvironment:
    """The sizes to plan ``graphs`` (one joint graph, or its forward and backward) at.

    Every backed shape symbol in a tensor size gets its upper bound, or its traced value when it
    has none; symbols that are not sizes (an ``.item()`` value) and unbacked ones are left out.
    Reads the ShapeEnv without adding a guard. Empty for static graphs.
    """
    shape_env = next((env for g in graphs if (env := _torch_shapes.shape_env_of(g)) is not None), None)
    if shape_env is None:
        return SizeEnvironment()
    from .sizing import size_symbols

    names = set().union(*(size_symbols(graph) for graph in graphs))
    sources = _torch_shapes.source_names(shape_env)
    symbols = [SizeSymbol(str(sym), sources.get(str(sym), "?"), traced, _torch_shapes.upper_bound(shape_env, sym))
               for sym, traced in _torch_shapes.traced_values(shape_env).items() if str(sym) in names]
    return SizeEnvironment(tuple(sorted(symbols, key=lambda s: (len(s.name), s.name))))


def partition_at_planned_sizes(partition: Callable[..., tuple[fx.GraphModule, fx.GraphModule]],
                               options: "RematOptions", compiled_graphs: Sequence["CompiledGraph"],
                               joint: fx.GraphModule, joint_inputs: Sequence[object],
                               kwargs: Mapping[str, Any]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``partition(joint, joint_inputs, **kwargs)`` (the backend's, with its ``options`` and the
    ``compiled_graphs`` it appends its records to) with the joint graph's sizes read at its
    ``SizeEnvironment`` and no guard added; warns when Dynamo will not compile this frame again,
    and when a symbol with no upper bound leaves larger sizes unplanned. Returns what
    ``partition`` returns."""
    warn_if_last_compile(options.budget_bytes)
    sizes = size_environment([joint.graph])
    if not sizes.symbols:
        return partition(joint, joint_inputs, **kwargs)
    known = len(compiled_graphs)
    try:
        with _torch_shapes.guards_suppressed(_torch_shapes.shape_env_of(joint.graph)), sizes_evaluated_at(sizes.values):
            result = partition(joint, joint_inputs, **kwargs)
    except BudgetInfeasibleError as error:
        if not sizes.above_traced:
            raise
        raise _restated(error, sizes) from None
    if sizes.unbounded and options.budget_bytes is not None and len(compiled_graphs) > known:
        record = compiled_graphs[-1]
        _warn_unbounded(record.graph_id, record.plan, record.dump_path, joint, int(kwargs["num_fwd_outputs"]),
                        options.hardware, joint_inputs, sizes, eager_loss=record.eager_loss_bytes > 0)
    return result


def _restated(error: BudgetInfeasibleError, sizes: SizeEnvironment) -> BudgetInfeasibleError:
    """The same error (every field kept), saying it was planned at the largest sizes and how to plan for smaller ones."""
    restated = passthrough_error_class(BudgetInfeasibleError)(error)
    restated.args = (f"{error.args[0]} Planned at the largest sizes the graph admits: {sizes.describe()}. Declare a "
                     "smaller max with torch._dynamo.mark_dynamic(x, dim, max=...) to plan for smaller sizes.",)
    return restated


def warn_if_last_compile(budget_bytes: Optional[int]) -> None:
    """Warn when this is the last compile Dynamo's recompile limit allows for the current frame."""
    position = _torch_shapes.compile_position()
    if position is None or not position.is_last_compile or position.fails_on_limit:
        return
    budget = (f"its budget of {format_bytes(budget_bytes)} (1 MB = 1e6 bytes)" if budget_bytes is not None
              else "its plan (no budget set)")
    warnings.warn(
        f"remat: this is compile {position.compiles_before + 1} of frame {position.frame_id}, the last one Dynamo's "
        f"recompile limit allows (torch._dynamo.config.recompile_limit={position.recompile_limit}, "
        f"accumulated_recompile_limit={position.accumulated_recompile_limit}). If this frame's guards fail again "
        f"(a new input size, dtype or attribute), Dynamo runs it in eager, without remat and {budget}, and only logs "
        "it. Mark the sizes that change dynamic (torch._dynamo.mark_dynamic(x, dim, max=...)) or raise "
        "torch._dynamo.config.recompile_limit.",
        stacklevel=2,
    )


@dataclass(frozen=True)
class SizeReach:
    """How far one unbounded symbol may grow before the plan made at its traced size exceeds its target."""

    symbol: SizeSymbol
    largest_fitting: int         # the largest size at which the plan's simulated peak meets its target
    searched_to: int             # the search stopped here: ``largest_fitting == searched_to`` means "at least"
    peak_bytes: int              # the simulated peak at ``largest_fitting``

    def describe(self, target_bytes: int) -> str:
        bound = "at least " if self.largest_fitting >= self.searched_to else ""
        return (f"{self.symbol.source} ({self.symbol.name}, traced at {self.symbol.traced}) has no upper bound; "
                f"the plan meets its target of {format_bytes(target_bytes)} up to {bound}{self.symbol.name} = "
                f"{self.largest_fitting} (simulated peak {format_bytes(self.peak_bytes)} there)")


def size_reach(joint: fx.GraphModule, num_fwd_outputs: int, profile: Any, plan: "Plan",
               sizes: SizeEnvironment, eager_loss: bool = False) -> tuple[SizeReach, ...]:
    """For each unbounded symbol, the largest size (others at their planned sizes) at which
    ``plan``, unchanged, keeps its simulated peak at or under ``plan.target_bytes``; with ``eager_loss``, next to
    the reserve for an eager loss on the outputs at that size (``pipeline.with_eager_loss_reserve``).

    Guarantees, for each answer n < ``searched_to``: the plan fits at n and not at n + 1.
    Re-annotates ``joint``'s costs at each size tried (nothing reads them after partitioning).
    """
    from .simulator import evaluate
    from .pipeline import facts_at_sizes, with_eager_loss_reserve
    from .sizing import search_largest

    assert plan.target_bytes is not None
    saved = frozenset(plan.saved)
    reaches = []
    for symbol in sizes.unbounded:
        peaks: dict[int, tuple[bool, int]] = {}

        def fits_at(value: int) -> tuple[bool, int]:
            if value not in peaks:
                facts = facts_at_sizes(joint, num_fwd_outputs, profile, {**sizes.values, symbol.name: value})
                facts = with_eager_loss_reserve(facts, None) if eager_loss else facts
                with sizes_evaluated_at({**sizes.values, symbol.name: value}):
                    peak = evaluate(facts, saved).simulation.peak_bytes
                peaks[value] = (peak <= plan.target_bytes, peak)
            return peaks[value]

        highest = symbol.traced * SEARCH_FACTOR
        largest, _ = search_largest(fits_at, symbol.traced, symbol.traced, highest, 1)
        if largest is None:   # the plan does not meet its target even at the traced size (best effort)
            continue
        reaches.append(SizeReach(symbol, largest, highest, fits_at(largest)[1]))
    return tuple(reaches)


def _warn_unbounded(graph_id: str, plan: "Plan", dump_path: Optional[str], joint: fx.GraphModule,
                    num_fwd_outputs: int, hardware: str, joint_inputs: Sequence[object], sizes: SizeEnvironment,
                    eager_loss: bool = False) -> None:
    """One warning (and a section of the graph's report.md) per graph with unbounded size symbols."""
    from .cost_model.hardware import get_profile

    if plan.target_bytes is None:
        return
    shape_env = _torch_shapes.shape_env_of(joint.graph)
    with _torch_shapes.guards_suppressed(shape_env):
        reaches = size_reach(joint, num_fwd_outputs, get_profile(hardware, device_of(joint_inputs)), plan, sizes,
                             eager_loss)
    if not reaches:
        return
    lines = [r.describe(plan.target_bytes) for r in reaches]
    text = (f"remat {graph_id}: planned for budget {format_bytes(plan.budget_bytes or 0)} (1 MB = 1e6 bytes) at "
            f"the traced sizes of dims with no upper bound; larger sizes may exceed the budget. "
            + "; ".join(lines) + ". Declare the largest size with torch._dynamo.mark_dynamic(x, dim, max=...) "
            "and remat plans for it (the plan then fits every size up to it).")
    warnings.warn(text, stacklevel=3)
    if dump_path is not None:
        report = Path(dump_path) / "report.md"
        section = "\n## Sizes above the traced size (dynamic shapes)\n\n" + "".join(f"- {line}\n" for line in lines)
        section += ("\nLarger sizes may exceed the budget. Declare the largest size with "
                    "`torch._dynamo.mark_dynamic(x, dim, max=...)` and remat plans for it.\n")
        with report.open("a") as f:
            f.write(section)


__all__ = ["SizeEnvironment", "SizeReach", "SizeSymbol", "partition_at_planned_sizes", "size_environment",
           "size_reach", "warn_if_last_compile"]
