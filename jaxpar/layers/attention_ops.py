"""The attention math every attention path shares: RoPE, causal attention, and the fused kernels.

One device's attention is :func:`attention` ``(q [B, T, H, D], k, v [B, S, KV, D]) -> [B, T, H, D]``
(``H % KV == 0``: multi-head, grouped-query or multi-query; K and V are never copied per query
head), causal on global positions, computed by one of these kernels (``model.attention``):

``xla``     the reference: ``QK^T`` as a float32-accumulated matmul (:func:`f32_einsum`), a float32
            softmax, ``PV``; materialises the ``[B, KV, G, T, S]`` scores. Any platform.
``cudnn``   cuDNN's flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``
            (GPU; bfloat16/float16; head dim a multiple of 8 up to 128, 256 on Hopper and later). The
            kernel accumulates and takes the softmax in float32 and never materialises the scores.
``pallas``  the Pallas flash kernels of JAX: on TPU the splash-attention kernel (GQA native; its
            blocks need the keys divisible by 128); on GPU the Triton flash kernel (multi-head
            only, plain causal); on CPU the TPU kernel runs in Pallas's interpret mode, which is slow
            and exists to test the kernel path.
``auto``    the fastest one that fits: cudnn on GPU, pallas on TPU, xla on CPU, or xla where the
            chosen kernel does not fit the shapes or dtype (the math is the same).

The causal mask has three forms: by index (``q_offset = 0``: query row i sees keys 0..i), shifted
(query row i sees keys ``0..q_offset + i``: the local queries of an all-gathered sequence), or by
explicit global positions (``q_pos``, ``k_pos``, any order; xla and cudnn only). Packed documents
(``data.packing=documents``) add segment ids: a query sees the keys of its own document only.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.config import ConfigError
from jaxpar.layers.precision import f32_einsum

KERNELS = ("xla", "cudnn", "pallas")
CHOICES = ("auto",) + KERNELS
NEG = -1e30


def rope_frequencies(head_dim: int, theta: float, scaling: str = "none", factor: float = 8.0,
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                     original_context: int = 8192, beta_fast: float = 32.0,
                     beta_slow: float = 1.0, truncate: bool = True) -> tuple[float, ...]:
    """RoPE's ``head_dim / 2`` inverse frequencies ``theta ** (-2i / head_dim)`` (float32, as Hugging Face
    computes them), scaled: ``linear`` divides them all by ``factor`` (positions / factor); ``llama3``
    (Llama 3.1) divides those of wavelength above ``original_context / low_freq_factor`` by ``factor``,
    keeps those below ``original_context / high_freq_factor`` and blends the band between; ``yarn`` (YaRN)
    divides by ``factor`` the frequencies of fewer than ``beta_slow`` rotations over ``original_context``,
    keeps those of more than ``beta_fast`` and ramps linearly between (the correction range rounded
    outwards as Hugging Face does, unless ``truncate`` is false: GPT-OSS; the cos/sin factor is
    ``ModelConfig.yarn_attention_factor``). A tuple, so that a module can hold it as static data."""
    inv = (1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim))))
    inv = inv.astype(np.float32)
    if scaling == "linear":
        inv = inv / np.float32(factor)
    elif scaling == "llama3":
        wavelen = np.float32(2 * np.pi) / inv
        low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv)
        smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    elif scaling == "yarn":
        def dim_of(rotations: float) -> float:  # the frequency index that turns `rotations` times over the context
            return head_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = dim_of(beta_fast), dim_of(beta_slow)
        if truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / ((high - low) or 0.001), 0, 1)
        keep = (1 - ramp).astype(np.float32)  # 1: the original frequency (extrapolation), 0: divided by factor
        inv = (inv / np.float32(factor) * (1 - keep) + inv * keep).astype(np.float32)
    elif scaling != "none":
        raise ValueError(f"unknown RoPE scaling {scaling!r}; choose none, linear, llama3 or yarn")
    return tuple(float(f) for f in inv)


def rope(x: jax.Array, positions: jax.Array, theta: float = 10000.0, inv_freq=None, scale: float = 1.0) -> jax.Array:
    """Rotary embedding (rotate-half layout, as Llama): ``x [B, T, H, D]``, ``positions [T]`` or ``[B, T]``;
    ``inv_freq [D/2]`` (e.g. :func:`rope_frequencies`, scaled; may be traced) replaces ``theta``'s; cos and
    sin times ``scale`` (YaRN's attention factor)."""
    d = x.shape[-1]
    if inv_freq is None:
        inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    else:
        inv = jnp.asarray(inv_freq, jnp.float32)
    ang = positions.astype(jnp.float32)[..., None] * inv  # [.., T, D/2]
    if ang.ndim == 2:
        ang = ang[None]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    if not (isinstance(scale, (int, float)) and scale == 1.0):
        cos, sin = cos * jnp.asarray(scale, jnp.float32), sin * jnp.asarray(scale, jnp.float32)
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _mask(t: int, s: int, q_offset=0, q_pos=None, k_pos=None, window=None, q_seg=None, k_seg=None) -> jax.Array:
    """``[T, S]``: query i may see key j (causal on global positions; within ``window`` positions of it,
    itself included, when ``window`` > 0: a Python int or a traced scalar); with segment ids ``q_seg
    [B, T]``, ``k_seg [B, S]`` (packed documents) ``[B, T, S]``, and only within the query's document."""
    if q_pos is None:
        q_pos = q_offset + jnp.arange(t)
    if k_pos is None:
        k_pos = jnp.arange(s)
    ok = in_window(q_pos[:, None], k_pos[None, :], window)
    return ok if q_seg is None else ok & same_segment(q_seg, k_seg)


def same_segment(q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """``[B, T, S]``: query i and key j belong to the same document (segment id)."""
    return q_seg[:, :, None] == k_seg[:, None, :]


def _heads(mask: jax.Array) -> jax.Array:
    """A ``[T, S]`` or ``[B, T, S]`` mask broadcast against ``[B, KV, G, T, S]`` scores."""
    return mask if mask.ndim == 2 else mask[:, None, None]


def in_window(q_pos, k_pos, window=None):
    """Whether a query at ``q_pos`` sees a key at ``k_pos``: causal, and within the sliding ``window``
    (``q_pos - k_pos < window``) when it is > 0 (None or 0: no window)."""
    ok = q_pos >= k_pos
    if window is None or (isinstance(window, (int, np.integer)) and window <= 0):
        return ok
    return ok & ((window <= 0) | (q_pos - k_pos < window))


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """The softmax over the keys of ``scores [B, KV, G, T, S]`` (float32), with a sink logit per head (``sinks
    [KV * G]``, GPT-OSS) beside the keys when given: its share of the weight goes to no value."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    kv, g = scores.shape[1:3]
    sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv, g, 1, 1), (*scores.shape[:-1], 1))
    return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array | None = None,
                     k_pos: jax.Array | None = None, q_offset=0, *, scale=None, window=None, q_seg=None,
                     k_seg=None, sinks=None) -> jax.Array:
    """The reference (``xla``) kernel: softmax attention with a causal mask, float32 scores and softmax.

    ``q [B, T, H, D]``, ``k [B, S, KV, D]``, ``v [B, S, KV, Dv]`` with ``H % KV == 0`` (``Dv``: MLA's
    value width may differ from the queries' and keys'); the mask compares global
    positions (default: query i at ``q_offset + i``, key j at j), within a sliding ``window`` when one
    is given, and segment ids ``q_seg [B, T]``, ``k_seg [B, S]`` when given (a query sees its own
    document only). Scores are scaled by ``scale`` (default ``1/sqrt(D)``). ``sinks [H]``: a logit per head
    beside the scores in the softmax, whose share goes to no value (GPT-OSS). Returns ``[B, T, H, Dv]``.
    """
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, kv, h // kv, d)
    scores = f32_einsum("btkgd,bskd->bkgts", qg, k) * np.float32(_scale(scale, d))
    scores = jnp.where(_heads(_mask(t, s, q_offset, q_pos, k_pos, window, q_seg, k_seg)), scores, NEG)
    p = softmax_with_sinks(scores, sinks).astype(v.dtype)
    out = f32_einsum("bkgts,bskd->btkgd", p, v)
    return out.reshape(b, t, h, v.shape[-1]).astype(q.dtype)


def _scale(scale, d: int) -> float:
    return float(1.0 / np.sqrt(d)) if scale is None else float(scale)


def _static_window(window) -> bool:
    return window is None or isinstance(window, (int, np.integer))


# ---------------------------------------------------------------------------------------------
# Choosing a kernel


def _platform() -> str:
    return jax.default_backend()


def _cudnn_max_head_dim() -> int:
    try:
        cc = float(getattr(jax.devices()[0], "compute_capability", "0") or 0)
    except (TypeError, ValueError):
        cc = 0.0
    return 256 if cc >= 9.0 else 128


def unsupported(kernel: str, *, dtype, head_dim: int, n_heads: int, n_kv_heads: int,
                platform: str | None = None, cudnn_head_dim: int | None = None) -> str | None:
    """Why ``kernel`` cannot run this attention on this platform (None: it can). Shapes that only
    the call knows (sequence lengths) are checked there. ``cudnn_head_dim``: the largest head dim cuDNN's
    kernel takes on the GPU meant (default: this process's first device's: 256 on Hopper and later, else
    128), for a planner on another machine."""
    platform = platform or _platform()
    dtype = jnp.dtype(dtype)
    if kernel == "cudnn":
        if platform != "gpu":
            return f"cuDNN flash attention needs a GPU (this run is on {platform})"
        if dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
            return (f"cuDNN flash attention has no {dtype.name} kernel; it needs model.compute_dtype=bfloat16 "
                    "(auto is bfloat16 on GPU)")
        hmax = cudnn_head_dim or _cudnn_max_head_dim()
        if head_dim % 8 or head_dim > hmax:
            return f"cuDNN flash attention needs a head dim that is a multiple of 8 and <= {hmax}; got {head_dim}"
    if kernel == "pallas" and platform == "gpu" and n_kv_heads != n_heads:
        return (f"the Pallas GPU (Triton) flash kernel is multi-head only; model.n_kv_heads={n_kv_heads} != "
                f"model.n_heads={n_heads} (use cudnn, which runs grouped-query attention without copies)")
    return None


def choose(choice: str, *, dtype, head_dim: int, n_heads: int, n_kv_heads: int, platform: str | None = None,
           seq_len: int | None = None, cudnn_head_dim: int | None = None) -> str:
    """The kernel ``model.attention=choice`` runs: ``auto`` picks; an explicit choice that cannot run
    is a :class:`ConfigError` naming ``model.attention`` (``cudnn_head_dim``: :func:`unsupported`)."""
    if choice not in CHOICES:
        raise ConfigError(f"model.attention={choice!r} is not a valid choice; choose one of {', '.join(CHOICES)}")
    platform = platform or _platform()
    facts = dict(dtype=dtype, head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads, platform=platform,
                 cudnn_head_dim=cudnn_head_dim)
    if choice != "auto":
        why = unsupported(choice, **facts)
        if why:
            raise ConfigError(f"model.attention={choice}: {why}; choose auto or xla")
        return choice
    best = {"gpu": "cudnn", "tpu": "pallas"}.get(platform, "xla")
    if unsupported(best, **facts) or not _fits(best, seq_len, seq_len, platform):
        return "xla"
    return best


def _fits(kernel: str, t: int | None, s: int | None, platform: str) -> bool:
    """Sequence lengths the kernel's blocks can tile (None: not known yet)."""
    if t is None or s is None:
        return True
    if kernel == "pallas" and platform == "tpu":
        return t % 128 == 0 and s % 128 == 0
    if kernel == "cudnn":
        return t % 2 == 0 and s % 2 == 0
    return True


# ---------------------------------------------------------------------------------------------
# One device's attention


def attention(q: jax.Array, k: jax.Array, v: jax.Array, kernel: str = "xla", *, q_offset=0,
              q_pos: jax.Array | None = None, k_pos: jax.Array | None = None, scale: float | None = None,
              window=None, q_seg: jax.Array | None = None, k_seg: jax.Array | None = None,
              sinks: jax.Array | None = None) -> jax.Array:
    """Causal attention of ``q [B, T, H, D]`` over ``k, v [B, S, KV, D]`` with ``kernel``
    (a choice of :data:`CHOICES`; ``auto`` is resolved here from the shapes).

    The mask: by index shifted by ``q_offset`` (a Python int, or a traced scalar for xla and cudnn),
    or by explicit global positions ``q_pos [T]``, ``k_pos [S]``; and a sliding ``window`` (a query
    sees the keys less than ``window`` positions behind it; None or 0: all; a Python int, or a traced
    scalar, e.g. a per-layer value scanned with the weights, for xla and cudnn). Scores are scaled by
    ``scale`` (default ``1/sqrt(D)``). Packed documents: segment ids ``q_seg [B, T]``, ``k_seg [B, S]``
    keep each query inside its document (xla and cudnn: in the mask; pallas: the splash kernel's own
    segment ids). Values narrower than the queries (``v [B, S, KV, Dv]``, MLA) are zero-padded to ``D``
    for the fused kernels, which take one head width, and the output cut back to ``Dv``. Attention sinks
    (``sinks [H]``, GPT-OSS): the ``xla`` kernel (``auto`` chooses it); cudnn and pallas refuse them.
    """
    b, t, h, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    platform = _platform()
    if kernel == "auto":
        kernel = choose("auto", dtype=q.dtype, head_dim=d, n_heads=h, n_kv_heads=kv, platform=platform, seq_len=t)
        if not _fits(kernel, t, s, platform) or sinks is not None:
            kernel = "xla"
    if sinks is not None and kernel != "xla":
        raise ConfigError(f"model.attention={kernel}: the {kernel} kernels have no attention sinks (model.attn_sinks, "
                          "GPT-OSS); choose model.attention=auto or xla")
    dv = v.shape[-1]
    if kernel != "xla" and dv != d:
        if dv > d:
            raise ValueError(f"values wider than the queries ({dv} > {d}) are not supported")
        padded = jnp.pad(v, [(0, 0)] * 3 + [(0, d - dv)])
        return attention(q, k, padded, kernel, q_offset=q_offset, q_pos=q_pos, k_pos=k_pos, scale=_scale(scale, d),
                         window=window, q_seg=q_seg, k_seg=k_seg, sinks=sinks)[..., :dv]
    positions = q_pos is not None or k_pos is not None
    windowed = not (window is None or (_static_window(window) and window <= 0))
    segs = dict(q_seg=q_seg, k_seg=k_seg)
    if kernel == "xla":
        return causal_attention(q, k, v, q_pos, k_pos, q_offset, scale=scale, window=window, sinks=sinks, **segs)
    if kernel == "cudnn":
        plain = not positions and isinstance(q_offset, int) and q_offset == 0 and t == s and q_seg is None
        if plain and windowed and _static_window(window):
            return jax.nn.dot_product_attention(q, k, v, scale=_scale(scale, d), is_causal=True,
                                                local_window_size=(int(window) - 1, 0), implementation="cudnn")
        plain = plain and not windowed
        mask = None if plain else _mask(t, s, q_offset, q_pos, k_pos, window, q_seg, k_seg)
        mask = None if mask is None else mask[None, None] if mask.ndim == 2 else mask[:, None]  # [B, 1, T, S]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=_scale(scale, d), is_causal=plain,
                                            implementation="cudnn")
    if kernel == "pallas":
        if positions or not isinstance(q_offset, (int, np.integer)):
            raise ConfigError("model.attention=pallas: the Pallas kernels' causal masks are static, so they cannot "
                              "take tokens in another order (explicit positions); choose auto or xla")
        if windowed and not _static_window(window):
            raise ConfigError("model.attention=pallas: the Pallas kernels' masks are static, and layers with "
                              "different windows (model.global_every) pass the window as data; choose auto or xla")
        if platform == "gpu":
            if q_offset != 0 or t != s:
                raise ConfigError("model.attention=pallas: the Pallas GPU (Triton) flash kernel runs plain causal "
                                  f"attention only (as many queries as keys, no offset; here {t} queries, {s} keys), "
                                  "not parallel.seq_attention=all_gather; use model.attention=cudnn or ulysses")
            if windowed:
                raise ConfigError("model.attention=pallas: the Pallas GPU (Triton) flash kernel has no sliding "
                                  "window (model.sliding_window); use model.attention=cudnn or auto")
            if q_seg is not None:
                raise ConfigError("model.attention=pallas: the Pallas GPU (Triton) flash kernel has no segment ids "
                                  "(data.packing=documents); use model.attention=cudnn or auto")
            return triton_attention(q, k, v, scale=_scale(scale, d))
        if s % 128:
            raise ConfigError(f"model.attention=pallas: the splash attention kernel tiles the keys in blocks of 128, "
                              f"and this attention has {s} keys (model.seq_len, or its share under parallel.seq); "
                              "choose a multiple of 128, or model.attention=auto / xla")
        return splash_attention(q, k, v, int(q_offset), interpret=platform != "tpu", scale=_scale(scale, d),
                                window=int(window) if windowed else None, q_seg=q_seg, k_seg=k_seg)
    raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(CHOICES)}")


def _block(n: int) -> int:
    """The largest of 512, 256, 128 that divides ``n`` (``n`` itself, for short query blocks)."""
    return next((b for b in (512, 256, 128) if n % b == 0), n)


def splash_attention(q, k, v, q_offset: int = 0, *, interpret: bool = False, scale: float | None = None,
                     window: int | None = None, q_seg=None, k_seg=None) -> jax.Array:
    """TPU splash attention (``jax.experimental.pallas.ops.tpu``), causal with a static offset (and a static
    sliding ``window``); grouped-query natively (the kernel maps each query head to its KV head); packed
    documents through the kernel's segment ids (``q_seg [B, T]``, ``k_seg [B, S]``)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, h, d = q.shape
    s = k.shape[1]
    one = (sm.CausalMask((t, s), offset=q_offset) if not window else
           sm.LocalMask((t, s), window_size=(window - 1, 0), offset=q_offset))
    mask = sm.MultiHeadMask([one for _ in range(h)])
    bq, bk = _block(t), _block(s)
    sizes = sk.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=sizes, interpret=interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, H, D] -> [B, H, T, D]
    qs, ks, vs = heads_first(q * np.asarray(_scale(scale, d), q.dtype)), heads_first(k), heads_first(v)
    if q_seg is None:
        out = jax.vmap(kernel)(qs, ks, vs)
    else:
        out = jax.vmap(lambda q, k, v, a, b: kernel(q, k, v, segment_ids=sk.SegmentIds(q=a, kv=b)))(
            qs, ks, vs, q_seg.astype(jnp.int32), k_seg.astype(jnp.int32))
    return heads_first(out).astype(q.dtype)


def triton_attention(q, k, v, *, interpret: bool = False, scale: float | None = None) -> jax.Array:
    """The Pallas GPU (Triton) flash kernel (``jax.experimental.pallas.ops.gpu.attention``):
    multi-head, plain causal."""
    from jax.experimental.pallas.ops.gpu import attention as tri

    t, d = q.shape[1], q.shape[-1]
    blocks = tri.BlockSizes(block_q=min(128, t), block_k=min(128, t), block_q_dkv=min(32, t),
                            block_kv_dkv=min(32, t), block_q_dq=min(32, t), block_kv_dq=min(32, t))
    return tri.mha(q, k, v, None, sm_scale=_scale(scale, d), causal=True, block_sizes=blocks,
                   interpret=interpret)


@functools.lru_cache(maxsize=None)
def describe(choice: str, *, dtype, head_dim: int, n_heads: int, n_kv_heads: int, seq_len: int,
             platform: str | None = None) -> str:
    """One line for the start-up report: the kernel ``choice`` runs, and why when auto fell back."""
    platform = platform or _platform()
    kernel = choose(choice, dtype=dtype, head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                    platform=platform, seq_len=seq_len)
    if choice != "auto":
        return kernel
    best = {"gpu": "cudnn", "tpu": "pallas"}.get(platform, "xla")
    if kernel == best:
        return f"{kernel} (auto on {platform})"
    why = unsupported(best, dtype=dtype, head_dim=head_dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                      platform=platform) or f"sequence length {seq_len} does not tile into its blocks"
    return f"{kernel} (auto on {platform}: {best} does not fit: {why})"
