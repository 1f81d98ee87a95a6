"""The memory simulator: the peak of a planned forward and backward as Inductor will run them.

One entry point, ``evaluate(facts, chosen_saved) -> Evaluated``: the ground truth every solver
answers to. It closes a saved set into a partition, schedules the backward, builds the steps
Inductor's kernels take and walks their memory, and charges the recompute time of that
schedule. The stages, each a module:

- ``schedule``: the partition a saved set closes into (``partition_nodes``), the backward's
  order with its recompute regions (``backward_order``: the rewrite emits the same order),
  and their simulation (``simulate_partition``, ``memory_steps``);
- ``shared_storage``: at most one saved value per storage (the partition's rule);
- ``kernel_facts``: what the kernel model needs of each node (its kind, layout, buffers),
  once per graph, and how storages are named; ``returned_views``: views Inductor copies when a
  graph returns them (a saved view of a loop value laid out unlike eager);
- ``kernel_steps``: the forward and backward graphs as steps in Inductor's kernel order, with
  ``addmm_fusion`` (an mm feeding one add runs where the add runs, as Inductor's post-grad
  ``addmm`` pattern places it);
- ``kernel_schedule`` (with ``kernel_lowering``, ``kernel_fusion`` and ``peak_reorder``): which
  buffers Inductor's CPU backend allocates for one compiled graph, and when (the kernels in the
  order Inductor's ``reorder_for_peak_memory`` keeps);
- ``memory_timeline``: the live bytes along the steps, with Inductor's in-place and buffer
  reuse (``simulate_memory``);
- ``evaluation``: ``evaluate`` itself, and ``partition_of`` (what a saved set saves, unsimulated).

Every stage is a pure function of the joint graph's facts and the saved set; what is worked
out once per graph is kept in the facts' ``GraphAnalysis``, never in a module.
"""

from .evaluation import Evaluated, evaluate, partition_of
from .memory_timeline import MemorySimulation, Step

__all__ = ["Evaluated", "MemorySimulation", "Step", "evaluate", "partition_of"]
