"""jaxpar.layers against float64 numpy formulas, and a user's own model built from them."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import load_config
from jaxpar.layers import (MLP, Attention, ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear,
                           VocabParallelEmbed, causal_attention, rope, vocab_parallel_cross_entropy)
from jaxpar.mesh import make_mesh
from jaxpar.partitioning import make_rules, use_rules
from jaxpar.trainer import ModelAdapter


def test_cross_entropy_matches_numpy_and_masks_padding():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 16)) * 3
    targets = rng.integers(0, 10, size=(3, 5))
    got = vocab_parallel_cross_entropy(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), vocab_size=10)
    real = logits[..., :10]
    lse = np.log(np.exp(real - real.max(-1, keepdims=True)).sum(-1)) + real.max(-1)
    want = lse - np.take_along_axis(real, targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


def test_causal_gqa_attention_matches_numpy():
    rng = np.random.default_rng(1)
    b, t, h, kv, d = 2, 7, 6, 2, 4
    q, k, v = rng.normal(size=(b, t, h, d)), rng.normal(size=(b, t, kv, d)), rng.normal(size=(b, t, kv, d))
    got = np.asarray(causal_attention(*(jnp.asarray(x, jnp.float32) for x in (q, k, v))))
    want = np.zeros_like(q)
    for hi in range(h):
        kh = hi // (h // kv)  # query head hi uses KV head hi // group
        for i in range(t):
            s = np.einsum("bd,bjd->bj", q[:, i, hi], k[:, : i + 1, kh]) / np.sqrt(d)
            p = np.exp(s - s.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            want[:, i, hi] = np.einsum("bj,bjd->bd", p, v[:, : i + 1, kh])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rope_is_a_rotation_by_relative_position():
    rng = np.random.default_rng(2)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))
    def dot(m, n):
        return float(jnp.sum(rope(q, jnp.array([m])) * rope(k, jnp.array([n]))))
    assert abs(dot(5, 3) - dot(12, 10)) < 1e-5 and abs(dot(0, 0) - float(jnp.sum(q * k))) < 1e-6
    np.testing.assert_allclose(float(jnp.linalg.norm(rope(q, jnp.array([7])))), float(jnp.linalg.norm(q)), rtol=1e-6)


def test_norms_match_numpy():
    x = np.random.default_rng(3).normal(size=(4, 10)) * 5 + 2
    ln = LayerNorm(10, eps=1e-5)
    want = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(ln(jnp.asarray(x, jnp.float32))), want, rtol=1e-5, atol=1e-5)
    rms = RMSNorm(10, eps=1e-5)
    np.testing.assert_allclose(np.asarray(rms(jnp.asarray(x, jnp.float32))),
                               x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-5), rtol=1e-5)


class MyModel(nnx.Module):
    """A user's own model (not a jaxpar model): embedding, a GQA attention, a parallel MLP, a
    hand-made column/row pair and a vocab-parallel loss."""

    def __init__(self, rngs):
        self.embed = VocabParallelEmbed(100, 32, vocab_multiple=8, rngs=rngs)
        self.norm = RMSNorm(32)
        self.attn = Attention(32, 4, 2, 8, rope_theta=10000.0, use_bias=False, rngs=rngs)
        self.mlp = MLP(32, 64, kind="swiglu", use_bias=False, rngs=rngs)
        self.up = ColumnParallelLinear(32, 16, rngs=rngs)
        self.down = RowParallelLinear(16, 32, rngs=rngs)

    def __call__(self, ids, targets):
        x = self.embed(ids)
        x = x + self.attn(self.norm(x))
        x = x + self.mlp(x) + self.down(jax.nn.relu(self.up(x)))
        return jnp.mean(vocab_parallel_cross_entropy(self.embed.attend(x), targets, 100))


def test_custom_model_from_layers_is_mesh_independent():
    adapter = ModelAdapter(lambda: MyModel(nnx.Rngs(0)))
    ids = np.random.default_rng(4).integers(0, 100, size=(4, 12)).astype(np.int32)
    params = adapter.params_of(MyModel(nnx.Rngs(0)))

    def loss(p, ids):
        return adapter.model(p)(ids[:, :-1], ids[:, 1:])

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(params, ids)
    par = load_config(None, ["parallel.data=2", "parallel.tensor=2"]).parallel
    mesh = make_mesh(par, jax.devices()[:4])
    rules = make_rules(par, mesh)
    shard = jax.tree.map(lambda a, ax: rules.params.sharding(ax, a.shape), adapter.abstract, adapter.axes)

    def sharded_loss(p, ids):
        with use_rules(rules):
            return loss(p, ids)

    p = jax.device_put(params, shard)
    got_loss, got_grads = jax.jit(jax.value_and_grad(sharded_loss))(p, jax.device_put(ids, rules.params.sharding(("batch", None))))
    assert p["embed"]["embedding"].sharding.spec == rules.params.spec(("vocab", "embed"))
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)
