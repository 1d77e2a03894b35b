"""Vocabulary-parallel embedding and cross-entropy (Megatron): the vocabulary dim is split over
``tensor`` and the full logits are never gathered.

* Lookup: each device gathers the rows it owns and zeroes the others; an all-reduce over
  ``tensor`` of the ``[batch, length, embed]`` result completes it (written out in a ``shard_map``:
  left to XLA's partitioner, a gather from a table replicated over other axes may be split over
  those too and the table shuffled between devices).
* Loss: ``logsumexp`` is a max-reduce and a sum-reduce over the split dim (all-reduces of
  ``[batch, length]`` scalars) and the target logit is picked by comparing a vocab iota with the
  target, so no device ever holds a ``[batch, length, vocab]`` array whole.
* Logits (:func:`vocab_logits`) accumulate in float32 (:func:`~jaxpar.layers.precision.f32_einsum`).
  Training does not compute them for the whole batch: :mod:`jaxpar.layers.loss` fuses the head and
  the cross-entropy over chunks of tokens.

The table is padded to a multiple of ``vocab_multiple`` (and of the tensor size) so that any
vocabulary size splits evenly; the padded logits are masked out of the softmax. Initial values
are drawn at the real size and zero-padded, so they do not depend on the padding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.onstage import predicate, varying, when
from jaxpar.layers.precision import f32_einsum
from jaxpar.partitioning import active_rules, constrain, constrain_weight, param


def padded_vocab(vocab_size: int, multiple: int, tensor: int = 1) -> int:
    m = math.lcm(multiple, tensor)
    return -(-vocab_size // m) * m


def padded_init(init, real_rows: int, axis: int = 0):
    """Initialise ``real_rows`` along ``axis`` with ``init`` and zero the rest of the requested shape.

    The whole padded shape is drawn and the padding zeroed, so the program holds no pad of a sharded axis,
    whose fused initialisation XLA:CPU's LLVM IR emitters round differently per layout (the tests' compiler;
    the drawn values are then the same on every mesh with either emitter). Along axis 0 the real rows get the
    values that drawing them alone gives (the generators draw in row-major order); along another axis they
    are other draws of the same distribution. ``init`` must not read the shape for its scale (a fan-in
    scaling would see the padded one)."""

    def f(key, shape, dtype=jnp.float32):
        keep = (jnp.arange(shape[axis]) < real_rows).reshape([-1 if a == axis else 1 for a in range(len(shape))])
        return jnp.where(keep, init(key, tuple(shape), dtype), jnp.zeros((), dtype))

    return f


class VocabParallelEmbed(nnx.Module):
    """Token embedding ``[vocab_padded, embed]`` with the vocabulary split over ``tensor``.

    ``__call__(ids)`` looks tokens up; ``attend(x)`` gives tied output logits ``x @ table.T``.
    """

    def __init__(self, vocab_size: int, features: int, *, vocab_multiple: int = 128, tensor: int = 1,
                 init_std: float = 0.02, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.vocab_size = vocab_size
        self.padded_size = padded_vocab(vocab_size, vocab_multiple, tensor)
        init = padded_init(nnx.initializers.normal(init_std), vocab_size)
        self.embedding = param(init(rngs.params(), (self.padded_size, features), param_dtype),
                               ("vocab", "embed"))
        self.dtype = dtype

    def table(self) -> jax.Array:
        return constrain_weight(self.embedding[...], ("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        rules = active_rules()
        if rules is None or rules.mesh is None or not rules.manual_axes():  # (a pipeline's first stage: the
            # gather there only, every other axis of the mesh being of size 1)
            return when(predicate(), lambda ids, table: jnp.take(table, ids, axis=0).astype(self.dtype),
                        lambda ids, table: jnp.zeros((*ids.shape, table.shape[1]), self.dtype), ids, self.table())
        return self._lookup(ids, rules)

    def _lookup(self, ids: jax.Array, rules) -> jax.Array:
        """Vocabulary-parallel lookup in a ``shard_map``: each tensor rank gathers the rows of its
        vocabulary shard (zeros for the others), and one collective over ``tensor`` completes the sum
        in the compute dtype: an all-reduce, or under Megatron-SP a reduce-scatter along the sequence
        that also leaves the output split like the residual stream (its backward an all-gather, not
        a table all-reduce). The table's gradient is a local scatter-add on each rank's shard.

        In a pipeline's :func:`~jaxpar.layers.onstage.only_where` (its first stage) the gather runs only
        where the predicate holds (zeros elsewhere), the collective over ``tensor`` on every device; the
        table is cast to varying over the token axes before the branch, so that its gradient's sum over
        them (that cast's transpose) stays outside the branch as well."""
        p = rules.params
        tensor = rules.axis_size("tensor") > 1
        pred = predicate()

        def local(ids, table, pred):
            rows = table.shape[0]
            first = jax.lax.axis_index("tensor") * rows if tensor else 0

            def lookup(ids, table):
                if tensor:
                    local_ids = ids - first
                    ok = (local_ids >= 0) & (local_ids < rows)
                    return jnp.where(ok[..., None], jnp.take(table, jnp.where(ok, local_ids, 0), axis=0),
                                     0).astype(self.dtype)
                return jnp.take(table, ids, axis=0).astype(self.dtype)

            if pred is not None:  # both as varying as the lookup (the casts' transposes outside the branch)
                both = varying(ids) | varying(table) | ({"tensor"} if tensor else set())
                ids, table = (jax.lax.pcast(a, tuple(sorted(both - varying(a))), to="varying")
                              if both - varying(a) else a for a in (ids, table))

            def nothing(ids, table):  # zeros as varying as the lookup's
                z = jnp.zeros((*ids.shape, table.shape[1]), self.dtype)
                return jax.lax.pcast(z, tuple(sorted(varying(table))), to="varying") if varying(table) else z

            x = when(pred, lookup, nothing, ids, table)
            if not tensor:
                return x
            if rules.megatron_sp:
                return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)
            return jax.lax.psum(x, "tensor")

        extra = () if pred is None else (pred,)  # the predicate enters replicated, when there is one
        fn = jax.shard_map(lambda ids, table, *q: local(ids, table, q[0] if q else None), mesh=p.mesh,
                           in_specs=(p.spec(("batch", "length")), rules.compute.spec(("vocab", "embed")),
                                     *(jax.sharding.PartitionSpec(),) * len(extra)),
                           out_specs=p.spec(("batch", "res_length", "act_embed")))
        return fn(ids, self.embedding[...], *extra)

    def attend(self, x: jax.Array) -> jax.Array:
        """Tied output logits ``x @ table.T`` (float32, ``[..., vocab_padded]``)."""
        return vocab_logits(x, self.table(), "vd", self.dtype)


def vocab_logits(x: jax.Array, w: jax.Array, layout: str, dtype) -> jax.Array:
    """Float32 logits of ``x [B, T, d]`` against the output weight ``w`` (``layout`` ``"vd"``: the
    ``[vocab, embed]`` table; ``"dv"``: a ``[embed, vocab]`` head), split over the vocabulary. The
    matmul runs in ``dtype`` and accumulates in float32 (:func:`f32_einsum`)."""
    spec = f"btd,{layout}->btv"
    rules = active_rules()
    if rules is not None and rules.megatron_sp:
        # Megatron-SP: x arrives split along the sequence over tensor; all-gather it explicitly (the
        # backward is then a reduce-scatter, as after every column-parallel layer)
        p = rules.params
        w_names = ("vocab", "embed") if layout == "vd" else ("embed", "vocab")

        def local(x, w):
            x = jax.lax.all_gather(x, "tensor", axis=1, tiled=True)
            return f32_einsum(spec, x.astype(dtype), w.astype(dtype))

        return jax.shard_map(local, mesh=p.mesh, in_specs=(p.spec(("batch", "res_length", "act_embed")),
                                                           rules.compute.spec(w_names)),
                             out_specs=p.spec(("batch", "length", "act_vocab")))(x, w)
    x = constrain(x, ("batch", "length", "act_embed"))
    logits = f32_einsum(spec, x.astype(dtype), w.astype(dtype))
    return constrain(logits, ("batch", "length", "act_vocab"))


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, vocab_size: int | None = None
                                 ) -> jax.Array:
    """Per-token ``-log softmax(logits)[target]`` in float32; columns ``>= vocab_size`` are padding.

    ``logits``: ``[..., vocab_padded]`` (may be split over ``tensor``), ``targets``: ``[...]`` ints.
    """
    logits = logits.astype(jnp.float32)
    iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    if vocab_size is not None and vocab_size < logits.shape[-1]:
        logits = jnp.where(iota < vocab_size, logits, -1e30)
    m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1)) + m[..., 0]
    target_logit = jnp.sum(jnp.where(iota == targets[..., None], logits, 0.0), axis=-1)
    return lse - target_logit
