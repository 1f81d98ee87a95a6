"""At most one saved value per storage: the rule that keeps donated buffers safe.

AOTAutograd *donates* to the backward every saved tensor that does not alias a forward
input or output (``torch/_functorch/_aot_autograd/graph_compile.py``,
``collect_fw_donated_buffer_idxs``, checked on torch 2.13): Inductor may then write a
backward result into that tensor's buffer once the tensor's last reader has run. Its alias
check does not look at the saved tensors among themselves. So when two saved values share
one storage (``relu`` and ``relu.view(-1, d)``), Inductor sees two unrelated donated
inputs, may reuse one's buffer in place (``buf41 = relu; del relu  # reuse``) and
schedule that write before a kernel that reads the other: the backward then reads
overwritten data, and a gradient is silently wrong (issue 15: a weight's gradient off by
100% while the loss is equal).

The rule: when several saved values share a storage, the plan saves the value that owns the
storage (the node that allocates it) and rebuilds the others in the backward as views of it,
which costs no memory and no compute; unless one of them is a view that may not be rebuilt (a view
by explicit strides, ``joint_graph.LAYOUT_READING_VIEWS``): then that view is the one saved, and
the owner, where the backward needs it, is recomputed. Views of a primal (a transposed weight) share the input's
storage, which AOTAutograd never donates, so they are left as the plan chose them. One saved value
per storage cannot race with itself.
"""

from __future__ import annotations

from typing import AbstractSet, Optional

from ..passes.joint_graph import JointGraphFacts
from .kernel_facts import storage_owner


def _storage_owner(facts: JointGraphFacts, storage: str) -> Optional[str]:
    """The node whose value *is* ``storage`` (not a view of it): the node that allocates it
    (``kernel_facts.storage_owner`` names it), or for one output of a multi-output op, the
    getitem that selects that output (found by a walk: only such storages need one)."""
    allocator = facts.nodes.get(storage_owner(storage))
    if allocator is None or not allocator.is_multi_output:
        return None if allocator is None else allocator.name
    return next((name for name in facts.users[allocator.name]
                 if facts.nodes[name].is_getitem and facts.nodes[name].value_storages == (storage,)), None)


def shared_storage_groups(facts: JointGraphFacts, saved: AbstractSet[str]) -> dict[str, tuple[str, list[str]]]:
    """The storages an intermediate owns that two or more of ``saved`` refer to: storage ->
    (its owner, those values, sorted). Storages of primals are left out: AOTAutograd never
    donates a saved tensor that aliases an input."""
    by_storage: dict[str, list[str]] = {}
    for name in saved:
        for storage in facts.nodes[name].value_storages:
            by_storage.setdefault(storage, []).append(name)
    groups = {}
    for storage, names in sorted(by_storage.items()):
        if len(names) < 2:
            continue
        owner = _storage_owner(facts, storage)
        if owner is None:   # every storage a value refers to is allocated by some node
            raise RuntimeError(f"remat: no node of the joint graph allocates storage {storage!r}, which the saved "
                               f"values {sorted(names)} share; cannot make the plan save it once.")
        if facts.nodes[owner].role == "forward":
            groups[storage] = (owner, sorted(names))
    return groups


def one_value_per_storage(facts: JointGraphFacts, saved: AbstractSet[str]) -> Optional[set[str]]:
    """``saved`` with every group of ``shared_storage_groups`` replaced by the storage's owner, or
    None when there is none. The dropped values are views of the owner, so the caller's closure
    rebuilds them in the backward from it. A view of the group that may not be recomputed is kept
    instead of the owner (the closure then recomputes the owner where the backward reads it)."""
    groups = shared_storage_groups(facts, saved)
    if not groups:
        return None
    result = set(saved)
    for owner, names in groups.values():
        result.difference_update(names)
        unrebuildable = [name for name in names if name != owner and facts.nodes[name].is_view
                         and facts.nodes[name].recompute_ban is not None]
        result.update(unrebuildable or [owner])
    return result
