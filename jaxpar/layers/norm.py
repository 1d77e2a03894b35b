"""LayerNorm and RMSNorm, computed in float32 whatever the activation dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.partitioning import param


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` (Llama), or ``x / rms(x) * (1 + scale)`` with ``plus_one`` (Gemma: the weight is
    stored as an offset from 1 and initialised at 0)."""

    def __init__(self, features: int, *, eps: float = 1e-5, plus_one: bool = False, param_dtype=jnp.float32,
                 axis_name: str = "norm", rngs: nnx.Rngs | None = None):
        self.scale = param((jnp.zeros if plus_one else jnp.ones)((features,), param_dtype), (axis_name,))
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (y * (1.0 + scale if self.plus_one else scale)).astype(x.dtype)


class LayerNorm(nnx.Module):
    """``(x - mean) / std * scale + bias`` (GPT-2); ``use_bias=False`` drops the bias."""

    def __init__(self, features: int, *, eps: float = 1e-5, use_bias: bool = True, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.scale = param(jnp.ones((features,), param_dtype), ("norm",))
        self.bias = param(jnp.zeros((features,), param_dtype), ("norm",)) if use_bias else None
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def make_norm(kind: str, features: int, *, eps: float, use_bias: bool, param_dtype, plus_one: bool = False,
              rngs=None) -> nnx.Module:
    if kind == "layernorm":
        return LayerNorm(features, eps=eps, use_bias=use_bias, param_dtype=param_dtype)
    if kind == "rmsnorm":
        return RMSNorm(features, eps=eps, plus_one=plus_one, param_dtype=param_dtype)
    raise ValueError(f"unknown norm {kind!r}; choose layernorm or rmsnorm")
