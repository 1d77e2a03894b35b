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

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import attention_ops
from jaxpar.layers.attention_ops import rope, rope_frequencies
from jaxpar.layers.context_parallel import sharded_attention
from jaxpar.layers.linear import ColumnParallelLinear, RowParallelLinear
from jaxpar.layers.norm import RMSNorm
from jaxpar.layers.precision import f32_einsum
from jaxpar.partitioning import active_rules, constrain, constrain_weight, param


def _copy_kv(kernel: jax.Array, *, copies: int, group: int) -> tuple[jax.Array, tuple]:
    """The fused QKV kernel ``[embed, KV, group + 2, D]`` laid out for ``KV x copies`` head groups of
    ``group / copies`` query heads each, with their KV head copied: ``[embed, KV copies, group / copies + 2,
    D]`` (query head order unchanged), and its logical names."""
    d, kv, _, hd = kernel.shape
    q = kernel[:, :, :group].reshape(d, kv, copies, group // copies, hd)
    k, v = (jnp.broadcast_to(kernel[:, :, i, None, None], (d, kv, copies, 1, hd)) for i in (group, group + 1))
    out = jnp.concatenate([q, k, v], axis=3).reshape(d, kv * copies, group // copies + 2, hd)
    return out, ("embed", "kv_heads", "fused", "head_dim")


class Attention(nnx.Module):
    """Multi-head / grouped-query causal self-attention.

    Q, K and V come from ONE column-parallel matmul whose kernel is laid out
    ``[embed, kv_heads, group + 2, head_dim]``: for each KV head, its ``group`` query heads, then
    its key, then its value. Splitting ``kv_heads`` over ``tensor`` keeps every group whole on one
    device, and a single matmul means a single all-reduce of the input gradient in the backward
    (three separate projections would cost three).

    When ``tensor`` (the layout's tensor size) is larger than the KV heads (an MQA model on tensor=2,
    Qwen2.5-7B's 4 KV heads on tensor=8), each KV head is copied for the ``tensor / kv_heads`` devices
    that share it, as Megatron does: the stored kernel keeps ``kv_heads`` (named ``kv_rep``: not split
    over ``tensor``), and the matmul takes a copy laid out ``[embed, tensor, group / copies + 2,
    head_dim]`` split over ``tensor``, so each device computes its own query heads and its KV head;
    the copies' gradients are summed into the one stored head by the copy's transpose.

    Switches (each a model config key, see :class:`jaxpar.config.ModelConfig`): ``qkv_bias`` (biases on
    Q, K, V; the key's only where it can matter, i.e. with RoPE or QK-norm after it), ``use_bias`` (the
    out-projection's), ``qk_norm`` (an RMSNorm over each head's Q and K before RoPE), ``rope_freqs``
    (RoPE's inverse frequencies, scaled as the model says; ``rope_local_freqs`` those of the layers
    with a sliding window when they differ; ``rope_scale``: YaRN's factor on the global layers' cos and
    sin), ``scale`` (the scores' multiplier), ``window`` (the sliding window; a call may pass its
    layer's own, traced) and ``sinks`` (a learned logit per head beside the scores in the softmax: GPT-OSS).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, use_bias: bool = True,
                 qkv_bias: bool | None = None, rope_theta: float | None = None,
                 rope_freqs: tuple[float, ...] | None = None, rope_local_freqs: tuple[float, ...] | None = None,
                 qk_norm: bool = False, norm_eps: float = 1e-6, norm_plus_one: bool = False,
                 scale: float | None = None, window: int = 0, rope_scale: float = 1.0, init_std: float = 0.02,
                 out_init_std: float | None = None, kernel: str = "auto", tensor: int = 1, sinks: bool = False,
                 dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_kv_heads={n_kv_heads} must divide n_heads={n_heads}")
        # KV heads copied over the tensor devices that share them (class docstring)
        self.kv_copies = tensor // n_kv_heads if tensor > n_kv_heads and tensor % n_kv_heads == 0 else 1
        kv_axis = "kv_rep" if self.kv_copies > 1 else "kv_heads"
        # an explicit kernel that cannot run here fails now; auto also looks at the sequence length per call
        attention_ops.choose(kernel, dtype=dtype, head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads)
        self.kernel = kernel
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.group = n_heads // n_kv_heads
        if rope_freqs is None and rope_theta is not None:
            rope_freqs = rope_frequencies(head_dim, rope_theta)
        self.rope_freqs, self.rope_local_freqs, self.rope_scale = rope_freqs, rope_local_freqs, float(rope_scale)
        self.scale, self.window = scale, window
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv = ColumnParallelLinear(d_model, (n_kv_heads, self.group + 2, head_dim), name="qkv_proj",
                                        out_axes=(kv_axis, "fused", "head_dim"),
                                        act_axes=("batch", "length", "act_kv_heads", None, "act_head_dim"),
                                        use_bias=False, kernel_init=nnx.initializers.normal(init_std), **kw)
        qkv_bias = use_bias if qkv_bias is None else qkv_bias
        # A key bias adds q.b_k to every score of a query, which softmax ignores, unless RoPE (which rotates
        # it by the key's position) or a norm comes after it: without them its gradient is zero in exact
        # arithmetic and Adam would turn round-off into steps, so it exists only where it can matter.
        key_bias = qkv_bias and (rope_freqs is not None or qk_norm)
        self.q_bias = param(jnp.zeros((n_heads, head_dim), param_dtype), ("heads", "head_dim")) if qkv_bias else None
        self.k_bias = param(jnp.zeros((n_kv_heads, head_dim), param_dtype), (kv_axis, "head_dim")) if key_bias else None
        self.v_bias = param(jnp.zeros((n_kv_heads, head_dim), param_dtype), (kv_axis, "head_dim")) if qkv_bias else None
        norm = dict(eps=norm_eps, plus_one=norm_plus_one, param_dtype=param_dtype)
        self.q_norm = RMSNorm(head_dim, **norm) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, **norm) if qk_norm else None
        self.sinks = param(jnp.zeros((n_heads,), param_dtype), ("heads",)) if sinks else None
        self.o = RowParallelLinear((n_heads, head_dim), d_model, in_axes=("heads", "head_dim"), use_bias=use_bias,
                                   name="out_proj",
                                   kernel_init=nnx.initializers.normal(out_init_std or init_std), **kw)
        self.dtype = dtype

    def _window(self, window):
        """The layer's window: the call's (per-layer data), else the module's."""
        return self.window if window is None else window

    def _inv_freq(self, window):
        """RoPE's inverse frequencies for a layer with this ``window`` (the local ones where it is > 0)."""
        if self.rope_local_freqs is None:
            return jnp.asarray(self.rope_freqs, jnp.float32)
        local, glob = jnp.asarray(self.rope_local_freqs, jnp.float32), jnp.asarray(self.rope_freqs, jnp.float32)
        if isinstance(window, (int, float)):
            return local if window > 0 else glob
        return jnp.where(window > 0, local, glob)

    def _rope_scale(self, window):
        """YaRN's cos/sin factor for a layer with this ``window``: the global layers' (local layers with their
        own RoPE base are unscaled)."""
        if self.rope_scale == 1.0 or self.rope_local_freqs is None:
            return self.rope_scale
        if isinstance(window, (int, float)):
            return 1.0 if window > 0 else self.rope_scale
        return jnp.where(window > 0, 1.0, self.rope_scale)

    def _copies(self) -> int:
        """How many copies of each KV head this call computes: ``kv_copies`` under a layout whose tensor
        axis splits the heads (training), else 1 (generation, one device)."""
        rules = active_rules()
        return self.kv_copies if rules is not None and rules.axis_size("tensor") > 1 else 1

    def _kv_bias(self, bias, copies: int) -> jax.Array:
        b = bias[...]
        if copies > 1:
            b = jnp.repeat(constrain_weight(b, ("kv_rep", "head_dim")), copies, axis=0)
        return constrain_weight(b, ("kv_heads", "head_dim")).astype(self.dtype)

    def _qkv(self, x: jax.Array, positions: jax.Array | None, window=None):
        """Q ``[B, T, H, D]``, K and V ``[B, T, KV, D]`` of ``x`` (``KV`` x the copies of :meth:`_copies`),
        biased, QK-normed, RoPE at ``positions`` (``[T]`` or ``[B, T]``; None: ``0..T-1``)."""
        b, t = x.shape[:2]
        r = self._copies()
        group = self.group // r
        qkv = self.qkv(x, None if r == 1 else functools.partial(_copy_kv, copies=r, group=self.group))
        q = qkv[..., :group, :].reshape(b, t, self.n_heads, self.head_dim)  # [B, T, KV r, group / r + 2, D]
        k, v = qkv[..., group, :], qkv[..., group + 1, :]
        if self.q_bias is not None:
            q = q + constrain_weight(self.q_bias[...], ("heads", "head_dim")).astype(self.dtype)
        if self.k_bias is not None:
            k = k + self._kv_bias(self.k_bias, r)
        if self.v_bias is not None:
            v = v + self._kv_bias(self.v_bias, r)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(q, ("batch", "length", "act_heads", "act_head_dim"))
        if self.rope_freqs is not None:
            pos = jnp.arange(t) if positions is None else positions
            inv = self._inv_freq(self._window(window))
            sc = self._rope_scale(self._window(window))
            q, k = rope(q, pos, inv_freq=inv, scale=sc), rope(k, pos, inv_freq=inv, scale=sc)
        return q, k, v

    def __call__(self, x: jax.Array, positions: jax.Array | None = None, window=None, *,
                 segment_ids: jax.Array | None = None, doc_positions: jax.Array | None = None) -> jax.Array:
        """``x [B, T, d]``; ``positions [T]``: the tokens' global positions when they are not
        ``0..T-1`` in order (e.g. zig-zag ordered for ring attention), else None; ``window``: this layer's
        sliding window when the layers differ (a traced scalar; None: the module's). With ``seq`` > 1
        attention runs context-parallel. Packed documents (``data.packing=documents``): ``segment_ids
        [B, T]`` keep each token's attention inside its document and ``doc_positions [B, T]`` (each
        token's position in its document, in the same order as ``x``) are RoPE's positions."""
        window = self._window(window)
        q, k, v = self._qkv(x, positions if doc_positions is None else doc_positions, window)
        out = sharded_attention(q, k, v, positions, self.kernel, scale=self.scale, window=window,
                                segment_ids=segment_ids, sinks=None if self.sinks is None else self.sinks[...])
        out = checkpoint_name(constrain(out, ("batch", "length", "act_heads", "act_head_dim")), "attention")
        return self.o(out)

    def decode(self, x: jax.Array, positions: jax.Array, cache: dict, window=None) -> tuple[jax.Array, dict]:
        """Attention with a KV cache (generation): ``x [B, T, d]`` are the tokens at ``positions [B, T]``
        (consecutive in each row, starting anywhere); their K and V are written into ``cache = {"k", "v"}``
        (``[B, S, KV, D]``) at those positions, and each query attends to the cached keys at positions
        <= its own and within its sliding window (float32 scores and softmax, as the ``xla`` kernel).
        Returns the output and the cache."""
        window = self._window(window)
        q, k, v = self._qkv(x, positions, window)
        write = jax.vmap(lambda c, u, s: jax.lax.dynamic_update_slice_in_dim(c, u.astype(c.dtype), s, axis=0))
        start = positions[:, 0]
        cache = {"k": write(cache["k"], k, start), "v": write(cache["v"], v, start)}
        b, t, h, d = q.shape
        s, kv = cache["k"].shape[1], cache["k"].shape[2]
        qg = q.reshape(b, t, kv, h // kv, d)
        scale = (1.0 / d ** 0.5) if self.scale is None else self.scale
        scores = f32_einsum("btkgd,bskd->bkgts", qg, cache["k"].astype(q.dtype)) * scale
        visible = attention_ops.in_window(positions[:, None, None, :, None], jnp.arange(s)[None, None, None, None, :],
                                          window)
        sinks = None if self.sinks is None else self.sinks[...]  # the sink's logit beside the cached keys'
        p = attention_ops.softmax_with_sinks(jnp.where(visible, scores, attention_ops.NEG), sinks).astype(q.dtype)
        out = f32_einsum("bkgts,bskd->btkgd", p, cache["v"].astype(q.dtype))
        return self.o(out.reshape(b, t, h, d).astype(q.dtype)), cache
