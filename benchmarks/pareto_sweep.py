"""A short peak-memory vs step-time sweep on the zoo GPT, remat next to three baselines.

    python benchmarks/pareto_sweep.py --out-dir pareto_sweep

Compiles the zoo GPT (dropout 0.1) with plain ``backend="inductor"``, with PyTorch's
``activation_memory_budget=0.5``, with every block under ``torch.utils.checkpoint``, and
with remat at 4 budgets from its smallest feasible budget to plain Inductor's peak (plus
one at each baseline's measured peak and one at half of Inductor's). Measures each point's
peak above the memory resident at step start, its median forward, backward and step time
(interleaved runs), and its gradients against plain Inductor; prints the table and the
checks, and writes the JSON, the markdown and the plot (with matplotlib) to ``--out-dir``.
The full benchmark, every baseline on three models, is ``benchmarks/pareto.py``: this script runs its
sweep (``import pareto``: benchmarks/ is ``sys.path[0]`` when it runs as a script).
1 MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

import pareto  # benchmarks/pareto.py: the sweep, the checks, the files
from common import MODELS

SHORT = pareto.SweepConfig(ac_budgets=(0.5,), every_k=(), full_checkpoint=True, selective=False,
                           sweep_points=4, reps=11, peak_rounds=1)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("pareto_sweep"), help="where the files go (default pareto_sweep/)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=SHORT.reps, help=f"timed steps per method (default {SHORT.reps})")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error(f"--reps={args.reps}: need at least 1")
    device = torch.device(args.device)
    pareto.configure_torch(device, threads=None)
    spec = MODELS["gpt"]
    print(f"pareto sweep: {spec.description} on {device}, torch {torch.__version__}", flush=True)
    result, points = pareto.measure_model(spec, device, pareto.replace(SHORT, reps=args.reps))
    written = pareto.write_model_results(args.out_dir, result, points)
    print()
    print(pareto.render_markdown(result, points))
    plot = [p for p in written if p.suffix == ".png"]
    print(f"plot:  {plot[0] if plot else 'not written (pip install matplotlib)'}")
    print(f"files: {', '.join(str(p) for p in written if p.suffix != '.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
