"""The private torch APIs the step's account across graph breaks uses, in one place (verified on
torch 2.13.0).

- ``GraphModule.compile_subgraph_reason``: Dynamo sets it on the graph it hands a backend
  (``torch/_dynamo/output_graph.py: OutputGraph.compile_and_call_fx_graph``) to the
  ``GraphCompileReason`` the graph was compiled for; its ``graph_break`` is True when the frame
  broke there, so more of the frame (a resume function, its graphs) runs after this graph.
- ``torch._subclasses.fake_tensor.FakeTensorMode``: fake inputs for re-planning a graph ahead of
  its call (``compile_fx`` takes the fake mode from its inputs, as it does under Dynamo), so
  nothing the size of its inputs is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


def graph_break_follows(gm: Any) -> bool:
    """Whether Dynamo compiled ``gm`` because its frame broke after it (code of the same frame runs
    next, and may hold more graphs of the step). False when unknown (no reason recorded)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))


@dataclass(frozen=True)
class TensorSpec:
    """An input's metadata, enough to stand for it in a compile (no storage kept)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


def input_specs(args: Sequence[Any]) -> tuple[Any, ...]:
    """Each tensor of ``args`` as a ``TensorSpec``; other values as they are. Static shapes only."""
    return tuple(TensorSpec(tuple(a.shape), tuple(a.stride()), a.dtype, a.device, a.requires_grad)
                 if isinstance(a, torch.Tensor) else a for a in args)


def fake_inputs(specs: Sequence[Any]) -> list[Any]:
    """Fake tensors (one fresh ``FakeTensorMode``) for the ``TensorSpec`` of ``specs``: inputs to
    compile a graph for without allocating them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    out: list[Any] = []
    with mode:
        for spec in specs:
            if isinstance(spec, TensorSpec):
                out.append(torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device,
                                               requires_grad=spec.requires_grad))
            else:
                out.append(spec)
    return out
