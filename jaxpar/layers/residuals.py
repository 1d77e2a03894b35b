"""A pipeline stage's forward residuals, kept from its F to its B (``parallel.stage_remat=false``, the default).

A schedule that computes its own gradients (1F1B, interleaved 1F1B, ZB-H1, ZB-V) runs a stage's backward
in a later iteration than its forward. With ``parallel.stage_remat=true`` the backward runs the stage's
forward again from the kept input (the stage rematerialised as a whole). Keeping what ``jax.vjp`` linearised
instead saves that forward: B then runs only the backward, the layers' remat policy (``model.remat``) deciding
what the forward keeps (``none``: every activation; ``full``: each layer's input).

Not every residual of a stage's ``jax.vjp`` belongs to the microbatch: the linearisation of a scan over
layers re-emits its stacked (selected, cast) weights as residuals, and keeping those per microbatch would
copy the stage's weights into every slot. :class:`Residuals` traces the function once and splits its
residuals with JAX's partial evaluation (the chunk input unknown, everything else known): those that
depend on the input are kept per slot (:attr:`Residuals.kept`); the rest depend only on the weights and
the other arguments, which the backward has again, and are computed again there from the known half of
the program (casts, slices and transposes of weights: no matmul of the forward).

The kept residuals live in a buffer of slots (one per microbatch in flight). Most of them are stacked over
the stage's layers, and the backward's loop over the layers scans them: given a slot's slice whole, XLA
materialises it as that loop's operand, a copy of the slot. :meth:`Residuals.apply_reading` runs the
backward reading each such residual a layer at a time from the buffer inside the loop instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core, source_info_util
from jax._src.interpreters import partial_eval as pe  # the JAX version's partial evaluation (pinned >= 0.10.2)


class Residuals:
    """The residuals of ``vjp_fn(known, x) -> (out, pullback)`` split by whether they depend on ``x``.

    ``known`` and ``x`` are pytrees (arrays or ``ShapeDtypeStruct``), the same structure and shapes as the
    calls that follow. :meth:`forward` runs the function (``(out, kept)``: the residuals to keep for the
    backward), :meth:`pullback` rebuilds the pullback from them and ``known`` (``known`` as at the backward:
    the same weights; per-microbatch values, such as a microbatch's rows, those of the same microbatch)."""

    def __init__(self, vjp_fn, known, x):
        self._treedefs: dict = {}

        def flat(known, x):
            out, pullback = vjp_fn(known, x)
            res, self._treedefs["pullback"] = jax.tree.flatten(pullback)
            outs, self._treedefs["out"] = jax.tree.flatten(out)
            return outs, res

        k_leaves, x_leaves = jax.tree.leaves(known), jax.tree.leaves(x)
        closed, (outs, res) = jax.make_jaxpr(flat, return_shape=True)(known, x)
        self._closed, self._n_out = closed, len(outs)
        unknowns = [False] * len(k_leaves) + [True] * len(x_leaves)
        known_jaxpr, _, out_unknown, _ = pe.partial_eval_jaxpr_nounits(closed, unknowns, instantiate=False)
        self.depends = tuple(out_unknown[self._n_out:])  # per residual: depends on x (kept) or not (recomputed)
        self.kept = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r, d in zip(res, self.depends) if d]
        # the known half's outputs: those of ``flat`` that do not depend on x, then its residuals for the unknown
        # half; the backward wants only the first kind's residuals of the stage (not its outputs)
        known_out = [i for i, u in enumerate(out_unknown) if not u]
        want = [i >= self._n_out for i in known_out]
        want += [False] * (len(known_jaxpr.jaxpr.outvars) - len(known_out))
        self._known_jaxpr, self._known_used = pe.dce_jaxpr(known_jaxpr.jaxpr, want, instantiate=False)
        self._known_consts = known_jaxpr.consts

    def forward(self, known, x):
        """``(out, kept)``: the function's output and the residuals to keep for :meth:`pullback`."""
        k_leaves, x_leaves = jax.tree.leaves(known), jax.tree.leaves(x)
        got = jax.core.eval_jaxpr(self._closed.jaxpr, self._closed.consts, *k_leaves, *x_leaves)
        outs, res = got[:self._n_out], got[self._n_out:]
        return (jax.tree.unflatten(self._treedefs["out"], outs),
                [r for r, d in zip(res, self.depends) if d])

    def pullback(self, known, kept):
        """The pullback of :meth:`forward`'s call from its kept residuals and ``known`` again."""
        k_leaves = jax.tree.leaves(known)
        ins = [v for v, u in zip(k_leaves, self._known_used) if u]
        again = iter(jax.core.eval_jaxpr(self._known_jaxpr, self._known_consts, *ins))
        kept_it = iter(kept)
        res = [next(kept_it) if d else next(again) for d in self.depends]
        return jax.tree.unflatten(self._treedefs["pullback"], res)

    def apply_reading(self, known, read, fn, *args):
        """``fn(pullback, *args)`` for :meth:`pullback`'s ``pullback`` (e.g. ``lambda p, ct: p(ct)``), with the
        kept residuals left in their buffer: ``read(i, j)`` is kept residual ``i`` (``j`` None) or its ``[j]``
        along its leading dim (``j`` traced). Where the backward's loop over the layers (a ``scan``, at the
        top or in a ``jit``) scans a kept residual, each iteration reads its layer's ``read(i, j)``; any
        other use reads it whole, and a residual ``fn`` does not use is not read. The same numbers as
        ``fn(pullback(known, [read(i, None) ...]), *args)``."""
        k_leaves, (a_leaves, a_def) = jax.tree.leaves(known), jax.tree.flatten(args)
        got = {}

        def traced(k, kept, a):
            out = fn(self.pullback(jax.tree.unflatten(jax.tree.structure(known), k), kept),
                     *jax.tree.unflatten(a_def, a))
            leaves, got["tree"] = jax.tree.flatten(out)
            return leaves

        closed = jax.make_jaxpr(traced)(k_leaves, self.kept, a_leaves)
        lazy = [_Kept(read, i) for i in range(len(self.kept))]
        return jax.tree.unflatten(got["tree"], _eval_reading(closed.jaxpr, closed.consts,
                                                              [*k_leaves, *lazy, *a_leaves]))


def slot_reader(bufs, slot, dtypes=None):
    """``read(i, j)`` for :meth:`Residuals.apply_reading`: slot ``slot`` of buffer ``bufs[i]`` (``j`` None), or
    that slot's ``[j]`` as one dynamic slice of the buffer (XLA fuses the two indexings), as ``dtypes[i]``
    where given (a stash holds 16-bit floats as their bits: :func:`jaxpar.layers.pipeline.as_stored`)."""
    def read(i, j):
        at = jax.lax.dynamic_index_in_dim(bufs[i], slot, 0, keepdims=False)
        if j is not None:
            at = jax.lax.dynamic_index_in_dim(at, j, 0, keepdims=False)
        return at if dtypes is None else jax.lax.bitcast_convert_type(at, dtypes[i])
    return read


class _Kept:
    """A kept residual not yet read from its buffer (:meth:`Residuals.apply_reading`)."""

    def __init__(self, read, i):
        self.read, self.i = read, i

    def whole(self):
        return self.read(self.i, None)


def _whole(v):
    return v.whole() if isinstance(v, _Kept) else v


def _eval_reading(jaxpr, consts, args):
    """``jax.core.eval_jaxpr`` where ``args`` may hold :class:`_Kept` values: a ``scan`` reads those it scans
    a layer at a time inside its loop; a ``jit`` is evaluated the same way inside; any other use reads the
    whole residual."""
    env = {}

    def get(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [get(v) for v in eqn.invars]
        name = eqn.primitive.name
        if any(isinstance(x, _Kept) for x in ins) and name == "scan":
            outs = _scan_reading(eqn.params, ins)
        elif any(isinstance(x, _Kept) for x in ins) and name in ("pjit", "jit"):
            inner = eqn.params["jaxpr"]
            outs = _eval_reading(inner.jaxpr, inner.consts, ins)
        else:
            params = eqn.primitive.get_bind_params(eqn.params)
            stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with source_info_util.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
                outs = eqn.primitive.bind(*[_whole(x) for x in ins], **params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [_whole(get(v)) for v in jaxpr.outvars]


def _scan_reading(params, ins):
    """A ``scan`` equation's outputs, its scanned :class:`_Kept` operands read a row per iteration."""
    nc, ncar, length = params["num_consts"], params["num_carry"], params["length"]
    consts = [_whole(x) for x in ins[:nc]]
    init = [_whole(x) for x in ins[nc:nc + ncar]]
    xs = ins[nc + ncar:]
    plain = [x for x in xs if not isinstance(x, _Kept)]
    body = params["jaxpr"]

    def step(carry, inp):
        j, rest = inp
        it = iter(rest)
        row = [x.read(x.i, j) if isinstance(x, _Kept) else next(it) for x in xs]
        out = _eval_reading(body.jaxpr, body.consts, [*consts, *carry, *row])
        return out[:ncar], out[ncar:]

    carry, ys = jax.lax.scan(step, init, (jnp.arange(length), plain), length=length, reverse=params["reverse"],
                             unroll=params["unroll"])
    return [*carry, *ys]
