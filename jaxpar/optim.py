"""AdamW with linear warm-up + cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
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


def make_optimizer(t: TrainConfig, axes: dict) -> optax.GradientTransformation:
    parts = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
    parts.append(optax.adamw(lr_schedule(t), b1=t.beta1, b2=t.beta2, eps=t.eps, weight_decay=t.weight_decay,
                             mask=decay_mask(axes)))
    return optax.chain(*parts)
