"""Causal self-attention (MHA and GQA; RoPE or external positions) with heads split over ``tensor``.

Q, K, V are projected by one column-parallel kernel split by KV heads; the output projection ``(heads, head_dim) -> embed`` is row-parallel, so
the block costs one all-reduce forward under tensor parallelism. With GQA the ``heads`` are
grouped ``[kv_heads, group]`` so that each device keeps whole groups and K/V are never copied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from jaxpar.partitioning import active_rules, constrain, constrain_weight, param


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
    """Multi-head / grouped-query causal self-attention.

    Q, K and V come from ONE column-parallel matmul whose kernel is laid out
    ``[embed, kv_heads, group + 2, head_dim]``: for each KV head, its ``group`` query heads, then
    its key, then its value. Splitting ``kv_heads`` over ``tensor`` keeps every group whole on one
    device, and a single matmul means a single all-reduce of the input gradient in the backward
    (three separate projections would cost three).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, use_bias: bool = True,
                 rope_theta: float | None = None, init_std: float = 0.02, out_init_std: float | None = None,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        self.rope_theta = rope_theta
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv = ColumnParallelLinear(d_model, (n_kv_heads, self.group + 2, head_dim),
                                        out_axes=("kv_heads", "fused", "head_dim"),
                                        act_axes=("batch", "length", "act_kv_heads", None, "act_head_dim"),
                                        use_bias=False, kernel_init=nnx.initializers.normal(init_std), **kw)
        # Biases of Q and V only: a key bias adds q.b_k to every score of a query, which softmax
        # ignores; its gradient is zero in exact arithmetic and Adam would turn round-off into steps.
        self.q_bias = param(jnp.zeros((n_heads, head_dim), param_dtype), ("heads", "head_dim")) if use_bias else None
        self.v_bias = param(jnp.zeros((n_kv_heads, head_dim), param_dtype), ("kv_heads", "head_dim")) if use_bias else None
        self.o = RowParallelLinear((n_heads, head_dim), d_model, in_axes=("heads", "head_dim"), use_bias=use_bias,
                                   kernel_init=nnx.initializers.normal(out_init_std or init_std), **kw)
        self.dtype = dtype

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``x [B, T, d]``; ``positions [T]``: global positions of the tokens (they may be permuted,
        e.g. zig-zag ordered for ring attention). With ``seq`` > 1 attention runs context-parallel."""
        b, t = x.shape[:2]
        positions = jnp.arange(t) if positions is None else positions
        qkv = self.qkv(x)  # [B, T, KV, group + 2, D]
        q = qkv[..., : self.group, :].reshape(b, t, self.n_heads, self.head_dim)
        k, v = qkv[..., self.group, :], qkv[..., self.group + 1, :]
        if self.q_bias is not None:
            q = q + constrain_weight(self.q_bias[...], ("heads", "head_dim")).astype(self.dtype)
            v = v + constrain_weight(self.v_bias[...], ("kv_heads", "head_dim")).astype(self.dtype)
        q = constrain(q, ("batch", "length", "act_heads", "act_head_dim"))
        if self.rope_theta is not None:
            q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        rules = active_rules()
        if rules is not None and rules.seq_attention is not None:
            from jaxpar.layers.context_parallel import sequence_parallel_attention

            out = sequence_parallel_attention(q, k, v, positions, rules, rules.seq_attention,
                                              rules.parallel.seq_zigzag)
        else:
            out = causal_attention(q, k, v, positions, positions)
        out = constrain(out, ("batch", "length", "act_heads", "act_head_dim"))
        return self.o(out)
