"""What Inductor's generated CPU loops pay beyond the roofline, measured on Inductor's own kernels.

The roofline charges a fused loop its bytes at the memory bandwidth and its
FLOPs at the matmul peak. Inductor's C++ loops pay far more than that for four
things, each measured here per element on a kernel Inductor generates (2-core
AMD EPYC VM, one thread, against a float loop of the same size):

- ``random_value``: every random number is one Philox4x32-10 call made from
  the element's offset (``normalized_rand_cpu`` in Inductor's ``cpp_prefix.h``),
  scalar, 16 per vector: ~7 ns, 2-3x eager ``torch.rand`` (a sequential
  mt19937 stream).
- ``bool_store``: a bool tensor written from a float comparison goes through
  ``VecMask::store(bool*)``: ~7 ns per element, where a float store costs 0.1.
- ``bool_load``: a bool tensor read into a vector mask (``VecMask::from(bool*)``):
  ~0.8 ns per element.
  Both branch per element: the probes use masks as models have them (dropout
  keeps 90%); a 50/50 random mask costs 1.4x (store) to 4x (load) more.
- ``welford_long``: a mean and variance over a long reduction (batch norm's
  statistics over N, H, W) is one Welford chain per output, whose every step
  waits on a division: ~0.25 ns per element more than a sum. Short row
  reductions (layer norm's 128 elements per row) overlap their chains and stay
  near the roofline; a reduction counts as long from ``LONG_REDUCTION``
  elements per output.

Calls cost too. ``kernel_call``: each kernel of a compiled graph is a line of
Inductor's Python wrapper (allocate the outputs, call through pybind, free
inputs): ~1.3 us, where the roofline's launch floor (an eager add on 4 elements)
is ~1.7 us. ``graph_call``: calling a compiled training graph (guards, the
autograd function, saving for backward) once: ~30 us. Both measured on a chain
of tiny matmuls and sines (all overhead), with 1 and with 9 blocks.
``graph_input``: what each input adds to a graph's call (a module and its
parameters are guarded by Dynamo, each tensor passes through AOTAutograd's and
Inductor's wrappers): measured on chains of 1 and 17 linear layers, ~2 us per
parameter.

GPT's compiled forward spends most of its loop time on the first three (dropout
masks are drawn, stored as bools and read back in the backward); the CNN's on
the fourth. ``measure_loop_costs`` compiles one probe per cost with
``torch.compile`` in a subprocess (a compile cannot nest inside the partitioner
that asks for a profile, and a fresh process keeps Dynamo's state clean) and
returns seconds per element (per call, per input); a probe that cannot run (no
C++ compiler) leaves its cost out, and out means not charged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from typing import Mapping

log = logging.getLogger("remat.loop_costs")

ELEMENT_COSTS = ("random_value", "bool_store", "bool_load", "welford_long")   # seconds per element
CALL_COSTS = ("kernel_call", "graph_call", "graph_input")                       # seconds per call (or input)
LOOP_COST_NAMES = ELEMENT_COSTS + CALL_COSTS
LONG_REDUCTION = 1024        # elements per output from which a Welford chain no longer overlaps the next
PROBE_TIMEOUT_S = 600.0

# Each probe: (cost name, the kernel that pays it, the same kernel without it). Run in the subprocess.
_PROBE_SCRIPT = r"""
import json, sys, time
import torch

torch.set_num_threads(int(sys.argv[1]))
N = 1 << 19                                   # 2 MiB of fp32: cache-resident, so the loop's work shows

# One thread: CPU time, which a neighbour's load does not inflate (on a shared 2-core VM the best
# of 7 wall-clock samples still read 2x high). Several threads: wall clock, the threads' span.
clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

def best_s(fn, *args):
    fn(*args); fn(*args)
    once = clock(); fn(*args); once = max(clock() - once, 1e-7)
    inner = max(1, int(5e-3 / once))
    samples = []
    for _ in range(11):
        t0 = clock()
        for _ in range(inner):
            fn(*args)
        samples.append((clock() - t0) / inner)
    return min(samples)

def compiled(fn):
    return torch.compile(fn, dynamic=False, fullgraph=True)

x, y = torch.randn(N), torch.randn(N)
# masks as models have them: dropout keeps 90%. Storing and loading bools branches per element, so a
# 50/50 random mask costs 1.4x (store) to 4x (load) more than that, an all-true one 0.8x to 0.6x.
mask = torch.rand(N) < 0.9
x4 = torch.randn(16, 32, 32, 32)               # N, C, H, W: 16K elements per channel
probes = {
    "random_value": (compiled(lambda x: torch.rand_like(x)), compiled(lambda x: x * 2.0), (x,), N),
    "bool_store": (compiled(lambda x: torch.rand_like(x) > 0.1), compiled(lambda x: torch.rand_like(x)), (x,), N),
    "bool_load": (compiled(lambda m, x: x * m), compiled(lambda y, x: x * y), None, N),
    "welford_long": (compiled(lambda x: torch.var_mean(x, dim=(0, 2, 3), correction=0)),
                     compiled(lambda x: x.sum(dim=(0, 2, 3))), (x4,), x4.numel()),
}
out = {}

def chain(blocks):
    def f(x, w):
        for _ in range(blocks):
            x = torch.mm(x, w).sin()       # two kernels per block: a library matmul, a generated loop
        return x
    return compiled(f)

try:   # training forwards on 8 x 8 tensors: all call overhead (guards, wrapper, allocation, saving for backward)
    x8, w8 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    one, nine = best_s(chain(1), x8, w8), best_s(chain(9), x8, w8)
    out["kernel_call"] = max(nine - one, 0.0) / 16
    out["graph_call"] = max(one - 2 * out["kernel_call"], 0.0)
    # a module's parameters: Dynamo guards each module and tensor, the wrappers pass each one on;
    # a chain of linear layers adds two inputs and one library call per layer
    few, many = (best_s(torch.compile(torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)]),
                                      dynamic=False, fullgraph=True), x8) for layers in (1, 17))
    out["graph_input"] = max(many - few - 16 * out["kernel_call"], 0.0) / 32
except Exception as error:
    out["error:kernel_call"] = type(error).__name__ + ": " + str(error).splitlines()[0][:200] if str(error) else ""
for name, (paying, plain, args, n) in probes.items():
    try:
        if name == "bool_load":
            cost = best_s(paying, mask, x) - best_s(plain, y, x)
        else:
            cost = best_s(paying, *args) - best_s(plain, *args)
        out[name] = max(cost, 0.0) / n
    except Exception as error:
        out["error:" + name] = type(error).__name__ + ": " + str(error).splitlines()[0][:200] if str(error) else ""
print("REMAT_LOOP_COSTS " + json.dumps(out))
"""


def measure_loop_costs(threads: int, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[dict[str, float], str]:
    """Seconds per element of each ``LOOP_COST_NAMES`` cost in Inductor's CPU loops, and a note.

    Runs the probes in a subprocess with ``threads`` torch threads. Returns only
    the costs that were measured; the note says what was not and why ("" when all were).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT, str(threads)], capture_output=True, text=True,
                              timeout=timeout_s, env=env, check=False)
    except (OSError, subprocess.SubprocessError) as error:
        return {}, f"generated-loop costs not measured: {type(error).__name__}: {error}"
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("REMAT_LOOP_COSTS ")), None)
    if line is None:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return {}, f"generated-loop costs not measured: the probe exited {done.returncode}: {tail}"
    data = json.loads(line.split(" ", 1)[1])
    costs = {k: float(v) for k, v in data.items() if k in LOOP_COST_NAMES}
    errors = [f"{k.split(':', 1)[1]} ({v})" for k, v in data.items() if k.startswith("error:")]
    note = f"generated-loop costs not measured for {', '.join(errors)}" if errors else ""
    if note:
        log.warning(note)
    return costs, note


def check_loop_costs(costs: Mapping[str, float]) -> None:
    """Raise ValueError naming a cost that no CPU could have: negative, not finite, above
    1 us per element or 10 ms per call."""
    for name, seconds in costs.items():
        if name not in LOOP_COST_NAMES:
            raise ValueError(f"unknown generated-loop cost {name!r}; known: {', '.join(LOOP_COST_NAMES)}")
        limit, unit = (1e-6, "per element") if name in ELEMENT_COSTS else (1e-2, "per call")
        if not (math.isfinite(seconds) and 0.0 <= seconds <= limit):
            raise ValueError(f"generated-loop cost {name}={seconds!r} s {unit} is not in [0, {limit:g} s]")


__all__ = ["CALL_COSTS", "ELEMENT_COSTS", "LONG_REDUCTION", "LOOP_COST_NAMES", "check_loop_costs",
           "measure_loop_costs"]
