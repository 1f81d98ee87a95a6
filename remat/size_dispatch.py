"""A dynamic-shape graph of a budgeted step re-planned at the sizes one call ran at.

Dynamo compiles a frame again with dynamic shapes when it meets it at new sizes (automatic dynamic):
a block's forward compiled on its own at a graph break, met once per block at each block's sizes, is
the common case. Its plan is made once, at the sizes ``dynamic.py`` plans it at, without Inductor's
check. When the step's measured peak asks it to change, the graph is compiled again from Dynamo's
graph for the real inputs of the call that asked (static shapes: Inductor can check the new plan),
and ``SizeDispatch`` runs that code for calls whose inputs have exactly those sizes, strides, dtypes
and devices (what the static code assumes) and the dynamic code, with its first plan, for every other
call. Nothing is guarded anew: the dynamic code's guards, which Dynamo checks before either runs,
are unchanged, and the static code runs only where its own assumptions hold.

What this leaves: a graph whose calls change size from step to step keeps its dynamic plan on the
calls at sizes it was not re-planned at; the step loop's rounds then end as for any step the re-plans
do not fix (refused, naming the largest step peak measured).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ._torch_graph_breaks import input_specs


@dataclass(frozen=True)
class SizeDispatch:
    """Calls ``specialized`` (compiled for inputs exactly like ``specs``: ``input_specs``) where a
    call's inputs match ``specs``, else ``general`` (the dynamic-shape code, valid at every size
    Dynamo's guards admit). Re-planned again, ``general`` stays the dynamic code."""

    general: Callable[..., Any]
    specs: tuple[Any, ...]
    specialized: Callable[..., Any]

    def __call__(self, *args: Any) -> Any:
        fn = self.specialized if input_specs(args) == self.specs else self.general
        return fn(*args)


def at_call_sizes(general: Callable[..., Any], args: list, specialized: Callable[..., Any]) -> SizeDispatch:
    """``specialized`` (compiled for the inputs ``args``) for calls shaped like ``args``; ``general``
    for the others (a ``SizeDispatch`` given as ``general`` hands on its own general code)."""
    base = general.general if isinstance(general, SizeDispatch) else general
    return SizeDispatch(base, input_specs(args), specialized)
