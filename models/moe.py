"""A Mixture-of-Experts decoder (Mixtral / Switch style) that shares everything but the feed-forward
with :mod:`models.gpt`.

    x = embed(tokens) (+ learned positions)                       # GPT's
    for each of moe.first_dense dense blocks (GPT's Block, a lax.scan): x = x + attn(..); x = x + mlp(..)
    for each of (n_layers - first_dense) / every groups (stacked weights, lax.scan):
        every - 1 dense blocks (GPT's Block, an inner lax.scan):  x = x + attn(norm1(x)); x = x + mlp(norm2(x))
        one MoE block:                                            x = x + attn(norm1(x)); x = x + moe(norm2(x))
    logits = head(norm_f(x))                                      # GPT's
    loss = CE + aux_loss_weight * sum_layers balance + z_loss_weight * sum_layers z

``moe.every = 1`` makes every layer MoE (Mixtral); ``every = 2`` alternates dense and MoE (Switch),
the MoE layers being the last of each group. ``moe.first_dense = k`` puts k dense layers before the
groups (DeepSeek-V3's ``first_k_dense_replace``): a stack of their own, not split over ``pipe``;
under a pipeline they run on the first stage after the embedding, per microbatch inside the schedule
(``Stack.loss(lead_fn=)``: their backward too, so they keep one microbatch's activations; as the
embedding, every stage computes them and only the first stage's result is used: 3 of DeepSeek-V3's
61 layers: on 16 stages each stage computes about 3 + 58/16 layers).
The MoE layer (:class:`jaxpar.layers.MoE`) routes each
token to its top-k experts, which live split over the ``expert`` mesh axis and are reached by
all-to-all; attention, norms, embeddings and dense MLPs are GPT's and use ``expert`` as extra data
parallelism (the ``batch`` rule maps to ``data, expert``).

Tokens are routed in groups: the tokens one device holds. Capacity is per group and expert, so
which tokens drop depends on the mesh; with enough capacity (or ``moe.dropless``) nothing drops and
every mesh computes the one-device function.

``loss`` returns the total loss and metrics: ``ce_loss``, ``moe_aux_loss`` and ``moe_z_loss`` (per MoE
layer, averaged over layers; the loss adds their layer *sums* times the weights),
``moe_drop_fraction`` (dropped share of token-expert assignments) and ``moe_expert_load`` (a vector:
assignments routed to each expert per MoE layer, over the batch).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import MoEConfig, ModelConfig
from jaxpar.layers import MoE, balance_bias
from jaxpar.partitioning import constrain
from jaxpar.layers.stack import Stack, loss_in_pipeline, to_storage
from jaxpar.models.gpt import DTYPES, GPT, Block, activation, ordered


class MoEBlock(Block):
    """GPT's pre-norm block with the MLP replaced by a :class:`~jaxpar.layers.MoE` layer;
    ``__call__`` returns ``(x, stats)``."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, tensor: int = 1):
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)

        def experts(r):
            return MoE(cfg.d_model, moe.d_ff or cfg.d_ff, moe.n_experts, moe.top_k,
                       capacity_factor=moe.capacity_factor, dropless=moe.dropless, renormalize=moe.renormalize,
                       kind=activation(cfg), init_std=cfg.init_std, out_init_std=out_std,
                       shared_experts=moe.shared_experts,
                       score=moe.score, dispatch=moe.dispatch_path(), bias_update_rate=moe.bias_update_rate,
                       groups=moe.n_group, top_groups=moe.topk_group, gate_scale=moe.routed_scaling_factor,
                       routing_bias=moe.router_bias, logit_bias=moe.router_logit_bias, expert_bias=moe.expert_bias,
                       grouped_matmul=moe.grouped_matmul,
                       dtype=dtype, param_dtype=DTYPES[cfg.param_dtype], rngs=r)

        super().__init__(cfg, dtype=dtype, rngs=rngs, ffn=experts, tensor=tensor)

    def __call__(self, x: jax.Array, positions: jax.Array | None, window=None, **docs) -> tuple[jax.Array, dict]:
        x = self.attn_residual(x, lambda h: self.attn(h, positions, window, **docs))
        x, stats = self.mlp_residual(x)
        return constrain(x, ("batch", "res_length", "act_embed")), stats


class MoEGroup(nnx.Module):
    """``every - 1`` dense blocks (stacked, scanned) followed by one MoE block."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, dtype=jnp.float32, rngs: nnx.Rngs, tensor: int = 1):
        self.dense = (Stack.create(lambda r: Block(cfg, dtype=dtype, rngs=r, tensor=tensor), moe.every - 1, rngs,
                                   axis="sublayers")
                      if moe.every > 1 else None)
        self.moe = MoEBlock(cfg, moe, dtype=dtype, rngs=rngs, tensor=tensor)

    def __call__(self, x: jax.Array, positions: jax.Array | None, window=None, **docs) -> tuple[jax.Array, dict]:
        """``window``: the MoE layer's sliding window when the layers differ (every layer MoE, validated)."""
        if self.dense is not None:
            x = Stack(self.dense, pipelined=False, rows=docs)(x, positions)
        return self.moe(x, positions, window, **docs)


class MoETransformer(GPT):
    """GPT with ``n_layers / every`` groups of [dense..., MoE] blocks in place of its dense stack."""

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, *, tensor: int = 1, rngs: nnx.Rngs):
        if moe.every <= 0 or cfg.n_layers % moe.every:
            raise ValueError(f"moe.every={moe.every} must divide model.n_layers={cfg.n_layers}")
        self.moe_cfg = moe
        super().__init__(cfg, tensor=tensor, rngs=rngs)

    def make_blocks(self, cfg: ModelConfig, dtype, rngs: nnx.Rngs) -> nnx.Module:
        m = self.moe_cfg
        # the dense first layers (moe.first_dense): their own stack, never split over pipe (module docstring)
        self.first = (Stack.create(lambda r: Block(cfg, dtype=dtype, rngs=r, tensor=self.tensor), m.first_dense, rngs,
                                   axis="sublayers")
                      if m.first_dense else None)
        return Stack.create(lambda r: MoEGroup(cfg, m, dtype=dtype, rngs=r, tensor=self.tensor),
                            m.groups(cfg.n_layers), rngs)

    def outer(self) -> dict:
        """GPT's, and the dense first layers (run with the embedding: on the first stage of a pipeline)."""
        return {**super().outer(), "first": self.first}

    def has_lead_in(self) -> bool:
        return self.first is not None

    def lead_in(self, outer: dict, x: jax.Array, positions: jax.Array | None, **docs) -> jax.Array:
        """The dense first layers (``moe.first_dense``) on the embedded ``x``."""
        if outer["first"] is None:
            return x
        # in a pipeline's loop (per microbatch) the backward casts the weights again (Stack's recast)
        return Stack(outer["first"], remat=self.cfg.remat, pipelined=False, rows=docs,
                     recast=loss_in_pipeline())(x, positions)

    def apply_blocks(self, x: jax.Array, positions: jax.Array | None, **docs) -> jax.Array:
        x = self.lead_in(self.outer(), x, positions, **docs)
        x, stats = Stack(self.blocks, remat=self.cfg.remat, outputs=True, per_layer=self.per_layer(),
                         rows=docs)(x, positions)
        # GPT's hidden() returns only the residual stream: the router statistics ([groups] / [groups, E]) leave
        # through Flax's intermediates, collected by nnx.capture in loss / __call__.
        self.sow(nnx.Intermediate, "moe_stats", stats)
        return x

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return nnx.capture(super().__call__, nnx.Intermediate)(tokens)[0]

    def loss(self, tokens: jax.Array, targets: jax.Array, **docs) -> tuple[jax.Array, dict]:
        """Cross-entropy plus the weighted router losses; metrics as in the module docstring; packed
        documents (``docs``) as :meth:`GPT.loss` (the router losses count every token, trained or not)."""
        m = self.moe_cfg
        if loss_in_pipeline():  # the router losses join the loss inside the pipeline; stats are for metrics
            tokens, targets, positions, docs = ordered(tokens, targets, docs)
            total, stats = self.pipelined_loss(tokens, targets, positions, {"aux_loss": m.aux_loss_weight,
                                                                            "z_loss": m.z_loss_weight}, docs)
            assert stats is not None
            metrics: dict = {}
            aux, z = jnp.sum(stats["aux_loss"]), jnp.sum(stats["z_loss"])
            ce = total - m.aux_loss_weight * aux - m.z_loss_weight * z
        else:
            (ce, metrics), inter = nnx.capture(super().loss, nnx.Intermediate)(tokens, targets, **docs)
            stats = inter["moe_stats"][0]  # the one sown tuple entry
            aux, z = jnp.sum(stats["aux_loss"]), jnp.sum(stats["z_loss"])
            total = ce + m.aux_loss_weight * aux + m.z_loss_weight * z
        n = stats["aux_loss"].shape[0]
        out = {**metrics, "ce_loss": ce, "moe_aux_loss": aux / n, "moe_z_loss": z / n,
               "moe_drop_fraction": jnp.mean(stats["drop_fraction"]),
               "moe_expert_load": jnp.mean(stats["expert_load"], axis=0)}
        if m.bias_update_rate > 0:  # each MoE layer's load, for after_update (which removes it from the metrics)
            out["moe_layer_load"] = stats["expert_load"]
        return total, out

    def after_update(self, params: dict, aux: dict) -> tuple[dict, dict]:
        """The trainer's post-optimizer hook: with ``moe.bias_update_rate`` > 0, each MoE layer's routing
        bias takes one balancing step (:func:`jaxpar.layers.moe.balance_bias`) from that layer's expert
        load in this batch (``aux["moe_layer_load"] [groups, E]``, in layer order; the parameters are in the
        layout's storage order, :func:`jaxpar.layers.stack.to_storage`: the trainer runs this under its rules).
        Returns the new parameters and the metrics without the per-layer loads; ``moe_load_max_min``
        reports the max/min expert load of the batch, averaged over MoE layers (1 = balanced)."""
        if self.moe_cfg.bias_update_rate <= 0:
            return params, aux
        aux = dict(aux)
        load = aux.pop("moe_layer_load")
        mlp = params["blocks"]["moe"]["mlp"]
        bias = balance_bias(mlp["router_bias"], to_storage(load, load.shape[0]), self.moe_cfg.bias_update_rate)
        params = {**params, "blocks": {**params["blocks"], "moe": {**params["blocks"]["moe"],
                                                                     "mlp": {**mlp, "router_bias": bias}}}}
        aux["moe_load_max_min"] = jnp.mean(jnp.max(load, axis=-1) / jnp.maximum(jnp.min(load, axis=-1), 1))
        return params, aux


def build_model(cfg: ModelConfig, moe: MoEConfig, *, tensor: int = 1, seed: int = 0) -> MoETransformer:
    return MoETransformer(cfg, moe, tensor=tensor, rngs=nnx.Rngs(seed))
