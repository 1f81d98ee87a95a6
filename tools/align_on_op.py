"""Diagnostic: live bytes (measured vs simulated) right before each call of an op, e.g.

    python tools/align_on_op.py llama 0.0069 aten::mm

Measured values include the forward's calls; the simulated list is the backward's.
"""
import sys, torch
import remat
from remat.simulator.schedule import memory_steps, partition_nodes
from remat.simulator.memory_timeline import simulate_memory
from remat.testing.zoo import ZOO
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile
name, b = sys.argv[1], (None if sys.argv[2] == "none" else float(sys.argv[2]))
anchor = sys.argv[3]  # op name substring to align on
model, inputs = ZOO[name]()
be = remat.backend(b, headroom_fraction=0.0)
c = torch.compile(model, backend=be)
def step():
    for p in model.parameters(): p.grad = None
    out = c(*inputs); out.float().sum().backward()
step()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    step()
evs = []
def walk(ev):
    if ev.tag == _EventType.Allocation:
        if ev.extra_fields.device.type == "cpu": evs.append((ev.start_time_ns, 0, ev.extra_fields.alloc_size, ""))
    else:
        evs.append((ev.start_time_ns, 1, 0, ev.name))
    for ch in ev.children: walk(ch)
for ev in prof.profiler.kineto_results.experimental_event_tree(): walk(ev)
evs.sort()
live = 0; meas = []
for t, kind, size, nm in evs:
    if kind == 0: live += size
    elif nm == anchor: meas.append(live)
record = be.compiled_graphs[-1]   # the accepted plan of the last graph, and the facts it was made on
assert record.facts is not None, f"{record.graph_id}: {record.cache} restored no facts; rerun with REMAT_COMPILE_CACHE=0"
facts, plan = record.facts, record.plan
part = partition_nodes(facts, set(plan.saved))
steps, pinned = memory_steps(facts, part)
sim = simulate_memory(steps, pinned)
simv = [sim.timeline_bytes[i] - sum(b for _, b in s.allocs) for i, s in enumerate(steps) if s.phase == "backward" and facts.nodes.get(s.name.removesuffix("@r"), facts.nodes[facts.order[0]]).op in ("aten.mm.default",)]
names = [s.name for s in steps if s.phase == "backward" and facts.nodes.get(s.name.removesuffix("@r"), facts.nodes[facts.order[0]]).op in ("aten.mm.default",)]
print(names)
print("measured before each:", [round(x/1e6,2) for x in meas])
print("sim      before each:", [round(x/1e6,2) for x in simv])
