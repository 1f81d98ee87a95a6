"""Helpers for testing and benchmarking remat on models it was not tuned on (like ``torch.testing``).

``remat.testing.corpus`` holds the corpus: random nets from a grammar of common layers
(``random_nets``), CNNs with BatchNorm and pooling (``cnns``), and tiny Hugging Face models
built from configs when ``transformers`` is installed (``hf_models``).

``remat.testing.zoo`` holds the model zoo the tests, benchmarks and examples share (an MLP, a
GPT, a CNN with BatchNorm, a Llama-style stack: ``ZOO[name]()`` returns the model and its
inputs), and ``remat.testing.steps`` one training step and the gradient comparisons;
``remat.testing.distributed_setup`` is the two-rank harness the distributed test and benchmark
share. None of them is imported here: ``import remat.testing`` stays light.
"""

from .corpus import BENCHMARK_SEEDS, TEST_SEEDS, Built, CorpusEntry, entries, hf_skip_reason

__all__ = ["BENCHMARK_SEEDS", "TEST_SEEDS", "Built", "CorpusEntry", "entries", "hf_skip_reason"]
