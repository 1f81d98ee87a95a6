"""Train the zoo's small GPT with DistributedDataParallel under a per-rank memory budget.

    torchrun --nproc_per_node 2 examples/ddp_train.py --budget-gb 0.037 --steps 4

Each rank wraps the GPT in DDP (small buckets, so Dynamo's DDP optimizer splits the step
into pieces), compiles it with ``remat.backend(budget_gb=...)`` and trains a few steps on its
own batch (gloo on CPU, nccl on CUDA). Each rank prints its budget, how remat split it across
the pieces (each piece's planning target and predicted peak), and the peak it measured on the
last step (docs/design.md's method: memory allocated above what was resident when the step began),
next to plain Inductor's. 1 GB = 1e9 bytes, 1 MB = 1e6 bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import remat

from remat.testing.zoo import GPT, GPTConfig


def fmt(num_bytes: Optional[int]) -> str:
    if num_bytes is None:
        return "none"
    return f"{num_bytes / 1e9:.4f} GB ({num_bytes / 1e6:.2f} MB)"


def parse_budget(text: str) -> Any:
    if text.strip().lower() in ("none", "auto"):
        return None if text.strip().lower() == "none" else "auto"
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budget-gb={text!r}: pass a number of GB (e.g. 0.03), 'none' or 'auto'") from None


def train(backend: Any, args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    """``args.steps`` DDP training steps of a fresh GPT compiled with ``backend``; the last
    step's forward + backward is measured (the first compiles; in the second DDP rebuilds
    its gradient buckets once, which is no part of a steady step)."""
    torch._dynamo.reset()
    cfg = GPTConfig()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(cfg).to(device).train()
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    compiled = torch.compile(ddp, backend=backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    losses, measured, start = [], None, time.perf_counter()
    compile_s = 0.0
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1), generator=generator).to(device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        optimizer.zero_grad(set_to_none=True)

        def forward_backward() -> float:
            loss = F.cross_entropy(compiled(inputs).flatten(0, 1), targets.flatten())
            loss.backward()
            return loss.item()

        if step == args.steps - 1:
            result = remat.measure_peak_bytes(forward_backward, device)
            measured, loss = result.peak_bytes, result.result
        else:
            loss = forward_backward()
        optimizer.step()
        losses.append(loss)
        if step == 0:
            compile_s = time.perf_counter() - start
    return {"losses": losses, "measured_peak_bytes": measured, "compile_s": compile_s}


def report(rank: int, backend: remat.RematBackend, ours: dict[str, Any], base: Optional[dict[str, Any]],
           device: torch.device) -> str:
    options = backend.options
    lines = [f"[rank {rank}] budget:         {fmt(options.budget_bytes)} per rank"
             + (f", step target {fmt(options.planning_target_bytes(device.type))} "
                f"(less {options.headroom_for(device.type):.0%} headroom)" if options.budget_bytes else "")]
    for graph in backend.compiled_graphs:
        share = graph.distributed.share if graph.distributed else None
        where = f"piece {share.index + 1}/{share.count}" if share and share.kind == "ddp" else "graph"
        lines.append(
            f"[rank {rank}]   {graph.graph_id} ({where}): predicted peak {fmt(graph.plan.predicted_peak_bytes)}, "
            f"planning target {fmt(graph.plan.target_bytes)}"
            + (f"; held by earlier pieces {fmt(share.held_before_bytes)}, reserved for later {fmt(share.reserved_later_bytes)}"
               if share else "")
            + f"; recomputes {len(graph.plan.recomputed)} ops")
    lines.append(f"[rank {rank}] measured peak:  {fmt(ours['measured_peak_bytes'])}   (remat, last step's forward + backward)")
    if base is not None:
        lines.append(f"[rank {rank}]                 {fmt(base['measured_peak_bytes'])}   (plain inductor)")
    lines.append(f"[rank {rank}] compile:        {ours['compile_s']:.1f} s (remat)"
                 + (f" vs {base['compile_s']:.1f} s (plain inductor)" if base else ""))
    lines.append(f"[rank {rank}] losses (remat): {' '.join(f'{x:.4f}' for x in ours['losses'])}")
    if base is not None:
        lines.append(f"[rank {rank}] losses (plain): {' '.join(f'{x:.4f}' for x in base['losses'])}")
    dumps = [g.dump_path for g in backend.compiled_graphs if g.dump_path]
    lines.append(f"[rank {rank}] dump:           {', '.join(dumps) if dumps else 'none'}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-gb", type=parse_budget, default=0.037,
                        help="per-rank peak above the resident baseline, in GB (1 GB = 1e9 bytes); 'none' or 'auto'")
    parser.add_argument("--steps", type=int, default=4, help="training steps per backend; the last is measured (default 4)")
    parser.add_argument("--batch", type=int, default=8, help="batch per rank (default 8)")
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0,
                        help="DDP bucket size in MiB; smaller buckets split the step into more pieces (default 1, the smallest "
                             "Dynamo's DDP optimizer accepts)")
    parser.add_argument("--headroom-fraction", type=float, default=None,
                        help="the share of the budget the plans leave unplanned (default: remat's)")
    parser.add_argument("--dump-dir", default="remat_dump_ddp", help="rank r writes its dump to DUMP_DIR/rank<r>")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-baseline", action="store_true", help="skip the plain Inductor run")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps={args.steps}: need at least 3 (compile, DDP's bucket rebuild, then a measured step)")
    if "RANK" not in os.environ:
        parser.error("run it with torchrun, e.g. torchrun --nproc_per_node 2 examples/ddp_train.py")
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        try:
            extra = {} if args.headroom_fraction is None else {"headroom_fraction": args.headroom_fraction}
            backend = remat.backend(args.budget_gb, dump_dir=str(Path(args.dump_dir) / f"rank{rank}"), **extra)
        except (ValueError, TypeError) as error:
            parser.error(str(error))
        if rank == 0:
            print(f"remat DDP example: zoo GPT {GPTConfig()}, {world} ranks, batch {args.batch} per rank, {args.steps} steps "
                  f"on {device.type}, torch {torch.__version__}")
            print("units: 1 GB = 1e9 bytes, 1 MB = 1e6 bytes; peaks are per rank, above the memory resident at step start",
                  flush=True)
        try:
            ours = train(backend, args, device, rank)
        except remat.BudgetInfeasibleError as error:
            print(f"[rank {rank}] remat: {error}", file=sys.stderr)
            return 2
        base = None if args.no_baseline else train("inductor", args, device, rank)
        text = report(rank, backend, ours, base, device)
        for r in range(world):  # one rank at a time, so the lines do not interleave
            if r == rank:
                print("\n" + text, flush=True)
            dist.barrier()
        over = backend.options.budget_bytes is not None and ours["measured_peak_bytes"] > backend.options.budget_bytes
        if over:
            print(f"[rank {rank}] WARNING: the measured peak is over the budget", file=sys.stderr)
        return 1 if over else 0
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
