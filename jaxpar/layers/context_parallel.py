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

Kernels (``model.attention``, :mod:`jaxpar.layers.attention_ops`): ``all_gather`` and ``ulysses``
run their local attention with the chosen kernel (cuDNN / Pallas flash where the platform has
it): ulysses' is plain causal; all_gather's is causal shifted by the device's first position
(cuDNN takes that shift as a mask, the static Pallas masks as one kernel per device picked with
``lax.switch``). The ring keeps its XLA blocks: combining blocks needs each block's softmax
statistics (log-sum-exp) *with their gradient*, and neither fused kernel gives that through JAX's
public API (cuDNN's ``return_residual`` statistics get no cotangent in its VJP; the Pallas kernels
refuse to differentiate when they return them). Each ring block is an online-softmax update
rematerialised in the backward, so its memory is one ``[T/N, T/N]`` block per head group (with the
layers rematerialised; without remat the loop over the hops still keeps each hop's: see :func:`_update`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar.layers.attention_ops import NEG, attention, in_window, same_segment
from jaxpar.layers.precision import f32_einsum
from jaxpar.partitioning import active_rules

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


def _update(carry, q, k, v, q_pos, k_pos, scale, window=None, q_seg=None, k_seg=None):
    """Online-softmax update of (o, m, l) with one K/V block; q [B,Tq,KV,G,D], k/v [B,Tk,KV,D]; keys
    outside the sliding ``window`` (when > 0) or of another document (segment ids ``[B, Tq]``,
    ``[B, Tk]``, when given) are masked like the causal future.

    Rematerialised: the backward recomputes the block's scores instead of keeping them for every
    ring step, so memory holds one ``[Tq, Tk]`` block at a time (as flash / ring attention do). A
    custom derivative: a policy of an enclosing checkpoint (a pipeline stage's under ``model.remat=none``,
    :func:`jaxpar.layers.remat.select_remat`) overrides a nested ``jax.checkpoint``'s, and kept the scores
    of every block of every layer. And inside a ``jax.checkpoint`` too: in a layer rematerialised with a
    policy (``model.remat=full`` ...) the ``lax.cond`` that skips a hidden block kept the scores and masks
    of every hop without it (``configs/long_context.yaml``: 1.50 -> 0.47 GiB per device). (Without remat,
    inside the layers' scan, the hops' blocks are still kept: not found why.)"""
    static = window is None or isinstance(window, int)

    def update(carry, q, k, v, q_pos, k_pos, w, q_seg, k_seg):
        return _block(carry, q, k, v, q_pos, k_pos, scale, window if static else w, q_seg, k_seg)

    def fwd(*args):
        return update(*args), args

    def bwd(args, g):
        carry, q, k, v, *rest = args
        _, pullback = jax.vjp(lambda c, q, k, v: update(c, q, k, v, *rest), carry, q, k, v)
        return (*pullback(g), *(None,) * len(rest))

    f = jax.custom_vjp(update)
    f.defvjp(fwd, bwd)
    f = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)  # (see above)
    return f(carry, q, k, v, q_pos, k_pos, None if static else window, q_seg, k_seg)


def _block(carry, q, k, v, q_pos, k_pos, scale, window, q_seg, k_seg):
    """:func:`_update`'s arithmetic."""
    o, m, l = carry
    s = f32_einsum("btkgd,bskd->bkgts", q, k) * scale
    mask = in_window(q_pos[:, None], k_pos[None, :], window)
    if q_seg is not None:
        mask = (mask & same_segment(q_seg, k_seg))[:, None, None]
    s = jnp.where(mask, s, NEG)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + p.sum(-1)
    o = o * jnp.moveaxis(corr, -1, 1)[..., None] + f32_einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v)
    return o, m_new, l


def _rows(carry, sl):
    o, m, l = carry
    return o[:, sl], m[..., sl], l[..., sl]


def _set_rows(carry, part, sl):
    o, m, l = carry
    po, pm, pl = part
    return o.at[:, sl].set(po), m.at[..., sl].set(pm), l.at[..., sl].set(pl)


def ring_attention(q, k, v, q_pos, k_pos, *, axis: str, zigzag: bool, scale: float | None = None, window=None,
                   q_seg=None, k_seg=None, sinks=None):
    """Per-device ring attention (call inside shard_map). q, k [B,T,H|KV,D], v [B,T,KV,Dv], pos [T].

    With a sliding ``window`` (> 0; a Python int or a traced scalar) a block whose every key is at
    least ``window`` positions behind every query is skipped (a ``lax.cond``: no work, only its hop),
    so short windows do less work, not just more masking. Likewise with packed documents (segment ids
    ``q_seg``, ``k_seg [B, T]``; the keys' travel with them): a block in which no query shares a
    document with a visible key is skipped, so short documents do less work. Attention sinks (``sinks
    [H]``, this device's heads) start the online softmax as a block of one logit per head and no value.

    Communication overlaps computation: each K/V block is passed on to the next device *before*
    it is used, so the ``ppermute`` of step s+1's block runs while step s's block is computed (the
    first hop while the local block is). N-1 hops of K, V and their positions in all.
    """
    b, t, h, d = q.shape
    kv = k.shape[2]
    g = h // kv
    n = jax.lax.axis_size(axis)
    i = jax.lax.axis_index(axis)
    scale = float(1.0 / np.sqrt(d)) if scale is None else float(scale)
    qg = q.reshape(b, t, kv, g, d)
    dv = v.shape[-1]  # the values' width (MLA's differs from the queries')
    if sinks is None:
        carry = (jnp.zeros((b, t, kv, g, dv), jnp.float32), jnp.full((b, kv, g, t), NEG, jnp.float32),
                 jnp.zeros((b, kv, g, t), jnp.float32))
    else:  # the sink as a first block: one logit per head, of weight exp(0) = 1 at its own maximum, and no value
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, kv, g, 1), (b, kv, g, t))
        carry = (jnp.zeros((b, t, kv, g, dv), jnp.float32), m0, jnp.ones((b, kv, g, t), jnp.float32))
    half = t // 2
    lo, hi = slice(0, half), slice(half, t)
    perm = [(r, (r + 1) % n) for r in range(n)]

    windowed = not (window is None or (isinstance(window, int) and window <= 0))

    def update(c, qg, k, v, qp, kp, qs, ks):  # a block; skipped when the window or the documents hide all of it
        if not windowed and qs is None:
            return _update(c, qg, k, v, qp, kp, scale)
        w = window if windowed else None
        if qs is None:
            hidden = (window > 0) & (jnp.min(qp) - jnp.max(kp) >= window)
        else:  # no (query, key) pair of any row both visible and of one document
            hidden = ~jnp.any(in_window(qp[:, None], kp[None, :], w) & same_segment(qs, ks))
        return jax.lax.cond(hidden, lambda c: c, lambda c: _update(c, qg, k, v, qp, kp, scale, w, qs, ks), c)

    def block(s, carry, k, v, k_pos, k_seg):
        """Combine the block of device (i - s) into the local output (skipping what the mask hides)."""
        j = (i - s) % n
        lo_seg = None if k_seg is None else k_seg[:, lo]
        hi_seg = None if q_seg is None else q_seg[:, hi]
        if zigzag:
            def low_keys(c):  # the sender's first chunk precedes both of our chunks
                return update(c, qg, k[:, lo], v[:, lo], q_pos, k_pos[lo], q_seg, lo_seg)

            def high_queries(c):  # our second chunk follows both of the sender's chunks
                part = update(_rows(c, hi), qg[:, hi], k, v, q_pos[hi], k_pos, hi_seg, k_seg)
                return _set_rows(c, part, hi)

            return jax.lax.cond(j < i, low_keys, high_queries, carry)
        return jax.lax.cond(j < i, lambda c: update(c, qg, k, v, q_pos, k_pos, q_seg, k_seg), lambda c: c, carry)

    travel = (k, v, k_pos) if k_seg is None else (k, v, k_pos, k_seg)  # what each hop sends
    if n > 1:
        incoming = jax.lax.ppermute(travel, axis, perm)  # first hop, in flight during the local block
    # the local block (causal inside)
    carry = _update(carry, qg, k, v, q_pos, k_pos, scale, window, q_seg, k_seg)

    def unpack(sent):
        return sent if k_seg is not None else (*sent, None)

    def step(s, state):
        carry, block_kv = state
        onward = jax.lax.ppermute(block_kv, axis, perm)  # pass it on first; the next step needs it
        return block(s, carry, *unpack(block_kv)), onward

    if n > 1:
        carry, last = jax.lax.fori_loop(1, n - 1, step, (carry, incoming))
        carry = block(n - 1, carry, *unpack(last))
    o, _, l = carry
    out = o / jnp.moveaxis(l, -1, 1)[..., None]
    return out.reshape(b, t, h, dv).astype(q.dtype)


def all_gather_attention(q, k, v, pos, *, axis: str, kernel: str, scale: float | None = None, window=None,
                         seg=None, sinks=None):
    """Local queries over the gathered K/V: ``kernel``'s causal mask shifted by this device's first
    position (by explicit positions when the tokens are not in order); segment ids ``seg [B, T/N]``
    (packed documents) gathered with the keys."""
    k_all = jax.lax.all_gather(k, axis, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axis, axis=1, tiled=True)
    kw: dict[str, Any] = dict(scale=scale, window=window, sinks=sinks)
    if seg is not None:
        kw.update(q_seg=seg, k_seg=jax.lax.all_gather(seg, axis, axis=1, tiled=True))
    if pos is not None:
        return attention(q, k_all, v_all, kernel, q_pos=pos, k_pos=jax.lax.all_gather(pos, axis, axis=0, tiled=True),
                         **kw)
    t, i = q.shape[1], jax.lax.axis_index(axis)
    if kernel == "pallas":  # its mask is static: one kernel per device's offset, the right one picked at run time
        branches = [functools.partial(attention, kernel=kernel, q_offset=j * t, **kw)
                    for j in range(jax.lax.axis_size(axis))]
        return jax.lax.switch(i, branches, q, k_all, v_all)
    return attention(q, k_all, v_all, kernel, q_offset=i * t, **kw)


def ulysses_attention(q, k, v, pos, *, axis: str, kernel: str, scale: float | None = None, window=None,
                      seg=None, sinks=None):
    """All-to-all from sequence-split to head-split, whole-sequence attention, and back (segment ids of
    packed documents gathered over the sequence)."""
    def to_heads(x):  # [B, T/N, H, D] -> [B, T, H/N, D]
        return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)

    pos = None if pos is None else jax.lax.all_gather(pos, axis, axis=0, tiled=True)
    seg = None if seg is None else jax.lax.all_gather(seg, axis, axis=1, tiled=True)
    if sinks is not None:  # this device's share of its heads after the all-to-all
        n = sinks.shape[0] // jax.lax.axis_size(axis)
        sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(axis) * n, n)
    out = attention(to_heads(q), to_heads(k), to_heads(v), kernel, q_pos=pos, k_pos=pos, scale=scale, window=window,
                    q_seg=seg, k_seg=seg, sinks=sinks)
    return jax.lax.all_to_all(out, axis, split_axis=1, concat_axis=2, tiled=True)


def sharded_attention(q, k, v, positions, kernel: str = "xla", *, scale: float | None = None, window=None,
                      segment_ids=None, sinks=None):
    """Causal attention of the global ``q [B,T,H,D]``, ``k, v [B,T,KV,D]`` under the active rules.

    ``positions [T]``: the tokens' global positions when they are not in order (zig-zag), else None.
    ``segment_ids [B, T]``: packed documents (a query attends within its own document), else None.
    ``scale``: the scores' multiplier (default ``1/sqrt(D)``); ``window``: a sliding window (None or 0:
    none; a Python int, or a traced scalar such as a per-layer value). ``sinks [H]``: attention sinks (a
    logit per head in the softmax; split over ``tensor`` with the heads), else None.
    Without a multi-device mesh this is :func:`attention`; with one it runs in a ``shard_map`` over
    the whole mesh (batch over the batch axes, heads over ``tensor``), every device computing its
    own heads and tokens with ``kernel``, and with ``seq`` > 1 the strategy of
    ``parallel.seq_attention`` exchanges K/V over ``seq``.
    """
    rules = active_rules()
    mesh = None if rules is None else rules.mesh
    if rules is None or mesh is None or not rules.manual_axes():
        return attention(q, k, v, kernel, q_pos=positions, k_pos=positions, scale=scale, window=window,
                         q_seg=segment_ids, k_seg=segment_ids, sinks=sinks)
    strategy = rules.seq_attention
    if strategy is None:
        def local(q, k, v, pos, window, seg, sinks):
            return attention(q, k, v, kernel, q_pos=pos, k_pos=pos, scale=scale, window=window, q_seg=seg, k_seg=seg,
                             sinks=sinks)
    elif strategy == "ring":
        def local(q, k, v, pos, window, seg, sinks):
            if pos is None:
                t = q.shape[1]
                pos = jax.lax.axis_index("seq") * t + jnp.arange(t)
            return ring_attention(q, k, v, pos, pos, axis="seq", zigzag=rules.parallel.seq_zigzag, scale=scale,
                                  window=window, q_seg=seg, k_seg=seg, sinks=sinks)
    elif strategy in STRATEGIES:
        cp = {"all_gather": all_gather_attention, "ulysses": ulysses_attention}[strategy]

        def local(q, k, v, pos, window, seg, sinks):
            return cp(q, k, v, pos, axis="seq", kernel=kernel, scale=scale, window=window, seg=seg, sinks=sinks)
    else:
        raise ValueError(f"unknown seq attention strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    p = rules.params
    qs = p.spec(("batch", "length", "act_heads", "act_head_dim"))
    ks = p.spec(("batch", "length", "act_kv_heads", "act_head_dim"))
    specs: tuple[P, ...] = (qs, ks, ks)
    args: tuple[Any, ...] = (q, k, v)
    traced_window = window is not None and not isinstance(window, (int, np.integer))
    if traced_window:  # a traced window (per layer) enters as a replicated scalar
        specs, args = specs + (P(),), args + (jnp.asarray(window, jnp.int32),)
    if positions is not None:
        specs, args = specs + (p.spec(("length",)),), args + (positions,)
    if segment_ids is not None:
        specs, args = specs + (p.spec(("batch", "length")),), args + (segment_ids,)
    if sinks is not None:
        specs, args = specs + (p.spec(("act_heads",)),), args + (sinks,)
    # check_vma=False: JAX 0.10's varying-axes check rejected the ring's online-softmax loop inside
    # pipeline stages, and fused kernels carry no varying-axes rules; every input and output is split
    # over the batch, sequence and head axes (nothing is replicated) and the only cross-device ops are
    # the explicit collectives above, so the check adds nothing to correctness.
    # manual over the axes of size > 1 only (inside a pipeline stage `pipe` is manual already): every one
    # of them splits q, k and v, so the backward has no axis to sum a replicated input's gradient over

    def body(q, k, v, *rest):
        rest = list(rest)
        w = rest.pop(0) if traced_window else window
        pos = rest.pop(0) if positions is not None else None
        seg = rest.pop(0) if segment_ids is not None else None
        sk = rest.pop(0) if sinks is not None else None
        return local(q, k, v, pos, w, seg, sk)

    manual = rules.manual_axes()
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=qs, axis_names=manual, check_vma=False)
    return fn(*args)
