"""torch's private shape and recompile machinery: the one place remat reads it outside backend.py.

Verified on torch 2.13.0 (``backed_var_to_val`` is ``var_to_val`` before 2.13):

- ``ShapeEnv.backed_var_to_val``: the value each shape symbol was traced with (its hint);
  ``ShapeEnv.optimization_hint(expr)``: an expression's value at the hints, adding no guard.
- ``ShapeEnv.var_to_range``: each symbol's value range. ``torch._dynamo.mark_dynamic(x, d, min=, max=)``
  sets it, and guards on the symbol (``s0 <= 128``) narrow it; no upper bound is ``int_oo``.
- ``ShapeEnv.var_to_sources``: where each symbol came from (``L['x'].size()[1]``).
- ``ShapeEnv.suppress_guards()``: comparisons on SymInts inside evaluate at the hint and record
  no guard (and no replacement); ``ShapeEnv.error_on_new_guards()`` raises instead (for tests).
- ``torch.fx.experimental.symbolic_shapes.statically_known_true(expr)``: whether a size comparison
  holds for every value of its symbols, adding no guard (``sizes_known_equal``).
- ``torch._guards.CompileContext.current_compile_id()``: ``frame_id`` and ``frame_compile_id``.
- ``torch._dynamo.convert_frame._compile``'s local ``cache_size`` (a ``CacheSizeRelevantForFrame``),
  read off the Python stack: the cache entries Dynamo counts against its limits.
- ``torch._dynamo.config.recompile_limit``, ``accumulated_recompile_limit``,
  ``fail_on_recompile_limit_hit``: when Dynamo stops compiling a frame and runs it in eager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import sympy
import torch
from torch import fx


def shape_env_of(graph: fx.Graph) -> Optional[Any]:
    """The ShapeEnv of the graph's symbolic sizes, or None when every size is an int."""
    for node in graph.nodes:
        for tensor in _tensors(node.meta.get("val")):
            for size in tensor.shape:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def sizes_known_equal(a: Sequence[Any], b: Sequence[Any]) -> bool:
    """Whether two shapes (ints or SymInts) are equal for every value their symbols may take; adds no guard."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def traced_values(shape_env: Any) -> dict[sympy.Symbol, int]:
    """Each backed shape symbol and the value it was traced with (its hint)."""
    values = getattr(shape_env, "backed_var_to_val", None) or shape_env.var_to_val
    return {sym: int(val) for sym, val in values.items()}


def hint_of(shape_env: Any, expr: sympy.Expr) -> int:
    """``expr``'s value at the traced sizes (an unbacked symbol takes torch's optimisation hint); no guard."""
    return int(shape_env.optimization_hint(expr))


def upper_bound(shape_env: Any, symbol: sympy.Symbol) -> Optional[int]:
    """The largest value the symbol may take (a declared max, or one guards imply); None when unbounded."""
    bounds = shape_env.var_to_range.get(symbol)
    if bounds is None:
        return None
    upper = bounds.upper   # a sympy Integer, or int_oo (not an Integer) when unbounded
    return int(upper) if isinstance(upper, sympy.Integer) else None


def source_names(shape_env: Any) -> dict[str, str]:
    """Each symbol's name and where it came from ("s0" -> "L['x'].size()[0]")."""
    out = {}
    for sym, sources in shape_env.var_to_sources.items():
        if sources:
            name = sources[0].name
            out[str(sym)] = name() if callable(name) else str(name)
    return out


def guards_suppressed(shape_env: Optional[Any]) -> contextlib.AbstractContextManager[None]:
    """Inside, a comparison on a SymInt takes its traced value and adds no guard: planning
    decisions are made at the sizes remat chose and never specialise the compiled graph."""
    return shape_env.suppress_guards() if shape_env is not None else contextlib.nullcontext()


@contextlib.contextmanager
def guards_forbidden(shape_env: Optional[Any]) -> Iterator[None]:
    """Inside, any guard on the shape symbols raises (``_ShapeEnvGuardError``, a RuntimeError):
    for tests that check a code path reads sizes without guarding."""
    if shape_env is None:
        yield
        return
    with shape_env.error_on_new_guards():
        yield


@dataclass(frozen=True)
class CompilePosition:
    """Where the current compile stands against Dynamo's recompile limits."""

    frame_id: int
    frame_compile_id: int           # compiles of this code object so far (any model instance), 0 for the first
    compiles_before: int            # cache entries Dynamo counts against recompile_limit (same ID-matched objects)
    entries_before: int             # cache entries of the code object, counted against accumulated_recompile_limit
    recompile_limit: int            # compiles of one frame before Dynamo runs it in eager
    accumulated_recompile_limit: int
    fails_on_limit: bool            # fail_on_recompile_limit_hit: Dynamo raises instead of running eager

    @property
    def is_last_compile(self) -> bool:
        """True when Dynamo will not compile this frame again (the test of
        ``torch._dynamo.cache_size.exceeds_recompile_limit`` with this compile's entry added):
        a guard that fails later runs the frame in eager."""
        return (self.compiles_before + 1 >= self.recompile_limit
                or self.entries_before + 1 >= self.accumulated_recompile_limit)


def _dynamo_cache_size() -> Optional[Any]:
    """The ``CacheSizeRelevantForFrame`` Dynamo's ``convert_frame._compile`` checks the limits on,
    read off the Python stack (it is a local of that call, in no context object); None if not found."""
    import sys

    from torch._dynamo import convert_frame

    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_compile" and code.co_filename == convert_frame.__file__:
            return frame.f_locals.get("cache_size")
        frame = frame.f_back
    return None


def compile_position() -> Optional[CompilePosition]:
    """The current Dynamo compile against the recompile limits, or None outside a Dynamo compile.

    Counts what Dynamo counts: cache entries with the same ID-matched objects (another instance of
    the same module class compiles separately); where Dynamo's count cannot be read, this code
    object's compile count (``frame_compile_id``), which may count other instances too."""
    from torch._dynamo import config
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None or compile_id.frame_compile_id is None:
        return None
    count = int(compile_id.frame_compile_id)
    cache_size = _dynamo_cache_size()
    same = getattr(cache_size, "num_cache_entries_with_same_id_matched_objs", count)
    entries = getattr(cache_size, "total_cache_entries_all_regions", count)
    return CompilePosition(int(compile_id.frame_id), count, int(same), int(entries), int(config.recompile_limit),
                           int(config.accumulated_recompile_limit), bool(config.fail_on_recompile_limit_hit))
