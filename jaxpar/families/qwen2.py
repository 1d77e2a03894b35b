"""Qwen2 / Qwen2.5: Llama's block with biases on Q, K and V (not on the out-projection)."""

from __future__ import annotations

from typing import Any

from jaxpar.families.common import decoder_config, decoder_keys, full_attention_only

MODEL_TYPE, CLASS = "qwen2", "Qwen2ForCausalLM"


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    full_attention_only(hf, where)
    return {"model.arch": "gpt", **decoder_keys(hf, where), "model.qkv_bias": True}, {}


def to_hf(m, moe=None) -> dict[str, Any]:
    return {**decoder_config(m), "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": m.n_layers, "layer_types": ["full_attention"] * m.n_layers}
