"""Read an AOTAutograd joint forward+backward graph into plain facts.

``read_joint_graph`` walks the FX graph once and returns ``JointGraphFacts``:
node names in order, each node's inputs, role (primal, tangent, forward,
backward), the storages it allocates or aliases, its cost, and the reason it may
never be recomputed, if any. Everything downstream (solvers, memory simulation,
report) works on these facts, not on ``fx.Node`` objects.

Roles. Placeholders named ``primals_*`` (and forward RNG seeds) are forward
inputs; ``tangents_*`` (and backward RNG seeds) are backward inputs. A node is
*backward* when it depends on a backward input (or is tagged must-be-in-backward);
every other op is a *forward candidate*: computed in the forward, or recomputed
in the backward if the plan says so.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Mapping, Optional

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

from .._torch_dynamo import module_calls
from ..cost_model.costs import NodeCost
from ..cost_model.inductor_rules import CHEAP_TO_RECOMPUTE_OPS, COLLECTIVE_NAMESPACES, INLINABLE_OPS, REDUCTION_OPS
from .graph_analysis import GraphAnalysis
from ..cost_model.tensors import (
    aliases_input,
    concrete_int,
    is_mutating_op,
    is_sym_node,
    is_tensor_node,
    iter_tensors,
    node_val,
    op_tags,
    tensor_nbytes,
)


@dataclass(frozen=True)
class NodeFacts:
    name: str
    role: str                      # primal | tangent | forward | backward | output
    op: str                        # "aten.mm.default", "placeholder", ...
    inputs: tuple[str, ...]
    allocs: tuple[tuple[str, int], ...]   # storages this node allocates: (storage id, bytes)
    value_storages: tuple[str, ...]       # storages this node's value refers to (own or aliased)
    is_tensor: bool
    is_sym: bool
    is_multi_output: bool          # its value is a tuple: it cannot be saved, only its getitems can
    is_getitem: bool
    getitem_index: Optional[int]   # for getitem nodes: which output of the producer
    is_view: bool                  # its value aliases its first tensor input
    inlinable: bool                # Inductor computes it inside its consumers' kernels when they can fuse it
    fusible_consumer: bool         # Inductor can fuse a producer into this op's kernel (pointwise, reduction, view)
    free_to_recompute: bool        # fusible/cheap: recomputing it costs (almost) nothing
    recompute_ban: Optional[str]   # why it may never be recomputed, or None
    cost: NodeCost
    numel: int = 0                 # elements of its (first) tensor output, at the size hint: Inductor's loop size
    inner_reduction: bool = False  # reduces its input's innermost dims (a row reduction: its loop nests inside the rows')
    device: str = ""               # device type of its (first) tensor output: "cpu", "cuda", ...
    shape: tuple[int, ...] = ()    # shape of its (first) tensor output, at the size hint
    itemsize: int = 0              # bytes per element of its (first) tensor output
    strides: tuple[int, ...] = ()  # strides of its (first) tensor output as traced (eager's), at the size hint
    scratch_bytes: int = 0         # a library call's working memory beyond its outputs, measured (library_scratch.py)
    # forward nodes: the module calls it was traced in, outermost first, as (call, class) pairs
    # (``_torch_dynamo.module_calls``); empty for other roles and where Dynamo recorded none
    module_calls: tuple[tuple[str, str], ...] = ()

    @property
    def alloc_bytes(self) -> int:
        return sum(size for _, size in self.allocs)


@dataclass(frozen=True)
class JointGraphFacts:
    order: tuple[str, ...]
    nodes: Mapping[str, NodeFacts]
    users: Mapping[str, tuple[str, ...]]
    fwd_outputs: tuple[str, ...]
    bwd_outputs: tuple[str, ...]
    forward_required: frozenset[str]      # forward candidates the forward outputs (or side effects) need
    needed_by_backward: tuple[str, ...]   # forward candidates and primals read by a backward node
    # Whether the step keeps the forward's outputs alive through the backward (the caller holds them).
    # False: they die when the forward returns, unless the backward reads them; the usual training step
    # ``loss_fn(model(x)).backward()`` drops them before its backward starts (``RematOptions.outputs_held``).
    outputs_held: bool = False
    # What an eager loss on the forward's outputs holds between the forward and the backward, next to what the
    # forward keeps for its backward (``eager_loss_reserve_bytes``); 0 for a graph that is not alone in its step
    # (its outputs feed a later graph or a DDP piece, accounted by the step) or that computes its own loss.
    eager_loss_bytes: int = 0
    # The values PyTorch's default partitioner (plain Inductor's) saves for this graph, None when not known:
    # a saved set whose partition plain Inductor is measured to reach, which the planner starts from too.
    default_saved: Optional[frozenset[str]] = None
    # What the planner works out once for this graph (bans, min-cut, kernel constants, ...), filled
    # lazily by the modules that own each part; a new one for every facts object, ``replace`` included.
    analysis: GraphAnalysis = field(default_factory=GraphAnalysis, init=False, compare=False, repr=False)

    def position(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.order)}


# An eager loss on a graph's outputs (cross-entropy on logits, the usual ``F.cross_entropy(model(x), y)`` next to a
# compiled model; measured on the zoo GPT, alone and under DDP) holds, when the backward starts, its log-softmax
# of the outputs, the gradient of that, and the outputs' gradient it hands the graph's backward: three tensors the
# size of the outputs, next to everything the forward keeps. remat never sees the loss; this is what it reserves.
LOSS_OUTPUT_COPIES = 3


def eager_loss_reserve_bytes(facts: JointGraphFacts) -> int:
    """What an eager loss on the graph's outputs is taken to hold between the forward and the backward:
    ``LOSS_OUTPUT_COPIES`` times the bytes of the outputs that get a gradient (the backward's incoming
    gradients, its tangents), for a graph none of whose outputs with a gradient is a scalar. 0 for one
    that returns a scalar with a gradient: it computes its loss (a Hugging Face model given its labels
    returns the loss and the logits; the logits' gradient is zeros, no eager loss reads them)."""
    tangents = [node for name, node in facts.nodes.items() if node.role == "tangent" and name.startswith("tangents")]
    if not tangents or any(node.numel <= 1 for node in tangents):
        return 0
    return LOSS_OUTPUT_COPIES * sum(node.numel * node.itemsize for node in tangents)


def _placeholder_role(node: fx.Node) -> str:
    target = str(node.target)
    if target.startswith("tangents") or target.startswith("bwd_seed") or target.startswith("bwd_base_offset"):
        return "tangent"
    return "primal"


def _randomness_disabled(node: fx.Node) -> bool:
    """True for ops tagged random only through a ``dropout_p`` argument that is 0 here
    (scaled-dot-product attention kernels): they are deterministic."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return False
    for index, argument in enumerate(schema.arguments):
        if argument.name == "dropout_p":
            if argument.name in node.kwargs:
                value = node.kwargs[argument.name]
            elif index < len(node.args):
                value = node.args[index]
            else:
                value = argument.default_value
            return isinstance(value, (int, float)) and float(value) == 0.0
    return False


def is_collective(node: fx.Node) -> bool:
    """True for a call to an op that communicates between ranks, or waits for such an op
    (``wait_tensor``): one of ``COLLECTIVE_NAMESPACES``."""
    if node.op != "call_function":
        return False
    qualified = getattr(node.target, "_qualified_op_name", None)  # "ns::op" on overloads and packets
    namespace = qualified.split("::")[0] if isinstance(qualified, str) else getattr(node.target, "namespace", "")
    return namespace in COLLECTIVE_NAMESPACES


# Views given explicit strides (GroupNorm's decomposition makes one): their values depend on the memory
# layout of their input, not only on its values. Inductor lays out the values it computes in the backward
# (and the saved values it hands the backward) as it chooses, e.g. channels-last after a CPU convolution,
# so such a view recomputed there can read other elements than the forward's did (a VGG with GroupNorm:
# gradients 32% off plain Inductor's). Saving the view is always right: it is only as big as its base.
LAYOUT_READING_VIEWS = frozenset({"as_strided", "as_strided_", "as_strided_copy", "as_strided_scatter", "_reshape_alias"})


def recompute_ban_reason(node: fx.Node) -> Optional[str]:
    """Why ``node`` may never be recomputed, or None if recomputing it is safe."""
    if node.op != "call_function":
        return None
    if torch.Tag.nondeterministic_seeded in op_tags(node) and not _randomness_disabled(node):
        return "random op: recomputing it would draw fresh random numbers (its seed is not replayed)"
    if is_mutating_op(node):
        return "mutates its input: recomputing it would apply the mutation twice"
    if is_collective(node):
        return "collective: recomputing it would communicate again"
    if _op_name(node) in LAYOUT_READING_VIEWS:
        return ("reads its input's memory by explicit strides: recomputed in the backward, where Inductor may lay "
                "its input out differently, it would read other elements")
    if node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE:
        return "a checkpoint policy marked it MUST_SAVE"
    if node.target is not operator.getitem and node.is_impure(impure_random=False):
        return "has side effects"
    if not is_tensor_node(node) and not is_sym_node(node):
        return "not a tensor"
    return None


def _is_free_to_recompute(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or aliases_input(node):
        return True
    if torch.Tag.pointwise in op_tags(node):
        return True
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet.__name__.split(".")[-1] in CHEAP_TO_RECOMPUTE_OPS


def _op_name(node: fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__.split(".")[-1] if packet is not None else ""


def _is_inlinable(node: fx.Node) -> bool:
    """Pointwise-like ops Inductor evaluates inside the consumer's loop instead of writing a buffer."""
    if node.op != "call_function" or isinstance(node_val(node), (list, tuple)) or aliases_input(node):
        return False
    return torch.Tag.pointwise in op_tags(node) or _op_name(node) in INLINABLE_OPS


def _is_fusible_consumer(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or aliases_input(node) or _is_inlinable(node):
        return True
    return torch.Tag.reduction in op_tags(node) or _op_name(node) in REDUCTION_OPS


def _is_inner_reduction(node: fx.Node) -> bool:
    """True for a reduction over the innermost dims of its input (RMSNorm's mean over the last
    dim), whose result a loop over the same rows can use in the same outer loop."""
    if node.op != "call_function" or not _is_fusible_consumer(node) or _is_inlinable(node) or aliases_input(node):
        return False
    source = node.args[0] if node.args else None
    value = node_val(source) if isinstance(source, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return False
    ndim = value.dim()
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return True
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims or not all(isinstance(d, int) for d in dims):
        return not dims
    wanted = sorted(d % ndim for d in dims) if ndim else []
    return wanted == list(range(ndim - len(wanted), ndim))


def _storages(node: fx.Node, value_storages: dict[str, tuple[str, ...]]) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
    """(allocs, value storages) of one node under the storage model described in the module doc."""
    if node.op == "placeholder":
        size = sum(tensor_nbytes(t) for t in iter_tensors(node_val(node)))
        return ((node.name, size),) if size else (), ((node.name,) if size else ())
    if node.op != "call_function" or not is_tensor_node(node):
        return (), ()
    if node.target is operator.getitem:
        source, index = node.args[0], node.args[1]
        parent = value_storages.get(source.name, ())
        if len(parent) > 1 and isinstance(index, int) and index < len(parent):
            return (), (parent[index],)
        return (), parent
    if aliases_input(node):   # views, and _unsafe_view (no alias annotation, still no copy)
        base = next((a for a in node.all_input_nodes if is_tensor_node(a)), None)
        return (), (value_storages.get(base.name, ()) if base is not None else ())
    val = node_val(node)
    if isinstance(val, (list, tuple)):
        allocs = tuple((f"{node.name}#{i}", tensor_nbytes(t)) for i, t in enumerate(val) if isinstance(t, torch.Tensor))
        return allocs, tuple(sid for sid, _ in allocs)
    return ((node.name, tensor_nbytes(val)),), (node.name,)


def backward_closure(graph: fx.Graph) -> set[str]:
    """The names of a joint graph's backward nodes: the tangents (and backward seeds), what the partitioner
    tags for the backward, and everything computed from them."""
    backward: set[str] = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        is_seed = node.op == "placeholder" and _placeholder_role(node) == "tangent"
        tagged = node.meta.get("partitioner_tag") == "must_be_in_backward"
        if is_seed or tagged or any(a.name in backward for a in node.all_input_nodes):
            backward.add(node.name)
    return backward


def _ancestors(roots: list[fx.Node], stop: set[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node.name in seen or node.name in stop:
            continue
        seen.add(node.name)
        stack.extend(node.all_input_nodes)
    return seen


def read_joint_graph(graph: fx.Graph, costs: Mapping[str, NodeCost], num_fwd_outputs: int,
                     outputs_held: bool = False) -> JointGraphFacts:
    """Collect the facts the planner needs; requires ``costs`` for every node name.
    ``outputs_held``: see ``JointGraphFacts.outputs_held``."""
    output = graph.find_nodes(op="output")[0]
    flat_outputs = [o for o in torch.utils._pytree.tree_leaves(output.args)]
    fwd_outputs = [o for o in flat_outputs[:num_fwd_outputs] if isinstance(o, fx.Node)]
    bwd_outputs = [o for o in flat_outputs[num_fwd_outputs:] if isinstance(o, fx.Node)]
    backward = backward_closure(graph)

    side_effect_roots = [n for n in graph.nodes if n.op == "call_function" and n.name not in backward and is_mutating_op(n)]
    forward_required = _ancestors(fwd_outputs + side_effect_roots, stop=backward)

    nodes: dict[str, NodeFacts] = {}
    users: dict[str, tuple[str, ...]] = {}
    value_storages: dict[str, tuple[str, ...]] = {}
    order: list[str] = []
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder":
            role = _placeholder_role(node)
        else:
            role = "backward" if node.name in backward else "forward"
        allocs, vstorages = _storages(node, value_storages)
        value_storages[node.name] = vstorages
        nodes[node.name] = NodeFacts(
            name=node.name,
            role=role,
            op=node.op if node.op != "call_function" else str(node.target),
            inputs=tuple(a.name for a in node.all_input_nodes),
            allocs=allocs,
            value_storages=vstorages,
            is_tensor=is_tensor_node(node),
            is_sym=is_sym_node(node),
            is_multi_output=isinstance(node_val(node), (list, tuple)),
            is_getitem=node.target is operator.getitem,
            getitem_index=node.args[1] if node.target is operator.getitem and isinstance(node.args[1], int) else None,
            is_view=aliases_input(node),
            inlinable=_is_inlinable(node),
            fusible_consumer=_is_fusible_consumer(node),
            free_to_recompute=_is_free_to_recompute(node),
            recompute_ban=recompute_ban_reason(node),
            cost=costs[node.name],
            numel=next((concrete_int(t.numel()) for t in iter_tensors(node_val(node))), 0),
            inner_reduction=_is_inner_reduction(node),
            device=next((t.device.type for t in iter_tensors(node_val(node))), ""),
            shape=next((tuple(concrete_int(d) for d in t.shape) for t in iter_tensors(node_val(node))), ()),
            itemsize=next((t.element_size() for t in iter_tensors(node_val(node))), 0),
            strides=next((tuple(concrete_int(d) for d in t.stride()) for t in iter_tensors(node_val(node))), ()),
            module_calls=module_calls(node) if role == "forward" else (),
        )
        users[node.name] = tuple(u.name for u in node.users if u.op != "output")
        order.append(node.name)

    needed = [
        name for name in order
        if nodes[name].role in ("forward", "primal")
        and any(nodes[u].role == "backward" for u in users[name])
    ]
    return JointGraphFacts(
        order=tuple(order),
        nodes=nodes,
        users=users,
        fwd_outputs=tuple(o.name for o in fwd_outputs),
        bwd_outputs=tuple(o.name for o in bwd_outputs),
        forward_required=frozenset(n for n in forward_required if nodes.get(n) is not None and nodes[n].role == "forward"),
        needed_by_backward=tuple(needed),
        outputs_held=outputs_held,
    )
