"""Rows of a token store's split: its stream cut into rows, or its documents packed whole into rows.

``data.packing=stream``: :class:`StoreRows` cuts the stream into rows as :func:`jaxpar.data.pipeline.pack`
does (documents straddle rows, attention crosses documents). ``data.packing=documents``: each row of
``seq_len`` (input, target) pairs holds several whole documents, each a *segment* of its own: per
token a segment id, a position restarting at 0 in each document, and a loss weight.

**Pieces.** A document of ``n`` tokens (as the store holds it: BOS, text, EOS) gives ``n - 1`` pairs
(inputs ``ids[:-1]``, targets ``ids[1:]``) and occupies ``n - 1`` slots of a row. A document of more
than ``seq_len + 1`` tokens is either split into pieces of at most ``seq_len + 1`` tokens that overlap
by one token, so that every pair is trained exactly once (``long="split"``: pretraining text; each
piece is its own segment, positions restarting at 0), or dropped and counted (``long="skip"``: chat
data, where a cut conversation would lose its context). Documents of fewer than 2 tokens (no pair)
are dropped and counted.

**Rows.** The pieces' pair counts are packed by best-fit decreasing (:func:`best_fit`): the longest
piece first, each into the open row with the least room that still holds it, else a new row. Rows
are numbered in the order they were opened; within a row the pieces keep their order in the stream.
The plan (:class:`PackPlan`) is a pure function of the document lengths and ``seq_len``: every
process computes the same rows, so :class:`~jaxpar.data.pipeline.PackedBatches` orders and shards
them unchanged.

**Batches.** :class:`DocumentRows` gathers planned rows on demand from a token reader (and an
optional loss-mask reader, one uint8 per token: 1 where the token is trained as a target) as a dict
of ``[rows, seq_len]`` arrays: ``inputs``, ``targets``, ``segment_ids`` (1, 2, ... in row order;
padding 0), ``positions`` and ``weights`` (1.0 on trained targets, 0.0 on padding and untrained
targets). :class:`ConcatReader` reads a stream stored as consecutive raw files (a token store's
shards) by memory map.

**Pre-tokenized documents.** :func:`jaxpar.data.chat.prepare_tokenized` writes a token store of
documents that come as ids with a loss mask (chat data: the template's tokens with 1 on the
assistant's turns), whose rows are then packed here with their masks as weights.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass
from typing import Callable

import numpy as np

from jaxpar.config import ConfigError

LONG_POLICIES = ("split", "skip")


def best_fit(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, int]:
    """Best-fit-decreasing bin packing: ``(bin_of_item int64 [n], n_bins)``.

    Items (lengths 1..capacity) are placed longest first (ties: lower item index first), each into
    the open bin of least remaining room that holds it (ties: the lowest-numbered bin), else into a
    new bin; bins are numbered in the order they are opened. O(n log n): open bins are kept in a heap
    per remaining room, and a two-level bitmap over the rooms finds the smallest room >= the need.
    """
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity {capacity} must be >= 1")
    n = len(lengths)
    if n and (int(lengths.min()) < 1 or int(lengths.max()) > capacity):
        raise ValueError(f"item lengths must be in [1, {capacity}], got [{lengths.min()}, {lengths.max()}]")
    order = np.argsort(-lengths, kind="stable")
    bins = np.empty(n, np.int64)
    n_full = int(np.count_nonzero(lengths == capacity))  # first in the order; each fills a bin of its own
    bins[order[:n_full]] = np.arange(n_full)
    n_bins = n_full
    rooms: dict[int, list[int]] = {}  # remaining room -> heap of the open bins with that room
    words, top = [0] * ((capacity >> 6) + 1), 0  # bit r of words[r >> 6]: some bin has room r; bit w of top: words[w]
    for i, need in zip(order[n_full:].tolist(), lengths[order[n_full:]].tolist()):
        w = need >> 6
        m = words[w] >> (need & 63)
        if m:
            r = need + (m & -m).bit_length() - 1
        else:
            t = top >> (w + 1)
            if t:
                w += (t & -t).bit_length()
                r = (w << 6) + (words[w] & -words[w]).bit_length() - 1
            else:
                r = 0
        if r:  # the fullest open bin that holds the item
            heap = rooms[r]
            b = heapq.heappop(heap)
            if not heap:
                words[r >> 6] &= ~(1 << (r & 63))
                if not words[r >> 6]:
                    top &= ~(1 << (r >> 6))
            left = r - need
        else:
            b, n_bins, left = n_bins, n_bins + 1, capacity - need
        bins[i] = b
        if left:
            heap = rooms.setdefault(left, [])
            if not heap:
                words[left >> 6] |= 1 << (left & 63)
                top |= 1 << (left >> 6)
            heapq.heappush(heap, b)
    return bins, n_bins


@dataclass
class PackPlan:
    """Rows of ``seq_len`` (input, target) pairs: row ``r`` holds pieces ``row_ptr[r]:row_ptr[r + 1]``;
    piece ``p`` is tokens ``[piece_start[p], piece_start[p] + piece_len[p])`` of the split's stream
    (``piece_len >= 2``: ``piece_len - 1`` pairs), from document ``piece_doc[p]`` (its index in the
    lists given to :func:`plan_rows`). ``documents``: documents packed; ``skipped_long`` / ``skipped_short``:
    documents dropped (too long under ``long="skip"``; fewer than 2 tokens)."""

    seq_len: int
    row_ptr: np.ndarray
    piece_start: np.ndarray
    piece_len: np.ndarray
    piece_doc: np.ndarray
    documents: int
    skipped_long: int
    skipped_short: int

    @property
    def n_rows(self) -> int:
        return len(self.row_ptr) - 1

    @property
    def pieces(self) -> int:
        return len(self.piece_len)

    @property
    def pairs(self) -> int:
        """(input, target) pairs in all rows (the rest is padding)."""
        return int(np.sum(self.piece_len - 1))

    @property
    def fill_rate(self) -> float:
        """Share of the rows' slots that hold a pair (not padding)."""
        return self.pairs / (self.n_rows * self.seq_len) if self.n_rows else 0.0


def plan_rows(doc_starts: np.ndarray, doc_lens: np.ndarray, seq_len: int, long: str = "split") -> PackPlan:
    """The rows (see the module docstring) of documents ``[doc_starts[i], doc_starts[i] + doc_lens[i])``."""
    if long not in LONG_POLICIES:
        raise ConfigError(f"long documents are either split or skipped ({', '.join(LONG_POLICIES)}), got {long!r}")
    if seq_len < 1:
        raise ConfigError(f"model.seq_len={seq_len} must be >= 1")
    starts = np.asarray(doc_starts, np.int64).reshape(-1)
    lens = np.asarray(doc_lens, np.int64).reshape(-1)
    if starts.shape != lens.shape:
        raise ValueError(f"{len(starts)} document starts but {len(lens)} lengths")
    short, too_long = lens < 2, lens > seq_len + 1
    keep = ~short & ~too_long if long == "skip" else ~short
    docs = np.nonzero(keep)[0]
    n_pieces = (lens[docs] - 2) // seq_len + 1  # ceil(pairs / seq_len)
    doc = np.repeat(docs, n_pieces)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)  # piece index in its document
    piece_start = starts[doc] + k * seq_len
    pairs = np.minimum(seq_len, lens[doc] - 1 - k * seq_len)
    bins, n_bins = best_fit(pairs, seq_len)
    order = np.lexsort((np.arange(len(doc)), bins))  # by row, then stream order within a row
    row_ptr = np.concatenate([[0], np.cumsum(np.bincount(bins, minlength=n_bins))]).astype(np.int64)
    return PackPlan(int(seq_len), row_ptr, piece_start[order], pairs[order] + 1, doc[order], len(docs),
                    int(np.count_nonzero(too_long & ~short)) if long == "skip" else 0, int(np.count_nonzero(short)))


def document_spans(starts: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """``(doc_starts, doc_lens)`` of a stream of ``total`` tokens whose documents begin at ``starts``
    (each document ends where the next begins, the last at the end; offset 0 always begins one).
    ValueError if ``starts`` is not non-decreasing within ``[0, total]``."""
    starts = np.asarray(starts, np.int64).reshape(-1)
    if len(starts) and (starts[0] < 0 or starts[-1] > total or np.any(np.diff(starts) < 0)):
        raise ValueError("document starts are not in order within the stream")
    if not len(starts) or starts[0] != 0:
        starts = np.concatenate([[0], starts])
    return starts, np.diff(np.append(starts, total))


class ConcatReader:
    """A stream stored as consecutive raw arrays of ``dtype`` in ``paths`` (``sizes`` elements each,
    none empty), each memory-mapped on first use."""

    def __init__(self, paths: list[os.PathLike], sizes: list[int], dtype):
        self.paths, self.dtype = list(paths), np.dtype(dtype)
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(sizes, np.int64))]).astype(np.int64)
        self._maps: dict[int, np.memmap] = {}

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    def file_of(self, pos: int) -> int:
        """Index of the file that holds element ``pos``."""
        return int(np.searchsorted(self.starts, pos, side="right")) - 1

    def _map(self, k: int) -> np.ndarray:
        m = self._maps.get(k)
        if m is None:
            m = self._maps[k] = np.memmap(self.paths[k], dtype=self.dtype, mode="r")
        return m

    def read(self, start: int, out: np.ndarray) -> None:
        """Elements ``[start, start + len(out))`` of the stream into ``out`` (converted to its dtype)."""
        k, pos, n = self.file_of(start), start, len(out)
        while n:
            off = pos - int(self.starts[k])
            take = min(n, int(self.starts[k + 1]) - pos)
            out[len(out) - n:len(out) - n + take] = self._map(k)[off:off + take]
            pos, n, k = pos + take, n - take, k + 1


class DocumentRows:
    """The rows of a :class:`PackPlan`, gathered on demand: ``rows[ids]`` is a dict of ``[len(ids),
    seq_len]`` arrays (see the module docstring; an int index gives ``[seq_len]`` arrays, a slice or
    an int array a batch). ``read(start, out)`` fills ``out`` with the stream's tokens ``[start, start +
    len(out))``; ``read_mask(start, out)`` likewise with the loss mask (uint8; ``None``: every target
    trained). A token id ``>= vocab_size`` calls ``corrupt(stream offset, id)`` for the exception to
    raise. ``tokens_read`` counts the tokens gathered so far.

    Padding: inputs, targets, segment ids and weights 0; positions count on from 0 (``0, 1, ...``).
    """

    ndim = 2

    def __init__(self, plan: PackPlan, read: Callable[[int, np.ndarray], None],
                 read_mask: Callable[[int, np.ndarray], None] | None = None, vocab_size: int | None = None,
                 corrupt: Callable[[int, int], Exception] | None = None):
        self.plan, self.read, self.read_mask = plan, read, read_mask
        self.vocab_size, self.corrupt = vocab_size, corrupt
        self.seq_len = plan.seq_len
        self.shape = (plan.n_rows, plan.seq_len)
        self.tokens_read = 0

    def __len__(self) -> int:
        return self.plan.n_rows

    @property
    def fill_rate(self) -> float:
        return self.plan.fill_rate

    def __getitem__(self, ids) -> dict[str, np.ndarray]:
        n_rows, L = self.plan.n_rows, self.seq_len
        ids = np.arange(n_rows)[ids] if isinstance(ids, slice) else np.asarray(ids)
        scalar = ids.ndim == 0
        ids = ids.reshape(-1).astype(np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= n_rows):
            raise IndexError(f"row index out of range [0, {n_rows})")
        out = {"inputs": np.zeros((len(ids), L), np.int32), "targets": np.zeros((len(ids), L), np.int32),
               "segment_ids": np.zeros((len(ids), L), np.int32),
               "positions": np.tile(np.arange(L, dtype=np.int32), (len(ids), 1)),
               "weights": np.zeros((len(ids), L), np.float32)}
        ptr, starts, lens = self.plan.row_ptr, self.plan.piece_start, self.plan.piece_len
        for i, r in enumerate(ids.tolist()):
            col = 0
            for seg, p in enumerate(range(int(ptr[r]), int(ptr[r + 1])), 1):
                start, n = int(starts[p]), int(lens[p])
                buf = np.empty(n, np.int32)
                self.read(start, buf)
                self.tokens_read += n
                if self.vocab_size is not None and int(buf.max()) >= self.vocab_size:
                    bad = int(np.argmax(buf >= self.vocab_size))
                    err = self.corrupt(start + bad, int(buf[bad])) if self.corrupt else None
                    raise err or ValueError(f"token id {int(buf[bad])} >= vocab_size={self.vocab_size}")
                span = slice(col, col + n - 1)
                out["inputs"][i, span], out["targets"][i, span] = buf[:-1], buf[1:]
                out["segment_ids"][i, span] = seg
                out["positions"][i, span] = np.arange(n - 1)
                if self.read_mask is None:
                    out["weights"][i, span] = 1.0
                else:
                    mask = np.empty(n, np.uint8)
                    self.read_mask(start, mask)
                    out["weights"][i, span] = mask[1:] != 0
                col += n - 1
            out["positions"][i, col:] = np.arange(L - col)
        return {k: v[0] for k, v in out.items()} if scalar else out


class StoreRows:
    """The rows ``[N, seq_len + 1]`` of one split of a :class:`~jaxpar.data.store.TokenStore`, gathered on
    demand from the shards' memory maps.

    Behaves like the int32 array :func:`~jaxpar.data.pipeline.pack` would return for the split's
    token stream (``len``, ``shape``, ``ndim``, indexing by an int array or slice), but reads only
    the rows asked for. ``tokens_read`` counts the tokens gathered so far.
    """

    ndim = 2

    def __init__(self, store, split: str, seq_len: int, vocab_size: int):
        self.store, self.split, self.seq_len, self.vocab_size = store, split, int(seq_len), int(vocab_size)
        self.reader = store.reader(split)
        total = self.reader.total
        if total < seq_len + 1:
            raise ConfigError(f"the {split} split of {store.label} has {total} tokens, fewer than one row of "
                              f"model.seq_len + 1 = {seq_len + 1}; lower model.seq_len, or {store.more(split)}")
        self.n = (total - 1) // self.seq_len
        self.shape = (self.n, self.seq_len + 1)
        self.tokens_read = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.arange(self.n)[ids] if isinstance(ids, slice) else np.asarray(ids)
        scalar = ids.ndim == 0
        ids = ids.reshape(-1).astype(np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n):
            raise IndexError(f"row index out of range [0, {self.n})")
        out = np.empty((len(ids), self.seq_len + 1), np.int32)
        for i, r in enumerate(ids):
            self.reader.read(int(r) * self.seq_len, out[i])
        self.tokens_read += out.size
        if out.size and int(out.max()) >= self.vocab_size:  # bit rot in a shard; the index said otherwise
            i = int(np.nonzero(out.max(axis=1) >= self.vocab_size)[0][0])
            pos = int(ids[i]) * self.seq_len + int(np.argmax(out[i] >= self.vocab_size))
            raise self.store.corrupt(self.reader, pos, int(out[i].max()), self.vocab_size)
        return out[0] if scalar else out
