"""Diagnostic: Inductor's real kernels for a zoo model's compiled graphs next to the simulator's.

    python tools/kernel_compare.py MODEL BUDGET [fw|bw]

For the chosen graph (default bw) prints, in execution order, Inductor's scheduler nodes (each
with the FX node it was lowered from and the bytes of its buffers, "removed" when codegen dropped
the buffer) and then remat's kernel steps (the node whose step carries the kernel, its allocations
and phantom bytes). BUDGET is in GB (1 GB = 1e9 bytes) or "none".
"""
import sys

import torch

import torch._inductor.codegen.wrapper as wrapper
from torch._inductor.virtualized import V

import remat
from remat.simulator.schedule import memory_steps, partition_nodes
from remat.testing.zoo import ZOO

graphs = []
orig_init = wrapper.EfficientPeakEstimate.__init__


def record(self):
    orig_init(self)
    rows = []
    for snode in V.graph.scheduler.nodes:
        for sub in snode.get_nodes():
            origin = getattr(sub.node, "origin_node", None)
            outs = [(b.get_name(), b.mpi_buffer.size_alloc) for b in sub.get_outputs()]
            rows.append((snode.get_name(), type(sub).__name__, origin.name if origin is not None else "?", outs))
    graphs.append((rows, self.overall_peak_memory, set(V.graph.removed_buffers)))


wrapper.EfficientPeakEstimate.__init__ = record
torch._inductor.config.fx_graph_cache = False  # a cache hit skips the scheduler


def main() -> None:
    name, b = sys.argv[1], sys.argv[2]
    which = sys.argv[3] if len(sys.argv) > 3 else "bw"
    model, inputs = ZOO[name]()
    be = remat.backend(None if b == "none" else float(b), headroom_fraction=0.0)
    c = torch.compile(model, backend=be)
    c(*inputs).float().sum().backward()
    rows, estimate, _ = graphs[-1] if which == "bw" else graphs[0]
    removed = graphs[-1][2] if which == "bw" else graphs[0][2]
    print(f"== Inductor {which}: estimated peak {estimate} bytes")
    last = None
    for kernel, kind, origin, outs in rows:
        mark = "" if kernel == last else "-" * 4
        last = kernel
        sizes = " ".join(f"{buf}={size}{'(removed)' if buf in removed else ''}" for buf, size in outs)
        print(f"{mark:4s} {kernel:28s} {kind[:12]:12s} {origin:30s} {sizes}")
    record = be.compiled_graphs[-1]   # the accepted plan of the last graph, and the facts it was made on
    assert record.facts is not None, f"{record.graph_id}: {record.cache} restored no facts; rerun with REMAT_COMPILE_CACHE=0"
    facts, plan = record.facts, record.plan
    steps, _ = memory_steps(facts, partition_nodes(facts, set(plan.saved)))
    phase = "backward" if which == "bw" else "forward"
    print(f"== remat {which} kernel steps")
    for step in steps:
        if step.phase == phase and (step.allocs or step.uses):
            allocs = " ".join(f"{sid}={n}" for sid, n in step.allocs)
            extra = f" phantom={step.phantom_bytes}" if step.phantom_bytes else ""
            inplace = " inplace:" + ",".join(f"{a}<-{b}" for a, b in step.inplace) if step.inplace else ""
            print(f"     {step.name:30s} {allocs}{extra}{inplace}")


if __name__ == "__main__":
    main()
