"""What the distributed test and benchmark share: the model, the batches, the wrapping, the ranks.

``tests/test_distributed.py`` and ``benchmarks/distributed_budget.py`` run the same two-rank
training on 127.0.0.1 (gloo): the zoo GPT (its default 4 layers) without dropout, batch 4 per rank,
3 steps, DDP with 1 MiB buckets or FSDP2 ``fully_shard`` on each block and the model.
``tests/test_distributed.py`` also runs DDP and FSDP2 on ``PostLNTiedLM`` (``--model postln``), a model
unlike the zoo GPT: 3 post-LN blocks, hand-written attention, a tied head.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from remat.testing.zoo import GPTConfig

WORLD_SIZE = 2
CFG = GPTConfig(dropout=0.0)   # the zoo GPT; no dropout: a single-process reference cannot replay per-rank masks
BATCH_PER_RANK = 4
STEPS = 3


class PostLNTiedLM(torch.nn.Module):
    """A language model unlike the zoo GPT, for the distributed tests: 3 post-LN blocks (the norm
    after each residual add), attention written out by hand (no SDPA), a GELU MLP of width 3d,
    and a head tied to the token embedding (``h @ tok.weight.t()``). No dropout."""

    def __init__(self, vocab_size: int = 384, seq_len: int = 64, d_model: int = 128, n_heads: int = 4,
                 n_layers: int = 3) -> None:
        super().__init__()
        self.vocab_size, self.seq_len, self.n_heads = vocab_size, seq_len, n_heads
        self.tok = torch.nn.Embedding(vocab_size, d_model)
        self.pos = torch.nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = torch.nn.ModuleList(_PostLNBlock(d_model, n_heads) for _ in range(n_layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return x @ self.tok.weight.t()


class _PostLNBlock(torch.nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model)
        self.proj = torch.nn.Linear(d_model, d_model)
        self.ln1, self.ln2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.fc1, self.fc2 = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(3 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        attn = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        x = self.ln1(x + self.proj((attn @ v).transpose(1, 2).reshape(b, t, d)))
        return self.ln2(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))


MODELS = ("gpt", "postln")   # the zoo GPT (CFG), and PostLNTiedLM


def make_model(name: str) -> torch.nn.Module:
    """A fresh model, the same on every rank and in the reference (seed 0)."""
    torch.manual_seed(0)
    from remat.testing.zoo import GPT

    return (GPT(CFG) if name == "gpt" else PostLNTiedLM()).train()


def batches(name: str = "gpt") -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per rank: (tokens, targets) for model ``name``, from a fixed generator."""
    vocab_size, seq_len = (CFG.vocab_size, CFG.seq_len) if name == "gpt" else (384, 64)
    generator = torch.Generator().manual_seed(7)
    steps = []
    for _ in range(STEPS):
        ranks = []
        for _ in range(WORLD_SIZE):
            tokens = torch.randint(0, vocab_size, (BATCH_PER_RANK, seq_len + 1), generator=generator)
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
    parser.add_argument("--model", choices=MODELS, default="gpt")
    parser.add_argument("--fraction", type=float, default=None, help="budget as a fraction of plain Inductor's peak")
    parser.add_argument("--attempts", type=int, default=3, help="compiles at most: the budget, then each one named")
    parser.add_argument("--verify-peak", type=int, default=None, help="remat.backend(verify_peak=); default: remat's")
    return parser
