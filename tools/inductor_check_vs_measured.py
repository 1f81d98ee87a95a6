"""Diagnostic: on corpus models, the simulated, Inductor-checked and measured peak of the same plan.

    python tools/inductor_check_vs_measured.py NAME [NAME ...]     # names from remat.testing.corpus

For each model: the min-cut plan (no budget), then the plan at the smallest budget the planner
names (x 1.03). The plan is the simulator's (Inductor's check reads it, re-plans nothing), so the
three numbers describe one compiled step. ``held`` is the forward's user outputs the backward does
not read: the check counts them live through the backward (as the simulator does); a step that
drops them first (as the corpus loss does) measures up to that much lower. Bytes; 1 MB = 1e6 bytes.
"""
import math
import sys

import torch

import remat
from remat import _torch_cache
from remat._torch_compile import CodeCapture, compile_with_partitioner
from remat.backend import RematBackend
from remat.inductor_check import checked_peak_of
from remat.testing import corpus


class _Capturing(RematBackend):
    """remat with Inductor's check off, keeping the generated code of the last compile."""

    def __call__(self, gm, example_inputs):
        self.capture = CodeCapture()
        with _torch_cache.autograd_cache(False, non_lazy_backward=True):
            return compile_with_partitioner(gm, example_inputs, self.partitioner, self.capture)


def compare(entry, budget_gb):
    torch._dynamo.reset()
    built = entry.build()
    backend = _Capturing(remat.backend(budget_gb, verify_peak=0, inductor_check=False).options)
    compiled = torch.compile(built.model, backend=backend)

    def step():
        built.model.zero_grad(set_to_none=True)
        built.loss(compiled).backward()

    step()
    measured = remat.measure_peak_bytes(step).peak_bytes
    plan = backend.compiled_graphs[-1].plan
    checked = checked_peak_of(backend.capture.graphs, "cpu")
    held = checked.held_output_bytes if checked else 0
    print(f"{entry.name:24s} budget {budget_gb!s:>9} GB  graphs {len(backend.compiled_graphs)}  simulated "
          f"{plan.predicted_peak_bytes:>10,}  checked {checked.peak_bytes if checked else None!s:>10}  held {held:>9,}  "
          f"measured {measured:>10,}  simulated/measured {plan.predicted_peak_bytes / measured - 1:+.3f}  "
          f"checked/measured {(checked.peak_bytes / measured - 1) if checked else float('nan'):+.3f}  "
          f"(checked-held)/measured {((checked.peak_bytes - held) / measured - 1) if checked else float('nan'):+.3f}",
          flush=True)
    return plan


def main(names):
    for entry in corpus.entries(corpus.TEST_SEEDS[:10]):
        if entry.name not in names:
            continue
        compare(entry, None)
        torch._dynamo.reset()
        built = entry.build()
        try:
            built.loss(torch.compile(built.model, backend=remat.backend(1e-7, verify_peak=0, inductor_check=False)))
        except remat.BudgetInfeasibleError as error:
            try:
                compare(entry, math.ceil(error.min_budget_gb * 1.03 * 1e6) / 1e6)
            except remat.BudgetInfeasibleError as refused:
                print(f"{entry.name:24s} refused: {str(refused)[:160]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
