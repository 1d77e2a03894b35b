"""The lean loss: output head and cross-entropy fused, over chunks of tokens, gradients in the forward.

:func:`head_cross_entropy` is the mean next-token cross-entropy of the logits ``x @ w`` without the
float32 logits of the whole batch ever existing. Each device walks its tokens in chunks (at most
``model.loss_chunk_tokens`` per chunk); a chunk computes its float32 logits, their log-sum-exp and
target logit, and, when the loss is differentiated, its gradients right away:

    p = softmax(logits)                 dlogits = (p - onehot(target)) / N       (N: all tokens)
    dx_chunk = dlogits @ w^T            dw += x_chunk^T @ dlogits

The loss is the last operation before the backward, so the cotangent of the mean is one scalar
``g``; the backward only multiplies the stored ``dx`` and ``dw`` by it. Nothing is recomputed (a
rematerialised chunk loop would run the head matmul a fourth time) and one chunk's logits are the
only ``[tokens, vocab]`` array alive. Without differentiation (evaluation) only the loss is computed.

Communication, in a ``shard_map`` over the mesh (everything else is local to a device):

* vocabulary split over ``tensor`` (Megatron): per chunk, a max and two sums over ``tensor`` of one
  float32 per token; after the loop one all-reduce over ``tensor`` of ``dx`` (``[tokens, d_model]``,
  the head's input gradient), or under Megatron-SP one reduce-scatter along the sequence (after the
  input's all-gather, as every column-parallel layer does);
* tokens split over ``data``, ``expert``, ``seq``: ``dw`` is summed locally over the chunks and
  leaves the ``shard_map`` as one partial sum per device, reduced by XLA with the rest of the
  gradients (one reduction over all those axes; folded with the tied table's lookup gradient on
  GPU/TPU); the loss is summed over them in the ``shard_map``.

Matmuls run in the compute dtype with float32 accumulation; ``dw`` accumulates in float32.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.layers.attention_ops import NEG
from jaxpar.layers.onstage import predicate, when
from jaxpar.layers.precision import f32_einsum
from jaxpar.partitioning import active_rules


# The fields of a batch of packed documents (data.packing=documents, jaxpar.data.packing), each [B, T]: which
# document a token belongs to, its position in it, and its loss weight (0: not trained). A model's loss takes
# them as keywords.
DOC_KEYS = ("segment_ids", "positions", "weights")

_MIN_CHUNKS = contextvars.ContextVar("jaxpar_loss_min_chunks", default=1)


@contextlib.contextmanager
def min_chunks(n: int):
    """Within it, :func:`head_cross_entropy` cuts a device's tokens into at least ``n`` chunks (the
    pipeline runs the loss of all M microbatches at once, in chunks of at most a microbatch each, so
    that its temporaries do not grow with M)."""
    token = _MIN_CHUNKS.set(n)
    try:
        yield
    finally:
        _MIN_CHUNKS.reset(token)


def loss_chunks(batch: int, length: int, chunk_tokens: int, at_least: int = 1) -> int:
    """How many chunks a device's ``batch x length`` tokens are cut into: the fewest (a divisor of
    ``length``, at least ``at_least`` where ``length`` allows) with at most ``chunk_tokens`` tokens each
    (``chunk_tokens`` 0: no limit)."""
    fits = lambda n: chunk_tokens <= 0 or batch * length // n <= chunk_tokens  # noqa: E731
    return next((n for n in range(max(at_least, 1), length + 1) if length % n == 0 and fits(n)), length)


def head_cross_entropy(x: jax.Array, w: jax.Array, targets: jax.Array, vocab_size: int, *, layout: str, dtype,
                       chunk_tokens: int, weights: jax.Array | None = None, denominator=None) -> jax.Array:
    """Mean cross-entropy of the logits ``x [B, T, d] @ w`` against ``targets [B, T]``; ``w`` is the
    ``[vocab, embed]`` table (``layout="vd"``, tied) or a ``[embed, vocab]`` head (``"dv"``), padded
    columns ``>= vocab_size`` masked. Under active rules ``x`` is the residual stream (split like
    ``res_length``) and ``w`` in its compute layout (vocabulary over ``tensor``).

    With loss ``weights [B, T]`` (float; 0 = not trained: prompts, padding) the loss is
    ``sum(weights * ce) / denominator`` (a number or a traced scalar; default ``sum(weights)``): a
    caller that splits a batch into parts (microbatches, gradient-accumulation microsteps) passes the
    whole batch's trained tokens per part, so that the mean over parts is the whole batch's weighted
    mean, whatever each part holds."""
    b, t, _ = x.shape
    n_tokens = b * t
    if weights is not None:
        if denominator is None:
            denominator = jnp.sum(weights.astype(jnp.float32))
        denominator = jnp.asarray(denominator, jnp.float32)
        denominator = jnp.where(denominator > 0, denominator, 1.0)  # a batch with nothing trained: loss 0
        labels: jax.Array | tuple = (targets, weights.astype(jnp.float32), denominator)
    else:
        labels = targets
    padded = w.shape[0 if layout == "vd" else 1] > vocab_size
    rules = active_rules()
    mesh = None if rules is None else rules.mesh
    chunking = (chunk_tokens, _MIN_CHUNKS.get())
    pred = predicate()  # a pipeline's: the head runs on its last stage only (jaxpar.layers.onstage)
    if rules is None or mesh is None or not rules.manual_axes():
        kernel = _Kernel(vocab_size, padded, layout, dtype, chunking, n_tokens, (), (), False)
        return _differentiable(lambda x, w, t, pred, grads=False: kernel(x, w, t, grads, pred))(x, w, labels, pred)
    tokens_spec = rules.params.spec(("batch", "length"))
    t_spec = tokens_spec if weights is None else (tokens_spec, tokens_spec, P())
    big = lambda names: tuple(a for n in names for a in rules.params.axes(n) if mesh.shape[a] > 1)  # noqa: E731
    vocab_axes = tuple(a for a in rules.compute.axes("vocab") if mesh.shape[a] > 1)
    token_axes = tuple(dict.fromkeys(a for a in big(("batch", "length")) if a not in vocab_axes))
    kernel = _Kernel(vocab_size, padded, layout, dtype, chunking, n_tokens, vocab_axes, token_axes,
                     rules.megatron_sp)
    p = rules.params
    x_spec = p.spec(("batch", "res_length", "act_embed"))
    w_spec = rules.compute.spec(("vocab", "embed") if layout == "vd" else ("embed", "vocab"))
    manual = rules.manual_axes()

    # dw leaves the shard_map unreduced, one partial sum per token shard on a leading dim: summing
    # it outside lets XLA fold that reduction into the gradient reduction of the rest of the model
    # (the tied table's lookup gradient: one all-reduce, or one reduce-scatter into ZeRO's layout)
    parts_spec = P(token_axes or None, *w_spec)

    def local(x, w, t, pred, grads):
        if not grads:
            return kernel(x, w, t, pred=pred)
        loss, dx, dw = kernel(x, w, t, grads=True, pred=pred)
        return loss, dx, dw[None]  # this device's partial sum

    def run(x, w, t, pred, grads=False):
        extra = () if pred is None else (pred,)  # the predicate enters replicated, when there is one
        fn = jax.shard_map(lambda x, w, t, *p: local(x, w, t, p[0] if p else None, grads), mesh=mesh,
                           in_specs=(x_spec, w_spec, t_spec, *(P(),) * len(extra)),
                           out_specs=(P(), x_spec, parts_spec) if grads else P(), axis_names=manual,
                           check_vma=False)
        if not grads:
            return fn(x, w, t, *extra)
        loss, dx, dw_parts = fn(x, w, t, *extra)
        return loss, dx, jnp.sum(dw_parts, axis=0)  # outside any branch: on every device

    return _differentiable(run)(x, w, labels, pred)


def _differentiable(run):
    """``run(x, w, t, pred, grads)`` -> loss, or (loss, dx, dw) with grads: a function of (x, w, t, pred) whose
    VJP scales the forward's ``dx``, ``dw`` by the cotangent of the loss (``pred``: see :meth:`_Kernel.__call__`)."""

    @jax.custom_vjp
    def f(x, w, t, pred):
        return run(x, w, t, pred, grads=False)

    def fwd(x, w, t, pred):
        loss, dx, dw = run(x, w, t, pred, grads=True)
        return loss, (dx, dw)

    def bwd(res, g):
        dx, dw = res
        return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None

    f.defvjp(fwd, bwd)
    return f


class _Kernel:
    """One device's chunked head + cross-entropy (its collectives over the given mesh axes)."""

    def __init__(self, vocab_size, padded, layout, dtype, chunking, n_tokens, vocab_axes, token_axes,
                 megatron_sp):
        self.vocab_size, self.padded, self.layout, self.dtype = vocab_size, padded, layout, dtype
        self.chunking = chunking  # (at most this many tokens per chunk, at least this many chunks)
        self.n_tokens, self.vocab_axes, self.token_axes, self.sp = n_tokens, vocab_axes, token_axes, megatron_sp

    def _psum(self, v, axes):
        return jax.lax.psum(v, axes) if axes else v

    def __call__(self, x, w, targets, grads: bool = False, pred=None):
        """``targets [B, T]``, or ``(targets, weights [B, T], denominator)`` (see :func:`head_cross_entropy`).
        With ``pred`` (a boolean scalar: :func:`~jaxpar.layers.onstage.only_where`) the matmuls run only where
        it holds (elsewhere the statistics are dummies, ``dx`` and ``dw`` zeros); the collectives run either way."""
        x_dtype, w_dtype = x.dtype, w.dtype
        if isinstance(targets, tuple):
            targets, weights, denom = targets
        else:
            weights, denom = None, self.n_tokens
        if self.sp:  # Megatron-SP: the residual stream arrives split along the sequence over tensor
            x = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
        b, t, d = x.shape
        n = loss_chunks(b, t, *self.chunking)
        vd = self.layout == "vd"
        local_vocab = w.shape[0 if vd else 1]
        first = jax.lax.axis_index(self.vocab_axes) * local_vocab if self.vocab_axes else 0
        cols = first + jnp.arange(local_vocab)
        wc = w.astype(self.dtype)
        chunks = lambda a: jnp.swapaxes(a.reshape(b, n, t // n, *a.shape[2:]), 0, 1)  # noqa: E731  [n, B, T/n, ...]

        def stats(xc, tc):  # this vocabulary shard's logits and per-token statistics (no collective)
            logits = f32_einsum(f"btd,{self.layout}->btv", xc, wc)
            if self.padded:  # (static: without padded columns no select, and no copy of the logits)
                logits = jnp.where(cols < self.vocab_size, logits, NEG)
            m = jnp.max(logits, -1)
            s = jnp.sum(jnp.exp(logits - m[..., None]), -1)
            # the target's logit by a gather (zero where another vocabulary shard holds the target)
            local = tc - first
            mine = (local >= 0) & (local < local_vocab)
            picked = jnp.take_along_axis(logits, jnp.clip(local, 0, local_vocab - 1)[..., None], -1)[..., 0]
            return logits, m, s, jnp.where(mine, picked, 0.0)

        def no_stats(xc, tc):  # finite dummies (log 1 + 0 - 0), never used
            zero = jnp.zeros(tc.shape, jnp.float32)
            return jnp.zeros((*tc.shape, local_vocab), jnp.float32), zero, zero + 1, zero

        def chunk_grads(logits, lse, xc, tc, wc_):  # the chunk's dx and its share of dw
            # softmax from the log-sum-exp rather than from `e`: the exponentials are recomputed in this
            # fusion, so `e` is only ever a reduction's input and no third [tokens, vocab] buffer exists
            hit = cols == tc[..., None]
            d = jnp.exp(logits - lse[..., None]) - hit
            dlogits = (d / denom if wc_ is None else d * (wc_ / denom)[..., None]).astype(self.dtype)
            dx = f32_einsum(f"btv,{self.layout}->btd", dlogits, wc)
            return dx, f32_einsum(f"btd,btv->{self.layout}", xc, dlogits)

        def no_grads(logits, lse, xc, tc, wc_):
            return jnp.zeros(xc.shape, jnp.float32), jnp.zeros(w.shape, jnp.float32)

        def chunk(carry, xt):
            loss, dw = carry
            xc, tc, wc_ = xt
            xc = xc.astype(self.dtype)
            logits, m, s, target = when(pred, stats, no_stats, xc, tc)
            if self.vocab_axes:  # the whole vocabulary's: a max and two sums over its shards
                m_all = jax.lax.pmax(m, self.vocab_axes)
                s = jax.lax.psum(s * jnp.exp(m - m_all), self.vocab_axes)
                m, target = m_all, jax.lax.psum(target, self.vocab_axes)
            ce = jnp.log(s) + m - target
            loss = loss + jnp.sum(ce if wc_ is None else wc_ * ce)
            if not grads:
                return (loss, dw), None
            # the chunk's share of dw out of the cond and added after it (in place in the carry; passed
            # through a branch, XLA:CPU copies the running sum), taken as the sum where one chunk is all
            dx, dw_chunk = when(pred, chunk_grads, no_grads, logits, m + jnp.log(s), xc, tc, wc_)
            return (loss, dw_chunk if dw is None else dw + dw_chunk), dx

        ws = None if weights is None else chunks(weights)
        xs = (chunks(x), chunks(targets), ws)
        if n == 1:  # no loop, and no zeros to sum the chunks' dw into: a [d, vocab] buffer fewer
            (loss, dw), dx = chunk((jnp.zeros((), jnp.float32), None), jax.tree.map(lambda a: a[0], xs))
            dx = None if dx is None else dx[None]
        else:
            dw0 = jnp.zeros(w.shape, jnp.float32) if grads else None
            (loss, dw), dx = jax.lax.scan(chunk, (jnp.zeros((), jnp.float32), dw0), xs)
        loss = self._psum(loss, self.token_axes) / denom
        if not grads:
            return loss
        assert dw is not None  # the scan accumulates it from dw0 when grads
        # summed over tensor in float32 (in bfloat16 XLA:CPU's all-reduce promotion aborts on it,
        # combined with the loss's float32 sum)
        dx = jnp.swapaxes(dx, 0, 1).reshape(b, t, d)
        if self.sp:
            dx = jax.lax.psum_scatter(dx, "tensor", scatter_dimension=1, tiled=True)
        elif self.vocab_axes:
            dx = jax.lax.psum(dx, self.vocab_axes)
        return loss, dx.astype(x_dtype), dw.astype(w_dtype)
