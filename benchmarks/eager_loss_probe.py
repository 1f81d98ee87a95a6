"""The zoo GPT compiled alone, its loss an eager cross-entropy: the step's measured peak against the budget.

The usual training loop compiles the model and computes ``F.cross_entropy(model(x), y)`` outside it; what the loss
holds between the compiled forward and backward is memory no graph shows (``remat/eager_loss.py``). For each budget
(fractions of plain Inductor's measured peak on the same step) this compiles a fresh zoo GPT with remat, measures its
first step inside ``remat.measure_peak_bytes`` (so the feedback loop does not see that step: the plan as compiled is
what is measured), compares its gradients with plain Inductor's, runs two more steps and measures a fourth.

    PYTHONHASHSEED=0 python benchmarks/eager_loss_probe.py --out benchmarks/results/eager_loss_probe-cpu.md

Run it from a snapshot of any commit (``PYTHONPATH=<snapshot>``) to compare before and after.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import remat
from remat.measure import close_open_window
from remat.testing.steps import assert_grads_close, grads_of
from remat.testing.zoo import GPTConfig, make_gpt

FRACTIONS = (0.9, 0.7, 0.5)


def _build() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    cfg = GPTConfig()
    model, _ = make_gpt(cfg, batch=8)
    tokens = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(0))
    return model, tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _run(backend: Any) -> dict[str, Any]:
    """Four steps of a fresh model compiled with ``backend``: step 1's peak and gradients, step 4's peak."""
    torch._dynamo.reset()
    model, x, y = _build()
    compiled = torch.compile(model, backend=backend)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        F.cross_entropy(compiled(x).flatten(0, 1), y.flatten()).backward()

    first = remat.measure_peak_bytes(step).peak_bytes
    grads = grads_of(model)
    for _ in range(2):
        step()
        close_open_window()
    return {"first": first, "grads": grads, "later": remat.measure_peak_bytes(step).peak_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with torch._inductor.config.patch(fallback_random=True):
        plain = _run("inductor")
        rows = []
        for fraction in FRACTIONS:
            budget = int(fraction * plain["later"])
            backend = remat.backend(budget / 1e9)
            try:
                run = _run(backend)
            except remat.BudgetInfeasibleError as error:
                rows.append(f"| {fraction:g} | {budget:,} | refused: names {error.min_budget_bytes:,} | | | | |")
                continue
            assert_grads_close(run["grads"], plain["grads"])
            graph = backend.compiled_graphs[0]
            rows.append(f"| {fraction:g} | {budget:,} | {graph.plan.predicted_peak_bytes:,} | {run['first']:,} | "
                        f"{run['first'] / budget:.3f} | {run['later']:,} | {run['later'] / budget:.3f} |")
    commit = os.environ.get("REMAT_SOURCE_COMMIT", "unknown")
    text = "\n".join([
        "# Zoo GPT, compiled alone, with an eager cross-entropy (CPU)",
        "",
        f"`PYTHONHASHSEED=0 python benchmarks/eager_loss_probe.py --out {args.out}` at {commit}, "
        f"{time.strftime('%Y-%m-%d %H:%M')} UTC, torch {torch.__version__}. Plain Inductor's measured peak: "
        f"{plain['later']:,} B. Gradients of step 1 equal plain Inductor's at every budget run (fallback_random).",
        "",
        "| fraction | budget B | first plan predicted B | step 1 B | step 1 / budget | step 4 B | step 4 / budget |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        *rows, ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
