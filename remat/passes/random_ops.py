"""Keep only the random part of a random op unrecomputable.

``aten.native_dropout(x, p, train)`` returns ``(x * mask * scale, mask)``. The op
draws random numbers, so it may never be recomputed, and without this pass both
its outputs would have to be saved: the float output as well as the bool mask.
``split_dropout_outputs`` rewrites every use of the float output into
``x * mask * scale`` (pointwise, free to recompute), so only the mask — a quarter
of the bytes for fp32 — has to be kept. The values equal the op's own output up
to floating-point rounding of the multiplication order.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

_DROPOUT = torch.ops.aten.native_dropout.default


def split_dropout_outputs(graph: fx.Graph) -> int:
    """Rewrite uses of native_dropout's output as ``x * mask * scale``; return how many ops changed.

    Requires a functional (AOTAutograd) graph; guarantees the graph still lints.
    """
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _DROPOUT:
            continue
        x, p = node.args[0], float(node.args[1])
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        if train is False or p >= 1.0:
            continue
        getitems = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        output = getitems.get(0)
        if output is None or not output.users:
            continue
        # New nodes go right after the dropout op: before every user of its output.
        mask = getitems.get(1)
        if mask is None:
            with graph.inserting_after(node):
                mask = graph.call_function(operator.getitem, (node, 1))
            mask.meta["val"] = node.meta["val"][1]
        else:
            node.append(mask)
        with graph.inserting_after(mask):
            masked = graph.call_function(torch.ops.aten.mul.Tensor, (x, mask))
        masked.meta["val"] = output.meta["val"]
        with graph.inserting_after(masked):
            scaled = graph.call_function(torch.ops.aten.mul.Tensor, (masked, 1.0 / (1.0 - p)))
        scaled.meta["val"] = output.meta["val"]
        output.replace_all_uses_with(scaled)
        graph.erase_node(output)
        changed += 1
    if changed:
        graph.lint()
    return changed
