"""The edges of the data path a new user hits: a data folder that must stay untouched and resume,
`python -m jaxpar.data.prepare` that never overwrites, and one true line for every bad input.

References are independent of the code: the byte tokenizer's stream is the UTF-8 of the documents
joined as documented, folders are compared byte for byte (every entry, hidden ones included) before
and after, and each message's advice is followed to check that it works.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import config

from jaxpar.config import ConfigError
from jaxpar.data import prepare as prep
from jaxpar.data import store as st
from jaxpar.data import tokenizer as tk
from jaxpar.data.corpus import expand_paths, load_texts
from jaxpar.data.sources import TokenBatches, cache_root, make_source

QUIET = dict(log=lambda *_: None)


def _tree(root: Path) -> dict:
    """Every entry under ``root`` (hidden ones too): its bytes and mtime, or None for a folder."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@pytest.fixture()
def home(tmp_path, monkeypatch) -> Path:
    """A fake home with no cache variables set, so that a default location lands in it, never in the real one."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.delenv("JAXPAR_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return h


def _corpus(root: Path) -> list[str]:
    """A folder of text and JSONL, plus what jaxpar or the user's tools left in it that is not data: the
    cache an earlier jaxpar wrote beside the data, a hidden file, and a token store. Returns the documents
    in the documented order (sorted paths; a .txt file is one document, a .jsonl line one document)."""
    rng = np.random.default_rng(3)
    words = "to be or not that is the question whether tis nobler in mind".split()
    a = "\n".join(" ".join(rng.choice(words, 9)) for _ in range(150)) + "\n"
    b = [" ".join(rng.choice(words, 25)) for _ in range(40)]
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(a)
    (root / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in b))
    (root / ".notes.txt").write_text("hidden: not data\n")
    old = root / ".jaxpar-cache" / "stores" / "files-0123456789abcdef"  # as versions before this one left it
    st.write_stream_store(old, np.arange(50), np.arange(20), tk.ByteTokenizer(), {"key": "old"})
    (root / ".jaxpar-cache" / "bpe-v300-0123456789abcdef.tokenizer.json").write_text("{}")
    prep.prepare([str(root / "a.txt")], root / "stores" / "web", tokenizer="byte", val_fraction=0.2, **QUIET)
    return [a, *b]


def test_files_source_never_writes_beside_the_data_and_a_rerun_reuses_its_cache(tmp_path, home, monkeypatch):
    corpus = tmp_path / "corpus"
    docs = _corpus(corpus)
    before = _tree(corpus)
    cfg = config("gpt2", data__source="files", data__path=str(corpus), data__tokenizer="byte", data__prefetch=0,
                 model__vocab_size=256, model__seq_len=16, train__batch_size=8)
    logged: list[str] = []
    first = make_source(cfg, slice(None), logged.append)
    assert any("tokenised" in line for line in logged)
    assert f"note: {corpus / '.jaxpar-cache'} is the cache an earlier jaxpar wrote beside the data" in "\n".join(logged)
    # The stream is the documents' UTF-8, joined by a blank line: the hidden file, the old cache and the
    # token store (its store.json, tokenizer-less byte store) were not read as data.
    joined = "\n\n".join(docs).encode()
    stores = sorted((home / ".cache" / "jaxpar" / "stores").iterdir())
    assert len(stores) == 1 and stores[0].name.startswith("files-")
    stream = [np.fromfile(stores[0] / f"{s}-00000.bin", np.uint16) for s in st.SPLITS]
    assert np.concatenate(stream).tolist() == list(joined)
    assert _tree(corpus) == before  # byte for byte, no new entry

    def no_tokenising(*a, **k):
        raise AssertionError("tokenised again although the cache holds the store")

    monkeypatch.setattr(tk, "encode_documents", no_tokenising)
    logged.clear()
    second = make_source(cfg, slice(None), logged.append)
    assert not any("tokenised" in line for line in logged)
    assert sorted((home / ".cache" / "jaxpar" / "stores").iterdir()) == stores
    for _ in range(3):
        a, b = first.next(), second.next()
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    assert _tree(corpus) == before


def test_the_cache_location_and_what_a_folder_or_glob_skips(tmp_path, home, monkeypatch):
    assert cache_root("") == home / ".cache" / "jaxpar"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root("") == tmp_path / "xdg" / "jaxpar"
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path / "env"))
    assert cache_root("") == tmp_path / "env"
    assert cache_root(str(tmp_path / "key")) == tmp_path / "key"

    corpus = tmp_path / "corpus"
    _corpus(corpus)
    want = [corpus / "a.txt", corpus / "sub" / "b.jsonl"]
    assert expand_paths(str(corpus)) == want
    assert expand_paths(str(corpus / "**" / "*.json*"), what="input") == [corpus / "sub" / "b.jsonl"]
    assert expand_paths(str(corpus / "**" / "*.txt")) == [corpus / "a.txt"]
    assert load_texts(str(corpus / ".notes.txt")) == ["hidden: not data\n"]  # a file named on its own is read
    with pytest.raises(ConfigError, match=r"matches no files but 1 file\(s\) of jaxpar's own"):
        expand_paths(str(corpus / "stores" / "*" / "*.json"))
    with pytest.raises(ConfigError, match=r"data.path='.*web' is a token store, not text: train on it with "
                                          r"data.source=tokens data.path="):
        expand_paths(str(corpus / "stores" / "web"))
    (tmp_path / "only-hidden" / ".git").mkdir(parents=True)
    (tmp_path / "only-hidden" / ".git" / "a.txt").write_text("x\n")
    with pytest.raises(ConfigError, match=r"holds no .txt/.md/.jsonl/.json/.parquet files \(hidden files and "
                                          r"folders and token stores are skipped\)"):
        expand_paths(str(tmp_path / "only-hidden"))
    # A cache inside the data folder (data.cache_dir=corpus/cache) is never read as data either.
    cfg = config("gpt2", data__source="files", data__path=str(corpus), data__tokenizer="bpe",
                 data__cache_dir=str(corpus / "cache"), model__vocab_size=300, model__seq_len=16, train__batch_size=8)
    logged: list[str] = []
    for _ in range(2):  # the second run finds the cache's tokenizer.json (a .json file) in the folder: skipped
        make_source(cfg, slice(None), logged.append)
    assert sum("tokenised" in line for line in logged) == 1
    assert len(list((corpus / "cache").glob("bpe-v300-*.tokenizer.json"))) == 1


def _cache_cfg(tmp_path, corpus: Path, **over):
    return config("gpt2", **{"data__source": "files", "data__path": str(corpus), "data__tokenizer": "byte",
                             "data__cache_dir": str(tmp_path / "cache"), "data__prefetch": 0, "model__vocab_size": 256,
                             "model__seq_len": 16, "train__batch_size": 8, **over})


def test_files_source_faults_are_one_true_line(tmp_path):
    corpus = tmp_path / "corpus"
    _corpus(corpus)
    before = _tree(corpus)
    cfg = _cache_cfg(tmp_path, corpus)
    make_source(cfg, slice(None), lambda *_: None)
    cached = next((tmp_path / "cache" / "stores").iterdir())
    shard = cached / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-4])
    with pytest.raises(ConfigError) as e:
        make_source(cfg, slice(None), lambda *_: None)
    msg = str(e.value)
    assert "\n" not in msg and "shard train-00000.bin is corrupt" in msg and "prepare" not in msg
    assert f"delete '{cached}', jaxpar's cache of data.source=files, data.path='{corpus}': the next run rebuilds" in msg
    shutil.rmtree(cached)  # what the message says to do, and it works
    make_source(cfg, slice(None), lambda *_: None)
    (cached / "store.json").unlink()
    with pytest.raises(ConfigError, match=f"'{cached}', jaxpar's cache of data.source=files, .* is damaged "
                                          f"\\(no store.json\\); delete it: the next run rebuilds it"):
        make_source(cfg, slice(None), lambda *_: None)
    shutil.rmtree(cached)
    make_source(cfg, slice(None), lambda *_: None)

    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"^data.cache_dir='.*a-file': cannot write the tokenised data.source=files, "
                                          r"data.path='.*' there \(Not a directory: .*\); set data.cache_dir \(or "
                                          r"\$JAXPAR_CACHE\) to a writable folder$"):
        make_source(_cache_cfg(tmp_path, corpus, data__cache_dir=str(tmp_path / "a-file")), slice(None))
    with pytest.raises(ConfigError, match=r"^the validation split of data.source=files, data.path='.*' \(cached as "
                                          r"token store '.*'\) has \d+ rows of model.seq_len=16, fewer than one batch "
                                          r"\(train.batch_size=512\); lower train.batch_size or model.seq_len, or use "
                                          r"more text or a larger data.val_fraction$"):
        make_source(_cache_cfg(tmp_path, corpus, train__batch_size=512), slice(None), lambda *_: None)
    with pytest.raises(ConfigError, match=r"^data.tokenizer='.*nope.json' does not exist: choose 'byte', 'bpe' or "):
        make_source(_cache_cfg(tmp_path, corpus, data__tokenizer=str(tmp_path / "nope.json")), slice(None))
    with pytest.raises(ConfigError, match=r"^data.tokenizer='.*a.txt': tokenizer file '.*a.txt' is not a valid "
                                          r"tokenizer.json \(.*\)$"):
        make_source(_cache_cfg(tmp_path, corpus, data__tokenizer=str(corpus / "a.txt")), slice(None))
    with pytest.raises(ConfigError, match=r"^model.vocab_size=200 is too small for a byte-level BPE .* use >= 258 "
                                          r"or data.tokenizer=byte$"):
        make_source(_cache_cfg(tmp_path, corpus, data__tokenizer="bpe", model__vocab_size=200), slice(None))
    assert _tree(corpus) == before


def _run(capsys, argv) -> tuple[int, str, str]:
    """``python -m jaxpar.data.prepare ARGV``: (exit status, stderr, stdout)."""
    try:
        rc = prep.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    cap = capsys.readouterr()
    return rc, cap.err, cap.out


def _one_line(result, status: int, *needles: str) -> None:
    rc, err, _ = result
    assert rc == status and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err


BYTE = ["--tokenizer", "byte", "--val-fraction", "0.2"]


def test_prepare_never_overwrites_and_every_refusal_is_one_line(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    _corpus(corpus)
    web = corpus / "stores" / "web"  # a finished store of a.txt alone
    before = _tree(tmp_path)
    # into a store made from other inputs, a file, a folder of something else, onto its input: refused, untouched
    _one_line(_run(capsys, [str(corpus / "sub"), *BYTE, "--out", str(web)]), 2,
              "already holds a token store made from other inputs or options; choose another --out or remove it")
    _one_line(_run(capsys, [str(corpus / "sub"), *BYTE, "--out", str(corpus / "a.txt")]), 2,
              "is a file; give a new or empty folder for the token store")
    _one_line(_run(capsys, [str(corpus / "a.txt"), *BYTE, "--out", str(corpus / "sub")]), 2,
              "exists and is not a token store; choose an empty or new folder")
    _one_line(_run(capsys, [str(corpus), *BYTE, "--out", str(corpus)]), 2,
              "is (or holds) the input")
    _one_line(_run(capsys, [str(corpus / "*.nothing"), *BYTE, "--out", str(tmp_path / "s")]), 2,
              "input='", "the pattern matches no files")
    _one_line(_run(capsys, [str(corpus), "--tokenizer", str(tmp_path / "no.json"), "--out", str(tmp_path / "s")]), 2,
              "--tokenizer '", "does not exist: choose bpe, byte or the path of a tokenizer.json")
    _one_line(_run(capsys, [str(corpus), "--tokenizer", str(corpus / "sub"), "--out", str(tmp_path / "s")]), 2,
              "--tokenizer: tokenizer file '", "sub/tokenizer.json' does not exist")
    _one_line(_run(capsys, [str(corpus), "--tokenizer", str(corpus / "a.txt"), "--out", str(tmp_path / "s")]), 2,
              "a.txt' is not a valid tokenizer.json (")
    _one_line(_run(capsys, [str(corpus), "--vocab-size", "100", "--out", str(tmp_path / "s")]), 2,
              "--tokenizer bpe needs --vocab-size (>= 258)")
    (tmp_path / "a-file").write_text("x")
    _one_line(_run(capsys, [str(corpus), *BYTE, "--out", str(tmp_path / "a-file" / "s")]), 1,
              "cannot prepare ", "Not a directory; fix that and run the same command again")
    (tmp_path / "a-file").unlink()
    assert _tree(tmp_path) == before and not (tmp_path / "s").exists()

    # the same command on its own finished store: the summary, the store byte for byte as it was
    rc, err, out = _run(capsys, [str(corpus / "a.txt"), *BYTE, "--out", str(web)])
    assert (rc, err) == (0, "") and "is already prepared" in out
    assert _tree(tmp_path) == before
    # an --out inside the input folder is never read as input: the rerun finds it prepared
    args = [str(corpus), *BYTE, "--out", str(corpus / "all")]
    assert _run(capsys, args)[:2] == (0, "")
    rc, err, out = _run(capsys, args)
    assert (rc, err) == (0, "") and "is already prepared" in out
    assert set(_tree(tmp_path)) - set(before) == {"corpus/all", *(f"corpus/all/{n}" for n in
                                                               ("store.json", "train-00000.bin", "train-00000.docs.bin", "val-00000.bin",
                                                                "val-00000.docs.bin"))}
    # a damaged store: rerunning its command says so (it does not claim "already prepared"), and the advice works
    shard = corpus / "all" / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    damaged = _tree(corpus / "all")
    _one_line(_run(capsys, args), 2, "shard train-00000.bin is corrupt", st.PREPARED_REMEDY)
    _one_line(_run(capsys, ["--verify", "--out", str(corpus / "all")]), 2, "shard train-00000.bin is corrupt",
              st.PREPARED_REMEDY)
    assert _tree(corpus / "all") == damaged
    assert _run(capsys, [*args[:-1], str(tmp_path / "new")])[0] == 0
    assert st.TokenStore(tmp_path / "new").tokens("train") > 0


def test_an_input_error_or_interruption_never_leaves_a_store_that_training_reads(tmp_path, capsys, monkeypatch):
    corpus = tmp_path / "corpus"
    _corpus(corpus)
    good = (corpus / "sub" / "b.jsonl").read_text()
    out = tmp_path / "store"
    # a bad line after the first shard: one line naming file and line; nothing of the store is left
    (corpus / "sub" / "b.jsonl").write_text(good + '{"text": "fine"}\n{not json\n')
    _one_line(_run(capsys, [str(corpus), *BYTE, "--shard-tokens", "500", "--batch-mb", "0.001", "--out", str(out)]), 2,
              "b.jsonl' line 42: not valid JSON (", "; fix or remove that line")
    assert not out.exists()
    (corpus / "sub" / "b.jsonl").write_text(good + '{"body": "x"}\n')
    _one_line(_run(capsys, [str(corpus), *BYTE, "--out", str(out)]), 2,
              "b.jsonl' line 41: no 'text' field (it has 'body'); set --field to the field that holds the text")
    assert not out.exists()
    (corpus / "sub" / "b.jsonl").write_text(good)
    # interrupted before the first shard (while the tokenizer is made): an unfinished store, which resumes
    real = prep.Preparer._tokenizer

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(prep.Preparer, "_tokenizer", interrupted)
    _one_line(_run(capsys, [str(corpus), *BYTE, "--out", str(out)]), 130,
              f"interrupted; run the same command again to continue preparing {out}")
    with pytest.raises(ConfigError, match="is an unfinished token store .* run the same `python -m "
                                          "jaxpar.data.prepare` command again to finish it"):
        TokenBatches(config("gpt2", data__source="tokens", data__path=str(out), model__vocab_size=256), slice(None))
    monkeypatch.setattr(prep.Preparer, "_tokenizer", real)
    assert _run(capsys, [str(corpus), *BYTE, "--out", str(out)])[0] == 0
    assert _run(capsys, [str(corpus), *BYTE, "--out", str(tmp_path / "whole")])[0] == 0  # never interrupted
    contents = [{k: v and v[0] for k, v in _tree(d).items()} for d in (out, tmp_path / "whole")]
    assert contents[0] == contents[1] and sorted(contents[0]) == ["store.json", "train-00000.bin",
                                                                "train-00000.docs.bin", "val-00000.bin",
                                                                "val-00000.docs.bin"]


def _tokens_cfg(path, **over):
    return config("gpt2", **{"data__source": "tokens", "data__path": str(path), "model__vocab_size": 256,
                             "model__seq_len": 16, "train__batch_size": 8, **over})


def _refused(cfg, pattern: str) -> str:
    with pytest.raises(ConfigError) as e:
        TokenBatches(cfg, slice(None), **QUIET)
    msg = str(e.value)
    assert "\n" not in msg and re.search(pattern, msg), msg
    return msg


def test_tokens_source_edges_are_one_true_line(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    _corpus(corpus)
    web = corpus / "stores" / "web"
    _refused(_tokens_cfg(tmp_path / "nope"), r"data.path='.*nope' does not exist; make a token store there with "
                                             r"`python -m jaxpar.data.prepare INPUT... --out .*nope`")
    _refused(_tokens_cfg(corpus / "a.txt"), r"data.path='.*a.txt' is a file, not a token store .*; data.source=files "
                                            r"trains on text files directly$")
    _refused(_tokens_cfg(corpus), r"data.path='.*corpus' is not a token store \(no store.json\); make one with "
                                  r"`python -m jaxpar.data.prepare INPUT... --out NEW_FOLDER` and set data.path to "
                                  r"NEW_FOLDER; data.source=files trains on text files directly$")
    (tmp_path / "empty").mkdir()
    msg = _refused(_tokens_cfg(tmp_path / "empty"), r"is not a token store \(no store.json\); make one with `python -m "
                                                    r"jaxpar.data.prepare INPUT... --out .*empty` \(it is empty\)$")
    assert _run(capsys, [str(corpus / "a.txt"), *BYTE, "--out", msg.split("--out ")[1].split("`")[0]])[0] == 0
    TokenBatches(_tokens_cfg(tmp_path / "empty"), slice(None), **QUIET)  # the advice worked

    # another vocabulary, a context longer than the split, a validation split smaller than a batch
    _refused(_tokens_cfg(web, model__vocab_size=200), r"holds ids up to 255 .* set model.vocab_size >= 256$")
    _refused(_tokens_cfg(web, model__vocab_size=600), r"model.vocab_size=600 is more than twice .* set "
                                                      r"model.vocab_size=256$")
    val_tokens = st.TokenStore(web).tokens("val")
    a = (corpus / "a.txt").read_bytes()  # by the documented rule: the last 20% cut back to a line start
    assert val_tokens == len(a) - (a.rfind(b"\n", 0, len(a) - round(0.2 * len(a))) + 1)
    seq = val_tokens  # one row needs seq_len + 1 tokens
    _refused(_tokens_cfg(web, model__seq_len=seq), rf"^the val split of token store '.*web' has {val_tokens} tokens, "
                                                   rf"fewer than one row of model.seq_len \+ 1 = {seq + 1}; lower "
                                                   r"model.seq_len, or prepare the store again into a new --out with "
                                                   r"a larger --val-fraction \(or more text\)$")
    rows = (val_tokens - 1) // 16
    _refused(_tokens_cfg(web, train__batch_size=rows + 1),
             rf"^the validation split of token store '.*web' has {rows} rows of model.seq_len=16, fewer than one "
             rf"batch \(train.batch_size={rows + 1}\); lower train.batch_size or model.seq_len, or prepare the store "
             r"again into a new --out with a larger --val-fraction \(or more text\)$")

    # a damaged index, another format version, a missing tokenizer.json: each names what repairs it
    for name, edit, pattern in [
            ("json", lambda i: "{", r"token store index '.*store.json' is corrupt \(.*\); "),
            ("version", lambda i: json.dumps({**i, "version": 99}), r"has format version 99; this jaxpar reads version "
                                                                    r"1: "),
            ("keys", lambda i: json.dumps({**i, "splits": {}}), r"its store.json is corrupt \(no valid 'train'\); "),
            ("format", lambda i: json.dumps({**i, "format": "other"}), r"is not a jaxpar token store index")]:
        bad = shutil.copytree(web, tmp_path / name)
        (bad / "store.json").write_text(edit(json.loads((web / "store.json").read_text())))
        msg = _refused(_tokens_cfg(bad), pattern)
        assert name == "format" or msg.endswith(st.PREPARED_REMEDY)
    bpe = tmp_path / "bpe"
    prep.prepare([str(corpus / "a.txt")], bpe, vocab_size=300, val_fraction=0.2, **QUIET)
    (bpe / "tokenizer.json").unlink()
    _refused(_tokens_cfg(bpe, model__vocab_size=300), r"token store '.*bpe': its tokenizer.json is missing; "
                                                      + re.escape(st.PREPARED_REMEDY) + "$")


def test_a_mixture_names_the_store_whose_validation_split_is_short_and_a_field_names_its_key(tmp_path):
    tok = tk.ByteTokenizer()
    a = st.write_stream_store(tmp_path / "a", np.arange(4000) % 256, np.arange(40) % 256, tok, {})
    b = st.write_stream_store(tmp_path / "b", np.arange(4000) % 256, np.arange(2000) % 256, tok, {})
    cfg = config("gpt2", data__source="tokens", data__mix=f"{a}:1,{b}:1", model__vocab_size=256, model__seq_len=16,
                 train__batch_size=8)
    # by hand: store a's 40 validation tokens make (40 - 1) // 16 = 2 rows, and it fills 4 of each batch's 8 rows
    with pytest.raises(ConfigError, match=rf"^the validation split of token store '{a}' \(data.mix\) holds 2 rows of "
                                          r"model.seq_len \+ 1 tokens, fewer than its 4 rows of each batch; lower "
                                          r"train.batch_size or model.seq_len, or prepare the store again into a new "
                                          r"--out with a larger --val-fraction$"):
        TokenBatches(cfg, slice(None), **QUIET)
    (tmp_path / "d.jsonl").write_text('{"text": "one"}\n{"body": "two"}\n')
    with pytest.raises(ConfigError, match=r"d.jsonl' line 2: no 'text' field \(it has 'body'\); set data.jsonl_field "
                                          r"to the field that holds the text$"):
        load_texts(str(tmp_path / "d.jsonl"))
