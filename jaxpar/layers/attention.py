"""Causal self-attention (MHA and GQA; RoPE or external positions) with heads split over ``tensor``.

Q projects ``embed -> (heads, head_dim)`` and K, V ``embed -> (kv_heads, head_dim)`` with
column-parallel kernels; the output projection ``(heads, head_dim) -> embed`` is row-parallel, so
the block costs one all-reduce forward under tensor parallelism. With GQA the ``heads`` are
grouped ``[kv_heads, group]`` so that each device keeps whole groups and K/V are never copied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from jaxpar.partitioning import constrain


def rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary embedding (rotate-half layout, as Llama): ``x [B, T, H, D]``, ``positions [T]`` or ``[B, T]``."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    ang = positions.astype(jnp.float32)[..., None] * inv  # [.., T, D/2]
    if ang.ndim == 2:
        ang = ang[None]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array | None = None,
                     k_pos: jax.Array | None = None) -> jax.Array:
    """Softmax attention with a causal mask on global positions (float32 softmax).

    ``q [B, T, H, D]``, ``k, v [B, S, KV, D]`` with ``H % KV == 0``; positions default to
    ``arange``. Returns ``[B, T, H, D]``.
    """
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = h // kv
    q_pos = jnp.arange(t) if q_pos is None else q_pos
    k_pos = jnp.arange(s) if k_pos is None else k_pos
    qg = q.reshape(b, t, kv, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k).astype(jnp.float32) / jnp.sqrt(jnp.float32(d))
    mask = q_pos[:, None] >= k_pos[None, :]
    scores = jnp.where(mask, scores, -1e30)
    p = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v)
    return out.reshape(b, t, h, d)


class Attention(nnx.Module):
    """Multi-head / grouped-query causal self-attention."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, use_bias: bool = True,
                 rope_theta: float | None = None, init_std: float = 0.02, out_init_std: float | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                  kernel_init=nnx.initializers.normal(init_std))
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q = ColumnParallelLinear(d_model, (n_heads, head_dim), out_axes=("heads", "head_dim"),
                                      act_axes=("batch", "length", "act_heads", "act_head_dim"), **kw)
        kv_axes = dict(out_axes=("kv_heads", "head_dim"), act_axes=("batch", "length", "act_kv_heads", "act_head_dim"))
        # No key bias: it adds q.b_k to every score of a query, which softmax ignores. Its gradient is
        # exactly zero in exact arithmetic, and Adam would turn the round-off left in it into steps.
        self.k = ColumnParallelLinear(d_model, (n_kv_heads, head_dim), **kv_axes, **{**kw, "use_bias": False})
        self.v = ColumnParallelLinear(d_model, (n_kv_heads, head_dim), **kv_axes, **kw)
        kw["kernel_init"] = nnx.initializers.normal(out_init_std or init_std)
        self.o = RowParallelLinear((n_heads, head_dim), d_model, in_axes=("heads", "head_dim"), **kw)

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        t = x.shape[1]
        positions = jnp.arange(t) if positions is None else positions
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.rope_theta is not None:
            q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        out = causal_attention(q, k, v)
        out = constrain(out, ("batch", "length", "act_heads", "act_head_dim"))
        return self.o(out)
