"""Plain-JAX baseline of jaxpar's GPT training step (the benchmark reference).

One page of hand-written JAX doing the same math as ``models/gpt.py`` + ``jaxpar/optim.py`` on one
device, with no Flax and no jaxpar code in the step: a throughput benchmark reports
"jaxpar step time / plain-JAX step time" against it. ``tests/test_plain_jax.py`` checks that its
loss, gradients and AdamW steps equal jaxpar's.

    b = build(model_cfg, train_cfg, compute_dtype=jnp.bfloat16, attention="cudnn", remat="none")
    params = b.init(jax.random.key(0)); opt_state = b.opt.init(params)
    params, opt_state, loss = b.step(params, opt_state, {"inputs": x, "targets": y})

Parameters (float32, layers stacked on a leading dim ``L``; ``Vp`` the padded vocabulary)::

    wte [Vp, D]   wpe [seq_len, D] (learned positions)   head [D, Vp] (untied)   lnf {scale, bias?}
    layers: ln1, ln2 {scale [L, D], bias [L, D]?}
            wqkv [L, D, (H + 2 KV) * hd]   (all Q heads, then K, then V; Q head n uses KV head n // (H / KV))
            bq [L, H, hd]?  bv [L, KV, hd]?  (no key bias, as jaxpar)   wo [L, H * hd, D]  bo [L, D]?
            w_up [L, D, F] (gelu) or [L, D, 2F] (swiglu: gate, then up)   b_up?   w_down [L, F, D]  b_down [L, D]?
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

F32 = jnp.float32
MATRICES = ("wte", "wpe", "head", "wqkv", "wo", "w_up", "w_down")
POLICIES = {"full": jax.checkpoint_policies.nothing_saveable,
            "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Baseline(NamedTuple):
    init: Callable[[jax.Array], dict]  # key -> params (float32)
    loss: Callable[[dict, dict], jax.Array]  # (params, batch) -> mean cross-entropy
    opt: optax.GradientTransformation
    step: Callable[[dict, Any, dict], tuple]  # jitted, params/opt_state donated -> (params, opt_state, loss)


def _dims(c):
    from jaxpar.layers.embedding import padded_vocab

    vp = padded_vocab(c.vocab_size, c.vocab_multiple)
    return c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, vp


def build(model_cfg, train_cfg, *, compute_dtype=F32, attention: str = "xla", remat: str = "none") -> Baseline:
    c, t, dt = model_cfg.resolved(), train_cfg, compute_dtype
    L, D, H, KV, hd, F, Vp = _dims(c)
    V, swiglu, bias = c.vocab_size, c.mlp == "swiglu", c.bias
    impl = {"xla": None, "cudnn": "cudnn"}[attention]

    def init(key):
        keys = iter(jax.random.split(key, 8))
        normal = lambda shape, std=c.init_std: std * jax.random.normal(next(keys), shape, F32)  # noqa: E731
        out_std = c.init_std / (2 * L) ** 0.5  # residual projections (GPT-2)
        ln_bias = bias and c.norm == "layernorm"
        norm = lambda *s: {"scale": jnp.ones((*s, D)), **({"bias": jnp.zeros((*s, D))} if ln_bias else {})}  # noqa: E731
        layers = {"ln1": norm(L), "ln2": norm(L), "wqkv": normal((L, D, (H + 2 * KV) * hd)),
                  "wo": normal((L, H * hd, D), out_std), "w_up": normal((L, D, 2 * F if swiglu else F)),
                  "w_down": normal((L, F, D), out_std)}
        if bias:
            layers.update(bq=jnp.zeros((L, H, hd)), bv=jnp.zeros((L, KV, hd)), bo=jnp.zeros((L, D)),
                          b_up=jnp.zeros((L, 2 * F if swiglu else F)), b_down=jnp.zeros((L, D)))
        p = {"wte": jnp.pad(normal((V, D)), ((0, Vp - V), (0, 0))), "lnf": norm(), "layers": layers}
        if c.positions == "learned":
            p["wpe"] = normal((c.seq_len, D), 0.01)
        if not c.tie_embeddings:
            p["head"] = jnp.pad(normal((D, V)), ((0, 0), (0, Vp - V)))
        return p

    def norm(p, x):  # float32 LayerNorm / RMSNorm, result in the activation dtype
        xf = x.astype(F32)
        if c.norm == "layernorm":
            xf = xf - jnp.mean(xf, axis=-1, keepdims=True)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + c.norm_eps) * p["scale"]
        return (y + p["bias"] if "bias" in p else y).astype(x.dtype)

    def rope(x, pos):  # rotate-half, in float32
        ang = pos[:, None].astype(F32) / (c.rope_theta ** (jnp.arange(0, hd, 2, dtype=F32) / hd))
        cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
        x1, x2 = jnp.split(x.astype(F32), 2, axis=-1)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)

    def linear(x, p, w, b=None):
        y = x @ p[w].astype(dt)
        return y + p[b].astype(dt) if bias and b else y

    def block(x, p):
        b, s, _ = x.shape
        qkv = linear(norm(p["ln1"], x), p, "wqkv").reshape(b, s, H + 2 * KV, hd)
        q, k, v = qkv[:, :, :H], qkv[:, :, H:H + KV], qkv[:, :, H + KV:]
        if bias:
            q, v = q + p["bq"].astype(dt), v + p["bv"].astype(dt)
        if c.positions == "rope":
            q, k = rope(q, jnp.arange(s)), rope(k, jnp.arange(s))
        a = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
        x = x + linear(a.reshape(b, s, H * hd), p, "wo", "bo")
        h = linear(norm(p["ln2"], x), p, "w_up", "b_up")
        if swiglu:
            gate, up = jnp.split(h, 2, axis=-1)
            h = jax.nn.silu(gate) * up
        else:
            h = jax.nn.gelu(h, approximate=True)
        return x + linear(h, p, "w_down", "b_down"), None

    body = block if remat == "none" else jax.checkpoint(block, policy=POLICIES[remat], prevent_cse=False)

    def loss(params, batch):
        tokens, targets = batch["inputs"], batch["targets"]
        x = params["wte"][tokens].astype(dt)
        if c.positions == "learned":
            x = x + params["wpe"][: tokens.shape[1]].astype(dt)
        x, _ = jax.lax.scan(body, x, params["layers"])
        x = norm(params["lnf"], x)
        logits = (x @ (params["wte"].T if c.tie_embeddings else params["head"]).astype(dt)).astype(F32)
        logits = jnp.where(jnp.arange(Vp) < V, logits, -1e30)  # padded vocabulary columns
        target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - target)

    # AdamW + warm-up/cosine + global-norm clipping, as jaxpar.optim.make_optimizer. Weight decay on
    # the weight matrices only: not norms or biases.
    warm = min(t.warmup_steps, max(t.steps - 1, 0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, t.lr, warm, max(t.steps, warm + 1), t.lr * t.min_lr_ratio)
    mask = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key in MATRICES, p)  # noqa: E731
    opt = optax.chain(*([optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []),
                      optax.adamw(schedule, b1=t.beta1, b2=t.beta2, eps=t.eps, weight_decay=t.weight_decay, mask=mask))

    @partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return Baseline(init, loss, opt, step)


def params_from_jaxpar(jp: dict, model_cfg) -> dict:
    """jaxpar's parameter dict (``Trainer`` state["params"], layer order) -> this layout. Linear (only
    slices, reshapes and concatenations), so it converts gradients and Adam moments too."""
    c = model_cfg.resolved()
    L, D, H, KV, hd, F, Vp = _dims(c)
    blk, g = jp["blocks"], H // KV
    qkv = blk["attn"]["qkv"]["kernel"]  # [L, D, KV, g + 2, hd]: per KV head its g query heads, key, value
    parts = [qkv[..., :g, :], qkv[..., g, :], qkv[..., g + 1, :]]
    layers = {"ln1": dict(blk["norm1"]), "ln2": dict(blk["norm2"]),
              "wqkv": jnp.concatenate([x.reshape(L, D, -1) for x in parts], axis=-1),
              "wo": blk["attn"]["o"]["kernel"].reshape(L, H * hd, D),
              "w_up": blk["mlp"]["up"]["kernel"].reshape(L, D, -1),  # swiglu [L, D, 2, F] -> [L, D, 2F]
              "w_down": blk["mlp"]["down"]["kernel"]}
    if c.bias:
        layers.update(bq=blk["attn"]["q_bias"], bv=blk["attn"]["v_bias"], bo=blk["attn"]["o"]["bias"],
                      b_up=blk["mlp"]["up"]["bias"].reshape(L, -1), b_down=blk["mlp"]["down"]["bias"])
    p = {"wte": jp["embed"]["embedding"], "lnf": dict(jp["norm_f"]), "layers": layers}
    if c.positions == "learned":
        p["wpe"] = jp["pos_embed"]
    if not c.tie_embeddings:
        p["head"] = jp["head"]["kernel"]
    return jax.tree.map(jnp.asarray, p)
