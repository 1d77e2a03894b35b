"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3) with heads split over ``tensor``.

Per token ``x`` (``H`` heads; widths: ``r_q`` = ``q_lora_rank``, ``r`` = ``kv_lora_rank``, ``n`` the
query/key part without position encoding, ``p`` = ``rope_head_dim``, ``v`` = ``v_head_dim``)::

    q        = up_q(norm_q(down_q(x)))         [H, n + p]   (r_q = 0: one projection of x)
    c, k_p   = down_kv(x)                      [r], [p]     the latent and ONE RoPE key for all heads
    c        = norm_kv(c)
    k_n, v_h = up_kv(c)                        [H, n], [H, v]
    q_h = [q_n, rope(q_p)],  k_h = [k_n, rope(k_p)]            (k_p shared by the heads)
    out = o(softmax(q_h . k_h * scale) v_h)

Training computes every head's key and value (``up_kv``) and runs the usual attention
(:func:`jaxpar.layers.context_parallel.sharded_attention`: every kernel, context-parallel strategy and
packed documents; the values may be narrower than the queries). The down projections and their norms
are small and replicated over ``tensor``; the up projections are column-parallel by heads and the
output row-parallel, as :class:`~jaxpar.layers.attention.Attention` (one all-reduce forward). Under
Megatron-SP the latents, not ``x``, are what is all-gathered along the sequence.

Generation (:meth:`LatentAttention.decode`) caches only ``c`` and ``rope(k_p)``: ``r + p`` values per
token and layer, against ``2 H (n + p)``-ish for full K/V. The up projection is absorbed into the
query and the output instead (``q_n . k_n = (q_n W_k^T) . c`` and ``p . v_h = (p . c) W_v``), so the
keys and values of the cached positions are never rebuilt.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import attention_ops
from jaxpar.layers.attention_ops import rope
from jaxpar.layers.context_parallel import sharded_attention
from jaxpar.layers.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from jaxpar.layers.norm import RMSNorm
from jaxpar.layers.precision import f32_einsum
from jaxpar.partitioning import constrain, constrain_weight

# the latents' RMSNorm epsilon: DeepSeek's (its q_a_layernorm / kv_a_layernorm ignore rms_norm_eps)
LATENT_NORM_EPS = 1e-6
_DOWN_ACT = ("batch", "res_length", "latent")  # a latent: split like the residual stream (Megatron-SP: gathered by up)


class LatentAttention(nnx.Module):
    """Multi-head latent attention (module docstring). Parameters: ``q_down [embed, latent]``, ``q_norm``,
    ``q_up [latent, heads, head_dim]`` (or ``q [embed, heads, head_dim]`` with ``q_rank`` 0), ``kv_down
    [embed, latent]`` (the ``kv_rank`` latent, then the ``rope_dim`` RoPE key), ``kv_norm``, ``kv_up [latent,
    heads, head_dim]`` (each head's ``head_dim - rope_dim`` key part, then its ``v_head_dim`` value) and
    ``o [heads, head_dim, embed]``. ``head_dim`` is the query/key width, of which the last ``rope_dim`` are
    rotated (``rope_freqs``: RoPE's inverse frequencies over ``rope_dim``; ``rope_scale``: YaRN's factor on
    cos and sin). ``scale``: the scores' multiplier (default ``1/sqrt(head_dim)``); ``window``: a sliding
    window (a call may pass its layer's own); ``norm_eps``: the latents' norms' epsilon."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, *, rope_dim: int, v_head_dim: int, q_rank: int,
                 kv_rank: int, rope_freqs: tuple[float, ...], rope_scale: float = 1.0, scale: float | None = None,
                 window: int = 0, norm_eps: float = LATENT_NORM_EPS, init_std: float = 0.02,
                 out_init_std: float | None = None,
                 kernel: str = "auto", use_bias: bool = False, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        if not 0 < rope_dim < head_dim:
            raise ValueError(f"rope_dim={rope_dim} must be between 0 and head_dim={head_dim} (exclusive)")
        attention_ops.choose(kernel, dtype=dtype, head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_heads)
        self.n_heads, self.head_dim, self.rope_dim, self.v_head_dim = n_heads, head_dim, rope_dim, v_head_dim
        self.nope = head_dim - rope_dim
        self.q_rank, self.kv_rank = q_rank, kv_rank
        self.rope_freqs, self.rope_scale, self.scale, self.window = rope_freqs, float(rope_scale), scale, window
        self.kernel, self.dtype = kernel, dtype
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.normal(init_std)
        heads = dict(out_axes=("heads", "head_dim"), act_axes=("batch", "length", "act_heads", "act_head_dim"),
                     use_bias=False, kernel_init=init, name="qkv_proj", **kw)
        self.q_down: ParallelLinear | None
        self.q_norm: RMSNorm | None
        if q_rank:
            self.q_down = ParallelLinear(d_model, q_rank, in_axes=("embed",), out_axes=("latent",),
                                         act_axes=_DOWN_ACT, use_bias=use_bias, kernel_init=init, **kw)
            self.q_norm = RMSNorm(q_rank, eps=norm_eps, param_dtype=param_dtype)
            self.q_up = ColumnParallelLinear(q_rank, (n_heads, head_dim), in_axes=("latent",), **heads)
        else:
            self.q_down, self.q_norm = None, None
            self.q_up = ColumnParallelLinear(d_model, (n_heads, head_dim), **heads)
        self.kv_down = ParallelLinear(d_model, kv_rank + rope_dim, in_axes=("embed",), out_axes=("latent",),
                                      act_axes=_DOWN_ACT, use_bias=use_bias, kernel_init=init, **kw)
        self.kv_norm = RMSNorm(kv_rank, eps=norm_eps, param_dtype=param_dtype)
        self.kv_up = ColumnParallelLinear(kv_rank, (n_heads, self.nope + v_head_dim), in_axes=("latent",), **heads)
        self.o = RowParallelLinear((n_heads, v_head_dim), d_model, in_axes=("heads", "head_dim"), use_bias=use_bias,
                                   name="out_proj", kernel_init=nnx.initializers.normal(out_init_std or init_std),
                                   **kw)

    def _window(self, window):
        return self.window if window is None else window

    def _rope(self, x: jax.Array, positions: jax.Array | None) -> jax.Array:
        pos = jnp.arange(x.shape[1]) if positions is None else positions
        return rope(x, pos, inv_freq=self.rope_freqs, scale=self.rope_scale)

    def _queries(self, x: jax.Array, positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """Each head's query parts ``[B, T, H, n]`` (no position) and ``[B, T, H, p]`` (rotated)."""
        h = x if self.q_down is None or self.q_norm is None else self.q_norm(self.q_down(x))
        q = self.q_up(h)
        return q[..., :self.nope], self._rope(q[..., self.nope:], positions)

    def _latent(self, x: jax.Array, positions: jax.Array | None) -> tuple[jax.Array, jax.Array]:
        """The normed latent ``c [B, T, r]`` and the rotated shared key ``[B, T, p]``."""
        ckv = self.kv_down(x)
        c = self.kv_norm(ckv[..., :self.kv_rank])
        return c, self._rope(ckv[..., None, self.kv_rank:], positions)[:, :, 0]

    def __call__(self, x: jax.Array, positions: jax.Array | None = None, window=None, *,
                 segment_ids: jax.Array | None = None, doc_positions: jax.Array | None = None) -> jax.Array:
        """As :meth:`jaxpar.layers.attention.Attention.__call__`: ``x [B, T, d]``; ``positions`` the tokens'
        global positions when not in order; packed documents' ``segment_ids`` and ``doc_positions``."""
        rope_pos = positions if doc_positions is None else doc_positions
        q_n, q_p = self._queries(x, rope_pos)
        c, k_p = self._latent(x, rope_pos)
        kv = self.kv_up(c)
        k_n, v = kv[..., :self.nope], kv[..., self.nope:]
        q = constrain(jnp.concatenate([q_n, q_p], axis=-1), ("batch", "length", "act_heads", "act_head_dim"))
        k_p = jnp.broadcast_to(k_p[:, :, None, :], (*k_n.shape[:3], self.rope_dim))
        k = constrain(jnp.concatenate([k_n, k_p.astype(k_n.dtype)], axis=-1),
                      ("batch", "length", "act_kv_heads", "act_head_dim"))
        out = sharded_attention(q, k, v, positions, self.kernel, scale=self.scale, window=self._window(window),
                                segment_ids=segment_ids)
        out = checkpoint_name(constrain(out, ("batch", "length", "act_heads", "act_head_dim")), "attention")
        return self.o(out)

    def cache_shapes(self, batch: int, length: int) -> dict[str, tuple[int, ...]]:
        """The generation cache of one layer: the latent and the rotated shared key of each position."""
        return {"latent": (batch, length, self.kv_rank), "rope_key": (batch, length, self.rope_dim)}

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict, window=None) -> tuple[jax.Array, dict]:
        """Attention with the compressed cache (generation): ``x [B, T, d]`` at ``positions [B, T]``
        (consecutive in each row); their latents and RoPE keys are written into ``cache = {"latent" [B, S,
        r], "rope_key" [B, S, p]}``, and each query attends to the cached positions <= its own (and in its
        window) with the up projection absorbed (module docstring; float32 scores and softmax)."""
        window = self._window(window)
        q_n, q_p = self._queries(x, positions)
        c, k_p = self._latent(x, positions)
        write = jax.vmap(lambda a, u, s: jax.lax.dynamic_update_slice_in_dim(a, u.astype(a.dtype), s, axis=0))
        start = positions[:, 0]
        cache = {"latent": write(cache["latent"], c, start), "rope_key": write(cache["rope_key"], k_p, start)}
        w = constrain_weight(self.kv_up.kernel[...], ("latent", "heads", "head_dim")).astype(q_n.dtype)
        w_k, w_v = w[..., :self.nope], w[..., self.nope:]
        lat, key = cache["latent"].astype(q_n.dtype), cache["rope_key"].astype(q_n.dtype)
        q_lat = f32_einsum("bthn,rhn->bthr", q_n, w_k).astype(q_n.dtype)
        scale = (1.0 / self.head_dim ** 0.5) if self.scale is None else self.scale
        scores = (f32_einsum("bthr,bsr->bhts", q_lat, lat) + f32_einsum("bthp,bsp->bhts", q_p, key)) * scale
        s = lat.shape[1]
        visible = attention_ops.in_window(positions[:, None, :, None], jnp.arange(s)[None, None, None, :], window)
        p = jax.nn.softmax(jnp.where(visible, scores, attention_ops.NEG), axis=-1).astype(q_n.dtype)
        out_lat = f32_einsum("bhts,bsr->bthr", p, lat).astype(q_n.dtype)
        out = f32_einsum("bthr,rhv->bthv", out_lat, w_v)
        return self.o(out.astype(q_n.dtype)), cache
