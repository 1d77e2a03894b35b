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

from jax.sharding import PartitionSpec as P

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
    leaves are ``[L, ...]`` (layer order, split over ``pipe``; ``param_axes`` their logical names),
    ``outer`` the weights of ``first_fn`` / ``last_fn`` (shared: a tied embedding is one weight).

    Returns ``(loss, ys)``: the mean over microbatches of ``last_fn`` plus, with ``ys_weights`` (a dict
    name -> weight over the stage's per-layer outputs ``ys``, a dict of float arrays; missing names
    weigh 0), ``sum_name weight * sum_layers ys[name]`` (e.g. a router's balance loss); ``ys`` are the
    per-layer outputs averaged over microbatches, for metrics only (no gradient flows back through
    them). Without differentiation ``primal(params, outer, tokens, targets)`` computes the same two
    values (the GPipe forward); under ``jax.grad`` the forwards and backwards run interleaved (a
    ``custom_vjp`` whose forward computes the gradients, which its backward scales).

    Schedule (:func:`schedule_1f1b`): on iteration t stage s runs the forward of microbatch t - s and the
    backward of microbatch t - 2(S-1) + s, each where it exists; M + 2(S-1) iterations in three loops:
    S - 1 warm-up iterations of forwards only, M of one forward and one backward, S - 1 of backwards
    only. The last stage runs the loss of a microbatch and its gradient as soon as its forward is done,
    so a stage keeps the inputs of at most 2S - 1 microbatches (:func:`stash_slots`): activation memory
    O(S), not O(M) as GPipe's. A stage's backward runs its forward again from the stashed input
    (``jax.vjp``, so the layers' remat policy decides what that one microbatch keeps while its backward
    runs): the stage is rematerialised as a whole, as ``model.remat=full`` would. (Stashing the
    ``jax.vjp`` residuals instead would save that forward but copy the stage's weights into every slot:
    the linearisation of a scan over layers re-emits its stacked weights as residuals.)

    The schedule runs in a ``shard_map`` manual over ``pipe`` (every other axis stays the compiler's,
    under :meth:`~jaxpar.partitioning.RuleSet.manual_pipe`), so each device decides for itself with a
    ``lax.cond``: the embedding (forward and weight gradient) runs on the first stage only, the head
    and loss on the last stage only, and a stage in the bubble (no forward or no backward this
    iteration) skips that work. What crosses ``pipe``: one ``ppermute`` of a microbatch's activations
    forward per iteration of the first two loops and one of its gradient backward per iteration of the
    last two (2M + 2(S-1) in all, against the minimum 2M), and once per step the sum over stages of
    the embedding / head gradients (each nonzero on one stage only) and of the loss.
    """
    s_, m_ = stages, microbatches
    k_ = stash_slots(s_)
    b = tokens.shape[0]
    mb = b // m_
    rules = _rules()
    leaves, treedef = jax.tree.flatten(params)
    outer_leaves, outer_def = jax.tree.flatten(outer)
    n_local = leaves[0].shape[0] // s_
    has_ys = ys_weights is not None

    def split_mb(a):  # microbatch m = rows m, m+M, ... (stays split over the batch axes)
        return constrain(a.reshape(mb, m_, *a.shape[1:]).swapaxes(0, 1), (None, "batch", "length"))

    def stage(group_leaves, x):  # the stage's layers, each selected inside its remat (see `pipeline`)
        return stage_fn(jax.tree.unflatten(treedef, group_leaves), x, select=(0, n_local))

    def ys_cotangent(ys):
        return {k: jnp.full(y.shape, ys_weights.get(k, 0.0) / m_, y.dtype) for k, y in ys.items()}

    x0 = jax.eval_shape(first_fn, outer, tokens[:mb])
    first_used = _used_leaves(first_fn, outer_leaves, outer_def, tokens[:mb])
    last_used = _used_leaves(last_fn, outer_leaves, outer_def, jnp.zeros(x0.shape, x0.dtype), targets[:mb])
    outer_used = sorted(set(first_used) | set(last_used))
    act = ("batch", "res_length", "act_embed")
    ys_shape = None  # a stage's per-layer outputs
    if has_ys:
        group = [jax.ShapeDtypeStruct((n_local, *a.shape[1:]), a.dtype) for a in leaves]
        ys_shape = jax.eval_shape(stage, group, x0)[1]
    fwd_perm = [(s, s + 1) for s in range(s_ - 1)]

    def batch_of(a):  # [M, B/M, ...] -> [B, ...] in the batch's row order (undoes split_mb)
        names = ("batch", "length") if a.ndim == 3 else ("batch", "res_length", "act_embed")
        return constrain(a.swapaxes(0, 1).reshape(b, *a.shape[2:]), names)

    bwd_perm = [(s + 1, s) for s in range(s_ - 1)]

    def local(p_leaves, o_leaves, toks, tgts):
        """One device's stage: ``p_leaves`` its layers ``[L/S, ...]``, the rest replicated over pipe."""
        s = jax.lax.axis_index("pipe")
        outer_ = jax.tree.unflatten(outer_def, o_leaves)

        def with_leaves(used, sub):  # the outer tree with the leaves at `used` replaced by `sub`
            full = list(o_leaves)
            for i, a in zip(used, sub):
                full[i] = a
            return jax.tree.unflatten(outer_def, full)

        def add(acc, used, grads):
            return {**acc, **{i: acc[i] + g.astype(acc[i].dtype) for i, g in zip(used, grads)}}

        c = dict(
            fwd=jnp.zeros(x0.shape, x0.dtype), bwd=jnp.zeros(x0.shape, x0.dtype),
            stash=jnp.zeros((k_, *x0.shape), x0.dtype), dins=jnp.zeros((m_, *x0.shape), x0.dtype),
            dgroups=[jnp.zeros(a.shape, a.dtype) for a in p_leaves],
            douter={i: jnp.zeros(o_leaves[i].shape, o_leaves[i].dtype) for i in outer_used},
            loss=jnp.zeros((), jnp.float32),
            ys=(jax.tree.map(lambda y: jnp.zeros(y.shape, jnp.float32), ys_shape) if has_ys else None),
        )

        def forward(t, c):
            """Microbatch t - s into the stage (stage 0 embeds it), its input stashed for the backward."""
            fm = jnp.clip(t - s, 0, m_ - 1)

            def run(c):
                c = dict(c)
                x = _when(s == 0, lambda c: first_fn(outer_, toks[fm]).astype(x0.dtype), lambda c: c["fwd"], c)
                x = constrain(x, act)
                y, ys = stage(p_leaves, x) if has_ys else (stage(p_leaves, x), None)
                c["stash"] = jax.lax.dynamic_update_index_in_dim(c["stash"], x, fm % k_, 0)
                if has_ys:
                    c["ys"] = jax.tree.map(lambda a, v: a + v.astype(jnp.float32) / m_, c["ys"], ys)
                return c, y.astype(x0.dtype)

            return _when((t - s >= 0) & (t - s < m_), run, lambda c: (c, c["fwd"]), c)

        def backward(t, c, y):
            """Microbatch t - 2(S-1) + s back through the stage: the last stage starts it from the loss
            of ``y`` (its forward of this iteration), stage 0 ends it in the embedding's gradient."""
            bm = t - 2 * (s_ - 1) + s
            bmm = jnp.clip(bm, 0, m_ - 1)

            def run(c):
                c = dict(c)
                if y is None:  # no forward this iteration: not the last stage's turn
                    g = c["bwd"]
                else:
                    def loss_grad(c):
                        loss, vjp = jax.vjp(lambda o, h: last_fn(with_leaves(last_used, o), h, tgts[bmm]),
                                            [o_leaves[i] for i in last_used], y)
                        d_last, dy = vjp(jnp.ones((), loss.dtype) / m_)
                        c = dict(c, loss=c["loss"] + loss.astype(jnp.float32) / m_)
                        return dict(c, douter=add(c["douter"], last_used, d_last)), dy.astype(x0.dtype)

                    c, g = _when(s == s_ - 1, loss_grad, lambda c: (c, c["bwd"]), c)
                x = jax.lax.dynamic_index_in_dim(c["stash"], bmm % k_, 0, keepdims=False)
                out, pullback = jax.vjp(stage, p_leaves, x)  # the stage's forward again (its remat policy)
                if has_ys:
                    dgroup, dx = pullback((constrain(g, act), ys_cotangent(out[1])))
                else:
                    dgroup, dx = pullback(constrain(g, act))
                c["dgroups"] = [a + d.astype(a.dtype) for a, d in zip(c["dgroups"], dgroup)]
                dx = dx.astype(x0.dtype)
                # kept for the embedding's weight gradient, taken once after the loops (in the loop, its
                # reduction over the batch axes would run once per microbatch); used on stage 0 only
                c["dins"] = jax.lax.dynamic_update_index_in_dim(c["dins"], dx, bmm, 0)
                return c, dx

            return _when((bm >= 0) & (bm < m_), run, lambda c: (c, c["bwd"]), c)

        def phase(c, first: int, last: int, do_f: bool, do_b: bool):
            """Iterations ``first .. last - 1``; each shifts what it computed to the next stage."""
            def iteration(c, t):
                y = dx = None
                if do_f:
                    c, y = forward(t, c)
                if do_b:
                    c, dx = backward(t, c, y)
                c = dict(c, stash=constrain(c["stash"], (None, *act)), dins=constrain(c["dins"], (None, *act)))
                if do_f:
                    c["fwd"] = constrain(jax.lax.ppermute(constrain(y, act), "pipe", fwd_perm), act)
                if do_b:
                    c["bwd"] = constrain(jax.lax.ppermute(constrain(dx, act), "pipe", bwd_perm), act)
                return c, None

            return jax.lax.scan(iteration, c, jnp.arange(first, last))[0]

        c = phase(c, 0, s_ - 1, True, False)  # warm-up: forwards only
        c = phase(c, s_ - 1, m_ + s_ - 1, True, True)
        c = phase(c, m_ + s_ - 1, m_ + 2 * (s_ - 1), False, True)  # cool-down: backwards only

        def embed_grads(douter):  # stage 0: the embedding's weight gradients, over the whole batch at once
            _, vjp = jax.vjp(lambda o: first_fn(with_leaves(first_used, o), batch_of(toks)),
                             [o_leaves[i] for i in first_used])
            return add(douter, first_used, vjp(batch_of(c["dins"]))[0])

        douter = _when(s == 0, embed_grads, lambda d: d, c["douter"])
        # the loss is the last stage's, the embedding's / head's gradients the first's / last's: summed
        # over pipe once (zeros elsewhere)
        douter = {i: jax.lax.psum(a, "pipe") for i, a in douter.items()}
        return jax.lax.psum(c["loss"], "pipe"), douter, c["dgroups"], c["ys"]

    def run(p_leaves, o_leaves, tokens, targets):
        stage_spec = [P("pipe")] * len(p_leaves)
        ys_spec = None if ys_shape is None else jax.tree.map(lambda _: P("pipe"), ys_shape)

        def body(p_leaves, o_leaves, toks, tgts):
            with use_rules(rules.manual_pipe()):
                return local(p_leaves, o_leaves, toks, tgts)

        fn = jax.shard_map(body, mesh=rules.mesh, in_specs=(stage_spec, [P()] * len(o_leaves), P(), P()),
                           out_specs=(P(), {i: P() for i in outer_used}, stage_spec, ys_spec),
                           axis_names={"pipe"}, check_vma=False)
        loss, douter, dparams, ys = fn(p_leaves, o_leaves, split_mb(tokens), split_mb(targets))
        grads_outer = [douter[i].astype(a.dtype) if i in douter else jnp.zeros_like(a)
                       for i, a in enumerate(o_leaves)]
        if has_ys:
            loss = loss + sum(w * jnp.sum(ys[k]) for k, w in ys_weights.items())
        dparams = [d.astype(a.dtype) for d, a in zip(dparams, p_leaves)]
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


def _when(pred, fn, skip, operand):
    """``lax.cond(pred, fn, skip, operand)`` on each device for itself (inside a ``shard_map`` manual over
    ``pipe``), unless ``fn`` holds a point-to-point collective (a ``ppermute``, e.g. ring attention's over
    ``seq``): the runtime pairs the instances of such an op over all devices it names, so it must not run
    on some stages only (XLA:CPU then mixes up data of different iterations). Such a ``fn`` runs
    everywhere, and its result is selected."""
    if _has_ppermute(jax.make_jaxpr(fn)(operand).jaxpr):
        return jax.tree.map(lambda a, b: jnp.where(pred, a, b), fn(operand), skip(operand))
    return jax.lax.cond(pred, fn, skip, operand)


def _has_ppermute(jaxpr) -> bool:
    def subs(v):
        if hasattr(v, "eqns"):
            yield v
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):  # a ClosedJaxpr
            yield v.jaxpr
        elif isinstance(v, (tuple, list)):
            for u in v:
                yield from subs(u)

    return any(e.primitive.name == "ppermute" or any(_has_ppermute(j) for v in e.params.values() for j in subs(v))
               for e in jaxpr.eqns)


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
