"""Which part of a joint forward+backward graph each node belongs to.

AOTAutograd tags every node of the joint graph it traces with
``node.meta["partitioner_tag"]`` ("is_forward" / "is_backward"): what autograd
ran during the forward and during ``backward()``. That tag is what
``FlopCounterMode`` sees split into a forward and a backward count, so it is the
tag used here. Nodes without a tag (added by later graph passes, or a graph
traced by hand) fall back to dependency: a node is backward when it reads a
``tangents_*`` placeholder or a backward node, forward otherwise.
"""

from __future__ import annotations

from torch import fx

FORWARD = "forward"
BACKWARD = "backward"
_TAGS = {"is_forward": FORWARD, "is_backward": BACKWARD}


def _is_tangent(node: fx.Node) -> bool:
    return node.op == "placeholder" and str(node.target).startswith(("tangents", "bwd_seed", "bwd_base_offset"))


def node_phases(graph: fx.Graph) -> dict[str, str]:
    """Map every node name to "forward" or "backward" (the output node: "backward")."""
    phases: dict[str, str] = {}
    for node in graph.nodes:
        tagged = _TAGS.get(node.meta.get("partitioner_tag", ""))
        if tagged is not None:
            phases[node.name] = tagged
        elif node.op == "output" or _is_tangent(node):
            phases[node.name] = BACKWARD
        elif any(phases.get(arg.name) == BACKWARD for arg in node.all_input_nodes):
            phases[node.name] = BACKWARD
        else:
            phases[node.name] = FORWARD
    return phases


__all__ = ["FORWARD", "BACKWARD", "node_phases"]
