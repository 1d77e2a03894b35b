"""Decode time per token: KV-cache generation (jaxpar.generate) against recomputing the context window for
every token with a host round trip per token (the end-of-run sample loop before the cache).

    python benchmarks/generate.py                      # GPT-2 style, 4 layers, d_model 256, 256 tokens of context
    python benchmarks/generate.py --context 512 --json out.json

Both decode greedily from the same prompt of ``--context`` tokens on one device; each is compiled (and
run once) before it is timed. The cached time per token is ``(t(n + 1 tokens) - t(1 token)) / n``: the
decode steps without the prompt's prefill. The recomputation runs the model on the whole window (the
model's ``seq_len``, the prompt's tokens plus padding, as the old loop did) for each token.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jaxpar.cli import ArgumentParser  # noqa: E402


def main(argv=None) -> int:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed decode steps")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=3, help="timings per measurement (the best is kept)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    for name in ("layers", "d_model", "heads", "vocab", "context", "tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.config import load_config
    from jaxpar.generate import Sampling, for_trainer
    from jaxpar.mesh import make_mesh
    from jaxpar.trainer import Trainer

    seq_len = a.context + a.tokens + 1
    cfg = load_config(None, {"model.style": "gpt2", "model.n_layers": a.layers, "model.d_model": a.d_model,
                             "model.n_heads": a.heads, "model.vocab_size": a.vocab, "model.seq_len": seq_len,
                             "train.batch_size": 1, "train.out_dir": "/tmp/jaxpar-bench-generate"})
    t = Trainer(cfg, mesh=make_mesh(cfg.parallel, jax.devices()[:1]))
    params = t.init_state()["params"]
    prompt = [int(i) for i in np.random.default_rng(0).integers(0, a.vocab, a.context)]
    greedy = Sampling(temperature=0)

    def best(fn) -> float:
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    # KV cache: one prefill + n decode steps in one program
    gen = for_trainer(t)
    for n in (1, a.tokens + 1):
        gen(params, [prompt], n, greedy)  # compile
    one = best(lambda: gen(params, [prompt], 1, greedy))
    many = best(lambda: gen(params, [prompt], a.tokens + 1, greedy))
    cached = (many - one) / a.tokens

    # recomputation: the model over the whole (padded) window per token, the next token picked on the host
    logits_at = jax.jit(lambda p, buf, pos: jax.lax.dynamic_index_in_dim(t.adapter.model(p)(buf), pos, axis=1,
                                                                          keepdims=False)[:, :a.vocab])

    def recompute(n: int) -> list[int]:
        seq, out = list(prompt), []
        for _ in range(n):
            buf = np.zeros((1, seq_len), np.int32)
            buf[0, :len(seq)] = seq
            tok = int(np.argmax(np.asarray(logits_at(params, jnp.asarray(buf), len(seq) - 1))[0]))
            out.append(tok)
            seq.append(tok)
        return out

    recompute(1)  # compile
    slow = best(lambda: recompute(a.tokens)) / a.tokens
    same = gen(params, [prompt], a.tokens, greedy)[0] == recompute(a.tokens)
    r = {"layers": a.layers, "d_model": a.d_model, "context": a.context, "tokens": a.tokens, "window": seq_len,
         "params": t.param_count(), "platform": jax.devices()[0].platform,
         "cached_s_per_token": cached, "recompute_s_per_token": slow, "speedup": slow / cached,
         "prefill_and_one_token_s": one, "same_greedy_tokens": same}
    print(f"{r['platform']}, {a.layers} layers, d_model {a.d_model}, {r['params']:,} parameters, {a.context} "
          f"tokens of context:\n  KV cache      {cached * 1e3:8.2f} ms/token (prefill + 1 token: {one * 1e3:.1f} ms)\n"
          f"  recompute     {slow * 1e3:8.2f} ms/token (window of {seq_len}, host round trip per token)\n"
          f"  speedup       {slow / cached:8.1f}x; the same greedy tokens: {same}")
    if a.json:
        a.json.write_text(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
