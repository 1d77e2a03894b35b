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
pipeline), which the trainer applies to parameters and undoes for checkpoints. The model knows none of this::

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

from jaxpar.layers.pipeline import one_f_one_b, pipeline, pipeline_loss, stage_major_order
from jaxpar.layers.remat import remat as rematerialise
from jaxpar.layers.remat import select_remat
from jaxpar.partitioning import active_rules


def storage_order(n: int, stages: int, repeats: int) -> np.ndarray:
    """``order[p]``: the layer a stack of ``n`` stores at position p: stage-major under a circular
    pipeline (``stages`` > 1 and ``repeats`` > 1, :func:`~jaxpar.layers.pipeline.stage_major_order`),
    so that each device's layer groups are contiguous; else ``0..n-1``."""
    if stages == 1 or repeats == 1:
        return np.arange(n)
    return np.asarray(stage_major_order(n, stages, repeats))


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
    a leading layer dim in storage order; through a pipeline, each the mean over the microbatches).
    """

    def __init__(self, layers: nnx.Module, *, remat: str = "none", outputs: bool = False, pipelined: bool = True,
                 per_layer: dict | None = None, rows: dict | None = None):
        self.layers, self.remat, self.outputs, self.pipelined = layers, remat, outputs, pipelined
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
        """``(graphdef, state)`` of the layers; with per-layer values, ``state`` is ``(weights, values)``,
        the values ``[n]`` float32 in the active layout's storage order (scanned and pipelined alike)."""
        graphdef, state = nnx.split(self.layers)
        if not self.per_layer:
            return graphdef, state
        pipe = self._stages()
        n = jax.tree.leaves(state)[0].shape[0]
        order = storage_order(n, pipe[0], pipe[1]) if pipe else np.arange(n)
        values = {}
        for k, v in self.per_layer.items():
            v = np.asarray(v, np.float32)
            if v.shape != (n,):
                raise ValueError(f"Stack(per_layer={{{k!r}: ...}}) needs one value per layer ({n}); got shape "
                                 f"{v.shape}")
            values[k] = jnp.asarray(v[order])
        return graphdef, (state, values)

    def _stage_fn(self, graphdef, args):
        """``(group_state, h, select=None, rows=None) -> h`` (or ``(h, ys)``): a scan of the layers in
        ``group_state``, each given ``rows`` (a microbatch's; None: the stack's own) as keywords."""
        def run(group, h, select=None, rows=None):
            rows = self.rows if rows is None else rows

            def body(h, layer_state):
                if self.per_layer:
                    layer_state, values = layer_state
                    out = nnx.merge(graphdef, layer_state)(h, *args, **values, **rows)
                else:
                    out = nnx.merge(graphdef, layer_state)(h, *args, **rows)
                return out if self.outputs else (out, None)

            if select is None:
                h, ys = jax.lax.scan(rematerialise(body, self.remat), h, group)
            else:  # layers first .. first + count - 1 of `group`, each selected inside the remat
                first, count = select

                def body_at(h, j):
                    return body(h, jax.tree.map(lambda a: a[first + j], group))

                h, ys = jax.lax.scan(select_remat(body_at, self.remat), h, jnp.arange(count))
            return (h, ys) if self.outputs else h

        return run

    def __call__(self, x: jax.Array, *args):
        graphdef, state = self._state()
        stage_fn = self._stage_fn(graphdef, args)
        pipe = self._stages()
        if pipe is None:
            return stage_fn(state, x)
        if self.rows:
            raise NotImplementedError("per-row inputs (packed documents) run through a pipeline in the training "
                                      "loss (Stack.loss) only, not in a forward of the stack")
        s_, r_, m_ = pipe
        return pipeline(stage_fn, state, x, stages=s_, repeats=r_, microbatches=m_, outputs=self.outputs)

    def loss(self, first_fn, last_fn, outer, tokens: jax.Array, targets: jax.Array, *args,
             weights: dict | None = None) -> tuple[jax.Array, dict | None]:
        """The model's loss with the stack in between, in the layout's pipeline (needs ``pipe > 1``):
        ``first_fn(outer, tokens) -> x`` (the embedding, run on the first stage), the stack (``*args``
        passed to each layer), ``last_fn(outer, h, targets) -> mean loss`` (final norm, head, loss: run
        on the last stage, on a microbatch or on the whole batch at once: the loss of the whole batch is
        the mean over equal microbatches); ``tokens`` and ``targets`` may be pytrees of ``[B, ...]``
        arrays, sliced into microbatches alike; ``outer`` the weights of both (a pytree, e.g. ``nnx.split``
        state). With
        ``weights`` (a dict over the layers' outputs, which then need ``outputs=True``) the loss adds
        ``sum weight x sum over layers``. Returns ``(loss, outputs)``: the per-layer outputs averaged
        over microbatches (for metrics; None without ``weights``). GPipe and circular:
        :func:`~jaxpar.layers.pipeline.pipeline_loss`; 1F1B: :func:`~jaxpar.layers.pipeline.one_f_one_b`."""
        pipe = self._stages()
        if pipe is None:
            raise ValueError("Stack.loss runs the stack in a pipeline: it needs parallel.pipe > 1")
        s_, r_, m_ = pipe
        graphdef, state = self._state()
        stage_fn = self._stage_fn(graphdef, args)
        if self.outputs and weights is None:
            weights = {}

        rows = self.rows or None

        def primal(p, o, tok, tgt, rws):
            return pipeline_loss(stage_fn, first_fn, last_fn, p, o, tok, tgt, stages=s_, repeats=r_, microbatches=m_,
                                 ys_weights=weights, rows=rws)

        rules = active_rules()
        assert rules is not None and rules.parallel is not None  # _stages() checked them
        if rules.parallel.pipeline_schedule != "1f1b":
            return primal(state, outer, tokens, targets, rows)
        return one_f_one_b(stage_fn, first_fn, last_fn, state, outer, tokens, targets, stages=s_, microbatches=m_,
                           repeats=r_, primal=primal, ys_weights=weights, rows=rows)
