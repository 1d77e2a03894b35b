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


def recompute(t, params, prompt: list[int], n: int, seq_len: int | None = None) -> list[int]:
    """Greedy decoding by the model's full forward pass over the window (``seq_len``, default model.seq_len)
    for each token (the window slides as the generator's: when full, the last seq_len // 2 tokens are kept)."""
    seq_len, vocab = seq_len or t.cfg.model.seq_len, t.cfg.model.vocab_size
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
    # ... at temperatures other than 1 too: softmax(logits / T) in float64 numpy (T = 2 flattens, T = 0.5 sharpens)
    row = np.asarray(logits[0], np.float64) / 3
    for temp in (2.0, 0.5):
        counts = np.bincount(np.asarray(pick(one, jax.random.key(7), Sampling(temp))), minlength=50) / 4000
        want = np.exp(row / temp - (row / temp).max())
        np.testing.assert_allclose(counts, want / want.sum(), atol=0.03, err_msg=f"temperature {temp}")
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


def test_chunked_generation_gives_the_same_tokens_and_reports_progress():
    """Decoding in compiled calls of 3 steps (progress between them) draws the tokens of one call per
    segment: sampled rows equal token for token (the same key per step), greedy rows equal recomputing the
    window; the progress calls count the steps, 3 at a time within each segment, up to the request."""
    t, params = _setup("gpt2")
    warm = Sampling(temperature=1.0)
    calls = []
    chunked = Generator(t.adapter.model, chunk=3)
    got = chunked(params, PROMPTS, 12, warm, seed=5, progress=lambda done, total: calls.append((done, total)))
    assert got == Generator(t.adapter.model)(params, PROMPTS, 12, warm, seed=5)
    # segment 1: the longest prompt (7) fills the window of 16 in 9 steps (3 calls); segment 2: 3 steps
    assert calls == [(3, 12), (6, 12), (9, 12), (12, 12)]
    greedy = Generator(t.adapter.model, chunk=4)(params, PROMPTS[:1], 15, GREEDY)
    assert greedy == [recompute(t, params, PROMPTS[0], 15)]


def test_a_request_is_checked_before_anything_is_compiled(monkeypatch):
    """Ids the model does not have, a vocabulary beyond the model's, a non-integer count, and a KV cache
    that the devices' free memory cannot hold: each a ConfigError naming it, with nothing compiled."""
    import jaxpar.generate as g

    t, params = _setup("gpt2")
    gen = for_trainer(t)
    for args, needle in [(([[1, 250]], 3), "prompt 0 has the id 250, not one of the model's ids 0..249"),
                         (([[1, -1]], 3), "prompt 0 has the id -1"),
                         (([[1]], 2.5), "n_tokens=2.5 must be an integer >= 0"),
                         (([[1]], -1), "n_tokens=-1 must be an integer >= 0")]:
        with pytest.raises(ConfigError, match=needle):
            gen(params, *args, GREEDY)
    with pytest.raises(ConfigError, match="vocab=251: draw from 1..model.vocab_size=250 ids"):
        gen(params, [[1]], 3, GREEDY, vocab=251)
    with pytest.raises(ConfigError, match="chunk=0"):
        Generator(t.adapter.model, chunk=0)
    # the cache by hand: 2 layers x (K and V) x 3 rows x 16 positions x 8 kv heads x 8 dims x 4 bytes (float32);
    # the prefill's logits: 3 rows x 7 positions x 256 padded ids x 4 bytes (one device, no split)
    model = t.adapter.model(params)
    assert model.dtype == jnp.float32 and model.cfg.n_kv_heads == 8 and model.cfg.head_dim == 8
    cache, logits = 2 * 2 * 3 * 16 * 8 * 8 * 4, 3 * 7 * 256 * 4
    need = gen.check(params, PROMPTS, 5)
    assert (need["cache"], need["logits"], need["window"]) == (cache, logits, 16)
    monkeypatch.setattr(g, "free_memory", lambda devices: (cache, "the test's device has 1 KiB free"))
    with pytest.raises(ConfigError) as e:
        gen(params, PROMPTS, 10**8, GREEDY)
    assert str(e.value).startswith("generating for 3 prompt(s) needs 69.0 KiB per device (the KV cache of 3 rows x "
                                   "16 positions x 2 layers: 48.0 KiB; the prompts' float32 logits: 21.0 KiB) and the "
                                   "test's device has 1 KiB free; give fewer prompts")
    assert gen._fns == {}
    one, one_params = _setup("gpt2", model__seq_len=1)  # a window of one position has no room for a new token
    with pytest.raises(ConfigError, match="attends to 1 position"):
        for_trainer(one)(one_params, [[1]], 1, GREEDY)


def test_learned_positions_generate_over_the_whole_position_table():
    """model.max_positions=16 rows of learned positions, trained context model.seq_len=8: the cache holds
    the 16 positions the model can attend to; greedy tokens equal recomputing a window of 16 (sliding past it)."""
    t, params = _setup("gpt2", model__seq_len=8, model__max_positions=16)
    gen = for_trainer(t)
    assert gen.check(params, PROMPTS, 20)["window"] == 16
    assert gen(params, PROMPTS[1:2], 20, GREEDY) == [recompute(t, params, PROMPTS[1], 20, seq_len=16)]
