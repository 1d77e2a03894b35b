"""Dropless experts at the cost of the routed assignments: a grouped matmul over the assignments sorted
by expert (:func:`sorted_experts`) and, with the experts split over mesh axes, the sorted rows exchanged
in all-to-all rounds (:func:`exchanged_experts`, differentiable through :func:`sum_rounds`). Used by
:class:`jaxpar.layers.MoE` with ``dispatch="sorted"``; see :mod:`jaxpar.layers.moe` for the math.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers.mlp import Kind
from jaxpar.layers.mlp import activate as _ffn
from jaxpar.layers.remat import keep_all_but_selection


GROUPED_MATMUL = ("auto", "tiles", "ragged_dot")


def grouped_matmul_impl(choice: str, platform: str) -> str:
    """The grouped matmul ``moe.grouped_matmul`` runs on ``platform``: ``auto`` is ``ragged_dot`` on TPU
    (Mosaic's grouped GEMM) and ``tiles`` elsewhere: XLA:GPU and XLA:CPU expand ``jax.lax.ragged_dot`` into
    a dense matmul over every expert (E/top_k x the routed flops and an ``[E, rows, d]`` temporary; on an
    H200, 128 experts x 16384 assignments of d = 2048: 100 ms and 24.8 GiB of temporaries forward and
    backward, against 23 ms and 0.66 GiB in tiles)."""
    if choice not in GROUPED_MATMUL:
        raise ValueError(f"moe.grouped_matmul={choice!r}: choose one of {', '.join(GROUPED_MATMUL)}")
    if choice == "auto":
        return "ragged_dot" if platform == "tpu" else "tiles"
    return choice


def tile_rows(assignments: int, n_experts: int, platform: str = "cpu") -> int:
    """Rows per tile of the tiled grouped matmul; each expert's rows are padded to a multiple of it.

    On CPU the padding (at most ``E * (m - 1)`` rows) stays within 1/8 of the assignments: a tile costs
    its rows. On an accelerator each tile is a step of a loop whose matmuls are separate kernels with a
    fixed cost (about 60 us forward and backward per tile on an H200), so the tile is the mean rows per
    expert rounded up to a power of two, at most 256: measured on an H200 (128 experts, d = 2048, expert
    width 768, forward and backward), 16384 assignments took 72.7 ms in tiles of 16 (the CPU rule), 23.0
    ms in tiles of 128 and 22.0 in tiles of 256; 65536 assignments 55.8 ms in tiles of 128 and 43.6 in
    tiles of 256."""
    if platform == "cpu":
        return max(1, min(128, assignments // (8 * n_experts)))
    mean = max(1, -(-assignments // n_experts))
    return min(256, 1 << (mean - 1).bit_length())


def tile_count(assignments: int, n_experts: int, m: int) -> int:
    """Tiles of ``m`` rows that hold ``assignments`` rows of ``n_experts`` experts, each expert's rows padded
    to a multiple of ``m``, whatever the routing: the padded buffer's static size."""
    return -(-(assignments + n_experts * (m - 1)) // m)


def round_rows(assignments: int, ep: int, chunk: float) -> int:
    """Rows each device sends each of its ``ep`` peers per exchange round of :func:`exchanged_experts`:
    ``chunk`` x the balanced share of its ``assignments``."""
    return max(1, math.ceil(chunk * assignments / ep - 1e-9))


def tiles_per_step(m: int, platform: str, expert_weights: int) -> int:
    """Tiles of ``m`` rows the tiled grouped matmul runs per loop step, as one batched matmul over their
    experts' weights: gathered (a copy of ``tiles x expert_weights``, ``d x (2) f + f x d`` each) and, in
    the backward, their gradients scattered back (added into the experts' float32 gradient).

    On CPU 1: a tile costs its rows. On an accelerator a loop step's kernels have a fixed cost, which
    batching shares, while the gather and the scatter-add grow with the experts' size: up to 2048 rows'
    worth of tiles, at most 8, and at most 2^26 gathered weights. Measured on an H200 (forward and
    backward): Qwen3-30B-A3B's experts (2048 x 1536 + 768 x 2048 = 4.7M weights), 65536 assignments in
    tiles of 256: 43.6 ms one tile a step, 35.9 four, 32.7 eight (a 4-layer model's train step 276.7 ->
    230.8 ms); DeepSeek-V3's (7168 x 4096 + 2048 x 7168 = 44M weights), 8 a step: its step 268.5 -> 309.8
    ms, so one (the rule's 2^26 / 44M)."""
    if platform == "cpu":
        return 1
    return max(1, min(8, 2048 // m, (1 << 26) // max(1, expert_weights)))


def sorted_experts(x, experts, gates, w_in, w_out, kind: Kind, impl: str = "tiles", b_in=None,
                   platform: str | None = None):
    """Dropless experts at the cost of the routed assignments: ``x [G, d]``, ``experts``/``gates [G, k]``
    -> ``y [G, d] = sum_j gates_tj FFN_{experts_tj}(x_t)``.

    The ``G*k`` assignments are sorted by expert (stable), so each expert's rows are contiguous, and the
    experts run as a grouped matmul: ``impl="ragged_dot"`` is ``jax.lax.ragged_dot`` (Mosaic's grouped
    GEMM on TPU; XLA:GPU and XLA:CPU expand it to a dense matmul over every expert, see
    :func:`grouped_matmul_impl`), ``"tiles"`` pads each expert's rows to a multiple of :func:`tile_rows`
    (by ``platform``, default: the first device's) and scans over the tiles, each one expert's matmul
    (:func:`tiles_per_step` of them per step, batched): compute ``<= (G*k + E*(m-1)) * FFN`` (and the last
    step's padding tiles), whatever the routing. Results are unsorted and combined with
    the gates. ``b_in [E, (2,) f]``: the up projections' biases (GPT-OSS), or None.
    """
    if impl not in ("tiles", "ragged_dot"):
        raise ValueError(f"sorted_experts(impl={impl!r}): choose tiles or ragged_dot")
    g, d = x.shape
    k, e = experts.shape[1], w_in.shape[0]
    a = g * k
    flat, order, xs = _by_expert(x, experts)
    sizes = jnp.bincount(flat, length=e).astype(jnp.int32)     # rows of each expert
    fused = w_in.reshape(e, d, -1)                             # [E, d, (2) f]
    if impl == "ragged_dot":
        h = jax.lax.ragged_dot(xs, fused, sizes).reshape(a, *w_in.shape[2:])
        if b_in is not None:
            h = h + jnp.take(b_in, flat[order], axis=0)
        ys = jax.lax.ragged_dot(_ffn(checkpoint_name(h, "mlp_up"), kind), w_out, sizes)
    else:
        platform = platform or jax.devices()[0].platform
        m = tile_rows(a, e, platform)
        padded = (sizes + m - 1) // m * m
        ends = jnp.cumsum(padded)
        se = flat[order]
        dest = (ends - padded)[se] + jnp.arange(a) - (jnp.cumsum(sizes) - sizes)[se]   # row in the padded buffer
        n_tiles = tile_count(a, e, m)
        per = min(tiles_per_step(m, platform, fused.shape[1] * fused.shape[2] + w_out.shape[1] * w_out.shape[2]),
                  n_tiles)
        n_tiles = -(-n_tiles // per) * per     # whole steps: the last step's extra tiles hold zeros
        # unique_indices (dest is one-to-one): JAX's derivative of a scatter that may repeat indices scatters
        # the updates' ids to find the winner, two u32 buffers of the operand's size more
        buf = jnp.zeros((n_tiles * m, d), x.dtype).at[dest].set(xs, unique_indices=True)
        # the expert whose padded rows hold tile j: how many experts end at or before its first row
        # (a comparison, not jnp.searchsorted, which does not trace inside shard_map with check_vma)
        owner = jnp.minimum(jnp.sum(ends[None, :] <= (jnp.arange(n_tiles) * m)[:, None], axis=1), e - 1)

        t = "t" if per > 1 else ""                             # a step's tiles: [per, m, d] and ids [per], or one

        def tile(_, inp):
            rows, i = inp
            h = jnp.einsum(f"{t}md,{t}dh->{t}mh", rows, fused[i]).reshape(*rows.shape[:-1], *w_in.shape[2:])
            if b_in is not None:
                h = h + (b_in[i][:, None] if per > 1 else b_in[i])
            return None, jnp.einsum(f"{t}mf,{t}fd->{t}md", _ffn(checkpoint_name(h, "mlp_up"), kind), w_out[i])

        # the backward selects each tile's expert weights again: kept, fused[i] and w_out[i] would be a copy of
        # the experts' weights per tile ([n_tiles, d, (2) f], tens of GiB for fine-grained experts), not the
        # tile's activations ([m, (2) f]); everything else is kept as without the checkpoint (no matmul redone)
        tile = jax.checkpoint(tile, policy=keep_all_but_selection, prevent_cse=False)
        steps = (buf.reshape(n_tiles // per, per, m, d), owner.reshape(-1, per)) if per > 1 else (
            buf.reshape(n_tiles, m, d), owner)
        _, out = jax.lax.scan(tile, None, steps)
        ys = jnp.take(out.reshape(n_tiles * m, d), dest, axis=0)
    return _combine(checkpoint_name(ys, "mlp_down"), order, gates)


def _by_expert(x, experts):
    """The ``G*k`` assignments sorted by expert (stable): their expert ids ``[A]`` (assignment order), the
    sorting permutation and the tokens ``[A, d]`` in sorted order."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    return flat, order, jnp.take(x, order // experts.shape[1], axis=0)


def _combine(ys, order, gates):
    """Results ``[A, d]`` in sorted order -> ``y [G, d] = sum_j gates_tj * result of (t, j)``."""
    g, k = gates.shape
    y = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)   # back to assignment order (a permutation)
    return jnp.einsum("gkd,gk->gd", y.reshape(g, k, -1), gates)


def _accumulate(term, n):
    """``sum_{r < n} term(r)`` (pytrees) for a traced ``n >= 1``: round 0, then a ``while_loop``."""
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jax.tree.map(jnp.add, c[1], term(c[0]))),
                              (1, term(0)))[1]


def _sum_rounds_impl(body, n, plan, *args):
    return _accumulate(lambda r: body(r, plan, *args), n)



@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sum_rounds(body, n, plan, *args):
    """``sum_{r < n} body(r, plan, *args)`` for a traced round count ``n >= 1``, differentiable in ``args``.

    A ``while_loop`` with a data-dependent trip count has no reverse-mode derivative in JAX; this one's
    backward is a second loop over the same rounds that accumulates each round's ``jax.vjp`` (the round's
    forward runs again there: its collectives are re-issued, nothing per round is stored). ``plan`` is
    integer data (no gradient); ``body`` must give every round the same output type."""
    return _sum_rounds_impl(body, n, plan, *args)


def _sum_rounds_fwd(body, n, plan, *args):
    return _sum_rounds_impl(body, n, plan, *args), (n, plan, args)


def _sum_rounds_bwd(body, res, ct):
    n, plan, args = res

    def grads(r):
        return jax.vjp(lambda *a: body(r, plan, *a), *args)[1](ct)

    return (None, None, *_accumulate(grads, n))


sum_rounds.defvjp(_sum_rounds_fwd, _sum_rounds_bwd)


def exchanged_experts(x, experts, gates, w_in, w_out, kind: Kind, *, axes: tuple, ep: int, chunk: float = 1.25,
                      impl: str = "tiles", b_in=None):
    """Dropless experts split over the mesh axes ``axes`` (``ep`` devices, ``w_in [E/ep, ...]`` the local
    experts): ``x [G, d]``, ``experts``/``gates [G, k]`` (global expert ids) -> ``y [G, d]`` as
    :func:`sorted_experts` computes it on one device. Call inside ``shard_map`` (manual over ``axes``).

    1. The ``A = G*k`` assignments are sorted by expert, hence by the device holding it; the per-expert
       counts ``[ep, E/ep]`` go first, in one small all-to-all, so each device knows what it receives.
    2. The rows move in *rounds*: each round every device sends each peer up to ``c = ceil(chunk*A/ep)``
       of its rows (one all-to-all of ``[ep, c, d]``: ``chunk`` x the balanced share), the receiver
       runs its experts on the ``ep*c`` rows as one grouped matmul (:func:`sorted_experts`, padding rows
       gated 0) and a second all-to-all returns the results. The number of rounds is the largest
       ``ceil(rows to one peer / c)`` over the expert group (a ``pmax``): 1 for balanced routing, at most
       ``ceil(ep/chunk)`` when every row goes to one device. Each round's buffers are ``[ep, c, d]``, so
       memory and bytes per round follow the routed rows, never ``E*G`` slots.

    ``b_in [E/ep, (2,) f]``: the local experts' up biases, or None.

    This padded exchange runs on every backend (``jax.lax.ragged_all_to_all`` does not compile on
    XLA:CPU); its padding is bounded by the largest per-peer count of the round, rounded up to ``c``.
    """
    g, d = x.shape
    k, el = experts.shape[1], w_in.shape[0]
    a = g * k
    flat, order, xs = _by_expert(x, experts)                   # grouped by expert, so by destination device
    sizes = jnp.bincount(flat, length=el * ep).astype(jnp.int32).reshape(ep, el)   # to device j, its expert i
    recv = jax.lax.all_to_all(sizes, axes, 0, 0, tiled=True)                     # from device j, my expert i
    send = jnp.sum(sizes, axis=1)
    c = round_rows(a, ep, chunk)
    n = jax.lax.pmax(jnp.max((send + c - 1) // c), axes)
    plan = (jnp.cumsum(send) - send, send, jnp.cumsum(recv, axis=1))

    def one_round(r, plan, xs, w_in, w_out, b_in):
        start, count, ends = plan
        q = r * c + jnp.arange(c)                              # my rows' positions in each peer's stream
        valid = q[None, :] < count[:, None]                    # [ep, c]
        # the padding's rows: past the end (read as 0, written nowhere), each its own, so rows stay unique
        rows = jnp.where(valid, start[:, None] + q[None, :], a + jnp.arange(ep * c).reshape(ep, c))
        out = jnp.take(xs, rows, axis=0, mode="fill", fill_value=0)
        got = jax.lax.all_to_all(out, axes, 0, 0, tiled=True)  # [ep, c, d]: peer j's rows for my experts
        lid = jnp.sum(ends[:, None, :] <= q[None, :, None], axis=-1).reshape(ep * c, 1)   # local expert; el: pad
        ys = sorted_experts(got.reshape(ep * c, d), jnp.minimum(lid, el - 1), (lid < el).astype(xs.dtype),
                            w_in, w_out, kind, impl, b_in)
        back = jax.lax.all_to_all(ys.reshape(ep, c, d), axes, 0, 0, tiled=True)    # my rows' results
        return jnp.zeros((a, d), ys.dtype).at[rows].set(back, mode="drop", unique_indices=True)

    return _combine(checkpoint_name(sum_rounds(one_round, n, plan, xs, w_in, w_out, b_in), "mlp_down"), order, gates)


def _vma(v) -> frozenset:
    """The mesh axes ``v`` varies over inside ``shard_map``: ``.manual_axis_type.varying`` (jax 0.10),
    ``.vma`` (other versions)."""
    t = jax.typeof(v)
    return t.manual_axis_type.varying if hasattr(t, "manual_axis_type") else t.vma


def varying(v, axes):
    """``v`` made varying over those of ``axes`` it is not yet varying over (``jax.lax.pcast``)."""
    missing = tuple(a for a in axes if a not in _vma(v))
    return jax.lax.pcast(v, missing, to="varying") if missing else v
