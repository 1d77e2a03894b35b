"""Causal self-attention (MHA and GQA; RoPE or external positions) with heads split over ``tensor``.

Q, K, V are projected by one column-parallel kernel split by KV heads; the output projection
``(heads, head_dim) -> embed`` is row-parallel, so the block costs one all-reduce forward under
tensor parallelism. With GQA the ``heads`` are grouped ``[kv_heads, group]`` so that each device
keeps whole groups and K/V are never copied. The attention itself (kernel choice, context
parallelism) is :func:`jaxpar.layers.context_parallel.sharded_attention` over the math of
:mod:`jaxpar.layers.attention_ops`.

Rematerialisation names (``jax.ad_checkpoint.checkpoint_name``, see :mod:`jaxpar.layers.remat`):
``qkv_proj`` (the fused projection), ``attention`` (the attention output, before the
out-projection) and ``out_proj``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import attention_ops
from jaxpar.layers.attention_ops import rope
from jaxpar.layers.context_parallel import sharded_attention
from jaxpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from jaxpar.layers.precision import f32_einsum
from jaxpar.partitioning import constrain, constrain_weight, param


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
                 kernel: str = "auto", dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        # an explicit kernel that cannot run here fails now; auto also looks at the sequence length per call
        attention_ops.choose(kernel, dtype=dtype, head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads)
        self.kernel = kernel
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        self.rope_theta = rope_theta
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv = ColumnParallelLinear(d_model, (n_kv_heads, self.group + 2, head_dim), name="qkv_proj",
                                        out_axes=("kv_heads", "fused", "head_dim"),
                                        act_axes=("batch", "length", "act_kv_heads", None, "act_head_dim"),
                                        use_bias=False, kernel_init=nnx.initializers.normal(init_std), **kw)
        # Biases of Q and V only: a key bias adds q.b_k to every score of a query, which softmax
        # ignores; its gradient is zero in exact arithmetic and Adam would turn round-off into steps.
        self.q_bias = param(jnp.zeros((n_heads, head_dim), param_dtype), ("heads", "head_dim")) if use_bias else None
        self.v_bias = (param(jnp.zeros((n_kv_heads, head_dim), param_dtype), ("kv_heads", "head_dim"))
                       if use_bias else None)
        self.o = RowParallelLinear((n_heads, head_dim), d_model, in_axes=("heads", "head_dim"), use_bias=use_bias,
                                   name="out_proj",
                                   kernel_init=nnx.initializers.normal(out_init_std or init_std), **kw)
        self.dtype = dtype

    def _qkv(self, x: jax.Array, positions: jax.Array | None):
        """Q ``[B, T, H, D]``, K and V ``[B, T, KV, D]`` of ``x``, biased, RoPE at ``positions`` (``[T]`` or
        ``[B, T]``; None: ``0..T-1``)."""
        b, t = x.shape[:2]
        qkv = self.qkv(x)  # [B, T, KV, group + 2, D]
        q = qkv[..., : self.group, :].reshape(b, t, self.n_heads, self.head_dim)
        k, v = qkv[..., self.group, :], qkv[..., self.group + 1, :]
        if self.q_bias is not None:
            q = q + constrain_weight(self.q_bias[...], ("heads", "head_dim")).astype(self.dtype)
        if self.v_bias is not None:  # both biases or neither (use_bias)
            v = v + constrain_weight(self.v_bias[...], ("kv_heads", "head_dim")).astype(self.dtype)
        q = constrain(q, ("batch", "length", "act_heads", "act_head_dim"))
        if self.rope_theta is not None:
            pos = jnp.arange(t) if positions is None else positions
            q, k = rope(q, pos, self.rope_theta), rope(k, pos, self.rope_theta)
        return q, k, v

    def __call__(self, x: jax.Array, positions: jax.Array | None = None) -> jax.Array:
        """``x [B, T, d]``; ``positions [T]``: the tokens' global positions when they are not
        ``0..T-1`` in order (e.g. zig-zag ordered for ring attention), else None. With ``seq`` > 1
        attention runs context-parallel."""
        q, k, v = self._qkv(x, positions)
        out = sharded_attention(q, k, v, positions, self.kernel)
        out = checkpoint_name(constrain(out, ("batch", "length", "act_heads", "act_head_dim")), "attention")
        return self.o(out)

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        """Attention with a KV cache (generation): ``x [B, T, d]`` are the tokens at ``positions [B, T]``
        (consecutive in each row, starting anywhere); their K and V are written into ``cache = {"k", "v"}``
        (``[B, S, KV, D]``) at those positions, and each query attends to the cached keys at positions
        <= its own (float32 scores and softmax, as the ``xla`` kernel). Returns the output and the cache."""
        q, k, v = self._qkv(x, positions)
        write = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice_in_dim(c, u.astype(c.dtype), s, axis=0))
        start = positions[:, 0]
        cache = {"k": write(cache["k"], k, start), "v": write(cache["v"], v, start)}
        b, t, h, d = q.shape
        s, kv = cache["k"].shape[1], cache["k"].shape[2]
        qg = q.reshape(b, t, kv, h // kv, d)
        scores = f32_einsum("btkgd,bskd->bkgts", qg, cache["k"].astype(q.dtype)) * (1.0 / d ** 0.5)
        visible = positions[:, None, None, :, None] >= jnp.arange(s)[None, None, None, None, :]
        p = jax.nn.softmax(jnp.where(visible, scores, attention_ops.NEG), axis=-1).astype(q.dtype)
        out = f32_einsum("bkgts,bskd->btkgd", p, cache["v"].astype(q.dtype))
        return self.o(out.reshape(b, t, h, d).astype(q.dtype)), cache
