"""Diagnostic: for a zoo model and budgets, print the planner's predicted peak, a no-fusion variant,
and the measured peak (DESIGN.md's CPU method) of the Inductor-compiled step.

    python tools/sim_vs_measured.py MODEL none 0.02 ...
"""
import sys, torch
sys.path.insert(0, "/work/main")
import remat
from remat.passes import plan as P
import remat.passes.schedule as S
from remat.passes.schedule import memory_steps, partition_nodes
from remat.cost_model.memory import simulate_memory
from tests.models import ZOO
import torch._inductor.config as ic
ic.fallback_random = True
captured = []
B = sys.modules["remat.backend"]; orig = B.make_plan
def spy(facts, budget_bytes, **kw):
    plan = orig(facts, budget_bytes, **kw); captured.append((facts, plan)); return plan
B.make_plan = spy
name = sys.argv[1]
for b in sys.argv[2:]:
    budget = None if b == "none" else float(b)
    model, inputs = ZOO[name]()
    be = remat.backend(budget, headroom_fraction=0.0)
    c = torch.compile(model, backend=be)
    def step():
        for p in model.parameters(): p.grad = None
        out = c(*inputs); out.float().sum().backward()
    step(); m = remat.measure_peak_bytes(step).peak_bytes
    facts, plan = captured[-1]
    part = partition_nodes(facts, set(plan.saved))
    S.INLINE_FUSED = False
    pess = simulate_memory(*memory_steps(facts, part)).peak_bytes
    S.INLINE_FUSED = True
    print(f"RESULT {name} budget={b} opt={plan.predicted_peak_bytes/1e6:.2f} pess={pess/1e6:.2f} meas={m/1e6:.2f} opt_err={plan.predicted_peak_bytes/m-1:+.1%} pess_err={pess/m-1:+.1%}", flush=True)
    torch._dynamo.reset()
