"""Diagnostic: for a zoo model and budgets, print the planner's predicted peak, the prediction
without Inductor's buffer reuse, and the measured peak of the Inductor-compiled step.

    python tools/sim_vs_measured.py MODEL none 0.02 ...
    INDUCTOR=allow_buffer_reuse=0 python tools/sim_vs_measured.py MODEL none   # Inductor config overrides
    THREADS=1 python tools/sim_vs_measured.py cnn none                        # torch threads Inductor compiles for

Budgets in GB (1 GB = 1e9 bytes); printed sizes in MB (1e6 bytes). The measurement is
benchmarks/memory_accuracy.py's: ``remat.measure_peak_bytes`` over one step (the allocations made
inside it), gradients cleared before.
For reproducible plans run with PYTHONHASHSEED=0.
"""
import os
import sys

import torch

import torch._inductor.config as inductor_config

if os.environ.get("THREADS"):
    torch.set_num_threads(int(os.environ["THREADS"]))
for kv in filter(None, os.environ.get("INDUCTOR", "").split(",")):
    key, value = kv.split("=")
    setattr(inductor_config, key, value == "1")

import remat  # noqa: E402
from remat.simulator.memory_timeline import simulate_memory  # noqa: E402
from remat.simulator.schedule import memory_steps, partition_nodes  # noqa: E402
from remat.testing.zoo import ZOO  # noqa: E402

name = sys.argv[1]
for b in sys.argv[2:]:
    budget = None if b == "none" else float(b)
    model, inputs = ZOO[name]()
    be = remat.backend(budget, headroom_fraction=0.0)
    c = torch.compile(model, backend=be)
    c(*inputs).float().sum().backward()
    for p in model.parameters():
        p.grad = None
    m = remat.measure_peak_bytes(lambda: c(*inputs).float().sum().backward(), "cpu").peak_bytes
    record = be.compiled_graphs[-1]   # the accepted plan of the last graph, and the facts it was made on
    assert record.facts is not None, f"{record.graph_id}: {record.cache} restored no facts; rerun with REMAT_COMPILE_CACHE=0"
    facts, plan = record.facts, record.plan
    steps, pinned = memory_steps(facts, partition_nodes(facts, set(plan.saved)))
    sim = simulate_memory(steps, pinned, reuse_freed=inductor_config.allow_buffer_reuse).peak_bytes
    no_reuse = simulate_memory(steps, pinned, reuse_freed=False).peak_bytes
    print(f"RESULT {name} budget={b} planned={plan.predicted_peak_bytes/1e6:.3f} sim={sim/1e6:.3f} "
          f"sim_no_reuse={no_reuse/1e6:.3f} meas={m/1e6:.3f} err={sim/m-1:+.1%}", flush=True)
    torch._dynamo.reset()
