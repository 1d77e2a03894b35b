"""Training sources behind ``data.source``: each yields this process's rows of every global batch.

A source is built with the ``row_slice`` of the global batch that this process feeds (derived from
the batch sharding by the trainer) and offers ``next()`` (the next training batch, a dict of
``inputs``/``targets`` int32 ``[local rows, seq_len]``), ``state()``/``restore()`` (its position),
and, for text, ``val`` (fixed validation batches) and ``tokenizer``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from jaxpar.config import Config, ConfigError
from jaxpar.data.synthetic import SyntheticSource


class SyntheticBatches:
    """The synthetic source, sliced to this process's rows."""

    tokenizer = None
    val: list = []

    def __init__(self, cfg: Config, row_slice: slice):
        self.source = SyntheticSource(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size)
        self.row_slice, self.step = row_slice, 0

    def next(self) -> dict[str, np.ndarray]:
        b = self.source.batch(self.step)
        self.step += 1
        return {k: v[self.row_slice] for k, v in b.items()}

    def state(self) -> dict:
        return {"step": self.step}

    def restore(self, state: dict) -> None:
        self.step = int(state["step"])


class TextBatches:
    """A real corpus: split, tokenised, packed, shuffled per epoch; validation batches fixed."""

    def __init__(self, cfg: Config, row_slice: slice, log=print):
        from jaxpar.data import corpus, pipeline, tokenizer

        d, m = cfg.data, cfg.model
        if d.source == "shakespeare":
            docs = corpus.shakespeare_plays()
            cache = Path(d.cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "jaxpar"))
        else:
            docs = corpus.load_texts(d.path, d.jsonl_field)
            base = Path(d.path.split("*")[0] or ".")
            cache = Path(d.cache_dir) if d.cache_dir else (base if base.is_dir() else base.parent) / ".jaxpar-cache"
        train_text, val_text = corpus.split_train_val(docs, d.val_fraction)
        self.tokenizer = tokenizer.get_tokenizer(d.tokenizer, m.vocab_size, [train_text], cache)
        train_ids = tokenizer.encode_documents(self.tokenizer, train_text)
        val_ids = tokenizer.encode_documents(self.tokenizer, val_text)
        log(f"data: {d.source}, {len(train_text):,} + {len(val_text):,} characters -> {len(train_ids):,} train / "
            f"{len(val_ids):,} validation tokens ({len(train_text) / max(len(train_ids), 1):.2f} chars/token), "
            f"tokenizer {d.tokenizer} with {self.tokenizer.vocab_size} ids")
        b = cfg.train.batch_size
        self.batches = pipeline.PackedBatches(pipeline.pack(train_ids, m.seq_len), b, cfg.train.seed, row_slice)
        val_rows = pipeline.pack(val_ids, m.seq_len)
        if len(val_rows) < b:
            raise ConfigError(f"the validation text has {len(val_rows)} rows of model.seq_len={m.seq_len}, fewer than "
                              f"one batch (train.batch_size={b}); raise data.val_fraction or use more text")
        self.val = pipeline.eval_batches(val_rows, b, cfg.train.eval_batches, row_slice)
        if len(self.val) < cfg.train.eval_batches:
            log(f"note: the validation text holds {len(self.val)} batch(es) of train.batch_size={b}; evaluating on "
                f"{len(self.val)}, not train.eval_batches={cfg.train.eval_batches} (raise data.val_fraction for more)")
        ids = self.tokenizer.vocab_size
        if m.vocab_size > 2 * ids:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is more than twice what the tokenizer yields ({ids} ids, "
                              f"data.tokenizer={d.tokenizer}): the extra rows of the embedding and head are never used; "
                              f"set model.vocab_size={ids}")

    def next(self) -> dict[str, np.ndarray]:
        return self.batches.next()

    def state(self) -> dict:
        return self.batches.state()

    def restore(self, state: dict) -> None:
        self.batches.restore(state)


def make_source(cfg: Config, row_slice: slice, log=print):
    if cfg.data.source == "synthetic":
        return SyntheticBatches(cfg, row_slice)
    return TextBatches(cfg, row_slice, log)
