"""Mixtral: Llama's attention with a Mixture-of-Experts feed-forward in every layer (softmax router,
top-k, renormalised), the experts SwiGLU MLPs."""

from __future__ import annotations

from typing import Any

from jaxpar.families.common import MOE_PLAIN, decoder_config, decoder_keys, require

MODEL_TYPE, CLASS = "mixtral", "MixtralForCausalLM"

# the MoE layer's weight names as published (jaxpar.hf): the module of the router (``{module}.gate.weight``) and
# the experts (``{module}.experts.{i}.{w}.weight``), and each expert's gate, up and down projection (w)
MOE_NAMES = ("block_sparse_moe", "w1", "w3", "w2")


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    require(hf, where, "router_jitter_noise", lambda v: not v, "0", 0.0)
    hard = decoder_keys(hf, where)
    hard["model.sliding_window"] = hf.get("sliding_window") or 0
    k, n = hf.get("num_experts_per_tok", 2), hf["num_hidden_layers"]
    hard.update({"model.arch": "moe", **MOE_PLAIN, "moe.n_experts": hf.get("num_local_experts", 8), "moe.top_k": k,
                 "moe.every": 1, "moe.d_ff": hf["intermediate_size"], "moe.score": "softmax",
                 "moe.renormalize": True, "moe.shared_experts": 0, "moe.bias_update_rate": 0.0})
    soft = {"moe.dropless": True, "moe.aux_loss_weight": hf.get("router_aux_loss_coef", 0.001) * k / n}
    return hard, soft


def to_hf(m, moe) -> dict[str, Any]:
    return {**decoder_config(m), "num_local_experts": moe.n_experts, "num_experts_per_tok": moe.top_k,
            "intermediate_size": moe.d_ff or m.d_ff, "router_jitter_noise": 0.0,
            "sliding_window": m.sliding_window or None,
            "router_aux_loss_coef": moe.aux_loss_weight * m.n_layers / moe.top_k}
