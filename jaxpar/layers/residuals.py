"""A pipeline stage's forward residuals, kept from its F to its B (``parallel.stage_remat=false``).

A schedule that computes its own gradients (1F1B, interleaved 1F1B, ZB-H1, ZB-V) runs a stage's backward
in a later iteration than its forward. By default the backward runs the stage's forward again from the
kept input (the stage rematerialised as a whole). Keeping what ``jax.vjp`` linearised instead saves that
forward: B then runs only the backward, the layers' remat policy (``model.remat``) deciding what the
forward keeps (``none``: every activation; ``full``: each layer's input).

Not every residual of a stage's ``jax.vjp`` belongs to the microbatch: the linearisation of a scan over
layers re-emits its stacked (selected, cast) weights as residuals, and keeping those per microbatch would
copy the stage's weights into every slot. :class:`Residuals` traces the function once and splits its
residuals with JAX's partial evaluation (the chunk input unknown, everything else known): those that
depend on the input are kept per slot (:attr:`Residuals.kept`); the rest depend only on the weights and
the other arguments, which the backward has again, and are computed again there from the known half of
the program (casts, slices and transposes of weights: no matmul of the forward).
"""

from __future__ import annotations

import jax
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
