"""The token store: `python -m jaxpar.data.prepare` (streaming, sharded, resumable), training reads
(each process only its rows), mixtures, prefetching, and the errors of a bad store.

References are built independently: the expected token streams from the tokenizer applied to
documents read here with json / pyarrow and split by hand at the documented point; rows from
:func:`jaxpar.data.pipeline.pack` of that stream; mixture contents from token values that name their
store and row.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import config

from jaxpar.config import ConfigError
from jaxpar.data import prepare as prep
from jaxpar.data import store as st
from jaxpar.data.pipeline import PackedBatches, eval_batches, pack
from jaxpar.data.sources import Prefetched, TokenBatches, mix_quotas, parse_mix
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi".split()


def _sentences(rng, n) -> str:
    return "\n".join(" ".join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(n))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """a.jsonl (60 records), b.json (a list of 20), c.parquet (40 rows), d.txt (one long document that
    holds the validation split point)."""
    rng = np.random.default_rng(1)
    root = tmp_path_factory.mktemp("corpus")
    a = [_sentences(rng, 3) for _ in range(60)]
    (root / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(a)))
    b = [_sentences(rng, 2) for _ in range(20)]
    (root / "b.json").write_text(json.dumps([{"text": t} for t in b]))
    c = [_sentences(rng, 4) for _ in range(40)]
    pq.write_table(pa.table({"text": c, "n": list(range(40))}), root / "c.parquet", row_group_size=16)
    (root / "d.txt").write_text(_sentences(rng, 300) + "\n")
    return root


def _expected_docs(root: Path, val_fraction: float) -> tuple[list[str], list[str]]:
    """Train and validation documents, by the documented rule, with the text file d.txt (last) cut at
    the line boundary before the split point."""
    files = sorted(root.iterdir())
    total = sum(f.stat().st_size for f in files)
    target = total - int(round(val_fraction * total))
    base_d = total - (root / "d.txt").stat().st_size
    assert target > base_d, "the corpus is built so that d.txt holds the split point"
    a = [json.loads(line)["text"] for line in (root / "a.jsonl").read_text().splitlines()]
    b = [r["text"] for r in json.loads((root / "b.json").read_text())]
    c = pq.read_table(root / "c.parquet").column("text").to_pylist()
    d = (root / "d.txt").read_bytes()
    cut = d.rfind(b"\n", 0, target - base_d) + 1
    return a + b + c + [d[:cut].decode()], [d[cut:].decode()]


def _stream(tok, docs: list[str]) -> np.ndarray:
    if tok.eos_id is None:
        return tok.encode("\n\n".join(docs))
    return np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs]).astype(np.int32)


def _split_tokens(store: Path, split: str) -> np.ndarray:
    index = json.loads((store / "store.json").read_text())
    return np.concatenate([np.fromfile(store / s["file"], dtype=index["dtype"])
                           for s in index["splits"][split]["shards"]]).astype(np.int32)


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_prepare_streams_split_shards_and_rows_match_the_reference(tmp_path, corpus_dir, tokenizer):
    out = tmp_path / "store"
    opts = dict(tokenizer=tokenizer, vocab_size=300, val_fraction=0.05, shard_tokens=2000, batch_mb=0.002)
    summary = prep.prepare([str(corpus_dir)], out, log=lambda *_: None, **opts)
    tok = ByteTokenizer() if tokenizer == "byte" else BPETokenizer.load(out / "tokenizer.json")
    assert tok.vocab_size == (256 if tokenizer == "byte" else 300)
    train_docs, val_docs = _expected_docs(corpus_dir, 0.05)
    train, val = _stream(tok, train_docs), _stream(tok, val_docs)
    np.testing.assert_array_equal(_split_tokens(out, "train"), train)
    np.testing.assert_array_equal(_split_tokens(out, "val"), val)
    assert (summary["documents"], summary["train_tokens"], summary["val_tokens"]) == (122, len(train), len(val))

    index = json.loads((out / "store.json").read_text())
    shards = index["splits"]["train"]["shards"]
    assert len(shards) >= 3 and all(s["tokens"] >= 2000 for s in shards[:-1])
    for s in shards[:-1]:  # shards close between documents
        last = np.fromfile(out / s["file"], dtype=index["dtype"])[-1]
        assert tokenizer == "byte" or last == tok.eos_id

    store = st.TokenStore(out)
    rows = store.rows("train", 24, 300)
    ref = pack(train, 24)
    assert rows.shape == ref.shape
    ids = np.random.default_rng(0).permutation(len(ref))
    np.testing.assert_array_equal(rows[ids], ref[ids])  # rows straddling shard boundaries included
    np.testing.assert_array_equal(rows[3], ref[3])
    assert rows.tokens_read == (len(ref) + 1) * 25
    assert not store.verify()


def test_prepare_resumes_after_an_interruption_to_the_same_store(tmp_path, corpus_dir, monkeypatch, capsys):
    args = [str(corpus_dir / "*.jsonl"), str(corpus_dir / "c.parquet"), str(corpus_dir / "d.txt"), "--tokenizer", "byte",
            "--shard-tokens", "3000", "--batch-mb", "0.001", "--val-fraction", "0.1"]
    assert prep.main([*args, "--out", str(tmp_path / "whole")]) == 0
    closes = []
    real_close = st.ShardWriter.close_shard

    def interrupted_close(self):
        closes.append(1)
        if len(closes) == 4:
            raise KeyboardInterrupt
        return real_close(self)

    monkeypatch.setattr(st.ShardWriter, "close_shard", interrupted_close)
    assert prep.main([*args, "--out", str(tmp_path / "cut")]) == 130
    assert "run the same command again to continue" in capsys.readouterr().err
    assert not (tmp_path / "cut" / "store.json").exists()
    with pytest.raises(ConfigError, match="unfinished token store"):
        st.TokenStore(tmp_path / "cut")
    monkeypatch.setattr(st.ShardWriter, "close_shard", real_close)
    assert prep.main([*args, "--out", str(tmp_path / "cut")]) == 0
    assert "resuming" in capsys.readouterr().out
    whole, cut = (json.loads((tmp_path / d / "store.json").read_text()) for d in ("whole", "cut"))
    assert cut["splits"] == whole["splits"]  # every shard's size and SHA-256
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == sorted(p.name for p in (tmp_path / "whole").iterdir())


def _bad(capsys, argv) -> tuple[int, str]:
    try:
        rc = prep.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return rc, err


def test_prepare_cli_errors_are_one_line(tmp_path, corpus_dir, capsys):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x").write_text("x")
    assert "needs --vocab-size" in _bad(capsys, [str(corpus_dir), "--out", str(tmp_path / "s")])[1]
    assert "exists and is not a token store" in _bad(capsys, [str(corpus_dir), "--tokenizer", "byte",
                                                              "--out", str(tmp_path / "junk")])[1]
    assert "does not exist" in _bad(capsys, [str(tmp_path / "nope"), "--tokenizer", "byte", "--out", str(tmp_path / "s")])[1]
    assert "name the inputs" in _bad(capsys, ["--out", str(tmp_path / "s")])[1]
    (tmp_path / "one.txt").write_text("a single line")
    rc, err = _bad(capsys, [str(tmp_path / "one.txt"), "--tokenizer", "byte", "--out", str(tmp_path / "s")])
    assert rc == 2 and "the val split is empty" in err
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
    assert "no column 'text' (columns: body)" in _bad(capsys, [str(tmp_path / "p.parquet"), "--tokenizer", "byte",
                                                               "--out", str(tmp_path / "s2")])[1]


@pytest.fixture(scope="module")
def byte_store(tmp_path_factory, corpus_dir) -> Path:
    out = tmp_path_factory.mktemp("stores") / "byte"
    prep.prepare([str(corpus_dir)], out, tokenizer="byte", val_fraction=0.05, shard_tokens=4000, batch_mb=0.002,
                 log=lambda *_: None)
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_a_bad_store_is_one_clear_error(tmp_path, byte_store, capsys):
    with pytest.raises(ConfigError, match=r"data.path='.*nope' does not exist; make a token store there with"):
        st.TokenStore(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"is not a token store \(no store.json\); make one with"):
        st.TokenStore(tmp_path / "empty")
    bad = _copy(byte_store, tmp_path / "json")
    (bad / "store.json").write_text("{")
    with pytest.raises(ConfigError, match="store.json' is corrupt"):
        st.TokenStore(bad)
    cut = _copy(byte_store, tmp_path / "cut")
    (cut / "train-00001.bin").write_bytes((cut / "train-00001.bin").read_bytes()[:-7])
    with pytest.raises(ConfigError, match=r"shard train-00001.bin is corrupt \(.* bytes, the index says"):
        st.TokenStore(cut)
    (cut / "train-00001.bin").unlink()
    with pytest.raises(ConfigError, match="shard train-00001.bin is missing"):
        st.TokenStore(cut)

    store = st.TokenStore(byte_store)
    with pytest.raises(ConfigError, match=r"the token store of data.path=.* holds ids up to 255 .* model.vocab_size=200; set model.vocab_size >= 256"):
        store.check_vocab(200)
    with pytest.raises(ConfigError, match=r"model.vocab_size=1024 is more than twice what the tokenizer yields \(256 ids, data.path="):
        store.check_vocab(1024)

    flipped = _copy(byte_store, tmp_path / "flip")  # bit rot: same size, an id beyond the vocabulary
    raw = bytearray((flipped / "train-00000.bin").read_bytes())
    raw[10:12] = (40000).to_bytes(2, "little")
    (flipped / "train-00000.bin").write_bytes(bytes(raw))
    rows = st.TokenStore(flipped).rows("train", 16, 256)
    rows[[5]]
    with pytest.raises(ConfigError, match=r"shard train-00000.bin is corrupt \(token id 40000 >= model.vocab_size=256"):
        rows[[0]]
    rc, err = _bad(capsys, ["--verify", "--out", str(flipped)])
    assert rc == 1 and "train-00000.bin do not match their checksum" in err


def _cfg(**over):
    return config("gpt2", **{"model__vocab_size": 256, "model__seq_len": 16, "train__batch_size": 8,
                             "data__source": "tokens", **over})


def test_each_process_gathers_only_its_rows_and_the_shares_make_the_batch(byte_store):
    cfg = _cfg(data__path=str(byte_store))
    ref_rows = pack(_split_tokens(byte_store, "train"), 16)
    ref = PackedBatches(ref_rows, 8, cfg.train.seed)  # the in-memory pipeline over the same stream
    procs = [TokenBatches(cfg, slice(0, 4), log=lambda *_: None), TokenBatches(cfg, slice(4, 8), log=lambda *_: None)]
    read_at_start = [p.train_rows[0].tokens_read for p in procs]
    assert read_at_start == [0, 0]  # opening reads no training row
    for step in range(ref.steps_per_epoch + 3):  # into the second epoch
        want = ref.next()
        got = [p.next() for p in procs]
        for k in want:
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[k])
    for p in procs:  # each gathered only its 4 rows of each batch
        assert p.train_rows[0].tokens_read == (ref.steps_per_epoch + 3) * 4 * 17
    val_ref = eval_batches(pack(_split_tokens(byte_store, "val"), 16), 8, cfg.train.eval_batches)
    np.testing.assert_array_equal(procs[1].val[0]["inputs"], val_ref[0]["inputs"][4:])


def _numbered_store(root: Path, first: int, n: int, n_ids: int = 60000) -> Path:
    """A store whose train stream is first, first+1, ... (each row names itself by its first token)."""
    root.mkdir(parents=True)
    splits = {}
    for split, start in (("train", first), ("val", first + n)):
        w = st.ShardWriter(root, split, st.dtype_for(n_ids), 700)
        for chunk in np.array_split(np.arange(start, start + n), 4):
            w.write(chunk)
            if w.full():
                w.close_shard()
        w.close_shard()
        splits[split] = {"shards": w.shards, "documents": 1, "tokens": n}
    st.write_index(root, st.dtype_for(n_ids), {"kind": "byte", "vocab_size": n_ids, "eos_id": None}, splits, {})
    return root


def test_mixture_quotas_interleave_epochs_resume_and_process_shares(tmp_path):
    a, b = _numbered_store(tmp_path / "a", 0, 2001), _numbered_store(tmp_path / "b", 30000, 801)
    assert parse_mix(f"{a}:7,{b}:3") == [(str(a), 7.0), (str(b), 3.0)]
    assert mix_quotas([0.7, 0.3], 10) == [7, 3] and mix_quotas([1, 1, 1], 8) == [3, 3, 2]
    cfg = _cfg(data__mix=f"{a}:0.7,{b}:0.3", train__batch_size=10, model__vocab_size=60000)
    whole = TokenBatches(cfg, slice(None), log=lambda *_: None)
    halves = [TokenBatches(cfg, s, log=lambda *_: None) for s in (slice(0, 5), slice(5, 10))]
    steps_b = (800 // 16) // 3  # store b's epoch: 50 rows in batches of 3
    seen_b, layout = [], None
    for step in range(steps_b + 2):
        x = whole.next()["inputs"]
        first = x[:, 0]
        from_a = first < 30000
        assert from_a.sum() == 7
        layout = from_a if layout is None else layout
        np.testing.assert_array_equal(from_a, layout)  # the same slots every batch
        assert (x[:, 1] - x[:, 0] == 1).all() and (first % 16 == 0).all()  # whole rows of one store
        if step < steps_b:
            seen_b += ((first[~from_a] - 30000) // 16).tolist()
        shares = [h.next()["inputs"] for h in halves]
        np.testing.assert_array_equal(np.concatenate(shares), x)
    # By hand: slot j goes to the store furthest behind q_k * (j + 1) / 10 (ties: the first): a b a a a b a a b a.
    assert layout.tolist() == [True, False, True, True, True, False, True, True, False, True]
    assert sorted(seen_b) == sorted(set(seen_b)) and len(seen_b) == steps_b * 3  # no row twice in an epoch

    state = json.loads(json.dumps(whole.state()))  # through a checkpoint's JSON
    after = [whole.next()["inputs"] for _ in range(3)]
    resumed = TokenBatches(cfg, slice(5, 10), log=lambda *_: None)
    resumed.restore(state)
    for want in after:
        np.testing.assert_array_equal(resumed.next()["inputs"], want[5:])
    other = TokenBatches(_cfg(data__mix=f"{a}:0.5,{b}:0.5", train__batch_size=10, model__vocab_size=60000),
                         slice(None), log=lambda *_: None)
    with pytest.raises(ConfigError, match="saved with the mixture"):
        other.restore(state)
    val = whole.val[0]["inputs"][:, 0]
    np.testing.assert_array_equal(val[layout], np.arange(7) * 16 + 2001)  # store a's first validation rows
    with pytest.raises(ConfigError, match="a store would get no row"):
        TokenBatches(_cfg(data__mix=f"{a}:0.99,{b}:0.01", train__batch_size=10, model__vocab_size=60000), slice(None))
    with pytest.raises(ConfigError, match="each entry is PATH:WEIGHT"):
        parse_mix(f"{a}:0.5,{b}")


def test_prefetched_batches_are_the_in_loop_batches_across_a_restore(byte_store):
    cfg = _cfg(data__path=str(byte_store))
    plain = TokenBatches(cfg, slice(2, 6), log=lambda *_: None)
    fetched = Prefetched(TokenBatches(cfg, slice(2, 6), log=lambda *_: None), depth=3)
    want = [plain.next() for _ in range(8)]
    got = [fetched.next() for _ in range(5)]
    state = fetched.state()
    got += [fetched.next() for _ in range(3)]
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w["targets"], g["targets"])
    fetched.restore(state)
    np.testing.assert_array_equal(fetched.next()["inputs"], want[5]["inputs"])
    fetched.close()
