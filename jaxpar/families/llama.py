"""Llama 1/2/3.x: RoPE (Llama 3.1's ``llama3`` scaling, or ``linear``), RMSNorm, SwiGLU, GQA; tied
embeddings in the small Llama 3.2 sizes."""

from __future__ import annotations

from typing import Any

from jaxpar.families.common import decoder_config, decoder_keys, require

MODEL_TYPE, CLASS = "llama", "LlamaForCausalLM"


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    for key in ("attention_bias", "mlp_bias"):
        require(hf, where, key, lambda v: not v, "false", False)
    require(hf, where, "pretraining_tp", lambda v: v in (None, 1), "1", 1)
    return {"model.arch": "gpt", **decoder_keys(hf, where)}, {}


def to_hf(m, moe=None) -> dict[str, Any]:
    return {**decoder_config(m), "attention_bias": False, "mlp_bias": False}
