"""Text generation from a trained model: temperature and top-k sampling, sliding context window.

The whole window is recomputed for each new token (no KV cache): simple, exact, and cheap for the
sample printed at the end of a run. One sequence per batch-parallel group is generated (the batch
must split over the ``data`` x ``expert`` devices, and into the pipeline's microbatches with
``pipe`` > 1); the first is the sample shown.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def generate(trainer, params, tokenizer, prompt: str, n_tokens: int, temperature: float = 0.8, top_k: int = 40,
             seed: int = 0) -> list[str]:
    """``n_tokens`` new tokens after ``prompt`` for each of the batch-parallel rows; returns the texts."""
    t = trainer.cfg.model.seq_len
    rows = trainer.sizes["data"] * trainer.sizes["expert"]
    if trainer.sizes["pipe"] > 1:  # the pipeline cuts the batch into microbatches, each split over the batch axes
        rows *= trainer.cfg.parallel.microbatches or trainer.sizes["pipe"]
    ids = list(np.asarray(tokenizer.encode(prompt), np.int32)) or [0]
    vocab = tokenizer.vocab_size
    sharding = trainer.rules.params.sharding(("batch", "length"))

    def last_logits(p, buf, pos):
        logits = trainer.logits(p, buf)
        return jax.lax.dynamic_index_in_dim(logits, pos, axis=1, keepdims=False)[:, :vocab].astype(jnp.float32)

    fn = jax.jit(last_logits)
    rng = np.random.default_rng(seed)
    seqs = [list(ids) for _ in range(rows)]
    for _ in range(n_tokens):
        window = [s[-t:] for s in seqs]
        n = len(window[0])
        buf = np.zeros((rows, t), np.int32)
        buf[:, :n] = np.array(window)
        arr = jax.make_array_from_callback(buf.shape, sharding, buf.__getitem__)
        logits = np.asarray(jax.device_get(fn(params, arr, n - 1)), np.float64)
        for r in range(rows):
            seqs[r].append(_pick(logits[r], temperature, top_k, rng))
    return [tokenizer.decode(np.array(s[len(ids):], np.int32)) for s in seqs]


def _pick(logits: np.ndarray, temperature: float, top_k: int, rng: np.random.Generator) -> int:
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits / temperature
    if 0 < top_k < len(z):
        z = np.where(z >= np.partition(z, -top_k)[-top_k], z, -np.inf)
    p = np.exp(z - z.max())
    return int(rng.choice(len(p), p=p / p.sum()))
