"""Megatron tensor-parallel linear layers, written as sharding annotations.

``ColumnParallelLinear`` splits its *output* features over ``tensor`` (e.g. QKV, MLP-up): no
communication. ``RowParallelLinear`` splits its *input* features over ``tensor`` (attention-out,
MLP-down): each device holds a partial sum, and constraining the output to be replicated over
``tensor`` makes XLA insert the one all-reduce per block that Megatron prescribes (a
reduce-scatter when the output is sequence-sharded). Which dims are split is decided by the
logical names and the active :mod:`jaxpar.partitioning` rules, not by these classes.
"""

from __future__ import annotations

import string
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.partitioning import constrain, constrain_weight, param

Shape = int | Sequence[int]


def _tup(x: Shape) -> tuple[int, ...]:
    return (x,) if isinstance(x, int) else tuple(x)


class ParallelLinear(nnx.Module):
    """``y[..., *out] = sum_in x[..., *in] W[*in, *out] (+ b[*out])`` with logical axis names.

    Args:
      in_features / out_features: an int or a tuple (e.g. ``(heads, head_dim)``).
      in_axes / out_axes: logical names of the kernel dims (one per feature dim).
      act_axes: logical names of the output activation ``(batch, length, *out)``; the output is
        constrained to them (None: leave it to the partitioner).
      kernel_init: initialiser called with the kernel shape ``(*in, *out)``.
      dtype: compute dtype (inputs and kernel are cast to it); param_dtype: storage dtype.
    """

    def __init__(self, in_features: Shape, out_features: Shape, *, in_axes: Sequence[str],
                 out_axes: Sequence[str], act_axes: Sequence[str] | None, use_bias: bool = True,
                 kernel_init: Callable = nnx.initializers.normal(0.02), dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.in_features, self.out_features = _tup(in_features), _tup(out_features)
        if len(in_axes) != len(self.in_features) or len(out_axes) != len(self.out_features):
            raise ValueError("one logical axis name per feature dim is required")
        shape = self.in_features + self.out_features
        self.kernel_axes, self.bias_axes = tuple(in_axes) + tuple(out_axes), tuple(out_axes)
        self.kernel = param(kernel_init(rngs.params(), shape, param_dtype), self.kernel_axes)
        self.bias = (param(jnp.zeros(self.out_features, param_dtype), self.bias_axes)
                     if use_bias else None)
        self.act_axes = tuple(act_axes) if act_axes is not None else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        ni, no = len(self.in_features), len(self.out_features)
        letters = string.ascii_letters
        batch = letters[: x.ndim - ni]
        ins = letters[x.ndim - ni: x.ndim]
        outs = letters[x.ndim: x.ndim + no]
        kernel = constrain_weight(self.kernel[...], self.kernel_axes)
        y = jnp.einsum(f"{batch}{ins},{ins}{outs}->{batch}{outs}", x.astype(self.dtype), kernel.astype(self.dtype))
        if self.bias is not None:
            y = y + constrain_weight(self.bias[...], self.bias_axes).astype(self.dtype)
        return constrain(y, self.act_axes) if self.act_axes is not None else y


class ColumnParallelLinear(ParallelLinear):
    """Output features split over ``tensor`` (defaults: ``embed -> mlp``)."""

    def __init__(self, in_features: Shape, out_features: Shape, *, in_axes=("embed",), out_axes=("mlp",),
                 act_axes=("batch", "length", "act_mlp"), **kw):
        super().__init__(in_features, out_features, in_axes=in_axes, out_axes=out_axes, act_axes=act_axes, **kw)


class RowParallelLinear(ParallelLinear):
    """Input features split over ``tensor`` (defaults: ``mlp -> embed``); output all-reduced."""

    def __init__(self, in_features: Shape, out_features: Shape, *, in_axes=("mlp",), out_axes=("embed",),
                 act_axes=("batch", "length", "act_embed"), **kw):
        super().__init__(in_features, out_features, in_axes=in_axes, out_axes=out_axes, act_axes=act_axes, **kw)
