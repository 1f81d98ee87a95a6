"""The corpus (``remat.testing``): built deterministically from seeds, and remat's gradients on a
small sample from the test seed range equal plain Inductor's (the benchmark runs the rest:
``benchmarks/fidelity.py``)."""

from __future__ import annotations

import pytest
import torch

import remat
from conftest import assert_grads_close, grads_of
from remat.testing import BENCHMARK_SEEDS, TEST_SEEDS, corpus, hf_skip_reason
from remat.testing.random_nets import net_spec

STEP_SEED = 1234
# From TEST_SEEDS: 24 = written-out attention applied twice (the same block), in-place residual,
# dropout. Until session 41 also 6 (a conv net with BatchNorm, max and avg pooling, a residual and dropout;
# the zoo CNN's end-to-end tests cover BatchNorm): one drawn net here, the distribution in benchmarks/fidelity.py.
E2E_SEEDS = (24,)
CONV_SEED = 6


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


def test_seed_ranges_are_disjoint() -> None:
    assert not set(TEST_SEEDS) & set(BENCHMARK_SEEDS)
    assert set(E2E_SEEDS) <= set(TEST_SEEDS)


@pytest.mark.parametrize("seed", [TEST_SEEDS[0], TEST_SEEDS[1], CONV_SEED])
def test_random_net_is_fixed_by_its_seed(seed: int) -> None:
    entry = corpus.random_entry(seed)
    first, second = entry.build(), entry.build()
    params_a, params_b = dict(first.model.named_parameters()), dict(second.model.named_parameters())
    assert params_a.keys() == params_b.keys()
    assert all(_same(params_a[k], params_b[k]) for k in params_a)
    assert all(_same(a, b) for a, b in zip(first.inputs, second.inputs, strict=True))
    assert net_spec(seed) == net_spec(seed) and entry.description == corpus.random_entry(seed).description
    torch.manual_seed(STEP_SEED)
    loss_a = first.loss(first.model)
    torch.manual_seed(STEP_SEED)
    assert torch.equal(loss_a, second.loss(second.model))


def test_checkpointed_build_has_the_same_parameters() -> None:
    entry = next(e for e in map(corpus.random_entry, TEST_SEEDS) if e.has_repeated_blocks)
    plain, checkpointed = entry.build(), entry.build(checkpoint_blocks=True)
    assert all(_same(a, b) for a, b in zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True))


def test_channels_last_build_has_the_same_values_in_the_channels_last_format() -> None:
    """``build(channels_last=True)`` (``fidelity.py --channels-last``): the same parameters and inputs, every 4-D one
    laid out channels-last, and the same loss as the default layout's."""
    from remat.testing import cnns

    entry = corpus.cnn_entry(cnns.cnn_shape(DRAWN_SEEDS[0]), DRAWN_SEEDS[0])
    plain, laid_out = entry.build(), entry.build(channels_last=True)
    assert all(_same(a, b) for a, b in zip(plain.model.parameters(), laid_out.model.parameters(), strict=True))
    four_d = [p for p in laid_out.model.parameters() if p.dim() == 4] + [t for t in laid_out.inputs if t.dim() == 4]
    assert four_d and all(t.is_contiguous(memory_format=torch.channels_last) for t in four_d)
    assert not laid_out.inputs[0].is_contiguous()       # (a 1x1 kernel is contiguous in both formats)
    assert all(torch.equal(a, b) for a, b in zip(plain.inputs, laid_out.inputs, strict=True))
    torch.manual_seed(STEP_SEED)
    expected = plain.loss(plain.model)
    torch.manual_seed(STEP_SEED)
    assert torch.allclose(laid_out.loss(laid_out.model), expected, rtol=1e-5, atol=1e-6)


def test_dtype_build_is_the_same_model_in_that_dtype() -> None:
    """``build(dtype=torch.bfloat16)`` (``fidelity.py --model-dtype bf16``): every floating parameter, buffer and
    input in bfloat16, equal to the float32 build's rounded, integer inputs unchanged; its loss trains (has a
    gradient in bfloat16)."""
    from remat.testing import cnns

    for entry in (corpus.random_entry(TEST_SEEDS[0]), corpus.cnn_entry(cnns.cnn_shape(DRAWN_SEEDS[0]), DRAWN_SEEDS[0])):
        plain, low = entry.build(), entry.build(dtype=torch.bfloat16)
        tensors = [*low.model.parameters(), *low.model.buffers(), *low.inputs]
        assert all(t.dtype == torch.bfloat16 for t in tensors if t.is_floating_point())
        assert all(torch.equal(a.to(torch.bfloat16), b) for a, b in zip(plain.model.parameters(), low.model.parameters(), strict=True))
        assert all(a.dtype == b.dtype for a, b in zip(plain.inputs, low.inputs, strict=True) if not a.is_floating_point())
        torch.manual_seed(STEP_SEED)
        low.loss(low.model).backward()
        assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in low.model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="not a floating dtype"):
        corpus.random_entry(TEST_SEEDS[0]).build(dtype=torch.int64)


def test_eager_cross_entropy_build_scores_the_output_outside_the_model() -> None:
    """``build(eager_cross_entropy=True)`` (``fidelity.py --eager-cross-entropy``): the same model and inputs, the
    loss ``F.cross_entropy`` of the output's last dimension against targets fixed across builds; a model that
    returns its own loss keeps it; a Hugging Face model is not given its labels and its logits are scored
    against them (the model's own loss, unshifted)."""
    import torch.nn.functional as F

    outside = next(s for s in TEST_SEEDS if net_spec(s).kind == "lm" and not net_spec(s).loss_inside)
    inside = next(s for s in TEST_SEEDS if net_spec(s).kind == "lm" and net_spec(s).loss_inside)
    entry = corpus.random_entry(outside)
    first, second = entry.build(eager_cross_entropy=True), entry.build(eager_cross_entropy=True)
    logits = first.model(*first.inputs)
    targets = torch.randint(0, logits.shape[-1], logits.shape[:-1], generator=torch.Generator().manual_seed(corpus.LOSS_SEED))
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    assert torch.equal(first.loss_fn(logits), expected) and torch.equal(second.loss(second.model), expected)
    own = corpus.random_entry(inside)
    assert torch.equal(own.build(eager_cross_entropy=True).loss(own.build().model), own.build().loss(own.build().model))
    if hf_skip_reason() is not None:
        return
    hf = next(e for e in corpus.entries((), include_cnns=False) if e.name == "hf-bert-mlm")
    plain, eager = hf.build(), hf.build(eager_cross_entropy=True)
    assert "labels" not in eager.kwargs and "labels" in plain.kwargs
    torch.manual_seed(STEP_SEED)     # (dropout)
    out = eager.model(*eager.inputs, **eager.kwargs)
    assert out.loss is None
    torch.manual_seed(STEP_SEED)
    assert torch.allclose(eager.loss_fn(out), plain.model(**plain.kwargs).loss)


def test_grammar_covers_its_layers() -> None:
    """Over the test seeds every choice of the grammar occurs (a generator stuck on one branch fails)."""
    specs = [net_spec(s) for s in TEST_SEEDS]
    blocks = [b for s in specs if s.kind != "conv" for b in s.blocks]
    assert {s.kind for s in specs} == {"lm", "seq", "conv"}
    assert {b.mixer for b in blocks} == {"attention", "sdpa", "mlp", "gated-mlp"}
    assert {b.norm for b in blocks} == {"layernorm", "rmsnorm", "none"}
    assert {b.activation for b in blocks} == {"gelu", "silu", "relu", "relu_"}
    assert {b.residual for b in blocks} == {"add", "add_", "none"}
    assert any(b.no_grad_rescale for b in blocks) and any(b.dropout_p for b in blocks)
    assert any(len(set(s.schedule)) < len(s.schedule) for s in specs)       # a block applied twice
    assert {s.tied_head for s in specs if s.kind == "lm"} == {True, False}
    conv_blocks = [b for s in specs if s.kind == "conv" for b in s.blocks]
    assert {b.pool for b in conv_blocks} == {"max", "avg", "none"} and any(b.batchnorm for b in conv_blocks)


def test_corpus_has_every_family() -> None:
    entries = corpus.entries(BENCHMARK_SEEDS)
    families = {e.family for e in entries}
    assert {"random", "cnn"} <= families
    assert len({e.name for e in entries}) == len(entries)
    if hf_skip_reason() is None:
        names = {e.name for e in entries if e.family == "hf"}
        assert {"hf-gpt2-eager", "hf-llama-sdpa", "hf-bert-mlm", "hf-t5", "hf-vit"} <= names
        assert any(n.startswith(("hf-mistral", "hf-qwen2")) for n in names)


def test_hf_model_is_fixed_by_its_seed() -> None:
    if hf_skip_reason() is not None:
        pytest.skip(hf_skip_reason())
    entry = next(e for e in corpus.entries((), include_cnns=False) if e.name == "hf-vit")
    first, second = entry.build(), entry.build()
    assert all(_same(a, b) for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True))
    assert all(_same(first.kwargs[k], second.kwargs[k]) for k in first.kwargs)


DRAWN_SEEDS = tuple(range(40))


def test_drawn_cnns_are_fixed_by_their_seed_and_cover_their_choices() -> None:
    """``cnn_shape(seed)`` is pure, every architecture, activation and normalization occurs over 40
    seeds, and a drawn CNN (a MobileNet-style one among them) trains: same parameters twice, a loss
    with a gradient for every parameter. The fixed shapes keep their names."""
    from remat.testing import cnns

    shapes = [cnns.cnn_shape(s) for s in DRAWN_SEEDS]
    assert shapes == [cnns.cnn_shape(s) for s in DRAWN_SEEDS]
    assert {s.arch for s in shapes} == {"vgg", "resnet", "mobile"}
    assert {s.activation for s in shapes} == {"relu", "silu", "gelu"} and {s.norm for s in shapes} == {"batch", "group"}
    assert [s.name for s in cnns.SHAPES[:2]] == ["cnn-vgg-b8-s32-w16", "cnn-vgg-b16-s32-w24"]
    seed = next(s for s in DRAWN_SEEDS if cnns.cnn_shape(s).arch == "mobile")
    entry = next(e for e in corpus.entries((), include_hf=False, cnn_seeds=(seed,)) if e.name == f"cnn-{seed}")
    first, second = entry.build(), entry.build()
    assert all(_same(a, b) for a, b in zip(first.model.parameters(), second.model.parameters(), strict=True))
    first.loss(first.model).backward()
    assert all(p.grad is not None for p in first.model.parameters())


def test_drawn_hf_configs_are_fixed_by_their_seed_and_cover_every_family() -> None:
    from remat.testing import hf_models

    descriptions = [hf_models.hf_spec(s).description for s in DRAWN_SEEDS]
    assert descriptions == [hf_models.hf_spec(s).description for s in DRAWN_SEEDS]
    classes = {d.split()[0].removesuffix("ForCausalLM").removesuffix("ForConditionalGeneration") for d in descriptions}
    assert classes == {"GPT2LMHeadModel", "Llama", "Mistral", "Qwen2", "BertForMaskedLM", "T5", "ViTForImageClassification"}
    if hf_skip_reason() is not None:
        return
    names = [e.name for e in corpus.entries((), include_cnns=False, hf_seeds=(3, 4))]
    assert names[-2:] == ["hf-3", "hf-4"] and len(set(names)) == len(names)


def test_a_drawn_hf_models_vocabulary_is_a_parameter_that_changes_no_other_draw() -> None:
    """``hf_spec(seed, vocab)``: the same configuration with a larger vocabulary, said in the description; the
    default's descriptions are unchanged; a corpus built with ``hf_vocab`` builds its language models with it."""
    from remat.testing import hf_models

    for seed in DRAWN_SEEDS:
        default, large = hf_models.hf_spec(seed).description, hf_models.hf_spec(seed, 32000).description
        assert default == hf_models.hf_spec(seed, hf_models.VOCAB).description and "vocabulary" not in default
        assert large == (default if default.startswith("ViT") else f"{default}, vocabulary 32,000")
    with pytest.raises(ValueError, match="vocab=2"):
        hf_models.hf_spec(DRAWN_SEEDS[0], 2)
    if hf_skip_reason() is not None:
        return
    seed = next(s for s in DRAWN_SEEDS if hf_models.hf_spec(s).description.startswith("GPT2LMHeadModel"))
    (entry,) = [e for e in corpus.entries((), include_cnns=False, hf_seeds=(seed,), hf_vocab=1000) if e.name == f"hf-{seed}"]
    built = entry.build()
    assert built.model.config.vocab_size == 1000 and int(built.kwargs["input_ids"].max()) < 1000


def _step(built: corpus.Built, module: object) -> None:
    built.model.zero_grad(set_to_none=True)
    torch.manual_seed(STEP_SEED)
    built.loss(module).backward()


@pytest.mark.e2e
@pytest.mark.parametrize("seed", E2E_SEEDS)
def test_remat_gradients_equal_plain_inductor(seed: int) -> None:
    """At 80% of plain Inductor's measured peak (best effort if no plan meets it), the gradients equal
    plain Inductor's, same seed, Inductor's own RNG in both."""
    entry = corpus.random_entry(seed)
    torch._dynamo.reset()
    plain = entry.build()
    compiled = torch.compile(plain.model, backend="inductor")
    _step(plain, compiled)
    expected = grads_of(plain.model)
    plain.model.zero_grad(set_to_none=True)
    peak = remat.measure_peak_bytes(lambda: _step(plain, compiled)).peak_bytes

    torch._dynamo.reset()
    built = entry.build()
    backend = remat.backend(0.8 * peak / 1e9, best_effort=True)
    _step(built, torch.compile(built.model, backend=backend))   # best effort may warn: only gradients are checked here
    assert backend.compiled_graphs, "remat planned no graph"
    assert_grads_close(grads_of(built.model), expected)


def test_graph_breaks_are_drawn_apart_from_the_net_and_split_its_forward() -> None:
    """``with_graph_breaks``: the net is the one ``net_spec`` draws (breaks aside), the breaks are fixed by the seed,
    the corpus names the net ``rand-brk-<seed>``, and Dynamo splits its forward into several graphs whose step gives
    the same loss and gradients as the eager net's (each break kind, at points of the forward and inside blocks)."""
    import dataclasses

    from remat.testing import random_nets

    specs = {seed: random_nets.with_graph_breaks(net_spec(seed)) for seed in TEST_SEEDS}
    assert all(dataclasses.replace(spec, breaks=None) == net_spec(seed) for seed, spec in specs.items())
    assert all(spec == random_nets.with_graph_breaks(net_spec(seed)) for seed, spec in specs.items())
    assert {spec.breaks.kind for spec in specs.values()} == set(random_nets.BREAK_KINDS)
    assert any(spec.breaks.blocks for spec in specs.values()) and any(spec.breaks.points for spec in specs.values())
    eager_function = next(s for s, spec in specs.items() if spec.breaks.kind == "eager-function" and spec.breaks.blocks)
    graph_break = next(s for s, spec in specs.items() if spec.breaks.kind == "graph-break" and spec.breaks.points)
    for seed in (eager_function, graph_break):
        entry = corpus.random_entry(seed, graph_breaks=True)
        assert entry.name == f"rand-brk-{seed}" and entry.description.startswith(corpus.random_entry(seed).description)
        graphs: list[int] = []

        def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
            graphs.append(len(gm.graph.nodes))
            return gm.forward

        eager, compiled = entry.build(), entry.build()
        torch._dynamo.reset()
        torch.manual_seed(STEP_SEED)
        eager.loss(eager.model).backward()
        torch.manual_seed(STEP_SEED)
        compiled.loss(torch.compile(compiled.model, backend=counting)).backward()
        assert len(graphs) >= 2, (seed, graphs)
        assert_grads_close(grads_of(compiled.model), grads_of(eager.model))
