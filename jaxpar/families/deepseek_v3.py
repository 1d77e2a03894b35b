"""DeepSeek-V3 (and configs of its shape: Kimi-K2-style, V2-Lite-sized): Multi-head Latent Attention
(``model.kv_lora_rank``, ``q_lora_rank``, ``rope_head_dim``, ``v_head_dim``; :mod:`jaxpar.layers.latent_attention`)
and a Mixture-of-Experts feed-forward: sigmoid router scores, a selection-only correction bias
(``e_score_correction_bias``: ``moe.router_bias``), group-limited top-k (``n_group``, ``topk_group``), the
gates renormalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``), ``n_shared_experts``
always-on experts of ``moe_intermediate_size`` each, and the first ``first_k_dense_replace`` layers dense
MLPs of ``intermediate_size`` (``moe.first_dense``).

RoPE: DeepSeek's checkpoints rotate interleaved pairs of the RoPE dims (``rope_interleave``, the default);
jaxpar rotates halves, so the import permutes each RoPE part's output columns (pairs' first elements, then
their second ones: the same rotation, an exact permutation of the weights) and the export permutes them back
and writes ``rope_interleave: true``. A ``rope_interleave: false`` checkpoint imports unpermuted (and
exports as the interleaved layout, the same model). YaRN with ``mscale_all_dim`` multiplies the scores by
``mscale(factor, mscale_all_dim)^2`` (``model.attn_scale``).

The multi-token-prediction module of a checkpoint (``num_nextn_predict_layers`` layers after the last
decoder layer, ``model.layers.{num_hidden_layers}...``) is not part of the next-token model: its tensors are
skipped on import with a note naming them. DeepSeek-V3 is balanced without an auxiliary loss (by the bias),
so the import sets ``moe.aux_loss_weight=0`` unless the user sets one (``moe.bias_update_rate`` > 0 moves
the bias while fine-tuning).
"""

from __future__ import annotations

import math
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.families.common import MOE_PLAIN, decoder_config, decoder_keys, require, rope_of, yarn_mscale

MODEL_TYPE, CLASS = "deepseek_v3", "DeepseekV3ForCausalLM"

# the MoE layer's weight names (jaxpar.hf): router module, experts' gate, up and down projections
MOE_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")
SHARED = "mlp.shared_experts"                    # the always-on experts, one MLP (gate_proj, up_proj, down_proj)
ROUTER_BIAS = "mlp.gate.e_score_correction_bias"  # the selection-only bias


def attn_scale(hf: dict, qk_head_dim: int) -> float:
    """The scores' multiplier as transformers' DeepSeek-V3 computes it, 0.0 when it is the plain
    ``1/sqrt(qk_head_dim)``."""
    rope = rope_of(hf)
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    m_all = rope.get("mscale_all_dim") or 0
    if kind == "default" or not m_all:
        return 0.0
    m = yarn_mscale(float(rope["factor"]), float(m_all))
    return qk_head_dim ** -0.5 * m * m


def skipped(hf: dict) -> list[str]:
    """Name prefixes of the checkpoint's tensors that are not the next-token model (the MTP layers)."""
    n, mtp = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0
    return [f"model.layers.{i}." for i in range(n, n + mtp)]


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    require(hf, where, "attention_bias", lambda v: not v, "false", False)
    for key in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        require(hf, where, key, lambda v: isinstance(v, int) and v > 0, "a positive integer")
    n, first = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0) or 0
    if not 0 <= first < n:
        raise ConfigError(f"{where}: first_k_dense_replace={first} with num_hidden_layers={n} is not supported by "
                          "jaxpar (needs at least one MoE layer: a value below num_hidden_layers)")
    require(hf, where, "moe_layer_freq", lambda v: v in (None, 1), "1 (every layer after the dense ones MoE)")
    require(hf, where, "topk_method", lambda v: v in (None, "noaux_tc"), "noaux_tc (sigmoid scores, group-limited)")
    require(hf, where, "scoring_func", lambda v: v in (None, "sigmoid"), "sigmoid")
    heads = hf["num_attention_heads"]
    require(hf, where, "num_key_value_heads", lambda v: v in (None, heads), f"num_attention_heads={heads}")
    rope, nope = hf["qk_rope_head_dim"], hf["qk_nope_head_dim"]
    keys = decoder_keys(hf, where)
    keys.update({"model.arch": "moe", **MOE_PLAIN, "model.head_dim": nope + rope, "model.n_kv_heads": heads,
                 "model.kv_lora_rank": hf["kv_lora_rank"], "model.q_lora_rank": hf.get("q_lora_rank") or 0,
                 "model.rope_head_dim": rope, "model.v_head_dim": hf["v_head_dim"],
                 "model.attn_scale": attn_scale(hf, nope + rope),
                 "moe.n_experts": hf.get("n_routed_experts", 256), "moe.top_k": hf.get("num_experts_per_tok", 8),
                 "moe.first_dense": first, "moe.d_ff": hf.get("moe_intermediate_size", 2048), "moe.score": "sigmoid",
                 "moe.renormalize": bool(hf.get("norm_topk_prob", True)),
                 "moe.shared_experts": hf.get("n_shared_experts", 0) or 0, "moe.router_bias": True,
                 "moe.n_group": hf.get("n_group", 1) or 1, "moe.topk_group": hf.get("topk_group", 1) or 1,
                 "moe.routed_scaling_factor": float(hf.get("routed_scaling_factor", 1.0))})
    soft = {"moe.dropless": True, "moe.aux_loss_weight": 0.0}
    return keys, soft


def to_hf(m, moe) -> dict[str, Any]:
    out = decoder_config(m)
    if m.attn_scale and m.rope_scaling == "yarn" and m.rope_factor > 1:  # the scale as mscale_all_dim (attn_scale)
        mscale = math.sqrt(m.attn_scale * math.sqrt(m.head_dim))
        out["rope_parameters"]["mscale_all_dim"] = (mscale - 1) / (0.1 * math.log(m.rope_factor))
    return {**out, "head_dim": m.rope_head_dim, "attention_bias": False,
            "q_lora_rank": m.q_lora_rank or None, "kv_lora_rank": m.kv_lora_rank,
            "qk_rope_head_dim": m.rope_head_dim, "qk_nope_head_dim": m.head_dim - m.rope_head_dim,
            "v_head_dim": m.v_head_dim, "rope_interleave": True, "n_routed_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.d_ff or m.d_ff,
            "first_k_dense_replace": moe.first_dense, "n_shared_experts": moe.shared_experts,
            "n_group": moe.n_group, "topk_group": moe.topk_group, "routed_scaling_factor": moe.routed_scaling_factor,
            "norm_topk_prob": moe.renormalize, "num_nextn_predict_layers": 0}
