"""The files of a Hugging Face model directory: safetensors read only once they agree, an export written whole.

**Reading** (:class:`Safetensors`). ``model.safetensors``, or the shards a ``model.safetensors.index.json``
names, each header read and checked when the directory is opened, before any weight is placed: a shard
the index names that is missing, a file whose header or data is cut short, a tensor the index maps to a
file that does not hold it (or that a shard holds and the index does not name), a single file and an
index side by side (transformers would load the one, jaxpar the other), a dtype jaxpar cannot read:
each is a :class:`~jaxpar.errors.ConfigError` naming the directory and the file. Tensors are then read
one at a time from memory maps, in every dtype safetensors stores (bfloat16 and float8 through
``ml_dtypes``: numpy has neither, so safetensors' own numpy reader refuses them).

**Writing** (:func:`target`, :func:`write`). An export goes into a new or empty directory, or replaces a
previous jaxpar export of the same source: one marked by ``jaxpar_export.json`` (the run directory's
resolved path, or ``hf:DIR``, the step and the files written) that holds nothing else. Anything else
(a Hugging Face model, a folder with other files, a file) is refused, unless ``overwrite`` is asked, and
never (overwrite or not) a directory that is or holds what the export comes from: the run, its
checkpoints, the model it was imported from, its tokenizer or data. The files are written into a
staging directory and put in place by renames: a new directory is the staging one renamed; an existing
export is renamed aside, the staging one renamed in, the old one deleted, so that the directory never
holds files of two models and a failure before the swap leaves it as it was (after a crash, the
``.NAME.jaxpar-*`` staging directory beside it is the only trace). An empty directory (which may be a
mount point or the working directory, and keeps its permissions) is filled from a staging directory
inside it, the marker first, so that an interrupted export is still recognised as this source's.
A refusal is a ``ConfigError``; a directory that cannot be written is an :class:`ExportError` (an IO
fault), with the target as it was. :func:`special_tokens` says which special-token ids and tokenizer
files an export carries.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np

from jaxpar.errors import ConfigError

INDEX, SINGLE, MARKER = "model.safetensors.index.json", "model.safetensors", "jaxpar_export.json"
_STAGING = ".jaxpar-"  # staging directories: ".jaxpar-*" inside a target, ".NAME.jaxpar-*" beside it

_DTYPES: dict[str, Any] = {
    "F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


class ExportError(RuntimeError):
    """An export that could not be written (an IO fault): one line naming the directory and the cause."""


# ---------------------------------------------------------------------------------------------
# Reading.

def _header(path: Path) -> tuple[int, dict]:
    """``(offset of the data, {name: entry})`` of a safetensors file that safetensors has validated."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entries = json.loads(f.read(n))
    entries.pop("__metadata__", None)
    return 8 + n, entries


class Safetensors:
    """The safetensors files of a model directory ``d``, checked against each other when opened (see the
    module docstring): ``where`` maps every tensor to its file; ``read(name)`` is the tensor."""

    def __init__(self, d: Path):
        self.d = d
        self._headers: dict[str, tuple[int, dict]] = {}
        self._maps: dict[str, np.ndarray] = {}
        if (d / INDEX).is_file() and (d / SINGLE).is_file():
            raise ConfigError(f"{d} holds both {SINGLE} and {INDEX} (transformers would load the one, jaxpar the "
                              "other): keep the files of one model")
        if (d / INDEX).is_file():
            self.where = self._index(d / INDEX)
        elif (d / SINGLE).is_file():
            self.where = {k: SINGLE for k in self._open(SINGLE)[1]}
        else:
            raise ConfigError(f"{d} has no {SINGLE} or {INDEX} (PyTorch .bin files are not read: convert them "
                              "with transformers' save_pretrained(safe_serialization=True))")

    def _index(self, index: Path) -> dict[str, str]:
        try:
            where = json.loads(index.read_text())["weight_map"]
            ok = isinstance(where, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in where.items())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} cannot be read as an index ({type(e).__name__}: {e}); copy it again") from None
        if not ok:
            raise ConfigError(f"{index}: weight_map must map tensor names to file names")
        for file in sorted(set(where.values())):
            if Path(file).name != file:
                raise ConfigError(f"{index} names {file!r}, not a file of {self.d}")
            if not (self.d / file).is_file():
                raise ConfigError(f"{index} names {file}, which is missing from {self.d}: copy the complete model")
            held = self._open(file)[1]
            wanted = {k for k, v in where.items() if v == file}
            missing, unmapped = sorted(wanted - held.keys()), sorted(held.keys() - wanted)
            if missing:
                raise ConfigError(f"{index} maps tensor {missing[0]!r} to {file}, which does not hold it: the index "
                                  "and the files are of different models; copy the complete model")
            if unmapped:
                raise ConfigError(f"{self.d}/{file} holds tensor {unmapped[0]!r}, which {INDEX} does not map to it: "
                                  "the index and the files are of different models; copy the complete model")
        return dict(where)

    def _open(self, file: str) -> tuple[int, dict]:
        """The checked header of one file (safetensors' own validation: header, offsets, file size)."""
        from safetensors import safe_open

        path = self.d / file
        try:
            with safe_open(str(path), "np"):
                pass
            offset, entries = _header(path)
        except Exception as e:  # safetensors raises its own error type; OSError for an unreadable file
            detail = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"{path} is not a readable safetensors file ({detail}): truncated or damaged? copy "
                              "it again") from None
        for name, entry in entries.items():
            if entry["dtype"] not in _DTYPES:
                raise ConfigError(f"{path}: tensor {name!r} has dtype {entry['dtype']}, which jaxpar does not read "
                                  f"({', '.join(_DTYPES)})")
        self._headers[file] = (offset, entries)
        return offset, entries

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name``, from its file's header."""
        file = self.where[name]
        if file not in self._headers:
            self._open(file)
        return tuple(self._headers[file][1][name]["shape"])

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` (read-only, memory-mapped)."""
        file = self.where[name]
        offset, entries = self._headers[file]
        if file not in self._maps:
            self._maps[file] = np.memmap(self.d / file, np.uint8, "r")
        entry = entries[name]
        begin, end = entry["data_offsets"]
        return self._maps[file][offset + begin: offset + end].view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


# ---------------------------------------------------------------------------------------------
# Writing.

_SPECIAL = ("bos_token_id", "eos_token_id", "pad_token_id")
_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def special_tokens(tokenizer, vocab_size: int) -> tuple[dict[str, Any], dict[str, Path]]:
    """``({bos_token_id, eos_token_id[, pad_token_id]}, {file name: file to copy})`` for the export of a
    run whose tokenizer is ``tokenizer``. A ``tokenizer.json`` read from a Hugging Face model directory
    brings that directory's ids (its ``generation_config.json``, else ``config.json``: GPT-2's BOS, which
    its tokenizer never adds, Llama 3's list of EOS ids, a pad id) and its ``tokenizer_config.json`` and
    ``special_tokens_map.json``; any other tokenizer gives its own EOS, and its BOS when it puts one
    before a text. Unknown ids (the byte tokenizer has none, nor has a run without a tokenizer) are
    None, which the export writes as null: transformers' class defaults are GPT-2's or Llama's ids. An
    id the model's vocabulary does not hold is left out the same way."""
    ids: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None}
    copies: dict[str, Path] = {}
    if tokenizer is None:
        return ids, copies
    bos = tuple(getattr(tokenizer, "bos_ids", ()))
    ids.update(bos_token_id=bos[0] if len(bos) == 1 else None, eos_token_id=getattr(tokenizer, "eos_id", None))
    path = Path(getattr(tokenizer, "path", None) or "")
    if path.name == "tokenizer.json":
        src = path.parent
        for name in ("generation_config.json", "config.json"):
            try:
                given = json.loads((src / name).read_text())
            except (OSError, ValueError):
                continue
            if isinstance(given, dict) and any(k in given for k in _SPECIAL):
                ids = {k: given[k] for k in _SPECIAL if k in given}
                ids.setdefault("bos_token_id", None)
                ids.setdefault("eos_token_id", None)
                break
        copies = {n: src / n for n in _TOKENIZER_FILES if (src / n).is_file()}

    def valid(v) -> bool:
        vs = v if isinstance(v, list) else [v]
        return bool(vs) and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in vs)

    return {k: v if valid(v) else None for k, v in ids.items() if v is not None or k != "pad_token_id"}, copies


def source_of(run: str | Path) -> str:
    """What an export records as its source and recognises again: a run directory's resolved path, or
    ``hf:`` and a Hugging Face model directory's."""
    run = str(run)
    if run.startswith("hf:"):
        return "hf:" + str(Path(run[3:]).expanduser().resolve())
    return str(Path(run).expanduser().resolve())


def protected(cfg, source: str) -> list[tuple[Path, str]]:
    """What an export of ``source`` (a run, or ``hf:DIR``) never replaces, ``--overwrite`` or not: the run,
    its checkpoints, the model it was imported from (in the run's ``config.yaml``: a run is reopened
    without it), its tokenizer, data and data cache."""
    import glob

    import yaml

    def real(p: str) -> Path:
        q = Path(p).expanduser()
        while glob.has_magic(str(q)):
            q = q.parent
        return q.resolve()

    imported = "the Hugging Face model this run was imported from (model.init_from)"
    out: list[tuple[Path, str]] = []
    inits = [cfg.model.init_from]
    if source.startswith("hf:"):
        out.append((Path(source[3:]), "the Hugging Face model being exported"))
    else:
        out += [(Path(source), "the run directory"), (real(cfg.train.out_dir), "the run directory (train.out_dir)")]
        try:
            saved = yaml.safe_load((Path(source) / "config.yaml").read_text())
            inits.append(str(saved["model"]["init_from"] or ""))
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            pass
    out += [(real(i[3:]), imported) for i in inits if i.startswith("hf:")]
    if cfg.checkpoint.dir:
        out.append((real(cfg.checkpoint.dir), "the run's checkpoints (checkpoint.dir)"))
    if cfg.data.tokenizer not in ("bpe", "byte"):
        out.append((real(cfg.data.tokenizer), "the run's tokenizer (data.tokenizer)"))
    data = [cfg.data.path] + [x.rsplit(":", 1)[0] for x in cfg.data.mix.split(",") if x.strip()]
    out += [(real(d), "the run's data (data.path / data.mix)") for d in data if d]
    if cfg.data.cache_dir:
        out.append((real(cfg.data.cache_dir), "the run's data cache (data.cache_dir)"))
    return out


def save(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """A safetensors file of ``tensors``, laid out as safetensors' own ``save_file`` does (widest dtype
    first, then by name; header padded to 8 bytes), streamed one tensor at a time; a failure is an
    ``OSError`` (safetensors reports IO faults as its own error type)."""
    names = {np.dtype(v): k for k, v in _DTYPES.items()}
    order = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    header: dict[str, Any] = {"__metadata__": metadata}
    size = 0
    for k in order:
        a = tensors[k]
        header[k] = {"dtype": names[a.dtype], "shape": list(a.shape), "data_offsets": [size, size + a.nbytes]}
        size += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with path.open("wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for k in order:
            f.write(np.ascontiguousarray(tensors[k]).reshape(-1).view(np.uint8).data)

@dataclass
class Target:
    """Where an export goes: ``out`` as given (for messages), ``real`` (resolved) and how it is written:
    ``new`` (nothing there), ``empty`` (an empty directory) or ``replace`` (an existing directory)."""

    out: Path
    real: Path
    kind: str


def _within(real: Path, p: Path) -> bool:
    return real == p or real in p.parents


def _marker(d: Path) -> dict | None:
    try:
        m = json.loads((d / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) and isinstance(m.get("files"), list) else None


def target(out: str | Path, source: str, overwrite: bool = False,
           protected: Iterable[tuple[Path, str]] = ()) -> Target:
    """Where an export of ``source`` (a resolved run directory, or ``hf:DIR``) into ``out`` goes, or the
    one-line refusal (see the module docstring). ``protected``: ``(path, what it is)`` that ``out`` may
    neither be nor hold, whatever ``overwrite`` says."""
    out = Path(out)
    real = out.expanduser().resolve()
    for p, what in protected:
        if _within(real, p):
            raise ConfigError(f"{out} {'is ' + what if real == p else f'holds {what} ({p})'}: exporting there "
                              "would replace it; name a new or empty directory")
    if real.exists() and not real.is_dir():
        raise ConfigError(f"{out} is a file: name a new or empty directory for the export")
    if not real.exists():
        top = next(p for p in real.parents if p.exists())
        if not top.is_dir():
            raise ConfigError(f"{out} cannot be created: {top} is a file; name a new or empty directory")
        if not os.access(top, os.W_OK | os.X_OK):
            raise ExportError(f"{out} cannot be created: {top} is not writable; export elsewhere")
        return Target(out, real, "new")
    try:
        entries = sorted(os.listdir(real))
    except OSError as e:
        raise ExportError(f"{out} cannot be read ({e.strerror}); export elsewhere") from None
    if not entries:
        if not os.access(real, os.W_OK | os.X_OK):
            raise ExportError(f"{out} is not writable; export elsewhere")
        return Target(out, real, "empty")
    prev = _marker(real)
    ours = prev is not None and prev.get("source") == source
    known = {MARKER, *(prev or {}).get("files", [])}
    extra = [e for e in entries if e not in known and not e.startswith(_STAGING)]
    if not overwrite and not (ours and not extra):
        again = "name a new or empty directory, or pass --overwrite to replace all of its content"
        if prev is not None and not ours:
            raise ConfigError(f"{out} holds the jaxpar export of {prev.get('source')}, not of {source}; {again}")
        if prev is not None:
            raise ConfigError(f"{out} holds {extra[0]!r} beside this run's export, a file jaxpar did not write; "
                              f"move it away, or {again}")
        what = "a model jaxpar did not export" if "config.json" in entries else "files jaxpar did not write"
        raise ConfigError(f"{out} holds {what} ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''}); "
                          f"{again}")
    if os.path.ismount(real):
        raise ExportError(f"{out} is a mount point, which an export replaces by renames beside it; export into an "
                          "empty directory or a new one inside it")
    if not os.access(real.parent, os.W_OK | os.X_OK):
        raise ExportError(f"{out} cannot be replaced: {real.parent} is not writable (the new export is written "
                          "beside it, then renamed in); export elsewhere")
    return Target(out, real, "replace")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _staging(parent: Path, name: str) -> Path:
    d = parent / f"{name}{_STAGING}{os.getpid()}-{secrets.token_hex(4)}"
    os.mkdir(d)
    return d


def write(t: Target, writers: dict[str, Callable[[Path], object]], marker: dict) -> list[Path]:
    """Write each file ``name`` with ``writers[name](path)`` and the marker (``marker`` plus the names) into
    ``t`` as :func:`target` planned (see the module docstring). Returns the files' final paths."""
    names = [*writers, MARKER]
    created: list[Path] = []  # directories above a new target that this export made
    stage = None
    placed = False  # an empty target holds some of the files
    try:
        if t.kind == "new":
            for p in reversed(t.real.parents):
                if not p.exists():
                    p.mkdir()
                    created.append(p)
        stage = _staging(t.real, "") if t.kind == "empty" else _staging(t.real.parent, f".{t.real.name}")
        if t.kind == "replace":
            os.chmod(stage, stat.S_IMODE(t.real.stat().st_mode))
        (stage / MARKER).write_text(json.dumps({**marker, "files": names[:-1]}, indent=2))
        for name, fn in writers.items():
            fn(stage / name)
        for name in names:
            _fsync(stage / name)
        if t.kind == "empty":
            for name in reversed(names):  # the marker first: an interrupted fill is still this source's export
                os.rename(stage / name, t.real / name)
                placed = True
            os.rmdir(stage)
        elif t.kind == "new":
            os.rename(stage, t.real)
        else:
            old = stage.with_name(stage.name + ".old")
            os.rename(t.real, old)
            try:
                os.rename(stage, t.real)
            except BaseException:
                os.rename(old, t.real)
                raise
            shutil.rmtree(old, ignore_errors=True)
        stage = None
    except BaseException as e:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        for p in reversed(created):
            try:
                p.rmdir()
            except OSError:
                pass
        if isinstance(e, OSError):
            state = ("it holds part of this export (export again to replace it)" if placed else
                     "nothing was changed")
            raise ExportError(f"{t.out} cannot be written ({e.strerror or e}"
                              f"{': ' + str(e.filename) if e.filename else ''}); {state}: free space or fix "
                              "permissions, then export again") from None
        raise
    try:
        _fsync(t.real.parent)  # the renames, on disk
    except OSError:
        pass
    return [t.real / n for n in names]
