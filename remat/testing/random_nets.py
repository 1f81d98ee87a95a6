"""Random nets from a grammar of common layers, each fully determined by an integer seed.

``net_spec(seed)`` draws a ``NetSpec`` with ``random.Random(seed)`` (never the global RNG);
``build_net(spec)`` builds it with ``torch.manual_seed(seed)`` for the parameters and a
``torch.Generator`` seeded from ``seed`` for the inputs. The grammar:

- sequence nets (a language model over token ids, or a regressor over float features):
  blocks of pre- or post-norm (``nn.LayerNorm``, an RMSNorm written out, or none), a mixer
  (attention written out with view / permute / ``.contiguous()`` / softmax, or
  ``F.scaled_dot_product_attention``; an MLP with GELU / SiLU / ReLU / in-place ``relu_``;
  a gated SiLU MLP), dropout, residuals (``x + h`` or in place ``h.add_(x)``), reductions (a
  sigmoid gate from a feature mean; the final mean / amax over time), ``torch.no_grad()``
  statistics that rescale a block's input; a block may be applied twice (the same module,
  shared weights); the LM head may be tied to the embedding (``h @ emb.weight.t()``) and the
  loss computed inside the model or outside it;
- conv nets: conv3x3 + BatchNorm (or none) + activation blocks with residuals, max / avg
  pooling, global average pooling and a linear head.

``with_graph_breaks(spec)`` adds graph breaks to a net (``BreakSpec``, drawn from the net's seed by its
own generator, so the net itself is the one ``net_spec`` draws): at points of the model's own forward
(after the embedding, input projection or stem, before the head, before the loss; Dynamo splits the forward into
graphs there and resumes after the break), or inside blocks (a block's forward ends in the break: the
blocks are called from a loop, so Dynamo runs the model's own forward eagerly, embedding, head and loss
included, and compiles each block's forward on its own, as with a Hugging Face layer that breaks).
What runs at a break: ``torch._dynamo.graph_break()`` (nothing), a finiteness check that reads a
tensor's value in Python (``bool(torch.isfinite(h).all())``, as training loops guard against NaNs), or
an eager function (``torch._dynamo.disable``) whose autograd saves its input and output for the
backward, memory no compiled graph holds.

Sizes are drawn so one compile takes seconds and a training step peaks at roughly 0.2-30 MB.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class BlockSpec:
    norm: str            # "layernorm" | "rmsnorm" | "none"
    post_norm: bool
    mixer: str           # "attention" (written out) | "sdpa" | "mlp" | "gated-mlp"
    activation: str      # "gelu" | "silu" | "relu" | "relu_" (in place)
    residual: str        # "add" | "add_" (in place) | "none"
    dropout_p: float
    causal: bool
    fused_qkv: bool
    scale_q_after_permute: bool   # q.permute(...) * scale, then the matmul
    no_grad_rescale: bool         # x / (a torch.no_grad() max statistic of x)
    reduce_gate: bool             # h * sigmoid(h.mean(-1))


@dataclass(frozen=True)
class ConvBlockSpec:
    c_out: int
    batchnorm: bool
    activation: str      # "gelu" | "silu" | "relu"
    residual: bool       # only where c_in == c_out
    pool: str            # "max" | "avg" | "none" (2x2, after the block)
    dropout_p: float


@dataclass(frozen=True)
class NetSpec:
    seed: int
    kind: str                         # "lm" | "seq" | "conv"
    batch: int
    seq_len: int                      # sequence nets: tokens; conv nets: image side
    width: int                        # d_model, or the stem's channels
    n_heads: int
    vocab: int
    blocks: tuple                     # BlockSpec or ConvBlockSpec per distinct block
    schedule: tuple[int, ...]         # the order blocks run in; an index may repeat (same module twice)
    tied_head: bool
    loss_inside: bool
    final_reduce: str                 # seq nets: "none" | "mean" | "amax"
    breaks: "BreakSpec | None" = None  # graph breaks (``with_graph_breaks``); None: the forward has none

    @property
    def has_repeated_blocks(self) -> bool:
        return len(self.schedule) >= 2

    def describe(self) -> str:
        return self._describe_net() + ("" if self.breaks is None else f"; {self.breaks.describe()}")

    def _describe_net(self) -> str:
        if self.kind == "conv":
            parts = [f"c{b.c_out}{'-bn' if b.batchnorm else ''}-{b.activation}{'-res' if b.residual else ''}"
                     f"{'-' + b.pool + 'pool' if b.pool != 'none' else ''}{'-drop' if b.dropout_p else ''}"
                     for b in self.blocks]
            return f"conv {self.batch}x3x{self.seq_len}x{self.seq_len}: " + " ".join(parts)
        parts = [f"{'post' if b.post_norm else 'pre'}-{b.norm}/{b.mixer}/{b.activation}/{b.residual}"
                 f"{'/drop' if b.dropout_p else ''}{'/nograd' if b.no_grad_rescale else ''}"
                 f"{'/gate' if b.reduce_gate else ''}" for b in self.blocks]
        head = (f", {'tied' if self.tied_head else 'untied'} head, loss {'inside' if self.loss_inside else 'outside'}"
                if self.kind == "lm" else f", reduce {self.final_reduce}")
        return (f"{self.kind} b{self.batch} t{self.seq_len} d{self.width} h{self.n_heads}, schedule "
                f"{list(self.schedule)}{head}: " + "; ".join(parts))


def _block_spec(rng: random.Random, lm: bool) -> BlockSpec:
    mixer = rng.choice(["attention", "attention", "sdpa", "mlp", "gated-mlp"])
    return BlockSpec(
        norm=rng.choice(["layernorm", "rmsnorm", "none"]), post_norm=rng.random() < 0.3, mixer=mixer,
        activation=rng.choice(["gelu", "silu", "relu", "relu_"]), residual=rng.choice(["add", "add", "add_", "none"]),
        dropout_p=rng.choice([0.0, 0.0, 0.1]), causal=lm or rng.random() < 0.5, fused_qkv=rng.random() < 0.5,
        scale_q_after_permute=rng.random() < 0.5, no_grad_rescale=rng.random() < 0.2, reduce_gate=rng.random() < 0.2)


def _conv_spec(rng: random.Random) -> NetSpec:
    stem, side = rng.choice([8, 16, 24]), rng.choice([16, 24, 32])
    blocks, c, now = [], stem, side
    for _ in range(rng.randint(2, 5)):
        c_out = c if rng.random() < 0.6 else min(c * 2, 48)
        pool = rng.choice(["max", "avg", "none", "none"]) if now >= 8 else "none"
        blocks.append(ConvBlockSpec(c_out=c_out, batchnorm=rng.random() < 0.75, activation=rng.choice(["gelu", "silu", "relu"]),
                                    residual=c_out == c and rng.random() < 0.6, pool=pool,
                                    dropout_p=rng.choice([0.0, 0.0, 0.1])))
        c, now = c_out, now // 2 if pool != "none" else now
    batch = rng.choice([4, 8, 16])
    while batch > 1 and batch * stem * side * side * 4 * 6 * len(blocks) > 20e6:
        batch //= 2
    return NetSpec(seed=0, kind="conv", batch=batch, seq_len=side, width=stem, n_heads=0, vocab=0,
                   blocks=tuple(blocks), schedule=tuple(range(len(blocks))), tied_head=False, loss_inside=False,
                   final_reduce="none")


def net_spec(seed: int) -> NetSpec:
    """The net ``seed`` names (pure: the same seed always gives the same spec)."""
    rng = random.Random(seed)
    kind = rng.choice(["lm", "lm", "seq", "seq", "conv"])
    if kind == "conv":
        return dataclasses.replace(_conv_spec(rng), seed=seed)
    n_heads = rng.choice([2, 4])
    width = n_heads * rng.choice([16, 32, 48])
    seq_len, batch = rng.choice([32, 64, 128]), rng.choice([2, 4, 8])
    blocks = tuple(_block_spec(rng, kind == "lm") for _ in range(rng.randint(1, 3)))
    schedule = list(range(len(blocks)))
    if rng.random() < 0.4:      # the same block (module) applied twice in a row
        repeat = rng.randrange(len(blocks))
        schedule.insert(repeat, repeat)
    # rough bytes of one step: ~12 activations of b*t*d and 3 of b*h*t*t per block application
    while batch > 1 and len(schedule) * 4 * (12 * batch * seq_len * width + 3 * batch * n_heads * seq_len ** 2) > 25e6:
        batch //= 2
    return NetSpec(seed=seed, kind=kind, batch=batch, seq_len=seq_len, width=width, n_heads=n_heads,
                   vocab=rng.choice([256, 512, 1024]), blocks=blocks, schedule=tuple(schedule),
                   tied_head=kind == "lm" and rng.random() < 0.5, loss_inside=kind == "lm" and rng.random() < 0.5,
                   final_reduce=rng.choice(["none", "mean", "amax"]))


BREAK_KINDS = ("graph-break", "finite-check", "eager-function")
BREAK_POINTS = {"lm": ("after-input", "before-head", "before-loss"), "seq": ("after-input", "before-head"),
                "conv": ("after-input", "before-head")}
BREAK_DRAW_OFFSET = 7_000_003     # the breaks' generator: seed + this, apart from the net's own draw


@dataclass(frozen=True)
class BreakSpec:
    """Where a net's forward breaks its graph and what runs there (``with_graph_breaks``)."""

    points: tuple[str, ...]      # in the model's own forward, of ``BREAK_POINTS[kind]``
    blocks: tuple[int, ...]      # distinct blocks whose forward ends in a break (the model's forward then runs eagerly)
    kind: str                    # of ``BREAK_KINDS``: what runs at each break

    def describe(self) -> str:
        where = (f"blocks {list(self.blocks)} end in" if self.blocks else "the forward has")
        return f"{where} a graph break ({self.kind})" + (f" at {', '.join(self.points)}" if self.points else "")


def with_graph_breaks(spec: NetSpec) -> NetSpec:
    """``spec`` with graph breaks drawn from ``random.Random(spec.seed + BREAK_DRAW_OFFSET)`` (pure): in
    two of three nets one to three points of the model's own forward, else one or two blocks (at most
    every block but one) whose forward ends in a break; one kind of ``BREAK_KINDS`` for all of them."""
    rng = random.Random(spec.seed + BREAK_DRAW_OFFSET)
    points = tuple(p for p in BREAK_POINTS[spec.kind] if p != "before-loss" or spec.loss_inside)
    kind = rng.choice(BREAK_KINDS)
    if rng.random() < 2 / 3 or len(spec.blocks) < 2:
        chosen = set(rng.sample(points, rng.randint(1, len(points))))
        return dataclasses.replace(spec, breaks=BreakSpec(tuple(p for p in points if p in chosen), (), kind))
    blocks = sorted(rng.sample(range(len(spec.blocks)), rng.randint(1, min(2, len(spec.blocks) - 1))))
    return dataclasses.replace(spec, breaks=BreakSpec((), tuple(blocks), kind))


@torch._dynamo.disable
def _eager_silu_gate(h: torch.Tensor) -> torch.Tensor:
    """``h * sigmoid(h)`` run eagerly wherever it is called from (its autograd saves ``h`` and ``sigmoid(h)``)."""
    return h * torch.sigmoid(h)


def graph_break(kind: str, h: torch.Tensor) -> torch.Tensor:
    """What runs at a break of ``kind`` (``BREAK_KINDS``), on the value ``h`` crossing it."""
    if kind == "graph-break":
        torch._dynamo.graph_break()
        return h
    if kind == "finite-check":
        if not bool(torch.isfinite(h.detach()).all()):
            raise FloatingPointError("a non-finite activation")
        return h
    return _eager_silu_gate(h)


def _break_at(spec: NetSpec, point: str, h: torch.Tensor) -> torch.Tensor:
    return graph_break(spec.breaks.kind, h) if spec.breaks is not None and point in spec.breaks.points else h


class RMSNorm(nn.Module):
    """RMSNorm written out (no fused op), as many model files do."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _norm(kind: str, dim: int) -> nn.Module:
    return {"layernorm": lambda: nn.LayerNorm(dim), "rmsnorm": lambda: RMSNorm(dim), "none": nn.Identity}[kind]()


def _activate(kind: str, h: torch.Tensor) -> torch.Tensor:
    if kind == "relu_":
        return h.relu_()     # in place on a linear's output (which its backward does not read)
    return {"gelu": F.gelu, "silu": F.silu, "relu": F.relu}[kind](h)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, spec: BlockSpec, seq_len: int) -> None:
        super().__init__()
        self.n_heads, self.spec = n_heads, spec
        self.qkv = nn.Linear(d, 3 * d) if spec.fused_qkv else None
        self.q, self.k, self.v = (None, None, None) if spec.fused_qkv else (nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d))
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(spec.dropout_p)
        self.register_buffer("mask", torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.n_heads
        q, k, v = self.qkv(x).split(d, dim=-1) if self.qkv is not None else (self.q(x), self.k(x), self.v(x))
        q, k, v = (z.view(b, t, self.n_heads, hd).permute(0, 2, 1, 3) for z in (q, k, v))
        scale = 1.0 / math.sqrt(hd)
        if self.spec.mixer == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.spec.dropout_p if self.training else 0.0,
                                               is_causal=self.spec.causal)
        else:
            if self.spec.scale_q_after_permute:
                att = (q * scale) @ k.transpose(-2, -1)
            else:
                att = (q @ k.transpose(-2, -1)) * scale
            if self.spec.causal:
                att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
            y = self.drop(F.softmax(att, dim=-1)) @ v
        return self.proj(y.permute(0, 2, 1, 3).contiguous().view(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int, spec: BlockSpec) -> None:
        super().__init__()
        self.spec = spec
        self.fc1 = nn.Linear(d, 4 * d)
        self.gate = nn.Linear(d, 4 * d, bias=False) if spec.mixer == "gated-mlp" else None
        self.fc2 = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(spec.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            h = F.silu(self.gate(x)) * self.fc1(x)
        else:
            h = _activate(self.spec.activation, self.fc1(x))
        return self.fc2(self.drop(h))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, spec: BlockSpec, seq_len: int, break_kind: str | None = None) -> None:
        super().__init__()
        self.spec, self.break_kind = spec, break_kind
        self.norm = _norm(spec.norm, d)
        self.mixer = Attention(d, n_heads, spec, seq_len) if spec.mixer in ("attention", "sdpa") else MLP(d, spec)
        self.drop = nn.Dropout(spec.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.no_grad_rescale:
            with torch.no_grad():
                s = x.abs().amax(dim=-1, keepdim=True).clamp_min(1.0)
            x = x / s
        h = self.mixer(x if self.spec.post_norm else self.norm(x))
        if self.spec.reduce_gate:
            h = h * torch.sigmoid(h.mean(dim=-1, keepdim=True))
        h = self.drop(h)
        if self.spec.residual == "add":
            h = x + h
        elif self.spec.residual == "add_":
            h = h.add_(x)     # in place on a value no backward reads (a dropout's, mul's or linear's output)
        h = self.norm(h) if self.spec.post_norm else h
        return h if self.break_kind is None else graph_break(self.break_kind, h)


class ConvBlock(nn.Module):
    def __init__(self, c_in: int, spec: ConvBlockSpec, break_kind: str | None = None) -> None:
        super().__init__()
        self.spec, self.break_kind = spec, break_kind
        self.conv = nn.Conv2d(c_in, spec.c_out, 3, padding=1, bias=not spec.batchnorm)
        self.bn = nn.BatchNorm2d(spec.c_out) if spec.batchnorm else nn.Identity()
        self.drop = nn.Dropout(spec.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(_activate(self.spec.activation, self.bn(self.conv(x))))
        if self.spec.residual:
            h = h + x
        if self.spec.pool == "max":
            h = F.max_pool2d(h, 2)
        elif self.spec.pool == "avg":
            h = F.avg_pool2d(h, 2)
        return h if self.break_kind is None else graph_break(self.break_kind, h)


class SeqNet(nn.Module):
    """A language model over token ids (``kind="lm"``) or a regressor over features (``"seq"``)."""

    def __init__(self, spec: NetSpec, checkpoint_blocks: bool = False) -> None:
        super().__init__()
        self.spec, self.checkpoint_blocks = spec, checkpoint_blocks
        d = spec.width
        if spec.kind == "lm":
            self.emb = nn.Embedding(spec.vocab, d)
            self.pos = nn.Parameter(0.02 * torch.randn(spec.seq_len, d))
        else:
            self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(Block(d, spec.n_heads, b, spec.seq_len, _block_break(spec, i))
                                    for i, b in enumerate(spec.blocks))
        self.final_norm = nn.LayerNorm(d)
        self.head = None if spec.tied_head else nn.Linear(d, spec.vocab if spec.kind == "lm" else 8)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]] if self.spec.kind == "lm" else self.inp(x)
        h = _break_at(self.spec, "after-input", h)
        for i in self.spec.schedule:
            block = self.blocks[i]
            h = checkpoint(block, h, use_reentrant=False) if self.checkpoint_blocks else block(h)
        h = _break_at(self.spec, "before-head", self.final_norm(h))
        out = h @ self.emb.weight.t() if self.head is None else self.head(h)
        if self.spec.kind == "lm":
            out = _break_at(self.spec, "before-loss", out)
            return F.cross_entropy(out.view(-1, out.shape[-1]), targets.view(-1)) if self.spec.loss_inside else out
        if self.spec.final_reduce == "mean":
            return out.mean(dim=1)
        return out.amax(dim=1) if self.spec.final_reduce == "amax" else out


class ConvNet(nn.Module):
    def __init__(self, spec: NetSpec, checkpoint_blocks: bool = False, n_classes: int = 10) -> None:
        super().__init__()
        self.spec, self.checkpoint_blocks = spec, checkpoint_blocks
        self.stem = nn.Conv2d(3, spec.width, 3, padding=1)
        blocks, c = [], spec.width
        for i, b in enumerate(spec.blocks):
            blocks.append(ConvBlock(c, b, _block_break(spec, i)))
            c = b.c_out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(c, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _break_at(self.spec, "after-input", F.relu(self.stem(x)))
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpoint_blocks else block(h)
        return self.head(_break_at(self.spec, "before-head", F.adaptive_avg_pool2d(h, 1).flatten(1)))


def _block_break(spec: NetSpec, index: int) -> str | None:
    """The kind of break block ``index``'s forward ends in, or None."""
    return spec.breaks.kind if spec.breaks is not None and index in spec.breaks.blocks else None


def build_net(spec: NetSpec, checkpoint_blocks: bool = False) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The net and its inputs: parameters from ``torch.manual_seed(spec.seed)``, inputs from a
    generator seeded with ``spec.seed`` (the same spec always gives the same tensors).
    ``checkpoint_blocks=True`` runs every block application under non-reentrant checkpointing
    (same parameters: the seed fixes them)."""
    torch.manual_seed(spec.seed)
    model = (ConvNet if spec.kind == "conv" else SeqNet)(spec, checkpoint_blocks)
    gen = torch.Generator().manual_seed(spec.seed)
    if spec.kind == "conv":
        inputs: tuple[torch.Tensor, ...] = (torch.randn(spec.batch, 3, spec.seq_len, spec.seq_len, generator=gen),)
    elif spec.kind == "seq":
        inputs = (torch.randn(spec.batch, spec.seq_len, 16, generator=gen),)
    else:
        ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq_len + 1), generator=gen)
        inputs = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()) if spec.loss_inside else (ids[:, :-1].contiguous(),)
    return model.train(), inputs
