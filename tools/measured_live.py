"""Diagnostic: the measured allocation timeline of a zoo model's compiled step (docs/design.md's CPU
method), each allocation labelled with the op that made it, and what is live at the measured peak;
next to it, the simulated peak and what the simulator holds live there.

    python tools/measured_live.py MODEL BUDGET [--timeline]

BUDGET is in GB (1 GB = 1e9 bytes) or "none". Sizes are printed in bytes.
"""
import gc
import os
import sys

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

import torch._inductor.config as inductor_config

for kv in filter(None, os.environ.get("INDUCTOR", "").split(",")):  # e.g. INDUCTOR=allow_buffer_reuse=0
    key, value = kv.split("=")
    setattr(inductor_config, key, value == "1")
import remat  # noqa: E402
from remat.simulator.memory_timeline import simulate_memory  # noqa: E402
from remat.simulator.schedule import memory_steps, partition_nodes  # noqa: E402
from remat.testing.zoo import ZOO  # noqa: E402


def allocation_events(prof):
    """(time, size, ptr, op that allocated it) for every CPU allocation and free, in time order."""
    out = []

    def walk(ev, parent):
        if ev.tag == _EventType.Allocation:
            if ev.extra_fields.device.type == "cpu":
                out.append((ev.start_time_ns, ev.extra_fields.alloc_size, ev.extra_fields.ptr, parent))
            return
        name = ev.name if parent in ("", "<py>") or not parent.startswith("aten::") else parent
        for ch in ev.children:
            walk(ch, name)

    for ev in prof.profiler.kineto_results.experimental_event_tree():
        walk(ev, "")
    out.sort(key=lambda e: e[0])
    return out


def main() -> None:
    name, b = sys.argv[1], sys.argv[2]
    budget = None if b == "none" else float(b)
    model, inputs = ZOO[name]()
    be = remat.backend(budget, headroom_fraction=0.0)
    c = torch.compile(model, backend=be)

    c(*inputs).float().sum().backward()
    for p in model.parameters():
        p.grad = None
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = c(*inputs)
        out.float().sum().backward()
        del out
    events = allocation_events(prof)
    live, peak, peak_i = 0, 0, -1
    live_set: dict[int, tuple[int, int, str]] = {}
    peak_set: dict[int, tuple[int, int, str]] = {}
    for i, (_, size, ptr, op) in enumerate(events):
        live += size
        if size > 0:
            live_set[ptr] = (i, size, op)
        else:
            live_set.pop(ptr, None)
        if "--timeline" in sys.argv:
            print(f"{i:5d} {live:10d} {size:+10d} {op}")
        if live > peak:
            peak, peak_i, peak_set = live, i, dict(live_set)
    print(f"measured peak {peak} bytes at allocation #{peak_i} ({events[peak_i][3]})")
    for i, size, op in sorted(peak_set.values(), key=lambda v: v[0]):
        print(f"  #{i:4d} {size:9d} {op}")
    record = be.compiled_graphs[-1]   # the accepted plan of the last graph, and the facts it was made on
    assert record.facts is not None, f"{record.graph_id}: {record.cache} restored no facts; rerun with REMAT_COMPILE_CACHE=0"
    facts, plan = record.facts, record.plan
    steps, pinned = memory_steps(facts, partition_nodes(facts, set(plan.saved)))
    sim = simulate_memory(steps, pinned, reuse_freed=inductor_config.allow_buffer_reuse)
    print(f"simulated peak {sim.peak_bytes} bytes at step {sim.peak_step} ({sim.peak_step_name})")
    for sid, size in sim.live_at_peak:
        print(f"  {size:9d} {sid}")
    if "--sim-timeline" in sys.argv:
        for i, (st, live) in enumerate(zip(steps, sim.timeline_bytes)):
            if st.allocs or st.uses:
                allocs = sum(b for _, b in st.allocs)
                print(f"{i:5d} {live:10d} {st.phase[0]} {st.name:40s} +{allocs}")

if __name__ == "__main__":
    main()
