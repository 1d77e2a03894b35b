"""Mistral: Llama's block with sliding-window attention in every layer (``sliding_window``; null in the
later releases, which attend globally)."""

from __future__ import annotations

from typing import Any

from jaxpar.families.common import decoder_config, decoder_keys

MODEL_TYPE, CLASS = "mistral", "MistralForCausalLM"


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return {"model.arch": "gpt", **decoder_keys(hf, where), "model.sliding_window": hf.get("sliding_window") or 0}, {}


def to_hf(m, moe=None) -> dict[str, Any]:
    return {**decoder_config(m), "sliding_window": m.sliding_window or None}
