"""Document packing (``data.packing=documents``): best-fit bins, the row plan, the gathered rows, and the
store's document boundaries and loss masks (prepare, the training cache, pre-tokenized documents).

References are independent of the code under test: best fit against a plain O(n^2) best-fit-decreasing
written here and against the lower bound ceil(sum / capacity); the plan and the rows of a small example
worked out by hand; documents reassembled from the gathered rows compared with the documents framed
here from their text (BOS text EOS; bytes joined by a blank line), stream offsets naming their tokens.
"""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from helpers import config

from jaxpar.config import ConfigError
from jaxpar.data import pipeline
from jaxpar.data import prepare as prep
from jaxpar.data import store as st
from jaxpar.data.corpus import split_train_val
from jaxpar.data.packing import DocumentRows, best_fit, document_spans, plan_rows
from jaxpar.data.sources import text_store
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer, cut_documents, encode_documents_with_starts

QUIET = {"log": lambda *_: None}


def _reference_best_fit(lengths, capacity):
    """Best-fit decreasing, spelled out: longest item first (ties: lower index), into the open bin of least
    room that holds it (ties: the lower bin), else a new bin."""
    room: list[int] = []
    bins = [0] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fits = [b for b in range(len(room)) if room[b] >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: (room[b], b))
        else:
            room.append(capacity)
            b = len(room) - 1
        room[b] -= lengths[i]
        bins[i] = b
    return bins, len(room)


def test_best_fit_is_best_fit_decreasing_and_respects_the_bound():
    rng = np.random.default_rng(0)
    for trial in range(60):
        capacity = int(rng.choice([1, 5, 63, 64, 65, 200, 1000]))
        n = int(rng.integers(0, 300))
        lengths = np.minimum(rng.integers(1, capacity + 1, n), rng.integers(1, capacity + 1, n))  # many small
        if trial % 3 == 0:
            lengths[: n // 4] = capacity  # whole bins
        bins, n_bins = best_fit(lengths, capacity)
        want_bins, want_n = _reference_best_fit(lengths.tolist(), capacity)
        assert bins.dtype == np.int64 and bins.tolist() == want_bins and n_bins == want_n
        assert n_bins >= -(-int(lengths.sum()) // capacity)
        assert (np.bincount(bins, weights=lengths, minlength=n_bins) <= capacity).all()
    # By hand: 6 5 4 3 2 into bins of 10: 6 | 5 | 4 -> the 6's bin (room 0), 3 -> the 5's (room 2), 2 -> the 5's
    assert best_fit(np.array([3, 6, 2, 5, 4]), 10)[0].tolist() == [1, 0, 1, 1, 0]
    assert best_fit(np.zeros(0, np.int64), 4)[1] == 0
    for bad in ([0], [5]):
        with pytest.raises(ValueError, match="item lengths must be in"):
            best_fit(np.array(bad), 4)


def test_realistic_documents_fill_the_rows():
    rng = np.random.default_rng(1)
    for seq_len, median in ((2048, 400), (512, 300), (8192, 1500)):
        lens = np.maximum(rng.lognormal(np.log(median), 1.0, 20000).astype(np.int64), 1)
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        plan = plan_rows(starts, lens, seq_len)
        assert plan.fill_rate >= 0.95, (seq_len, plan.fill_rate)
        assert plan.n_rows >= -(-plan.pairs // seq_len)
        assert plan.pairs == int(np.sum(lens[lens >= 2] - 1))  # split: every pair of every document is kept
    lengths = np.minimum(rng.lognormal(6, 1.2, 300_000).astype(np.int64) + 1, 2048)
    t0 = time.perf_counter()
    bins, n_bins = best_fit(lengths, 2048)
    assert time.perf_counter() - t0 < 10  # O(n log n): about 0.5 s here
    assert n_bins <= 1.01 * lengths.sum() / 2048


def _by_hand_plan():
    # documents of 5, 1, 12, 3, 0 and 6 tokens; seq_len 4 (rows of 4 pairs, pieces of at most 5 tokens)
    lens = np.array([5, 1, 12, 3, 0, 6])
    return np.concatenate([[0], np.cumsum(lens)[:-1]]), lens  # starts 0 5 6 18 21 21


def test_the_plan_by_hand():
    starts, lens = _by_hand_plan()
    plan = plan_rows(starts, lens, 4)
    # pieces in stream order: doc 0 [0,5); doc 2 [6,11) [10,15) [14,18); doc 3 [18,21); doc 5 [21,26) [25,27)
    # pairs 4 4 4 3 2 4 1; best fit: the four 4s open rows 0-3, the 3 row 4 (room 1), the 2 row 5 (room 2),
    # the 1 the fullest row that holds it: row 4
    assert plan.row_ptr.tolist() == [0, 1, 2, 3, 4, 6, 7]
    assert plan.piece_start.tolist() == [0, 6, 10, 21, 14, 25, 18]
    assert plan.piece_len.tolist() == [5, 5, 5, 5, 4, 2, 3]
    assert plan.piece_doc.tolist() == [0, 2, 2, 5, 2, 5, 3]
    assert (plan.documents, plan.pieces, plan.skipped_long, plan.skipped_short) == (4, 7, 0, 2)
    assert plan.fill_rate == 22 / 24
    skip = plan_rows(starts, lens, 4, long="skip")  # documents 2 and 5 (over 5 tokens) dropped
    assert skip.piece_start.tolist() == [0, 18] and skip.row_ptr.tolist() == [0, 1, 2]
    assert (skip.documents, skip.skipped_long, skip.skipped_short, skip.fill_rate) == (2, 2, 2, 6 / 8)
    with pytest.raises(ConfigError, match="split or skipped"):
        plan_rows(starts, lens, 4, long="truncate")
    assert [a.tolist() for a in document_spans(np.array([3, 3, 7]), 9)] == [[0, 3, 3, 7], [3, 0, 4, 2]]
    with pytest.raises(ValueError):
        document_spans(np.array([4, 2]), 9)


def _reader(array: np.ndarray):
    """``read(start, out)`` of an in-memory stream."""
    def read(start: int, out: np.ndarray) -> None:
        out[:] = array[start:start + len(out)]
    return read


def test_document_rows_by_hand():
    starts, lens = _by_hand_plan()
    stream = np.arange(1, 28, dtype=np.int32)  # token at offset k is k + 1
    mask = (np.arange(27) % 4 != 0).astype(np.uint8)  # offsets 0, 4, 8, ... untrained
    read, read_mask = _reader(stream), _reader(mask)
    rows = DocumentRows(plan_rows(starts, lens, 4), read, read_mask)
    assert rows.shape == (6, 4) and len(rows) == 6 and rows.ndim == 2 and rows.fill_rate == 22 / 24
    b = rows[np.array([4, 5])]
    assert set(b) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    assert [b[k].dtype for k in ("inputs", "targets", "segment_ids", "positions", "weights")] == \
        [np.int32] * 4 + [np.float32]
    # row 4: doc 2's last piece (offsets 14..17) then doc 5's second piece (25, 26); row 5: doc 3, 2 pads
    assert b["inputs"].tolist() == [[15, 16, 17, 26], [19, 20, 0, 0]]
    assert b["targets"].tolist() == [[16, 17, 18, 27], [20, 21, 0, 0]]
    assert b["segment_ids"].tolist() == [[1, 1, 1, 2], [1, 1, 0, 0]]
    assert b["positions"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 1]]
    # weight = mask of the target's offset: 15 16 17 26 -> 1 0 1 1; 19 20 -> 1 0; padding 0
    assert b["weights"].tolist() == [[1, 0, 1, 1], [1, 0, 0, 0]]
    one = rows[2]  # doc 2's second piece, offsets 10..14
    assert one["inputs"].tolist() == [11, 12, 13, 14] and one["targets"].tolist() == [12, 13, 14, 15]
    assert one["weights"].tolist() == [1, 0, 1, 1]
    sliced = rows[4:6]
    assert all((sliced[k] == b[k]).all() for k in b)
    assert DocumentRows(plan_rows(starts, lens, 4), read)[5]["weights"].tolist() == [1, 1, 0, 0]  # no mask
    assert rows.tokens_read == (4 + 2 + 3) + 5 + (4 + 2 + 3)
    with pytest.raises(IndexError):
        rows[[6]]
    bad = DocumentRows(plan_rows(starts, lens, 4), read, vocab_size=20,
                       corrupt=lambda pos, value: ConfigError(f"id {value} at {pos}"))
    with pytest.raises(ConfigError, match="id 20 at 19"):
        bad[5]


def _pairs_of(rows: DocumentRows) -> dict[int, list[np.ndarray]]:
    """Each document's pieces (token arrays, in row order) read back from every row's segments."""
    b = rows[np.arange(len(rows))]
    pieces: dict[int, list[np.ndarray]] = {}
    p = 0
    for r in range(len(rows)):
        seg = b["segment_ids"][r]
        for s in range(1, seg.max() + 1):
            at = np.nonzero(seg == s)[0]
            assert (np.diff(at) == 1).all() and (b["positions"][r, at] == np.arange(len(at))).all()
            toks = np.append(b["inputs"][r, at], b["targets"][r, at[-1]])
            pieces.setdefault(int(rows.plan.piece_doc[p]), []).append(toks)
            p += 1
        pad = seg == 0
        assert not b["inputs"][r, pad].any() and not b["weights"][r, pad].any()
        assert b["positions"][r, pad].tolist() == list(range(pad.sum()))
    return pieces


def _join(pieces: list[np.ndarray]) -> np.ndarray:
    """Pieces of one document, overlapping by one token, back into the document."""
    return np.concatenate([pieces[0], *[q[1:] for q in pieces[1:]]])


@pytest.mark.parametrize("long", ["split", "skip"])
def test_every_token_of_every_document_is_a_target_exactly_once(long):
    rng = np.random.default_rng(2)
    lens = np.concatenate([[0, 1, 2], rng.integers(0, 90, 400)])
    rng.shuffle(lens)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    stream = np.arange(1, lens.sum() + 1, dtype=np.int32)
    rows = DocumentRows(plan_rows(starts, lens, 24, long), _reader(stream))
    pieces = _pairs_of(rows)
    fits = (lens >= 2) & ((lens <= 25) | (long == "split"))
    assert sorted(pieces) == np.nonzero(fits)[0].tolist()
    for d, ps in pieces.items():  # each piece is a run of the document, the pieces rebuild it
        np.testing.assert_array_equal(_join(ps), stream[starts[d]:starts[d] + lens[d]])
    b = rows[np.arange(len(rows))]
    targets = np.sort(b["targets"][b["segment_ids"] > 0])
    want = np.concatenate([stream[starts[d] + 1:starts[d] + lens[d]] for d in np.nonzero(fits)[0]])
    np.testing.assert_array_equal(targets, np.sort(want))  # each trained exactly once
    plan = rows.plan
    assert plan.skipped_short == int(np.sum(lens < 2))
    assert plan.skipped_long == (int(np.sum(lens > 25)) if long == "skip" else 0)
    assert plan.documents == int(fits.sum())


# ---------------------------------------------------------------------------------------------
# The store: boundaries from prepare and the training cache, version 1, masks


def _texts(n: int, seed: int = 3) -> list[str]:
    rng = np.random.default_rng(seed)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    return [" ".join(rng.choice(words, rng.integers(1, 30))) for _ in range(n)]


def _framed(tok, texts: list[str]) -> list[np.ndarray]:
    """Each document as a split's stream holds it: ids + EOS; bytes: the text and the blank line after it
    (none after the split's last)."""
    if tok.eos_id is None:
        return [np.frombuffer((t + ("\n\n" if i < len(texts) - 1 else "")).encode(), np.uint8).astype(np.int32)
                for i, t in enumerate(texts)]
    return [np.append(tok.encode(t), tok.eos_id).astype(np.int32) for t in texts]


def _documents(rows) -> list[np.ndarray]:
    pieces = _pairs_of(rows)
    assert sorted(pieces) == list(range(len(pieces)))
    return [_join(pieces[d]) for d in range(len(pieces))]


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_prepared_store_rows_rebuild_its_documents(tmp_path, tokenizer):
    texts = _texts(80)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "store"
    prep.prepare([str(tmp_path / "in")], out, tokenizer=tokenizer, vocab_size=300, val_fraction=0.1,
                 shard_tokens=300, batch_mb=0.0005, **QUIET)
    store = st.TokenStore(out)
    tok = store.tokenizer()
    n_train = store.documents("train")
    assert store.version == 2 and not store.has_masks and 0 < n_train < 80
    assert len(store.index["splits"]["train"]["shards"]) > 3
    for split, part in (("train", texts[:n_train]), ("val", texts[n_train:])):
        want = _framed(tok, part)
        rows = store.document_rows(split, 16, tok.vocab_size)
        got = _documents(rows)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        starts = np.concatenate([np.fromfile(out / st.docs_name(s["file"]), "<i8")
                                 for s in store.index["splits"][split]["shards"]])
        np.testing.assert_array_equal(starts, np.cumsum([0, *map(len, want[:-1])]))
    assert not store.verify()
    whole = store.document_rows("train", 1 << 14, tok.vocab_size)  # every document in one row
    assert len(whole) == 1 and whole[0]["segment_ids"].max() == n_train


def test_a_document_may_straddle_shards(tmp_path):
    """The format allows it (prepare never does it): a document's pieces are read across shard files."""
    w = st.ShardWriter(tmp_path, "train", st.dtype_for(256), 1000)
    stream = np.arange(1, 61) % 256
    w.write(stream[:10], starts=(0, 4))  # documents [0,4) [4,25) [25,60): the second straddles shards
    w.close_shard()
    w.write(stream[10:30], starts=(15,))
    w.close_shard()
    w.write(stream[30:])
    w.close_shard()
    v = st.ShardWriter(tmp_path, "val", st.dtype_for(256), 1000)
    v.write(stream[:5], starts=(0,))
    v.close_shard()
    splits = {"train": {"shards": w.shards, "documents": 3, "tokens": 60}, "val": {"shards": v.shards, "documents": 1,
                                                                                   "tokens": 5}}
    st.write_index(tmp_path, st.dtype_for(256), {"kind": "byte", "vocab_size": 256, "eos_id": None}, splits, {})
    assert [s["docs"] for s in w.shards] == [2, 1, 0]
    rows = st.TokenStore(tmp_path).document_rows("train", 8, 256)
    got = _documents(rows)
    for g, (a, b) in zip(got, [(0, 4), (4, 25), (25, 60)]):
        np.testing.assert_array_equal(g, stream[a:b])


def test_a_version_1_store_is_a_stream_only_and_bad_boundaries_are_clear(tmp_path):
    texts = _texts(40)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "store"
    prep.prepare([str(tmp_path / "in.jsonl")], out, tokenizer="byte", val_fraction=0.1, **QUIET)
    index = json.loads((out / "store.json").read_text())
    old = tmp_path / "old"  # as a version-1 jaxpar wrote it: no .docs.bin files, no "docs" in the index
    old.mkdir()
    for sp in st.SPLITS:
        for s in index["splits"][sp]["shards"]:
            (old / s["file"]).write_bytes((out / s["file"]).read_bytes())
            for k in ("docs", "docs_sha256"):
                del s[k]
    (old / "store.json").write_text(json.dumps({**index, "version": 1}))
    store = st.TokenStore(old)
    assert store.version == 1 and len(store.rows("train", 16, 256)) > 0  # still read as a stream
    with pytest.raises(ConfigError, match=r"^token store '.*old' predates document boundaries \(format version 1, "
                                          r"no .docs.bin files\), which data.packing=documents needs; prepare it "
                                          r"again into a new --out folder"):
        store.document_rows("train", 16, 256)
    docs = out / "train-00000.docs.bin"
    raw = docs.read_bytes()
    docs.write_bytes(raw[:-8])
    with pytest.raises(ConfigError, match=r"shard train-00000.docs.bin is corrupt \(.* bytes, the index says"):
        st.TokenStore(out)
    docs.write_bytes(raw[8:] + raw[:8])  # same size, out of order
    with pytest.raises(ConfigError, match=r"the document boundaries of its train split \(.docs.bin files\) are "
                                          r"corrupt"):
        st.TokenStore(out).document_rows("train", 16, 256)
    assert st.TokenStore(out).verify() == ["train-00000.docs.bin"]
    with pytest.raises(ConfigError, match="has format version 7; this jaxpar reads version 1: token streams, and "
                                          "version 2: with document boundaries"):
        (old / "store.json").write_text(json.dumps({**index, "version": 7}))
        st.TokenStore(old)


def test_prepare_tokenized_keeps_masks_and_never_overwrites(tmp_path):
    bpe = BPETokenizer.train(_texts(50), 300, tmp_path / "tok.json")
    rng = np.random.default_rng(4)
    docs = []
    for i in range(30):
        n = int(rng.integers(2, 40)) if i != 7 else 100  # document 7 is longer than a row (skipped)
        docs.append((rng.integers(0, bpe.vocab_size, n).astype(np.int32), (rng.random(n) < 0.6).astype(np.uint8)))
    out = tmp_path / "chat"
    summary = prep.prepare_tokenized(docs, out, tmp_path / "tok.json", val_fraction=0.1, shard_tokens=200, **QUIET)
    assert summary["documents"] == 30 and summary["val_tokens"] == sum(len(d[0]) for d in docs[27:])  # last 3
    assert summary["train_trained_tokens"] == sum(int(d[1].sum()) for d in docs[:27])
    store = st.TokenStore(out)
    assert store.has_masks and store.documents("train") == 27 and store.documents("val") == 3
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tok.json").read_bytes()
    assert not store.verify() and store.tokenizer().vocab_size == bpe.vocab_size
    rows = store.document_rows("train", 64, bpe.vocab_size, long="skip")
    assert rows.plan.skipped_long == 1 and rows.plan.documents == 26
    b = rows[np.arange(len(rows))]
    p = 0
    for r in range(len(rows)):
        for s in range(1, b["segment_ids"][r].max() + 1):
            at = b["segment_ids"][r] == s
            ids, mask = docs[int(rows.plan.piece_doc[p])]
            np.testing.assert_array_equal(b["inputs"][r, at], ids[:-1])
            np.testing.assert_array_equal(b["targets"][r, at], ids[1:])
            np.testing.assert_array_equal(b["weights"][r, at], mask[1:])  # the target's mask
            p += 1
    assert p == 26
    with pytest.raises(ConfigError, match="exists and is not an empty folder; prepare never overwrites a store"):
        prep.prepare_tokenized(docs, out, tmp_path / "tok.json", **QUIET)
    bad = [*docs[:5], (np.arange(4), np.ones(3, np.uint8))]
    with pytest.raises(ConfigError, match=r"^tokenized document 5: ids of shape \(4,\) and a mask of shape \(3,\); "
                                          r"give 1-D ids and one mask byte per id$"):
        prep.prepare_tokenized(iter(bad), tmp_path / "bad", tmp_path / "tok.json", val_fraction=0.2, **QUIET)
    with pytest.raises(ConfigError, match=r"^tokenized document 0: ids in \[.*\], outside the tokenizer's 256 ids"):
        prep.prepare_tokenized([(np.array([1, 256]), np.ones(2, np.uint8))] * 2, tmp_path / "bad", "byte", **QUIET)
    assert not (tmp_path / "bad").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["chat", "tok.json"]
    with pytest.raises(ConfigError, match="too few to hold out"):
        prep.prepare_tokenized(docs[:1], tmp_path / "one", "byte", **QUIET)


def test_the_training_cache_records_each_document(tmp_path):
    assert cut_documents(["ab", "cd"], 3) == (["ab\n"], ["\ncd"])  # the cut falls in the separator
    assert cut_documents(["abc", "d"], 2) == (["ab"], ["c", "d"])
    ids, starts = encode_documents_with_starts(ByteTokenizer(), ["ab", "c"])
    assert ids.tolist() == [97, 98, 10, 10, 99] and starts.tolist() == [0, 4]
    docs = _texts(30, seed=5)
    docs[4] = "two\n\nparagraphs"  # a blank line inside a document is not a boundary
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    begins = np.cumsum([0, *(len(d) + 2 for d in docs[:-1])])  # each document's text in the joined text
    for tokenizer in ("byte", "bpe"):
        cfg = config("gpt2", data__source="files", data__path=str(tmp_path / "corpus"), data__tokenizer=tokenizer,
                     data__cache_dir=str(tmp_path / "cache"), model__vocab_size=300 if tokenizer == "bpe" else 256)
        store = st.TokenStore(text_store(cfg, log=lambda *_: None))
        tok = store.tokenizer()
        train_text, val_text = split_train_val(docs, cfg.data.val_fraction)
        c = len(train_text)
        for sp, text in (("train", train_text), ("val", val_text)):
            got = _documents(store.document_rows(sp, 8, tok.vocab_size))
            if tok.eos_id is None:  # bytes: the split's text, cut where each document's text begins
                want = [b for b in begins if b < c] if sp == "train" else [0, *(b - c for b in begins if b > c + 2)]
                np.testing.assert_array_equal(np.cumsum([0, *map(len, got[:-1])]), want)
                assert tok.decode(np.concatenate(got)) == text
            else:  # each document (or its part in this split) framed by the EOS
                assert all(d[-1] == tok.eos_id and tok.eos_id not in d[:-1] for d in got)
                assert "\n\n".join(tok.decode(d[:-1]) for d in got) == text
                assert len(got) >= (np.sum(begins < c) if sp == "train" else np.sum(begins > c))


def test_packed_batches_and_eval_batches_gather_document_rows():
    rng = np.random.default_rng(6)
    lens = rng.integers(2, 40, 300)
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
    stream = np.arange(1, lens.sum() + 1, dtype=np.int32)
    rows = DocumentRows(plan_rows(starts, lens, 32), _reader(stream))
    batches = pipeline.PackedBatches(rows, 8, 0, slice(2, 6))
    ids = batches.row_ids(0)
    b = batches.next()
    want = rows[ids]
    assert set(b) == set(want) and all((b[k] == want[k]).all() and b[k].shape == (4, 32) for k in want)
    first = pipeline.eval_batches(rows, 4, 2)[1]
    assert all((first[k] == rows[np.arange(4, 8)][k]).all() for k in first)
