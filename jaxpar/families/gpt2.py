"""GPT-2: learned positions, LayerNorm with biases, tanh GELU, tied embeddings, biases everywhere."""

from __future__ import annotations

from typing import Any

from jaxpar.families.common import PLAIN, require

MODEL_TYPE, CLASS = "gpt2", "GPT2LMHeadModel"


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    require(hf, where, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
            "the tanh GELU: gelu_new", "gelu_new")
    require(hf, where, "scale_attn_weights", bool, "true", True)
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention", "reorder_and_upcast_attn"):
        require(hf, where, key, lambda v: not v, "false", False)
    d = hf["n_embd"]
    hard = {**PLAIN, "model.arch": "gpt", "model.style": "gpt2", "model.positions": "learned",
            "model.norm": "layernorm", "model.mlp": "gelu", "model.bias": True, "model.qkv_bias": True,
            "model.tie_embeddings": True, "model.n_layers": hf["n_layer"], "model.d_model": d,
            "model.n_heads": hf["n_head"], "model.n_kv_heads": hf["n_head"], "model.head_dim": d // hf["n_head"],
            "model.d_ff": hf.get("n_inner") or 4 * d, "model.vocab_size": hf["vocab_size"],
            "model.norm_eps": hf.get("layer_norm_epsilon", 1e-5), "model.max_positions": hf["n_positions"]}
    del hard["model.rope_scaling"]  # no RoPE at all
    # the whole position table is the model's; model.seq_len (at most n_positions) only limits training
    return hard, {"model.seq_len": hf["n_positions"]}


def to_hf(m, moe=None) -> dict[str, Any]:
    return {"n_layer": m.n_layers, "n_embd": m.d_model, "n_head": m.n_heads, "n_inner": m.d_ff,
            "vocab_size": m.vocab_size, "n_positions": m.max_positions, "n_ctx": m.max_positions,
            "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new", "tie_word_embeddings": True}
