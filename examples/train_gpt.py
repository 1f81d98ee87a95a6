"""Train the zoo's small GPT for a few steps under a memory budget, next to plain Inductor.

    python examples/train_gpt.py --budget-gb 0.03 --steps 5 --dump-dir remat_dump

Prints the budget, the peak remat predicted for the compiled forward + backward, the peak
measured on one step (docs/design.md's method: memory allocated above what was resident when
the step began), the median step time next to plain ``backend="inductor"``'s, and where
the dump went. 1 GB = 1e9 bytes, 1 MB = 1e6 bytes.

Plain Inductor runs in a fresh child process, after remat: the first compile in a process also
pays torch's one-time setup (imports, the C++ compiler's checks; ~10 s on a 2-core CPU), so a
baseline compiled second in the same process would look that much faster. The child reads the
same Inductor cache, so kernels remat compiled first can only make the baseline faster.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from typing import Optional, Union

import torch
import torch.nn.functional as F

import remat

from remat.testing.zoo import GPTConfig, make_gpt


def parse_budget(text: str) -> Union[None, str, float]:
    """'none' -> no budget, 'auto' -> free device memory, else a number of GB."""
    if text.strip().lower() == "none":
        return None
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget-gb={text!r}: pass a number of GB (e.g. 0.03), 'none' or 'auto'") from None


def fmt(num_bytes: Optional[int]) -> str:
    if num_bytes is None:
        return "none"
    return f"{num_bytes / 1e9:.4f} GB ({num_bytes / 1e6:.2f} MB)"


def make_trainer(backend, device: torch.device, batch: int, seed: int):
    """A GPT, its AdamW optimizer, a compiled loss, and one training step that runs it."""
    cfg = GPTConfig()
    model, _ = make_gpt(cfg, batch=batch)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), generator=generator).to(device)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())

    compiled_loss = torch.compile(loss_fn, backend=backend)

    def forward_backward() -> torch.Tensor:
        loss = compiled_loss(inputs, targets)
        loss.backward()
        return loss.detach()

    def train_step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward()
        optimizer.step()
        return loss.item()

    return model, optimizer, forward_backward, train_step


def run(name: str, backend, args, device: torch.device) -> dict:
    torch._dynamo.reset()
    model, optimizer, forward_backward, train_step = make_trainer(backend, device, args.batch, args.seed)
    start = time.perf_counter()
    losses = [train_step()]  # compiles the forward and the backward
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps - 1):
        start = time.perf_counter()
        losses.append(train_step())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    # The budget covers one forward + backward above what is resident at its start:
    # parameters, AdamW state and the batch are resident, the gradients are not.
    optimizer.zero_grad(set_to_none=True)
    measured = remat.measure_peak_bytes(forward_backward, device).peak_bytes
    return {"name": name, "losses": losses, "compile_s": compile_s,
            "median_step_s": statistics.median(times) if times else float("nan"), "measured_peak_bytes": measured}


def run_baseline_in_fresh_process(args) -> dict:
    """``run("inductor", ...)`` in a spawned child: it pays torch's one-time setup as remat's run did."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_run_baseline, (args,))


def _run_baseline(args) -> dict:
    return run("inductor", "inductor", args, torch.device(args.device))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gb", type=parse_budget, default=0.03,
                        help="peak above the resident baseline, in GB (1 GB = 1e9 bytes); 'none' or 'auto' (default 0.03)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per backend, the first compiles (default 6)")
    parser.add_argument("--dump-dir", default="remat_dump", help="where remat writes its dump (default remat_dump)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain Inductor run")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: need at least 2 (the first step compiles, the rest are timed)")
    device = torch.device(args.device)

    try:
        backend = remat.backend(args.budget_gb, dump_dir=args.dump_dir)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    print(f"remat example: zoo GPT {GPTConfig()}, batch {args.batch}, {args.steps} steps on {device}, torch {torch.__version__}")
    print("units: 1 GB = 1e9 bytes, 1 MB = 1e6 bytes; peaks are above the memory resident at step start")
    try:
        ours = run("remat", backend, args, device)
    except remat.BudgetInfeasibleError as error:
        print(f"\nremat: {error}", file=sys.stderr)
        return 2
    base = None if args.no_baseline else run_baseline_in_fresh_process(args)

    print(f"\nbudget:          {fmt(backend.options.budget_bytes)}"
          + (f", planning target {fmt(backend.options.planning_target_bytes(device.type))} "
             f"(less {backend.options.headroom_for(device.type):.0%} headroom)" if backend.options.budget_bytes else ""))
    for graph in backend.compiled_graphs:
        plan = graph.plan
        print(f"predicted peak:  {fmt(plan.predicted_peak_bytes)}   [{graph.graph_id}; no-remat simulated peak "
              f"{fmt(plan.no_remat_peak_bytes)}; saved {len(plan.saved)} values, recomputed {len(plan.recomputed)} ops]")
    print(f"measured peak:   {fmt(ours['measured_peak_bytes'])}   (remat, one forward + backward)")
    if base is not None:
        print(f"                 {fmt(base['measured_peak_bytes'])}   (plain inductor)")
    print(f"median step:     {ours['median_step_s'] * 1e3:.1f} ms (remat)"
          + (f" vs {base['median_step_s'] * 1e3:.1f} ms (plain inductor)" if base else "")
          + f", over {args.steps - 1} steps after the compiling one")
    print(f"compile:         {ours['compile_s']:.1f} s (remat)"
          + (f" vs {base['compile_s']:.1f} s (plain inductor, in its own process)" if base else "")
          + ", the first step's")
    print(f"losses (remat):  {' '.join(f'{x:.4f}' for x in ours['losses'])}")
    if base is not None:
        print(f"losses (plain):  {' '.join(f'{x:.4f}' for x in base['losses'])}")
    dumps = [g.dump_path for g in backend.compiled_graphs if g.dump_path]
    print(f"dump:            {', '.join(dumps) if dumps else 'none'}" + ("  (forward.py, backward.py, plan.json, report.md)" if dumps else ""))
    if backend.options.budget_bytes is not None and ours["measured_peak_bytes"] > backend.options.budget_bytes:
        print("WARNING: the measured peak is over the budget", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
