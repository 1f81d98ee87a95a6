"""What the distributed test and benchmark share: the model, the batches, the wrapping.

``tests/test_distributed.py`` and ``benchmarks/distributed_budget.py`` run the same two-rank
training on 127.0.0.1 (gloo): the zoo GPT (its default 4 layers) without dropout, batch 4 per rank,
3 steps, DDP with 1 MiB buckets or FSDP2 ``fully_shard`` on each block and the model.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from models import GPTConfig

WORLD_SIZE = 2
CFG = GPTConfig(dropout=0.0)   # the zoo GPT; no dropout: a single-process reference cannot replay per-rank masks
BATCH_PER_RANK = 4
STEPS = 3


def batches() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per rank: (tokens, targets), from a fixed generator."""
    generator = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        ranks = []
        for _ in range(WORLD_SIZE):
            tokens = torch.randint(0, CFG.vocab_size, (BATCH_PER_RANK, CFG.seq_len + 1), generator=generator)
            ranks.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
        steps.append(ranks)
    return steps


def wrap(model: torch.nn.Module, mode: str) -> torch.nn.Module:
    """``mode`` "ddp": DistributedDataParallel with 1 MiB buckets (the smallest the DDP optimizer
    accepts: they split the GPT into pieces); "fsdp2": ``fully_shard`` on each block, then
    on the model."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, bucket_cap_mb=1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def all_max(value: float) -> float:
    """The largest ``value`` over the ranks."""
    tensor = torch.tensor([float(value)], dtype=torch.float64)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return float(tensor.item())


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, args: list[str], log_paths: list[Path], timeout_s: float) -> list[int]:
    """Start ``python script --worker --rank r --port P *args`` for every rank on a free port,
    one thread each (``OMP_NUM_THREADS=1``), output to ``log_paths[r]``; wait until all exit;
    kill every rank still running when one fails or ``timeout_s`` passes (a rank left alone
    blocks in a collective). Returns the exit codes (-9 for a killed rank)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = [open(path, "w") for path in log_paths]
    procs = [subprocess.Popen([sys.executable, script, "--worker", "--rank", str(r), "--port", str(port), *args],
                              env=env, stdout=logs[r], stderr=subprocess.STDOUT)
             for r in range(WORLD_SIZE)]
    deadline = time.monotonic() + timeout_s
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    return [p.returncode for p in procs]


def worker_parser() -> argparse.ArgumentParser:
    """The arguments every rank's worker takes (``run_ranks`` passes --rank and --port)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("ddp", "fsdp2"), required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    return parser
