"""Transformer MLP: GELU (GPT-2), SwiGLU (Llama), GeGLU (Gemma) or the clamped SwiGLU (GPT-OSS); column-parallel
up, row-parallel down.

Rematerialisation names: ``mlp_up`` (the up / fused gate-up projection) and ``mlp_down``."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.linear import ColumnParallelLinear, RowParallelLinear

KINDS = ("gelu", "swiglu", "geglu", "clamped_swiglu")
GATED = ("swiglu", "geglu", "clamped_swiglu")


class ClampedSwiGLU(NamedTuple):
    """GPT-OSS's SwiGLU: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``
    (a ``kind`` of :func:`activate`, :class:`MLP` and the MoE experts; the string ``clamped_swiglu`` is it
    with GPT-OSS's values)."""

    limit: float = 7.0
    alpha: float = 1.702


Kind = str | ClampedSwiGLU


def kind_name(kind: Kind) -> str:
    return "clamped_swiglu" if isinstance(kind, ClampedSwiGLU) else kind


def activate(h: jax.Array, kind: Kind) -> jax.Array:
    """The MLP's nonlinearity on the up projection ``h``: ``gelu(h)`` (tanh form), or for the gated kinds
    (``h [..., 2, d_ff]``: gate, up) ``silu(gate) * up`` (SwiGLU), ``gelu_tanh(gate) * up`` (GeGLU) or the
    clamped SwiGLU (:class:`ClampedSwiGLU`; computed in float32)."""
    if kind_name(kind) == "clamped_swiglu":
        c = kind if isinstance(kind, ClampedSwiGLU) else ClampedSwiGLU()
        gate = jnp.minimum(h[..., 0, :].astype(jnp.float32), c.limit)
        up = jnp.clip(h[..., 1, :].astype(jnp.float32), -c.limit, c.limit)
        return ((up + 1.0) * gate * jax.nn.sigmoid(c.alpha * gate)).astype(h.dtype)
    if kind == "swiglu":
        return jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
    if kind == "geglu":
        return jax.nn.gelu(h[..., 0, :], approximate=True) * h[..., 1, :]
    return jax.nn.gelu(h, approximate=True)


class MLP(nnx.Module):
    """``down(gelu(up(x)))`` or ``down(act(x W_gate) * x W_up)`` (:func:`activate`); one all-reduce forward
    under TP."""

    def __init__(self, d_model: int, d_ff: int, *, kind: Kind = "gelu", use_bias: bool = True,
                 init_std: float = 0.02, out_init_std: float | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if kind_name(kind) not in KINDS:
            raise ValueError(f"unknown mlp kind {kind!r}; choose one of {', '.join(KINDS)}")
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.normal(init_std)
        self.kind = kind
        if kind_name(kind) in GATED:  # gate and up fused: one matmul, one input-gradient all-reduce under TP
            self.up = ColumnParallelLinear(d_model, (2, d_ff), out_axes=("fused", "mlp"), kernel_init=init,
                                           act_axes=("batch", "length", None, "act_mlp"), name="mlp_up", **kw)
        else:
            self.up = ColumnParallelLinear(d_model, d_ff, kernel_init=init, name="mlp_up", **kw)
        self.down = RowParallelLinear(d_ff, d_model, kernel_init=nnx.initializers.normal(out_init_std or init_std),
                                      name="mlp_down", **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(activate(self.up(x), self.kind))
