"""Tokenise a corpus once into a token store (:mod:`jaxpar.data.store`) that training reads by memory map.

    python -m jaxpar.data.prepare 'corpus/*.jsonl' --out stores/web --vocab-size 32768
    python -m jaxpar.data.prepare books/ more.parquet --out stores/mix --tokenizer tokenizer.json
    python train.py data.source=tokens data.path=stores/web model.vocab_size=32768

**Input.** Files, globs and folders (searched recursively), in sorted order within each argument:
``.txt``/``.md`` files are one document each, ``.jsonl`` lines, ``.json`` records and Parquet rows
one document per record (``--field``, default ``text``). Folders and globs skip hidden files and
folders, token stores and ``--out`` itself (:func:`~jaxpar.data.corpus.expand_paths`).

**Split.** As ``data.val_fraction`` does for in-memory text, the last ``--val-fraction`` of the input
(by bytes, over all files in order) is the validation split: a document goes to validation when it
starts at or after that point; a text file that straddles it is cut at a line boundary.

**Tokenizer.** ``--tokenizer bpe`` (default) trains a byte-level BPE of ``--vocab-size`` ids on the
first ``--bpe-sample-mb`` megabytes of the training documents; ``byte`` uses raw UTF-8 bytes; a path
uses that ``tokenizer.json``. The store keeps the tokenizer beside the tokens.

**Streaming, all cores, bounded memory.** Documents are read one at a time and encoded in batches of
about ``--batch-mb`` megabytes of text (the Rust tokenizer spreads a batch over every core); the ids
are appended to the open shard file, which closes once it holds ``--shard-tokens`` tokens (where
each document starts goes beside it, for ``data.packing=documents``). Peak memory is a batch, not
the corpus. Chat conversations (``--chat HF_DIR``, :func:`jaxpar.data.chat.prepare_store`) are stored
with their loss masks (assistant turns) by :func:`prepare_tokenized`.

**Resumable.** After each closed shard ``progress.json`` records the input position and the shards
so far. Running the same command again after an interruption continues from there (the
tokenizer, input files and options must be unchanged; any of them changed is an error); on a
finished store it only prints the summary. ``store.json`` is written last, so an interrupted run
never leaves a folder that training reads as a store.

**Never overwrites.** ``--out`` is a new or empty folder, or this command's own store (unfinished:
it resumes; finished: the summary). A file, another store or any other non-empty folder is refused
and left as it was. An input error (a bad JSON line, a missing field) removes the unfinished store
it interrupted: once the input is corrected it is another input, which could not resume it.
Long by design: the streaming, resumable preparer and its command line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.data import chat
from jaxpar.data import store as st
from jaxpar.data.corpus import iter_documents
from jaxpar.data.chat import prepare_tokenized as prepare_tokenized  # pre-tokenized documents (chat)
from jaxpar.data.store import write_stream_store as write_stream_store  # re-exported: tests/helpers.py
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer, document, encode_many

BYTE_SEP = "\n\n"  # between documents when the tokenizer has no end-of-text id (as encode_documents)


def _text_cut(data: bytes, target: int) -> int:
    """A byte index near ``target`` just after a newline (as :func:`~jaxpar.data.corpus.split_train_val`)."""
    cut = data.rfind(b"\n", 0, target) + 1
    if cut <= 0:
        nl = data.find(b"\n", target)
        cut = nl + 1 if 0 <= nl < len(data) - 1 else target
    while 0 < cut < len(data) and (data[cut] & 0xC0) == 0x80:  # not inside a UTF-8 character
        cut -= 1
    return cut


class _Split:
    """The writer of one split plus its counts."""

    def __init__(self, root: Path, name: str, dtype, shard_tokens: int, saved: dict | None = None):
        saved = saved or {"shards": [], "documents": 0, "tokens": 0}
        self.writer = st.ShardWriter(root, name, dtype, shard_tokens, saved["shards"])
        self.documents, self.tokens = int(saved["documents"]), int(saved["tokens"])
        self.pending_docs = 0

    def summary(self) -> dict:
        return {"shards": self.writer.shards, "documents": self.documents, "tokens": self.tokens}


class Preparer:
    """One run of ``prepare`` (see the module docstring); :meth:`run` returns the summary dict."""

    def __init__(self, inputs: list[str], out: str | os.PathLike, tokenizer: str = "bpe", vocab_size: int = 0,
                 val_fraction: float = 0.01, field: str = "text", shard_tokens: int = 1 << 28,
                 bpe_sample_mb: float = 64.0, batch_mb: float = 4.0, log=print, progress: bool | None = None):
        from jaxpar.data.corpus import expand_paths

        if not inputs:
            raise ConfigError("no input: name files, globs or folders to prepare")
        if not 0.0 < val_fraction <= 0.5:
            raise ConfigError(f"--val-fraction={val_fraction} must be in (0, 0.5]")
        if shard_tokens < 1 or batch_mb <= 0 or bpe_sample_mb <= 0:
            raise ConfigError("--shard-tokens, --batch-mb and --bpe-sample-mb must be positive")
        out_r = Path(out).resolve()
        for spec in inputs:
            r = Path(spec).resolve()
            if r == out_r or out_r in r.parents:
                raise ConfigError(f"--out {str(out)!r} is (or holds) the input {spec!r}: prepare writes there; "
                                  f"choose a new folder for --out")
        seen, self.files = set(), []
        for spec in inputs:
            for f in expand_paths(spec, what="input", exclude=(out_r,)):  # never the store being written
                if f.resolve() not in seen:
                    seen.add(f.resolve())
                    self.files.append(f)
        self.out, self.tokenizer_spec, self.vocab_size = Path(out), tokenizer, int(vocab_size)
        self.val_fraction, self.field, self.shard_tokens = float(val_fraction), field, int(shard_tokens)
        self.bpe_sample = int(bpe_sample_mb * 1e6)
        self.batch_bytes = int(batch_mb * 1e6)
        self.log = log
        self.progress = sys.stderr.isatty() if progress is None else progress
        if tokenizer == "bpe" and self.vocab_size < 258:
            raise ConfigError("--tokenizer bpe needs --vocab-size (>= 258): the number of ids to train")
        if tokenizer not in ("bpe", "byte"):
            if not Path(tokenizer).exists():
                raise ConfigError(f"--tokenizer {tokenizer!r} does not exist: choose bpe, byte or the path of a "
                                  f"tokenizer.json (a file, or a folder holding one)")
            try:
                self.tokenizer_file = Path(BPETokenizer.load(tokenizer).path or tokenizer)
            except ConfigError as e:
                raise ConfigError(f"--tokenizer: {e}") from None
        self.sizes = [f.stat().st_size for f in self.files]
        self.bases = np.concatenate([[0], np.cumsum(self.sizes)]).tolist()
        self.total = int(self.bases[-1])
        self.val_start = self.total - int(round(self.val_fraction * self.total))
        self.key = self._key()

    def _key(self) -> str:
        """What the store depends on: inputs (path, size, mtime) and options."""
        h = hashlib.sha256(json.dumps({
            "files": [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in self.files],
            "tokenizer": self.tokenizer_spec if self.tokenizer_spec in ("bpe", "byte") else
            hashlib.sha256(self.tokenizer_file.read_bytes()).hexdigest(),
            "vocab_size": self.vocab_size, "val_fraction": self.val_fraction, "field": self.field,
            "shard_tokens": self.shard_tokens, "bpe_sample": self.bpe_sample, "version": st.VERSION,
        }, sort_keys=True).encode())
        return h.hexdigest()

    # -- documents ---------------------------------------------------------------------------

    def documents(self, cursor=(0, 0)):
        """``(split, text, next_cursor)`` from ``cursor`` on, the split decided by input position."""
        for i, off, text, nxt in iter_documents(self.files, self.field, tuple(cursor), key="--field"):
            g = self.bases[i] + off
            end = self.bases[i + 1]
            is_text = nxt == (i + 1, 0) and self.files[i].suffix.lower() not in (".jsonl", ".json", ".parquet")
            if is_text and off > 0:  # resuming inside a cut text file: its second part is validation
                yield "val", text, nxt
                continue
            if is_text and g < self.val_start < end:  # the text file holding the split point: cut it
                data = text.encode("utf-8")
                cut = _text_cut(data, self.val_start - g)
                if 0 < cut < len(data):
                    yield "train", data[:cut].decode("utf-8"), (i, off + cut)
                    yield "val", data[cut:].decode("utf-8"), nxt
                    continue
            yield ("val" if g >= self.val_start else "train"), text, nxt

    def _tokenizer(self):
        out_tok = self.out / st.TOKENIZER_FILE
        spec = self.tokenizer_spec
        if spec == "byte":
            return ByteTokenizer()
        if out_tok.is_file():  # resuming: the tokenizer this store began with
            return BPETokenizer.load(out_tok)
        if spec != "bpe":  # copied beside, then renamed: a tokenizer.json in --out is always whole
            tmp = self.out / f".{st.TOKENIZER_FILE}.{os.getpid()}.tmp"
            shutil.copyfile(self.tokenizer_file, tmp)
            os.replace(tmp, out_tok)
            return BPETokenizer.load(out_tok)
        t0 = time.perf_counter()

        used = [0]

        def sample():
            for split, text, _ in self.documents():
                if split != "train" or used[0] >= self.bpe_sample:
                    return
                text = text[:self.bpe_sample - used[0]]
                used[0] += len(text.encode("utf-8"))
                yield text

        tok = BPETokenizer.train(sample(), self.vocab_size, out_tok)
        self.log(f"prepare: trained a byte-level BPE of {tok.vocab_size} ids on the first "
                 f"{used[0] / 1e6:.3g} MB of training text in {time.perf_counter() - t0:.1f}s")
        return tok

    # -- the run -----------------------------------------------------------------------------

    def _save_progress(self, cursor, splits: dict, tok_info: dict | None) -> None:
        p = {"key": self.key, "cursor": list(cursor), "splits": {k: v.summary() for k, v in splits.items()},
             "tokenizer": tok_info}
        tmp = self.out / f".{st.PROGRESS}.tmp"
        tmp.write_text(json.dumps(p))
        os.replace(tmp, self.out / st.PROGRESS)

    def run(self) -> dict:
        """Prepare, resume or (finished) summarise ``--out``. A folder that is not this store's (a file,
        another store, anything else non-empty) is refused untouched; ``store.json`` is written last, so
        an interrupted run never leaves what training reads as a store; an input error discards the
        unfinished store (a corrected input is another input: it could not resume)."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out {str(out)!r} is a file; give a new or empty folder for the token store")
        if (out / st.INDEX).is_file():
            index = st.read_index(out, "--out")
            if index.get("key") != self.key:
                raise ConfigError(f"--out {str(out)!r} already holds a token store made from other inputs or "
                                  f"options; choose another --out or remove it")
            st.TokenStore(out, "--out")  # its shards are all there, with their sizes
            self.log(f"prepare: {out} is already prepared")
            return self._summary(index, 0.0, 0)
        progress = None
        if (out / st.PROGRESS).is_file():
            try:
                progress = json.loads((out / st.PROGRESS).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                progress = {}
            if not isinstance(progress, dict) or progress.get("key") != self.key:
                raise ConfigError(f"--out {str(out)!r} holds an unfinished store from other inputs or options; "
                                  f"choose another --out or remove it")
        elif out.exists() and any(out.iterdir()):
            raise ConfigError(f"--out {str(out)!r} exists and is not a token store; choose an empty or new folder")
        created = not out.exists()
        out.mkdir(parents=True, exist_ok=True)
        try:
            return self._run(progress)
        except ConfigError:
            self._discard(created)
            raise

    def _discard(self, created: bool) -> None:
        """Remove what preparing wrote into ``--out`` (and the folder, if this run made it)."""
        ours = re.compile(rf"({'|'.join(st.SPLITS)})-\d{{5}}(\.docs|\.mask)?\.bin(\.tmp)?|{re.escape(st.PROGRESS)}|"
                          rf"{re.escape(st.TOKENIZER_FILE)}|\.(progress|tokenizer|store)\.json\..*tmp")
        for f in self.out.iterdir():
            if ours.fullmatch(f.name) and f.is_file():
                f.unlink()
        if created and not any(self.out.iterdir()):
            self.out.rmdir()

    def _run(self, progress: dict | None) -> dict:
        out = self.out
        if progress is None:  # from now on a rerun resumes this store
            self._save_progress((0, 0), {}, None)
        for f in out.glob("*.tmp"):  # a shard cut short by the interruption
            f.unlink()
        tok = self._tokenizer()
        tok_info = st.tokenizer_info(tok)
        dtype = st.dtype_for(tok.vocab_size)
        saved = (progress or {}).get("splits", {})
        splits = {s: _Split(out, s, dtype, self.shard_tokens, saved.get(s)) for s in st.SPLITS}
        cursor = tuple((progress or {}).get("cursor", (0, 0)))
        self._save_progress(cursor, splits, tok_info)  # with the tokenizer made
        if progress and progress.get("tokenizer"):
            done = sum(s.tokens for s in splits.values())
            self.log(f"prepare: resuming {out} after {done:,} tokens (input file {cursor[0] + 1} of {len(self.files)})")
        start_bytes = self._position(cursor)
        t0, text_bytes = time.perf_counter(), 0
        batch: list[str] = []
        cursors: list = []  # the input position after each document of the batch
        starts: list[int] = []  # where each document's text begins in its ids (after the byte tokenizer's BYTE_SEP)
        batch_split, batch_bytes, batch_end = "train", 0, cursor

        def flush():
            """Encode the batch (in parallel) and append it; a full shard closes after a document."""
            nonlocal batch, cursors, starts, batch_bytes
            sp = splits[batch_split]
            for ids, nxt, start in zip(encode_many(tok, batch), cursors, starts):
                ids = document(tok, ids) if tok.eos_id is not None else ids  # bytes: joined by BYTE_SEP
                sp.writer.write(ids, starts=(start,))
                sp.tokens += len(ids)
                sp.documents += 1
                if sp.writer.full():
                    sp.writer.close_shard()
                    self._save_progress(nxt, splits, tok_info)
            batch, cursors, starts, batch_bytes = [], [], [], 0

        with _progress_bar(self.progress, self.total - start_bytes) as bar:
            for split, text, nxt in self.documents(cursor):
                if split != batch_split:
                    flush()
                    splits[batch_split].writer.close_shard()
                    self._save_progress(batch_end, splits, tok_info)
                    batch_split = split
                sep = tok.eos_id is None and bool(splits[split].documents or batch)
                text = BYTE_SEP + text if sep else text
                starts.append(len(BYTE_SEP) if sep else 0)  # the byte tokenizer: one id per byte
                batch.append(text)
                cursors.append(nxt)
                n = len(text.encode("utf-8"))
                batch_bytes, text_bytes, batch_end = batch_bytes + n, text_bytes + n, nxt
                if batch_bytes >= self.batch_bytes:
                    flush()
                    bar(self._position(nxt) - start_bytes)
            flush()
            for sp in splits.values():
                sp.writer.close_shard()
        for name, sp in splits.items():
            if sp.tokens == 0:
                raise ConfigError(f"the {name} split is empty: {len(self.files)} input file(s) hold too few documents "
                                  f"to hold out --val-fraction={self.val_fraction}; add documents or change it")
        index = st.write_index(out, dtype, tok_info, {k: v.summary() for k, v in splits.items()},
                               {"key": self.key, "inputs": [str(f) for f in self.files], "field": self.field,
                                "val_fraction": self.val_fraction, "text_bytes": self.total})
        (out / st.PROGRESS).unlink(missing_ok=True)
        return self._summary(index, time.perf_counter() - t0, text_bytes)

    def _position(self, cursor) -> int:
        i, pos = cursor
        if i >= len(self.files):
            return self.total
        if self.files[i].suffix.lower() in (".json", ".parquet"):
            return self.bases[i]
        return self.bases[i] + pos

    def _summary(self, index: dict, seconds: float, text_bytes: int) -> dict:
        sp = index["splits"]
        docs = sum(sp[s]["documents"] for s in st.SPLITS)
        tokens = sum(sp[s]["tokens"] for s in st.SPLITS)
        shards = sum(len(sp[s]["shards"]) for s in st.SPLITS)
        size = tokens * np.dtype(index["dtype"]).itemsize
        summary = {"documents": docs, "tokens": tokens, "train_tokens": sp["train"]["tokens"],
                   "val_tokens": sp["val"]["tokens"], "shards": shards, "store_bytes": size,
                   "text_bytes": text_bytes, "seconds": round(seconds, 3),
                   "tokens_per_second": round(tokens / seconds) if seconds and text_bytes else None}
        rate = (f" in {seconds:.1f}s: {tokens / seconds:,.0f} tokens/s, {text_bytes / seconds / 1e6:.1f} MB/s of text"
                if seconds and text_bytes else "")
        self.log(f"prepared {self.out}: {docs:,} documents, {tokens:,} tokens ({sp['train']['tokens']:,} train / "
                 f"{sp['val']['tokens']:,} validation) in {shards} shard(s), {size / 1e6:,.1f} MB, "
                 f"{index['dtype']}{rate}")
        return summary


class _progress_bar:
    """A rich progress bar over input bytes when ``enabled`` (a terminal), else nothing."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

            self.p = Progress("prepare", BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                              transient=True)
            self.p.__enter__()
            self.task = self.p.add_task("prepare", total=self.total)
        return self

    def __call__(self, done: int) -> None:
        if self.enabled:
            self.p.update(self.task, completed=done)

    def __exit__(self, *exc):
        if self.enabled:
            self.p.__exit__(*exc)


def prepare(inputs: list[str], out: str | os.PathLike, **options) -> dict:
    """Prepare (or finish preparing) the store ``out`` from ``inputs``; see :class:`Preparer`."""
    return Preparer(inputs, out, **options).run()


def main(argv=None) -> int:
    from jaxpar.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m jaxpar.data.prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("inputs", nargs="*", help="files, globs or folders (.txt .md .jsonl .json .parquet)")
    ap.add_argument("--out", required=True, help="the store folder to write: new or empty (or this command's "
                                                 "unfinished store, to resume); a store is never overwritten")
    ap.add_argument("--tokenizer", default="bpe", help="bpe (train one), byte, or the path of a tokenizer.json")
    ap.add_argument("--vocab-size", type=int, default=0, help="ids of the BPE to train (with --tokenizer bpe)")
    ap.add_argument("--val-fraction", type=float, default=0.01, help="share of the input (its end) held out")
    ap.add_argument("--field", default="text", help="the document field of .jsonl/.json records and Parquet rows")
    ap.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file (default 2^28)")
    ap.add_argument("--bpe-sample-mb", type=float, default=64.0, help="training text the BPE learns from")
    ap.add_argument("--batch-mb", type=float, default=4.0, help="text encoded per parallel batch")
    ap.add_argument("--verify", action="store_true", help="check an existing store's shards against their SHA-256")
    ap.add_argument("--chat", metavar="HF_DIR", default="", help="inputs are .jsonl conversations, rendered and "
                    "tokenised by this Hugging Face folder; loss masks on assistant turns (data.packing=documents)")
    args = ap.parse_args(argv)
    try:
        if args.verify:
            bad = st.TokenStore(args.out, "--out").verify()
            if bad:
                print(f"error: {args.out}: shard(s) {', '.join(bad)} do not match their checksum; {st.PREPARED_REMEDY}",
                      file=sys.stderr)
                return 1
            print(f"{args.out}: every shard matches its checksum")
            return 0
        if not args.inputs:
            ap.error("name the inputs to prepare (files, globs or folders)")
        if args.chat:
            chat.prepare_store(args.inputs, args.out, args.chat, args.val_fraction, args.shard_tokens)
        else:
            prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                    val_fraction=args.val_fraction, field=args.field, shard_tokens=args.shard_tokens,
                    bpe_sample_mb=args.bpe_sample_mb, batch_mb=args.batch_mb)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: interrupted; run the same command again to continue preparing {args.out}", file=sys.stderr)
        return 130
    except OSError as e:  # a full disk, a read-only --out, a file that vanished: the store resumes once fixed
        name = f" {e.filename}" if e.filename else ""
        print(f"error: cannot {'read' if args.verify else 'prepare'} {args.out}:{name}: {e.strerror or e}; fix that "
              f"and run the same command again", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
