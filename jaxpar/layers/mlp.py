"""Transformer MLP: GELU (GPT-2) or SwiGLU (Llama); column-parallel up, row-parallel down.

Rematerialisation names: ``mlp_up`` (the up / fused gate-up projection) and ``mlp_down``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.layers.linear import ColumnParallelLinear, RowParallelLinear


class MLP(nnx.Module):
    """``down(gelu(up(x)))`` or ``down(silu(x W_gate) * x W_up)``; one all-reduce forward under TP."""

    def __init__(self, d_model: int, d_ff: int, *, kind: str = "gelu", use_bias: bool = True,
                 init_std: float = 0.02, out_init_std: float | None = None, dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if kind not in ("gelu", "swiglu"):
            raise ValueError(f"unknown mlp kind {kind!r}; choose gelu or swiglu")
        kw = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.normal(init_std)
        self.kind = kind
        if kind == "swiglu":  # gate and up fused: one matmul, one input-gradient all-reduce under TP
            self.up = ColumnParallelLinear(d_model, (2, d_ff), out_axes=("fused", "mlp"), kernel_init=init,
                                           act_axes=("batch", "length", None, "act_mlp"), name="mlp_up", **kw)
        else:
            self.up = ColumnParallelLinear(d_model, d_ff, kernel_init=init, name="mlp_up", **kw)
        self.down = RowParallelLinear(d_ff, d_model, kernel_init=nnx.initializers.normal(out_init_std or init_std),
                                      name="mlp_down", **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.kind == "swiglu":
            gate_up = self.up(x)
            h = jax.nn.silu(gate_up[..., 0, :]) * gate_up[..., 1, :]
        else:
            h = jax.nn.gelu(self.up(x), approximate=True)
        return self.down(h)
