"""Transformer MLP: GELU (GPT-2), SwiGLU (Llama) or GeGLU (Gemma); column-parallel up, row-parallel down.

Rematerialisation names: ``mlp_up`` (the up / fused gate-up projection) and ``mlp_down``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.linear import ColumnParallelLinear, RowParallelLinear

KINDS = ("gelu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")


def activate(h: jax.Array, kind: str) -> jax.Array:
    """The MLP's nonlinearity on the up projection ``h``: ``gelu(h)`` (tanh form), or for the gated kinds
    (``h [..., 2, d_ff]``: gate, up) ``silu(gate) * up`` (SwiGLU) or ``gelu_tanh(gate) * up`` (GeGLU)."""
    if kind == "swiglu":
        return jax.nn.silu(h[..., 0, :]) * h[..., 1, :]
    if kind == "geglu":
        return jax.nn.gelu(h[..., 0, :], approximate=True) * h[..., 1, :]
    return jax.nn.gelu(h, approximate=True)


class MLP(nnx.Module):
    """``down(gelu(up(x)))`` or ``down(act(x W_gate) * x W_up)`` (:func:`activate`); one all-reduce forward
    under TP."""

    def __init__(self, d_model: int, d_ff: int, *, kind: str = "gelu", use_bias: bool = True,
                 init_std: float = 0.02, out_init_std: float | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if kind not in KINDS:
            raise ValueError(f"unknown mlp kind {kind!r}; choose one of {', '.join(KINDS)}")
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.normal(init_std)
        self.kind = kind
        if kind in GATED:  # gate and up fused: one matmul, one input-gradient all-reduce under TP
            self.up = ColumnParallelLinear(d_model, (2, d_ff), out_axes=("fused", "mlp"), kernel_init=init,
                                           act_axes=("batch", "length", None, "act_mlp"), name="mlp_up", **kw)
        else:
            self.up = ColumnParallelLinear(d_model, d_ff, kernel_init=init, name="mlp_up", **kw)
        self.down = RowParallelLinear(d_ff, d_model, kernel_init=nnx.initializers.normal(out_init_std or init_std),
                                      name="mlp_down", **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(activate(self.up(x), self.kind))
