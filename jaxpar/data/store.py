"""The token store: a corpus tokenised once, read by memory map, each process touching only its rows.

**Layout** (a folder, written by :mod:`jaxpar.data.prepare`, or :func:`write_stream_store` for
training's cache)::

    store.json          the index (written last: a folder without it is not a store)
    tokenizer.json      the BPE that produced the ids (absent for the byte tokenizer)
    train-00000.bin     raw little-endian token ids (uint16 when the vocabulary fits, else uint32)
    ...
    val-00000.bin       the validation split, likewise

``store.json`` holds the format version, the dtype, the tokenizer (kind, ids, end-of-text id), and
per split the shards in order with their token count, largest id and SHA-256, plus document and
token totals. A split's token stream is its shards concatenated; every document is followed by the
end-of-text id (by a blank line for the byte tokenizer), exactly as
:func:`jaxpar.data.tokenizer.encode_documents` joins them.

**Why memory-mapped arrays, not ArrayRecord/grain.** A training row of ``seq_len + 1`` tokens
starts anywhere in the stream and straddles documents; with a raw array it is one slice of a
memory map (the kernel reads only the pages it covers, ~2 pages per row), with no decoding. A
record format stores documents, so a row would decode every record it overlaps. Measured here
(``benchmarks/data.py``): gathering a random 32 x 257 batch from a 200 M-token store takes tens of
microseconds; see the README for the numbers.

**Rows.** :class:`StoreRows` is a split cut into rows exactly as :func:`jaxpar.data.pipeline.pack`
cuts an in-memory stream (row ``i`` = tokens ``[i*L, i*L + L + 1)``), so
:class:`~jaxpar.data.pipeline.PackedBatches` orders and shards it unchanged and a process reads
only the rows of its share of each global batch.

Every problem with a store (missing, incomplete, a shard of the wrong size, an id beyond the
vocabulary) raises :class:`~jaxpar.config.ConfigError` naming the file and what repairs it: a store
that ``prepare`` made is prepared again into a new ``--out`` (``prepare`` never overwrites a store),
and a store that training cached for ``data.source=shakespeare/files`` is deleted (the next run
rebuilds it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data.tokenizer import ByteTokenizer

FORMAT = "jaxpar-token-store"
VERSION = 1
INDEX = "store.json"
PROGRESS = "progress.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")


def dtype_for(n_ids: int) -> np.dtype:
    """uint16 when every id fits (vocabularies up to 65,536), else uint32."""
    return np.dtype("<u2") if n_ids <= 1 << 16 else np.dtype("<u4")


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}.bin"


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class ShardWriter:
    """Appends token arrays to ``<split>-NNNNN.bin`` files, closing a shard once it holds
    ``shard_tokens`` tokens (only between documents, so shards end on document boundaries)."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int, shards: list | None = None):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, np.dtype(dtype), int(shard_tokens)
        self.shards = list(shards or [])  # finished shards: {"file", "tokens", "max_id", "sha256"}
        self._f: BinaryIO | None = None
        self._hash: Any = None
        self._tokens, self._max = 0, -1

    @property
    def open_tokens(self) -> int:
        return self._tokens

    def write(self, ids: np.ndarray) -> None:
        if self._f is None:
            name = shard_name(self.split, len(self.shards))
            self._f = open(self.root / (name + ".tmp"), "wb")
            self._hash, self._tokens, self._max = hashlib.sha256(), 0, -1
        f = self._f
        if len(ids):
            b = np.asarray(ids).astype(self.dtype, copy=False).tobytes()
            f.write(b)
            self._hash.update(b)
            self._tokens += len(ids)
            self._max = max(self._max, int(np.max(ids)))

    def full(self) -> bool:
        return self._f is not None and self._tokens >= self.shard_tokens

    def close_shard(self) -> bool:
        """Finish the open shard (fsync, rename into place); False if none was open or it was empty."""
        if self._f is None:
            return False
        f, self._f = self._f, None
        f.flush()
        os.fsync(f.fileno())
        f.close()
        name = shard_name(self.split, len(self.shards))
        if self._tokens == 0:
            os.remove(self.root / (name + ".tmp"))
            return False
        os.replace(self.root / (name + ".tmp"), self.root / name)
        self.shards.append({"file": name, "tokens": self._tokens, "max_id": self._max,
                            "sha256": self._hash.hexdigest()})
        return True


def write_index(root: Path, dtype: np.dtype, tokenizer: dict, splits: dict, meta: dict) -> dict:
    """Write ``store.json`` (atomically): the store is complete from this moment on."""
    index = {"format": FORMAT, "version": VERSION, "dtype": np.dtype(dtype).name, "tokenizer": tokenizer,
             "splits": splits, **meta}
    tmp = root / f".{INDEX}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, root / INDEX)
    return index


def tokenizer_info(tok) -> dict:
    """The index's ``tokenizer`` entry for a tokenizer of :mod:`jaxpar.data.tokenizer`."""
    return {"kind": "byte" if isinstance(tok, ByteTokenizer) else "bpe", "vocab_size": int(tok.vocab_size),
            "eos_id": tok.eos_id}


def write_stream_store(out: Path, train_ids: np.ndarray, val_ids: np.ndarray, tok, meta: dict) -> Path:
    """A store of two in-memory token streams (one shard per split), written to a temporary folder and
    renamed into place, so concurrent writers (processes on one host) are safe: the first one wins."""
    if (out / INDEX).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    dtype = dtype_for(tok.vocab_size)
    splits = {}
    for name, ids in (("train", train_ids), ("val", val_ids)):
        w = ShardWriter(tmp, name, dtype, len(ids) + 1)
        w.write(ids)
        w.close_shard()
        splits[name] = {"shards": w.shards, "documents": 1, "tokens": int(len(ids))}
    if not isinstance(tok, ByteTokenizer):
        shutil.copyfile(tok.path, tmp / TOKENIZER_FILE)
    write_index(tmp, dtype, tokenizer_info(tok), splits, meta)
    try:
        os.replace(tmp, out)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


PREPARED_REMEDY = "prepare it again into a new --out folder (prepare never overwrites a store)"


def is_store(path: str | os.PathLike) -> bool:
    """Whether the folder ``path`` holds a jaxpar token store, finished (``store.json``) or being
    prepared (``progress.json``): folders that reading text files skips (see
    :func:`jaxpar.data.corpus.expand_paths`)."""
    root = Path(path)
    for name, keys in ((INDEX, ("format",)), (PROGRESS, ("key", "cursor", "splits"))):
        f = root / name
        if f.is_file():
            try:
                d = json.loads(f.read_bytes())
            except (OSError, ValueError):
                continue
            if isinstance(d, dict) and all(k in d for k in keys) and (name != INDEX or d["format"] == FORMAT):
                return True
    return False


def _not_a_store(root: Path, what: str) -> str:
    """Why ``root`` (no store.json, not being prepared) is not a token store, and what to do."""
    p = str(root)
    make = "`python -m jaxpar.data.prepare INPUT... --out"
    text = "; data.source=files trains on text files directly" if what in ("data.path", "data.mix") else ""
    if not root.exists():
        return f"{what}={p!r} does not exist; make a token store there with {make} {p}`{text}"
    if not root.is_dir():
        return f"{what}={p!r} is a file, not a token store (the folder that {make} FOLDER` writes){text}"
    if not any(root.iterdir()):
        return f"{what}={p!r} is not a token store (no {INDEX}); make one with {make} {p}` (it is empty)"
    return (f"{what}={p!r} is not a token store (no {INDEX}); make one with {make} NEW_FOLDER` and set "
            f"{what} to NEW_FOLDER{text}")


def read_index(path: str | os.PathLike, what: str = "data.path", remedy: str = PREPARED_REMEDY) -> dict:
    """The index of the store ``path`` (checked: a jaxpar store of this version); ``what`` names the
    setting that gave the path and ``remedy`` what repairs a damaged store, in messages."""
    root = Path(path)
    f = root / INDEX
    if not root.is_dir() or not f.is_file():
        if root.is_dir() and (root / PROGRESS).is_file():
            raise ConfigError(f"{what}={str(path)!r} is an unfinished token store (its preparation was "
                              f"interrupted); run the same `python -m jaxpar.data.prepare` command again to finish it")
        raise ConfigError(_not_a_store(root, what))
    try:
        index = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"token store index {str(f)!r} is corrupt ({e}); {remedy}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(f"{str(f)!r} is not a jaxpar token store index (its \"format\" is not {FORMAT!r}); "
                          f"{what} names a folder that `python -m jaxpar.data.prepare` wrote")
    if index.get("version") != VERSION:
        raise ConfigError(f"token store {str(path)!r} has format version {index.get('version')}; this jaxpar "
                          f"reads version {VERSION}: {remedy}")
    return index


class TokenStore:
    """An opened store: the index checked against the shard files (sizes), nothing read yet.

    ``what`` is the setting that names it (``data.path``, ``data.mix``, ``--out``); ``cache_of`` says
    what a store cached by training holds (e.g. ``data.source=files, data.path='corpus'``), for the
    messages' advice.
    """

    def __init__(self, path: str | os.PathLike, what: str = "data.path", cache_of: str | None = None):
        self.root, self.cache_of = Path(path), cache_of
        remedy = self.remedy = (f"delete {str(self.root)!r}, jaxpar's cache of {cache_of}: the next run rebuilds it"
                                if cache_of else PREPARED_REMEDY)
        self.index = read_index(path, what, remedy)
        where = f"token store {str(self.root)!r}"
        self.label = f"{cache_of} (cached as {where})" if cache_of else where
        try:
            self.dtype = np.dtype(self.index["dtype"])
            tok = self.index["tokenizer"]
            self.n_ids, self.eos_id, self.tokenizer_kind = int(tok["vocab_size"]), tok.get("eos_id"), tok["kind"]
            shards = [(s["file"], int(s["tokens"]), int(s["max_id"])) for split in SPLITS
                      for s in self.index["splits"][split]["shards"]]
            self._counts = {sp: {k: int(self.index["splits"][sp][k]) for k in ("tokens", "documents")} for sp in SPLITS}
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: its {INDEX} is corrupt (no valid {e}); {remedy}") from None
        if self.tokenizer_kind != "byte" and not (self.root / TOKENIZER_FILE).is_file():
            raise ConfigError(f"{where}: its {TOKENIZER_FILE} is missing; {remedy}")
        for name, tokens, _ in shards:
            f = self.root / name
            want = tokens * self.dtype.itemsize
            try:
                size = f.stat().st_size
            except OSError:
                raise ConfigError(f"{where}: shard {name} is missing; {remedy}") from None
            if size != want or not f.is_file():
                raise ConfigError(f"{where}: shard {name} is corrupt ({size:,} bytes, the index says {want:,}); "
                                  f"{remedy}")
            if not os.access(f, os.R_OK):
                raise ConfigError(f"{where}: shard {name} cannot be read (permission denied); give this user read "
                                  f"access to it")

    @property
    def max_id(self) -> int:
        return max((int(s["max_id"]) for sp in SPLITS for s in self.index["splits"][sp]["shards"]), default=-1)

    def tokens(self, split: str) -> int:
        return self._counts[split]["tokens"]

    def documents(self, split: str) -> int:
        return self._counts[split]["documents"]

    def tokenizer(self):
        """The tokenizer that produced the ids (for decoding samples)."""
        from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer

        if self.tokenizer_kind == "byte":
            return ByteTokenizer()
        return BPETokenizer.load(self.root / TOKENIZER_FILE)

    def check_vocab(self, vocab_size: int, origin: str | None = None) -> None:
        """The model's vocabulary must hold every id of the store, and not be more than twice its ids.
        ``origin`` names where the tokens come from in messages (default: ``data.path=<store>``)."""
        origin = origin or f"data.path={str(self.root)!r}"
        if self.max_id >= vocab_size or self.n_ids > vocab_size:
            raise ConfigError(f"the token store of {origin} holds ids up to {max(self.max_id, self.n_ids - 1)} "
                              f"(tokenizer of {self.n_ids} ids) but model.vocab_size={vocab_size}; set "
                              f"model.vocab_size >= {self.n_ids}")
        if vocab_size > 2 * self.n_ids:
            raise ConfigError(f"model.vocab_size={vocab_size} is more than twice what the tokenizer yields "
                              f"({self.n_ids} ids, {origin}): the extra rows of the embedding and head are never "
                              f"used; set model.vocab_size={self.n_ids}")

    def more(self, split: str) -> str:
        """What gives ``split`` more tokens (in messages)."""
        if self.cache_of:
            return "use more text" + (" or a larger data.val_fraction" if split == "val" else "")
        if split == "val":
            return "prepare the store again into a new --out with a larger --val-fraction (or more text)"
        return "prepare a larger corpus into a new --out"

    def rows(self, split: str, seq_len: int, vocab_size: int) -> "StoreRows":
        return StoreRows(self, split, seq_len, vocab_size)

    def verify(self) -> list[str]:
        """Shards whose SHA-256 differs from the index (reads every byte)."""
        return [s["file"] for sp in SPLITS for s in self.index["splits"][sp]["shards"]
                if file_sha256(self.root / s["file"]) != s["sha256"]]


class StoreRows:
    """The rows ``[N, seq_len + 1]`` of one split, gathered on demand from the shards' memory maps.

    Behaves like the int32 array :func:`~jaxpar.data.pipeline.pack` would return for the split's
    token stream (``len``, ``shape``, ``ndim``, indexing by an int array or slice), but reads only
    the rows asked for. ``tokens_read`` counts the tokens gathered so far.
    """

    ndim = 2

    def __init__(self, store: TokenStore, split: str, seq_len: int, vocab_size: int):
        self.store, self.split, self.seq_len, self.vocab_size = store, split, int(seq_len), int(vocab_size)
        shards = store.index["splits"][split]["shards"]
        self.files = [s["file"] for s in shards]
        sizes = np.array([int(s["tokens"]) for s in shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])
        total = int(self.starts[-1])
        if total < seq_len + 1:
            raise ConfigError(f"the {split} split of {store.label} has {total} tokens, fewer than one row of "
                              f"model.seq_len + 1 = {seq_len + 1}; lower model.seq_len, or {store.more(split)}")
        self.n = (total - 1) // self.seq_len
        self.shape = (self.n, self.seq_len + 1)
        self._maps: dict[int, np.memmap] = {}
        self.tokens_read = 0

    def __len__(self) -> int:
        return self.n

    def _map(self, k: int) -> np.ndarray:
        m = self._maps.get(k)
        if m is None:
            m = self._maps[k] = np.memmap(self.store.root / self.files[k], dtype=self.store.dtype, mode="r")
        return m

    def _read(self, start: int, out: np.ndarray) -> None:
        """Tokens ``[start, start + len(out))`` of the split's stream into ``out``."""
        k, pos, n = int(np.searchsorted(self.starts, start, side="right")) - 1, start, len(out)
        while n:
            off = pos - int(self.starts[k])
            take = min(n, int(self.starts[k + 1]) - pos)
            out[len(out) - n:len(out) - n + take] = self._map(k)[off:off + take]
            pos, n, k = pos + take, n - take, k + 1

    def __getitem__(self, ids) -> np.ndarray:
        ids = np.arange(self.n)[ids] if isinstance(ids, slice) else np.asarray(ids)
        scalar = ids.ndim == 0
        ids = ids.reshape(-1).astype(np.int64)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.n):
            raise IndexError(f"row index out of range [0, {self.n})")
        out = np.empty((len(ids), self.seq_len + 1), np.int32)
        for i, r in enumerate(ids):
            self._read(int(r) * self.seq_len, out[i])
        self.tokens_read += out.size
        if out.size and int(out.max()) >= self.vocab_size:  # bit rot in a shard; the index said otherwise
            bad = int(ids[np.nonzero(out.max(axis=1) >= self.vocab_size)[0][0]])
            k = int(np.searchsorted(self.starts, bad * self.seq_len, side="right")) - 1
            raise ConfigError(f"token store {str(self.store.root)!r}: shard {self.files[k]} is corrupt (token id "
                              f"{int(out.max())} >= model.vocab_size={self.vocab_size}, above the index's largest id); "
                              f"{self.store.remedy}")
        return out[0] if scalar else out
