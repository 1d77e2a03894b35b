"""AdamW with linear warm-up + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import TrainConfig

# Logical dims that stack copies of a weight; they do not make a vector a matrix.
STACK_AXES = ("layers", "sublayers", "stages", "experts")


def lr_schedule(t: TrainConfig) -> optax.Schedule:
    """0 -> lr over ``warmup_steps``, then cosine to ``lr * min_lr_ratio`` at step ``steps``."""
    warm = min(t.warmup_steps, max(t.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=t.lr, warmup_steps=warm, decay_steps=max(t.steps, warm + 1),
        end_value=t.lr * t.min_lr_ratio)


def decay_mask(axes: dict) -> dict:
    """Weight decay for weight matrices only: two or more non-stacking dims, one of them ``embed``
    (every matrix of a transformer maps to or from the model width). Not norms, scalars, or biases,
    also those shaped like a matrix (``[heads, head_dim]``, SwiGLU's ``[2, d_ff]``)."""
    return jax.tree.map(lambda ax: (bool({"embed", "expert_embed"} & set(ax))
                                    and sum(a not in STACK_AXES for a in ax) >= 2),
                        axes, is_leaf=lambda x: isinstance(x, tuple))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """``optax.clip_by_global_norm`` (same state, same result up to rounding) as one multiply by a
    scalar: ``g * min(1, max_norm / |g|)``. Each clipped gradient is then a function of its own
    gradient only, so the compiler may write it over the gradient's buffer; optax's
    ``where(|g| < max_norm, g, g / |g| * max_norm)`` reads the unclipped gradient again in every
    consumer of the update. (Measured on XLA:CPU: 1 MiB less on the MaxText pipeline layout of
    ``benchmarks/pipeline_memory.py`` with 128-token loss chunks, nothing at the default chunk.)"""

    def update(updates, state, params=None):
        del params
        norm = optax.tree.norm(updates)
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norm, jnp.finfo(jnp.float32).tiny))
        return jax.tree.map(lambda g: g * scale.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def keep_unused_positions(axes: dict, used: int) -> optax.GradientTransformation:
    """Rows ``>= used`` of a ``positions`` table (a learned position table longer than the training
    context, e.g. GPT-2's 1024 imported for ``model.seq_len=128``) get no update at all: no gradient
    reaches them, and AdamW's decoupled weight decay would otherwise shrink them every step, so the
    rows the run never used would not export as imported."""

    def update(updates, state, params=None):
        del params

        def keep(u, ax):
            if not ax or ax[0] != "positions" or u.shape[0] <= used:
                return u
            rows = jax.lax.broadcasted_iota(jnp.int32, u.shape, 0)
            return jnp.where(rows < used, u, jnp.zeros((), u.dtype))

        return jax.tree.map(keep, updates, axes, is_leaf=lambda x: isinstance(x, tuple)), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(t: TrainConfig, axes: dict, positions_used: int | None = None) -> optax.GradientTransformation:
    """Clipping, then AdamW (:func:`decay_mask`); with ``positions_used`` (the training context),
    the rows of a position table beyond it are left as they are (:func:`keep_unused_positions`)."""
    parts = [clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2, eps=t.eps, weight_decay=t.weight_decay,
                             mask=decay_mask(axes)))
    if positions_used is not None:
        parts.append(keep_unused_positions(axes, positions_used))
    return optax.chain(*parts)
