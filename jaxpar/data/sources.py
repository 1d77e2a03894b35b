"""Training sources behind ``data.source``: each yields this process's rows of every global batch.

A source is built with the ``row_slice`` of the global batch that this process feeds (derived from
the batch sharding by the trainer) and offers ``next()`` (the next training batch, a dict of
``inputs``/``targets`` int32 ``[local rows, seq_len]``), ``state()``/``restore()`` (its position),
and, for text, ``val`` (fixed validation batches) and ``tokenizer``. Rows of packed documents
(``data.packing=documents``, ``data.source=chat``) add ``segment_ids``, ``positions`` and ``weights``
(:mod:`jaxpar.data.packing`). Long by design: every ``data.source`` is here behind that one interface.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar.config import Config, ConfigError
from jaxpar.data import pipeline, store
from jaxpar.data.store import TokenStore
from jaxpar.data.synthetic import SyntheticSource


class SyntheticBatches:
    """The synthetic source, sliced to this process's rows."""

    tokenizer = None
    val: list = []

    def __init__(self, cfg: Config, row_slice: slice):
        self.source = SyntheticSource(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size,
                                      documents=cfg.data.packing == "documents")
        self.row_slice, self.step = row_slice, 0

    def next(self) -> dict[str, np.ndarray]:
        b = self.source.batch(self.step)
        self.step += 1
        return {k: v[self.row_slice] for k, v in b.items()}

    def state(self) -> dict:
        return {"step": self.step}

    def restore(self, state: dict) -> None:
        self.step = int(state["step"])


def cache_root(cache_dir: str = "") -> Path:
    """Where trained tokenizers and the token stores of ``data.source=shakespeare/files`` are cached:
    ``data.cache_dir``, else ``$JAXPAR_CACHE``, else ``$XDG_CACHE_HOME/jaxpar``, else
    ``~/.cache/jaxpar``. Never the data's own folder: jaxpar writes nothing beside the data."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get("JAXPAR_CACHE"):
        return Path(os.environ["JAXPAR_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "jaxpar"


def text_store(cfg: Config, log=print) -> Path:
    """The built-in corpus or ``data.path`` files as a token store, prepared on first use and cached.

    The text is split (``data.val_fraction``), the tokenizer made (``data.tokenizer``), and each split's
    documents (the plays, the files or records) encoded as ``prepare`` frames them (BOS, text, EOS; joined
    by a blank line for the byte tokenizer), their starts recorded for ``data.packing=documents``; the
    store lives under
    :func:`cache_root` (``stores/<source>-<key>``), keyed by the text of both splits (so by the files'
    contents, ``data.jsonl_field`` and ``data.val_fraction``), the tokenizer (its file, hence its
    vocabulary) and the store format, so a rerun (or another process on this host) opens it without
    tokenising again. Nothing is written into the data's folder, and files of the cache (or of a
    token store) found there are never read as data.
    """
    from jaxpar.data import corpus, tokenizer

    d, m = cfg.data, cfg.model
    cache = cache_root(d.cache_dir)
    where = f"data.cache_dir={d.cache_dir!r}" if d.cache_dir else f"the data cache {str(cache)!r}"
    if d.source == "shakespeare":
        docs = corpus.shakespeare_plays()
        origin = "data.source=shakespeare"
    else:
        docs = corpus.load_texts(d.path, d.jsonl_field, exclude=(cache,))
        origin = f"data.source=files, data.path={d.path!r}"
        base = Path(d.path.split("*")[0] or ".")
        old = (base if base.is_dir() else base.parent) / ".jaxpar-cache"
        if old.is_dir():
            log(f"note: {old} is the cache an earlier jaxpar wrote beside the data; it is no longer read or "
                f"written (the cache is {cache}), and can be deleted")
    train_text, val_text = corpus.split_train_val(docs, d.val_fraction)
    try:
        tok = tokenizer.get_tokenizer(d.tokenizer, m.vocab_size, [train_text], cache)
        identity = (hashlib.sha256(tok.to_str().encode()).hexdigest() if isinstance(tok, tokenizer.BPETokenizer)
                    else "byte")
        key = hashlib.sha256(f"{tokenizer.text_hash([train_text, val_text])}:{identity}:v{store.VERSION}"
                             .encode()).hexdigest()[:16]
        path = cache / "stores" / f"{d.source}-{key}"
        if path.exists() and not (path / store.INDEX).is_file():  # a cached store appears whole (renamed) or not
            raise ConfigError(f"{str(path)!r}, jaxpar's cache of {origin}, is damaged (no {store.INDEX}); delete it: "
                              f"the next run rebuilds it")
        if not path.exists():
            t0 = time.perf_counter()
            train_docs, val_docs = tokenizer.cut_documents(docs, len(train_text))  # the documents of each split
            train_ids, train_starts = tokenizer.encode_documents_with_starts(tok, train_docs)
            val_ids, val_starts = tokenizer.encode_documents_with_starts(tok, val_docs)
            text_bytes = len(train_text.encode()) + len(val_text.encode())
            store.write_stream_store(path, train_ids, val_ids, tok, {"key": key, "source": d.source,
                                                                     "text_bytes": text_bytes},
                                     train_starts, val_starts)
            log(f"data: {d.source}, {len(train_text):,} + {len(val_text):,} characters -> {len(train_ids):,} train / "
                f"{len(val_ids):,} validation tokens ({len(train_text) / max(len(train_ids), 1):.2f} chars/token), "
                f"tokenizer {d.tokenizer} with {tok.vocab_size} ids; tokenised in {time.perf_counter() - t0:.1f}s "
                f"into the token store {path}")
    except OSError as e:
        raise ConfigError(f"{where}: cannot write the tokenised {origin} there ({e.strerror}"
                          f"{': ' + str(e.filename) if e.filename else ''}); set data.cache_dir (or $JAXPAR_CACHE) to "
                          f"a writable folder") from None
    return path


def parse_mix(mix: str) -> list[tuple[str, float]]:
    """``"dirA:0.7,dirB:0.3"`` -> ``[("dirA", 0.7), ("dirB", 0.3)]`` (weights positive, any scale)."""
    out = []
    for part in mix.split(","):
        path, sep, w = part.strip().rpartition(":")
        try:
            weight = float(w)
        except ValueError:
            weight = float("nan")
        if not sep or not path or not weight > 0 or weight == float("inf"):
            raise ConfigError(f"data.mix={mix!r}: each entry is PATH:WEIGHT with a positive weight, "
                              f"e.g. data.mix='stores/web:0.7,stores/code:0.3'; got {part.strip()!r}")
        out.append((path, weight))
    if len({p for p, _ in out}) < len(out):
        raise ConfigError(f"data.mix={mix!r} names a store twice; list each store once, with its whole weight")
    return out


def mix_quotas(weights: list[float], batch: int) -> list[int]:
    """Rows of each store in every global batch: ``w_k * batch`` rounded by largest remainder (sum = batch)."""
    w = np.asarray(weights, np.float64) / np.sum(weights)
    exact = w * batch
    q = np.floor(exact).astype(int)
    for k in np.argsort(-(exact - q), kind="stable")[:batch - q.sum()]:
        q[k] += 1
    return q.tolist()


def local_placement(quotas: list[int], row_slice: slice) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each store: (positions in this process's share of the batch that it fills, the indices of
    those rows within the store's rows of the batch), by :func:`mix_slots`."""
    slots = mix_slots(quotas)
    local = np.arange(len(slots))[row_slice]
    out = []
    for k in range(len(quotas)):
        mine = np.nonzero(slots[local] == k)[0]
        rank = np.cumsum(slots == k) - 1  # slot j's index within store k's rows of the batch
        out.append((mine, rank[local[mine]]))
    return out


def mix_slots(quotas: list[int]) -> np.ndarray:
    """Which store fills each slot of the global batch: the stores interleaved evenly (each slot goes
    to the store furthest behind its share), the same in every batch."""
    b = sum(quotas)
    taken = np.zeros(len(quotas))
    slots = np.empty(b, np.int64)
    for j in range(b):
        k = int(np.argmax(np.asarray(quotas) * (j + 1) / b - taken))
        slots[j] = k
        taken[k] += 1
    return slots


class MixedBatches:
    """Global batches drawn from several stores' rows, ``quotas[k]`` rows of store ``k`` each.

    Store ``k`` is ordered by its own :class:`~jaxpar.data.pipeline.PackedBatches` (global batch
    ``quotas[k]``, seed ``[seed, k]`` mixed into its permutation, its own epochs), so the batch at step
    ``s`` is a pure function of the seed and ``s``; ``mix_slots`` places the stores' rows in the
    global batch, and this process gathers only the rows of ``row_slice``.
    """

    def __init__(self, rows: list, quotas: list[int], seed: int, row_slice: slice):
        self.parts = []  # (PackedBatches over store k's rows of this process, positions in the local batch)
        for k, (r, q, (mine, idx)) in enumerate(zip(rows, quotas, local_placement(quotas, row_slice))):
            pb = pipeline.PackedBatches(r, q, seed, idx if len(mine) else slice(0, 1), key=k)
            self.parts.append((pb, mine))
        self.n_local = len(np.arange(sum(quotas))[row_slice])
        self.seq_len = rows[0].shape[1] - 1
        self.step = 0

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        out = {n: np.empty((self.n_local, self.seq_len), np.int32) for n in ("inputs", "targets")}
        for pb, mine in self.parts:
            if len(mine):
                b = pb.batch_at(step)
                for n in out:
                    out[n][mine] = b[n]
        return out

    def advance(self) -> None:
        self.step += 1

    def next(self) -> dict[str, np.ndarray]:
        b = self.batch_at(self.step)
        self.advance()
        return b

    def state(self) -> dict:
        return {"step": self.step, "mix": [{"n_rows": pb.n_rows, "global_batch": pb.global_batch}
                                           for pb, _ in self.parts]}

    def restore(self, state: dict) -> None:
        if "mix" not in state:
            raise ConfigError("the checkpoint's data position is of a single source, and this run has data.mix")
        if state["mix"] != self.state()["mix"]:
            raise ConfigError(f"the checkpoint's data position was saved with the mixture {state['mix']} (rows and "
                              f"rows per batch of each store), and this run's is {self.state()['mix']}: data.mix, "
                              f"the stores, seq_len or batch size changed since the checkpoint")
        self.step = int(state["step"])


def _mixed_eval(vals: list, quotas: list[int], n_batches: int, row_slice: slice, paths: list[str]) -> list[dict]:
    """Validation batches of a mixture: batch ``k`` takes rows ``[k*q, (k+1)*q)`` of each store's
    validation split (in order), placed as in training."""
    placement = local_placement(quotas, row_slice)
    n_local = len(np.arange(sum(quotas))[row_slice])
    n = min(len(v) // q for v, q in zip(vals, quotas))
    if n < 1:
        v, q, p = next((v, q, p) for v, q, p in zip(vals, quotas, paths) if len(v) < q)
        raise ConfigError(f"the validation split of token store {p!r} (data.mix) holds {len(v)} rows of "
                          f"model.seq_len + 1 tokens, fewer than its {q} rows of each batch; lower train.batch_size "
                          f"or model.seq_len, or prepare the store again into a new --out with a larger --val-fraction")
    out = []
    for k in range(min(n, n_batches)):
        rows = np.empty((n_local, vals[0].shape[1]), np.int32)
        for v, q, (mine, idx) in zip(vals, quotas, placement):
            if len(mine):
                rows[mine] = v[k * q + idx]
        out.append(pipeline.split_rows(rows))
    return out


class _Batches:
    """A source whose batches are ``self.batches`` (:class:`~jaxpar.data.pipeline.PackedBatches` or a mixture)."""

    batches: Any

    def batch_at(self, step: int) -> dict[str, np.ndarray]:
        return self.batches.batch_at(step)

    @property
    def step(self) -> int:
        return self.batches.step

    def advance(self) -> None:
        self.batches.advance()

    def next(self) -> dict[str, np.ndarray]:
        return self.batches.next()

    def state(self) -> dict:
        return self.batches.state()

    def restore(self, state: dict) -> None:
        self.batches.restore(state)


class TokenBatches(_Batches):
    """Training rows from token store(s) (``data.source=tokens``, or the built-in corpus and files
    through their cached store): memory-mapped, each process gathering only its rows."""

    def __init__(self, cfg: Config, row_slice: slice, log=print, path: str | None = None):
        d, m, b = cfg.data, cfg.model, cfg.train.batch_size
        entries = parse_mix(d.mix) if d.mix else [(path or d.path, 1.0)]
        what = "data.mix" if d.mix else "data.path"
        cache_of = (None if d.source == "tokens" else "data.source=shakespeare" if d.source == "shakespeare" else
                    f"data.source=files, data.path={d.path!r}")
        stores = [TokenStore(p, what, cache_of) for p, _ in entries]
        for s in stores:
            s.check_vocab(m.vocab_size, None if d.source == "tokens" else
                          f"data.source={d.source}, data.tokenizer={d.tokenizer}")
        if len({(s.tokenizer_kind, s.n_ids, s.eos_id) for s in stores}) > 1:
            raise ConfigError(f"the stores of data.mix={d.mix!r} were made with different tokenizers; prepare them "
                              f"with the same --tokenizer")
        self.stores = stores
        self.tokenizer = stores[0].tokenizer()
        self.batches: MixedBatches | pipeline.PackedBatches
        if d.packing == "documents":  # whole documents packed into rows (jaxpar.data.packing)
            # a chat store's conversations (loss masks) are skipped when longer than a row, never cut (counted)
            train: list[Any]
            val: list[Any]
            train, val = ([s.document_rows(split, m.seq_len, m.vocab_size, "skip" if s.has_masks else "split")
                           for s in stores] for split in ("train", "val"))
            log(f"data: documents packed into rows of {m.seq_len} tokens: {fill_line(train[0], val[0])}")
        else:
            train = [s.rows("train", m.seq_len, m.vocab_size) for s in stores]
            val = [s.rows("val", m.seq_len, m.vocab_size) for s in stores]
        if d.mix:
            quotas = mix_quotas([w for _, w in entries], b)
            if min(quotas) < 1:
                raise ConfigError(f"data.mix={d.mix!r}: with train.batch_size={b} a store would get no row of a "
                                  f"batch (rows per batch {quotas}); raise its weight or the batch size")
            self.batches = MixedBatches(train, quotas, cfg.train.seed, row_slice)
            self.val = _mixed_eval(val, quotas, cfg.train.eval_batches, row_slice, [p for p, _ in entries])
            log(f"data: mixture of {len(stores)} token stores, rows per global batch of {b}: " + ", ".join(
                f"{p} {q}" for (p, _), q in zip(entries, quotas)))
        else:
            s = stores[0]
            self.batches = pipeline.PackedBatches(train[0], b, cfg.train.seed, row_slice)
            if len(val[0]) < b:
                raise ConfigError(f"the validation split of {s.label} has {len(val[0])} rows of model.seq_len="
                                  f"{m.seq_len}, fewer than one batch (train.batch_size={b}); lower train.batch_size "
                                  f"or model.seq_len, or {s.more('val')}")
            self.val = pipeline.eval_batches(val[0], b, cfg.train.eval_batches, row_slice)
            if d.source == "tokens":
                log(f"data: token store {s.root}: {s.documents('train'):,} + {s.documents('val'):,} documents, "
                    f"{s.tokens('train'):,} train / {s.tokens('val'):,} validation tokens, tokenizer "
                    f"{s.tokenizer_kind} with {s.n_ids} ids")
            if len(self.val) < cfg.train.eval_batches:
                log(f"note: the validation split holds {len(self.val)} batch(es) of train.batch_size={b}; evaluating "
                    f"on {len(self.val)}, not train.eval_batches={cfg.train.eval_batches} (raise data.val_fraction "
                    f"for more)")
        self.train_rows = train


def fill_line(train, val) -> str:
    """One line on packed rows (:class:`~jaxpar.data.packing.DocumentRows`): documents, rows, fill rate."""
    def one(rows, split):
        p = rows.plan
        skipped = p.skipped_long + p.skipped_short
        return (f"{split} {p.documents:,} documents in {p.n_rows:,} rows, {100 * p.fill_rate:.1f}% filled"
                + (f" ({skipped:,} skipped: {p.skipped_long:,} longer than a row, {p.skipped_short:,} under 2 "
                   "tokens)" if skipped else ""))

    return f"{one(train, 'train')}; {one(val, 'validation')}"


class ChatBatches(_Batches):
    """``data.source=chat``: the conversations of ``data.path`` (:mod:`jaxpar.data.chat`) rendered with the
    model's chat template, only assistant turns trained, packed whole into rows (best fit); the last
    ``data.val_fraction`` of them (at least one) is the validation split. Tokenised in memory at start;
    for data at scale, ``python -m jaxpar.data.prepare --chat`` makes a token store once
    (``data.source=tokens data.packing=documents``)."""

    def __init__(self, cfg: Config, row_slice: slice, log=print):
        from jaxpar.data import chat, packing
        from jaxpar.data.tokenizer import BPETokenizer

        d, m, b = cfg.data, cfg.model, cfg.train.batch_size
        if d.tokenizer in ("bpe", "byte"):
            raise ConfigError(f"data.source=chat needs the model's own tokenizer (data.tokenizer=PATH of its "
                              f"tokenizer.json, which model.init_from=hf:DIR sets), not data.tokenizer={d.tokenizer}")
        self.tokenizer = BPETokenizer.load(d.tokenizer)
        template = chat.ChatTemplate.from_hf_dir(chat.template_folder(cfg))
        docs, report = chat.read_conversations(d.path, max_tokens=m.seq_len + 1, tok=self.tokenizer, template=template,
                                               log=log, limit_name="model.seq_len + 1")
        if len(docs) < 2:
            raise ConfigError(f"data.path={d.path!r} holds {len(docs)} usable conversation(s); training and "
                              "validation need at least 2")
        n_val = min(len(docs) - 1, max(1, round(d.val_fraction * len(docs))))
        splits = {"train": docs[:len(docs) - n_val], "val": docs[len(docs) - n_val:]}
        rows = {}
        for split, part in splits.items():
            ids = np.concatenate([i for i, _ in part]).astype(np.int32)
            masks = np.concatenate([k for _, k in part]).astype(np.uint8)
            if ids.size and int(ids.max()) >= m.vocab_size:
                raise ConfigError(f"data.tokenizer={d.tokenizer!r} gives ids up to {int(ids.max())} but "
                                  f"model.vocab_size={m.vocab_size}")
            lens = np.asarray([len(i) for i, _ in part], np.int64)
            plan = packing.plan_rows(np.concatenate([[0], np.cumsum(lens)[:-1]]), lens, m.seq_len, "skip")
            rows[split] = packing.DocumentRows(plan, _array_reader(ids), _array_reader(masks), m.vocab_size)
        log(f"data: chat {d.path}: {report['conversations']:,} conversations, {report['trained_tokens']:,} of "
            f"{report['tokens']:,} tokens trained (assistant turns); {fill_line(rows['train'], rows['val'])}")
        self.batches = pipeline.PackedBatches(rows["train"], b, cfg.train.seed, row_slice)
        if len(rows["val"]) < b:
            log(f"note: the validation conversations fill {len(rows['val'])} row(s), fewer than one batch of "
                f"train.batch_size={b}; no validation loss (raise data.val_fraction for one)")
            self.val: list = []
        else:
            self.val = pipeline.eval_batches(rows["val"], b, cfg.train.eval_batches, row_slice)


def _array_reader(a: np.ndarray):
    """``read(start, out)`` over an in-memory stream (:class:`~jaxpar.data.packing.DocumentRows`' reader)."""
    def read(start: int, out: np.ndarray) -> None:
        out[:] = a[start:start + len(out)]

    return read


class Prefetched:
    """A source whose next ``depth`` batches are gathered ahead in a background thread.

    The batch at a step is a pure function of the step (``batch_at``), so the thread gathers by step
    and ``next()`` / ``state()`` / ``restore()`` stay exact: a prefetched batch is never skipped or
    repeated, and a restored position discards nothing that matters.
    """

    def __init__(self, source, depth: int):
        from concurrent.futures import ThreadPoolExecutor

        self.source, self.depth = source, int(depth)
        self.tokenizer, self.val = source.tokenizer, source.val
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="jaxpar-prefetch")
        self._ahead: dict = {}

    def next(self) -> dict[str, np.ndarray]:
        step = self.source.step
        fut = self._ahead.pop(step, None)
        batch = fut.result() if fut is not None else self.source.batch_at(step)
        self.source.advance()
        for s in range(step + 1, step + 1 + self.depth):
            if s not in self._ahead:
                self._ahead[s] = self._pool.submit(self.source.batch_at, s)
        return batch

    def state(self) -> dict:
        return self.source.state()

    def restore(self, state: dict) -> None:
        self._ahead.clear()
        self.source.restore(state)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_source(cfg: Config, row_slice: slice, log=print):
    if cfg.data.source == "synthetic":
        return SyntheticBatches(cfg, row_slice)
    if cfg.data.source == "chat":
        chat = ChatBatches(cfg, row_slice, log)
        return Prefetched(chat, cfg.data.prefetch) if cfg.data.prefetch else chat
    path = text_store(cfg, log) if cfg.data.source in ("shakespeare", "files") else None
    source = TokenBatches(cfg, row_slice, log, str(path) if path else None)
    return Prefetched(source, cfg.data.prefetch) if cfg.data.prefetch else source
