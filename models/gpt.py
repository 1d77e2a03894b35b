"""A decoder-only GPT in Flax NNX, written once against logical axis names.

    x = embed(tokens) (+ learned positions)
    for each of n_layers blocks (a jaxpar.layers.Stack: stacked weights, a scan or the pipeline):
        x = x + attn(norm1(x))          # RoPE inside attention when positions == "rope"
        x = x + mlp(norm2(x))
    logits = head(norm_f(x))            # tied: embed.attend(x)

``style=gpt2``: learned positions, LayerNorm, GELU, tied embeddings, biases.
``style=llama``: RoPE, RMSNorm, SwiGLU, GQA (n_kv_heads), untied head, no biases.
Residual projections are initialised with std ``init_std / sqrt(2 n_layers)`` (GPT-2).

The families of today are switches of this one block, never branches on a family's name (see
:class:`jaxpar.config.ModelConfig`): Q/K/V biases (Qwen2.5), QK-norm (Qwen3, Gemma 3), RoPE scaling
(Llama 3.1 ``llama3``, ``linear``), sliding windows (Mistral), and Gemma 3's sandwich norms
(``x + norm(f(norm(x)))``), ``(1 + w)`` RMSNorm, GeGLU, embeddings scaled by sqrt(d_model), its
attention scale, DeepSeek's Multi-head Latent Attention (``model.kv_lora_rank``:
:class:`~jaxpar.layers.latent_attention.LatentAttention` in place of ``Attention``), and local
(sliding-window, own RoPE base) layers interleaved with global ones: the
window is a per-layer value scanned with the weights (:class:`~jaxpar.layers.stack.Stack`'s
``per_layer``), so such a stack is still one scan.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.layers import (MLP, Attention, ColumnParallelLinear, LatentAttention, VocabParallelEmbed, make_norm,
                           padded_init)
from jaxpar.layers.attention_ops import rope_frequencies
from jaxpar.layers.context_parallel import zigzag_order
from jaxpar.layers.embedding import vocab_logits
from jaxpar.layers.loss import DOC_KEYS, head_cross_entropy
from jaxpar.layers.mlp import ClampedSwiGLU
from jaxpar.layers.stack import Stack, loss_in_pipeline
from jaxpar.layers.precision import DTYPES, compute_dtype
from jaxpar.partitioning import active_rules, constrain, constrain_weight, param



def activation(cfg: ModelConfig):
    """The MLP's and experts' nonlinearity as :func:`jaxpar.layers.mlp.activate` takes it: the ``model.mlp``
    name, or for the clamped SwiGLU its limit and slope (:class:`jaxpar.layers.mlp.ClampedSwiGLU`)."""
    if cfg.mlp == "clamped_swiglu":
        return ClampedSwiGLU(cfg.swiglu_limit, cfg.swiglu_alpha)
    return cfg.mlp


def rope_freqs(cfg: ModelConfig) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """RoPE's inverse frequencies of the global layers (scaled by ``model.rope_scaling``) and of the
    sliding-window layers when they have their own base (``model.rope_local_theta``; else None)."""
    if cfg.positions != "rope":
        return None, None
    glob = rope_frequencies(cfg.rope_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor,
                            cfg.rope_high_freq_factor, cfg.rope_original_context, cfg.rope_beta_fast,
                            cfg.rope_beta_slow, cfg.rope_truncate)
    return glob, rope_frequencies(cfg.rope_dim, cfg.rope_local_theta) if cfg.rope_local_theta else None


class Block(nnx.Module):
    """Pre-norm transformer block: attention and MLP with residuals; ``norm_placement=sandwich`` adds a
    norm on each branch's output (``x + norm(f(norm(x)))``).

    ``ffn(rngs)`` may build another feed-forward module in place of the MLP (e.g. a MoE layer).
    ``window``: the layer's sliding window when the layers differ (a per-layer value of the stack).
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, ffn=None, tensor: int = 1):
        pd = DTYPES[cfg.param_dtype]
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        norm = dict(eps=cfg.norm_eps, use_bias=cfg.bias, param_dtype=pd, plus_one=cfg.norm_plus_one)
        sandwich = cfg.norm_placement == "sandwich"
        glob, local = rope_freqs(cfg)
        self.norm1 = make_norm(cfg.norm, cfg.d_model, **norm)
        window = 0 if cfg.global_every else cfg.sliding_window
        rope_scale = cfg.yarn_attention_factor() if cfg.rope_scaling == "yarn" else 1.0
        self.attn: Attention | LatentAttention
        if cfg.latent:
            assert glob is not None  # (validated: MLA needs RoPE)
            self.attn = LatentAttention(cfg.d_model, cfg.n_heads, cfg.head_dim, rope_dim=cfg.rope_head_dim,
                                        v_head_dim=cfg.v_head_dim, q_rank=cfg.q_lora_rank, kv_rank=cfg.kv_lora_rank,
                                        rope_freqs=glob, rope_scale=rope_scale, scale=cfg.attn_scale or None,
                                        window=window, init_std=cfg.init_std,
                                        out_init_std=out_std, kernel=cfg.attention, use_bias=cfg.bias, dtype=dtype,
                                        param_dtype=pd, rngs=rngs)
        else:
            self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, use_bias=cfg.bias,
                                  qkv_bias=cfg.qkv_bias, rope_freqs=glob, rope_local_freqs=local, qk_norm=cfg.qk_norm,
                                  norm_eps=cfg.norm_eps, norm_plus_one=cfg.norm_plus_one,
                                  scale=cfg.attn_scale or None, window=window, rope_scale=rope_scale,
                                  init_std=cfg.init_std, out_init_std=out_std, kernel=cfg.attention, tensor=tensor,
                                  sinks=cfg.attn_sinks, dtype=dtype, param_dtype=pd, rngs=rngs)
        self.post_norm1 = make_norm(cfg.norm, cfg.d_model, **norm) if sandwich else None
        self.norm2 = make_norm(cfg.norm, cfg.d_model, **norm)
        self.mlp = (ffn(rngs) if ffn is not None else
                    MLP(cfg.d_model, cfg.d_ff, kind=activation(cfg), use_bias=cfg.bias, init_std=cfg.init_std,
                        out_init_std=out_std, dtype=dtype, param_dtype=pd, rngs=rngs))
        self.post_norm2 = make_norm(cfg.norm, cfg.d_model, **norm) if sandwich else None

    def attn_residual(self, x: jax.Array, attend) -> jax.Array:
        """``x + attend(norm1(x))`` (normed again with sandwich norms); ``attend`` is the attention call
        (training's, or generation's with a cache)."""
        h = attend(self.norm1(x))
        return x + (h if self.post_norm1 is None else self.post_norm1(h))

    def mlp_residual(self, x: jax.Array) -> tuple[jax.Array, dict | None]:
        """``(x + mlp(norm2(x)), stats)``: ``stats`` a MoE layer's router statistics (None for an MLP)."""
        y = self.mlp(self.norm2(x))
        y, stats = y if isinstance(y, tuple) else (y, None)
        return x + (y if self.post_norm2 is None else self.post_norm2(y)), stats

    def __call__(self, x: jax.Array, positions: jax.Array | None, window=None, **docs) -> jax.Array:
        """``docs``: packed documents' ``segment_ids`` and ``doc_positions`` (:class:`~jaxpar.layers.Attention`)."""
        x = self.attn_residual(x, lambda h: self.attn(h, positions, window, **docs))
        x, _ = self.mlp_residual(x)
        return constrain(x, ("batch", "res_length", "act_embed"))


class GPT(nnx.Module):
    """Decoder-only transformer; ``tensor`` is only used to pad the vocabulary evenly."""

    def __init__(self, cfg: ModelConfig, *, tensor: int = 1, rngs: nnx.Rngs):
        cfg = cfg.resolved()
        self.cfg = cfg
        dtype, pd = compute_dtype(cfg.compute_dtype), DTYPES[cfg.param_dtype]
        self.dtype = dtype
        self.embed = VocabParallelEmbed(cfg.vocab_size, cfg.d_model, vocab_multiple=cfg.vocab_multiple, tensor=tensor,
                                        init_std=cfg.init_std, dtype=dtype, param_dtype=pd, rngs=rngs)
        self.pos_embed = (param(nnx.initializers.normal(0.01)(rngs.params(), (cfg.max_positions, cfg.d_model), pd),
                                ("positions", "embed"))
                          if cfg.positions == "learned" else None)
        self.tensor = tensor
        self.blocks = self.make_blocks(cfg, dtype, rngs)
        self.norm_f = make_norm(cfg.norm, cfg.d_model, eps=cfg.norm_eps, use_bias=cfg.bias, param_dtype=pd,
                                plus_one=cfg.norm_plus_one)
        vp = self.embed.padded_size
        self.head = (None if cfg.tie_embeddings else
                     ColumnParallelLinear(cfg.d_model, vp, out_axes=("vocab",),
                                          act_axes=("batch", "length", "act_vocab"),
                                          use_bias=False, dtype=dtype, param_dtype=pd, rngs=rngs,
                                          kernel_init=padded_init(nnx.initializers.normal(cfg.init_std),
                                                                  cfg.vocab_size, axis=1)))

    def make_blocks(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
        """The stacked layers between embedding and head (a subclass may build others, e.g. MoE)."""
        return Stack.create(lambda r: Block(cfg, dtype=dtype, rngs=r, tensor=self.tensor), cfg.n_layers, rngs)

    def apply_blocks(self, x: jax.Array, positions: jax.Array | None, **docs) -> jax.Array:
        """Run :meth:`make_blocks`' layers on the residual stream ``x [B, T, d_model]`` (``docs``: packed
        documents' ``segment_ids`` and ``doc_positions``, each ``[B, T]``, passed to every layer)."""
        return Stack(self.blocks, remat=self.cfg.remat, per_layer=self.per_layer(), rows=docs)(x, positions)

    def per_layer(self) -> dict | None:
        """The values in which the layers differ, one per layer (``Stack``'s ``per_layer``): each layer's
        sliding window when ``model.global_every`` interleaves local and global layers; else None."""
        if not self.cfg.global_every:
            return None
        return {"window": np.asarray(self.cfg.layer_windows(), np.float32)}

    def outer(self) -> dict:
        """The modules around the layer stack: embedding, positions, final norm and head."""
        return {"embed": self.embed, "pos_embed": self.pos_embed, "norm_f": self.norm_f, "head": self.head}

    def has_lead_in(self) -> bool:
        """Whether :meth:`lead_in` runs layers (then a pipeline runs them per microbatch on its first stage)."""
        return False

    def lead_in(self, outer: dict, x: jax.Array, positions: jax.Array | None, **docs) -> jax.Array:
        """Layers run with the embedding, before the stack (under a pipeline: on the first stage; ``outer``
        holds their weights); none here (a MoE decoder's dense first layers)."""
        return x

    def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, *, segment_ids: jax.Array | None = None,
               doc_positions: jax.Array | None = None) -> jax.Array:
        """The final-normed residual stream ``[B, T, d_model]`` of ``tokens`` at global ``positions [T]``
        (None: ``0..T-1`` in order; otherwise any order, e.g. zig-zag). Packed documents: ``segment_ids``
        and ``doc_positions`` ``[B, T]`` (in the order of ``tokens``): attention stays in each document
        and position encodings restart with each."""
        x = embed_tokens(self.outer(), self.cfg, self.dtype, tokens, positions if doc_positions is None else
                         doc_positions)
        docs = {} if segment_ids is None else {"segment_ids": segment_ids, "doc_positions": doc_positions}
        return self.norm_f(self.apply_blocks(x, positions, **docs))

    def output_weight(self) -> tuple[jax.Array, str]:
        """The head's weight in its compute layout and its einsum layout (``vd`` tied, ``dv`` untied)."""
        return output_weight(self.outer())

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """``tokens [B, T]`` -> float32 logits ``[B, T, vocab_padded]`` (pad columns are garbage; use :meth:`loss`)."""
        order = sequence_order(tokens.shape[1])
        x = self.hidden(tokens) if order is None else self.hidden(tokens[:, order], jnp.asarray(order))
        logits = vocab_logits(x, *self.output_weight(), self.dtype)
        return logits if order is None else logits[:, np.argsort(order)]

    def loss(self, tokens: jax.Array, targets: jax.Array, **docs) -> tuple[jax.Array, dict]:
        """Mean next-token cross-entropy (float32) and a dict of auxiliary metrics.

        The head and the loss run fused over chunks of at most ``model.loss_chunk_tokens`` tokens per
        device (:func:`~jaxpar.layers.loss.head_cross_entropy`), so the float32 logits of the whole
        batch never exist. Under zig-zag ring attention the tokens and targets are permuted together
        (the mean does not depend on the order), so nothing is put back in order. With ``pipe > 1`` the
        layer stack, the embedding and the loss run in the pipeline (:meth:`pipelined_loss`).

        Packed documents (``data.packing=documents``; keywords, each ``[B, T]``, see :func:`batch_docs`):
        ``segment_ids``, ``positions`` (each token's position in its document) and ``weights`` (0: not
        trained); the loss is then ``sum(weights * ce) / loss_denominator`` (default ``sum(weights)`` of
        this batch: the weighted mean; a trainer splitting a batch into microsteps passes the whole
        batch's trained tokens per microstep).
        """
        tokens, targets, positions, docs = ordered(tokens, targets, docs)
        if loss_in_pipeline():
            return self.pipelined_loss(tokens, targets, positions, docs=docs)[0], {}
        x = self.hidden(tokens, positions, **layer_docs(docs))
        return head_loss(self.outer(), self.cfg, self.dtype, x, targets, docs), {}

    def pipelined_loss(self, tokens: jax.Array, targets: jax.Array, positions: jax.Array | None,
                       weights: dict | None = None, docs: dict | None = None) -> tuple[jax.Array, dict | None]:
        """The loss in the layout's pipeline (:meth:`~jaxpar.layers.stack.Stack.loss`): the embedding on
        the first stage, the head and loss on the last (the model's loss under every schedule). With
        ``weights`` (a dict over the per-layer outputs of :meth:`make_blocks`' layers, e.g. MoE router
        losses) the loss adds ``sum weight x sum over layers``; returns ``(loss, outputs)``, the per-layer
        outputs averaged over microbatches (None without ``weights``). ``docs``: packed documents (as
        :meth:`loss`, in the order of ``tokens``): the segment ids and positions travel with each
        microbatch, and each microbatch's loss is its share of the whole batch's weighted mean."""
        cfg, dtype = self.cfg, self.dtype
        outer_def, outer = nnx.split(self.outer())
        docs = docs or {}
        b = tokens.shape[0]
        if docs:  # each token's share of the whole batch's loss: weight / the batch's trained tokens
            tokens = {"tokens": tokens, "positions": docs["positions"], "segment_ids": docs["segment_ids"]}
            targets = {"targets": targets, "weights": docs["weights"] / loss_denominator(docs)}

        def first_fn(o, tok):
            mods = nnx.merge(outer_def, o)
            if isinstance(tok, dict):
                return embed_tokens(mods, cfg, dtype, tok["tokens"], tok["positions"])
            return embed_tokens(mods, cfg, dtype, tok, positions)

        def lead_fn(o, x, tok):  # the layers before the stack (a MoE model's dense first layers): on stage 0
            mods = nnx.merge(outer_def, o)
            if isinstance(tok, dict):
                return self.lead_in(mods, x, positions, segment_ids=tok["segment_ids"], doc_positions=tok["positions"])
            return self.lead_in(mods, x, positions)

        def last_fn(o, h, tgt):
            mods = nnx.merge(outer_def, o)
            if isinstance(tgt, dict):  # a part of rows/b of the batch, of which the pipeline takes the mean
                share = {"weights": tgt["weights"], "loss_denominator": tgt["weights"].shape[0] / b}
                return head_loss(mods, cfg, dtype, mods["norm_f"](h), tgt["targets"], share)
            return head_loss(mods, cfg, dtype, mods["norm_f"](h), tgt)

        return Stack(self.blocks, remat=cfg.remat, outputs=weights is not None, per_layer=self.per_layer(),
                     rows=layer_docs(docs)).loss(first_fn, last_fn, outer, tokens, targets, positions, weights=weights,
                                                 lead_fn=lead_fn if self.has_lead_in() else None)


def batch_docs(docs: dict) -> dict:
    """The packed-document fields of a loss call's keywords, checked: ``segment_ids``, ``positions``,
    ``weights`` (each ``[B, T]``, all three or none) and optionally ``loss_denominator``."""
    unknown = set(docs) - set(DOC_KEYS) - {"loss_denominator"}
    if unknown:
        raise TypeError(f"unknown loss keyword(s) {sorted(unknown)}; a batch of packed documents has "
                        f"{', '.join(DOC_KEYS)} (and loss_denominator)")
    given = [k for k in DOC_KEYS if docs.get(k) is not None]
    if given and len(given) < len(DOC_KEYS):
        raise TypeError(f"packed documents need {', '.join(DOC_KEYS)} together; got only {', '.join(given)}")
    return {k: v for k, v in docs.items() if v is not None} if given else {}


def layer_docs(docs: dict) -> dict:
    """What the layers take of a batch's packed documents: segment ids and in-document positions."""
    return {"segment_ids": docs["segment_ids"], "doc_positions": docs["positions"]} if docs else {}


def loss_denominator(docs: dict) -> jax.Array:
    """The trained tokens the loss of a batch of packed documents is divided by (``loss_denominator``
    when the caller gives it, else the sum of this batch's ``weights``; 1 when nothing is trained, so
    that such a batch's loss is 0)."""
    d = docs.get("loss_denominator")
    d = jnp.sum(docs["weights"].astype(jnp.float32)) if d is None else jnp.asarray(d, jnp.float32)
    return jnp.where(d > 0, d, 1.0)


def ordered(tokens: jax.Array, targets: jax.Array, docs: dict | None = None):
    """Tokens, targets and the packed-document fields (:func:`batch_docs`) in the order the active
    layout needs (:func:`sequence_order`), with the global positions of that order (None: in order)."""
    docs = batch_docs(docs or {})
    order = sequence_order(tokens.shape[1])
    if order is None:
        return tokens, targets, None, docs
    docs = {k: (v[:, order] if k in DOC_KEYS else v) for k, v in docs.items()}
    return tokens[:, order], targets[:, order], jnp.asarray(order), docs


def embed_tokens(outer: dict, cfg: ModelConfig, dtype, tokens: jax.Array, positions: jax.Array | None) -> jax.Array:
    """Token (and learned position) embeddings of ``tokens [B, T]`` by :meth:`GPT.outer`'s modules, scaled
    by sqrt(d_model) with ``model.embed_scale``; ``positions`` ``[T]`` or ``[B, T]`` (None: ``0..T-1``)."""
    t = tokens.shape[1]
    if outer["pos_embed"] is not None and t > outer["pos_embed"].shape[0]:
        raise ValueError(f"sequence of {t} tokens exceeds the {outer['pos_embed'].shape[0]} learned positions "
                         "(model.max_positions)")
    x = outer["embed"](tokens)
    if cfg.embed_scale:  # as Gemma: the factor rounded to the weights' dtype first
        x = x * jnp.asarray(math.sqrt(cfg.d_model), DTYPES[cfg.param_dtype]).astype(x.dtype)
    if outer["pos_embed"] is not None:
        pos_table = constrain_weight(outer["pos_embed"][...], ("positions", "embed"))
        pos = pos_table[:t] if positions is None else jnp.take(pos_table, positions, axis=0)
        x = constrain(x + pos.astype(dtype), ("batch", "res_length", "act_embed"))
    return x


def output_weight(outer: dict) -> tuple[jax.Array, str]:
    """The head's weight in its compute layout and its einsum layout (``vd`` tied, ``dv`` untied)."""
    if outer["head"] is None:
        return outer["embed"].table(), "vd"
    return constrain_weight(outer["head"].kernel[...], ("embed", "vocab")), "dv"


def head_loss(outer: dict, cfg: ModelConfig, dtype, x: jax.Array, targets: jax.Array,
              docs: dict | None = None) -> jax.Array:
    """Head and mean cross-entropy of the final-normed residual stream ``x`` (chunked, see :meth:`GPT.loss`);
    with packed documents' ``weights`` (and ``loss_denominator``) the weighted mean."""
    w, layout = output_weight(outer)
    weighted = {} if not docs else {"weights": docs["weights"], "denominator": loss_denominator(docs)}
    return head_cross_entropy(x, w, targets, cfg.vocab_size, layout=layout, dtype=dtype,
                              chunk_tokens=cfg.loss_chunk_tokens, **weighted)


def sequence_order(t: int) -> np.ndarray | None:
    """The token order the active layout needs: zig-zag for ring attention over ``seq``, else None."""
    rules = active_rules()
    if rules is None or rules.seq_attention != "ring" or not rules.parallel.seq_zigzag:
        return None
    return zigzag_order(t, rules.axis_size("seq"))


def build_model(cfg: ModelConfig, *, tensor: int = 1, seed: int = 0) -> GPT:
    return GPT(cfg, tensor=tensor, rngs=nnx.Rngs(seed))
