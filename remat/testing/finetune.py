"""Fine-tuning regimes for corpus models: which parameters train, and low-rank adapters.

    from remat.testing import finetune
    finetune.freeze_parameters(model, "lora")      # every nn.Linear frozen and given a rank-4 adapter

A fine-tuned step differs in memory from full training in ways remat's planner sees only through
the graph: a frozen weight needs no gradient, so its layer's input need not be kept for one; the
backward stops below the lowest parameter that trains; a library call asked for fewer gradients
may still compute more (the CPU convolution backward asked for a bias's gradient alone returns the
weight's too). The regimes (``FREEZE_REGIMES``):

- ``"bottom-half"``: the leading parameters in registration order (embeddings, stem, first blocks)
  frozen until at least half of the parameters' elements are: fine-tuning the top of a model.
- ``"matrices"``: every parameter of two or more dimensions frozen (linear and convolution weights,
  embeddings); biases and normalisation scales train (BitFit).
- ``"lora"``: every parameter frozen, and every ``nn.Linear`` ``y = base(x)`` becomes
  ``base(x) + (x @ A.T @ B.T) * (alpha / rank)`` with trainable ``A`` (rank x in) and ``B``
  (out x rank) drawn from a generator seeded with ``ADAPTER_SEED`` (``B`` is not zero, as it is at the
  start of LoRA training, so that every adapter gets a nonzero gradient to compare).

Applied after a model is built, the same way to every variant (a checkpointed copy included), so the
variants keep equal parameters.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

FREEZE_REGIMES = ("bottom-half", "matrices", "lora")
LORA_RANK = 4
LORA_ALPHA = 8.0
ADAPTER_SEED = 777


class LoRALinear(nn.Module):
    """``base(x) + (x @ lora_a.T @ lora_b.T) * scale``: a frozen ``nn.Linear`` with a trainable low-rank adapter."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        a = torch.randn(rank, base.in_features, generator=generator) / base.in_features ** 0.5
        b = torch.randn(base.out_features, rank, generator=generator) / rank ** 0.5
        self.lora_a = nn.Parameter(a.to(base.weight.dtype))
        self.lora_b = nn.Parameter(b.to(base.weight.dtype))

    # read by models that look at their layers' weights (T5's feed-forward checks ``wo.weight``'s dtype)
    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def add_lora(model: nn.Module, rank: int = LORA_RANK, alpha: float = LORA_ALPHA) -> list[str]:
    """Freeze every parameter of ``model`` and wrap each of its ``nn.Linear`` modules in ``LoRALinear``;
    returns the wrapped modules' names. Raises ``ValueError`` when the model has no ``nn.Linear``."""
    for param in model.parameters():
        param.requires_grad_(False)
    generator = torch.Generator().manual_seed(ADAPTER_SEED)
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear to adapt: the 'lora' regime needs one")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(module, rank, alpha, generator))
    return [name for name, _ in targets]


def freeze_parameters(model: nn.Module, regime: str) -> list[str]:
    """Fine-tune ``model`` as ``regime`` says (see the module docstring); returns the names of the
    parameters frozen (under ``"lora"``: of the modules given adapters).

    Raises ``ValueError`` for an unknown regime, or when the regime would leave nothing to train."""
    if regime == "lora":
        return add_lora(model)
    named = list(model.named_parameters())
    if regime == "bottom-half":
        total, frozen_elements, frozen = sum(p.numel() for _, p in named), 0, []
        for name, param in named:
            if 2 * frozen_elements >= total:
                break
            frozen.append(name)
            frozen_elements += param.numel()
    elif regime == "matrices":
        frozen = [name for name, param in named if param.dim() >= 2]
    else:
        raise ValueError(f"unknown freeze regime {regime!r}: choose one of {FREEZE_REGIMES}")
    if len(frozen) == len(named):
        raise ValueError(f"freeze regime {regime!r} freezes all {len(named)} parameters: nothing would train")
    chosen = set(frozen)
    for name, param in named:
        if name in chosen:
            param.requires_grad_(False)
    return frozen


__all__ = ["ADAPTER_SEED", "FREEZE_REGIMES", "LORA_ALPHA", "LORA_RANK", "LoRALinear", "add_lora", "freeze_parameters"]
