"""A corpus of models nobody tuned remat to: random nets, CNNs, tiny Hugging Face models.

    from remat.testing import corpus
    for entry in corpus.entries(corpus.BENCHMARK_SEEDS):
        built = entry.build()                       # on CPU, fixed by the entry's seed
        loss = built.loss(torch.compile(built.model, backend=remat.backend(budget_gb=0.01)))

Each ``CorpusEntry`` has a name, a family (``random`` / ``cnn`` / ``hf``), a description, the
seed that fixes it, and ``build(checkpoint_blocks=False)`` returning a ``Built`` (the model in
training mode, its inputs, and its loss function). ``has_repeated_blocks`` says whether the
model runs a stack of blocks; ``build(checkpoint_blocks=True)`` then returns the same model
(same parameters) with every block application under non-reentrant
``torch.utils.checkpoint``: full per-block checkpointing, the baseline remat's floor is held
against. ``checkpointing`` says how that is done for the entry.

Seed ranges: the benchmark uses ``BENCHMARK_SEEDS``; tests draw from ``TEST_SEEDS`` (disjoint),
so no test fixes the benchmark's nets.

Losses: a model that computes its own loss (an LM with ``targets``, a Hugging Face model with
``labels``) returns it; any other output ``out`` is reduced by ``dot(out, w)`` with fixed random
weights ``w`` made once when the entry is built (a plain ``sum()`` sends the same gradient to every
position, which makes BatchNorm's input gradients rounding noise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from . import cnns, finetune, hf_models, random_nets
from .steps import grads_of

BENCHMARK_SEEDS = tuple(range(1000, 1028))
TEST_SEEDS = tuple(range(0, 100))
MODEL_SEED = 0            # the seed of the CNN family's and the Hugging Face models' parameters and inputs
LOSS_SEED = 4321


@dataclass(frozen=True)
class Built:
    """A corpus model on CPU, ready for a step: ``loss(module)`` runs ``module(*inputs, **kwargs)``
    (``module`` is ``model`` or its compiled wrapper) and returns the scalar loss."""

    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[Any], torch.Tensor]
    kwargs: dict[str, torch.Tensor] = field(default_factory=dict)

    def loss(self, module: Callable[..., Any]) -> torch.Tensor:
        return self.loss_fn(module(*self.inputs, **self.kwargs))


def loss_step(built: Built, module: Callable[..., Any], seed: int = 0) -> None:
    """One training step of ``built`` through ``module`` (its model, or a compiled wrapper): gradients set to None,
    ``torch.manual_seed(seed)`` (dropout draws the same masks every step), the loss's backward."""
    built.model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    built.loss(module).backward()


def plain_inductor_peak(entry: "CorpusEntry") -> tuple[int, dict[str, torch.Tensor]]:
    """``entry`` built anew (Dynamo reset first) and compiled with plain Inductor: the measured peak of its second
    ``loss_step`` (the first compiles) and the gradients that step left, by parameter name."""
    from ..measure import measure_peak_bytes

    torch._dynamo.reset()
    built = entry.build()
    plain = torch.compile(built.model, backend="inductor")
    loss_step(built, plain)
    peak = measure_peak_bytes(lambda: loss_step(built, plain)).peak_bytes
    return peak, grads_of(built.model)


@dataclass(frozen=True)
class CorpusEntry:
    name: str
    family: str                    # "random" | "cnn" | "hf"
    description: str
    seed: int
    has_repeated_blocks: bool
    checkpointing: str             # how build(checkpoint_blocks=True) checkpoints each block ("" if it cannot)
    make: Callable[[bool], Built] = field(repr=False, compare=False)

    def build(self, checkpoint_blocks: bool = False, freeze: Optional[str] = None, channels_last: bool = False,
              dtype: Optional[torch.dtype] = None, eager_cross_entropy: bool = False) -> Built:
        """A fresh model and inputs; two calls give equal parameters and inputs. With ``freeze`` (one of
        ``finetune.FREEZE_REGIMES``) the model is fine-tuned as that regime says (``finetune.freeze_parameters``);
        with ``channels_last``, laid out as ``to_channels_last`` says; with ``dtype`` (a floating dtype), in
        that dtype as ``to_dtype`` says; with ``eager_cross_entropy``, its loss computed outside the model as
        ``to_eager_cross_entropy`` says."""
        if checkpoint_blocks and not self.has_repeated_blocks:
            raise ValueError(f"{self.name} has no repeated blocks to checkpoint (has_repeated_blocks=False)")
        built = self.make(checkpoint_blocks)
        if freeze is not None:
            finetune.freeze_parameters(built.model, freeze)
        if dtype is not None:
            built = to_dtype(built, dtype)
        if eager_cross_entropy:
            built = to_eager_cross_entropy(built)
        return to_channels_last(built) if channels_last else built


def to_eager_cross_entropy(built: Built) -> Built:
    """``built`` with its loss a cross-entropy computed outside the model, on its output's last dimension
    taken as class logits, as most training loops write ``F.cross_entropy(model(x), y)`` next to a compiled
    model: a Hugging Face model is no longer given its ``labels`` (an encoder-decoder gets the
    ``decoder_input_ids`` it made from them) and its ``logits`` are scored against them; any other output
    against targets drawn once, at the first call, from a generator seeded with ``LOSS_SEED`` (equal across
    builds). A model that returns its own loss (a scalar: a random LM with ``loss_inside``) keeps it."""
    kwargs = dict(built.kwargs)
    labels = kwargs.pop("labels", None)
    if labels is not None and getattr(getattr(built.model, "config", None), "is_encoder_decoder", False):
        kwargs["decoder_input_ids"] = built.model.prepare_decoder_input_ids_from_labels(labels=labels)
    drawn: list[torch.Tensor] = []

    def loss(out: Any) -> torch.Tensor:
        logits = out.logits if labels is not None else out
        if labels is None and logits.dim() == 0:
            return built.loss_fn(out)
        if labels is not None:
            targets = labels
        else:
            if not drawn:
                drawn.append(torch.randint(0, logits.shape[-1], tuple(logits.shape[:-1]),
                                           generator=torch.Generator().manual_seed(LOSS_SEED)))
            targets = drawn[0]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return Built(built.model, built.inputs, loss, kwargs)


def to_dtype(built: Built, dtype: torch.dtype) -> Built:
    """``built`` trained in ``dtype`` throughout (a pure bfloat16 model, no autocast): ``model.to(dtype)``
    (its floating parameters and buffers, in place) and every floating input tensor cast to it; integer
    inputs (token ids, labels) are unchanged. The loss functions take the output as it comes."""
    if not dtype.is_floating_point:
        raise ValueError(f"dtype {dtype} is not a floating dtype: a corpus model trains in a floating dtype")
    built.model.to(dtype)

    def cast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.to(dtype)
        return value
    return _with_inputs(built, cast)


def to_channels_last(built: Built) -> Built:
    """``built`` in the channels-last memory format, as PyTorch's performance guide has CNN users train:
    ``model.to(memory_format=torch.channels_last)`` (its 4-D parameters and buffers, in place) and every 4-D input
    tensor made contiguous in that format; a model with no 4-D tensor is unchanged."""
    built.model.to(memory_format=torch.channels_last)

    def laid_out(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() == 4:
            return value.contiguous(memory_format=torch.channels_last)
        return value
    return _with_inputs(built, laid_out)


def _with_inputs(built: Built, change: Callable[[Any], Any]) -> Built:
    """``built`` with ``change`` applied to each of its inputs, positional and keyword."""
    return Built(built.model, tuple(change(t) for t in built.inputs), built.loss_fn,
                 {k: change(v) for k, v in built.kwargs.items()})


def weighted_sum(shape: tuple[int, ...]) -> Callable[[Any], torch.Tensor]:
    """``out -> dot(out, w)`` with ``w`` drawn once, now, from a generator seeded with ``LOSS_SEED``."""
    weights = torch.randn(shape, generator=torch.Generator().manual_seed(LOSS_SEED)).reshape(-1)

    def loss(out: torch.Tensor) -> torch.Tensor:
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"output shape {tuple(out.shape)} is not the {tuple(shape)} the loss weights were made for")
        return torch.dot(out.float().reshape(-1), weights)
    return loss


def _own_loss(out: torch.Tensor) -> torch.Tensor:
    return out


def _hf_loss(out: Any) -> torch.Tensor:
    return out.loss


def output_shape(spec: random_nets.NetSpec) -> tuple[int, ...]:
    """The shape of a random net's output (``()`` when it returns its loss)."""
    if spec.kind == "conv":
        return (spec.batch, 10)
    if spec.kind == "lm":
        return () if spec.loss_inside else (spec.batch, spec.seq_len, spec.vocab)
    return (spec.batch, 8) if spec.final_reduce in ("mean", "amax") else (spec.batch, spec.seq_len, 8)


def random_entry(seed: int, graph_breaks: bool = False) -> CorpusEntry:
    """The random net ``seed`` draws (``rand-<seed>``); with ``graph_breaks``, that net with the graph breaks
    ``random_nets.with_graph_breaks`` draws for it (``rand-brk-<seed>``)."""
    spec = random_nets.net_spec(seed)
    if graph_breaks:
        spec = random_nets.with_graph_breaks(spec)

    def make(checkpoint_blocks: bool) -> Built:
        model, inputs = random_nets.build_net(spec, checkpoint_blocks)
        shape = output_shape(spec)
        return Built(model, inputs, weighted_sum(shape) if shape else _own_loss)

    return CorpusEntry(f"rand-{'brk-' if graph_breaks else ''}{seed}", "random", spec.describe(), seed, spec.has_repeated_blocks,
                       "each application of model.blocks[i] under torch.utils.checkpoint(use_reentrant=False)", make)


def cnn_entry(shape: cnns.CNNShape, seed: int = MODEL_SEED) -> CorpusEntry:
    def make(checkpoint_blocks: bool) -> Built:
        model, inputs = cnns.build_cnn(shape, seed, checkpoint_blocks)
        return Built(model, inputs, weighted_sum((shape.batch, 10)))

    return CorpusEntry(shape.name, "cnn", shape.describe(), seed, True,
                       "each of model.blocks under torch.utils.checkpoint(use_reentrant=False)", make)


def hf_entry(spec: hf_models.HFModelSpec, seed: int = MODEL_SEED) -> CorpusEntry:
    def make(checkpoint_blocks: bool) -> Built:
        model, kwargs = hf_models.build_hf(spec, seed, checkpoint_blocks)
        return Built(model, (), _hf_loss, kwargs)

    return CorpusEntry(spec.name, "hf", spec.description, seed, True,
                       "model.gradient_checkpointing_enable(use_reentrant=False): every layer checkpointed", make)


def hf_skip_reason() -> Optional[str]:
    """Why the Hugging Face models are left out (None when they are in)."""
    return hf_models.available()


def entries(seeds: tuple[int, ...] = BENCHMARK_SEEDS, *, include_cnns: bool = True, include_hf: bool = True,
            cnn_seeds: tuple[int, ...] = (), hf_seeds: tuple[int, ...] = (),
            hf_vocab: int = hf_models.VOCAB, break_seeds: tuple[int, ...] = ()) -> list[CorpusEntry]:
    """Random nets for ``seeds``, the random nets with graph breaks for ``break_seeds`` (``rand-brk-<seed>``), then the fixed CNN shapes and the CNNs drawn from ``cnn_seeds``
    (``cnn-<seed>``), then the fixed Hugging Face models and those drawn from ``hf_seeds``
    (``hf-<seed>``, language models with an ``hf_vocab``-token vocabulary) when ``transformers`` is importable
    (``hf_skip_reason()`` says why not otherwise). A drawn model's parameters and inputs come from its own seed."""
    chosen = [random_entry(seed) for seed in seeds] + [random_entry(seed, graph_breaks=True) for seed in break_seeds]
    if include_cnns:
        chosen += [cnn_entry(shape) for shape in cnns.SHAPES]
        chosen += [cnn_entry(cnns.cnn_shape(seed), seed) for seed in cnn_seeds]
    if include_hf and hf_skip_reason() is None:
        chosen += [hf_entry(spec) for spec in hf_models.hf_specs()]
        chosen += [hf_entry(hf_models.hf_spec(seed, hf_vocab), seed) for seed in hf_seeds]
    return chosen
