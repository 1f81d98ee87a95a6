"""Helpers for testing and benchmarking remat on models it was not tuned on (like ``torch.testing``).

``remat.testing.corpus`` holds the corpus: random nets from a grammar of common layers
(``random_nets``), CNNs with BatchNorm and pooling (``cnns``), and tiny Hugging Face models
built from configs when ``transformers`` is installed (``hf_models``).
"""

from .corpus import BENCHMARK_SEEDS, TEST_SEEDS, Built, CorpusEntry, entries, hf_skip_reason

__all__ = ["BENCHMARK_SEEDS", "TEST_SEEDS", "Built", "CorpusEntry", "entries", "hf_skip_reason"]
