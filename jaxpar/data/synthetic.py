"""Synthetic tokens: a deterministic function of (seed, step), the same global batch on every mesh.

Each row is an arithmetic progression ``(a + b*t) mod vocab`` with a random start ``a`` and stride
``b``: a model can learn it (the next token follows from the previous two), so the loss falls.

With ``documents=True`` (``data.packing=documents``) each row is cut into documents of random lengths,
each its own progression, with the packed-document fields of :mod:`jaxpar.data.packing`: segment ids
(1, 2, ... per row), positions restarting per document, and loss weights (all 1: rows are full).
"""

from __future__ import annotations

import numpy as np


class SyntheticSource:
    """``batch(step)`` -> ``{"inputs": [B, T], "targets": [B, T]}`` int32 numpy arrays (global batch)."""

    def __init__(self, seed: int, batch_size: int, seq_len: int, vocab_size: int, documents: bool = False):
        self.seed, self.batch_size, self.seq_len, self.vocab_size = seed, batch_size, seq_len, vocab_size
        self.documents = documents

    def batch(self, step: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, step, 0x5EED])
        b, v = self.batch_size, self.vocab_size
        start = rng.integers(0, v, size=(b, 1))
        stride = rng.integers(1, max(2, min(v, 17)), size=(b, 1))
        tokens = ((start + stride * np.arange(self.seq_len + 1)) % v).astype(np.int32)
        if self.documents:
            return self._documents(rng)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def _documents(self, rng) -> dict[str, np.ndarray]:
        b, t, v = self.batch_size, self.seq_len, self.vocab_size
        out = {k: np.zeros((b, t), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
        for r in range(b):
            at, seg = 0, 1
            while at < t:
                n = min(int(rng.integers(1, max(2, t // 2) + 1)), t - at)  # pairs of this document
                a, stride = rng.integers(0, v), rng.integers(1, max(2, min(v, 17)))
                doc = ((a + stride * np.arange(n + 1)) % v).astype(np.int32)
                out["inputs"][r, at:at + n], out["targets"][r, at:at + n] = doc[:-1], doc[1:]
                out["segment_ids"][r, at:at + n], out["positions"][r, at:at + n] = seg, np.arange(n)
                at, seg = at + n, seg + 1
        return {**out, "weights": np.ones((b, t), np.float32)}
