"""Tiny Hugging Face models built from configs (no downloads), each with a training loss.

Needs ``transformers`` (the ``bench`` extra); ``available()`` says whether it is importable and,
if not, why. Every model: 2-3 layers, hidden size 128-256, parameters from
``torch.manual_seed(seed)``, inputs from a generator with the same seed, ``labels`` passed so
the model computes its own loss (``output.loss``). ``hf_specs()`` are nine fixed configurations;
``hf_spec(seed)`` draws one from a seed (the family, attention implementation, sizes, tying,
dropout), so a corpus can hold configurations nobody has tuned to. ``checkpoint_blocks=True`` turns on the
model's own per-layer checkpointing (``gradient_checkpointing_enable`` with
``use_reentrant=False``), which is full per-block checkpointing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class HFModelSpec:
    name: str
    description: str
    make: Callable[[], nn.Module]          # the model from its config (parameters drawn from the global RNG)
    inputs: Callable[[torch.Generator], dict[str, torch.Tensor]]


def available() -> Optional[str]:
    """None when ``transformers`` can be imported, else the reason it cannot."""
    try:
        import transformers  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means: skip these models
        return f"transformers is not importable ({type(error).__name__}: {error}); pip install -e '.[bench]'"
    return None


def _tokens(vocab: int, batch: int, seq: int, causal_lm: bool) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        if causal_lm:
            return {"input_ids": ids, "labels": ids.clone()}
        labels = torch.where(torch.rand(batch, seq, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
        return {"input_ids": ids, "labels": labels}
    return make


def _seq2seq(vocab: int, batch: int, src: int, tgt: int) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, vocab, (batch, src), generator=gen),
                "labels": torch.randint(0, vocab, (batch, tgt), generator=gen)}
    return make


def _images(batch: int, side: int, classes: int) -> Callable[[torch.Generator], dict[str, torch.Tensor]]:
    def make(gen: torch.Generator) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(batch, 3, side, side, generator=gen),
                "labels": torch.randint(0, classes, (batch,), generator=gen)}
    return make


def _decoder(cls_name: str, config_name: str, attn: str, **config: Any) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        import transformers

        cfg = getattr(transformers, config_name)(**config)
        cfg._attn_implementation = attn
        return getattr(transformers, cls_name)(cfg)
    return make


VOCAB = 512


def _gpt2(attn: str, d: int, layers: int) -> Callable[[], nn.Module]:
    return _decoder("GPT2LMHeadModel", "GPT2Config", attn, vocab_size=VOCAB, n_positions=256, n_embd=d, n_layer=layers,
                    n_head=4, bos_token_id=0, eos_token_id=0, use_cache=False)


def _llama_like(hidden: int, intermediate: int, layers: int, **extra: Any) -> dict[str, Any]:
    """The config of a Llama-family decoder with GQA (4 query heads, 2 key/value heads)."""
    return dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, use_cache=False,
                bos_token_id=0, eos_token_id=1, pad_token_id=2, **extra)


def _bert(hidden: int, layers: int, intermediate: int) -> Callable[[], nn.Module]:
    return _decoder("BertForMaskedLM", "BertConfig", "eager", vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                    num_attention_heads=4, intermediate_size=intermediate, max_position_embeddings=256)


def _t5(d: int, d_kv: int, d_ff: int, layers: int) -> Callable[[], nn.Module]:
    return _decoder("T5ForConditionalGeneration", "T5Config", "eager", vocab_size=VOCAB, d_model=d, d_kv=d_kv, d_ff=d_ff,
                    num_layers=layers, num_decoder_layers=layers, num_heads=4, decoder_start_token_id=0, pad_token_id=0,
                    eos_token_id=1, use_cache=False)


def _vit(image: int, patch: int, hidden: int, layers: int, intermediate: int) -> Callable[[], nn.Module]:
    return _decoder("ViTForImageClassification", "ViTConfig", "eager", image_size=image, patch_size=patch,
                    hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=intermediate,
                    num_labels=10)


def hf_specs() -> list[HFModelSpec]:
    """The Hugging Face corpus (only call when ``available()`` is None)."""
    llama_like = _llama_like(128, 352, 2)
    return [
        HFModelSpec("hf-gpt2-eager", "GPT2LMHeadModel 3 layers d=128, 4 heads, eager attention, dropout 0.1, batch 4 x 128",
                    _gpt2("eager", 128, 3), _tokens(VOCAB, 4, 128, True)),
        HFModelSpec("hf-gpt2-sdpa", "GPT2LMHeadModel 2 layers d=256, 4 heads, SDPA, dropout 0.1, batch 2 x 128",
                    _gpt2("sdpa", 256, 2), _tokens(VOCAB, 2, 128, True)),
        HFModelSpec("hf-llama-sdpa", "LlamaForCausalLM 2 layers d=128, GQA 4/2 heads, SDPA, batch 4 x 128",
                    _decoder("LlamaForCausalLM", "LlamaConfig", "sdpa", **llama_like), _tokens(VOCAB, 4, 128, True)),
        HFModelSpec("hf-llama-eager", "LlamaForCausalLM 3 layers d=128, tied embeddings, eager attention, batch 2 x 128",
                    _decoder("LlamaForCausalLM", "LlamaConfig", "eager",
                             **_llama_like(128, 352, 3, tie_word_embeddings=True)),
                    _tokens(VOCAB, 2, 128, True)),
        HFModelSpec("hf-mistral-sdpa", "MistralForCausalLM 2 layers d=128, GQA 4/2 heads, SDPA, batch 4 x 64",
                    _decoder("MistralForCausalLM", "MistralConfig", "sdpa", **llama_like), _tokens(VOCAB, 4, 64, True)),
        HFModelSpec("hf-qwen2-eager", "Qwen2ForCausalLM 2 layers d=128, GQA 4/2 heads, eager attention, batch 4 x 128",
                    _decoder("Qwen2ForCausalLM", "Qwen2Config", "eager", **llama_like), _tokens(VOCAB, 4, 128, True)),
        HFModelSpec("hf-bert-mlm", "BertForMaskedLM 2 layers d=128, 4 heads, eager attention, dropout 0.1, batch 4 x 128",
                    _bert(128, 2, 512), _tokens(VOCAB, 4, 128, False)),
        HFModelSpec("hf-t5", "T5ForConditionalGeneration 2+2 layers d=128, 4 heads, dropout 0.1, batch 4, 64 -> 32 tokens",
                    _t5(128, 32, 256, 2), _seq2seq(VOCAB, 4, 64, 32)),
        HFModelSpec("hf-vit", "ViTForImageClassification 2 layers d=128, 4 heads, 32x32 images, patch 4, batch 8",
                    _vit(32, 4, 128, 2, 256), _images(8, 32, 10)),
    ]


DRAWN_FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "bert", "t5", "vit")


def hf_spec(seed: int, vocab: int = VOCAB) -> HFModelSpec:
    """The configuration ``seed`` names (pure), named ``hf-<seed>``: a family of ``DRAWN_FAMILIES``,
    1-3 layers (T5: that many on each side), hidden size 32-192 in 2 or 4 heads of 16-48, batch 2-4 of
    32-128 tokens (ViT: 32x32 or 48x48 images, patches of 4 or 8); per family its own draws
    (attention implementation, GQA, tied embeddings, dropout). The model builds its own loss.
    ``vocab``: the language models' vocabulary (``VOCAB`` by default; real models' 32,000-50,257 make the
    logits and the loss the step's largest tensors), said in a language model's description when not the
    default; the draws do not depend on it."""
    if vocab < 4:
        raise ValueError(f"vocab={vocab}: a vocabulary needs at least 4 tokens (the special tokens use ids 0-2)")
    said = "" if vocab == VOCAB else f", vocabulary {vocab:,}"    # a ViT has none
    rng = random.Random(f"hf-{seed}")   # a string seed is hashed: nearby integers draw unlike nets
    family = rng.choice(DRAWN_FAMILIES)
    heads = rng.choice([2, 4])
    hidden, layers = heads * rng.choice([16, 32, 48]), rng.randint(1, 3)
    batch, seq = rng.choice([2, 4]), rng.choice([32, 64, 128])
    attn = rng.choice(["eager", "sdpa"])
    dropout = rng.choice([0.0, 0.1])
    size = f"{layers} layers d={hidden}, {heads} heads"
    if family == "gpt2":
        make = _decoder("GPT2LMHeadModel", "GPT2Config", attn, vocab_size=vocab, n_positions=128, n_embd=hidden,
                        n_layer=layers, n_head=heads, bos_token_id=0, eos_token_id=0, use_cache=False,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
        return HFModelSpec(f"hf-{seed}", f"GPT2LMHeadModel {size}, {attn} attention, dropout {dropout}, batch {batch} x {seq}{said}",
                           make, _tokens(vocab, batch, seq, True))
    if family in ("llama", "mistral", "qwen2"):
        kv_heads, tied = rng.choice([heads, heads // 2]), rng.random() < 0.5
        cls = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
        config = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=16 * round(hidden * 8 / 3 / 16),
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=128, use_cache=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                      tie_word_embeddings=tied)
        return HFModelSpec(f"hf-{seed}", f"{cls} {size} ({kv_heads} key/value), {attn} attention, "
                           f"{'tied' if tied else 'untied'} embeddings, batch {batch} x {seq}{said}",
                           _decoder(cls, cls.replace("ForCausalLM", "Config"), attn, **config), _tokens(vocab, batch, seq, True))
    if family == "bert":
        make = _decoder("BertForMaskedLM", "BertConfig", attn, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=128,
                        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        return HFModelSpec(f"hf-{seed}", f"BertForMaskedLM {size}, {attn} attention, dropout {dropout}, batch {batch} x {seq}{said}",
                           make, _tokens(vocab, batch, seq, False))
    if family == "t5":
        target = rng.choice([seq // 2, seq])
        make = _decoder("T5ForConditionalGeneration", "T5Config", "eager", vocab_size=vocab, d_model=hidden,
                        d_kv=hidden // heads, d_ff=rng.choice([2, 4]) * hidden, num_layers=layers, num_decoder_layers=layers,
                        num_heads=heads, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, use_cache=False,
                        dropout_rate=dropout)
        return HFModelSpec(f"hf-{seed}", f"T5ForConditionalGeneration {layers}+{layers} layers d={hidden}, {heads} heads, "
                           f"dropout {dropout}, batch {batch}, {seq} -> {target} tokens{said}",
                           make, _seq2seq(vocab, batch, seq, target))
    image, patch = rng.choice([32, 48]), rng.choice([4, 8])
    make = _decoder("ViTForImageClassification", "ViTConfig", attn, image_size=image, patch_size=patch, hidden_size=hidden,
                    num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * hidden, num_labels=10,
                    hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return HFModelSpec(f"hf-{seed}", f"ViTForImageClassification {size}, {attn} attention, dropout {dropout}, "
                       f"{image}x{image} images, patch {patch}, batch {batch}", make, _images(batch, image, 10))


def benchmark_specs() -> list[HFModelSpec]:
    """The models of ``benchmarks/hf_models.py``, at sizes where a plain Inductor step takes tens to
    hundreds of milliseconds on one CPU thread (the corpus's ``hf_specs()`` stay small for memory
    checks): 3 layers (T5: 2+2), hidden size 256, 4 heads, vocabulary 512, batch 4 of 256 tokens
    (T5: 128 -> 128; ViT: 128x128 images in 8x8 patches, 256 of them). Only call when ``available()`` is None."""
    batch, seq, layers = 4, 256, 3
    tokens = _tokens(VOCAB, batch, seq, True)
    sizes = f"{layers} layers d=256, 4 heads"
    llama = {"llama": ("LlamaForCausalLM", "LlamaConfig", "sdpa", "SDPA"),
             "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", "eager", "eager attention")}
    specs = [HFModelSpec("gpt2", f"GPT2LMHeadModel {sizes}, eager attention, dropout 0.1, batch {batch} x {seq}",
                         _gpt2("eager", 256, layers), tokens)]
    specs += [HFModelSpec(name, f"{cls} {sizes} (GQA: 2 key/value heads), {attn_text}, batch {batch} x {seq}",
                          _decoder(cls, config, attn, **_llama_like(256, 704, layers)), tokens)
              for name, (cls, config, attn, attn_text) in llama.items()]
    specs.append(HFModelSpec("bert", f"BertForMaskedLM {sizes}, eager attention, dropout 0.1, batch {batch} x {seq}",
                             _bert(256, layers, 1024), _tokens(VOCAB, batch, seq, False)))
    specs.append(HFModelSpec("t5", f"T5ForConditionalGeneration 2+2 layers d=256, 4 heads, dropout 0.1, batch {batch}, "
                             "128 -> 128 tokens", _t5(256, 64, 1024, 2), _seq2seq(VOCAB, batch, 128, 128)))
    specs.append(HFModelSpec("vit", f"ViTForImageClassification {sizes}, 128x128 images, patch 8, batch {batch}",
                             _vit(128, 8, 256, layers, 1024), _images(batch, 128, 10)))
    return specs


def build_hf(spec: HFModelSpec, seed: int, checkpoint_blocks: bool = False) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model in training mode and its keyword inputs (``labels`` included), both fixed by ``seed``."""
    torch.manual_seed(seed)
    model = spec.make()
    if checkpoint_blocks:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train(), spec.inputs(torch.Generator().manual_seed(seed))
