"""GPT-OSS (``gpt_oss``): GQA attention with biases on Q, K, V and O and a learned sink logit per head in
the softmax (``model.attn_sinks``), sliding-window and full layers alternating (``layer_types``: ``model.
sliding_window`` + ``model.global_every``), YaRN RoPE (its ``truncate: false`` correction range:
``model.rope_truncate``), and a Mixture-of-Experts in every layer: a router with a bias on its logits
(``moe.router_logit_bias``) whose top-k logits are softmaxed (= the softmax renormalised over the chosen
experts), experts with biases (``moe.expert_bias``) and the clamped SwiGLU ``(clamp(up) + 1) * g *
sigmoid(alpha g)``, ``g = min(gate, limit)`` (``model.mlp=clamped_swiglu``, ``model.swiglu_limit``,
``model.swiglu_alpha``).

The published checkpoints store the experts' weights in MXFP4 (``quantization_config.quant_method``):
jaxpar reads plain (dequantised) tensors only and refuses a quantised checkpoint by that field, naming the
way to dequantise it. The experts' fused ``gate_up_proj [E, d, 2F]`` interleaves gate and up columns
(gate at even ones); the import splits them into jaxpar's ``[E, d, 2, F]`` and the export interleaves them
again.
"""

from __future__ import annotations

from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.families.common import MOE_PLAIN, decoder_config, decoder_keys

MODEL_TYPE, CLASS = "gpt_oss", "GptOssForCausalLM"
EXPERTS = "interleaved"  # the experts' fused layout (jaxpar.hf): gate/up interleaved, biases beside
MOE_NAMES = ("mlp", "", "", "")  # (no per-expert tensors: the router is mlp.router, the experts fused)


def _windows(hf: dict, where: str) -> tuple[int, int]:
    """``(model.sliding_window, model.global_every)`` of ``layer_types``."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ConfigError(f"{where}: layer_types={types!r} is not supported by jaxpar (one of sliding_attention / "
                          f"full_attention per layer)")
    window = hf.get("sliding_window") or 0
    full = [t == "full_attention" for t in types]
    if all(full) or not window:
        if not all(full):
            raise ConfigError(f"{where}: layer_types has sliding_attention layers but sliding_window="
                              f"{hf.get('sliding_window')!r}; give the window")
        return 0, 0
    if not any(full):
        return window, 0
    every = full.index(True) + 1
    if full != [(i + 1) % every == 0 for i in range(n)]:
        raise ConfigError(f"{where}: layer_types={types!r} is not supported by jaxpar (a full-attention layer every "
                          "N-th layer, the last of each N: model.global_every)")
    return window, every


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if not (isinstance(quant, dict) and quant.get("dequantize")):
            raise ConfigError(f"{where}: quantization_config.quant_method={method!r} is not supported by jaxpar (it "
                              "reads plain tensors: load the model in transformers with "
                              "quantization_config=Mxfp4Config(dequantize=True), save_pretrained it, import that)")
    bias = bool(hf.get("attention_bias", True))
    window, every = _windows(hf, where)
    k, n = hf.get("num_experts_per_tok", 4), hf["num_hidden_layers"]
    hard = {"model.arch": "moe", **MOE_PLAIN, **decoder_keys(hf, where), "model.mlp": "clamped_swiglu",
            "model.swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
            "model.swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)), "model.bias": bias, "model.qkv_bias": bias,
            "model.attn_sinks": True, "model.sliding_window": window, "model.global_every": every,
            "moe.n_experts": hf.get("num_local_experts", 128), "moe.top_k": k, "moe.d_ff": hf["intermediate_size"],
            "moe.renormalize": True, "moe.router_logit_bias": True, "moe.expert_bias": True,
            "moe.bias_update_rate": 0.0}
    soft = {"moe.dropless": True, "moe.aux_loss_weight": hf.get("router_aux_loss_coef", 0.001) * k / n}
    return hard, soft


def to_hf(m, moe) -> dict[str, Any]:
    types = ["sliding_attention" if w else "full_attention" for w in m.layer_windows()]
    return {**decoder_config(m), "attention_bias": m.bias, "num_local_experts": moe.n_experts,
            "num_experts_per_tok": moe.top_k, "intermediate_size": moe.d_ff or m.d_ff,
            "sliding_window": m.sliding_window or None, "layer_types": types, "swiglu_limit": m.swiglu_limit,
            "swiglu_alpha": m.swiglu_alpha, "router_aux_loss_coef": moe.aux_loss_weight * m.n_layers / moe.top_k}
