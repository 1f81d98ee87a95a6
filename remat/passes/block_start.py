"""A saved set shaped like full per-block checkpointing, for the smallest-peak search to start from.

Most models run a stack of repeated blocks (a transformer's layers, a ResNet's stages' blocks), and
the alternative users know is to checkpoint each block: keep only what enters a block, recompute the
block's inside during its own backward. In one joint graph the saved set that does this is known
from where Dynamo traced each node (``NodeFacts.module_calls``):

- a *block* is one call of a module whose class is called at two or more places under a container
  index (``layers.0``, ``blocks.3``: what ``nn.ModuleList``/``nn.Sequential`` hold) and that calls
  modules of its own (a leaf such as a ``Linear`` in a ``Sequential`` is no block); a node belongs
  to the outermost block among the calls it was traced in (a decoder layer, not its attention);
- saved: every forward value that a block reads from outside itself (its inputs: the residual
  stream, a mask or position bias shared by every block, the encoder's output that each decoder
  block reads), outside every block what the free min-cut saves there (``mincut.min_cut_saved``:
  what PyTorch's partitioner does with the part of a graph no checkpoint covers, where a value
  cheap to rebuild from saved ones is rebuilt, not saved), and nothing else of a block's inside.

Why the min-cut outside the blocks, not every value the backward reads there (what eager autograd
saves): that is per-block checkpointing as a user gets it from ``torch.compile``, the baseline the
floor is held against. On a drawn MobileNet-style CNN (GroupNorm, SiLU; cnn-1403) the old rule saved
the stem's and the head's GroupNorm outputs (a SiLU's gradient reads them; the stem's is 196 kB), and
Inductor's code for that start peaked at 6,325,640 B, the search's smallest-peak plan measured
6,305,488 B, against per-block checkpointing's measured 6,128,848 B; from the new start the search
found a plan measuring 6,108,880 B. Over 15 never-run corpus models with blocks (benchmarks/results/
fidelity-floors-blockstart-cpu.md) the floor fell on two CNNs (0.91x, 0.82x: both had sat at checkpointing's peak)
and a random net (0.94x), and rose on one language model (rand-1445, 1.034x: a plan the simulator ranks lower
checks higher).

Why the search needs it: descents that drop one value at a time from saving everything or from the
min-cut stop in plans whose recompute chains cross block boundaries, so a value recomputed for one
block's backward is held until another's (measured: a T5 whose smallest-peak plan held recomputed
values of several layers at once peaked 1.67x above per-block checkpointing's measured peak). With
the cut at every block's inputs, each block's recomputation starts and ends inside its own backward.
The search still descends from this start, so its answer's peak is at most this plan's (simulated).

``block_checkpoint_saved`` is None when the graph has fewer than two blocks or no module stack.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Mapping, Optional

from .joint_graph import JointGraphFacts
from .mincut import min_cut_saved

_CONTAINER_INDEX = re.compile(r"[._]\d+(@\d+)?$")


def blocks_of(facts: JointGraphFacts) -> Mapping[str, str]:
    """Forward node -> the block call it belongs to (outermost repeated container element);
    nodes outside every block are absent. A node Dynamo recorded no module for (one the backward's
    decomposition or a joint-graph pass made, e.g. a mask a ReLU's gradient reads) belongs to the
    block its inputs come from, when that is one block."""
    calls_of_class: dict[str, set[str]] = defaultdict(set)
    for node in facts.nodes.values():
        # a call with a module call inside it (a leaf module, a Linear, is no block to checkpoint)
        for (call, cls), _inner in zip(node.module_calls, node.module_calls[1:]):
            if _CONTAINER_INDEX.search(call):
                calls_of_class[cls].add(call)
    repeated = {cls for cls, calls in calls_of_class.items() if len(calls) >= 2}
    block: dict[str, str] = {}
    for name in facts.order:
        node = facts.nodes[name]
        if node.role != "forward":
            continue
        if node.module_calls:
            outermost = next((call for call, cls in node.module_calls
                              if cls in repeated and _CONTAINER_INDEX.search(call)), None)
        else:   # made by a pass or a decomposition outside Dynamo's trace: where its inputs are
            inside = {block[i] for i in node.inputs if i in block}
            outermost = inside.pop() if len(inside) == 1 else None
        if outermost is not None:
            block[name] = outermost
    return block


def input_free_values(facts: JointGraphFacts) -> frozenset[str]:
    """Forward values computed from no graph input (constants and what is made only from them)."""
    free: set[str] = set()
    for name in facts.order:
        node = facts.nodes[name]
        if node.role == "forward" and all(i in free for i in node.inputs):
            free.add(name)
    return frozenset(free)


def block_checkpoint_saved(facts: JointGraphFacts) -> Optional[frozenset[str]]:
    """The saved set of checkpointing every block (module docstring), or None without two blocks."""
    block = blocks_of(facts)
    if len(set(block.values())) < 2:
        return None
    saved_outside = min_cut_saved(facts)
    rebuilt_from_nothing = input_free_values(facts)
    saved = set()
    for name in facts.order:
        node = facts.nodes[name]
        if (node.role != "forward" or not node.is_tensor or node.is_multi_output
                or name in rebuilt_from_nothing):
            continue
        here = block.get(name)
        readers = [block.get(user) for user in facts.users[name] if facts.nodes[user].role == "forward"]
        if here is None:
            if name in saved_outside or any(reader is not None for reader in readers):
                saved.add(name)
        elif any(reader != here for reader in readers):
            saved.add(name)
    return frozenset(saved)


__all__ = ["block_checkpoint_saved", "blocks_of", "input_free_values"]
