"""The largest batch (or sequence, or any dynamic size) whose plan fits a budget.

``max_size_that_fits(model, example_inputs, budget_gb, dynamic=[(0, 0), (1, 0)])``
traces the model once with those dims dynamic, so the joint graph's sizes are
SymInts in a shape symbol (``s0``). To ask about a size ``v`` it reads the facts
the planner uses (costs, storages, kernel steps) with every symbolic size
evaluated at ``s0 = v`` (``pipeline.facts_at_sizes``), then plans them as the
backend plans that graph (``pipeline.plan_graph`` for the request the backend's
options make for it: the budget less its device's headroom). No code is generated and nothing is retraced per size. The answer is
for the model compiled with those dims dynamic; a compile at one static size
can see a different joint graph (on the zoo GPT at batch 12, the dynamic graph's
min-cut plan peaks at 75.8 MB and the static graph's at 58.5 MB), so a static
compile may fit a larger size than this says.

Why a search and not one formula: what the plan saves and recomputes changes
with the size, so its simulated peak is a different sum of storage formulas at
different sizes. The search doubles from the traced size until a size does not
fit, then bisects. It guarantees, for the size ``n`` it returns: the plan made
at ``n`` fits (simulated peak <= budget less headroom, on every joint graph),
and the plan made at ``n + step`` does not (on at least one graph), unless
``n`` is ``highest``. It does not claim that no larger size fits: the planner is
not guaranteed monotone in the size, only checked at the boundary.

``replan=False`` keeps the plan made at the traced size, which is what a
dynamic compile with no upper bound on the size runs at every size, and asks
how far that one plan stretches (the backend warns with this figure:
``remat.dynamic``). With a declared max (``mark_dynamic(x, dim, max=n)``) the
backend plans at ``n`` instead, and that plan fits every size up to ``n``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import sympy
import torch
from torch import fx

from .cost_model.symbolic import shape_hints, symbol_sources
from .cost_model.tensors import iter_tensors
from .devices import free_device_bytes
from .errors import BudgetInfeasibleError
from .options import make_options, smallest_budget_bytes
from .simulator import evaluate
from .passes.joint_graph import JointGraphFacts
from .pipeline import PlanningRequest, PreparedGraph, facts_at_sizes, plan_graph, prepare_graph, request_for, \
    trace_joint_facts, with_eager_loss_reserve
from .units import format_bytes, format_gb_up


@dataclass(frozen=True)
class SizeFit:
    """The answer of ``max_size_that_fits``; bytes are simulated peaks above the step's resident memory."""

    size: int                        # the largest size found whose plan fits
    symbols: tuple[str, ...]         # the shape symbols set to ``size`` ("s0",)
    sources: tuple[str, ...]         # where each came from ("L['x'].size()[0]",)
    traced_size: int                 # the example inputs' size
    budget_bytes: int
    target_bytes: int                # what the simulated peak must meet: the budget less the headroom
    peak_bytes: int                  # the plan's simulated peak at ``size`` (largest over the joint graphs)
    next_size: Optional[int]         # the next size up (size + step); None when ``size`` is ``highest``
    next_peak_bytes: Optional[int]   # at ``next_size``, the peak of the planner's best-effort plan: over the target
    replanned: bool                  # True: planned at each size; False: the plan made at the traced size
    sizes_tried: tuple[tuple[int, bool], ...]   # (size, fits), in the order tried

    def describe(self) -> str:
        names = ", ".join(f"{s} = {src}" for s, src in zip(self.symbols, self.sources))
        text = (f"largest size that fits: {self.size} ({names}; traced at {self.traced_size}): simulated peak "
                f"{format_bytes(self.peak_bytes)} <= target {format_bytes(self.target_bytes)} "
                f"(budget {format_bytes(self.budget_bytes)} less headroom)")
        if self.next_size is None:
            return text + "; the search stopped at `highest`"
        peak = format_bytes(self.next_peak_bytes or 0)
        return text + f"; at {self.next_size} the planner's best-effort plan peaks at {peak}"


@dataclass(frozen=True)
class _TracedGraph:
    """One traced joint graph, kept to read its facts at other sizes (``pipeline.facts_at_sizes``)."""

    joint: fx.GraphModule
    num_fwd_outputs: int
    prepared: PreparedGraph     # its facts at the traced sizes

    def facts_at(self, values: dict[str, int]) -> JointGraphFacts:
        """Its facts at ``values``, with the reserve the backend plans a graph alone in its step with for an eager
        loss on its outputs (``pipeline.with_eager_loss_reserve``: each graph is planned here as one alone is)."""
        return with_eager_loss_reserve(facts_at_sizes(self.joint, self.num_fwd_outputs, self.prepared.profile, values),
                                       None)


def _mark_inputs(example_inputs: Sequence[Any], dynamic: Sequence[tuple[int, int]]) -> list[Any]:
    inputs = list(example_inputs)
    for item in dynamic:
        if not (isinstance(item, tuple) and len(item) == 2 and all(isinstance(i, int) for i in item)):
            raise TypeError(f"dynamic={dynamic!r}: each entry must be an (input index, dim) pair of ints, e.g. (0, 0).")
        index, dim = item
        if not 0 <= index < len(inputs) or not isinstance(inputs[index], torch.Tensor):
            raise ValueError(f"dynamic entry {item}: example_inputs[{index}] is not a tensor "
                             f"(there are {len(inputs)} inputs).")
        tensor = inputs[index]
        if not -tensor.dim() <= dim < tensor.dim():
            raise ValueError(f"dynamic entry {item}: input {index} has {tensor.dim()} dims.")
        if tensor.shape[dim] < 2:
            raise ValueError(f"dynamic entry {item}: the example size is {tensor.shape[dim]}; trace with a size >= 2 "
                             "(torch specializes sizes 0 and 1).")
        # a new leaf over the same storage, so the caller's tensor is not marked
        alias = tensor.detach().requires_grad_(tensor.requires_grad) if tensor.is_leaf else tensor.view_as(tensor)
        torch._dynamo.mark_dynamic(alias, dim % tensor.dim())
        inputs[index] = alias
    return inputs


def size_symbols(graph: fx.Graph) -> set[str]:
    """Names of the symbols that appear in tensor sizes (not ``.item()`` values such as a counter)."""
    names: set[str] = set()
    for node in graph.nodes:
        for tensor in iter_tensors(node.meta.get("val")):
            for size in tensor.shape:
                if isinstance(size, torch.SymInt):
                    names.update(str(s) for s in sympy.sympify(size.node.expr).free_symbols)
    return names


def _grown_symbols(graphs: list[_TracedGraph], symbol: Optional[str]) -> tuple[tuple[str, ...], tuple[str, ...], int]:
    hints: dict[str, int] = {}
    sources: dict[str, str] = {}
    in_sizes: set[str] = set()
    for g in graphs:
        hints.update({str(s): v for s, v in shape_hints(g.joint.graph).items()})
        sources.update(symbol_sources(g.joint.graph))
        in_sizes |= size_symbols(g.joint.graph)
    used = sorted(s for s in hints if s in sources and s in in_sizes)
    if not used:
        raise ValueError("the traced graphs have no dynamic size: pass dynamic=[(input index, dim), ...] for the "
                         "dims that grow together, or mark them with torch._dynamo.mark_dynamic before calling.")
    if symbol is not None:
        if symbol not in used:
            raise ValueError(f"symbol={symbol!r} is not a shape symbol of the traced graphs; they have "
                             + ", ".join(f"{s} ({sources[s]}, traced at {hints[s]})" for s in used) + ".")
        used = [symbol]
    if len({hints[s] for s in used}) > 1:
        raise ValueError("the dynamic sizes " + ", ".join(f"{s} ({sources[s]}, traced at {hints[s]})" for s in used)
                         + " were traced at different sizes, so they cannot grow as one; "
                         "pass symbol='...' to pick one.")
    return tuple(used), tuple(sources[s] for s in used), hints[used[0]]


def _peak_if_fits(facts: JointGraphFacts, request: PlanningRequest,
                  fixed: Optional[frozenset[str]]) -> tuple[bool, int]:
    """(fits, peak): the plan's simulated peak; when it does not fit, the peak of the planner's best-effort
    plan (``request`` is best effort)."""
    if fixed is not None:
        assert request.target_bytes is not None
        peak = evaluate(facts, fixed).simulation.peak_bytes
        return peak <= request.target_bytes, peak
    plan = plan_graph(facts, request)
    return plan.fits_budget, plan.predicted_peak_bytes


def search_largest(fits_at: Callable[[int], tuple[bool, int]], start: int, lowest: int, highest: int,
                   step: int) -> tuple[Optional[int], list[tuple[int, bool]]]:
    """The largest k*step in [lowest, highest] with fits and (k+1)*step not fitting (or == highest),
    searched from ``start`` (doubling, then bisection); None when ``lowest`` does not fit. Also the
    (size, fits) pairs tried, in order. ``fits_at(size)`` returns (fits, peak bytes)."""
    tried: list[tuple[int, bool]] = []
    memo: dict[int, bool] = {}

    def fits(k: int) -> bool:
        if k not in memo:
            memo[k] = fits_at(k * step)[0]
            tried.append((k * step, memo[k]))
        return memo[k]

    k_lo, k_hi = -(-lowest // step), highest // step
    k = min(max(start // step, k_lo), k_hi)
    if fits(k):                        # grow until a size does not fit
        good, width = k, max(k, 1)     # double the size each time
        while good < k_hi and fits(min(good + width, k_hi)):
            good, width = min(good + width, k_hi), width * 2
        if good == k_hi:
            return good * step, tried
        bad = min(good + width, k_hi)
    else:                              # shrink until one fits
        bad, width = k, max(k // 2, 1)  # halve the size each time
        while True:
            if bad == k_lo:
                return None, tried
            candidate = max(bad - width, k_lo)
            if fits(candidate):
                good = candidate
                break
            bad, width = candidate, max(candidate // 2, 1)
    while bad - good > 1:              # fits(good) and not fits(bad)
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good * step, tried


def max_size_that_fits(
    model: Callable[..., Any],
    example_inputs: Sequence[Any],
    budget_gb: Any,
    *,
    dynamic: Sequence[tuple[int, int]] = (),
    symbol: Optional[str] = None,
    lowest: int = 1,
    highest: int = 1 << 20,
    step: int = 1,
    replan: bool = True,
    hardware: str = "auto",
    headroom_fraction: Optional[float] = None,
) -> SizeFit:
    """The largest value of a dynamic size for which remat's plan fits ``budget_gb`` (decimal GB).

    ``dynamic`` lists the (input index, dim) pairs that are the size in question
    (e.g. the batch dim of the inputs and of the targets); they are marked with
    ``torch._dynamo.mark_dynamic`` on aliases of the inputs, and grow together.
    Dims already marked by the caller count too; with several shape symbols,
    ``symbol`` ("s0") picks the one to grow (the others stay at their traced size).
    Sizes searched are multiples of ``step`` in [``lowest``, ``highest``].
    The model is traced once (no code generated; only the forward runs, uncompiled).

    Guarantees, for the returned ``SizeFit.size`` n: the plan at n fits on every
    joint graph, and at n + step no plan the planner finds fits on some graph
    (unless n == ``highest``). Raises ``BudgetInfeasibleError`` when ``lowest``
    does not fit, naming the smallest budget that does.
    """
    options = make_options(budget_gb, hardware=hardware, headroom_fraction=headroom_fraction,
                           free_bytes_for_auto=free_device_bytes() if budget_gb == "auto" else None)
    if options.budget_bytes is None:
        raise ValueError("budget_gb=None: max_size_that_fits needs a budget, a number of decimal GB "
                         "(e.g. budget_gb=8).")
    for name, value in (("lowest", lowest), ("highest", highest), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int.")
    if highest < lowest or highest < step:
        raise ValueError(f"highest={highest} must be >= lowest={lowest} and >= step={step}.")
    budget = options.budget_bytes

    def keep(joint: fx.GraphModule, joint_inputs: Sequence[object], num_fwd_outputs: int) -> _TracedGraph:
        return _TracedGraph(joint, num_fwd_outputs, prepare_graph(joint, joint_inputs, num_fwd_outputs, hardware))

    graphs = [g for g in trace_joint_facts(model, _mark_inputs(example_inputs, dynamic), hardware=hardware, read=keep)
              if g.prepared.has_backward]
    if not graphs:
        raise ValueError("the model produced no joint graph with a backward: call it on inputs whose output "
                         "depends on parameters that require grad.")
    symbols, sources, traced = _grown_symbols(graphs, symbol)
    # each graph planned as the backend would plan it: the budget less its device's headroom, best effort
    requests = [request_for(options, g.prepared) for g in graphs]
    requests = [r.at(r.target_bytes, best_effort=True) for r in requests]
    binding = min(requests, key=lambda r: r.target_bytes or 0)   # the lowest target (the same on one device)
    target = binding.target_bytes
    assert target is not None
    fixed = [None if replan else _hint_plan_saved(with_eager_loss_reserve(g.prepared.facts, None), r)
             for g, r in zip(graphs, requests)]
    peaks: dict[int, tuple[bool, int]] = {}

    def fits_at(size: int) -> tuple[bool, int]:
        if size not in peaks:
            values = {s: size for s in symbols}
            results = [_peak_if_fits(g.facts_at(values), r, f) for g, r, f in zip(graphs, requests, fixed)]
            fits = all(ok for ok, _ in results)
            peak = max(p for _, p in results) if fits else max(p for ok, p in results if not ok)
            peaks[size] = (fits, peak)
        return peaks[size]

    size, tried = search_largest(fits_at, traced, lowest, highest, step)
    if size is None:
        smallest = -(-lowest // step) * step
        peak = fits_at(smallest)[1]
        minimum = smallest_budget_bytes(lambda b: binding.target_for(b) >= peak, start_bytes=peak)
        raise BudgetInfeasibleError(
            f"even the smallest size {smallest} does not fit budget {format_bytes(budget)}: the smallest simulated "
            f"peak a plan reaches there is {format_bytes(peak)} against a target of {format_bytes(target)} (the budget "
            f"less {100 * binding.headroom_fraction:.0f}% headroom). "
            f"Raise the budget to at least {format_gb_up(minimum)} GB"
            " (1 GB = 1e9 bytes) or lower `lowest`.",
            budget_bytes=budget, min_feasible_bytes=peak, min_budget_bytes=minimum, reasons=(),
        )
    next_size = size + step if size + step <= highest else None
    return SizeFit(
        size=size, symbols=symbols, sources=sources, traced_size=traced, budget_bytes=budget, target_bytes=target,
        peak_bytes=fits_at(size)[1], next_size=next_size,
        next_peak_bytes=fits_at(next_size)[1] if next_size is not None else None,
        replanned=replan, sizes_tried=tuple(tried),
    )


def _hint_plan_saved(facts: JointGraphFacts, request: PlanningRequest) -> frozenset[str]:
    """What the plan made at the traced size saves (the smallest-peak plan if none fits there: ``request``
    is best effort)."""
    return frozenset(plan_graph(facts, request).saved)


__all__ = ["SizeFit", "max_size_that_fits"]
