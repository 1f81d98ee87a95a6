"""The private torch APIs the step's account across graph breaks uses, in one place (verified on
torch 2.13.0).

- ``GraphModule.compile_subgraph_reason``: Dynamo sets it on the graph it hands a backend
  (``torch/_dynamo/output_graph.py: OutputGraph.compile_and_call_fx_graph``) to the
  ``GraphCompileReason`` the graph was compiled for; its ``graph_break`` is True when the frame
  broke there, so more of the frame (a resume function, its graphs) runs after this graph.
- ``torch._dynamo.utils.orig_code_map``: the code objects Dynamo generated for the frames it compiled
  (keys; ``convert_frame`` records each), and the names of the resume functions that generated code
  calls after a graph break (globals ``__resume_at_<offset>_<n>``, ``resume_execution.py``): a frame
  running such code that has a resume function still to call continues after the call it is in.
- The Python frames of Dynamo's frame callback (``torch/_dynamo/convert_frame.py``) and of the wrapper
  ``torch.compile`` returns (``torch/_dynamo/eval_frame.py``, which installs the callback and calls the
  user's function): the frames between them on the stack are the callers of the frame being compiled
  inside that compiled call (``called_from_eager_code``).
- ``torch._subclasses.fake_tensor.FakeTensorMode``: fake inputs for re-planning a graph ahead of
  its call (``compile_fx`` takes the fake mode from its inputs, as it does under Dynamo), so
  nothing the size of its inputs is allocated.
"""

from __future__ import annotations

import dis
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any, Sequence

import torch


def graph_break_follows(gm: Any) -> bool:
    """Whether Dynamo compiled ``gm`` because its frame broke after it (code of the same frame runs
    next, and may hold more graphs of the step). False when unknown (no reason recorded)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return bool(getattr(reason, "graph_break", False))


def caller_resumes_after() -> bool:
    """Whether a frame up this thread's stack that runs code Dynamo generated (a caller of the frame being
    compiled now, compiled itself) still has a resume function to call after the call it is in: it broke
    at that call, and more of it, perhaps with graphs of the step, runs once this graph's frame returns.
    A graph compiled so is not its step's last though its own frame ends with it: a module whose
    ``forward`` breaks, called from a compiled ``forward`` that goes on to a head and a loss (Dynamo breaks
    the caller at the call and compiles the callee's frame apart); a Hugging Face BERT with gradient
    checkpointing compiles so, and its first step measured 1.099x its budget when the encoder's graph was
    planned as the step's only one. Every such frame is asked, the nearest and those above it: a graph
    taken for not the last when it is (a decorator's resume that only repacks outputs, as Hugging Face's
    ``forward`` wrappers have) costs a leaner first step and a re-plan once the step is known, never a
    step over its budget."""
    from torch._dynamo.utils import orig_code_map

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in orig_code_map and any(
                instruction.opname == "LOAD_GLOBAL" and instruction.offset > frame.f_lasti
                and str(instruction.argval).startswith("__resume_at")
                for instruction in dis.get_instructions(frame.f_code)):
            return True
        frame = frame.f_back
    return False


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIRS = tuple({os.path.realpath(sysconfig.get_paths()[key]) + os.sep for key in ("stdlib", "platstdlib")})


def called_from_eager_code() -> bool:
    """Whether the frame being compiled was called by code of the user's that runs eagerly inside the
    compiled call: Dynamo gave up on an enclosing frame (a break it cannot resume at, such as one inside a
    loop over blocks; the frame then runs eagerly and Dynamo compiles each frame it calls, apart) or
    never traced it. Eager code of the same step then runs before this graph and after it, and may call
    more compiled frames, with no graph break or compiled caller to say so (``graph_break_follows``,
    ``caller_resumes_after`` see neither): a block compiled apart from a model whose ``forward`` Dynamo
    skipped, with the embedding, the head and the loss run eagerly around it (planned as its step's only
    graph, its first step measured 1.546x its budget). The callers asked are those between Dynamo's frame
    callback and the nearest wrapper ``torch.compile`` made; frames of torch itself, of Python's standard
    library and code Dynamo generated do not count. False where no such wrapper is on the stack (a compile
    entered otherwise: unknown)."""
    from torch._dynamo import convert_frame, eval_frame
    from torch._dynamo.utils import orig_code_map

    frame, in_callback, eager_user_code = sys._getframe(1), False, False
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == convert_frame.__file__:
            in_callback, eager_user_code = True, False     # callers of the frame being compiled start above
        elif filename == eval_frame.__file__:
            if in_callback:
                return eager_user_code
        elif in_callback and not filename.startswith(_TORCH_DIR) and frame.f_code not in orig_code_map and \
                not os.path.realpath(filename).startswith(_STDLIB_DIRS):
            eager_user_code = True
        frame = frame.f_back
    return False


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
