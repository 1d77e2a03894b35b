"""Tokenizers: raw UTF-8 bytes, or a byte-level BPE trained (and cached) with the ``tokenizers`` library.

Both follow the small :class:`Tokenizer` protocol: ``vocab_size``, ``eos_id`` (``None`` if there is
no end-of-text token), ``encode(text) -> int32 array`` and ``decode(ids) -> str``. Both are lossless:
``decode(encode(text)) == text`` for any text (the BPE is byte-level, so no unknown tokens).

:func:`get_tokenizer` turns the config choice (``"byte"``, ``"bpe"`` or a path to a tokenizer.json)
into a tokenizer; a trained BPE is cached under a name holding the vocabulary size and a hash of the
training text, so a rerun on the same data loads it instead of training again.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from jaxpar.config import ConfigError

EOS_TOKEN = "<|endoftext|>"
# Names an existing tokenizer.json may use for its end-of-text token, most common first.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|eos|>", "<|end_of_text|>", "[SEP]")
# Bump when the training recipe changes: cached files trained by an older recipe are not reused.
_BPE_RECIPE = "bytelevel-bpe-v1"
# Text is cut into chunks only where a newline sits between two non-space characters: the GPT-2
# pre-tokenizer always splits there and never looks across, so chunked == whole-text encoding.
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
_CHUNK_CHARS = 4096


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int | None
    bos_ids: tuple[int, ...]  # what the tokenizer puts before a text (Llama 3, Gemma: a BOS token; GPT-2: none)

    def encode(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


class ByteTokenizer:
    """Token ids are the 256 byte values of the UTF-8 encoding. No end-of-text token.

    ``decode`` replaces invalid UTF-8, and ids outside [0, 256) (a model with a padded vocabulary
    can sample them), with U+FFFD.
    """

    vocab_size: int = 256
    eos_id: int | None = None
    bos_ids: tuple[int, ...] = ()

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        ids = np.where((ids >= 0) & (ids < 256), ids, 0xFF)  # 0xFF never occurs in UTF-8
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _chunks(text: str, size: int = _CHUNK_CHARS) -> list[str]:
    """``text`` cut at safe newlines into pieces of about ``size`` characters (they join to ``text``)."""
    out, start, n = [], 0, len(text)
    while start < n:
        m = _SAFE_CUT.search(text, min(start + size, n))
        end = m.start() if m else n
        out.append(text[start:end])
        start = end
    return out


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` behind the protocol: byte-level BPE when trained here, or any file."""

    def __init__(self, tok, path: str | None = None):
        self._tok = tok
        self.path = path
        ids = tok.get_vocab(with_added_tokens=True).values()
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), max(ids, default=-1) + 1)
        self.eos_id = next((i for i in map(tok.token_to_id, _EOS_CANDIDATES) if i is not None), None)
        self.bos_ids = _prefix(tok)

    @classmethod
    def train(cls, texts: Sequence[str], vocab_size: int, path: str | os.PathLike) -> "BPETokenizer":
        """Train a byte-level BPE of ``vocab_size`` ids (256 bytes, ``<|endoftext|>`` = id 0, merges)
        on ``texts`` and save it as the tokenizer.json file ``path``. The result depends only on the
        texts and vocab_size (training is deterministic; the file is written atomically)."""
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

        if vocab_size < 258:
            raise ConfigError(f"model.vocab_size={vocab_size} is too small for a byte-level BPE "
                              f"(it needs 256 byte tokens + {EOS_TOKEN} + merges); use >= 258 or data.tokenizer=byte")
        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator((c for t in texts for c in _chunks(t)), trainer)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tok.save(str(tmp))
        os.replace(tmp, path)
        return cls(tok, str(path))

    @classmethod
    def load(cls, path: str | os.PathLike) -> "BPETokenizer":
        """Read a tokenizer.json written by ``tokenizers`` (a folder means its ``tokenizer.json``)."""
        from tokenizers import Tokenizer as HFTokenizer

        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise ConfigError(f"tokenizer file {str(p)!r} does not exist")
        try:
            tok = HFTokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises a bare Exception on a malformed file
            detail = " ".join(str(e).split())  # the library's message, on one line
            raise ConfigError(f"tokenizer file {str(p)!r} is not a valid tokenizer.json ({detail})") from None
        return cls(tok, str(p))

    def encode(self, text: str) -> np.ndarray:
        """Token ids of ``text`` (no BOS/EOS added). Long texts are encoded in parallel by chunks."""
        encs = self._tok.encode_batch(_chunks(text), add_special_tokens=False)
        if not encs:
            return np.zeros((0,), np.int32)
        return np.concatenate([np.asarray(e.ids, dtype=np.int32) for e in encs])

    def encode_many(self, docs: Sequence[str]) -> list[np.ndarray]:
        """``[encode(d) for d in docs]``, all chunks of all documents in one parallel batch."""
        chunks = [_chunks(d) for d in docs]
        encs = iter(self._tok.encode_batch([c for cs in chunks for c in cs], add_special_tokens=False))
        out = []
        for cs in chunks:
            ids = [np.asarray(next(encs).ids, dtype=np.int32) for _ in cs]
            out.append(np.concatenate(ids) if ids else np.zeros((0,), np.int32))
        return out

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tok.decode(np.asarray(ids, dtype=np.int64).tolist(), skip_special_tokens=False)

    def to_str(self) -> str:
        """The tokenizer.json contents."""
        return self._tok.to_str()


def _prefix(tok) -> tuple[int, ...]:
    """The ids a ``tokenizers.Tokenizer``'s post-processor puts before a text (its BOS: Llama 3's
    ``<|begin_of_text|>``, Gemma's ``<bos>``; none for GPT-2, Qwen or a BPE trained here)."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    k = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
    return tuple(int(i) for i in full[:k])


def document(tok: Tokenizer, ids: np.ndarray) -> np.ndarray:
    """One document's ids as the training stream holds them: the tokenizer's BOS ids (if it adds any),
    the text's ids, and ``tok.eos_id`` (if it has one)."""
    eos = [tok.eos_id] if tok.eos_id is not None else []
    return np.concatenate([np.asarray(getattr(tok, "bos_ids", ()), np.int32), ids.astype(np.int32),
                           np.asarray(eos, np.int32)])


def encode_documents(tok: Tokenizer, docs: str | Sequence[str], sep: str = "\n\n") -> np.ndarray:
    """One int32 token stream for ``docs``, each document framed by :func:`document` (BOS where the
    tokenizer adds one, then the EOS); without an EOS token (bytes) the documents are joined by ``sep``
    instead. A str is a single document."""
    docs = [docs] if isinstance(docs, str) else list(docs)
    if tok.eos_id is None:
        return tok.encode(sep.join(docs))
    return np.concatenate([document(tok, tok.encode(d)) for d in docs] or [np.zeros((0,), np.int32)])


def encode_documents_with_starts(tok: Tokenizer, docs: str | Sequence[str],
                                 sep: str = "\n\n") -> tuple[np.ndarray, np.ndarray]:
    """``(encode_documents(tok, docs, sep), starts)``: the same stream, and where each document begins in
    it (int64): at its first id (the BOS where the tokenizer adds one), or without an EOS token (bytes)
    at its text, the ``sep`` before it ending the previous document as an EOS would."""
    docs = [docs] if isinstance(docs, str) else list(docs)
    if tok.eos_id is None:
        lens = [len(d.encode("utf-8")) for d in docs]
        gaps = np.arange(len(docs)) * len(sep.encode("utf-8"))
        return encode_documents(tok, docs, sep), np.cumsum([0, *lens[:-1]], dtype=np.int64)[:len(docs)] + gaps
    parts = [document(tok, ids) for ids in encode_many(tok, docs)]
    starts = np.cumsum([0, *(len(p) for p in parts[:-1])], dtype=np.int64)[:len(docs)]
    return np.concatenate(parts or [np.zeros((0,), np.int32)]), starts


def cut_documents(docs: str | Sequence[str], cut: int, sep: str = "\n\n") -> tuple[list[str], list[str]]:
    """The documents of ``text[:cut]`` and of ``text[cut:]``, ``text = sep.join(docs)`` (the train and
    validation text of :func:`~jaxpar.data.corpus.split_train_val`): ``sep.join`` of each list is that
    text. A document the cut falls in is cut in two; a cut in a separator leaves its parts to the
    documents on either side."""
    docs = [docs] if isinstance(docs, str) else list(docs)
    pos = 0  # where docs[i] begins in text
    for i, d in enumerate(docs):
        end = pos + len(d)
        if pos <= cut <= end and (cut < end or i == len(docs) - 1):
            return [*docs[:i], d[:cut - pos]], [d[cut - pos:], *docs[i + 1:]]
        if end <= cut <= end + len(sep):  # in the separator after d (or at either of its ends)
            k = cut - end
            return [*docs[:i], d + sep[:k]], [sep[k:] + docs[i + 1], *docs[i + 2:]]
        pos = end + len(sep)
    raise ValueError(f"cut {cut} is beyond the text ({pos - len(sep)} characters)")


def prompt_ids(tok: Tokenizer, text: str) -> list[int]:
    """A generation prompt's ids as the tokenizer frames a text (its BOS first, if it adds one)."""
    return [int(i) for i in (*getattr(tok, "bos_ids", ()), *tok.encode(text))]


def encode_many(tok: Tokenizer, docs: Sequence[str]) -> list[np.ndarray]:
    """The token ids of each document (in parallel where the tokenizer can)."""
    many = getattr(tok, "encode_many", None)
    return many(docs) if many else [tok.encode(d) for d in docs]


def text_hash(texts: Sequence[str]) -> str:
    """SHA-256 (hex) of the texts, each length-prefixed so that the split into documents counts."""
    h = hashlib.sha256(_BPE_RECIPE.encode())
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def bpe_cache_path(cache_dir: str | os.PathLike, vocab_size: int, texts: Sequence[str]) -> Path:
    return Path(cache_dir) / f"bpe-v{vocab_size}-{text_hash(texts)[:16]}.tokenizer.json"


def get_tokenizer(kind: str, vocab_size: int, texts: Sequence[str], cache_dir: str | os.PathLike) -> Tokenizer:
    """The tokenizer for config value ``kind``: ``"byte"``, ``"bpe"`` or a path to a tokenizer.json.

    ``vocab_size`` is the model's ``model.vocab_size``: bytes need >= 256; ``"bpe"`` trains exactly
    that many ids on ``texts`` (the training text only, never validation), cached in ``cache_dir``;
    a loaded file must not have more ids than ``vocab_size``.
    """
    if kind == "byte":
        if vocab_size < 256:
            raise ConfigError(f"model.vocab_size={vocab_size} is too small for the byte tokenizer (needs >= 256)")
        return ByteTokenizer()
    if kind == "bpe":
        path = bpe_cache_path(cache_dir, vocab_size, texts)
        if path.is_file():
            return BPETokenizer.load(path)
        return BPETokenizer.train(texts, vocab_size, path)
    if not os.path.exists(kind):
        what = "does not exist" if kind.endswith(".json") or os.sep in kind else "is not a tokenizer"
        raise ConfigError(f"data.tokenizer={kind!r} {what}: choose 'byte', 'bpe' or the path of a tokenizer.json "
                          f"(a file, or a folder holding one)")
    try:
        tok = BPETokenizer.load(kind)
    except ConfigError as e:
        raise ConfigError(f"data.tokenizer={kind!r}: {e}") from None
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"data.tokenizer={kind!r} has {tok.vocab_size} ids but model.vocab_size={vocab_size}; "
                          f"set model.vocab_size >= {tok.vocab_size}")
    return tok
