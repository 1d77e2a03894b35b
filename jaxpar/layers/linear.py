"""Megatron tensor-parallel linear layers, written as sharding annotations.

``ColumnParallelLinear`` splits its *output* features over ``tensor`` (e.g. QKV, MLP-up): no
communication. ``RowParallelLinear`` splits its *input* features over ``tensor`` (attention-out,
MLP-down): each device holds a partial sum, and constraining the output to be replicated over
``tensor`` makes XLA insert the one all-reduce per block that Megatron prescribes.

With Megatron sequence parallelism (``parallel.megatron_sp``) the residual stream is split
along the sequence over ``tensor``; the two layers then run in a ``shard_map`` with the collectives
written out: all-gather of the input before a column-parallel matmul, reduce-scatter of the output
of a row-parallel one (their transposes in the backward are the reverse pair). Which dims are split is decided by the
logical names and the active :mod:`jaxpar.partitioning` rules, not by these classes.
"""

from __future__ import annotations

import string
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.layers import wgrad
from jaxpar.partitioning import active_rules, constrain, constrain_weight, param

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
      name: the output's rematerialisation name (``checkpoint_name``; see :mod:`jaxpar.layers.remat`).
    """

    def __init__(self, in_features: Shape, out_features: Shape, *, in_axes: Sequence[str],
                 out_axes: Sequence[str], act_axes: Sequence[str] | None, use_bias: bool = True,
                 kernel_init: Callable = nnx.initializers.normal(0.02), dtype=jnp.float32,
                 param_dtype=jnp.float32, name: str | None = None, rngs: nnx.Rngs):
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
        self.name = name

    # Megatron sequence parallelism: "gather" (column: the input arrives split along the sequence
    # over tensor) or "scatter" (row: the output leaves reduce-scattered along the sequence).
    seq_mode: str | None = None
    # its kernel's gradient can wait for a zero-bubble pipeline's W pass (jaxpar.layers.wgrad)
    defers_wgrad = True

    def _matmul(self, x, kernel, bias):
        ni, no = len(self.in_features), len(self.out_features)
        letters = string.ascii_letters
        batch = letters[: x.ndim - ni]
        ins = letters[x.ndim - ni: x.ndim]
        outs = letters[x.ndim: x.ndim + no]
        y = jnp.einsum(f"{batch}{ins},{ins}{outs}->{batch}{outs}", x.astype(self.dtype), kernel.astype(self.dtype))
        return y if bias is None else y + bias.astype(self.dtype)

    def __call__(self, x: jax.Array, transform=None) -> jax.Array:
        """``x @ kernel (+ bias)``. ``transform(kernel) -> (kernel', axes')``: a function of the stored
        kernel (in its compute layout) to multiply by instead, with the logical names of its dims (e.g.
        attention's K/V heads copied for the tensor devices that share them); its output activation
        takes ``act_axes``."""
        rules = active_rules()
        kernel, axes = self.kernel[...], self.kernel_axes
        if transform is not None:
            kernel, axes = transform(constrain_weight(kernel, axes))
        if rules is not None and rules.megatron_sp and self.seq_mode is not None:
            y = self._sequence_parallel(x, rules, kernel, axes)
        else:
            kernel = constrain_weight(kernel, axes)
            bias = None if self.bias is None else constrain_weight(self.bias[...], self.bias_axes)
            # a zero-bubble stage's B defers the kernel's gradient to its W (jaxpar.layers.wgrad)
            deferred = None if transform is not None else wgrad.matmul(self, x.astype(self.dtype),
                                                                       kernel.astype(self.dtype))
            if deferred is None:
                y = self._matmul(x, kernel, bias)
            else:
                y = deferred if bias is None else deferred + bias.astype(self.dtype)
            y = constrain(y, self.act_axes) if self.act_axes is not None else y
        return y if self.name is None else checkpoint_name(y, self.name)

    def _sequence_parallel(self, x: jax.Array, rules, kernel: jax.Array, axes: tuple) -> jax.Array:
        """Explicit Megatron-SP collectives in a shard_map: all-gather the input along the sequence
        before a column-parallel matmul; reduce-scatter the output of a row-parallel one."""
        p = rules.params
        in_act = tuple(_activation_name(a, p) for a in axes[: len(self.in_features)])
        length = "res_length" if self.seq_mode == "gather" else "length"
        x_spec = p.spec(("batch", length) + in_act)
        out_spec = p.spec(self.act_axes)
        k_spec = rules.compute.spec(axes)
        b_spec = rules.compute.spec(self.bias_axes)

        def local(x, kernel, bias):
            if self.seq_mode == "gather":
                return self._matmul(jax.lax.all_gather(x, "tensor", axis=1, tiled=True), kernel, bias)
            y = jax.lax.psum_scatter(self._matmul(x, kernel, None), "tensor", scatter_dimension=1, tiled=True)
            return y if bias is None else y + bias.astype(self.dtype)

        bias = None if self.bias is None else self.bias[...]
        fn = jax.shard_map(local, mesh=p.mesh, in_specs=(x_spec, k_spec, None if bias is None else b_spec),
                           out_specs=out_spec)
        return fn(x, kernel, bias)


def _activation_name(weight_name: str, rules) -> str | None:
    """The activation logical name matching a weight dim (``mlp`` -> ``act_mlp``), if any."""
    name = f"act_{weight_name}"
    return name if name in rules.table else None


class ColumnParallelLinear(ParallelLinear):
    """Output features split over ``tensor`` (defaults: ``embed -> mlp``)."""

    seq_mode = "gather"

    def __init__(self, in_features: Shape, out_features: Shape, *, in_axes=("embed",), out_axes=("mlp",),
                 act_axes=("batch", "length", "act_mlp"), **kw):
        super().__init__(in_features, out_features, in_axes=in_axes, out_axes=out_axes, act_axes=act_axes, **kw)


class RowParallelLinear(ParallelLinear):
    """Input features split over ``tensor`` (defaults: ``mlp -> embed``); output all-reduced, or
    reduce-scattered along the sequence under Megatron sequence parallelism."""

    seq_mode = "scatter"

    def __init__(self, in_features: Shape, out_features: Shape, *, in_axes=("mlp",), out_axes=("embed",),
                 act_axes=("batch", "res_length", "act_embed"), **kw):
        super().__init__(in_features, out_features, in_axes=in_axes, out_axes=out_axes, act_axes=act_axes, **kw)
