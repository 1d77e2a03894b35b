"""Sequence / context-parallel causal attention over the ``seq`` mesh axis.

Activations arrive split along the sequence: each of the N devices of a ``seq`` group holds
``T/N`` query, key and value positions (and their global positions, so masks and RoPE are exact).
Three strategies, each one ``jax.shard_map`` over the whole mesh with explicit ``seq`` collectives
(the other axes only make the arrays smaller: batch over data, heads over tensor):

``all_gather``  all-gather K and V (and their positions) over ``seq``, attend with the local Q.
                Communication: K/V of the whole sequence per device; memory: the whole K/V.
``ring``        K/V blocks travel around the ring by ``ppermute`` (N-1 hops), combined into the
                local output with an online (flash-style) softmax; no device holds the whole K/V.
                Blocks that the causal mask hides entirely are skipped. With the contiguous layout
                that leaves device i with i+1/2 blocks of work; with the zig-zag layout
                (:func:`zigzag_order`: device i holds chunks i and 2N-1-i of 2N) every device does
                the same work: its diagonal block, then N-1 half blocks.
``ulysses``     all-to-all from sequence-split to head-split, full-sequence attention on H/N heads,
                all-to-all back (DeepSpeed-Ulysses). Needs heads and KV heads divisible by N
                (times the tensor size).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.layers.attention import causal_attention

NEG = -1e30
STRATEGIES = ("all_gather", "ring", "ulysses")


def zigzag_order(t: int, n: int) -> np.ndarray:
    """Global positions in zig-zag layout: the sequence in 2n chunks, device i gets chunks i, 2n-1-i."""
    if t % (2 * n):
        raise ValueError(f"zig-zag needs the sequence ({t}) divisible by 2 x seq ({2 * n})")
    c = t // (2 * n)
    chunks = np.arange(t).reshape(2 * n, c)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def ring_schedule(n: int, zigzag: bool) -> list[list[tuple[str, str]]]:
    """For each device, the (query rows, key rows) blocks the ring computes, step by step.

    Rows are ``"all"``, ``"lo"`` (first local chunk) or ``"hi"`` (second); blocks hidden by the
    causal mask are left out. This is the schedule :func:`ring_attention` follows.
    """
    sched = []
    for i in range(n):
        steps = [("all", "all")]  # step 0: the local block (causal inside)
        for s in range(1, n):
            j = (i - s) % n
            if zigzag:
                steps.append(("all", "lo") if j < i else ("hi", "all"))
            elif j < i:
                steps.append(("all", "all"))
        sched.append(steps)
    return sched


@functools.partial(jax.checkpoint, static_argnums=(6,))
def _update(carry, q, k, v, q_pos, k_pos, scale):
    """Online-softmax update of (o, m, l) with one K/V block; q [B,Tq,KV,G,D], k/v [B,Tk,KV,D].

    Rematerialised: the backward recomputes the block's scores instead of keeping them for every
    ring step, so memory holds one ``[Tq, Tk]`` block at a time (as flash / ring attention do)."""
    o, m, l = carry
    s = jnp.einsum("btkgd,bskd->bkgts", q, k).astype(jnp.float32) * scale
    mask = q_pos[:, None] >= k_pos[None, :]
    s = jnp.where(mask, s, NEG)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    o = o * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v)
    return o, m_new, l


def _rows(carry, sl):
    o, m, l = carry
    return o[:, sl], m[..., sl], l[..., sl]


def _set_rows(carry, part, sl):
    o, m, l = carry
    po, pm, pl = part
    return o.at[:, sl].set(po), m.at[..., sl].set(pm), l.at[..., sl].set(pl)


def ring_attention(q, k, v, q_pos, k_pos, *, axis: str, zigzag: bool):
    """Per-device ring attention (call inside shard_map). q [B,T,H,D], k/v [B,T,KV,D], pos [T]."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    n = jax.lax.axis_size(axis)
    i = jax.lax.axis_index(axis)
    scale = float(1.0 / np.sqrt(d))
    qg = q.reshape(b, t, kv, g, d)
    carry = (jnp.zeros((b, t, kv, g, d), jnp.float32), jnp.full((b, kv, g, t), NEG, jnp.float32),
             jnp.zeros((b, kv, g, t), jnp.float32))
    carry = _update(carry, qg, k, v, q_pos, k_pos, scale)
    half = t // 2
    lo, hi = slice(0, half), slice(half, t)
    perm = [(r, (r + 1) % n) for r in range(n)]

    def step(s, state):
        carry, k, v, k_pos = state
        k, v, k_pos = jax.lax.ppermute((k, v, k_pos), axis, perm)
        j = (i - s) % n
        if zigzag:
            def low_keys(c):  # the sender's first chunk precedes both of our chunks
                return _update(c, qg, k[:, lo], v[:, lo], q_pos, k_pos[lo], scale)

            def high_queries(c):  # our second chunk follows both of the sender's chunks
                part = _update(_rows(c, hi), qg[:, hi], k, v, q_pos[hi], k_pos, scale)
                return _set_rows(c, part, hi)

            carry = jax.lax.cond(j < i, low_keys, high_queries, carry)
        else:
            carry = jax.lax.cond(j < i, lambda c: _update(c, qg, k, v, q_pos, k_pos, scale), lambda c: c, carry)
        return carry, k, v, k_pos

    carry, *_ = jax.lax.fori_loop(1, n, step, (carry, k, v, k_pos))
    o, _, l = carry
    out = o / jnp.moveaxis(l, -1, 1)[..., None]
    return out.reshape(b, t, h, d).astype(q.dtype)


def all_gather_attention(q, k, v, q_pos, k_pos, *, axis: str):
    k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    kp_all = jax.lax.all_gather(k_pos, axis, axis=0, tiled=True)
    return causal_attention(q, k_all, v_all, q_pos, kp_all)


def ulysses_attention(q, k, v, q_pos, k_pos, *, axis: str):
    def to_heads(x):  # [B, T/N, H, D] -> [B, T, H/N, D]
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    pos = jax.lax.all_gather(q_pos, axis, axis=0, tiled=True)
    out = causal_attention(to_heads(q), to_heads(k), to_heads(v), pos, pos)
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def sequence_parallel_attention(q, k, v, positions, rules, strategy: str, zigzag: bool = True):
    """Causal attention of sequence-split ``q [B,T,H,D]``, ``k, v [B,T,KV,D]`` (global arrays) over
    ``seq``; ``positions [T]`` are the global positions of the (possibly zig-zag ordered) tokens."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown seq attention strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    p = rules.params
    qs = p.spec(("batch", "length", "act_heads", "act_head_dim"))
    ks = p.spec(("batch", "length", "act_kv_heads", "act_head_dim"))
    ps = p.spec(("length",))
    kernel = {"all_gather": all_gather_attention, "ulysses": ulysses_attention,
              "ring": functools.partial(ring_attention, zigzag=zigzag)}[strategy]
    # check_vma=False for the ring: under vmap (pipeline stages) JAX 0.10's varying-axes check
    # rejects the loop's online-softmax update; every input here is split over `seq` and the only
    # cross-device ops are the explicit ppermutes, so the check adds nothing to correctness.
    fn = jax.shard_map(lambda q, k, v, pos: kernel(q, k, v, pos, pos, axis="seq"), mesh=p.mesh,
                       in_specs=(qs, ks, ks, ps), out_specs=qs, check_vma=strategy != "ring")
    return fn(q, k, v, positions)
