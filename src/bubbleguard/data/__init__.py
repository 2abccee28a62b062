"""The built-in data set: a byte corpus from Python's own sources, served in resumable batches.

Used by the demo, tests and benchmarks; the engine never imports it.
"""

from __future__ import annotations

from bubbleguard.data.corpus import Target, TokenBatches, corpus_fingerprint, load_corpus

__all__ = ["Target", "TokenBatches", "corpus_fingerprint", "load_corpus"]
