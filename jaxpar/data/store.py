"""The token store: a corpus tokenised once, read by memory map, each process touching only its rows.

**Layout** (a folder, written by :mod:`jaxpar.data.prepare`, or :func:`write_stream_store` for
training's cache)::

    store.json          the index (written last: a folder without it is not a store)
    tokenizer.json      the BPE that produced the ids (absent for the byte tokenizer)
    train-00000.bin       raw little-endian token ids (uint16 when the vocabulary fits, else uint32)
    train-00000.docs.bin  int64 little-endian: where (in the split's stream) each document that starts
                          in this shard starts, in order
    train-00000.mask.bin  only in a store with loss masks (chat data): one uint8 per token, 1 where
                          the token is trained (as a target)
    ...
    val-00000.bin         the validation split, likewise (with its .docs.bin, .mask.bin)

``store.json`` holds the format version (2; version 1 had no ``.docs.bin`` files), the dtype, the
tokenizer (kind, ids, end-of-text id), ``masks`` (whether the shards have ``.mask.bin`` files), and
per split the shards in order with their token count, largest id, SHA-256, document count
(``docs``) and the SHA-256 of the ``.docs.bin`` (and ``.mask.bin``), plus document and token
totals. A split's token stream is its shards concatenated; every document is followed by the
end-of-text id (by a blank line for the byte tokenizer), exactly as
:func:`jaxpar.data.tokenizer.encode_documents` joins them. A document ends where the next starts
(the last at the end of the split; offset 0 always starts one), so it may straddle shards; with the
byte tokenizer a document starts at its text, and the blank line after it is its end.

**Why memory-mapped arrays, not ArrayRecord/grain.** A training row of ``seq_len + 1`` tokens
starts anywhere in the stream and straddles documents; with a raw array it is one slice of a
memory map (the kernel reads only the pages it covers, ~2 pages per row), with no decoding. A
record format stores documents, so a row would decode every record it overlaps. Measured here
(``benchmarks/data.py``): gathering a random 32 x 257 batch from a 200 M-token store takes tens of
microseconds; see docs/guides/data.md for the numbers.

**Rows.** :meth:`TokenStore.rows` (:class:`~jaxpar.data.packing.StoreRows`) is a split cut into rows
exactly as :func:`jaxpar.data.pipeline.pack` cuts an in-memory stream (row ``i`` = tokens ``[i*L, i*L
+ L + 1)``); :meth:`TokenStore.document_rows` packs its documents whole into rows
(:mod:`jaxpar.data.packing`). :class:`~jaxpar.data.pipeline.PackedBatches` orders and shards either
unchanged, and a process reads only the rows of its share of each global batch.

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
from jaxpar.data import packing
from jaxpar.data.packing import StoreRows
from jaxpar.data.tokenizer import ByteTokenizer

FORMAT = "jaxpar-token-store"
VERSION = 2  # 2: document boundaries (.docs.bin) and optional loss masks (.mask.bin); 1 is still read, as a stream
INDEX = "store.json"
PROGRESS = "progress.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")


def dtype_for(n_ids: int) -> np.dtype:
    """uint16 when every id fits (vocabularies up to 65,536), else uint32."""
    return np.dtype("<u2") if n_ids <= 1 << 16 else np.dtype("<u4")


def shard_name(split: str, k: int) -> str:
    return f"{split}-{k:05d}.bin"


def docs_name(shard: str) -> str:
    """The document boundaries beside the shard ``shard`` (``train-00000.bin`` -> ``train-00000.docs.bin``)."""
    return shard[:-len(".bin")] + ".docs.bin"


def mask_name(shard: str) -> str:
    """The loss mask beside the shard ``shard`` (``train-00000.bin`` -> ``train-00000.mask.bin``)."""
    return shard[:-len(".bin")] + ".mask.bin"


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


class ShardWriter:
    """Appends token arrays to ``<split>-NNNNN.bin`` files (with their ``.docs.bin`` and, with ``masks``,
    ``.mask.bin``), closing a shard once it holds ``shard_tokens`` tokens (only between documents, so
    shards end on document boundaries)."""

    def __init__(self, root: Path, split: str, dtype: np.dtype, shard_tokens: int, shards: list | None = None,
                 masks: bool = False):
        self.root, self.split, self.dtype, self.shard_tokens = root, split, np.dtype(dtype), int(shard_tokens)
        self.shards = list(shards or [])  # finished: {"file", "tokens", "max_id", "sha256", "docs", "docs_sha256"}
        self.masks = bool(masks)
        self.position = sum(int(s["tokens"]) for s in self.shards)  # where the open shard starts in the stream
        self._files: list[BinaryIO] = []  # the open shard's tokens (and mask) files
        self._hashes: list[Any] = []
        self._docs: list[int] = []
        self._tokens, self._max = 0, -1

    @property
    def open_tokens(self) -> int:
        return self._tokens

    def _names(self) -> list[str]:
        name = shard_name(self.split, len(self.shards))
        return [name, mask_name(name)] if self.masks else [name]

    def write(self, ids: np.ndarray, mask: np.ndarray | None = None, starts=()) -> None:
        """Append ``ids`` (with masks: and ``mask``, one byte per id); documents begin at the offsets
        ``starts`` of ``ids``."""
        if not self._files:
            self._files = [open(self.root / (n + ".tmp"), "wb") for n in self._names()]
            self._hashes = [hashlib.sha256() for _ in self._files]
            self._tokens, self._max, self._docs = 0, -1, []
        self._docs.extend(self.position + self._tokens + int(k) for k in starts)
        parts = [np.asarray(ids).astype(self.dtype, copy=False)]
        if self.masks:
            if mask is None or len(mask) != len(ids):
                raise ValueError(f"a store with loss masks needs one mask byte per token ({len(ids)} tokens)")
            parts.append(np.asarray(mask).astype(np.uint8, copy=False))
        if len(ids):
            for f, h, a in zip(self._files, self._hashes, parts):
                b = a.tobytes()
                f.write(b)
                h.update(b)
            self._tokens += len(ids)
            self._max = max(self._max, int(np.max(ids)))

    def full(self) -> bool:
        return bool(self._files) and self._tokens >= self.shard_tokens

    def close_shard(self) -> bool:
        """Finish the open shard (fsync, rename into place); False if none was open or it was empty."""
        if not self._files:
            return False
        files, self._files = self._files, []
        for f in files:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        names = self._names()
        if self._tokens == 0:
            for n in names:
                os.remove(self.root / (n + ".tmp"))
            return False
        docs = np.asarray(self._docs, "<i8").tobytes()
        with open(self.root / (docs_name(names[0]) + ".tmp"), "wb") as f:
            f.write(docs)
            f.flush()
            os.fsync(f.fileno())
        for n in (docs_name(names[0]), *names[::-1]):  # the token shard last
            os.replace(self.root / (n + ".tmp"), self.root / n)
        entry = {"file": names[0], "tokens": self._tokens, "max_id": self._max, "sha256": self._hashes[0].hexdigest(),
                 "docs": len(self._docs), "docs_sha256": hashlib.sha256(docs).hexdigest()}
        if self.masks:
            entry["mask_sha256"] = self._hashes[1].hexdigest()
        self.shards.append(entry)
        self.position += self._tokens
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


def write_store(out: Path, tok, meta: dict, docs, shard_tokens: int, masks: bool = False) -> dict | None:
    """A store of ``docs``, ``(split, ids, mask, starts)`` in stream order (the train split's, then the
    validation split's; ``starts``: where documents begin in ``ids``; ``mask``: with ``masks``, one byte
    per id), written in a temporary folder beside ``out`` and renamed into place, so ``out`` appears
    whole or not at all. Its index, or None if another writer's copy took the place first."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    dtype = dtype_for(tok.vocab_size)
    try:
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens, masks=masks) for s in SPLITS}
        for split, ids, mask, starts in docs:
            writers[split].write(ids, mask, starts)
            if writers[split].full():
                writers[split].close_shard()
        splits = {}
        for name, w in writers.items():
            w.close_shard()
            splits[name] = {"shards": w.shards, "documents": sum(int(s["docs"]) for s in w.shards),
                            "tokens": w.position}
        if not isinstance(tok, ByteTokenizer):
            shutil.copyfile(tok.path, tmp / TOKENIZER_FILE)
        index = write_index(tmp, dtype, tokenizer_info(tok), splits, {**meta, "masks": bool(masks)})
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if (out / INDEX).is_file():  # another process renamed its copy first
            return None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index


def write_stream_store(out: Path, train_ids: np.ndarray, val_ids: np.ndarray, tok, meta: dict,
                       train_docs=(0,), val_docs=(0,)) -> Path:
    """A store of two in-memory token streams (one shard per split) whose documents begin at the offsets
    ``train_docs`` / ``val_docs``; concurrent writers (processes on one host) are safe: the first one wins."""
    if not (out / INDEX).is_file():
        write_store(out, tok, meta, [("train", train_ids, None, train_docs), ("val", val_ids, None, val_docs)],
                    max(len(train_ids), len(val_ids)) + 1)
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
    if index.get("version") not in (1, VERSION):
        raise ConfigError(f"token store {str(path)!r} has format version {index.get('version')}; this jaxpar "
                          f"reads version 1: token streams, and version {VERSION}: with document boundaries; {remedy}")
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
        self.version, self.has_masks = self.index["version"], bool(self.index.get("masks"))
        try:
            self.dtype = np.dtype(self.index["dtype"])
            tok = self.index["tokenizer"]
            self.n_ids, self.eos_id, self.tokenizer_kind = int(tok["vocab_size"]), tok.get("eos_id"), tok["kind"]
            files = []  # (file, its size in bytes) of every shard, its boundaries and its mask
            for s in (s for split in SPLITS for s in self.index["splits"][split]["shards"]):
                files.append((s["file"], int(s["tokens"]) * self.dtype.itemsize))
                files += [(docs_name(s["file"]), 8 * int(s["docs"]))] if "docs" in s else []
                files += [(mask_name(s["file"]), int(s["tokens"]))] if self.has_masks else []
            self._counts = {sp: {k: int(self.index["splits"][sp][k]) for k in ("tokens", "documents")} for sp in SPLITS}
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: its {INDEX} is corrupt (no valid {e}); {remedy}") from None
        if self.tokenizer_kind != "byte" and not (self.root / TOKENIZER_FILE).is_file():
            raise ConfigError(f"{where}: its {TOKENIZER_FILE} is missing; {remedy}")
        for name, want in files:
            f = self.root / name
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

    def rows(self, split: str, seq_len: int, vocab_size: int) -> StoreRows:
        return StoreRows(self, split, seq_len, vocab_size)

    def reader(self, split: str, masks: bool = False) -> packing.ConcatReader:
        """The token stream (or with ``masks``, the loss mask) of ``split``, read by memory map."""
        shards = self.index["splits"][split]["shards"]
        return packing.ConcatReader([self.root / (mask_name(s["file"]) if masks else s["file"]) for s in shards],
                                    [int(s["tokens"]) for s in shards], np.uint8 if masks else self.dtype)

    def corrupt(self, reader: packing.ConcatReader, pos: int, value: int, vocab_size: int) -> ConfigError:
        """The error for token id ``value`` (>= ``vocab_size``) at ``pos`` of ``reader``'s stream: bit rot."""
        shard = Path(reader.paths[reader.file_of(pos)]).name
        return ConfigError(f"token store {str(self.root)!r}: shard {shard} is corrupt (token id {value} >= "
                           f"model.vocab_size={vocab_size}, above the index's largest id); {self.remedy}")

    def document_rows(self, split: str, seq_len: int, vocab_size: int, long: str = "split") -> packing.DocumentRows:
        """The documents of ``split`` packed whole into rows of ``seq_len`` pairs (:mod:`jaxpar.data.packing`;
        ``long``: a document longer than a row is ``split`` into pieces or ``skip``-ped)."""
        if self.version < 2:
            raise ConfigError(f"{self.label} predates document boundaries (format version 1, no .docs.bin files), "
                              f"which data.packing=documents needs; {self.remedy}")
        tokens = self.reader(split)
        try:
            shards = self.index["splits"][split]["shards"]
            starts = [np.fromfile(self.root / docs_name(s["file"]), "<i8") for s in shards]
            doc_starts, doc_lens = packing.document_spans(np.concatenate([*starts, []]), tokens.total)
        except (KeyError, ValueError):
            raise ConfigError(f"token store {str(self.root)!r}: the document boundaries of its {split} split "
                              f"(.docs.bin files) are corrupt; {self.remedy}") from None
        plan = packing.plan_rows(doc_starts, doc_lens, seq_len, long)
        if plan.n_rows == 0:
            fits = f" that fits a row (model.seq_len + 1 = {seq_len + 1} tokens)" if long == "skip" else ""
            raise ConfigError(f"the {split} split of {self.label} holds no document of 2 tokens or more{fits}; "
                              f"{self.more(split)}")
        masks = self.reader(split, masks=True) if self.has_masks else None
        return packing.DocumentRows(plan, tokens.read, masks.read if masks else None, vocab_size,
                                    lambda pos, value: self.corrupt(tokens, pos, value, vocab_size))

    def verify(self) -> list[str]:
        """Files (shards, boundaries, masks) whose SHA-256 differs from the index (reads every byte)."""
        files = [(name(s["file"]), s.get(key)) for sp in SPLITS for s in self.index["splits"][sp]["shards"]
                 for name, key in ((str, "sha256"), (docs_name, "docs_sha256"), (mask_name, "mask_sha256"))]
        return [f for f, sha in files if sha is not None and file_sha256(self.root / f) != sha]
