"""``Stack``: a stack of identical layers, and everything about running it.

A model builds its repeated layers once with :meth:`Stack.create` (weights stacked on a leading dim
named ``layers``, which the partitioning rules split over ``pipe``) and applies them with
``Stack(layers, remat=...)(x, *args)``. The stack decides how: a ``lax.scan`` over the layers (compile
time flat in depth), each layer rematerialised with the ``model.remat`` policy
(:mod:`jaxpar.layers.remat`), or, when the active layout has ``pipe > 1``, the pipeline
(:mod:`jaxpar.layers.pipeline`: GPipe or circular), each stage scanning its layers with the same
policy. Under a pipeline, :meth:`Stack.loss` runs the whole model in it for training (the stack
between an embedding on the first stage and a loss on the last, in any schedule:
:func:`~jaxpar.layers.pipeline.pipeline_loss`, :func:`~jaxpar.layers.pipeline.one_f_one_b`).
:func:`storage_order` is the physical order of the stacked layers (stage-major under a circular
pipeline; with uneven stages, ``parallel.stage_layers``, each stage's group padded to the longest with
slots that pass their input on), which the trainer applies to parameters and undoes for checkpoints
(:func:`to_storage` maps per-layer values the same way). The model knows none of this::

    class MyModel(nnx.Module):
        def __init__(self, rngs):
            self.blocks = Stack.create(lambda r: MyBlock(r), 12, rngs)
        def __call__(self, x):
            return Stack(self.blocks, remat="save_dots")(x)

A stack inside a layer (e.g. a MoE group's dense blocks) is created with ``axis="sublayers"`` and
applied with ``pipelined=False``: a plain scan inside its stage.

Layers that differ in a value but not in their weights' shapes (Gemma 3's sliding-window and global
layers: the window, the RoPE base) stay one stack: ``Stack(layers, per_layer={"window": [n]})`` scans
the values (float32, in layer order; put in storage order here) with the weights, through the pipeline
too, and calls each layer as ``layer(h, *args, window=w_i)``. Compile time stays flat in depth.

Inputs that differ per batch row (packed documents' segment ids and positions, ``[B, T]``) are
``Stack(layers, rows={"segment_ids": ..., ...})``: each layer gets them as keyword arguments, and
through a pipeline each microbatch gets its own rows (the stage looks them up by the microbatch it
runs, so they travel with it without crossing ``pipe``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ConfigError
from jaxpar.layers import wgrad
from jaxpar.layers.pipeline import one_f_one_b, pipeline, pipeline_loss, stage_major_order
from jaxpar.layers.remat import remat as rematerialise
from jaxpar.layers.zero_bubble import KINDS as ZERO_BUBBLE
from jaxpar.layers.zero_bubble import zero_bubble_forward, zero_bubble_loss
from jaxpar.layers.remat import select_remat
from jaxpar.partitioning import active_rules


def storage_order(n: int, stages: int, repeats: int, counts=None, v: bool = False) -> np.ndarray:
    """``order[p]``: the layer a stack of ``n`` stores at position p: stage-major under a circular
    pipeline (``stages`` > 1 and ``repeats`` > 1, :func:`~jaxpar.layers.pipeline.stage_major_order`),
    so that each device's layer groups are contiguous; with uneven ``counts`` (the layers of each group,
    :func:`~jaxpar.partitioning.layer_groups`) every group padded to max(counts) slots, a padding
    slot holding -1; else ``0..n-1``."""
    if counts is not None and len(set(counts)) > 1:
        return stage_major_order(n, stages, repeats, counts, v)
    if stages == 1 or repeats == 1:
        return np.arange(n)
    return np.asarray(stage_major_order(n, stages, repeats, v=v))


def v_shaped(parallel=None) -> bool:
    """Whether the layout (``parallel``, or the active rules') stores its layers for ZB-V (each stage's second
    chunk on the way back up)."""
    if parallel is None:
        rules = active_rules()
        parallel = None if rules is None else rules.parallel
    return parallel is not None and parallel.pipeline_schedule == "zb_v"


def layer_positions(order: np.ndarray) -> np.ndarray:
    """``pos[l]``: the storage position of layer l (the inverse of :func:`storage_order`, padding left out)."""
    real = np.flatnonzero(order >= 0)
    return real[np.argsort(order[real])]


def restack(a, order: np.ndarray, inverse: bool = False):
    """The rows of a stacked ``a`` from layer order to the storage ``order`` (:func:`storage_order`; its
    padding rows zero), or back to layer order (``inverse``: the padding left out)."""
    if inverse:
        return a[layer_positions(order)]
    if np.all(order >= 0):  # a permutation (circular)
        return a[order]
    real = (order >= 0).reshape(-1, *(1,) * (np.ndim(a) - 1))
    return jnp.where(real, a[np.maximum(order, 0)], jnp.zeros((), a.dtype))


def uneven_groups(n_stored: int | None = None) -> tuple[int, ...] | None:
    """The layers of each pipeline group when the active layout's stages are uneven (its resolved
    ``parallel.stage_layers``, which the trainer sets from the model's layer count), else None. With
    ``n_stored`` (a stack's stored layer dim) it checks that the stack is stored for that layout."""
    rules = active_rules()
    if rules is None or rules.parallel is None or rules.axis_size("pipe") == 1:
        return None
    s_, r_ = rules.axis_size("pipe"), rules.parallel.pipeline_repeats
    given = rules.parallel.stage_layer_list()
    counts = given if given and len(set(given)) > 1 else None
    if n_stored is not None:
        slots = s_ * r_ * max(counts) if counts else n_stored
        if n_stored != slots or n_stored % (s_ * r_):
            raise ConfigError(f"a stack of {n_stored} stored layers does not fit the pipeline's {s_ * r_} groups "
                              + (f"of parallel.stage_layers={rules.parallel.stage_layers} (stored as {slots} "
                                 "slots: the trainer pads the stack, jaxpar.trainer.Trainer.to_storage_order)"
                                 if counts else "evenly; set parallel.stage_layers (uneven stages, padded by the "
                                 "trainer) or change the layer count"))
    return counts


def to_storage(rows, n: int):
    """Per-layer values ``[n, ...]`` in layer order -> the active layout's storage order (padding rows zero);
    the identity without a pipeline that reorders or pads."""
    rules = active_rules()
    if rules is None or rules.parallel is None or rules.axis_size("pipe") == 1:
        return rows
    order = storage_order(n, rules.axis_size("pipe"), rules.parallel.pipeline_repeats, uneven_groups(),
                          v_shaped(rules.parallel))
    if np.array_equal(order, np.arange(n)):
        return rows
    return jax.tree.map(lambda a: restack(a, order), rows)


def loss_in_pipeline() -> bool:
    """Whether the active layout pipelines the layer stack (``pipe > 1``, any schedule): the model's
    loss then goes through :meth:`Stack.loss`, which runs the embedding on the first stage and the
    head and loss on the last, inside the pipeline (:mod:`jaxpar.layers.pipeline`)."""
    rules = active_rules()
    return rules is not None and rules.parallel is not None and rules.axis_size("pipe") > 1


class Stack:
    """Run ``layers`` (built by :meth:`create`) on ``x``: ``Stack(layers, remat=...)(x, *args)``.

    Each layer is called as ``layer(h, *args)`` and returns ``h``, or ``(h, y)`` with ``outputs=True``
    (per-layer outputs, e.g. router statistics: the result is then ``(h, ys)`` with ``ys`` stacked on
    a leading layer dim in layer order; through a pipeline, each the mean over the microbatches).
    ``recast=True`` (a stack that runs once per microbatch inside a pipeline's loop, as a MoE model's dense
    lead-in): under ``remat=none`` its backward casts each layer's weights again, as a pipeline stage does
    (:func:`~jaxpar.layers.remat.select_remat`), rather than keep the cast stack, a copy of its weights,
    while the microbatch's backward runs.
    """

    def __init__(self, layers: nnx.Module, *, remat: str = "none", outputs: bool = False, pipelined: bool = True,
                 per_layer: dict | None = None, rows: dict | None = None, recast: bool = False):
        self.layers, self.remat, self.outputs, self.pipelined = layers, remat, outputs, pipelined
        self.recast = recast
        self.per_layer = dict(per_layer or {})
        self.rows = {k: v for k, v in (rows or {}).items() if v is not None}

    @staticmethod
    def create(make, n: int, rngs: nnx.Rngs, axis: str = "layers") -> nnx.Module:
        """``n`` copies of ``make(rngs)`` with weights stacked on a leading dim named ``axis``
        (``layers``: the model's stack, split over ``pipe``; ``sublayers``: a stack inside a layer)."""

        @nnx.split_rngs(splits=n)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
        def build(r):
            return make(r)

        return build(rngs)

    def _stages(self) -> tuple[int, int, int] | None:
        """(stages, repeats, microbatches) of the active layout's pipeline, None without one."""
        rules = active_rules()
        if not self.pipelined or rules is None or rules.parallel is None or rules.axis_size("pipe") == 1:
            return None
        s_ = rules.axis_size("pipe")
        return s_, rules.parallel.pipeline_repeats, rules.parallel.microbatches or s_

    def _state(self):
        """``(graphdef, state, order)`` of the layers; with per-layer values or uneven pipeline stages,
        ``state`` is ``(weights, values)``, the values ``[stored]`` float32 in the active layout's storage
        order (scanned and pipelined alike; uneven stages add ``_ACTIVE``, 0 on the padding slots);
        ``order`` the storage order (:func:`storage_order`), None when it is layer order."""
        graphdef, state = nnx.split(self.layers)
        pipe = self._stages()
        stored = jax.tree.leaves(state)[0].shape[0]
        counts = uneven_groups(stored) if pipe else None
        n = sum(counts) if counts else stored
        order = storage_order(n, pipe[0], pipe[1], counts, v_shaped()) if pipe else np.arange(n)
        order = None if np.array_equal(order, np.arange(stored)) else order
        if not self.per_layer and counts is None:
            return graphdef, state, order
        values = {}
        for k, v in self.per_layer.items():
            v = np.asarray(v, np.float32)
            if v.shape != (n,):
                raise ValueError(f"Stack(per_layer={{{k!r}: ...}}) needs one value per layer ({n}); got shape "
                                 f"{v.shape}")
            values[k] = jnp.asarray(v if order is None else restack(v, order))
        if counts is not None:
            values[_ACTIVE] = jnp.asarray(order >= 0, np.float32)
        return graphdef, (state, values), order

    def _stage_fn(self, graphdef, args, with_values: bool):
        """``(group_state, h, select=None, rows=None) -> h`` (or ``(h, ys)``): a scan of the layers in
        ``group_state``, each given ``rows`` (a microbatch's; None: the stack's own) as keywords; a padding
        slot of uneven stages passes ``h`` on (its outputs zero)."""
        def run(group, h, select=None, rows=None):
            rows = self.rows if rows is None else rows

            def body(h, layer_state, j=None):  # j: the layer's index in its group, for a deferred B's taps
                if not with_values:
                    layer = nnx.merge(graphdef, layer_state)
                    with wgrad.layer_scope(layer, j):
                        out = layer(h, *args, **rows)
                    return out if self.outputs else (out, None)
                layer_state, values = layer_state
                values = dict(values)
                active = values.pop(_ACTIVE, None)
                layer = nnx.merge(graphdef, layer_state)
                with wgrad.layer_scope(layer, j):
                    out = layer(h, *args, **values, **rows)
                out = out if self.outputs else (out, None)
                if active is None:
                    return out
                on = active > 0  # a padding slot: h unchanged, outputs zero
                return (jnp.where(on, out[0], h),
                        jax.tree.map(lambda y: jnp.where(on, y, jnp.zeros_like(y)), out[1]))

            if select is None:
                h, ys = jax.lax.scan((select_remat if self.recast else rematerialise)(body, self.remat), h, group)
            else:  # layers first .. first + count - 1 of `group`, each selected inside the remat
                first, count = select

                def body_at(h, j):
                    return body(h, jax.tree.map(lambda a: a[first + j], group), j)

                h, ys = jax.lax.scan(select_remat(body_at, self.remat), h, jnp.arange(count))
            return (h, ys) if self.outputs else h

        return run

    def __call__(self, x: jax.Array, *args):
        graphdef, state, order = self._state()
        stage_fn = self._stage_fn(graphdef, args, isinstance(state, tuple))
        pipe = self._stages()
        if pipe is None:
            return stage_fn(state, x)
        if self.rows:
            raise NotImplementedError("per-row inputs (packed documents) run through a pipeline in the training "
                                      "loss (Stack.loss) only, not in a forward of the stack")
        s_, r_, m_ = pipe
        if v_shaped():  # ZB-V's storage: its forwards down the stages and back up
            out = zero_bubble_forward("zb_v", stage_fn, lambda _, h: h, None, state, {}, x, None, stages=s_,
                                      microbatches=m_, ys_weights={} if self.outputs else None)
            out = out if self.outputs else out[0]
        else:
            out = pipeline(stage_fn, state, x, stages=s_, repeats=r_, microbatches=m_, outputs=self.outputs)
        return (out[0], _in_layer_order(out[1], order)) if self.outputs else out

    def loss(self, first_fn, last_fn, outer, tokens: jax.Array, targets: jax.Array, *args,
             weights: dict | None = None, lead_fn=None) -> tuple[jax.Array, dict | None]:
        """The model's loss with the stack in between, in the layout's pipeline (needs ``pipe > 1``):
        ``first_fn(outer, tokens) -> x`` (the embedding, run on the first stage), the stack (``*args``
        passed to each layer), ``last_fn(outer, h, targets) -> mean loss`` (final norm, head, loss: run
        on the last stage, on a microbatch or on the whole batch at once: the loss of the whole batch is
        the mean over equal microbatches); ``tokens`` and ``targets`` may be pytrees of ``[B, ...]``
        arrays, sliced into microbatches alike; ``outer`` the weights of both (a pytree, e.g. ``nnx.split``
        state). With
        ``weights`` (a dict over the layers' outputs, which then need ``outputs=True``) the loss adds
        ``sum weight x sum over layers``. Returns ``(loss, outputs)``: the per-layer outputs averaged
        over microbatches (for metrics; None without ``weights``). ``lead_fn(outer, x, tokens) -> x``: layers
        run on the first stage after ``first_fn``, per microbatch inside the schedule (a MoE model's dense first
        layers: :func:`~jaxpar.layers.pipeline.one_f_one_b`). GPipe and circular:
        :func:`~jaxpar.layers.pipeline.pipeline_loss`; 1F1B: :func:`~jaxpar.layers.pipeline.one_f_one_b`."""
        pipe = self._stages()
        if pipe is None:
            raise ValueError("Stack.loss runs the stack in a pipeline: it needs parallel.pipe > 1")
        s_, r_, m_ = pipe
        graphdef, state, order = self._state()
        stage_fn = self._stage_fn(graphdef, args, isinstance(state, tuple))
        if self.outputs and weights is None:
            weights = {}

        rows = self.rows or None

        def primal(p, o, tok, tgt, rws):
            if v_shaped():  # ZB-V's storage: its forwards down the stages and back up
                return zero_bubble_forward("zb_v", stage_fn, first_fn, last_fn, p, o, tok, tgt, stages=s_,
                                           microbatches=m_, ys_weights=weights, rows=rws, lead_fn=lead_fn)
            return pipeline_loss(stage_fn, first_fn, last_fn, p, o, tok, tgt, stages=s_, repeats=r_, microbatches=m_,
                                 ys_weights=weights, rows=rws, lead_fn=lead_fn)

        rules = active_rules()
        assert rules is not None and rules.parallel is not None  # _stages() checked them
        schedule = rules.parallel.pipeline_schedule
        if schedule in ZERO_BUBBLE:
            loss, ys = zero_bubble_loss(schedule, stage_fn, first_fn, last_fn, state, outer, tokens, targets,
                                        stages=s_, microbatches=m_, primal=primal, ys_weights=weights, rows=rows,
                                        lead_fn=lead_fn, stage_remat=rules.parallel.stage_remat)
        elif schedule != "1f1b":
            loss, ys = primal(state, outer, tokens, targets, rows)
        else:
            loss, ys = one_f_one_b(stage_fn, first_fn, last_fn, state, outer, tokens, targets, stages=s_,
                                   microbatches=m_, repeats=r_, primal=primal, ys_weights=weights, rows=rows,
                                   lead_fn=lead_fn, stage_remat=rules.parallel.stage_remat)
        return loss, _in_layer_order(ys, order)


_ACTIVE = "_active"  # the per-slot value marking uneven stages' real layers (Stack._state)


def _in_layer_order(ys, order):
    """Per-layer outputs ``[stored, ...]`` in storage order -> layer order, the padding left out."""
    if ys is None or order is None:
        return ys
    return jax.tree.map(lambda a: restack(a, order, inverse=True), ys)

