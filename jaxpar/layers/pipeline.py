"""Pipeline parallelism over the ``pipe`` axis: microbatched loops of stages (GPipe, circular, 1F1B).

The stacked layers are cut into S = ``pipe`` stages; the stage dim of their weights is sharded
over ``pipe`` so that each device holds only its stage. The batch is cut into M microbatches.

Schedule (GPipe, R = 1): on iteration t every stage s applies its layers to the activation it
holds, then the activations shift one stage forward (a collective-permute over ``pipe``); stage 0
takes microbatch t, stage s works on microbatch t - s. M + S - 1 iterations; stage s idles on the
first s and last S-1-s of them, so the bubble fraction is (S-1)/(M+S-1).

Circular / interleaved (R = ``pipeline_repeats`` > 1): the L layers form S*R groups; group g sits on
stage g mod S, so every device holds R non-adjacent groups and each microbatch passes the ring of
stages R times. Microbatch m in repeat r is on stage s at iteration t = r*M + m + s; when it leaves
the last stage the ring shift takes it to stage 0, which holds it until t = (r+1)*M + m (needs M >= S).
M*R + S - 1 iterations, bubble (S-1)/(M*R+S-1). Storage is stage-major: position p of the stacked
layer dim holds layer :func:`stage_major_order` [p], so that each device's groups are contiguous.

Training (:func:`pipeline_loss` for GPipe / circular, :func:`one_f_one_b`; the model's ``Stack.loss``)
runs in a ``jax.shard_map`` manual over ``pipe``, the embedding and the loss inside (below). A
forward without the loss (:func:`pipeline`, the model's ``Stack.__call__``: logits) runs the same
schedule with no embedding and no loss: the last stage files its outputs in its own slots of its
buffer (a local write); after the loop the buffers, all but the last stage's zeroed, are summed over
``pipe`` once; every stage holds a copy of the input microbatches, so that the input's gradient is
summed over ``pipe`` once: nothing but the stage shifts crosses ``pipe`` per iteration. (Every layer
thus runs inside a stage's ``shard_map``, never under a ``vmap`` over stages, so layers whose own
``shard_map`` holds loops, as the MoE layer's sorted dispatch, run in every schedule.) Bubble
iterations compute on zeros. What each layer keeps for the backward is the stage function's business
(the model applies its ``model.remat`` policy per layer inside the stage; the stage selects an
iteration's layer group itself, so that no per-iteration copy of its weights is kept).

:func:`pipeline_loss` (GPipe / circular; the scan's transpose is its backward) and :func:`one_f_one_b`
(1F1B; its loss without differentiation is :func:`pipeline_loss`) run the schedule in a
``jax.shard_map`` manual over ``pipe`` (every other mesh axis stays the compiler's; the layers see
:meth:`~jaxpar.partitioning.RuleSet.manual_pipe` rules, whose names leave ``pipe`` out): each device
holds its own stage and its own buffers, the embedding's result counts on the first stage only and
the head's and loss's on the last only. What crosses ``pipe``: the stage shifts, and once per step
the embedding's / head's gradients and the loss summed over the stages (each nonzero on one stage);
never the batch or a stage's weights. The embedding's gather runs on the first stage only and the
head's matmuls on the last only (:func:`~jaxpar.layers.onstage.only_where`: a ``lax.cond`` on the stage
inside the layer's ``shard_map``, holding no collective; the layer's collectives, and everything else
of the embedding and the head, run on every stage, on zeros where they do not count), and the results
are selected. Bubble work runs on zeros (a per-device branch around a stage, whose layers hold
collectives, would let XLA:CPU's runtime issue them out of order: see :mod:`jaxpar.layers.onstage`).
Forwards and backwards interleave, the stage inputs of at most 2S - 1 microbatches held per stage.
Long by design: the schedules share their shifts, buffers and schedule grids here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec as P

from jaxpar.layers.loss import min_chunks
from jaxpar.layers.onstage import only_where
from jaxpar.layers.residuals import Residuals, slot_reader
from jaxpar.partitioning import RuleSet, active_rules, constrain, use_rules


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    return (stages - 1) / (microbatches * repeats + stages - 1)


def group_of(s: int, r: int, stages: int, v: bool = False) -> int:
    """The layer group of stage s's r-th chunk: r S + s round a ring, or with ``v`` (ZB-V) down the stages and
    back up, stage s holding groups s and 2S - 1 - s (odd r: the way up)."""
    return r * stages + (stages - 1 - s if v and r % 2 else s)


def stage_major_order(n_layers: int, stages: int, repeats: int, counts=None, v: bool = False) -> np.ndarray:
    """``order[p]`` = the layer stored at position p: stage s holds groups s, s+S, s+2S, ... (``v``: s, 2S-1-s,
    :func:`group_of`). With ``counts`` (:func:`~jaxpar.partitioning.layer_groups`: the layers of each group,
    uneven) every group is stored in max(counts) slots, its layers first: the others hold -1 (padding,
    :mod:`jaxpar.layers.stack`)."""
    g = stages * repeats
    counts = tuple(counts) if counts is not None else (n_layers // g,) * g
    lg, start = max(counts), np.concatenate([[0], np.cumsum(counts)])
    grp = [[group_of(s, r, stages, v) for r in range(repeats)] for s in range(stages)]
    return np.array([start[grp[s][r]] + j if j < counts[grp[s][r]] else -1
                     for s in range(stages) for r in range(repeats) for j in range(lg)])


def _rules() -> RuleSet:
    rules = active_rules()
    if rules is None:
        raise RuntimeError("the pipeline runs under jaxpar rules (partitioning.use_rules) on a mesh with a pipe axis")
    return rules


def pipeline(stage_fn, params, x: jax.Array, *, stages: int, repeats: int, microbatches: int,
             outputs: bool = False):
    """The stack's output for ``x [B, ...]`` (``(y, ys)`` with ``outputs``: the per-layer outputs averaged
    over microbatches, in storage order), for a forward only (logits); the training loss runs the
    embedding and the head inside the pipeline (:func:`pipeline_loss`, :func:`one_f_one_b`). The
    schedule of :func:`pipeline_loss`, in the same ``shard_map`` manual over ``pipe``, with the identity
    for the embedding and no loss: the last stage's outputs, the others' zeroed, are summed over ``pipe``
    once. ``stage_fn`` and ``params`` as there."""
    y, ys = pipeline_loss(stage_fn, lambda _, h: h, None, params, {}, x, None, stages=stages, repeats=repeats,
                          microbatches=microbatches, ys_weights={} if outputs else None)
    return (y, ys) if outputs else y


def pipeline_loss(stage_fn, first_fn, last_fn, params, outer, tokens, targets, *,
                  stages: int, repeats: int, microbatches: int, ys_weights=None, rows=None, lead_fn=None):
    """The loss of a pipelined model under GPipe (``repeats`` = 1) or the circular schedule, the
    embedding and the loss inside the pipeline; its gradient is JAX's (the scan's transpose).

    Arguments as :func:`one_f_one_b` (``params`` leaves ``[L, ...]`` in storage order, stage-major when
    ``repeats`` > 1: :func:`stage_major_order`); returns ``(loss, ys)``, ``ys`` the per-layer outputs
    averaged over microbatches, in storage order (None without ``ys_weights``). ``lead_fn`` runs on stage 0
    on each microbatch as it enters its first repeat (the scan's transpose is its backward, per microbatch).

    The schedule of :func:`schedule`, in a ``shard_map`` manual over ``pipe`` (as :func:`one_f_one_b`):
    stage 0 embeds the whole batch once before the loop and the last stage files the microbatches it
    finishes, whose loss it computes once after the loop, in chunks of at most one microbatch
    (:func:`~jaxpar.layers.loss.min_chunks`: the head's temporaries stay one microbatch's at any M);
    one weight gradient for the embedding and one for the head per step, each on its own stage, summed
    over ``pipe`` by the ``shard_map``'s transpose; the embedding's gather and the head's matmuls run on
    their stage only (:func:`~jaxpar.layers.onstage.only_where`; after the loop, so no ``lax.cond`` sits
    in the scan). A stage in the bubble computes on zeros (its results are never used; a ``lax.cond``
    around the stage would hold its layers' collectives (:mod:`jaxpar.layers.onstage`) and make the
    scan's gradient keep what the branch reads, the stage's weights included, as a residual of every
    iteration: 4.0 -> 6.4 MiB per device on the planner's ``data=4 x pipe=2`` layout). With R > 1 a
    microbatch leaving the last stage goes round the ring to stage 0, which holds it until its next
    repeat (t = (r+1) M + m; needs M >= S). What crosses ``pipe``: one ``ppermute`` of a microbatch's
    activations per iteration (M R + S - 1) and its transpose in the backward, and the embedding /
    head gradients and the loss summed over stages once.
    """
    s_, r_, m_ = stages, repeats, microbatches
    b = _rows_in(tokens)
    mb = b // m_
    rules = _rules()
    leaves, treedef = jax.tree.flatten(params)
    outer_leaves, outer_def = jax.tree.flatten(outer)
    lg = leaves[0].shape[0] // (s_ * r_)  # layers per group
    has_ys = ys_weights is not None
    tokens_mb = _split_rows(tokens, m_) if lead_fn is not None else None
    act = ("batch", "res_length", "act_embed")
    x0 = jax.eval_shape(first_fn, outer, _first(tokens, mb))
    rows_mb = _split_rows(rows, m_)

    def run_group(group_leaves, x, repeat, rows=None):  # the stage's layer group of this repeat
        return stage_fn(jax.tree.unflatten(treedef, group_leaves), x, select=(repeat * lg, lg), rows=rows)

    group = [jax.ShapeDtypeStruct((r_ * lg, *a.shape[1:]), a.dtype) for a in leaves]
    ys_shape = None
    if has_ys:
        ys_shape = jax.eval_shape(lambda g, x, r: run_group(g, x, 0, r), group, x0, _take(rows_mb, 0))[1]
    perm = [(s, (s + 1) % s_) for s in range(s_) if r_ > 1 or s + 1 < s_]

    def local(p_leaves, o_leaves, toks, tgts, rws, toks_mb):
        """One device's stage: ``p_leaves`` its layers ``[L/S, ...]``, the rest replicated over pipe."""
        s = jax.lax.axis_index("pipe")
        outer_ = jax.tree.unflatten(outer_def, o_leaves)
        # one buffer of M microbatch slots per stage: on stage 0 the embedded batch (embedded once, before the
        # loop) and, with R > 1, the microbatches waiting there for their next repeat; on the last stage the
        # outputs of the last repeat, for the loss after the loop
        with only_where(s == 0):  # the embedding's gather on the first stage only (jaxpar.layers.onstage)
            buf = _split_mb(jnp.where(s == 0, first_fn(outer_, toks).astype(x0.dtype), 0), m_, act)
        c = dict(state=jnp.zeros(x0.shape, x0.dtype), buf=buf,
                 ys=(jax.tree.map(lambda y: jnp.zeros((r_, *y.shape), jnp.float32), ys_shape) if has_ys else None))

        def iteration(c, t):
            c = dict(c)
            k = t - s  # (repeat, microbatch) k // M, k % M; none (bubble) outside [0, M R)
            ok = (k >= 0) & (k < m_ * r_)
            repeat = jnp.clip(k // m_, 0, r_ - 1)
            x = c["state"]
            if r_ > 1:  # stage 0 files what comes round the ring (from iteration t - S of the last stage)
                c["buf"] = _put(c["buf"], x, (t - s_) % m_, (s == 0) & (t >= s_))
            x = constrain(jnp.where(s == 0, c["buf"][t % m_], x), act)
            if lead_fn is not None:  # stage 0 runs the lead-in on a microbatch entering its first repeat
                led = lead_fn(outer_, x, _take(toks_mb, t % m_)).astype(x0.dtype)
                x = constrain(jnp.where((s == 0) & (t < m_), led, x), act)

            # bubble iterations too (on zeros; their results are never used: see the docstring)
            y = run_group(p_leaves, x, repeat, _take(rws, k % m_))  # the rows of this microbatch
            y, ys = y if has_ys else (y, None)
            if has_ys:
                c["ys"] = jax.tree.map(lambda a, v: _put(a, a[repeat] + v.astype(jnp.float32) / m_, repeat, ok),
                                       c["ys"], ys)
            y = constrain(y.astype(x0.dtype), act)
            # the last stage files the microbatches of the last repeat (a local write)
            c["buf"] = _put(c["buf"], y, k % m_, (s == s_ - 1) & ok & (k >= m_ * (r_ - 1)))
            c["state"] = constrain(jax.lax.ppermute(y, "pipe", perm), act)
            return c, None

        c, _ = jax.lax.scan(iteration, c, jnp.arange(m_ * r_ + s_ - 1))
        ys = None if not has_ys else jax.tree.map(lambda a: a.reshape(r_ * a.shape[1], *a.shape[2:]), c["ys"])
        if last_fn is None:  # a forward only (pipeline()): the last stage's outputs in batch order, zeros elsewhere
            # (an output of the shard_map: no constraint of the other axes' layout here; the caller's, outside)
            y = c["buf"].swapaxes(0, 1).reshape(b, *c["buf"].shape[2:])
            return jnp.where(s == s_ - 1, y, 0)[None], ys
        # the head's temporaries: one microbatch's (each chunk at most one); its matmuls on the last stage only
        with min_chunks(m_), only_where(s == s_ - 1):
            loss = last_fn(outer_, _batch_of(c["buf"], b, act), tgts).astype(jnp.float32)
        loss = jnp.where(s == s_ - 1, loss, 0.0)
        return loss[None], ys

    def body(p_leaves, o_leaves, toks, tgts, rws, toks_mb):
        with use_rules(rules.manual_pipe()):
            return local(p_leaves, o_leaves, toks, tgts, rws, toks_mb)

    stage_spec = [P("pipe")] * len(leaves)
    ys_spec = None if ys_shape is None else jax.tree.map(lambda _: P("pipe"), ys_shape)
    fn = jax.shard_map(body, mesh=rules.mesh,
                       in_specs=(stage_spec, [P()] * len(outer_leaves),
                                 *map(_whole, (tokens, targets, rows_mb, tokens_mb))),
                       out_specs=(P("pipe"), ys_spec), axis_names={"pipe"}, check_vma=False)
    # (jit: a forward run eagerly, e.g. logits outside a jitted step, would take shard_map's op-by-op path,
    # which does not support a shard_map manual over some axes only)
    losses, ys = jax.jit(fn)(leaves, outer_leaves, tokens, targets, rows_mb, tokens_mb)
    if last_fn is None:
        return constrain(jnp.sum(losses, axis=0), act), ys
    loss = jnp.sum(losses)  # the last stage's (zeros elsewhere)
    if has_ys:
        loss = loss + sum(w * jnp.sum(ys[k]) for k, w in ys_weights.items())
    return loss, ys


def _split_mb(a: jax.Array, m_: int, names) -> jax.Array:
    """``[B, ...] -> [M, B/M, ...]``: microbatch m = rows m, m+M, ... (each stays split over the batch axes)."""
    return constrain(a.reshape(a.shape[0] // m_, m_, *a.shape[1:]).swapaxes(0, 1), (None, *names))


# Token inputs, targets and per-row inputs may be pytrees of [B, T] arrays (packed documents: segment ids,
# positions, loss weights), sliced into microbatches alike.

def _rows_in(tree) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


def _first(tree, n: int):
    """The first ``n`` rows of every leaf (for shapes)."""
    return jax.tree.map(lambda a: a[:n], tree)


def _split_rows(tree, m_: int):
    """:func:`_split_mb` of every ``[B, T]`` leaf (None stays None)."""
    return None if tree is None else jax.tree.map(lambda a: _split_mb(a, m_, ("batch", "length")), tree)


def _take(tree, m):
    """Microbatch ``m`` (traced) of every ``[M, ...]`` leaf (None stays None)."""
    return None if tree is None else jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False),
                                                  tree)


def _whole(tree):
    """A ``shard_map`` spec replicating every leaf of ``tree`` over ``pipe``."""
    return jax.tree.map(lambda _: P(), tree)


def _batch_of(a: jax.Array, b: int, names) -> jax.Array:
    """``[M, B/M, ...] -> [B, ...]`` in the batch's row order (undoes :func:`_split_mb`)."""
    return constrain(a.swapaxes(0, 1).reshape(b, *a.shape[2:]), names)


def schedule(stages: int, microbatches: int, repeats: int = 1) -> list[list[tuple[int, int] | None]]:
    """``grid[s][t]``: the (microbatch, repeat) stage s works on at iteration t, or None (bubble).

    The same rule :func:`pipeline` follows: microbatch m in repeat r is on stage s at t = r*M + m + s.
    """
    iters = microbatches * repeats + stages - 1
    grid: list[list[tuple[int, int] | None]] = [[None] * iters for _ in range(stages)]
    for s in range(stages):
        for r in range(repeats):
            for m in range(microbatches):
                grid[s][r * microbatches + m + s] = (m, r)
    return grid


# -- 1F1B ------------------------------------------------------------------------------------------

def _put(buf: jax.Array, value: jax.Array, slot, ok) -> jax.Array:
    """``buf[slot] = value`` where ``ok``, else unchanged (one slot read and written either way)."""
    old = jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(ok, value, old), slot, 0)


def as_stored(dtype) -> np.dtype:
    """The dtype a stash holds values of ``dtype`` in: a 16-bit float as its bits (``uint16``). XLA:CPU runs
    bfloat16 elementwise work in float32, and a bfloat16 stash's row update (a select and a dynamic update
    slice) became a conversion of the whole stash to float32 and back: a second copy of each buffer as it is
    written (6 GiB of GPT-3 175B's interleaved stash). Bits move unconverted; on an accelerator the
    bitcasts are free."""
    dtype = np.dtype(dtype)
    return np.dtype(np.uint16) if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating) else dtype


def _stored(value: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(value, as_stored(value.dtype))


def _row(buf: jax.Array, row, dtype) -> jax.Array:
    """Row ``row`` of a stash ``buf`` (:func:`as_stored`), as ``dtype``."""
    return jax.lax.bitcast_convert_type(jax.lax.dynamic_index_in_dim(buf, row, 0, keepdims=False), dtype)


def stash_slots(stages: int, repeats: int = 1, microbatches: int | None = None) -> int:
    """Chunk inputs a 1F1B stage holds at once: stage s keeps microbatch m from its forward (iteration
    m + s) to its backward (m + 2(S-1) - s), at most 2S - 1 of them (stage 0); interleaved (R chunks
    per stage), a chunk's input from its forward to its backward, at most (R + 1) S - 1 (stage 0:
    Megatron's 2(S - 1) + (R - 1) S warm-up forwards and one more), each a microbatch's activations,
    the input of 1/R of the stage's layers. With ``microbatches`` M, at most the M R there are."""
    cap = (repeats + 1) * stages - 1
    return cap if microbatches is None else min(cap, microbatches * repeats)


def allocate(spans: dict) -> tuple[dict, int]:
    """Buffer slots for values live over ``spans`` (key -> (written, last read), in any unit of time: the
    zero-bubble grid's half slots, 1F1B's iterations): the fewest slots, a slot reused once its value's
    last read is before the next one's write."""
    free: list[int] = []
    busy: list[tuple[int, int]] = []  # (last read, slot)
    out, n = {}, 0
    for key, (w, r) in sorted(spans.items(), key=lambda kv: kv[1]):
        for end, slot in sorted(busy):
            if end < w:
                busy.remove((end, slot))
                free.append(slot)
        if free:
            slot = min(free)
            free.remove(slot)
        else:
            slot, n = n, n + 1
        out[key] = slot
        busy.append((r, slot))
    return out, max(n, 1)


@functools.lru_cache(maxsize=64)
def stash_rows(stages: int, microbatches: int, repeats: int = 1) -> np.ndarray:
    """``rows[s, k]``: the row of 1F1B's stash that holds forward slot k's chunk input (:func:`_f1b_slot`) on
    stage s, from the iteration of its forward to that of its backward (both included: an iteration runs
    its forward before its backward), rows reused as they free (:func:`allocate`): as many rows as the
    busiest stage holds inputs at once, :func:`stash_slots` (a ring of ``k % rows`` would need the span
    of the live slots, 2RS - 1 when interleaved)."""
    s_, m_, r_ = stages, microbatches, repeats
    rows = np.zeros((s_, m_ * r_), np.int32)
    for s in range(s_):
        spans = {_f1b_slot(m, r, s_, r_): (_f1b_slot(m, r, s_, r_) + s, _f1b_backward_at(m, r, s, s_, r_))
                 for m in range(m_) for r in range(r_)}
        got, _ = allocate(spans)
        for k, row in got.items():
            rows[s, k] = row
    return rows


def embed_chunk(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Microbatches whose input gradients 1F1B's first stage keeps before it takes the embedding's weight
    gradient from them: the largest divisor of M not above 2RS (the stash's size), so that they, like the
    stash, grow with the stages and not with M (Megatron's 1T run: M = 512 microbatches of [2048, 25600]
    would be 50 GiB). All M (one gradient after the loops) when M <= 2RS; else M / C gradients, each
    reduced over the batch axes in the loop."""
    cap = 2 * repeats * stages
    return max(c for c in range(1, min(microbatches, cap) + 1) if microbatches % c == 0)


def _f1b_slot(m, r, stages: int, repeats: int):
    """The forward slot of (microbatch m, chunk r) under 1F1B: its forward runs on stage s at iteration
    slot + s. Interleaved (R > 1), microbatches go in groups of S, each group through chunk 0 of every
    stage, then chunk 1, ... (Megatron's order), so that a chunk's output reaches the next chunk on
    stage 0 just in time; with R = 1 the slot is m."""
    return (m // stages) * repeats * stages + r * stages + m % stages


def _f1b_unslot(k, stages: int, repeats: int):
    """``(m, r)`` of forward slot k (the inverse of :func:`_f1b_slot`; numbers or traced arrays)."""
    rs = repeats * stages
    return (k // rs) * stages + k % stages, (k % rs) // stages


def _f1b_backward_at(m, r, s, stages: int, repeats: int):
    """The iteration of the backward of (microbatch m, chunk r) on stage s: the forward order mirrored,
    chunks last to first, starting RS - 1 + S - 1 - s iterations in (the last chunk of the last stage
    runs a microbatch's backward in the iteration of its forward)."""
    return repeats * stages - 1 + stages - 1 - s + _f1b_slot(m, repeats - 1 - r, stages, repeats)


def _used_leaves(fn, leaves: list, treedef, *args) -> list[int]:
    """Indices of the ``leaves`` that ``fn(tree, *args)`` reads (from its jaxpr), so that gradients
    and accumulators are kept for those only (an untied head does not touch the embedding table)."""
    jaxpr = jax.make_jaxpr(lambda *o: fn(jax.tree.unflatten(treedef, list(o)), *args))(*leaves).jaxpr
    read = {id(v) for e in jaxpr.eqns for v in e.invars if not hasattr(v, "val")}
    read |= {id(v) for v in jaxpr.outvars if not hasattr(v, "val")}
    return [i for i, v in enumerate(jaxpr.invars) if id(v) in read]


def one_f_one_b(stage_fn, first_fn, last_fn, params, outer, tokens, targets, *,
                stages: int, microbatches: int, primal, ys_weights=None, repeats: int = 1, rows=None, lead_fn=None,
                stage_remat: bool = True):
    """Loss and gradients of a pipelined model with the 1F1B schedule (one forward, one backward).

    ``first_fn(outer, tokens_mb) -> x_mb`` (embedding), ``stage_fn(group, x_mb) -> y_mb`` (one stage's
    layers; ``(y_mb, ys)`` with per-layer outputs when ``ys_weights`` is given) and
    ``last_fn(outer, y_mb, targets_mb) -> loss_mb`` (head and mean loss of one microbatch). ``params``
    leaves are ``[L, ...]`` (layer order, split over ``pipe``),
    ``outer`` the weights of ``first_fn`` / ``last_fn`` (shared: a tied embedding is one weight).
    ``lead_fn(outer, x_mb, tokens_mb) -> x_mb``, optional: layers that run on the first stage after the
    embedding, per microbatch inside the schedule (a MoE model's dense first layers, whose weights are in
    ``outer``): the backward of a microbatch runs through them when it leaves stage 0's first chunk (their
    forward again, their weight gradients accumulated), so that what they keep is one microbatch's; the
    embedding's weight gradient is taken once, after the loops, from the lead-in's input gradients.

    Returns ``(loss, ys)``: the mean over microbatches of ``last_fn`` plus, with ``ys_weights`` (a dict
    name -> weight over the stage's per-layer outputs ``ys``, a dict of float arrays; missing names
    weigh 0), ``sum_name weight * sum_layers ys[name]`` (e.g. a router's balance loss); ``ys`` are the
    per-layer outputs averaged over microbatches, for metrics only (no gradient flows back through
    them). Without differentiation ``primal(params, outer, tokens, targets)`` computes the same two
    values (the GPipe forward); under ``jax.grad`` the forwards and backwards run interleaved (a
    ``custom_vjp`` whose forward computes the gradients, which its backward scales). With ``repeats``
    R > 1 (interleaved 1F1B; M a multiple of S) each stage holds R chunks of its layers in storage
    order (stage-major, as the circular schedule: :func:`stage_major_order`) and a microbatch goes
    round the ring R times, in the order of :func:`_f1b_slot` (groups of S microbatches through chunk 0
    of every stage, then chunk 1, ...; backwards mirrored): M R + R S + S - 2 iterations, at most
    (R + 1) S - 1 chunk inputs held per stage (:func:`stash_rows`), the circular schedule's bubble.

    Schedule (:func:`schedule_1f1b`; R = 1): on iteration t stage s runs the forward of microbatch t - s and the
    backward of microbatch t - 2(S-1) + s, each where it exists; M + 2(S-1) iterations in two loops:
    S - 1 warm-up iterations of forwards only, then one forward and one backward per iteration (the
    forward skipped by a ``lax.cond`` on t, the same on every stage, in the last S - 1). The last stage
    runs the loss of a microbatch and its gradient as soon as its forward is done, so a stage keeps the
    inputs of at most min(M, 2S - 1) microbatches (:func:`stash_slots`): activation memory O(S), not O(M)
    as GPipe's. A stage's backward runs its forward again from the stashed input
    (``jax.vjp``, so the layers' remat policy decides what that one microbatch keeps while its backward
    runs): the stage is rematerialised as a whole, as ``model.remat=full`` would. (Stashing the
    ``jax.vjp`` residuals instead would save that forward but copy the stage's weights into every slot:
    the linearisation of a scan over layers re-emits its stacked weights as residuals.)

    The schedule runs in a ``shard_map`` manual over ``pipe`` (every other axis stays the compiler's,
    under :meth:`~jaxpar.partitioning.RuleSet.manual_pipe`): each device holds its stage's stash and
    accumulators; the embedding's result counts on the first stage only, the loss and the head's
    gradient on the last only: the embedding's gather and the head's matmuls run there only
    (:func:`~jaxpar.layers.onstage.only_where`, per microbatch; their collectives and the rest run on
    every stage, masked), bubble work on zeros. What crosses ``pipe``: one ``ppermute`` of a
    microbatch's activations forward and one of a gradient backward per iteration (2M + 3(S-1) in all:
    the warm-up sends no gradient; against the minimum 2M; interleaved 2MR + RS + 2S - 3 against 2MR),
    and once per step the sum over stages of the embedding / head gradients (each nonzero on one stage
    only) and of the loss.
    """
    s_, m_, r_ = stages, microbatches, repeats
    if r_ > 1 and m_ % s_:
        raise ValueError(f"interleaved 1F1B needs the microbatches ({m_}) to be a multiple of the stages ({s_})")
    rows_of = stash_rows(s_, m_, r_)  # a stage's stash: forward slot k in row rows_of[s, k]
    k_ = int(rows_of.max()) + 1  # stash_slots(S, R, M)
    c_ = embed_chunk(s_, m_, r_)  # input gradients kept for the embedding's weight gradient
    o = Around(first_fn, last_fn, lead_fn, params, outer, tokens, targets, rows, microbatches=m_,
               ys_weights=ys_weights)
    leaves, x0, act = o.leaves, o.x0, ACT
    lg = leaves[0].shape[0] // (s_ * r_)  # layers per chunk
    has_ys = ys_weights is not None
    n_iters = m_ * r_ + r_ * s_ + s_ - 2  # the last backward: _f1b_backward_at(M - 1, 0, 0)
    warm = r_ * s_ - 1  # iterations before the first backward (the last stage's, of microbatch 0)

    def stage(group_leaves, x, r=0, rows=None):  # chunk r of the stage's layers, each selected inside its remat
        return stage_fn(jax.tree.unflatten(o.treedef, group_leaves), x, select=(r * lg if r_ > 1 else 0, lg),
                        rows=rows)

    ys_shape = o.stage_outputs(stage, r_ * lg)
    # interleaved: the last stage's chunk r feeds stage 0's chunk r + 1 (and its gradient goes back)
    fwd_perm = [(s, (s + 1) % s_) for s in range(s_) if r_ > 1 or s + 1 < s_]
    bwd_perm = [(d, s) for s, d in fwd_perm]

    def local(p_leaves, o_leaves, toks, tgts, rws):
        """One device's stage: ``p_leaves`` its layers ``[L/S, ...]``, the rest replicated over pipe."""
        s = jax.lax.axis_index("pipe")
        row_of = jnp.asarray(rows_of)[s]  # this stage's stash row of each forward slot
        outer_ = jax.tree.unflatten(o.outer_def, o_leaves)
        res = None if stage_remat else Residuals(
            lambda kn, x: jax.vjp(lambda p, x: stage(p, x, kn[1], kn[2]), kn[0], x),
            (list(p_leaves), jnp.zeros((), jnp.int32), _take(rws, 0)), jax.ShapeDtypeStruct(x0.shape, x0.dtype))
        c = dict(
            fwd=jnp.zeros(x0.shape, x0.dtype), bwd=jnp.zeros(x0.shape, x0.dtype),
            stash=(jnp.zeros((k_, *x0.shape), as_stored(x0.dtype)) if stage_remat else
                   [jnp.zeros((k_, *a.shape), as_stored(a.dtype)) for a in res.kept]),
            dins=jnp.zeros((c_, *x0.shape), x0.dtype),
            dgroups=[jnp.zeros(a.shape, a.dtype) for a in p_leaves], douter=o.zero_grads(o_leaves),
            loss=jnp.zeros((), jnp.float32),
            ys=(jax.tree.map(lambda y: jnp.zeros((r_, *y.shape), jnp.float32), ys_shape) if has_ys else None),
        )

        def forward(t, c):
            """Forward slot t - s (:func:`_f1b_slot`: microbatch fm through chunk fr) into the stage (stage 0
            embeds the microbatch for chunk 0), its input stashed for the backward."""
            c = dict(c)
            k = jnp.clip(t - s, 0, m_ * r_ - 1)
            f_ok = (t - s >= 0) & (t - s < m_ * r_)
            fm, fr = _f1b_unslot(k, s_, r_)
            x = o.stage_input(outer_, toks, fm, (s == 0) & (fr == 0), f_ok, c["fwd"])
            if stage_remat:
                y = stage(p_leaves, x, fr, _take(rws, fm))
                c["stash"] = _put(c["stash"], _stored(x), row_of[k], f_ok)
            else:  # the forward's residuals kept for the backward (the stage not run again)
                y, kept = res.forward((list(p_leaves), fr, _take(rws, fm)), x)
                c["stash"] = [_put(buf, _stored(v), row_of[k], f_ok) for buf, v in zip(c["stash"], kept)]
            y, ys = y if has_ys else (y, None)
            if has_ys:
                c["ys"] = jax.tree.map(lambda a, v: a.at[fr].add(jnp.where(f_ok, v.astype(jnp.float32) / m_, 0.0)),
                                       c["ys"], ys)
            return c, y.astype(x0.dtype)

        def backward(t, c, y):
            """The backward of microbatch bmm through chunk br (:func:`_f1b_backward_at`): the last stage's
            last chunk starts it from the loss of ``y`` (its forward of this iteration), stage 0's chunk 0
            ends it in the embedding's gradient."""
            c = dict(c)
            kb = t - warm - (s_ - 1 - s)
            b_ok = (kb >= 0) & (kb < m_ * r_)
            bmm, rr = _f1b_unslot(jnp.clip(kb, 0, m_ * r_ - 1), s_, r_)
            br = r_ - 1 - rr
            last = (s == s_ - 1) & (br == r_ - 1)  # the last chunk of the last stage: the loss starts it
            if y is None:  # no forward this iteration: not the last stage's turn
                g = c["bwd"]
            else:
                g = o.loss_cotangent(c, o_leaves, y, tgts, bmm, last, last & b_ok, c["bwd"])
            at = row_of[_f1b_slot(bmm, br, s_, r_)]
            bm_rows = _take(rws, bmm)
            if stage_remat:  # the chunk's forward again (its remat policy)
                x = _row(c["stash"], at, x0.dtype)
                out, pullback = jax.vjp(lambda p, x: stage(p, x, br, bm_rows), p_leaves, x)
            else:
                out = (None, ys_shape)
                read = slot_reader(c["stash"], at, [a.dtype for a in res.kept])

                def pullback(ct):  # the layers' backward reading the row's residuals a layer at a time
                    return res.apply_reading((list(p_leaves), br, bm_rows), read, lambda p, ct: p(ct), ct)
            dgroup, dx = pullback(o.output_cotangent(out, g))
            c["dgroups"] = [a + jnp.where(b_ok, d, 0).astype(a.dtype) for a, d in zip(c["dgroups"], dgroup)]
            dx = o.lead_backward(c, o_leaves, toks, bmm, (s == 0) & (br == 0) & b_ok, jnp.where(b_ok, dx, 0))
            # kept for the embedding's weight gradient, taken once after the loops (in the loop, its
            # reduction over the batch axes would run once per microbatch), or every C microbatches when
            # M > C (:func:`embed_chunk`); used on stage 0 only
            c["dins"] = _put(c["dins"], dx, bmm % c_, b_ok & (br == 0))
            if c_ < m_:  # stage 0 has the input gradients of C more microbatches: at an iteration that is the
                # same on every device (a function of t only), so that all take the same branch
                k0 = t - warm - (s_ - 1)
                m0, r0 = _f1b_unslot(jnp.clip(k0, 0, m_ * r_ - 1), s_, r_)
                full = (k0 >= 0) & (k0 < m_ * r_) & (r0 == r_ - 1) & (m0 % c_ == c_ - 1)
                c["douter"] = jax.lax.cond(
                    full, lambda d: o.embed_grads(d, o_leaves, toks, c["dins"], m0 + 1 - c_, s == 0),
                    lambda d: d, c["douter"])
            return c, dx

        def phase(c, first: int, last: int, do_f: bool, do_b: bool):
            """Iterations ``first .. last - 1``; each shifts what it computed to the next stage."""
            def iteration(c, t):
                y = dx = None
                if do_f and do_b:  # the cool-down's iterations (t the same on every stage) have no forward
                    c, y = jax.lax.cond(t < m_ * r_ + s_ - 1, lambda c: forward(t, c),
                                        lambda c: (c, jnp.zeros(x0.shape, x0.dtype)), c)
                elif do_f:
                    c, y = forward(t, c)
                if do_b:
                    c, dx = backward(t, c, y)
                if stage_remat:
                    c = dict(c, stash=constrain(c["stash"], (None, *act)))
                if do_b:
                    c["dins"] = constrain(c["dins"], (None, *act))
                if do_f:
                    c["fwd"] = constrain(jax.lax.ppermute(constrain(y, act), "pipe", fwd_perm), act)
                if do_b:
                    c["bwd"] = constrain(jax.lax.ppermute(constrain(dx, act), "pipe", bwd_perm), act)
                return c, None

            return jax.lax.scan(iteration, c, jnp.arange(first, last))[0]

        # warm-up (S - 1 iterations): forwards only; then one forward and one backward per iteration, the
        # forward skipped in the last S - 1 (cool-down). A loop of its own for the cool-down would send S - 1
        # fewer activations but, on XLA:CPU, give its body its own temporaries (as a warm-up loop carrying
        # more than it uses does)
        c.update(phase({k: c[k] for k in ("fwd", "stash", "ys")}, 0, warm, True, False))
        c = phase(c, warm, n_iters, True, True)
        douter = c["douter"] if c_ < m_ else o.embed_grads(c["douter"], o_leaves, toks, c["dins"], 0, s == 0)
        return o.finish(c, douter)

    return o.differentiate(local, primal, ys_shape)


ACT = ("batch", "res_length", "act_embed")  # a microbatch's activations between stages


class Around:
    """What the schedules that compute their own gradients (1F1B, :mod:`jaxpar.layers.zero_bubble`) do
    around their stages: the embedding (``first_fn``) and a MoE model's lead-in (``lead_fn``) on the first
    stage, the head and the loss (``last_fn``) on the last, each weight gradient kept for the leaves of
    ``outer`` the function reads (an untied head does not touch the embedding table), and the ``shard_map``
    manual over ``pipe`` with the ``custom_vjp`` whose forward runs the schedule (:meth:`differentiate`).
    Arguments as :func:`one_f_one_b`."""

    def __init__(self, first_fn, last_fn, lead_fn, params, outer, tokens, targets, rows, *, microbatches: int,
                 ys_weights):
        self.first_fn, self.last_fn, self.lead_fn = first_fn, last_fn, lead_fn
        self.m_, self.ys_weights = microbatches, ys_weights
        self.tokens, self.targets, self.rows = tokens, targets, rows
        self.leaves, self.treedef = jax.tree.flatten(params)
        self.outer_leaves, self.outer_def = jax.tree.flatten(outer)
        self.mb = _rows_in(tokens) // microbatches
        self.x0 = x0 = jax.eval_shape(first_fn, outer, _first(tokens, self.mb))
        self.rows_mb = _split_rows(rows, microbatches)
        ol, od = self.outer_leaves, self.outer_def
        self.first_used = _used_leaves(first_fn, ol, od, _first(tokens, self.mb))
        self.last_used = _used_leaves(last_fn, ol, od, jnp.zeros(x0.shape, x0.dtype), _first(targets, self.mb))
        self.lead_used = ([] if lead_fn is None else
                          _used_leaves(lead_fn, ol, od, jnp.zeros(x0.shape, x0.dtype), _first(tokens, self.mb)))
        self.outer_used = sorted(set(self.first_used) | set(self.last_used) | set(self.lead_used))

    def stage_outputs(self, stage, group_layers: int):
        """The shapes of a stage's per-layer outputs ``ys`` (None without ``ys_weights``)."""
        if self.ys_weights is None:
            return None
        group = [jax.ShapeDtypeStruct((group_layers, *a.shape[1:]), a.dtype) for a in self.leaves]
        return jax.eval_shape(lambda g, x, r: stage(g, x, 0, r), group, self.x0, _take(self.rows_mb, 0))[1]

    def zero_grads(self, o_leaves) -> dict:
        return {i: jnp.zeros(o_leaves[i].shape, o_leaves[i].dtype) for i in self.outer_used}

    def with_leaves(self, o_leaves, used, sub):
        """The outer tree with the leaves at ``used`` replaced by ``sub``."""
        full = list(o_leaves)
        for i, a in zip(used, sub):
            full[i] = a
        return jax.tree.unflatten(self.outer_def, full)

    @staticmethod
    def add(acc, used, grads):
        return {**acc, **{i: acc[i] + g.astype(acc[i].dtype) for i, g in zip(used, grads)}}

    def stage_input(self, outer_, toks, m, embeds, ok, x):
        """A stage's input: on the first stage's first chunk (``embeds``) microbatch ``m`` embedded (the
        gather where ``embeds & ok`` only) and through the lead-in, else ``x``."""
        x0 = self.x0
        with only_where(embeds & ok):  # the embedding's gather on the first stage only
            x = jnp.where(embeds, self.first_fn(outer_, _take(toks, m)).astype(x0.dtype), x)
        if self.lead_fn is not None:  # the lead-in (layers: computed everywhere, selected)
            x = jnp.where(embeds, self.lead_fn(outer_, x, _take(toks, m)).astype(x0.dtype), x)
        return constrain(x, ACT)

    def loss_cotangent(self, c, o_leaves, y, tgts, m, last, ok, g):
        """The last chunk's output cotangent: ``y``'s loss (microbatch ``m``), its head's weight gradient and
        loss added to ``c`` where ``ok`` (the head's matmuls there only); elsewhere ``g``."""
        used = self.last_used
        with only_where(ok):  # the head's matmuls on the last stage only
            loss, vjp = jax.vjp(lambda o, h: self.last_fn(self.with_leaves(o_leaves, used, o), h, _take(tgts, m)),
                                [o_leaves[i] for i in used], y)
        d_last, dy = vjp(jnp.ones((), loss.dtype) / self.m_)
        c["loss"] = c["loss"] + jnp.where(ok, loss.astype(jnp.float32) / self.m_, 0.0)
        c["douter"] = self.add(c["douter"], used, [jnp.where(ok, d, 0) for d in d_last])
        return jnp.where(last, dy.astype(self.x0.dtype), g)

    def output_cotangent(self, out, g):
        """The cotangent of a stage's output ``out`` (``(y, ys)`` with per-layer outputs) given ``y``'s."""
        if self.ys_weights is None:
            return constrain(g, ACT)
        return constrain(g, ACT), {k: jnp.full(y.shape, self.ys_weights.get(k, 0.0) / self.m_, y.dtype)
                                   for k, y in out[1].items()}

    def lead_backward(self, c, o_leaves, toks, m, first, dx):
        """``dx`` of the first stage's first chunk through the lead-in of microbatch ``m`` (run again; its
        weight gradients added to ``c`` where ``first``); ``dx`` unchanged without a lead-in."""
        dx = dx.astype(self.x0.dtype)
        if self.lead_fn is None:
            return dx
        outer_, tok, used = jax.tree.unflatten(self.outer_def, o_leaves), _take(toks, m), self.lead_used
        with only_where(first):
            e = self.first_fn(outer_, tok).astype(self.x0.dtype)
        _, lead_vjp = jax.vjp(lambda o, e: self.lead_fn(self.with_leaves(o_leaves, used, o), e, tok),
                              [o_leaves[i] for i in used], e)
        d_lead, de = lead_vjp(constrain(dx, ACT))
        c["douter"] = self.add(c["douter"], used, [jnp.where(first, d, 0) for d in d_lead])
        return jnp.where(first, de.astype(self.x0.dtype), dx)

    def embed_grads(self, douter, o_leaves, toks, dins, first, ok):
        """The first stage: the embedding's weight gradients of microbatches ``first .. first + n - 1`` at
        once from their input gradients ``dins [n, ...]``, added to ``douter`` where ``ok``."""
        n = dins.shape[0]
        part = jax.tree.map(lambda a: _batch_of(jax.lax.dynamic_slice_in_dim(a, first, n, 0), n * self.mb,
                                                ("batch", "length")), toks)
        used = self.first_used
        with only_where(ok):  # the scatter into the table on the first stage only
            _, vjp = jax.vjp(lambda o: self.first_fn(self.with_leaves(o_leaves, used, o), part),
                             [o_leaves[i] for i in used])
        grads = vjp(_batch_of(dins, n * self.mb, ACT))[0]
        return self.add(douter, used, [jnp.where(ok, g, 0) for g in grads])

    def finish(self, c, douter):
        """The local function's results: the loss is the last stage's, the embedding's / head's gradients the
        first's / last's: summed over ``pipe`` once (zeros elsewhere); the per-layer outputs in storage order."""
        douter = {i: jax.lax.psum(a, "pipe") for i, a in douter.items()}
        ys = c["ys"]
        ys = None if ys is None else jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), ys)
        return jax.lax.psum(c["loss"], "pipe"), douter, c["dgroups"], ys

    def differentiate(self, local, primal, ys_shape):
        """``(loss, ys)``: ``primal(params, outer, tokens, targets, rows)`` without differentiation; under
        ``jax.grad`` the schedule ``local(p_leaves, o_leaves, tokens_mb, targets_mb, rows_mb) -> (loss, douter,
        dgroups, ys)`` run in a ``shard_map`` manual over ``pipe`` (a ``custom_vjp`` whose forward computes
        the gradients, which its backward scales)."""
        rules, m_, ys_weights = _rules(), self.m_, self.ys_weights
        treedef, outer_def, outer_used = self.treedef, self.outer_def, self.outer_used

        def run(p_leaves, o_leaves, tokens, targets, rows):
            stage_spec = [P("pipe")] * len(p_leaves)
            ys_spec = None if ys_shape is None else jax.tree.map(lambda _: P("pipe"), ys_shape)

            def body(p_leaves, o_leaves, toks, tgts, rws):
                with use_rules(rules.manual_pipe()):
                    return local(p_leaves, o_leaves, toks, tgts, rws)

            split = [_split_rows(x, m_) for x in (tokens, targets, rows)]
            fn = jax.shard_map(body, mesh=rules.mesh,
                               in_specs=(stage_spec, [P()] * len(o_leaves), *map(_whole, split)),
                               out_specs=(P(), {i: P() for i in outer_used}, stage_spec, ys_spec),
                               axis_names={"pipe"}, check_vma=False)
            loss, douter, dparams, ys = fn(p_leaves, o_leaves, *split)
            grads_outer = [douter[i].astype(a.dtype) if i in douter else jnp.zeros_like(a)
                           for i, a in enumerate(o_leaves)]
            if ys_weights is not None:
                loss = loss + sum(w * jnp.sum(ys[k]) for k, w in ys_weights.items())
            dparams = [d.astype(a.dtype) for d, a in zip(dparams, p_leaves)]
            return (loss, ys), (dparams, grads_outer)

        @jax.custom_vjp
        def f(p_leaves, outer_leaves, tokens, targets, rows):
            return primal(jax.tree.unflatten(treedef, p_leaves), jax.tree.unflatten(outer_def, outer_leaves),
                          tokens, targets, rows)

        def f_bwd(grads, ct):
            g = ct[0]
            dparams, douter = grads
            return [g * d for d in dparams], [g * d for d in douter], None, None, None

        f.defvjp(run, f_bwd)  # the forward computes the loss and the gradients, kept as residuals
        loss, ys = f(self.leaves, self.outer_leaves, self.tokens, self.targets, self.rows)
        return loss, (jax.lax.stop_gradient(ys) if ys is not None else None)


def schedule_1f1b(stages: int, microbatches: int, repeats: int = 1) -> list[list[tuple[tuple[str, int, int], ...]]]:
    """``grid[s][t]``: the work of stage s at iteration t under 1F1B, a tuple of ``("F", m, r)`` (forward
    of microbatch m through the stage's chunk r) and ``("B", m, r)`` (its backward), empty in the bubble;
    the rule :func:`one_f_one_b` follows (:func:`_f1b_slot`, :func:`_f1b_backward_at`). R = 1: forward
    of m at t = m + s, backward at t = m + 2(S-1) - s, M + 2(S-1) iterations. R > 1 (interleaved; M a
    multiple of S): M R + R S + S - 2 iterations. The first RS - 1 run forwards only and the last
    RS - 1 backwards only, so in time units of a chunk's forward (F) and backward (B) the schedule
    takes (M R + S - 1)(F + B) and each stage idles (S-1)/(M R+S-1) of it, as the circular schedule."""
    s_, m_, r_ = stages, microbatches, repeats
    iters = m_ * r_ + r_ * s_ + s_ - 2
    grid: list[list[tuple[tuple[str, int, int], ...]]] = [[() for _ in range(iters)] for _ in range(s_)]
    for s in range(s_):
        for m in range(m_):
            for r in range(r_):
                grid[s][_f1b_slot(m, r, s_, r_) + s] += (("F", m, r),)
                grid[s][_f1b_backward_at(m, r, s, s_, r_)] += (("B", m, r),)
    return grid


def in_flight(stages: int, microbatches: int, repeats: int = 1) -> list[int]:
    """Per stage, the most chunk inputs a 1F1B stage holds at once (forwarded, not yet backwarded):
    R = 1, min(M, 2(S-1-s) + 1) microbatches; at most :func:`stash_slots`."""
    return peak_held(schedule_1f1b(stages, microbatches, repeats), until="B")


def peak_held(grid, until: str) -> list[int]:
    """Per stage of a grid of passes (``(op, m, r)`` cells), the most chunk inputs held at once: from the
    F that takes one to the ``until`` pass that frees it (its iteration included)."""
    out = []
    for row in grid:
        live, peak = 0, 0
        for cell in row:
            live += sum(op == "F" for op, _, _ in cell)
            peak = max(peak, live)
            live -= sum(op == until for op, _, _ in cell)
        out.append(peak)
    return out
