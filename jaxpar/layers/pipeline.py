"""Pipeline parallelism over the ``pipe`` axis: microbatched loops of stages (GPipe, circular, 1F1B).

The stacked layers are cut into S = ``pipe`` stages; the stage dim of their weights is sharded
over ``pipe`` so that each device holds only its stage. The batch is cut into M microbatches.

Schedule (GPipe, R = 1): on iteration t every stage s applies its layers to the activation it
holds, then the activations shift one stage forward (a collective-permute over ``pipe``); stage 0
takes microbatch t, stage s works on microbatch t - s. M + S - 1 iterations; stage s idles on the
first s and last S-1-s of them, so the bubble fraction is (S-1)/(M+S-1).

Circular / interleaved (R = ``pipeline_repeats`` > 1): the L layers form S*R groups; group g sits on
stage g mod S, so every device holds R non-adjacent groups and each microbatch passes the ring of
stages R times. Microbatch m in repeat r is on stage s at iteration t = r*M + m + s; when it leaves
the last stage the ring shift takes it to stage 0, which holds it until t = (r+1)*M + m (needs M >= S).
M*R + S - 1 iterations, bubble (S-1)/(M*R+S-1). Storage is stage-major: position p of the stacked
layer dim holds layer :func:`stage_major_order` [p], so that each device's groups are contiguous.

The last stage files its outputs in its own slots of a per-stage buffer (a local write); after the
loop the buffers, all but the last stage's zeroed, are summed over ``pipe`` once into the caller's
layout (a reduce-scatter when the batch is split over ``pipe`` there); every stage holds a copy of
the input microbatches, so that the input's gradient is summed over ``pipe`` once: nothing but the
stage shifts crosses ``pipe`` per iteration. Bubble iterations compute on zeros (their results are
never used; a ``cond`` on the stage under the stage ``vmap`` would lower to a select running both
branches): the compiled flops of the pipelined layers are (M*R+S-1)/(M*R) times those of the plain
stack. The backward is the scan's gradient; what each layer keeps for it is the stage function's
business (the model applies its ``model.remat`` policy per layer inside the stage, as it does
without a pipeline; the stage selects an iteration's layer group itself, so that no per-iteration
copy of its weights is kept). The embedding, final norm and head run outside the stages, on the
batch split over ``pipe`` as well when M is a multiple of S
(:meth:`~jaxpar.partitioning.RuleSet.inside_stages`: the pipeline runs under rules whose ``batch``
leaves ``pipe`` to the stage dim).

1F1B (:func:`one_f_one_b`): forwards and backwards interleaved, the embedding and the loss inside the
schedule, the stage inputs of at most 2S - 1 microbatches held per stage. Long by design: the three
schedules share their shifts, buffers and schedule grids here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.partitioning import RuleSet, active_rules, constrain, use_rules


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


def _shift(stages: int, step: int, ring: bool = False):
    """``state[s] -> state[s + step]`` over ``pipe`` by one ``ppermute`` (``step`` = +1 forward, -1 back);
    with ``ring`` the end stage sends to the other end (circular schedule), else it sends nothing."""
    rules = _rules()
    spec = rules.params.spec(("stages", "batch", "res_length", "act_embed"))
    perm = [(s, (s + step) % stages) for s in range(stages) if ring or 0 <= s + step < stages]
    return jax.shard_map(lambda x: jax.lax.ppermute(x, "pipe", perm), mesh=rules.mesh, in_specs=spec, out_specs=spec)


def pipeline(stage_fn, params, x: jax.Array, *, stages: int, repeats: int, microbatches: int,
             outputs: bool = False, param_axes: list[tuple] | None = None):
    """See :func:`_pipeline` (which runs under the rules inside the stages); ``x`` and the result are
    in the caller's layout (e.g. the batch also split over ``pipe``)."""
    outer = _rules()
    with use_rules(outer.inside_stages()):
        out = _pipeline(stage_fn, params, x, stages=stages, repeats=repeats, microbatches=microbatches,
                        outputs=outputs, param_axes=param_axes)
    y, ys = out if outputs else (out, None)
    y = constrain(jnp.sum(y, axis=0).swapaxes(0, 1).reshape(x.shape), ("batch", "res_length", "act_embed"))
    return (y, ys) if outputs else y


def _pipeline(stage_fn, params, x: jax.Array, *, stages: int, repeats: int, microbatches: int,
              outputs: bool = False, param_axes: list[tuple] | None = None):
    """Run ``x [B, ...]`` through the stages; ``params`` leaves are ``[L, ...]`` in stage-major order,
    ``param_axes`` their logical names (in ``jax.tree.leaves`` order; the first is the layer dim),
    so that a stage's weights keep their other splits (e.g. over ``tensor``).

    ``stage_fn(stage_params, h, select=(first, count))`` applies layers ``first .. first+count-1``
    of a stage (leaves ``[L/S, ...]``; ``first`` traced: the group of this iteration) to a microbatch
    ``h [B/M, ...]``. It selects each layer itself, inside its remat policy, so that the backward
    selects it again rather than the loop keeping a copy of the group's weights per iteration. With
    ``outputs=True`` it returns ``(h, ys)`` with per-layer leaves ``[L/(S*R), ...]`` (e.g. router
    statistics); the result is then ``(y, ys)`` with ``ys`` leaves ``[L, ...]`` in storage order,
    each the mean over the M microbatches (bubble iterations excluded).
    """
    s_, r_, m_ = stages, repeats, microbatches
    b = x.shape[0]
    mb = b // m_
    act = ("batch", "res_length", "act_embed")
    # microbatch m = rows m, m+M, ...: each stays split over the batch axes without moving data
    xs = constrain(x.reshape(mb, m_, *x.shape[1:]).swapaxes(0, 1), (None, *act))
    leaves, treedef = jax.tree.flatten(params)
    axes = param_axes or [(None,) * a.ndim for a in leaves]
    lg = leaves[0].shape[0] // (s_ * r_)  # layers per group
    # [S, R * lg, ...]: each device's R groups, contiguous in storage order (a free reshape)
    grouped = jax.tree.unflatten(treedef, [
        constrain(a.reshape(s_, a.shape[0] // s_, *a.shape[1:]), ("stages", None) + tuple(ax[1:]))
        for a, ax in zip(leaves, axes)])
    state = constrain(jnp.zeros((s_, mb, *x.shape[1:]), x.dtype), ("stages", *act))
    # per stage, M microbatch slots, all holding the input microbatches at
    # first: stage 0 takes them from there, and with R > 1 the microbatches coming round the ring wait
    # there for their next repeat; the last stage files its outputs in its own. Every stage has a copy of
    # the input (a local broadcast), so that the input's gradient is summed over pipe once, after the loop.
    buf = constrain(jnp.broadcast_to(xs[None], (s_, *xs.shape)), ("stages", None, *act))
    stage_ids = jnp.arange(s_)
    shift = _shift(s_, 1, ring=r_ > 1)

    def run_groups(grouped, repeat, inputs):
        """Each stage's layer group of this iteration (``select``, see the docstring) on its input."""
        return jax.vmap(lambda g, x, r: stage_fn(g, x, select=(r * lg, lg)), spmd_axis_name="pipe")(
            grouped, inputs, repeat)

    acc = None
    if outputs:
        ys_shape = jax.eval_shape(run_groups, grouped, stage_ids, state)[1]
        acc = jax.tree.map(lambda y: jnp.zeros((s_, r_, *y.shape[1:]), jnp.float32), ys_shape)

    def iteration(carry, t):
        state, buf, acc = carry
        # one collective-permute over pipe: stage s gets stage s-1's output (stage 0 the last stage's, R > 1)
        shifted = constrain(shift(state), ("stages", *act))

        def enter(s, row, received):  # a stage's input: stage 0 takes a fresh microbatch or one coming round
            if r_ > 1:
                row = _put(row, received, (t - s_) % m_, (s == 0) & (t >= s_))
            return row, jnp.where(s == 0, row[t % m_], received)

        buf, inputs = jax.vmap(enter, spmd_axis_name="pipe")(stage_ids, buf, shifted)
        repeat = jnp.clip((t - stage_ids) // m_, 0, r_ - 1)
        state = run_groups(grouped, repeat, constrain(inputs, ("stages", *act)))
        if outputs:
            state, ys = state
            k = t - stage_ids  # which (repeat, microbatch) each stage holds; bubble if outside [0, M*R)
            weight = ((k >= 0) & (k < m_ * r_)).astype(jnp.float32) / m_
            acc = jax.tree.map(lambda a, y: jax.vmap(lambda a_s, y_s, r, w: a_s.at[r].add(y_s.astype(a_s.dtype) * w))(
                a, y, repeat, weight), acc, ys)
        state = constrain(state, ("stages", *act))
        # the last stage files the microbatch it finished (a local write: nothing crosses pipe)
        done = (t >= s_ - 1) & (t - (s_ - 1) >= m_ * (r_ - 1))
        buf = jax.vmap(lambda s, row, y: _put(row, y, (t - (s_ - 1)) % m_, (s == s_ - 1) & done),
                       spmd_axis_name="pipe")(stage_ids, buf, state)
        return (state, constrain(buf, ("stages", None, *act)), acc), None

    (_, buf, acc), _ = jax.lax.scan(iteration, (state, buf, acc), jnp.arange(m_ * r_ + s_ - 1))
    # the last stage's outputs: each stage's buffer with all but the last stage's zeroed, summed over the
    # stages by the caller into its layout (a reduce-scatter when the batch is split over pipe there)
    y = constrain(jnp.where((stage_ids == s_ - 1)[:, None, None, None, None], buf, 0), ("stages", None, *act))
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


# -- 1F1B ------------------------------------------------------------------------------------------

def _put(buf: jax.Array, value: jax.Array, slot, ok) -> jax.Array:
    """``buf[slot] = value`` where ``ok``, else unchanged (one slot read and written either way)."""
    old = jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(ok, value, old), slot, 0)


def _stage_split(a: jax.Array) -> jax.Array:
    """Pin the leading (stage) dim of a per-stage buffer to ``pipe``; the other dims are the compiler's."""
    mesh = _rules().mesh
    assert mesh is not None  # _rules() checked it
    spec = jax.sharding.PartitionSpec("pipe", *[jax.sharding.PartitionSpec.UNCONSTRAINED] * (a.ndim - 1))
    return jax.lax.with_sharding_constraint(a, jax.sharding.NamedSharding(mesh, spec))


def stash_slots(stages: int) -> int:
    """Microbatches whose stage inputs a 1F1B stage holds at once: stage s keeps microbatch m from
    its forward (iteration m + s) to its backward (m + 2(S-1) - s), at most 2S - 1 of them (stage 0)."""
    return 2 * stages - 1


def _used_leaves(fn, leaves: list, treedef, *args) -> list[int]:
    """Indices of the ``leaves`` that ``fn(tree, *args)`` reads (from its jaxpr), so that gradients
    and accumulators are kept for those only (an untied head does not touch the embedding table)."""
    jaxpr = jax.make_jaxpr(lambda *o: fn(jax.tree.unflatten(treedef, list(o)), *args))(*leaves).jaxpr
    read = {id(v) for e in jaxpr.eqns for v in e.invars if not hasattr(v, "val")}
    read |= {id(v) for v in jaxpr.outvars if not hasattr(v, "val")}
    return [i for i, v in enumerate(jaxpr.invars) if id(v) in read]


def one_f_one_b(stage_fn, first_fn, last_fn, params, outer, tokens: jax.Array, targets: jax.Array, *,
                stages: int, microbatches: int, param_axes: list[tuple], primal, ys_weights=None):
    """Loss and gradients of a pipelined model with the 1F1B schedule (one forward, one backward).

    ``first_fn(outer, tokens_mb) -> x_mb`` (embedding), ``stage_fn(group, x_mb) -> y_mb`` (one stage's
    layers; ``(y_mb, ys)`` with per-layer outputs when ``ys_weights`` is given) and
    ``last_fn(outer, y_mb, targets_mb) -> loss_mb`` (head and mean loss of one microbatch). ``params``
    leaves are ``[L, ...]`` (layer order; ``param_axes`` their logical names), ``outer`` the weights of
    ``first_fn`` / ``last_fn`` (shared: a tied embedding is one weight).

    Returns ``(loss, ys)``: the mean over microbatches of ``last_fn`` plus, with ``ys_weights`` (a dict
    name -> weight over the stage's per-layer outputs ``ys``, a dict of float arrays; missing names
    weigh 0), ``sum_name weight * sum_layers ys[name]`` (e.g. a router's balance loss); ``ys`` are the
    per-layer outputs averaged over microbatches, for metrics only (no gradient flows back through
    them). Without differentiation ``primal(params, outer, tokens, targets)`` computes the same two
    values (the GPipe forward); under ``jax.grad`` the forwards and backwards run interleaved (a
    ``custom_vjp`` whose forward computes the gradients, which its backward scales).

    Schedule (:func:`schedule_1f1b`): on iteration t stage s runs the forward of microbatch t - s and the
    backward of microbatch t - 2(S-1) + s, each where it exists; M + 2(S-1) iterations in two loops:
    S - 1 warm-up iterations of forwards only, then one forward and one backward per iteration (the
    forward skipped by a ``lax.cond`` on t in the last S - 1). The last stage runs the loss of a
    microbatch and its gradient as soon as its forward is done, so a stage keeps the inputs of at most
    2S - 1 microbatches (:func:`stash_slots`): activation memory O(S), not O(M) as GPipe's. A stage's
    backward runs its forward again from the stashed input (``jax.vjp``, so the layers' remat policy
    decides what that one microbatch keeps while its backward runs): the stage is rematerialised as a
    whole, as ``model.remat=full`` would. (Stashing the ``jax.vjp`` residuals instead would save that
    forward but copy the stage's weights into every slot: the linearisation of a scan over layers
    re-emits its stacked weights as residuals.)

    Communication over ``pipe``: one ``ppermute`` of the activations forward and one of the gradients
    backward per iteration; once per step the first stage's input gradients go to every stage (the
    embedding's weight gradient is computed once, after the loops, on every stage) and the per-stage
    accumulators of the head's gradients are summed. The embedding and the loss run under the stage
    ``vmap``, so each stage computes them and only stage 0's resp. S-1's result is used: cheap next to
    a stage for the embedding, an extra head matmul per microbatch on the other stages for the loss,
    traded against broadcasting the last stage's output over ``pipe`` every iteration.
    """
    s_, m_ = stages, microbatches
    k_ = stash_slots(s_)
    b = tokens.shape[0]
    mb = b // m_
    leaves, treedef = jax.tree.flatten(params)
    outer_leaves, outer_def = jax.tree.flatten(outer)
    dtypes = [a.dtype for a in leaves]

    def split_mb(a):  # microbatch m = rows m, m+M, ... (stays split over the batch axes)
        return constrain(a.reshape(mb, m_, *a.shape[1:]).swapaxes(0, 1), (None, "batch", "length"))

    def staged(p_leaves):
        return [constrain(a.reshape(s_, a.shape[0] // s_, *a.shape[1:]), ("stages", None) + tuple(ax[1:]))
                for a, ax in zip(p_leaves, param_axes)]

    def unstaged(p_leaves):
        return [a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]) for a in p_leaves]

    def stage(group_leaves, x):  # the stage's layers selected inside the stage's scan (see `pipeline`):
        # scanning them as xs under the stage vmap would transpose (copy) the stage's weights
        return stage_fn(jax.tree.unflatten(treedef, group_leaves), x, select=(0, leaves[0].shape[0] // s_))

    def ys_cotangent(ys):
        return {k: jnp.full(y.shape, ys_weights.get(k, 0.0) / m_, y.dtype) for k, y in ys.items()}

    def run(p_leaves, outer_leaves, tokens, targets):
        outer_ = jax.tree.unflatten(outer_def, outer_leaves)
        toks, tgts = split_mb(tokens), split_mb(targets)
        groups = staged(p_leaves)
        x0 = jax.eval_shape(first_fn, outer_, toks[0])
        first_used = _used_leaves(first_fn, outer_leaves, outer_def, toks[0])
        last_used = _used_leaves(last_fn, outer_leaves, outer_def, jnp.zeros(x0.shape, x0.dtype), tgts[0])

        def pick(used):
            return [outer_leaves[i] for i in used]

        def with_leaves(used, sub):  # the outer tree with the leaves at `used` replaced by `sub`
            full = list(outer_leaves)
            for i, a in zip(used, sub):
                full[i] = a
            return jax.tree.unflatten(outer_def, full)
        out_shape = jax.eval_shape(jax.vmap(stage), groups, jnp.zeros((s_, *x0.shape), x0.dtype))
        has_ys = ys_weights is not None
        act = ("stages", "batch", "res_length", "act_embed")
        per_mb = ("stages", None, "batch", "res_length", "act_embed")
        carry = dict(
            fwd=constrain(jnp.zeros((s_, *x0.shape), x0.dtype), act),
            bwd=constrain(jnp.zeros((s_, *x0.shape), x0.dtype), act),
            stash=constrain(jnp.zeros((s_, k_, *x0.shape), x0.dtype), per_mb),
            # the first stage's input gradients, for the embedding's weight gradient after the loop
            dins=constrain(jnp.zeros((s_, m_, *x0.shape), x0.dtype), per_mb),
            dgroups=[constrain(jnp.zeros_like(g), ("stages", None) + tuple(ax[1:]))
                     for g, ax in zip(groups, param_axes)],
            douter=[_stage_split(jnp.zeros((s_, *a.shape), a.dtype)) for a in pick(last_used)],
            loss=jnp.zeros((s_,), jnp.float32),
            ys=(jax.tree.map(lambda y: jnp.zeros(y.shape, jnp.float32), out_shape[1]) if has_ys else None),
        )
        stage_ids = jnp.arange(s_)
        fwd_shift, bwd_shift = _shift(s_, 1), _shift(s_, -1)

        def tick(t, group, s, c, do_f: bool, do_b: bool):
            """One iteration of stage ``s`` (under the stage vmap): a forward and/or a backward."""
            c = dict(c)
            y = dx = None
            if do_f:
                f = t - s
                f_ok = (f >= 0) & (f < m_)
                fm = jnp.clip(f, 0, m_ - 1)

                def forward(c):
                    c = dict(c)
                    x = jnp.where(s == 0, first_fn(outer_, toks[fm]), c["fwd"])
                    y, ys = stage(group, x) if has_ys else (stage(group, x), None)
                    c["stash"] = _put(c["stash"], x, fm % k_, f_ok)
                    if has_ys:
                        c["ys"] = jax.tree.map(lambda a, v: a + jnp.where(f_ok, v.astype(jnp.float32) / m_, 0.0),
                                               c["ys"], ys)
                    return c, y

                # the last S - 1 iterations have no forward left: skip it (t is the same on every stage)
                c, y = jax.lax.cond(t < m_ + s_ - 1, forward, lambda c: (c, jnp.zeros(x0.shape, x0.dtype)), c)
            if do_b:
                bm = t - 2 * (s_ - 1) + s
                b_ok = (bm >= 0) & (bm < m_)
                bmm = jnp.clip(bm, 0, m_ - 1)
                if do_f:  # the last stage: loss and gradients of the microbatch it just finished
                    loss, loss_vjp = jax.vjp(lambda o, h: last_fn(with_leaves(last_used, o), h, tgts[bmm]),
                                             pick(last_used), y)
                    d_last, dy = loss_vjp(jnp.ones((), loss.dtype) / m_)
                    last_ok = (s == s_ - 1) & b_ok
                    c["loss"] = c["loss"] + jnp.where(last_ok, loss.astype(jnp.float32) / m_, 0.0)
                    c["douter"] = [a + jnp.where(last_ok, d, 0).astype(a.dtype) for a, d in zip(c["douter"], d_last)]
                    g = jnp.where(s == s_ - 1, dy.astype(x0.dtype), c["bwd"])
                else:
                    g = c["bwd"]
                x = jax.lax.dynamic_index_in_dim(c["stash"], bmm % k_, 0, keepdims=False)
                _, pullback = jax.vjp(stage, group, x)  # the stage's forward again, keeping what the remat policy keeps
                if has_ys:
                    ys_shape = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape[1:], o.dtype), out_shape[1])
                    dgroup, dx = pullback((g, ys_cotangent(ys_shape)))
                else:
                    dgroup, dx = pullback(g)
                c["dgroups"] = [a + jnp.where(b_ok, d, 0).astype(a.dtype) for a, d in zip(c["dgroups"], dgroup)]
                dx = jnp.where(b_ok, dx, 0).astype(x0.dtype)
                c["dins"] = _put(c["dins"], dx, bmm, b_ok)
            return c, y, dx

        def phase(c, first: int, last: int, do_f: bool, do_b: bool):
            """Iterations ``first .. last - 1``; each shifts what it computed to the next stage."""
            def iteration(c, t):
                c, y, dx = jax.vmap(tick, in_axes=(None, 0, 0, 0, None, None), spmd_axis_name="pipe")(
                    t, groups, stage_ids, c, do_f, do_b)
                c = dict(c, stash=constrain(c["stash"], per_mb))
                if do_b:
                    c["dins"] = constrain(c["dins"], per_mb)
                if do_f and do_b:
                    c["douter"] = [_stage_split(a) for a in c["douter"]]
                if do_f:
                    c["fwd"] = constrain(fwd_shift(constrain(y, act)), act)
                if do_b:
                    c["bwd"] = constrain(bwd_shift(constrain(dx, act)), act)
                return c, None

            return jax.lax.scan(iteration, c, jnp.arange(first, last))[0]

        # warm-up (S - 1 iterations): forwards only; then one forward and one backward per iteration, the
        # forward skipped in the last S - 1 (cool-down). A third loop for the cool-down would send S - 1
        # fewer activations but, on XLA:CPU, give its body its own temporaries (+18 MiB on the MaxText layout).
        c = dict(carry)
        c.update(phase({k: carry[k] for k in ("fwd", "stash", "ys")}, 0, s_ - 1, True, False))
        c = phase(c, s_ - 1, m_ + 2 * (s_ - 1), True, True)

        def batch_of(a):  # [M, B/M, ...] of one stage -> [B, ...] in the batch's row order
            return constrain(a.swapaxes(0, 1).reshape(b, *a.shape[2:]), ("batch", "res_length", "act_embed"))

        # the embedding's weight gradient, once over the whole batch; the head's, summed over the stages
        loss = jnp.sum(c["loss"])
        d_last = [jnp.sum(a, axis=0) for a in c["douter"]]
        _, first_vjp = jax.vjp(lambda o: first_fn(with_leaves(first_used, o), tokens), pick(first_used))
        (d_first,) = first_vjp(batch_of(c["dins"][0]))
        grads_outer = [jnp.zeros_like(a) for a in outer_leaves]
        for used, part in ((last_used, d_last), (first_used, d_first)):
            for i, g in zip(used, part):
                grads_outer[i] = grads_outer[i] + g.astype(grads_outer[i].dtype)
        ys = None
        if has_ys:  # [S, layers per stage, ...] -> [L, ...]
            ys = jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), c["ys"])
            loss = loss + sum(w * jnp.sum(ys[k]) for k, w in ys_weights.items())
        dparams = [d.astype(dt) for d, dt in zip(unstaged(c["dgroups"]), dtypes)]
        return (loss, ys), (dparams, grads_outer)

    @jax.custom_vjp
    def f(p_leaves, outer_leaves, tokens, targets):
        return primal(jax.tree.unflatten(treedef, p_leaves), jax.tree.unflatten(outer_def, outer_leaves),
                      tokens, targets)

    def f_bwd(grads, ct):
        g = ct[0]
        dparams, douter = grads
        return [g * d for d in dparams], [g * d for d in douter], None, None

    f.defvjp(run, f_bwd)  # the forward computes the loss and the gradients, kept as residuals
    loss, ys = f(leaves, outer_leaves, tokens, targets)
    return loss, (jax.lax.stop_gradient(ys) if ys is not None else None)


def schedule_1f1b(stages: int, microbatches: int) -> list[list[tuple[tuple[str, int], ...]]]:
    """``grid[s][t]``: the work of stage s at iteration t under 1F1B, a tuple of ``("F", m)`` (forward of
    microbatch m) and ``("B", m)`` (its backward), empty in the bubble; the rule :func:`one_f_one_b`
    follows: forward of m at t = m + s, backward at t = m + 2(S-1) - s. M + 2(S-1) iterations; the first
    S - 1 run forwards only and the last S - 1 backwards only, so in time units of a forward (F) and a
    backward (B) the schedule takes (M + S - 1)(F + B) and each stage idles (S-1)/(M+S-1) of it, as GPipe."""
    s_, m_ = stages, microbatches
    grid: list[list[tuple[tuple[str, int], ...]]] = [[() for _ in range(m_ + 2 * (s_ - 1))] for _ in range(s_)]
    for s in range(s_):
        for m in range(m_):
            grid[s][m + s] += (("F", m),)
            grid[s][m + 2 * (s_ - 1) - s] += (("B", m),)
    return grid


def in_flight(stages: int, microbatches: int) -> list[int]:
    """Per stage, the most microbatches whose input a 1F1B stage holds at once (forwarded, not yet
    backwarded): min(M, 2(S-1-s) + 1), at most :func:`stash_slots`."""
    grid = schedule_1f1b(stages, microbatches)
    out = []
    for row in grid:
        live, peak = 0, 0
        for cell in row:
            live += sum(op == "F" for op, _ in cell)
            peak = max(peak, live)
            live -= sum(op == "B" for op, _ in cell)
        out.append(peak)
    return out
