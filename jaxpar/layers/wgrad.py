"""A stage's backward split in two: B, the input cotangent, and W, the weight gradients of its matmuls.

A zero-bubble pipeline (:mod:`jaxpar.layers.zero_bubble`) runs a stage's backward as two passes: B, which
the previous stage waits for, and W, which nothing waits for and which fills the bubble. For a matmul
``y = x @ k`` the backward is ``dx = dy @ k^T`` (B) and ``dk = x^T @ dy`` (W); W needs ``x`` and ``dy`` of
every matmul of the stage, and nothing else.

:func:`vjp` runs a stage's function with every :class:`~jaxpar.layers.linear.ParallelLinear` of its
layers (inside the stack's scan: :class:`~jaxpar.layers.stack.Stack`) multiplying through a ``custom_vjp``
whose backward returns ``dx`` and, instead of ``dk``, the pair ``(x, dy)`` as the cotangent of an extra
input, a *tap*: zeros shaped like that pair, stacked over the stage's layers. ``jax.vjp`` of the stage in
its input and its taps is B: it gives the input's cotangent and the taps' (every matmul's ``x`` and
``dy``), from the same forward and the same residuals as a plain backward (no forward run twice). The
gradient of every weight that is not such a kernel (norms, biases, a router, the experts' stacks, a
kernel reached through a transform or under Megatron sequence parallelism) comes out of B as usual:
deferring is a split of the work, never a change of the math. :func:`weight_grads` is W: one
``x^T dy`` per kernel, batched over the layers, added to the kernel's gradient.

Which matmuls defer is found once per stage function by tracing it (:func:`sites`): the kernels called
exactly once per layer, directly (no ``transform``, no Megatron-SP ``shard_map``, not in a stack nested in
the layer).
"""

from __future__ import annotations

import contextlib
import functools
import string
import threading
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

_STATE = threading.local()


@dataclass(frozen=True)
class Site:
    """A deferred matmul: the kernel's path in a layer's state, the shapes of its input and output (one
    layer's), its feature dims and its stored dtype."""
    path: tuple
    x: jax.ShapeDtypeStruct
    y: jax.ShapeDtypeStruct
    n_in: int
    n_out: int
    param_dtype: np.dtype


def _active():
    return getattr(_STATE, "ctx", None)


@contextlib.contextmanager
def _context(ctx):
    old = _active()
    _STATE.ctx = ctx
    try:
        yield
    finally:
        _STATE.ctx = old


class _Record:
    """Tracing to find the sites: every direct call of a layer's kernel, counted."""

    def __init__(self):
        self.calls: dict[tuple, list] = {}
        self.paths: dict[int, tuple] = {}
        self.depth = 0


class _Taps:
    """Running with taps: ``taps[path] = (x, dy)`` stacked over the layers, layer ``j`` in use."""

    def __init__(self, taps):
        self.taps = taps
        self.paths: dict[int, tuple] = {}
        self.depth = 0
        self.layer = None


@contextlib.contextmanager
def layer_scope(layer: nnx.Module, j=None):
    """In the stack's scan body, around one layer's call (``j``: its index in the group, traced): lets the
    matmuls of ``layer`` find their sites. Nothing when no stage runs deferred."""
    ctx = _active()
    if ctx is None:
        yield
        return
    old = (ctx.paths, getattr(ctx, "layer", None))
    # a stack inside a layer (a MoE model's group of sublayers) runs its own scan: its kernels, stacked once
    # more, keep their gradients in B (its merged layers are new objects, unknown to the outer scope)
    nested = ctx.depth > 0
    ctx.depth += 1
    ctx.paths = {} if nested else {id(m): tuple(p) for p, m in nnx.iter_graph(layer)
                                   if getattr(m, "defers_wgrad", False)}
    if isinstance(ctx, _Taps):
        ctx.layer = j
    try:
        yield
    finally:
        ctx.depth -= 1
        ctx.paths, layer_old = old
        if isinstance(ctx, _Taps):
            ctx.layer = layer_old


def _spec(x_ndim: int, n_in: int, n_out: int) -> tuple[str, str, str]:
    letters = string.ascii_letters[1:]  # "a" is the layers' dim in weight_grads
    batch, ins = letters[: x_ndim - n_in], letters[x_ndim - n_in: x_ndim]
    outs = letters[x_ndim: x_ndim + n_out]
    return batch, ins, outs


def matmul(module, x: jax.Array, kernel: jax.Array):
    """``x @ kernel`` over ``module``'s feature dims, through its site when a deferred stage runs (else
    None: the caller multiplies as usual). ``x`` and ``kernel`` in the compute dtype."""
    ctx = _active()
    if ctx is None or id(module) not in ctx.paths:
        return None
    path = ctx.paths[id(module)]
    n_in, n_out = len(module.in_features), len(module.out_features)
    batch, ins, outs = _spec(x.ndim, n_in, n_out)
    spec = f"{batch}{ins},{ins}{outs}->{batch}{outs}"
    if isinstance(ctx, _Record):
        y = jnp.einsum(spec, x, kernel)
        ctx.calls.setdefault(path, []).append(Site(path, jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                   jax.ShapeDtypeStruct(y.shape, y.dtype), n_in, n_out,
                                                   np.dtype(module.kernel[...].dtype)))
        return y
    if path not in ctx.taps:
        return None
    tap = jax.tree.map(lambda a: a[ctx.layer], ctx.taps[path])
    return _tapped(spec, x, kernel, tap)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tapped(spec, x, kernel, tap):
    return jnp.einsum(spec, x, kernel)


def _tapped_fwd(spec, x, kernel, tap):
    return jnp.einsum(spec, x, kernel), (x, kernel)


def _tapped_bwd(spec, res, dy):
    """B's share: ``dx``; the kernel's cotangent is left out (zero: W adds it) and the tap's is ``(x, dy)``."""
    x, kernel = res
    _, vjp = jax.vjp(lambda x: jnp.einsum(spec, x, kernel), x)
    return vjp(dy)[0], None, (x, dy)


_tapped.defvjp(_tapped_fwd, _tapped_bwd)


def sites(fn, *args) -> dict[tuple, Site]:
    """The matmuls of ``fn(*args)`` (a stage's function) that defer their weight gradient: a layer's kernel
    multiplied directly once per layer (found by tracing ``fn``; nothing runs)."""
    rec = _Record()
    with _context(rec):
        jax.eval_shape(fn, *args)
    return {p: calls[0] for p, calls in rec.calls.items() if len(calls) == 1}


def zero_taps(found: dict[tuple, Site], layers: int) -> dict:
    """The taps of ``layers`` layers: zeros shaped like each site's ``(x, dy)``, stacked."""
    return {p: (jnp.zeros((layers, *s.x.shape), s.x.dtype), jnp.zeros((layers, *s.y.shape), s.y.dtype))
            for p, s in found.items()}


def vjp(fn, found: dict[tuple, Site], layers: int, *primals):
    """``jax.vjp`` of ``fn(*primals)`` with the weight gradients of the ``found`` sites deferred: returns
    ``(out, pullback)``, ``pullback(ct) -> (*cotangents of primals, taps)``; the kernels of the sites get
    no cotangent from their deferred matmuls (:func:`weight_grads` gives it from ``taps``)."""
    def with_taps(*a):
        *args, taps = a
        with _context(_Taps(taps)):
            return fn(*args)

    return jax.vjp(with_taps, *primals, zero_taps(found, layers))


def _keys(path) -> tuple:
    out = []
    for k in path:
        out.append(k.key if isinstance(k, jax.tree_util.DictKey) else k.idx
                   if isinstance(k, jax.tree_util.SequenceKey) else k.name)
    return tuple(out)


def kernel_leaves(tree, found: dict[tuple, Site]) -> dict[tuple, int]:
    """The index, among ``jax.tree.leaves(tree)`` (a stage's stacked state, or ``(state, values)``), of each
    site's kernel."""
    index = {}
    for i, (kp, _) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        keys = _keys(kp)
        keys = keys[:-1] if keys and keys[-1] == "value" else keys
        index[keys] = i
        if keys and keys[0] == 0:  # (state, values)
            index.setdefault(keys[1:], i)
    out = {}
    for p in found:
        key = (*p, "kernel")
        if key not in index:
            raise RuntimeError(f"jaxpar: the kernel of the deferred matmul at {'/'.join(map(str, p))} is not a leaf "
                               "of the stage's state")
        out[p] = index[key]
    return out


def weight_grads(found: dict[tuple, Site], taps: dict) -> dict[tuple, jax.Array]:
    """W: each site's kernel gradient ``[layers, *in, *out]`` (stored dtype) from its taps' ``x`` and
    ``dy``, one matmul over every layer's batch."""
    out = {}
    for p, s in found.items():
        x, dy = taps[p]
        batch, ins, outs = _spec(s.x.ndim, s.n_in, s.n_out)
        dk = jnp.einsum(f"a{batch}{ins},a{batch}{outs}->a{ins}{outs}", x, dy)
        out[p] = dk.astype(s.param_dtype)
    return out


def inputs_from(taps_of, found: dict[tuple, Site], *args):
    """W's matmul inputs read from what B's pullback is built of, where that takes no matmul: ``taps_of(*args)``
    gives the taps (``{path: (x, dy)}``, from a pullback of kept residuals); the returned function of the same
    ``args`` gives ``{path: x}`` alone, JAX's dead-code elimination having cut every other output (the cotangents,
    and with them the backward) out of the traced program. With the forward's residuals kept and no remat, a
    matmul's input is one of them, restacked over the layers: W can read it from the residuals, kept until W,
    and the taps hold only the output cotangents. None where the inputs need a matmul (a remat policy's
    recompute). The output cotangent (the last argument) may stay in the cut program, carried through the
    backward's loops that JAX's elimination keeps: nothing the inputs are computed from, the caller passes
    zeros."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe

    paths = list(found)
    closed = jax.make_jaxpr(lambda *a: [taps_of(*a)[p][0] for p in paths])(*args)
    jaxpr, used = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars), instantiate=True)
    if _has_matmul(jaxpr):
        return None
    consts = closed.consts

    def fn(*a):
        leaves = [v for v, u in zip(jax.tree.leaves(a), used) if u]
        return dict(zip(paths, core.eval_jaxpr(jaxpr, consts, *leaves)))

    return fn


def _has_matmul(jaxpr) -> bool:
    """Whether ``jaxpr`` or a program nested in it (a scan's body, a remat's) multiplies matrices."""
    from jax._src import core

    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot", "ragged_dot_general", "conv_general_dilated"):
            return True
        if any(_has_matmul(j) for j in core.jaxprs_in_params(eqn.params)):
            return True
    return False
