"""KV-cache generation (jaxpar.generate) against recomputing the whole context for every token (the
model's own forward pass, no cache): greedy tokens equal for GPT-2 style, Llama style (GQA) and the MoE
decoder, for prompts of different lengths, past the context window (sliding), and on meshes (expert x
tensor, pipe x data x tensor with Megatron-SP) against one device; the sampling rules and stop tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import config, trainer
from jaxpar.config import ConfigError
from jaxpar.generate import Generator, Sampling, for_trainer, pick

PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 6], [11]]
GREEDY = Sampling(temperature=0)
# larger initial weights than training's, so the random model's logits are far apart (no near-ties)
WIDE = dict(model__init_std=0.3)
MOE = dict(model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__d_ff=64, moe__dropless=True,
           moe__dispatch="sorted")


def recompute(t, params, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by the model's full forward pass over the window for each token (the window
    slides as the generator's: when full, the last seq_len // 2 tokens are kept)."""
    seq_len, vocab = t.cfg.model.seq_len, t.cfg.model.vocab_size
    fn = jax.jit(lambda p, toks: t.adapter.model(p)(toks))
    ctx, out = list(prompt), []
    for _ in range(n):
        if len(ctx) >= seq_len:
            ctx = ctx[-(seq_len // 2):]
        window = np.zeros((1, seq_len), np.int32)  # padded to one shape (causal: the padding is not seen)
        window[0, :len(ctx)] = ctx
        logits = np.asarray(fn(params, jnp.asarray(window)))[0, len(ctx) - 1, :vocab]
        out.append(int(np.argmax(logits)))
        ctx.append(out[-1])
    return out


def _setup(style, **over):
    t = trainer(config(style, **WIDE, **over))
    return t, t.init_state()["params"]


@pytest.mark.parametrize("style, over", [("gpt2", {}), ("llama_gqa", {}), ("llama_gqa", MOE)],
                         ids=["gpt2", "llama_gqa", "moe"])
def test_cached_greedy_equals_recomputation_for_prompts_of_different_lengths(style, over):
    """Greedy decoding with the cache gives the tokens of recomputing the window every token, per row,
    for 20 tokens from prompts of 3, 7 and 1 tokens with seq_len 16 (so the windows slide)."""
    t, params = _setup(style, **over)
    got = for_trainer(t)(params, PROMPTS, 20, GREEDY)
    for prompt, row in zip(PROMPTS, got):
        assert row == recompute(t, params, prompt, 20)


@pytest.mark.parametrize("style, over, mesh", [
    ("llama_gqa", MOE, dict(parallel__expert=2, parallel__tensor=2)),
    ("gpt2", {}, dict(parallel__pipe=2, parallel__data=2, parallel__megatron_sp=True, parallel__tensor=2)),
], ids=["moe-expert2-tensor2", "gpt2-pipe2-data2-tensor2-sp"])
def test_generation_on_a_training_mesh_equals_one_device(style, over, mesh):
    """The same parameters on a training mesh (initialisation is mesh-independent) generate the
    one-device tokens; the prompts (4 rows) are split over the batch axes, the cache's kv-heads over
    tensor (checked on the compiled program's cache buffers)."""
    prompts = PROMPTS + [[2, 4]]
    t1, params1 = _setup(style, **over)
    want = for_trainer(t1)(params1, prompts, 9, GREEDY)  # one segment: 9 = seq_len - the longest prompt
    cfg = config(style, **WIDE, **over, **mesh)
    tm = trainer(cfg)
    gen = for_trainer(tm)
    params = tm.init_state()["params"]
    assert gen(params, prompts, 9, GREEDY) == want
    fn, rows = gen._fn(4, 7, 9, GREEDY, cfg.model.vocab_size)  # the first segment's program (prompt of 7)
    buf = jax.device_put(jnp.zeros((4, 7), jnp.int32), rows)
    hlo = fn.lower(params, buf, jnp.ones(4, jnp.int32), jax.random.key(0)).compile().as_text()
    kv, hd = cfg.model.resolved().n_kv_heads, cfg.model.resolved().head_dim
    local_kv = kv // 2  # split over tensor=2
    assert f",{cfg.model.seq_len},{local_kv},{hd}]" in hlo and f",{cfg.model.seq_len},{kv},{hd}]" not in hlo


def test_sampling_rules():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(64, 50)) * 3, jnp.float32)
    key = jax.random.key(1)
    best = np.asarray(jnp.argmax(logits, -1))
    # top-k 1 and a tiny top-p both reduce to the argmax, whatever the temperature
    assert np.array_equal(pick(logits, key, Sampling(temperature=2.0, top_k=1)), best)
    assert np.array_equal(pick(logits, key, Sampling(temperature=2.0, top_p=1e-6)), best)
    # top-k 5: every draw among the 5 largest; top-p 0.5: among the smallest set reaching 0.5
    top5 = np.argsort(-np.asarray(logits), -1)[:, :5]
    draws = np.stack([np.asarray(pick(logits, jax.random.key(s), Sampling(1.0, top_k=5))) for s in range(20)], 1)
    assert all(set(d) <= set(t) for d, t in zip(draws, top5))
    p = np.asarray(jax.nn.softmax(logits, -1), np.float64)
    order = np.argsort(-p, -1)
    csum = np.cumsum(np.take_along_axis(p, order, -1), -1)
    allowed = [set(o[: int(np.searchsorted(c, 0.5) + 1)]) for o, c in zip(order, csum)]
    draws = np.stack([np.asarray(pick(logits, jax.random.key(s), Sampling(1.0, top_p=0.5))) for s in range(20)], 1)
    assert all(set(d) <= a for d, a in zip(draws, allowed))
    # temperature draws follow the softmax: the empirical frequency of one row's tokens over 4000 draws
    one = jnp.broadcast_to(logits[:1] / 3, (4000, 50))
    counts = np.bincount(np.asarray(pick(one, key, Sampling(1.0))), minlength=50) / 4000
    np.testing.assert_allclose(counts, np.asarray(jax.nn.softmax(logits[0] / 3)), atol=0.03)
    for bad, needle in ((dict(temperature=-1), "temperature=-1"), (dict(top_k=-2), "top_k=-2"),
                        (dict(top_p=0.0), "top_p=0.0")):
        with pytest.raises(ConfigError, match=needle):
            Sampling(**bad)


def test_stop_tokens_end_a_row_and_seeds_are_reproducible():
    t, params = _setup("gpt2")
    gen = for_trainer(t)
    free = gen(params, PROMPTS, 10, GREEDY)
    stop = free[1][3]  # the 4th greedy token of row 1
    cut = gen(params, PROMPTS, 10, Sampling(temperature=0, stop=(stop,)))
    for f, c in zip(free, cut):
        n = f.index(stop) + 1 if stop in f else len(f)
        assert c == f[:n]  # cut after the first stop token, the rest unchanged
    warm = Sampling(temperature=1.0, top_k=20)
    assert gen(params, PROMPTS, 10, warm, seed=3) == gen(params, PROMPTS, 10, warm, seed=3)
    assert gen(params, PROMPTS, 10, warm, seed=3) != gen(params, PROMPTS, 10, warm, seed=4)
    with pytest.raises(ConfigError, match="at least one token"):
        gen(params, [[1], []], 3, GREEDY)


def test_generator_for_a_model_outside_the_trainer():
    """``Generator`` takes any ``params -> model`` builder of jaxpar's models (here: no mesh)."""
    t, params = _setup("llama_gqa")
    gen = Generator(t.adapter.model)
    assert gen(params, PROMPTS[:1], 5, GREEDY) == [recompute(t, params, PROMPTS[0], 5)]
