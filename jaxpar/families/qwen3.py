"""Qwen3 (dense): Llama's block with QK-norm (an RMSNorm over each head's query and key before RoPE) and
a head width of its own (``head_dim``, not d_model / heads)."""

from __future__ import annotations

from typing import Any

from jaxpar.families.common import decoder_config, decoder_keys, full_attention_only, require

MODEL_TYPE, CLASS = "qwen3", "Qwen3ForCausalLM"


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    full_attention_only(hf, where)
    require(hf, where, "attention_bias", lambda v: not v, "false", False)
    return {"model.arch": "gpt", **decoder_keys(hf, where), "model.qk_norm": True}, {}


def to_hf(m, moe=None) -> dict[str, Any]:
    return {**decoder_config(m), "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m.n_layers, "layer_types": ["full_attention"] * m.n_layers}
