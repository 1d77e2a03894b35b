"""Mixed precision for the matmuls that feed a softmax or the loss.

:func:`f32_einsum` returns a float32 result from low-precision (bfloat16) operands: the matmul
accumulates in float32 (``preferred_element_type``) and its result is not rounded to bfloat16, so
attention scores and logits keep float32 accuracy. Its backward casts the incoming float32
cotangent to the operands' dtype and runs the two transposed matmuls in that dtype (float32
accumulation inside, as every accelerator matmul does): differentiating
``einsum(..., preferred_element_type=float32)`` directly would give matmuls of a float32 and a
bfloat16 operand, which XLA runs in float32, at a fraction of the bfloat16 rate. With float32
operands (the CPU default) it is exactly ``jnp.einsum``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def compute_dtype(name: str, platform: str | None = None):
    """``model.compute_dtype``: ``auto`` is float32 on CPU and bfloat16 on GPU/TPU."""
    if name == "auto":
        return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
    return DTYPES[name]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def f32_einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.einsum(spec, a, b)`` accumulated in and returned as float32."""
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _fwd(spec, a, b):
    return f32_einsum(spec, a, b), (a, b)


def _bwd(spec, res, g):
    a, b = res
    dtype = jnp.promote_types(a.dtype, b.dtype)
    g = g.astype(dtype)
    da, = jax.linear_transpose(lambda a: jnp.einsum(spec, a, b, preferred_element_type=dtype), a)(g)
    db, = jax.linear_transpose(lambda b: jnp.einsum(spec, a, b, preferred_element_type=dtype), b)(g)
    return da, db


f32_einsum.defvjp(_fwd, _bwd)
