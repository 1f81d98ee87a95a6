"""The thin torch-private layer of remat's distributed support: what Dynamo's DDP optimizer
and FSDP2 are doing while a graph compiles, read from torch 2.13.0's internals.

Nothing here changes torch's state; each function returns plain numbers or None when the
context it looks for is absent (then remat plans the graph with the whole budget, as for
one process). Private APIs used, verified on torch 2.13.0:

- ``torch._dynamo.backends.distributed.SubmodCompiler``: Dynamo's DDP optimizer
  (``torch._dynamo.config.optimize_ddp``, on by default) splits the graph at DDP's bucket
  boundaries into ``submod_<i>`` of one ``split_gm`` and compiles them in forward order,
  each by calling the backend from ``SubmodCompiler.compile_submod``. No API hands the
  backend the other pieces, so ``ddp_pieces`` finds that frame on the Python stack.
- ``DistributedDataParallel._get_active_ddp_module()``: the DDP module whose forward is
  being traced (its parameters give the step's gradient bytes).
- FSDP2 (``torch.distributed.fsdp.fully_shard``): its hooks are wrapped in
  ``torch._dynamo.disable`` (``_fully_shard/_fsdp_common.py``), so the all-gathers and
  reduce-scatters run eagerly around the compiled graphs, and a module's forward compiles
  as its own graph, shared by every module of the same class. ``fsdp_unit`` finds the
  ``FSDPModule`` whose forward is compiling (the nearest ``self`` on the stack) and reads
  ``_get_fsdp_state()._state_ctx.all_states`` and each state's ``_fsdp_param_groups``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import fx

_MAX_FRAMES = 200  # how far up the stack to look; Dynamo + Inductor compile stacks are ~100 frames


def _frames():
    frame = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


@dataclass(frozen=True)
class DDPPieces:
    """The DDP optimizer's split of one Dynamo graph, seen while piece ``index`` compiles."""

    index: int                         # which piece is compiling (forward order)
    count: int                         # how many pieces the graph was split into
    split_id: int                      # identity of the split graph: pieces of one step share it
    forward_bytes: tuple[int, ...]     # per piece: bytes of the tensors its forward computes (Dynamo's meta)
    later_param_bytes: tuple[int, ...]  # per piece: bytes of the trainable parameters a later piece reads
    output_bytes: int = 0              # bytes of the tensors the last piece returns: the step's outputs (a bound)


def _forward_tensor_bytes(gm: fx.GraphModule) -> int:
    """Bytes of every tensor a Dynamo-level graph computes (its placeholders excluded)."""
    total = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        value = node.meta.get("example_value")
        values = value if isinstance(value, (tuple, list)) else (value,)
        for v in values:
            if isinstance(v, torch.Tensor):
                try:
                    total += int(v.numel()) * v.element_size()
                except (TypeError, RuntimeError):  # a symbolic size without a hint
                    pass
    return total


def _output_tensor_bytes(gm: fx.GraphModule) -> int:
    """Bytes of the tensors a Dynamo-level graph returns (each storage's owner once)."""
    output = next((n for n in gm.graph.nodes if n.op == "output"), None)
    if output is None:
        return 0
    seen, total = set(), 0
    nodes: list[fx.Node] = []
    fx.node.map_arg(output.args, nodes.append)
    for node in nodes:
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and node.name not in seen:
            seen.add(node.name)
            try:
                total += int(value.numel()) * value.element_size()
            except (TypeError, RuntimeError):  # a symbolic size without a hint
                pass
    return total


def _piece_number(name: str) -> int:
    tail = name.rsplit("_", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _trainable(value: Any) -> bool:
    return isinstance(value, torch.nn.Parameter) and value.requires_grad


def later_param_bytes(split: fx.GraphModule, ordered: list[tuple[str, Any]]) -> tuple[int, ...]:
    """Per piece k of the DDP optimizer's ``split`` (``ordered``: its pieces in forward order), the
    bytes of the trainable parameters read by some piece after k.

    A parameter's gradient exists from the backward of the last piece that reads it: a parameter
    read by pieces i < j (a tied embedding and LM head) gets j's part of its gradient first, and
    the autograd engine holds that part until i's backward adds its own (then it becomes
    ``.grad``). Parameters are the split's placeholders a piece takes (Dynamo lifts them as inputs)
    or, in older traces, a piece's own ``get_attr`` nodes."""
    index = {name: k for k, (name, _) in enumerate(ordered)}
    last_reader: dict[int, tuple[int, int]] = {}   # id(parameter) -> (last piece reading it, its bytes)

    def read(k: int, value: Any) -> None:
        if _trainable(value):
            nbytes = value.numel() * value.element_size()
            last_reader[id(value)] = (max(k, last_reader.get(id(value), (k, 0))[0]), nbytes)

    for node in split.graph.find_nodes(op="call_module"):
        k = index.get(str(node.target))
        if k is None:
            continue
        for arg in node.all_input_nodes:
            if arg.op == "placeholder":
                read(k, arg.meta.get("example_value"))
        piece = ordered[k][1]
        if isinstance(piece, fx.GraphModule):
            for attr in piece.graph.find_nodes(op="get_attr"):
                read(k, getattr(piece, str(attr.target), None))
    return tuple(sum(nbytes for last, nbytes in last_reader.values() if last > k) for k in range(len(ordered)))


def ddp_pieces() -> Optional[DDPPieces]:
    """Where the graph now compiling sits in the DDP optimizer's split, or None when the
    backend was not called by the DDP optimizer."""
    try:
        from torch._dynamo.backends.distributed import SubmodCompiler
    except ImportError:
        return None
    for frame in _frames():
        compiler = frame.f_locals.get("self")
        if frame.f_code.co_name != "compile_submod" or not isinstance(compiler, SubmodCompiler):
            continue
        piece = frame.f_locals.get("input_mod")
        # Pieces already compiled are renamed "compiled_submod_<i>"; the others are "submod_<i>".
        ordered = sorted(compiler.module.named_children(), key=lambda nm: _piece_number(nm[0]))
        index = next((i for i, (_, mod) in enumerate(ordered) if mod is piece), None)
        if index is None:
            return None
        sizes = tuple(_forward_tensor_bytes(mod) if isinstance(mod, fx.GraphModule) else 0 for _, mod in ordered)
        last = ordered[-1][1] if ordered else None
        outputs = _output_tensor_bytes(last) if isinstance(last, fx.GraphModule) else 0
        return DDPPieces(index=index, count=len(ordered), split_id=id(compiler.module), forward_bytes=sizes,
                         output_bytes=outputs, later_param_bytes=later_param_bytes(compiler.module, ordered))
    return None


def ddp_param_grad_bytes() -> Optional[int]:
    """Bytes of the gradients of the active DDP module's trainable parameters, or None."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    module = DistributedDataParallel._get_active_ddp_module()
    if module is None:
        return None
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


@dataclass(frozen=True)
class FSDPUnit:
    """The FSDP2 unit whose forward is compiling, and the step's FSDP memory outside graphs."""

    module_class: str
    repeats: int                  # FSDP units of this class: the compiled graph runs once per unit
    unit_unsharded_bytes: int     # all-gathered parameters of one unit (freed after its forward and backward)
    unit_sharded_bytes: int       # this rank's shard of one unit's parameters: its reduce-scattered gradients
    root_unsharded_bytes: int     # the root's own parameters, all-gathered for the whole step
    root_grad_bytes: int          # the root's own parameters' unsharded gradients, reduced after every unit's
    other_unit_unsharded_bytes: int  # the largest non-root unit of another class (0 if none): it may be prefetched
    reduce_scatter_buffers: int   # reduce-scatter input buffers FSDP keeps after their collective
    world_size: int


def _state_param_bytes(state: Any) -> tuple[int, int]:
    """(unsharded bytes, sharded bytes on this rank) of one FSDP state's parameters."""
    unsharded = sharded = 0
    for group in getattr(state, "_fsdp_param_groups", None) or []:
        for param in group.fsdp_params:
            dtype = param.param_dtype or param.orig_dtype
            itemsize = torch.empty((), dtype=dtype).element_size()
            unsharded += int(param._orig_size.numel()) * itemsize
            orig_itemsize = torch.empty((), dtype=param.orig_dtype).element_size()
            sharded += int(param.padded_sharded_param_size.numel()) * orig_itemsize
    return unsharded, sharded


def fsdp_unit() -> Optional[FSDPUnit]:
    """The FSDP2 unit whose forward is being compiled, or None outside FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    for frame in _frames():
        module = frame.f_locals.get("self")
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        states = list(state._state_ctx.all_states) or [state]
        cls = type(module)
        same = [s for s in states if any(type(m) is cls for m in s._modules)]
        root = next((s for s in states if s._is_root), None)
        unit_bytes, unit_sharded = _state_param_bytes(state)
        others = [_state_param_bytes(s)[0] for s in states if s not in same and s is not root]
        root_bytes = _state_param_bytes(root)[0] if root is not None and root is not state else 0
        groups = state._fsdp_param_groups
        mesh = groups[0].mesh_info.mesh if groups else None
        # FSDPCommContext.reduce_scatter_max_input_buffers (1 by default on torch 2.13):
        # post_backward keeps that many reduce-scatter inputs alive until the next one.
        buffers = int(getattr(groups[0].comm_ctx, "reduce_scatter_max_input_buffers", 1)) if groups else 1
        return FSDPUnit(
            module_class=cls.__name__.removeprefix("FSDP"),
            repeats=max(len(same), 1),
            unit_unsharded_bytes=unit_bytes,
            unit_sharded_bytes=unit_sharded,
            root_unsharded_bytes=root_bytes,
            root_grad_bytes=root_bytes,
            other_unit_unsharded_bytes=max(others, default=0),
            reduce_scatter_buffers=buffers,
            world_size=mesh.size() if mesh is not None else 1,
        )
    return None
