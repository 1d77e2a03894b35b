"""Pipeline parallelism over the ``pipe`` axis: a microbatched ``lax.scan`` of stages.

The stacked layers are cut into S = ``pipe`` stages; the stage dim of their weights is sharded
over ``pipe`` so that each device holds only its stage. The batch is cut into M microbatches.

Schedule (GPipe, R = 1): on iteration t every stage s applies its layers to the activation it
holds, then the activations shift one stage forward (a collective-permute over ``pipe``); stage 0
takes microbatch t, stage s works on microbatch t - s. M + S - 1 iterations; stage s idles on the
first s and last S-1-s of them, so the bubble fraction is (S-1)/(M+S-1).

Circular / interleaved (R = ``pipeline_repeats`` > 1): the L layers form S*R groups; group g sits on
stage g mod S, so every device holds R non-adjacent groups and each microbatch passes the ring of
stages R times. Microbatch m in repeat r is on stage s at iteration t = r*M + m + s; when it leaves
the last stage it waits in a buffer until stage 0 takes it back at t = (r+1)*M + m (needs M >= S).
M*R + S - 1 iterations, bubble (S-1)/(M*R+S-1). Storage is stage-major: position p of the stacked
layer dim holds layer :func:`stage_major_order` [p], so that each device's groups are contiguous.

Bubble iterations compute on zeros (their results are never used): the compiled flops of the
pipelined layers are (M*R+S-1)/(M*R) times those of the plain stack. The backward is the scan's
gradient; what each layer keeps for it is the stage function's business (the model applies its
``model.remat`` policy per layer inside the stage, as it does without a pipeline).

The embedding, final norm and head run outside the stages (replicated over ``pipe``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.partitioning import RuleSet, active_rules, constrain


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    return (stages - 1) / (microbatches * repeats + stages - 1)


def stage_major_order(n_layers: int, stages: int, repeats: int) -> np.ndarray:
    """``order[p]`` = the layer stored at position p: stage s holds groups s, s+S, s+2S, ..."""
    lg = n_layers // (stages * repeats)
    return np.array([(r * stages + s) * lg + j for s in range(stages) for r in range(repeats) for j in range(lg)])


def _rules() -> RuleSet:
    rules = active_rules()
    if rules is None:
        raise RuntimeError("the pipeline runs under jaxpar rules (partitioning.use_rules) on a mesh with a pipe axis")
    return rules


def _shift_forward(stages: int):
    """``state[s] -> state[s+1]`` over ``pipe`` by one ``ppermute`` (the last stage sends nothing)."""
    rules = _rules()
    spec = rules.params.spec(("stages", "batch", "res_length", "act_embed"))
    perm = [(s, s + 1) for s in range(stages - 1)]
    return jax.shard_map(lambda x: jax.lax.ppermute(x, "pipe", perm), mesh=rules.mesh, in_specs=spec, out_specs=spec)


def _last_stage(stages: int):
    """``state[S-1]`` on every pipe device: one all-reduce (a broadcast from the last stage)."""
    rules = _rules()
    spec = rules.params.spec(("stages", "batch", "res_length", "act_embed"))
    out = rules.params.spec(("batch", "res_length", "act_embed"))

    def local(x):
        mine = jnp.where(jax.lax.axis_index("pipe") == stages - 1, x[0], jnp.zeros_like(x[0]))
        return jax.lax.psum(mine, "pipe")

    return jax.shard_map(local, mesh=rules.mesh, in_specs=spec, out_specs=out)


def pipeline(stage_fn, params, x: jax.Array, *, stages: int, repeats: int, microbatches: int,
             outputs: bool = False, param_axes: list[tuple] | None = None):
    """Run ``x [B, ...]`` through the stages; ``params`` leaves are ``[L, ...]`` in stage-major order,
    ``param_axes`` their logical names (in ``jax.tree.leaves`` order; the first is the layer dim),
    so that a stage's weights keep their other splits (e.g. over ``tensor``).

    ``stage_fn(group_params, h)`` applies one group of layers (leaves ``[L/(S*R), ...]``) to a
    microbatch ``h [B/M, ...]``. With ``outputs=True`` it returns ``(h, ys)`` with per-layer
    leaves ``[L/(S*R), ...]`` (e.g. router statistics); the result is then ``(y, ys)`` with ``ys``
    leaves ``[L, ...]`` in storage order, each the mean over the M microbatches (bubble
    iterations excluded).
    """
    s_, r_, m_ = stages, repeats, microbatches
    b = x.shape[0]
    mb = b // m_
    act = ("batch", "res_length", "act_embed")
    # microbatch m = rows m, m+M, ...: each stays split over the batch axes without moving data
    xs = constrain(x.reshape(mb, m_, *x.shape[1:]).swapaxes(0, 1), (None, *act))
    leaves, treedef = jax.tree.flatten(params)
    axes = param_axes or [(None,) * a.ndim for a in leaves]
    grouped = jax.tree.unflatten(treedef, [
        constrain(a.reshape(s_, r_, a.shape[0] // (s_ * r_), *a.shape[1:]), ("stages", None, None) + tuple(ax[1:]))
        for a, ax in zip(leaves, axes)])
    state = constrain(jnp.zeros((s_, mb, *x.shape[1:]), x.dtype), ("stages", *act))
    done = jnp.zeros_like(xs)
    stage_ids = jnp.arange(s_)
    run_stages = jax.vmap(stage_fn, spmd_axis_name="pipe")
    shift, last = _shift_forward(s_), _last_stage(s_)

    acc = None
    if outputs:
        group0 = jax.tree.map(lambda a: a[:, 0], grouped)
        ys_shape = jax.eval_shape(run_stages, group0, state)[1]
        acc = jax.tree.map(lambda y: jnp.zeros((s_, r_, *y.shape[1:]), jnp.float32), ys_shape)

    def iteration(carry, t):
        state, done, acc = carry
        first = jnp.where(t < m_, xs[t % m_], done[t % m_])  # a fresh microbatch or one coming round
        # shift one stage forward (one collective-permute over pipe); stage 0 takes `first`
        is_first = (stage_ids == 0).reshape((s_,) + (1,) * (state.ndim - 1))
        shifted = constrain(jnp.where(is_first, first[None], shift(state)), ("stages", *act))
        repeat = jnp.clip((t - stage_ids) // m_, 0, r_ - 1)
        group = jax.vmap(lambda p, r: jax.tree.map(lambda a: a[r], p))(grouped, repeat)
        state = run_stages(group, shifted)
        if outputs:
            state, ys = state
            k = t - stage_ids  # which (repeat, microbatch) each stage holds; bubble if outside [0, M*R)
            weight = ((k >= 0) & (k < m_ * r_)).astype(jnp.float32) / m_
            acc = jax.tree.map(lambda a, y: jax.vmap(lambda a_s, y_s, r, w: a_s.at[r].add(y_s.astype(a_s.dtype) * w))(
                a, y, repeat, weight), acc, ys)
        state = constrain(state, ("stages", *act))
        out = (t - (s_ - 1)) % m_
        done = jnp.where(t >= s_ - 1, done.at[out].set(last(state)), done)
        return (state, done, acc), None

    (_, done, acc), _ = jax.lax.scan(iteration, (state, done, acc), jnp.arange(m_ * r_ + s_ - 1))
    y = constrain(done.swapaxes(0, 1).reshape(x.shape), act)
    if not outputs:
        return y
    return y, jax.tree.map(lambda a: a.reshape(s_ * r_ * a.shape[2], *a.shape[3:]), acc)


def schedule(stages: int, microbatches: int, repeats: int = 1) -> list[list[tuple[int, int] | None]]:
    """``grid[s][t]``: the (microbatch, repeat) stage s works on at iteration t, or None (bubble).

    The same rule :func:`pipeline` follows: microbatch m in repeat r is on stage s at t = r*M + m + s.
    """
    iters = microbatches * repeats + stages - 1
    grid: list[list[tuple[int, int] | None]] = [[None] * iters for _ in range(stages)]
    for s in range(stages):
        for r in range(repeats):
            for m in range(microbatches):
                grid[s][r * microbatches + m + s] = (m, r)
    return grid
