"""Data at scale: prepare a synthetic corpus into a token store, then load it as two processes would.

    python benchmarks/data.py [--tokens 200e6] [--files 16] [--workdir /tmp/jaxpar-data-bench] [--json out.json]

1. **Corpus.** Generates ``--files`` JSONL files of Zipf-distributed words (about 5.35 characters
   per BPE token; sized at 5.5 so that it holds at least ``--tokens`` tokens), in ``--workdir``
   (replaced on each run).
2. **Prepare.** Runs ``python -m jaxpar.data.prepare`` on it in a subprocess (a byte-level BPE of
   8,192 ids trained on ``--bpe-sample-mb`` of text), and reports its wall time, tokens/s, MB/s
   and peak resident memory (``ru_maxrss`` of the child).
3. **Load.** Two subprocesses open the store with the default model's batch (32 rows of 128 + 1
   tokens, ``train.batch_size`` / ``model.seq_len`` of ``configs/default.yaml``) and row shares
   0:16 and 16:32, as the two processes of a run: seconds from opening to the first batch, tokens
   each one read (only its rows), and host seconds per batch gathered in the loop (no prefetch).
4. **Step.** The default model's CPU train step (``train.py`` on the default config with the
   synthetic source, ``--step-steps`` steps, median ``step_time``), to which the gather time compares.

Prints a table and one JSON object (also written to ``--json``).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOAD = r"""
import json, sys, time
t0 = time.perf_counter()
from jaxpar.config import load_config
from jaxpar.data.sources import TokenBatches
store, lo, hi, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = load_config(sys.argv[5], ["data.source=tokens", f"data.path={store}", "model.vocab_size=8192"])
t_import = time.perf_counter()
src = TokenBatches(cfg, slice(lo, hi), log=lambda *_: None)
src.next()
t_first = time.perf_counter()
t = time.perf_counter()
for _ in range(n):
    src.next()
per_batch = (time.perf_counter() - t) / n
rows = src.train_rows[0]
print(json.dumps({"start_s": t_first - t_import, "import_s": t_import - t0, "gather_s_per_batch": per_batch,
                  "tokens_read": rows.tokens_read, "batches": n + 1, "rows_per_batch": hi - lo,
                  "row_tokens": rows.shape[1], "store_rows": rows.shape[0]}))
"""


def make_corpus(root: Path, tokens: float, files: int, seed: int = 0) -> int:
    """JSONL files of documents of Zipf-distributed made-up words; returns the bytes written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vocab = ["".join(chr(97 + c) for c in rng.integers(0, 26, rng.integers(2, 10))) for _ in range(20000)]
    vocab = np.array(vocab)
    target = int(tokens * 5.5)  # characters: this text has ~5.35 characters per token of an 8k BPE
    per_file, written = target // files, 0
    root.mkdir(parents=True)
    for i in range(files):
        with open(root / f"part-{i:04d}.jsonl", "w") as f:
            n = 0
            while n < per_file:
                words = vocab[(rng.zipf(1.2, 40000) - 1) % len(vocab)]
                lens = rng.integers(50, 400, 200)
                parts = np.split(words, np.cumsum(lens)[np.cumsum(lens) < len(words)])
                lines = "".join(json.dumps({"text": " ".join(p)}) + "\n" for p in parts if len(p))
                f.write(lines)
                n += len(lines)
            written += n
    return written


def main(argv=None) -> int:
    from jaxpar.cli import ArgumentParser

    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=200e6, help="approximate corpus size in tokens")
    ap.add_argument("--files", type=int, default=16, help="JSONL files of the corpus")
    ap.add_argument("--bpe-sample-mb", type=float, default=64.0, help="text the BPE is trained on")
    ap.add_argument("--batches", type=int, default=200, help="batches gathered to time the loop")
    ap.add_argument("--step-steps", type=int, default=8, help="steps of train.py for the CPU step time")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxpar-data-bench"))
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args(argv)
    if args.tokens < 1e5 or args.files < 1 or args.batches < 1 or args.step_steps < 2:
        ap.error("--tokens must be >= 1e5, --files and --batches >= 1, --step-steps >= 2")
    work = Path(args.workdir)
    if work.exists():
        if not (work / ".jaxpar-data-bench").is_file():
            ap.error(f"--workdir={work} exists and is not this benchmark's folder; choose a new one")
        shutil.rmtree(work)
    work.mkdir(parents=True)
    (work / ".jaxpar-data-bench").touch()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = env.get("JAX_PLATFORMS", "cpu")

    t = time.perf_counter()
    text_bytes = make_corpus(work / "corpus", args.tokens, args.files)
    gen_s = time.perf_counter() - t

    store = work / "store"
    val_fraction = max(0.005, min(0.5, 4 * 32 * 129 / args.tokens))  # at least 4 validation batches
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "jaxpar.data.prepare", str(work / "corpus"), "--out", str(store),
                        "--vocab-size", "8192", "--bpe-sample-mb", str(args.bpe_sample_mb),
                        "--val-fraction", str(val_fraction)],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    prep_s = time.perf_counter() - t
    if p.returncode:
        print(p.stdout + p.stderr, file=sys.stderr)
        return 1
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    index = json.loads((store / "store.json").read_text())
    tokens = sum(index["splits"][s]["tokens"] for s in ("train", "val"))

    default = str(ROOT / "configs" / "default.yaml")
    loads = [subprocess.Popen([sys.executable, "-c", LOAD, str(store), str(lo), str(hi), str(args.batches), default],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env) for lo, hi in ((0, 16), (16, 32))]
    outs = [q.communicate()[0] for q in loads]
    if any(q.returncode for q in loads):
        print("\n".join(outs), file=sys.stderr)
        return 1
    procs = [json.loads(o.strip().splitlines()[-1]) for o in outs]

    out = work / "step-run"
    q = subprocess.run([sys.executable, str(ROOT / "train.py"), "data.source=synthetic",
                        f"train.steps={args.step_steps}", "train.log_every=1", "train.eval_every=0", "sample.tokens=0",
                        "checkpoint.every=0", f"train.out_dir={out}"],
                       capture_output=True, text=True, cwd=ROOT, env=env)
    if q.returncode:
        print(q.stdout[-3000:] + q.stderr[-3000:], file=sys.stderr)
        return 1
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(r["step_time"] for r in recs[1:])

    gather = max(pr["gather_s_per_batch"] for pr in procs)
    result = {
        "corpus_text_bytes": text_bytes, "corpus_generate_s": round(gen_s, 2), "tokens": tokens,
        "documents": sum(index["splits"][s]["documents"] for s in ("train", "val")),
        "shards": sum(len(index["splits"][s]["shards"]) for s in ("train", "val")),
        "prepare_s": round(prep_s, 2), "prepare_tokens_per_s": round(tokens / prep_s),
        "prepare_text_mb_per_s": round(text_bytes / prep_s / 1e6, 2), "prepare_peak_rss_bytes": peak_rss,
        "load_start_s": [round(pr["start_s"], 4) for pr in procs],
        "load_tokens_read": [pr["tokens_read"] for pr in procs],
        "load_tokens_expected": [pr["batches"] * pr["rows_per_batch"] * pr["row_tokens"] for pr in procs],
        "gather_s_per_batch": gather, "load_tokens_per_s": round(16 * procs[0]["row_tokens"] / gather),
        "cpu_step_s": step_s, "gather_share_of_step": gather / step_s,
    }
    print(f"prepare: {tokens / 1e6:,.1f} M tokens ({text_bytes / 1e6:,.0f} MB of JSONL) in {prep_s:.1f}s = "
          f"{result['prepare_tokens_per_s']:,} tokens/s, peak RSS {peak_rss / 2**20:,.0f} MiB")
    print(f"load (2 processes): start {result['load_start_s']} s; tokens read {result['load_tokens_read']} "
          f"(only their rows: {result['load_tokens_expected']}); {gather * 1e6:,.0f} us per batch = "
          f"{result['load_tokens_per_s']:,} tokens/s per process")
    print(f"default model CPU step {step_s:.3f}s: gathering a batch is {100 * gather / step_s:.3f}% of it")
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
