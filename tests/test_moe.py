"""Mixture of Experts: the layer against an independent per-token reference (float64), token dropping
on a hand-built routing, the MoE model on expert-parallel meshes against one device, the all-to-all
bytes against the capacity formula, the expert-weight split, metrics and config errors."""

import json
import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import (assert_trees_close, batches, check_moe_against_reference, command_env, config,
                     first_step, per_microbatch_reference, rel_err, run_script, trainer)
from jaxpar.config import ConfigError, load_config
from jaxpar.layers import MoE, expert_capacity
from jaxpar.mesh import make_mesh
from jaxpar.partitioning import make_rules, use_rules

F32 = 4
D, F, E = 16, 24, 8


# --- an independent reference: a Python loop over groups, tokens and their top-k experts ----------

def _gelu(h):
    return 0.5 * h * (1 + jnp.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))


def _ffn(p, e, x, kind):
    if kind == "swiglu":
        a, b = x @ p["w_in"][e][:, 0, :], x @ p["w_in"][e][:, 1, :]
        h = a / (1 + jnp.exp(-a)) * b
    else:
        h = _gelu(x @ p["w_in"][e])
    return h @ p["w_out"][e]


def _shared(p, s, x, kind, width):
    """The s-th always-on expert: hidden units [s*width, (s+1)*width) of the shared MLP."""
    cols = slice(s * width, (s + 1) * width)
    up, down = p["shared"]["up"]["kernel"], p["shared"]["down"]["kernel"][cols]
    if kind == "swiglu":
        a, b = x @ up[:, 0, cols], x @ up[:, 1, cols]
        return (a / (1 + jnp.exp(-a)) * b) @ down
    return _gelu(x @ up[:, cols]) @ down


def _scores(z, score, xp):
    if score == "sigmoid":
        return 1 / (1 + xp.exp(-z))
    e = xp.exp(z - xp.max(z, axis=-1, keepdims=True))
    return e / xp.sum(e, axis=-1, keepdims=True)


def reference(p: dict, x: np.ndarray, *, groups: int, k: int, cf: float, renormalize=True, kind="gelu",
              dropless=False, score="softmax", shared=0):
    """float64 numpy routing decisions, then a differentiable per-token sum over the kept experts.

    Group g is rows ``[g*B/groups, (g+1)*B/groups)`` of ``x [B, T, D]`` (one device's tokens), read in
    row-major token order; an expert takes the first ``C`` assignments of its group by choice rank
    (GShard/Switch): every token's first choice, in token order, then every token's second choice,
    and so on. Returns ``(f(p, x) -> y, stats)``.
    """
    b, t, d = x.shape
    xs = np.asarray(x, np.float64).reshape(b * t, d)
    wr = np.asarray(p["router"], np.float64)
    n_exp = wr.shape[1]
    bias = np.asarray(p.get("router_bias", np.zeros(n_exp)), np.float64)  # chooses experts, not in the gates
    g = b * t // groups
    cap = g if dropless else min(g, math.ceil(k * g * cf / n_exp))
    plan, load, dropped = [], np.zeros(n_exp), 0
    for grp in range(groups):
        used = np.zeros(n_exp, int)
        tokens = range(grp * g, (grp + 1) * g)
        orders, kept = {}, {i: [] for i in tokens}
        for i in tokens:
            orders[i] = [int(e) for e in np.argsort(-(_scores(xs[i] @ wr, score, np) + bias), kind="stable")[:k]]
        for j in range(k):  # choice rank first, then token order
            for i in tokens:
                e = orders[i][j]
                load[e] += 1
                if used[e] < cap:
                    used[e] += 1
                    kept[i].append(e)
                else:
                    dropped += 1
        plan += [(i, orders[i], kept[i]) for i in tokens]
    logits = xs @ wr
    probs = _scores(logits, score, np)
    probs /= probs.sum(1, keepdims=True)  # sigmoid scores: normalised for the balance loss
    f = load / (b * t * k)
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    stats = {"aux_loss": n_exp * np.sum(f * probs.mean(0)), "z_loss": np.mean(lse ** 2),
             "drop_fraction": dropped / (b * t * k), "expert_load": load}

    def fn(p, x):
        xs = x.reshape(b * t, d)
        out = []
        for i, order, kept in plan:
            gates = _scores(xs[i] @ p["router"], score, jnp)[jnp.array(order)]
            if renormalize:
                gates = gates / jnp.sum(gates)
            y = jnp.zeros(d, x.dtype)
            for j, e in enumerate(order):
                if e in kept:
                    y = y + gates[j] * _ffn(p, e, xs[i], kind)
            for sh in range(shared):
                y = y + _shared(p, sh, xs[i], kind, p["w_out"].shape[1])
            out.append(y)
        return jnp.stack(out).reshape(b, t, d)

    return fn, stats


def _layer(k=2, cf=1.0, kind="gelu", seed=0, **kw):
    return MoE(D, F, E, k, capacity_factor=cf, kind=kind, rngs=nnx.Rngs(seed), **kw)


def _params(m):
    return nnx.to_pure_dict(nnx.state(m))


def _run_layer(m, x, ct, mesh_over=None, n_dev=None):
    """``(y, stats, grads of sum(y * ct) wrt (params, x))`` of the layer, on a mesh if asked."""
    graphdef, state = nnx.split(m)
    rules = None
    if mesh_over:
        par = load_config(None, mesh_over).parallel
        rules = make_rules(par, make_mesh(par, jax.devices()[:n_dev]))

    def f(p, x):
        st = jax.tree.map(lambda v: v, state)
        nnx.replace_by_pure_dict(st, p)
        mod = nnx.merge(graphdef, st)
        with use_rules(rules):
            y, stats = mod.apply(x)
        return jnp.sum(y * ct), (y, stats)

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(_params(m), x)
    return y, stats, grads


def _reference_run(m, x, ct, groups, **kw):
    p64 = jax.tree.map(lambda a: np.asarray(a, np.float64), _params(m))
    shared = 0 if m.shared is None else p64["shared"]["down"]["kernel"].shape[0] // p64["w_out"].shape[1]
    fn, stats = reference(p64, np.asarray(x), groups=groups, k=m.top_k, cf=m.capacity_factor, kind=m.kind,
                          renormalize=m.renormalize, dropless=m.dropless, score=m.score, shared=shared, **kw)
    with jax.enable_x64(True):
        p, xx, c = jax.tree.map(jnp.asarray, p64), jnp.asarray(x, jnp.float64), jnp.asarray(ct, jnp.float64)
        y = fn(p, xx)
        grads = jax.grad(lambda p, x: jnp.sum(fn(p, x) * c), argnums=(0, 1))(p, xx)
        return np.asarray(y), stats, jax.tree.map(np.asarray, grads)


CASES = {  # name: (layer options, mesh overrides, devices, groups = devices splitting the tokens)
    "one_device_no_drop": (dict(k=2, cf=4.0), None, 1, 1),
    "one_device_drop": (dict(k=2, cf=0.5), None, 1, 1),
    "swiglu_top1_drop": (dict(k=1, cf=0.75, kind="swiglu", renormalize=False), None, 1, 1),
    "expert8_drop": (dict(k=2, cf=0.6), ["parallel.expert=8"], 8, 8),
    "data2_expert4_drop": (dict(k=2, cf=0.6), ["parallel.data=2", "parallel.expert=4"], 8, 8),
    "data2_expert2_tensor2_drop": (dict(k=2, cf=0.6, kind="swiglu"),
                                   ["parallel.data=2", "parallel.expert=2", "parallel.tensor=2"], 8, 4),
    "expert4_dropless": (dict(k=3, cf=0.1, dropless=True), ["parallel.expert=4"], 4, 4),
    # DeepSeek-style: sigmoid scores, 2 shared experts beside the routed ones, tensor-parallel shared MLP
    "sigmoid_shared2_drop": (dict(k=2, cf=0.6, kind="swiglu", score="sigmoid", shared_experts=2), None, 1, 1),
    "sigmoid_shared1_data2_expert2_tensor2_no_drop": (dict(k=2, cf=4.0, score="sigmoid", shared_experts=1),
                                              ["parallel.data=2", "parallel.expert=2", "parallel.tensor=2"], 8, 4),
    # dropless by sorting: a grouped matmul over the routed assignments only (moe.dispatch=sorted)
    "sorted_dropless_one_device": (dict(k=2, cf=0.1, dropless=True, dispatch="sorted"), None, 1, 1),
    "sorted_dropless_swiglu_sigmoid_shared1_data2_tensor2": (
        dict(k=3, cf=0.1, kind="swiglu", score="sigmoid", shared_experts=1, dropless=True, dispatch="sorted"),
        ["parallel.data=2", "parallel.tensor=2"], 4, 2),
    # ... with the experts split over `expert`: rows exchanged in rounds (all-to-all), skewed routing included
    "sorted_expert8_small_rounds": (dict(k=3, cf=0.3, dropless=True, dispatch="sorted"), ["parallel.expert=8"], 8, 8),
    "sorted_data2_expert4": (dict(k=2, cf=1.25, dropless=True, dispatch="sorted"),
                             ["parallel.data=2", "parallel.expert=4"], 8, 8),
    "sorted_swiglu_sigmoid_shared1_expert2_tensor2_data2": (
        dict(k=2, cf=0.5, kind="swiglu", score="sigmoid", shared_experts=1, dropless=True, dispatch="sorted"),
        ["parallel.data=2", "parallel.expert=2", "parallel.tensor=2"], 8, 4),
    # auxiliary-loss-free balancing: a (random, here) routing bias chooses the experts, the gates stay unbiased
    "bias_one_device_no_drop": (dict(k=2, cf=4.0, bias_update_rate=0.01), None, 1, 1),
    "bias_sigmoid_sorted_data2_expert2_tensor2": (
        dict(k=2, cf=1.0, score="sigmoid", dropless=True, dispatch="sorted", bias_update_rate=0.01),
        ["parallel.data=2", "parallel.expert=2", "parallel.tensor=2"], 8, 4),
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_per_token_reference(case):
    opts, over, n_dev, groups = CASES[case]
    m = _layer(**opts)
    rng = np.random.default_rng(1)
    if m.router_bias is not None:  # large enough to change the choices (checked below through the grads)
        m.router_bias[...] = jnp.asarray(rng.normal(size=E) * 0.2, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 4, D)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(8, 4, D)), jnp.float32)
    y, stats, grads = _run_layer(m, x, ct, over, n_dev)
    y_ref, stats_ref, grads_ref = _reference_run(m, x, ct, groups)
    assert rel_err(y, y_ref) <= 1e-5
    assert_trees_close(jax.device_get(grads), grads_ref, 1e-5, f"{case} grads ")
    for key in ("aux_loss", "z_loss", "drop_fraction", "expert_load"):
        np.testing.assert_allclose(np.asarray(stats[key]), stats_ref[key], rtol=1e-5, atol=1e-7, err_msg=key)
    if m.router_bias is not None:  # the bias did change the choices: without it the reference differs
        m.router_bias[...] = jnp.zeros(E, jnp.float32)
        assert rel_err(_reference_run(m, x, ct, groups)[0], y_ref) > 1e-2
    if "no_drop" in case or opts.get("dropless"):
        assert stats_ref["drop_fraction"] == 0
        assert float(stats["drop_fraction"]) == 0.0  # integer counts: exactly 0, not -3e-8
    else:
        assert stats_ref["drop_fraction"] > 0.05  # the dropping path is exercised


def _forced_layer(k: int):
    """Every token prefers expert 2, then expert 1 (x[..., 0] = 1 and a large router weight)."""
    m = MoE(D, F, 4, k, capacity_factor=1.0, rngs=nnx.Rngs(0))
    w = np.asarray(m.router[...]) * 0.01
    w[0, 2], w[0, 1] = 20.0, 10.0
    m.router[...] = jnp.asarray(w)
    return m


@pytest.mark.parametrize("k, keep", [(1, 4), (2, 8)])
def test_overflow_drops_the_last_tokens_of_the_group(k, keep):
    """16 tokens, 4 experts, capacity ceil(k*16/4): expert 2 (and for k=2 expert 1) takes the first
    `keep` tokens in token order; the others get an MoE output of exactly 0."""
    m = _forced_layer(k)
    x = np.random.default_rng(0).normal(size=(2, 8, D)).astype(np.float32)
    x[..., 0] = 1.0
    y, stats = m.apply(jnp.asarray(x))
    y = np.asarray(y).reshape(16, D)
    assert expert_capacity(16, 4, k, 1.0) == keep
    assert np.all(np.abs(y[:keep]).sum(-1) > 0)
    assert np.all(y[keep:] == 0.0)
    assert float(stats["drop_fraction"]) == pytest.approx((16 - keep) / 16)
    load = np.asarray(stats["expert_load"])
    assert load[2] == 16 and load[1] == (16 if k == 2 else 0)


def test_first_choices_take_slots_before_second_choices():
    """Capacity 1 per expert. Token 0 prefers experts (0, 1), token 1 prefers (1, 2): expert 1's slot
    goes to token 1's first choice, not to token 0's second choice, which drops (token order would
    keep token 0's second choice and drop token 1's first)."""
    from jaxpar.layers.moe import route

    logits = jnp.asarray([[10.0, 5.0, 0.0, 0.0], [0.0, 10.0, 5.0, 0.0]])
    r = route(logits, 2, 1)
    assert np.asarray(r.experts).tolist() == [[0, 1], [1, 2]]
    assert np.asarray(r.keep).tolist() == [[True, False], [True, True]]
    assert np.asarray(r.slot).tolist() == [[0, 4], [1, 2]]  # expert * C + position; E * C = dropped


def test_balance_loss_is_hf_mixtral_over_top_k_for_one_layer():
    """Hugging Face's load_balancing_loss_func (Mixtral), written out in numpy for one layer's router
    logits, equals top_k x this layer's aux_loss (the conversion the module docstring states)."""
    k = 2
    m = _layer(k=k, cf=4.0)
    x = np.random.default_rng(3).normal(size=(4, 8, D)).astype(np.float32)
    _, stats = m.apply(jnp.asarray(x))
    logits = x.reshape(-1, D).astype(np.float64) @ np.asarray(m.router[...], np.float64)
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    top = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    mask = np.eye(E)[top]                                   # [tokens, k, E]
    hf = E * np.sum(mask.mean(0) * probs.mean(0)[None, :])  # tokens_per_expert [k, E] x router_prob [E]
    np.testing.assert_allclose(k * float(stats["aux_loss"]), hf, rtol=1e-5)


def test_overflow_on_a_mesh_is_per_device_group():
    """data=2 x expert=2: each device's 4 tokens (one row) form a group with capacity 1 on expert 2,
    so exactly the first token of every row is kept."""
    m = _forced_layer(1)
    x = np.random.default_rng(0).normal(size=(4, 4, D)).astype(np.float32)
    x[..., 0] = 1.0
    ct = np.ones_like(x)
    y, stats, _ = _run_layer(m, jnp.asarray(x), jnp.asarray(ct), ["parallel.data=2", "parallel.expert=2"], 4)
    y = np.asarray(y)
    assert np.all(np.abs(y[:, 0]).sum(-1) > 0) and np.all(y[:, 1:] == 0.0)
    assert float(stats["drop_fraction"]) == pytest.approx(0.75)


# --- the MoE model on expert-parallel meshes equals one device ------------------------------------

MOE = dict(model__arch="moe", moe__n_experts=8, moe__top_k=2, moe__capacity_factor=4.0, moe__d_ff=64)
LAYOUTS = {
    "data2_expert4": ("gpt2", dict(parallel__data=2, parallel__expert=4)),
    # llama: DeepSeek-style options (a shared expert, sigmoid scores); under Megatron-SP the layer gathers the
    # sequence over tensor and reduce-scatters its output
    "expert2_tensor2_data2_shared_sigmoid": ("llama", dict(parallel__data=2, parallel__expert=2, parallel__tensor=2,
                                                           moe__shared_experts=1, moe__score="sigmoid")),
    "expert2_tensor4_sp_shared_sigmoid": ("llama", dict(parallel__expert=2, parallel__tensor=4,
                                                        parallel__megatron_sp=True, moe__shared_experts=1,
                                                        moe__score="sigmoid")),
    # Megatron-SP with the sequence split too: the residual stream is split over seq x tensor, seq-major, so
    # that an all-gather over tensor gives each seq shard its own positions (gpt2: the learned position table
    # is added in the embedding's reduce-scatter, which must agree with the attention's gather)
    "seq2_tensor2_data2_sp": ("gpt2", dict(parallel__data=2, parallel__seq=2, parallel__tensor=2,
                                           parallel__megatron_sp=True)),
    # dropless by sorting (a grouped matmul over the routed assignments), under Megatron-SP
    "sorted_data2_tensor4_sp": ("llama", dict(parallel__data=2, parallel__tensor=4, parallel__megatron_sp=True,
                                              moe__dropless=True, moe__dispatch="sorted")),
    # DeepSeek-V3's router: sigmoid scores, 4 groups of 2 experts of which the best 2 groups, scaled gates,
    # a correction bias (bias balancing on), dropless sorted dispatch over expert x data
    "group_limited_expert2_data2_sorted": ("llama", dict(parallel__data=2, parallel__expert=2, moe__score="sigmoid",
                                                         moe__n_group=4, moe__topk_group=2,
                                                         moe__routed_scaling_factor=2.5, moe__bias_update_rate=0.01,
                                                         moe__dropless=True, moe__dispatch="sorted")),
}
_REF = {}


def _loss_grads(cfg):
    r = first_step(cfg)
    return r["loss"], r["aux"], r["grads"], jax.device_get(r["state"]["params"])


def _one_device_moe():
    """``(loss, aux, grads, params)`` of the MoE model (``MOE``, gpt2) on one device at init, batch 0 (cached)."""
    key = ("gpt2", ())
    if key not in _REF:
        _REF[key] = _loss_grads(config("gpt2", **MOE))
    return _REF[key]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_model_matches_single_device(layout):
    """Capacity factor 4 = E/k: capacity = all tokens of a group, nothing drops, so grouping by
    device does not matter and the loss, router metrics and gradients equal the 1-device run."""
    style, over = LAYOUTS[layout]
    model = {k: v for k, v in over.items() if not k.startswith("parallel__")}  # the same model on one device
    key = (style, tuple(sorted(model.items())))
    if key not in _REF:  # (the same key as _one_device_moe's for data2_expert4)
        _REF[key] = _loss_grads(config(style, **MOE, **model))
    ref = _REF[key]
    got = _loss_grads(config(style, **MOE, **over))
    assert_trees_close(got[3], ref[3], 0.0, "initial params ")
    assert rel_err(got[0], ref[0]) <= 1e-5
    assert float(got[1]["moe_drop_fraction"]) == 0.0
    for key in ("ce_loss", "moe_aux_loss", "moe_z_loss", "moe_expert_load"):
        assert rel_err(got[1][key], ref[1][key]) <= 1e-5, key
    assert_trees_close(got[2], ref[2], 1e-5, "grads ")
    assert float(ref[0]) > float(ref[1]["ce_loss"])  # the router losses are part of the loss


def test_gradient_accumulation_adds_each_microsteps_router_losses():
    """train.grad_accum=2 on data=2, the router losses on: each microstep routes its own rows (k, k+K, ...: the
    rows every batch shard holds, so no data moves) and adds its router losses, averaged over the microsteps.
    The balance loss is a product of batch means, so the rows of each microstep matter: the loss, the MoE
    metrics and the gradients equal one device run on rows 0, 2, 4, ... and on rows 1, 3, 5, ... alone,
    averaged by hand (helpers.per_microbatch_reference)."""
    cfg = config("gpt2", **MOE, parallel__data=2, train__grad_accum=2)
    assert (cfg.moe.aux_loss_weight, cfg.moe.z_loss_weight) == (0.01, 0.001)
    ref = per_microbatch_reference("gpt2", 2, **MOE)
    got = first_step(cfg)
    check_moe_against_reference(cfg, got["loss"], got["aux"], got["grads"], ref, m=2)


def _cross_entropy(logits, targets, vocab: int) -> float:
    """Mean next-token cross-entropy of float logits ``[B, T, >= vocab]`` (padding columns cut), in float64."""
    z = np.asarray(logits, np.float64)[..., :vocab]
    lse = np.log(np.sum(np.exp(z - z.max(-1, keepdims=True)), -1)) + z.max(-1)
    return float(np.mean(lse - np.take_along_axis(z, np.asarray(targets)[..., None], -1)[..., 0]))


def test_moe_evaluation_is_one_device_cross_entropy_and_changes_no_state():
    """The validation loss of an MoE model on data=2 x expert=4 (experts split), router losses at their
    defaults and auxiliary-loss-free balancing on, after one training step (so the routing bias, a parameter no
    gradient moves, is nonzero and chooses the experts): :class:`~jaxpar.metrics.EvalHook` (train.py's
    validation, ``Trainer.eval_loss`` per batch) reports the mean cross-entropy of one device's logits for the same
    parameters, computed here in float64 (no router loss in it; capacity E/k: nothing drops). Evaluating leaves the
    parameters bit-identical and alive (not donated): evaluating twice gives the same value, and the next
    training step equals the one of a run that never evaluated."""
    from jaxpar.metrics import EvalHook

    model = dict(MOE, moe__bias_update_rate=0.01, train__warmup_steps=0)
    cfg = config("gpt2", **model, parallel__data=2, parallel__expert=4)
    assert (cfg.moe.aux_loss_weight, cfg.moe.z_loss_weight) == (0.01, 0.001)  # the defaults: on
    t = trainer(cfg)
    bs = batches(cfg, 4)  # batches 0, 1 train; 2, 3 validate
    state, _ = t.step(t.init_state(), t.place_batch(bs[0]))
    params = jax.device_get(state["params"])
    bias = params["blocks"]["moe"]["mlp"]["router_bias"]  # [MoE layers, E]: +-rate, 0 at exactly the mean load
    assert np.all(np.isin(bias, np.float32([-0.01, 0, 0.01]))) and np.count_nonzero(bias) > bias.size // 2
    hook = EvalHook(None, t, bs[2:], every=1)
    val = hook.evaluate(state["params"])
    assert hook.evaluate(state["params"]) == val
    assert_trees_close(jax.device_get(state["params"]), params, 0.0, "params after evaluation ")

    one = trainer(config("gpt2", **model))
    placed = jax.device_put(params, one.state_shardings["params"])
    ref = np.mean([_cross_entropy(one.logits(placed, jnp.asarray(b["inputs"])), b["targets"], cfg.model.vocab_size)
                   for b in bs[2:]])
    assert rel_err(val, ref) <= 1e-5, (val, ref)

    after_eval, _ = t.step(state, t.place_batch(bs[1]))
    plain, _ = t.step(t.step(t.init_state(), t.place_batch(bs[0]))[0], t.place_batch(bs[1]))
    assert_trees_close(jax.device_get(after_eval["params"]), jax.device_get(plain["params"]), 0.0, "next step ")


# --- the compiled step: all-to-alls over `expert` of the capacity formula's size ------------------

def test_all_to_all_bytes_match_capacity_formula_and_experts_are_split():
    cfg = config("gpt2", **dict(MOE, moe__capacity_factor=1.25, moe__every=2), model__n_layers=4,
                 parallel__data=2, parallel__expert=4)
    t = trainer(cfg)
    coll = t.compile()["collectives"]
    a2a = coll["all-to-all"]
    tokens = cfg.train.batch_size * cfg.model.seq_len // 8  # per device (one routing group)
    k, cf, d = cfg.moe.top_k, cfg.moe.capacity_factor, cfg.model.d_model
    per_direction = tokens * k * cf * d * F32
    moe_layers = cfg.model.n_layers // cfg.moe.every
    assert list(a2a["by_axes"]) == ["expert"], a2a
    # per MoE layer: dispatch + combine forward, and their transposes backward
    assert a2a["count"] == 4 * moe_layers, a2a
    assert abs(a2a["max_bytes"] / per_direction - 1) < 0.05, (a2a["max_bytes"], per_direction)
    assert abs(a2a["bytes"] / (4 * moe_layers * per_direction) - 1) < 0.05
    # the experts of each MoE layer are split over `expert`: 1/4 of their bytes per device
    params = t.abstract_state["params"]["blocks"]["moe"]["mlp"]
    for name in ("w_in", "w_out"):
        a = params[name]
        whole = math.prod(a.shape) * F32
        assert math.prod(a.sharding.shard_shape(a.shape)) * F32 * 4 == whole
    # dense layers use `expert` as data parallelism: an attention weight is replicated
    qkv = t.abstract_state["params"]["blocks"]["moe"]["attn"]["qkv"]["kernel"]
    assert qkv.sharding.shard_shape(qkv.shape) == qkv.shape


# --- metrics and configuration ---------------------------------------------------------------------

def test_run_writes_moe_metrics(tmp_path):
    from jaxpar.run import run

    cfg = config("gpt2", **MOE, parallel__data=2, parallel__expert=4, train__steps=2, train__log_every=1,
                 train__out_dir=str(tmp_path), sample__tokens=0)
    run(cfg, mesh=make_mesh(cfg.parallel, jax.devices()[:8]), log=lambda *_: None)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1]
    for r in recs:
        load = r["moe_expert_load"]
        assert isinstance(load, list) and len(load) == 8
        # every token makes k assignments in each MoE layer
        assert sum(load) == pytest.approx(cfg.train.batch_size * cfg.model.seq_len * cfg.moe.top_k)
        for key in ("moe_aux_loss", "moe_z_loss", "moe_drop_fraction", "ce_loss"):
            assert isinstance(r[key], float)
        assert 0.5 < r["moe_aux_loss"] < 2.0  # E sum_i f_i P_i: 1 when balanced
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    # step 0's record against one device at initialisation on batch 0 (the synthetic source's first): the loss
    # (cross-entropy + the default-weighted router losses), the router metrics, and grad_norm, the float64 norm of
    # one device's gradients (before clipping); lr by hand: warm-up from 0 over 1 step, then the peak
    ref = _one_device_moe()
    for key in ("loss", "ce_loss", "moe_aux_loss", "moe_z_loss", "moe_expert_load"):
        assert rel_err(recs[0][key], ref[0] if key == "loss" else ref[1][key]) <= 1e-5, key
    assert recs[0]["moe_drop_fraction"] == 0.0
    norm = np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(ref[2])))
    assert rel_err(recs[0]["grad_norm"], norm) <= 1e-5, (recs[0]["grad_norm"], norm)
    assert [r["lr"] for r in recs] == [0.0, pytest.approx(cfg.train.lr, rel=1e-6)]

    # its final checkpoint reads onto another expert layout: the same values, this layout's shardings
    from jaxpar.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "checkpoints")
    assert ck.steps() == [2]
    other = config("gpt2", **MOE, parallel__data=2, parallel__expert=2, parallel__tensor=2)
    t_a, t_b = trainer(cfg), trainer(other)
    a, _, _ = ck.restore(2, t_a.abstract_state)
    b, _, _ = ck.restore(2, t_b.abstract_state)
    ck.close()
    for x, y, want in zip(jax.tree.leaves(a), jax.tree.leaves(b), jax.tree.leaves(t_b.abstract_state)):
        assert y.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    w_in = lambda s: s["params"]["blocks"]["moe"]["mlp"]["w_in"].sharding.spec  # noqa: E731
    assert w_in(a) != w_in(b)  # experts over expert=4 there, over expert=2 (and mlp over tensor) here


@pytest.mark.parametrize("over, needle", [
    (["moe.n_experts=6", "parallel.expert=4"], "moe.n_experts=6 is not divisible by parallel.expert=4"),
    (["moe.n_experts=4", "moe.top_k=5"], "moe.top_k=5 must be between 1 and moe.n_experts=4"),
    (["moe.capacity_factor=0"], "moe.capacity_factor=0.0 is out of range: it must be > 0"),
    (["moe.capacity_factor=-1.5"], "moe.capacity_factor=-1.5 is out of range: it must be > 0"),
    (["moe.every=3"], "moe.every=3 must divide model.n_layers=4"),
    (["model.arch=dense"], "choose one of gpt, moe"),
    (["moe.dispatch=sorted"], "moe.dispatch=sorted is the dropless path (no capacity): set moe.dropless=true"),
    (["moe.bias_update_rate=-0.1"], "moe.bias_update_rate=-0.1 is out of range"),
    (["moe.dispatch=ragged"], "moe.dispatch='ragged' is not a valid choice; choose one of auto, capacity, sorted"),
])
def test_bad_moe_config(over, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.arch=moe", *over])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_moe_keys_are_ignored_for_gpt():
    load_config(None, ["model.arch=gpt", "moe.n_experts=6", "parallel.expert=4"])


def test_capacity_formula():
    assert expert_capacity(512, 8, 2, 1.25) == 160
    assert expert_capacity(10, 8, 2, 1.0) == 3           # ceil(2.5)
    assert expert_capacity(16, 8, 2, 100.0) == 16        # never more than the group
    assert expert_capacity(16, 8, 2, 0.01, dropless=True) == 16


def test_deepseek_style_config_trains_through_train_py(tmp_path):
    """configs/deepseek_moe.yaml (fine-grained experts, a shared expert, sigmoid scores, dropless sorted
    dispatch over expert, auxiliary-loss-free bias balancing) through
    `python train.py` on 8 simulated devices (data=2 x expert=2 x tensor=2): every token makes top_k
    assignments per MoE layer, the loss falls, and the shared expert's hidden units are split over tensor."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = command_env()
    over = ["data.source=synthetic", "model.seq_len=32", "train.batch_size=16", "train.steps=6", "train.log_every=1",
            "train.warmup_steps=1", "sample.tokens=0", "checkpoint.enabled=false", f"train.out_dir={tmp_path}",
            "debug.dump_hlo=true"]
    p = subprocess.run([sys.executable, str(root / "train.py"), "--config", str(root / "configs/deepseek_moe.yaml"),
                        *over], capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    cfg = load_config(root / "configs/deepseek_moe.yaml", over)
    recs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and recs[-1]["loss"] < recs[0]["loss"]
    assert cfg.moe.dispatch == "sorted" and cfg.moe.bias_update_rate > 0  # dropless, sorted, bias-balanced
    for r in recs:
        assert r["moe_load_max_min"] >= 1 and "moe_layer_load" not in r
        assert len(r["moe_expert_load"]) == 16
        assert sum(r["moe_expert_load"]) == pytest.approx(cfg.train.batch_size * cfg.model.seq_len * cfg.moe.top_k)
    hlo = (tmp_path / "train_step.hlo.txt").read_text()
    # the shared expert's fused up-projection [d_model, 2, 64] keeps half of its 64 hidden units per device
    assert "f32[128,2,32]" in hlo


@pytest.mark.parametrize("impl,platform", [("tiles", "cpu"), ("tiles", "gpu"), ("ragged_dot", None)])
def test_sorted_experts_equal_the_per_assignment_sum(impl, platform):
    """``sorted_experts`` against a float64 loop over every (token, choice), for skewed routing (one
    expert takes most assignments, one none), both grouped-matmul implementations (the tiles in the CPU's
    size, 1 row here, and the accelerators', 16 rows), with gradients."""
    from jaxpar.layers.moe import sorted_experts

    rng = np.random.default_rng(3)
    g, k, e, d, f = 40, 2, 6, 8, 12
    x = rng.normal(size=(g, d))
    experts = np.stack([rng.choice([0, 0, 0, 1, 2, 4, 5], g), rng.choice([1, 2, 3, 5], g)], 1)
    gates = rng.uniform(0.1, 1, size=(g, k))
    w_in, w_out = rng.normal(size=(e, d, 2, f)) / 3, rng.normal(size=(e, f, d)) / 3

    def ref(x, gates, w_in, w_out):
        out = []
        for t in range(g):
            y = 0
            for j in range(k):
                h = jnp.einsum("d,dhf->hf", x[t], w_in[experts[t, j]])
                y = y + gates[t, j] * ((h[0] / (1 + jnp.exp(-h[0])) * h[1]) @ w_out[experts[t, j]])
            out.append(y)
        return jnp.stack(out)

    def got(x, gates, w_in, w_out):
        return sorted_experts(x, jnp.asarray(experts), gates, w_in, w_out, "swiglu", impl, platform=platform)

    args32 = [jnp.asarray(a, jnp.float32) for a in (x, gates, w_in, w_out)]
    ct = rng.normal(size=(g, d))
    y = jax.jit(got)(*args32)
    gr = jax.jit(jax.grad(lambda *a: jnp.sum(got(*a) * ct), argnums=(0, 1, 2, 3)))(*args32)
    with jax.enable_x64(True):
        args64 = [jnp.asarray(a, jnp.float64) for a in (x, gates, w_in, w_out)]
        y_ref = ref(*args64)
        gr_ref = jax.grad(lambda *a: jnp.sum(ref(*a) * ct), argnums=(0, 1, 2, 3))(*args64)
    assert rel_err(y, y_ref) <= 1e-5
    for a, b in zip(gr, gr_ref):
        assert rel_err(a, b) <= 1e-5


def test_batched_tiles_equal_ragged_dot_with_up_biases():
    """The accelerators' tiles (108 assignments over 5 experts: tiles of 32 rows, (108 + 5 x 31) / 32 -> 9
    tiles in 2 loop steps of 8, the second with 7 tiles of zeros) with the up
    projections' biases and the clamped SwiGLU (GPT-OSS) equal XLA's dense expansion of ``ragged_dot``,
    output and gradients; so do the CPU's tiles (1 row, 1 per step)."""
    from jaxpar.layers.mlp import ClampedSwiGLU
    from jaxpar.layers.moe_dispatch import sorted_experts, tile_rows, tiles_per_step

    rng = np.random.default_rng(5)
    g, k, e, d, f = 36, 3, 5, 8, 6
    assert tile_rows(g * k, e, "gpu") == 32 and tiles_per_step(32, "gpu", d * 2 * f + f * d) == 8
    experts = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(g)]))
    x, gates = jnp.asarray(rng.normal(size=(g, d)), jnp.float32), jnp.asarray(rng.uniform(size=(g, k)), jnp.float32)
    w_in, w_out = (jnp.asarray(rng.normal(size=s) / 3, jnp.float32) for s in ((e, d, 2, f), (e, f, d)))
    b_in = jnp.asarray(rng.normal(size=(e, 2, f)), jnp.float32)
    ct = jnp.asarray(rng.normal(size=(g, d)), jnp.float32)

    def run(impl, platform):
        def loss(x, gates, w_in, w_out, b_in):
            y = sorted_experts(x, experts, gates, w_in, w_out, ClampedSwiGLU(), impl, b_in=b_in, platform=platform)
            return jnp.sum(y * ct), y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(x, gates, w_in, w_out, b_in)

    (_, y_ref), g_ref = run("ragged_dot", None)
    for platform in ("gpu", "cpu"):
        (_, y), grads = run("tiles", platform)
        assert rel_err(y, y_ref) <= 1e-5, platform
        for a, b in zip(grads, g_ref):
            assert rel_err(a, b) <= 1e-5, platform


def test_grouped_matmul_choice_and_tile_rows():
    """``moe.grouped_matmul=auto`` runs Mosaic's grouped GEMM (``ragged_dot``) on TPU only: XLA:GPU expands
    ``ragged_dot`` to every expert. Tiles: on CPU at most 1/8 padding; on an accelerator the mean rows per
    expert rounded up to a power of two, at most 256, and several tiles per loop step for small experts
    (hand values)."""
    from jaxpar.config import ConfigError, load_config
    from jaxpar.layers.moe_dispatch import grouped_matmul_impl, tile_rows, tiles_per_step

    assert [grouped_matmul_impl("auto", p) for p in ("cpu", "gpu", "tpu")] == ["tiles", "tiles", "ragged_dot"]
    assert grouped_matmul_impl("ragged_dot", "gpu") == "ragged_dot" and grouped_matmul_impl("tiles", "tpu") == "tiles"
    with pytest.raises(ValueError, match="grouped_matmul='dense'.*auto, tiles, ragged_dot"):
        grouped_matmul_impl("dense", "gpu")
    # CPU: A // (8 E), clamped to [1, 128]
    assert [tile_rows(a, e) for a, e in [(80, 6), (16384, 128), (65536, 8), (8192, 16)]] == [1, 16, 128, 64]
    # accelerators: ceil(A / E) up to a power of two, at most 256
    assert [tile_rows(a, e, "gpu") for a, e in [(80, 6), (16384, 128), (65536, 128), (1000, 16), (10**6, 8)]] == \
        [16, 128, 256, 64, 256]
    # tiles per loop step: 1 on CPU; on an accelerator up to 2048 rows, 8 tiles and 2^26 gathered weights
    qwen3, deepseek_v3 = 2048 * 2 * 768 + 768 * 2048, 7168 * 2 * 2048 + 2048 * 7168
    assert [tiles_per_step(256, "cpu", qwen3), tiles_per_step(256, "gpu", qwen3), tiles_per_step(512, "gpu", qwen3),
            tiles_per_step(16, "gpu", qwen3), tiles_per_step(256, "gpu", deepseek_v3),
            tiles_per_step(64, "gpu", 2**24)] == [1, 8, 4, 8, 1, 4]
    cfg = load_config(None, ["model.arch=moe", "moe.dropless=true", "moe.grouped_matmul=ragged_dot"])
    assert cfg.moe.grouped_matmul == "ragged_dot"
    with pytest.raises(ConfigError, match="moe.grouped_matmul=tiles has no effect with moe.dispatch=capacity"):
        load_config(None, ["model.arch=moe", "moe.grouped_matmul=tiles"])
    with pytest.raises(ConfigError, match="moe.grouped_matmul"):
        load_config(None, ["model.arch=moe", "moe.dropless=true", "moe.grouped_matmul=dense"])
    from flax import nnx

    from jaxpar.layers.moe import MoE
    with pytest.raises(ConfigError, match=r"MoE\(grouped_matmul='cublas'\).*moe.grouped_matmul"):
        MoE(8, 16, 4, 2, dropless=True, dispatch="sorted", grouped_matmul="cublas", rngs=nnx.Rngs(0))


def test_sorted_dispatch_computes_the_routed_tokens_only():
    """At E=64 experts, top-2, the compiled expert matmuls of moe.dispatch=sorted (forward) are within
    1.2x of top_k x tokens x FFN flops; the capacity path's dropless mode computes every expert on every
    token (E/k = 32x). Printed: both flop counts and the temp memory of both programs."""
    from jaxpar.hlo import matmul_flops

    g, d, f, e, k = 1024, 32, 64, 64, 2
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, g // 4, d)), jnp.float32)
    useful = k * g * 2 * d * f * 2  # up and down projections, 2 flops per multiply-add
    router = 2 * g * d * e
    out = {}
    for dispatch in ("sorted", "capacity"):
        m = MoE(d, f, e, k, dropless=True, dispatch=dispatch, rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        compiled = jax.jit(lambda s, x, g=graphdef: nnx.merge(g, s).apply(x)[0]).lower(state, x).compile()
        flops = matmul_flops(compiled.as_text()) - router
        out[dispatch] = (flops, compiled.memory_analysis().temp_size_in_bytes)
    print(f"expert flops: sorted {out['sorted'][0]:.3g} ({out['sorted'][0] / useful:.2f}x of k x tokens x FFN), "
          f"capacity-dropless {out['capacity'][0]:.3g} ({out['capacity'][0] / useful:.1f}x); temp bytes: sorted "
          f"{out['sorted'][1]:,}, capacity-dropless {out['capacity'][1]:,}")
    assert useful <= out["sorted"][0] <= 1.2 * useful
    assert out["capacity"][0] >= 0.9 * (e / k) * useful
    assert out["sorted"][1] * 8 < out["capacity"][1]


@pytest.mark.parametrize("tiling", ["cpu", "gpu"])
def test_expert_parallel_rounds_equal_one_device_under_skewed_routing(tiling, monkeypatch):
    """``exchanged_experts`` over expert=4 against ``sorted_experts`` on one device (itself checked against
    a float64 loop above), output and gradients, when 7/8 of the first choices go to the experts of one
    device: with rounds of the balanced share (chunk=1) that device's peers need several rounds. ``gpu``:
    the accelerators' tiles, 4 a loop step (a batched gather of the experts' weights inside shard_map)."""
    from jaxpar.layers import moe_dispatch

    if tiling == "gpu":
        rows = moe_dispatch.tile_rows
        monkeypatch.setattr(moe_dispatch, "tile_rows", lambda a, e, platform="cpu": rows(a, e, "gpu"))
        monkeypatch.setattr(moe_dispatch, "tiles_per_step", lambda m, platform, w: 4)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.layers.moe import exchanged_experts, sorted_experts

    ep, g, k, e, d, f = 4, 64, 2, 8, 16, 24
    rng = np.random.default_rng(3)
    first = np.where(rng.random(g) < 7 / 8, 0, rng.integers(0, e, g))
    second = (first + 1 + rng.integers(0, e - 1, g)) % e            # a different expert
    experts = np.stack([first, second], 1).astype(np.int32)
    args = [jnp.asarray(a, jnp.float32) for a in (rng.normal(size=(g, d)), rng.random((g, k)),
                                                   rng.normal(size=(e, d, 2, f)) * 0.3,
                                                   rng.normal(size=(e, f, d)) * 0.3)]
    ct = jnp.asarray(rng.normal(size=(g, d)), jnp.float32)
    chunk = 1.0
    c = math.ceil(chunk * g // ep * k / ep)
    to_device0 = [(experts[i * g // ep:(i + 1) * g // ep] < e // ep).sum() for i in range(ep)]
    assert max(math.ceil(n / c) for n in to_device0) >= 3  # the skew needs at least 3 rounds

    mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
    spec = P("expert")
    sharded = lambda a: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731

    def got(x, gates, w_in, w_out):
        fn = jax.shard_map(lambda x, ex, gt, wi, wo: exchanged_experts(x, ex, gt, wi, wo, "swiglu",
                                                                       axes=("expert",), ep=ep, chunk=chunk),
                           mesh=mesh, in_specs=(spec,) * 5, out_specs=spec, check_vma=True)
        return fn(x, sharded(jnp.asarray(experts)), gates, w_in, w_out)

    def ref(x, gates, w_in, w_out):
        return sorted_experts(x, jnp.asarray(experts), gates, w_in, w_out, "swiglu")

    loss = lambda fn: lambda *a: jnp.sum(fn(*a) * ct)  # noqa: E731
    y, gr = jax.jit(lambda *a: (got(*a), jax.grad(loss(got), argnums=(0, 1, 2, 3))(*a)))(*map(sharded, args))
    y_ref, gr_ref = jax.jit(lambda *a: (ref(*a), jax.grad(loss(ref), argnums=(0, 1, 2, 3))(*a)))(*args)
    assert rel_err(y, y_ref) <= 1e-5
    for a, b in zip(gr, gr_ref):
        assert rel_err(a, b) <= 1e-5


def test_expert_parallel_sorted_exchange_moves_the_routed_rows():
    """data=2 x expert=4, moe.dispatch=sorted: every all-to-all is over `expert`, and the largest (one
    round's rows, forward or back) is capacity_factor x k x tokens x d_model per device: the routed rows
    with the round's slack, not E x tokens slots as capacity-dropless would move."""
    cf = 1.25
    cfg = config("gpt2", **dict(MOE, moe__capacity_factor=cf, moe__every=2, moe__dropless=True,
                                moe__dispatch="sorted"), model__n_layers=4, parallel__data=2, parallel__expert=4)
    a2a = trainer(cfg).compile()["collectives"]["all-to-all"]
    tokens = cfg.train.batch_size * cfg.model.seq_len // 8  # per device
    routed = cfg.moe.top_k * tokens * cfg.model.d_model * F32
    capacity_dropless = cfg.moe.n_experts * tokens * cfg.model.d_model * F32
    print(f"largest all-to-all {a2a['max_bytes']:,} B = {a2a['max_bytes'] / routed:.3f} x k x tokens x d_model "
          f"(capacity-dropless: {capacity_dropless / routed:.0f}x)")
    assert list(a2a["by_axes"]) == ["expert"], a2a
    assert routed <= a2a["max_bytes"] <= cf * routed * 1.001


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_balancing_evens_out_a_skewed_router(score):
    """A router skewed towards experts 0 and 1 (max/min load ~16): 500 balancing steps of ``balance_bias``
    (DeepSeek-V3's sign rule, rate 0.002; no gradient step) on the same tokens bring max/min to ~1.1
    (mean of the last 50 steps < 1.3; the fixed-size steps leave a small oscillation)."""
    from jaxpar.layers import balance_bias

    m = MoE(D, F, E, 2, dropless=True, dispatch="sorted", score=score, bias_update_rate=0.002, rngs=nnx.Rngs(0))
    w = np.random.default_rng(1).normal(size=(D, E)) * 0.5
    w[0, 0], w[0, 1] = 2.0, 1.6
    m.router[...] = jnp.asarray(w, jnp.float32)
    x = np.random.default_rng(0).normal(size=(8, 32, D)).astype(np.float32)
    x[..., 0] = 1.0
    graphdef, state = nnx.split(m)
    load_of = jax.jit(lambda state, x: nnx.merge(graphdef, state).apply(x)[1]["expert_load"])
    ratio = lambda load: float(jnp.max(load) / jnp.maximum(jnp.min(load), 1))  # noqa: E731
    bias, ratios = m.router_bias[...], []
    for _ in range(500):
        state["router_bias"].set_value(bias)
        load = load_of(state, x)
        assert float(jnp.sum(load)) == 2 * 8 * 32  # dropless: every assignment is routed
        ratios.append(ratio(load))
        bias = balance_bias(bias, load, m.bias_update_rate)
    print(f"{score}: max/min expert load {ratios[0]:.1f} -> {np.mean(ratios[-50:]):.2f} (mean of the last 50 "
          f"steps); bias {np.round(bias, 3)}")
    assert ratios[0] > 10 and np.mean(ratios[-50:]) < 1.3 and max(ratios[-20:]) < 1.5


def test_trainer_moves_the_routing_bias_by_the_layer_loads():
    """Through the Trainer on data=2 x expert=2 x tensor=2: after one step each MoE layer's router_bias is
    rate * sign(mean load - load) of that layer's load in the batch (read from the loss's per-layer loads
    at the old parameters), exactly (its gradient is 0, so AdamW adds nothing); the metrics carry
    moe_load_max_min, not the per-layer loads."""
    rate = 0.01
    cfg = config("llama", **MOE, model__n_layers=2, moe__bias_update_rate=rate, moe__dropless=True,
                 moe__dispatch="sorted", parallel__data=2, parallel__expert=2, parallel__tensor=2)
    t = trainer(cfg)
    state = t.init_state()
    batch = t.place_batch(batches(cfg, 1)[0])
    _, aux = jax.jit(t.loss_fn)(state["params"], batch)
    load = np.asarray(aux["moe_layer_load"])                         # [MoE layers, E]
    new, metrics = t.step(state, batch)
    bias = np.asarray(new["params"]["blocks"]["moe"]["mlp"]["router_bias"])
    assert load.shape == (2, 8) and load.sum() == 2 * cfg.train.batch_size * cfg.model.seq_len * 2
    assert np.any(load != load.mean(1, keepdims=True))  # not balanced: the bias moves
    np.testing.assert_array_equal(bias, rate * np.sign(load.mean(1, keepdims=True) - load).astype(np.float32))
    assert "moe_layer_load" not in metrics
    ratio = np.mean(load.max(1) / np.maximum(load.min(1), 1))
    assert float(metrics["moe_load_max_min"]) == pytest.approx(ratio, rel=1e-6)


def test_auto_dispatch_is_sorted_when_dropless():
    """moe.dispatch=auto runs the sorted (grouped matmul) dispatch when dropless, the capacity one otherwise."""
    assert load_config(None, ["model.arch=moe", "moe.dispatch=auto", "moe.dropless=true"]).moe.dispatch_path() == "sorted"
    assert load_config(None, ["model.arch=moe", "moe.dispatch=auto"]).moe.dispatch_path() == "capacity"
    assert load_config(None, ["model.arch=moe", "moe.dropless=true"]).moe.dispatch_path() == "sorted"  # the default


@pytest.mark.parametrize("norm", [True, False])
def test_group_limited_routing_equals_transformers_deepseek_v3(norm):
    """Group-limited routing (moe.n_group, moe.topk_group), sigmoid scores, the correction bias choosing
    experts but not weighting them, renormalisation and moe.routed_scaling_factor: the experts each token
    chooses and their weights equal transformers' DeepseekV3TopkRouter on the same inputs."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    from jaxpar.layers.moe import route

    e, k, groups, top_groups, d, g = 16, 4, 4, 2, 24, 64
    hf = transformers.DeepseekV3Config(hidden_size=d, n_routed_experts=e, num_experts_per_tok=k, n_group=groups,
                                       topk_group=top_groups, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = ds.DeepseekV3TopkRouter(hf)
    rng = np.random.default_rng(0)
    with torch.no_grad():
        router.weight.copy_(torch.as_tensor(rng.normal(size=(e, d)), dtype=torch.float32))
        router.e_score_correction_bias.copy_(torch.as_tensor(rng.normal(scale=0.3, size=e), dtype=torch.float32))
    x = rng.normal(size=(g, d)).astype(np.float32)
    with torch.no_grad():
        _, weights, indices = router(torch.as_tensor(x))
    logits = jnp.asarray(x) @ jnp.asarray(router.weight.detach().numpy()).T
    r = route(logits, k, g, norm, "sigmoid", jnp.asarray(router.e_score_correction_bias.numpy()), groups, top_groups,
              2.5)
    want_idx, want_w = indices.numpy(), weights.numpy()
    got_idx, got_w = np.asarray(r.experts), np.asarray(r.gates)
    for t in range(g):  # transformers' top-k is unsorted: compare as expert -> weight maps
        want = dict(zip(want_idx[t].tolist(), want_w[t].tolist()))
        got = dict(zip(got_idx[t].tolist(), got_w[t].tolist()))
        assert set(got) == set(want), (t, got, want)
        np.testing.assert_allclose([got[i] for i in want], list(want.values()), rtol=1e-6)
    # the groups matter here: plain top-k of the biased scores would choose differently for some tokens
    plain = route(logits, k, g, norm, "sigmoid", jnp.asarray(router.e_score_correction_bias.numpy()))
    assert any(set(np.asarray(plain.experts)[t]) != set(got_idx[t]) for t in range(g))


@pytest.mark.parametrize("over, needle", [
    (["moe.n_experts=8", "moe.n_group=3"], "moe.n_group=3 must divide moe.n_experts=8"),
    (["moe.n_experts=8", "moe.n_group=8"], "moe.n_group=8: each group needs at least 2 experts"),
    (["moe.n_experts=8", "moe.n_group=2", "moe.topk_group=3"], "moe.topk_group=3 must be between 1 and moe.n_group=2"),
    (["moe.n_experts=8", "moe.n_group=4", "moe.topk_group=1", "moe.top_k=3"],
     "moe.top_k=3 is more than the 2 experts of the moe.topk_group=1 groups"),
])
def test_bad_group_routing(over, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(None, ["model.arch=moe", *over])


@pytest.mark.slow
@pytest.mark.parametrize("dispatch,layout", [("capacity", dict(data=2, tensor=2)),
                                             ("sorted", dict(expert=2, tensor=2, zero=1)),
                                             ("capacity", dict(seq=2, tensor=2, pipe=2, megatron_sp=True))])
def test_bfloat16_moe_under_tensor_parallelism_trains_on_cpu(dispatch, layout):
    """With ``model.compute_dtype=bfloat16`` and ``tensor`` > 1, the MoE layer's sums of activations over
    ``tensor`` (the row-parallel output's psum, the dispatched tokens' and the gates' gradient sums, Megatron-SP's
    reduce-scatter) run in float32 on XLA:CPU: its all-reduce promotion aborted the process compiling them in
    bfloat16 ("Invalid binary instruction opcode copy"), so a bfloat16 MoE run with tensor parallelism could not
    start on CPU. The MoE layers add no bfloat16 all-reduce or reduce-scatter to the lowered step beyond the dense
    model's (which XLA:CPU compiles), and a fresh process (XLA's
    default passes, no jaxpar.compile flags) runs two train steps to a finite loss equal, to bfloat16's
    precision, to the same model's in float32 compute."""
    over = {f"parallel__{k}": v for k, v in layout.items()}
    kw = dict(model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__d_ff=64, moe__dispatch=dispatch,
              moe__dropless=dispatch == "sorted", **over)
    n = math.prod(v for k, v in layout.items() if k in ("data", "tensor", "expert", "seq", "pipe"))

    def narrow_sums(**over):  # the bfloat16 all-reduces and reduce-scatters of the lowered step
        t = trainer(config("llama", model__compute_dtype="bfloat16", **{**kw, **over}), n)
        text = t.lower().as_text(dialect="hlo")
        return sorted(re.findall(r"= bf16\[[\d,]*\][^ ]* (?:all-reduce|reduce-scatter)\(", text))

    # the MoE layers add none to the dense model's (the expert axis as data; its embedding's, its MLPs' sums,
    # which XLA:CPU compiles outside a partly-manual shard_map)
    dense = dict(model__arch="gpt", parallel__expert=1,
                 parallel__data=layout.get("data", 1) * layout.get("expert", 1))
    assert not Counter(narrow_sums()) - Counter(narrow_sums(**dense))
    script = f"""
import math
from helpers import batches, config, trainer
kw = {kw!r}
losses = []
for dt in ("bfloat16", "float32"):
    cfg = config("llama", model__compute_dtype=dt, **kw)
    t = trainer(cfg)
    state = t.init_state()
    for b in batches(cfg, 2):
        state, m = t.step(state, t.place_batch(b))
    losses.append(float(m["loss"]))  # the second step's: after an update computed from the first's gradients
bf16, f32 = losses
assert math.isfinite(bf16) and abs(bf16 - f32) < 0.02 * abs(f32), losses
print("done", losses)
"""
    run_script(script, n, "done", timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("dispatch,layout", [("capacity", dict(data=2)), ("capacity", dict(data=2, seq=2)),
                                             ("sorted", dict(data=2, expert=2))])
def test_bfloat16_expert_gradients_are_summed_in_float32(dispatch, layout):
    """Under ``model.compute_dtype=bfloat16`` the experts' weights enter the layer's ``shard_map`` in float32 and
    are cast after they are made varying over the token axes: the sum of their gradient over those axes (the
    cast's transpose) runs in float32. (It ran in bfloat16, losing the gradient's low bits, and XLA:CPU
    aborted compiling it: "Invalid binary instruction opcode copy".) No bfloat16 all-reduce in the lowered
    step has an expert weight's shape (3 experts: no activation has a dimension of 3), and the step compiles."""
    over = {f"parallel__{k}": v for k, v in layout.items()}
    cfg = config("llama", model__arch="moe", moe__n_experts=3 if dispatch == "capacity" else 4, moe__top_k=2,
                 moe__d_ff=64, moe__dispatch=dispatch, moe__dropless=dispatch == "sorted",
                 model__compute_dtype="bfloat16", parallel__zero=1, **over)
    t = trainer(cfg, math.prod(layout.values()))
    e = cfg.moe.n_experts // layout.get("expert", 1)
    text = t.lower().as_text(dialect="hlo")
    reduced = [m.group(1) for m in re.finditer(r"= bf16\[([\d,]*)\][^ ]* all-reduce\(", text)]
    assert not any(s.startswith(f"{e},") for s in reduced), reduced
    assert t.compile()["memory"]["temp_size"] > 0
