"""Mixture of Experts with expert parallelism over the ``expert`` mesh axis.

Math, for one *group* of ``G`` tokens ``x_t`` (a group is the tokens one device holds):

    logits = x W_r                        [G, E]  (float32), probs p = softmax(logits)
                                          (score=sigmoid: p = sigmoid(logits), DeepSeek-V3)
    e_t = top_k ids of (p_t + b)          b: the routing bias (0 unless bias balancing is on)
    g_tj = p_{t, e_tj}                    gates: the unbiased scores; g_t /= sum_j g_tj if renormalize
    C = min(G, ceil(k G capacity_factor / E))     capacity of each expert (C = G when dropless)
    pos_tj = #{(s, i) before (t, j) in choice-major order (i, then s) with e_si = e_tj}
    y_t = sum_j [pos_tj < C] g_tj FFN_{e_tj}(x_t)
    FFN_e(x) = gelu(x W1_e) W2_e   or   (silu(x Wg_e) * (x Wu_e)) W2_e          (no biases)
    out_t = y_t + sum_{s<S} FFN^shared_s(x_t)     S = shared_experts always-on experts (DeepSeek-MoE),
                                                  run as one dense MLP of width S*d_ff (Megatron TP)

Fine-grained experts (DeepSeek-MoE) are many small experts: a larger ``n_experts`` and ``top_k``
with a smaller ``d_ff``; nothing else changes.

An assignment beyond an expert's capacity is *dropped*: its term is 0, so a token all of whose
assignments are dropped passes through the block's residual unchanged. Slots go by choice rank, as
in GShard and Switch: every token's first choice before any token's second choice (so a second
choice never takes the slot of a later token's first choice), and within a rank in token order.
Because capacity is per group, the result depends on the grouping (the mesh) only when something
is dropped; with enough capacity (or ``dropless``) every mesh computes the same function as one
device.

Auxiliary-loss-free balancing (DeepSeek-V3; ``bias_update_rate`` gamma > 0): a per-expert bias ``b``
(parameter ``router_bias``, no gradient) shifts which experts are chosen but not the gates; after
each optimizer step it moves by ``b_i += gamma * sign(mean_j load_j - load_i)`` (:func:`balance_bias`,
applied by the trainer through the model's ``after_update``), so overloaded experts become less likely.

Auxiliary losses, computed over the *whole* batch (group statistics averaged over the token-
splitting mesh axes, so they are the same on every mesh):

    balance = E sum_i f_i P_i    f_i = share of the k*N assignments routed to expert i (before
                                 dropping; no gradient), P_i = mean_t p_ti      (Switch; 1 = uniform)
                                 (sigmoid scores: p_t normalised to sum 1 for P, as in DeepSeek-V3)
    z       = mean_t (logsumexp_i logits_ti)^2                                 (ST-MoE router z-loss)
    drop_fraction = dropped assignments / (k*N), from integer counts (exactly 0 when none drop)

The model sums ``balance`` over its MoE layers (``moe.aux_loss_weight`` weighs the sum).
Hugging Face's ``load_balancing_loss_func`` (Mixtral) differs in two ways: its ``f`` counts each
choice rank separately and sums them, which is ``top_k`` times ours, and it pools the tokens of all
layers into one term instead of summing per-layer terms. For one layer, HF = ``top_k`` x balance
(tested); at uniform routing HF = ``top_k`` and the sum here = the number of MoE layers L. A
Mixtral ``router_aux_loss_coef`` c therefore corresponds to ``moe.aux_loss_weight`` = c * top_k / L
(exact for L = 1, at balance for any L).

Communication (inside ``jax.shard_map``, manual over the axes that split tokens: ``batch`` and
``length`` rules, e.g. ``data``, ``expert``, ``seq``; over the ``experts`` axis; and over the
``mlp`` axis, ``tensor``):

1. each device scatters its assignments into a capacity-padded buffer ``[E, C, d_model]``;
2. all-to-all over ``expert``: the slice of experts ``e`` goes to the device holding ``e``, which
   receives ``[E/ep, ep*C, d_model]`` (its experts' slots from every device of its ``expert`` group);
3. the local experts run (weights ``[E/ep, d_model, d_ff/tensor]``: experts split over ``expert``,
   hidden units over ``tensor``);
4. a second all-to-all returns the results ``[E, C, d_model]``; each token gathers its k slots and
   sums them with its gates; under tensor parallelism one psum over ``tensor`` of ``[G, d_model]``
   completes the row-parallel down-projection (Megatron). Under Megatron-SP (the residual stream is
   split along the sequence over ``tensor``) the layer all-gathers the sequence over ``tensor`` on
   entry and reduce-scatters ``y`` back along it (``psum_scatter``): half the psum's bytes.

Each all-to-all moves ``E*C*d_model ~= k*G*capacity_factor*d_model`` elements per device and
direction (forward and backward each do two). Tokens stay on their data/expert device otherwise;
replicas over ``data`` hold the same experts, and their gradients are summed by ``shard_map``'s
transpose. The all-to-all here is the dense (capacity-padded) ``jax.lax.all_to_all``, which every
backend runs.

``dispatch="sorted"`` (dropless only) replaces steps 1-4 with :func:`sorted_experts`: the ``G*k``
assignments sorted by expert and run as a grouped matmul, so compute and memory scale with ``k*G``,
not with ``E*G`` as capacity-dropless does. With the experts split over ``expert`` it is
:func:`exchanged_experts`: the per-expert counts first, then the sorted rows in all-to-all rounds of
``capacity_factor`` x the balanced share per peer (one round when the routing is balanced, more when
it is skewed; never ``E*G`` slots). ``jax.lax.ragged_all_to_all`` (unpadded) is not used: it does not
compile on XLA:CPU, so it could not be tested here; the rounds run on every backend.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, check_groups
from jaxpar.layers.mlp import GATED, KINDS, MLP, Kind, activate, kind_name
from jaxpar.layers.moe_dispatch import GROUPED_MATMUL, exchanged_experts, grouped_matmul_impl, sorted_experts, varying
from jaxpar.partitioning import active_rules, param


def expert_capacity(tokens: int, n_experts: int, top_k: int, capacity_factor: float, dropless: bool = False) -> int:
    """Slots per expert for a group of ``tokens``: ``min(tokens, ceil(k * tokens * cf / E))`` (``tokens`` if
    dropless; a token uses an expert at most once, so ``tokens`` slots never drop)."""
    if dropless:
        return tokens
    return max(1, min(tokens, math.ceil(top_k * tokens * capacity_factor / n_experts - 1e-9)))


class Routing(NamedTuple):
    """Top-k routing of a group of ``G`` tokens to ``E`` experts with capacity ``C``."""

    probs: jax.Array    # [G, E] router softmax (float32)
    gates: jax.Array    # [G, k] weights of the chosen experts (renormalised if asked)
    experts: jax.Array  # [G, k] chosen expert ids, best first
    keep: jax.Array     # [G, k] the assignment fits in its expert's capacity
    slot: jax.Array     # [G, k] row in the flat [E*C] buffer: expert*C + position; E*C when dropped
    counts: jax.Array   # [E] assignments routed to each expert (before dropping)


SCORES = ("softmax", "sigmoid")
DISPATCH = ("capacity", "sorted")


def route(logits: jax.Array, top_k: int, capacity: int, renormalize: bool = True, score: str = "softmax",
          bias: jax.Array | None = None, groups: int = 1, top_groups: int = 1, scale: float = 1.0) -> Routing:
    """Scores (softmax, or sigmoid per expert), top-k (of the scores plus ``bias [E]``, which chooses the
    experts but is not part of the gates and has no gradient), and the capacity positions by choice
    rank: all first choices (in token order) before any second choice, and so on.

    Group-limited routing (DeepSeek-V3; ``groups`` > 1): the experts form ``groups`` equal groups, each
    scored by the sum of its two best (biased) scores; a token chooses its top-k among the experts of its
    ``top_groups`` best groups only. The gates (renormalised if asked) are then multiplied by ``scale``
    (DeepSeek's ``routed_scaling_factor``)."""
    g, e = logits.shape
    logits = logits.astype(jnp.float32)
    probs = jax.nn.sigmoid(logits) if score == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    if bias is None and groups == 1:
        gates, experts = jax.lax.top_k(probs, top_k)
    else:
        choice = probs if bias is None else probs + jax.lax.stop_gradient(bias.astype(jnp.float32))
        if groups > 1:
            best_two = jax.lax.top_k(choice.reshape(g, groups, e // groups), 2)[0]
            _, top = jax.lax.top_k(jnp.sum(best_two, axis=-1), top_groups)            # [G, top_groups]
            allowed = jnp.any(jax.nn.one_hot(top, groups, dtype=jnp.bool_), axis=1)  # [G, groups]
            choice = jnp.where(jnp.repeat(allowed, e // groups, axis=-1), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, top_k)
        gates = jnp.take_along_axis(probs, experts, axis=-1)
    if renormalize:
        gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    if scale != 1.0:
        gates = gates * scale
    onehot = jax.nn.one_hot(experts, e, dtype=jnp.int32)                    # [G, k, E]
    by_rank = jnp.swapaxes(onehot, 0, 1).reshape(top_k * g, e)              # [k*G, E], rank-major
    before = jnp.swapaxes((jnp.cumsum(by_rank, axis=0) - 1).reshape(top_k, g, e), 0, 1)
    pos = jnp.sum(before * onehot, axis=-1)                                   # [G, k]
    keep = pos < capacity
    slot = jnp.where(keep, experts * capacity + pos, e * capacity)
    return Routing(probs, gates, experts, keep, slot, jnp.sum(onehot, axis=(0, 1)))


def balance_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """One auxiliary-loss-free balancing step (DeepSeek-V3): ``bias [..., E] + rate * sign(mean - load)``
    per row of ``load [..., E]`` (assignments per expert): overloaded experts' bias goes down by
    ``rate``, underloaded ones' up; exactly balanced ones stay."""
    mean = jnp.mean(load.astype(jnp.float32), axis=-1, keepdims=True)
    return bias + (rate * jnp.sign(mean - load.astype(jnp.float32))).astype(bias.dtype)


class _Axes(NamedTuple):
    tokens: tuple = ()   # mesh axes splitting the tokens (groups)
    expert: tuple = ()   # mesh axes splitting the experts (a subset of tokens)
    tensor: tuple = ()   # mesh axes splitting the expert hidden units
    sp: tuple = ()       # tensor axes that also split the sequence outside the layer (Megatron-SP)
    ep: int = 1          # devices over the expert axes


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _summed_as(dtype):
    """The dtype the layer's sums of activations over ``tensor`` run in (a ``psum`` inside its ``shard_map``, or
    the transpose of a cast to varying): ``dtype``, but float32 for a narrower one on XLA:CPU, whose
    all-reduce promotion (which sums bfloat16 in float32) aborts on the reducer JAX lowers for a sum inside a
    partly-manual ``shard_map`` ("Invalid binary instruction opcode copy"); the result is what the promotion
    would compute, and :mod:`jaxpar.comm` counts XLA:CPU's activation collectives at 4 bytes already."""
    return jnp.float32 if jnp.dtype(dtype).itemsize < 4 and jax.devices()[0].platform == "cpu" else dtype


def _vary(v, axes: tuple, dtype):
    """``v`` in ``dtype``, varying over ``axes`` (:func:`~jaxpar.layers.moe_dispatch.varying`); the cast to
    varying, whose transpose sums the gradient over ``axes``, in :func:`_summed_as` ``(dtype)``."""
    return varying(v.astype(_summed_as(dtype)), axes).astype(dtype)


class MoE(nnx.Module):
    """Top-k routed experts with capacity; ``apply(x) -> (y, stats)`` (see the module docstring).

    ``stats``: ``aux_loss`` (balance), ``z_loss``, ``drop_fraction`` (dropped share of the k*N
    assignments) and ``expert_load`` ``[E]`` (assignments routed to each expert over the whole
    batch). Parameters: ``router [embed, router]`` (E columns, replicated), ``w_in [experts, expert_embed, (2,) mlp]``,
    ``w_out [experts, mlp, expert_embed]`` (``expert_embed``: the embed dim of an expert weight, which ZeRO
    splits over the batch axes other than ``expert``), and with ``shared_experts`` > 0 ``shared``, an
    :class:`~jaxpar.layers.MLP` of width ``shared_experts * d_ff`` outside the routing (tensor-parallel
    like the dense MLP). ``score``: ``softmax`` or ``sigmoid`` router scores. ``bias_update_rate`` > 0
    adds ``router_bias [router]`` (zeros; chooses experts, no gradient), which the caller moves after
    each optimizer step with :func:`balance_bias` and ``stats["expert_load"]`` (the trainer does it);
    ``routing_bias`` adds it without moving it (DeepSeek-V3's ``e_score_correction_bias``, as imported).
    ``logit_bias`` adds ``router_logit_bias [router]``, a trained bias on the router's logits (GPT-OSS);
    ``expert_bias`` the experts' biases ``b_in [experts, (2,) mlp]`` (on the up projections) and ``b_out
    [router, expert_embed]`` (on the down projection: every expert's, whole on every device, added once as
    ``sum_j g_tj b_out[e_tj]``). ``grouped_matmul``: how the sorted dispatch runs its experts, ``tiles``,
    ``ragged_dot`` or ``auto`` (:func:`~jaxpar.layers.moe_dispatch.grouped_matmul_impl`: ``ragged_dot``
    on TPU only).
    """

    def __init__(self, d_model: int, d_ff: int, n_experts: int, top_k: int, *, capacity_factor: float = 1.25,
                 dropless: bool = False, renormalize: bool = True, kind: Kind = "gelu", init_std: float = 0.02,
                 out_init_std: float | None = None, shared_experts: int = 0, score: str = "softmax",
                 dispatch: str = "capacity", bias_update_rate: float = 0.0, groups: int = 1, top_groups: int = 1,
                 gate_scale: float = 1.0, routing_bias: bool = False, logit_bias: bool = False,
                 expert_bias: bool = False, grouped_matmul: str = "auto", dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        if kind_name(kind) not in KINDS:
            raise ValueError(f"unknown expert kind {kind!r}; choose one of {', '.join(KINDS)}")
        # a library caller's mistake names the argument (and the config key train.py users set)
        if score not in SCORES:
            raise ConfigError(f"MoE(score={score!r}) (config key moe.score): choose one of {', '.join(SCORES)}")
        if shared_experts < 0:
            raise ConfigError(f"MoE(shared_experts={shared_experts}) (config key moe.shared_experts) must be >= 0")
        if not 1 <= top_k <= n_experts:
            raise ConfigError(f"MoE(top_k={top_k}) (config key moe.top_k) must be between 1 and "
                              f"n_experts={n_experts}")
        if dispatch not in DISPATCH:
            raise ConfigError(f"MoE(dispatch={dispatch!r}) (config key moe.dispatch): choose one of "
                              f"{', '.join(DISPATCH)}")
        if grouped_matmul not in GROUPED_MATMUL:
            raise ConfigError(f"MoE(grouped_matmul={grouped_matmul!r}) (config key moe.grouped_matmul): choose one "
                              f"of {', '.join(GROUPED_MATMUL)}")
        if dispatch == "sorted" and not dropless:
            raise ConfigError("MoE(dispatch='sorted') is the dropless path: pass dropless=True (config key "
                              "moe.dropless)")
        if not bias_update_rate >= 0:
            raise ConfigError(f"MoE(bias_update_rate={bias_update_rate}) (config key moe.bias_update_rate) must "
                              f"be >= 0")
        if not capacity_factor > 0:
            raise ConfigError(f"MoE(capacity_factor={capacity_factor}) (config key moe.capacity_factor) must be > 0")
        check_groups(n_experts, top_k, groups, top_groups)
        self.groups, self.top_groups, self.gate_scale = groups, top_groups, float(gate_scale)
        self.n_experts, self.top_k, self.kind = n_experts, top_k, kind
        self.capacity_factor, self.dropless, self.renormalize = capacity_factor, dropless, renormalize
        self.score, self.dispatch, self.dtype = score, dispatch, dtype
        self.bias_update_rate, self.grouped_matmul = bias_update_rate, grouped_matmul
        # always-on experts: one dense MLP of width S * d_ff (the sum of S experts' outputs), no biases
        self.shared = (MLP(d_model, shared_experts * d_ff, kind=kind, use_bias=False, init_std=init_std,
                           out_init_std=out_init_std, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                       if shared_experts else None)
        init, out_init = nnx.initializers.normal(init_std), nnx.initializers.normal(out_init_std or init_std)
        self.router = param(init(rngs.params(), (d_model, n_experts), param_dtype), ("embed", "router"))
        self.router_bias = (param(jnp.zeros((n_experts,), jnp.float32), ("router",))
                            if bias_update_rate > 0 or routing_bias else None)
        self.in_axes: tuple[str, ...]
        if kind_name(kind) in GATED:
            self.in_axes = ("experts", "expert_embed", "fused", "mlp")
            w_in = init(rngs.params(), (n_experts, d_model, 2, d_ff), param_dtype)
        else:
            self.in_axes = ("experts", "expert_embed", "mlp")
            w_in = init(rngs.params(), (n_experts, d_model, d_ff), param_dtype)
        self.out_axes = ("experts", "mlp", "expert_embed")
        self.w_in = param(w_in, self.in_axes)
        self.w_out = param(out_init(rngs.params(), (n_experts, d_ff, d_model), param_dtype), self.out_axes)
        self.router_logit_bias = param(jnp.zeros((n_experts,), param_dtype), ("router",)) if logit_bias else None
        self.b_in_axes = (self.in_axes[0], *self.in_axes[2:])  # (experts, [fused,] mlp): w_in's but expert_embed
        self.b_in = (param(jnp.zeros(w_in.shape[:1] + w_in.shape[2:], param_dtype), self.b_in_axes)
                     if expert_bias else None)
        self.b_out = (param(jnp.zeros((n_experts, d_model), param_dtype), ("router", "expert_embed"))
                      if expert_bias else None)

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict]:
        return self.apply(x)

    # -- placement ----------------------------------------------------------------------------
    def apply(self, x: jax.Array) -> tuple[jax.Array, dict]:
        """``x [B, T, d_model]`` -> ``(y [B, T, d_model], stats)``; distributed under active rules."""
        y, stats = self._routed(x)
        if self.shared is not None:
            y = y + self.shared(x)
        return y, stats

    def _routed(self, x: jax.Array) -> tuple[jax.Array, dict]:
        def value(p):
            return None if p is None else p[...]

        weights = (self.router[...], self.w_in[...], self.w_out[...], value(self.router_bias),
                   value(self.router_logit_bias), value(self.b_in), value(self.b_out))
        rules = active_rules()
        mesh = None if rules is None else rules.mesh
        if rules is None or mesh is None:
            return self._local(x, *weights, ax=_Axes())
        big = lambda axes: tuple(a for a in axes if mesh.shape[a] > 1)  # noqa: E731
        tensor = big(rules.compute.axes("mlp"))
        batch = tuple(a for a in big(rules.params.axes("batch")) if a not in tensor)
        length = tuple(a for a in big(rules.params.axes("length")) if a not in tensor)
        expert = big(rules.compute.axes("experts"))
        if not set(expert) <= set(batch + length):
            raise ConfigError(f"expert parallelism needs the experts axes {expert} to split the tokens too "
                              f"(the batch rule maps to {batch})")
        sp = tuple(a for a in big(rules.params.axes("res_length")) if a in tensor)
        ax = _Axes(batch + length, expert, tensor, sp, math.prod(mesh.shape[a] for a in expert))
        manual = set(ax.tokens) | set(expert) | set(tensor)
        if not manual:
            return self._local(x, *weights, ax=ax)
        x_spec = P(_entry(batch), _entry(length + sp))  # Megatron-SP: sequence-split over tensor too
        names = (("embed", "router"), self.in_axes, self.out_axes, ("router",), ("router",), self.b_in_axes,
                 ("router", "expert_embed"))
        w_specs = tuple(None if w is None else rules.compute.spec(n, w.shape, "MoE weight")
                        for n, w in zip(names, weights))
        stats_spec = {k: P() for k in ("aux_loss", "z_loss", "drop_fraction", "expert_load")}
        fn = jax.shard_map(lambda *a: self._local(*a, ax=ax), mesh=mesh, in_specs=(x_spec, *w_specs),
                           out_specs=(x_spec, stats_spec), axis_names=manual, check_vma=True)
        return fn(x, *weights)

    # -- one device's work --------------------------------------------------------------------
    def _local(self, x, w_router, w_in, w_out, bias, logit_bias, b_in, b_out, *, ax: _Axes):
        if ax.sp:  # Megatron-SP: the sequence gathered over tensor here (its transpose: a reduce-scatter, whose
            # sum runs in _summed_as)
            x = jax.lax.all_gather(x.astype(_summed_as(x.dtype)), ax.sp, axis=1, tiled=True).astype(x.dtype)
        if ax.tokens or ax.tensor:
            # the experts' weights made varying over the token and tensor axes before they are cast to the compute
            # dtype: the cast's transpose, which sums their gradient over those axes, then sums in the weights'
            # dtype (a bfloat16 sum would lose the gradient's low bits, and XLA:CPU fails to compile it)
            w_in, w_out, b_in, b_out = (None if w is None else varying(w, ax.tokens + ax.tensor)
                                        for w in (w_in, w_out, b_in, b_out))
        b, t, d = x.shape
        g, e, k = b * t, self.n_experts, self.top_k
        cap = expert_capacity(g, e, k, self.capacity_factor, self.dropless)
        xt = x.reshape(g, d)
        logits = jnp.einsum("gd,de->ge", xt.astype(jnp.float32), w_router.astype(jnp.float32))
        if logit_bias is not None:
            logits = logits + logit_bias.astype(jnp.float32)
        r = route(logits, k, cap, self.renormalize, self.score, bias, self.groups, self.top_groups, self.gate_scale)
        # dispatch: every kept assignment copies its token into its expert's slot (dropped: index E*C, discarded)
        tokens = xt.astype(self.dtype)
        if ax.tensor and not ax.sp:
            # the dispatched tokens as every tensor rank's own copy: the backward then sums their gradient
            # over tensor on [tokens, d_model] here, not on the capacity-padded (larger) dispatch buffer
            # (under Megatron-SP the all-gather above already makes them per-rank copies)
            tokens = _vary(xt, ax.tensor, self.dtype)
        # the gates varying over tensor as the tokens are (the combine multiplies them): their gradient's sum too
        gates = _vary(r.gates, ax.tensor, self.dtype)
        if self.dispatch == "sorted":
            impl = grouped_matmul_impl(self.grouped_matmul, jax.devices()[0].platform)
            w_in, w_out = w_in.astype(self.dtype), w_out.astype(self.dtype)
            b_in = None if b_in is None else b_in.astype(self.dtype)
            if ax.expert:
                # every operand varying over the same axes (the weights are, from the top of this method), so
                # the rounds' custom VJP returns gradients of the primal's type
                tokens, gates = (_vary(v, ax.tokens + ax.tensor, self.dtype) for v in (tokens, gates))
                y = exchanged_experts(tokens, r.experts, gates, w_in, w_out, self.kind,
                                      axes=ax.expert, ep=ax.ep, chunk=self.capacity_factor, impl=impl, b_in=b_in)
            else:
                y = sorted_experts(tokens, r.experts, gates, w_in, w_out, self.kind, impl, b_in=b_in)
        else:
            y = self._capacity_experts(tokens, r, gates, w_in, w_out, cap, ax, b_in)
        if b_out is not None:  # the kept assignments' down biases, gated; on each tensor rank 1/t of it (summed below)
            kept = jnp.where(r.keep, gates, jnp.zeros((), gates.dtype))
            term = jnp.einsum("gk,gkd->gd", kept, jnp.take(b_out.astype(self.dtype), r.experts, axis=0))
            if ax.tensor:
                term = _vary(term, ax.tensor, self.dtype) / math.prod(jax.lax.axis_size(a) for a in ax.tensor)
            y = y + term
        y = y.reshape(b, t, d)
        if ax.tensor:  # the row-parallel down-projection's partial sums, reduced (in _summed_as: see there);
            # under Megatron-SP (ax.sp: tensor axes) split over the sequence again
            y = y.astype(_summed_as(y.dtype))
            y = (jax.lax.psum_scatter(y, ax.sp, scatter_dimension=1, tiled=True) if ax.sp
                 else jax.lax.psum(y, ax.tensor))
        return y.astype(x.dtype), self._stats(logits, r, ax.tokens, ax.sp)

    def _capacity_experts(self, tokens, r: Routing, gates, w_in, w_out, cap: int, ax: _Axes, b_in=None):
        """``tokens [G, d]`` through their kept experts via capacity slots (and all-to-all over expert), combined
        with ``gates [G, k]`` (``r.gates`` in the compute dtype, varying as ``tokens``)."""
        g, d = tokens.shape
        e, k = self.n_experts, self.top_k
        rows = jnp.broadcast_to(tokens[:, None, :], (g, k, d))
        buf = jnp.zeros((e * cap, d), self.dtype).at[r.slot].add(rows, mode="drop").reshape(e, cap, d)
        if ax.expert:  # [E, C, d] -> [E/ep, ep*C, d]: my experts' slots from every device of my expert group
            buf = jax.lax.all_to_all(buf, ax.expert, split_axis=0, concat_axis=1, tiled=True)
        out = self._experts(buf, w_in, w_out, b_in)
        if ax.expert:  # and back: [E/ep, ep*C, d] -> [E, C, d]
            out = jax.lax.all_to_all(out, ax.expert, split_axis=1, concat_axis=0, tiled=True)
        # combine: each token sums its k slots weighted by its gates (dropped slots read 0)
        picked = jnp.take(out.reshape(e * cap, d), r.slot, axis=0, mode="fill", fill_value=0)
        weights = jnp.where(r.keep, gates, jnp.zeros((), gates.dtype))
        return jnp.einsum("gkd,gk->gd", picked, weights)

    def _experts(self, buf, w_in, w_out, b_in=None):
        """``buf [E_local, N, d]`` through each local expert's FFN (remat names ``mlp_up``, ``mlp_down``;
        ``b_in [E_local, (2,) f]``: the up projections' biases)."""
        h = jnp.einsum("end,ed...->en...", buf, w_in.astype(self.dtype))
        h = checkpoint_name(h if b_in is None else h + b_in[:, None].astype(self.dtype), "mlp_up")
        h = activate(h, self.kind)
        return checkpoint_name(jnp.einsum("enf,efd->end", h, w_out.astype(self.dtype)), "mlp_down")

    def _stats(self, logits, r: Routing, token_axes: tuple, copies: tuple = ()) -> dict:
        """Batch statistics: averaged / summed over the groups (``token_axes``); ``copies``: axes whose
        devices routed the same tokens (equal values, reduced only to make them invariant)."""
        g, e, k = logits.shape[0], self.n_experts, self.top_k
        over = token_axes + copies
        mean = (lambda v: jax.lax.pmean(v, over)) if over else (lambda v: v)

        def total(v):
            v = jax.lax.psum(v, token_axes) if token_axes else v
            return jax.lax.pmax(v, copies) if copies else v

        counts = r.counts.astype(jnp.float32)
        f = jax.lax.stop_gradient(mean(counts / (g * k)))
        probs = r.probs / jnp.sum(r.probs, axis=-1, keepdims=True) if self.score == "sigmoid" else r.probs
        p_mean = mean(jnp.mean(probs, axis=0))
        z = mean(jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))))
        dropped = total(jnp.sum(~r.keep, dtype=jnp.int32))         # integer counts: exactly 0 when none drop
        assignments = g * k * (jax.lax.psum(1, token_axes) if token_axes else 1)  # static: the group count
        return {"aux_loss": e * jnp.sum(f * p_mean), "z_loss": z,
                "drop_fraction": dropped.astype(jnp.float32) / assignments,
                "expert_load": total(counts)}
