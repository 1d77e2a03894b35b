"""Synthetic tokens: a deterministic function of (seed, step), the same global batch on every mesh.

Each row is an arithmetic progression ``(a + b*t) mod vocab`` with a random start ``a`` and stride
``b``: a model can learn it (the next token follows from the previous two), so the loss falls.
"""

from __future__ import annotations

import numpy as np


class SyntheticSource:
    """``batch(step)`` -> ``{"inputs": [B, T], "targets": [B, T]}`` int32 numpy arrays (global batch)."""

    def __init__(self, seed: int, batch_size: int, seq_len: int, vocab_size: int):
        self.seed, self.batch_size, self.seq_len, self.vocab_size = seed, batch_size, seq_len, vocab_size

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, 0x5EED])
        b, v = self.batch_size, self.vocab_size
        start = rng.integers(0, v, size=(b, 1))
        stride = rng.integers(1, max(2, min(v, 17)), size=(b, 1))
        tokens = ((start + stride * np.arange(self.seq_len + 1)) % v).astype(np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
