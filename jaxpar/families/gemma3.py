"""Gemma 3 (text): GeGLU, RMSNorm with ``(1 + w)``, norms before and after attention and MLP
(sandwich), QK-norm, embeddings scaled by sqrt(d_model), scores scaled by ``query_pre_attn_scalar``,
sliding-window (local) layers with their own RoPE base interleaved with global ones (5:1; ``linear``
RoPE scaling on the global ones in the large sizes), tied embeddings."""

from __future__ import annotations

from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.families.common import decoder_config, decoder_keys, require, rope_keys, rope_parameters

MODEL_TYPE, CLASS = "gemma3_text", "Gemma3ForCausalLM"
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def _global_every(types: list[str], where: str) -> int:
    """``model.global_every`` of a ``layer_types`` list: every N-th layer global (0: all local)."""
    if GLOBAL not in types or LOCAL not in types:  # one kind of layer: no interleaving
        return 0
    n = types.index(GLOBAL) + 1
    if any(t not in (LOCAL, GLOBAL) for t in types) or types != [GLOBAL if (i + 1) % n == 0 else LOCAL
                                                                  for i in range(len(types))]:
        raise ConfigError(f"{where}: layer_types={types!r} is not supported by jaxpar (every N-th layer "
                          f"{GLOBAL}, the others {LOCAL})")
    return n


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        require(hf, where, key, lambda v: v is None, "null", None)
    for key in ("use_bidirectional_attention", "attention_bias"):
        require(hf, where, key, lambda v: not v, "false", False)
    act = "hidden_activation" if "hidden_activation" in hf else "hidden_act"
    n = hf["num_hidden_layers"]
    hard = decoder_keys({**hf, "rope_parameters": None, "rope_scaling": None, "tie_word_embeddings":
                         hf.get("tie_word_embeddings", True)}, where, act, "gelu_pytorch_tanh")
    types = hf.get("layer_types") or [GLOBAL if (i + 1) % hf.get("sliding_window_pattern", 6) == 0 else LOCAL
                                      for i in range(n)]
    every = _global_every(list(types), where)
    window = hf.get("sliding_window") or 0
    if LOCAL in types and not window:
        raise ConfigError(f"{where}: layer_types has {LOCAL} layers but sliding_window={hf.get('sliding_window')!r}")
    rope = hf.get("rope_parameters") or {}
    if GLOBAL in rope or LOCAL in rope:  # transformers 5: one dict per layer type
        glob, local = rope.get(GLOBAL) or {"rope_type": "default"}, rope.get(LOCAL) or {"rope_type": "default"}
    else:  # the older form: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        glob = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
        local = {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 1e4)}
    hard.update(rope_keys(glob, where, f"rope_parameters.{GLOBAL}", 1e6))
    local_keys = rope_keys(local, where, f"rope_parameters.{LOCAL}", 1e4)
    if local_keys["model.rope_scaling"] != "none":
        raise ConfigError(f"{where}: rope_parameters.{LOCAL}.rope_type={local.get('rope_type')!r} is not supported by "
                          "jaxpar (the sliding-window layers' RoPE is unscaled: default)")
    hard.update({"model.arch": "gpt", "model.mlp": "geglu", "model.qk_norm": True, "model.norm_placement": "sandwich",
                 "model.norm_plus_one": True, "model.embed_scale": True,
                 "model.attn_scale": float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
                 "model.sliding_window": window if LOCAL in types else 0, "model.global_every": every,
                 "model.rope_local_theta": local_keys["model.rope_theta"] if LOCAL in types else 0.0})
    return hard, {}


def _scalar(x: float) -> int | float:
    """transformers' Gemma 3 config takes an int ``query_pre_attn_scalar`` (the head width it stands for)."""
    return int(round(x)) if abs(x - round(x)) < 1e-6 * x else x


def to_hf(m, moe=None) -> dict[str, Any]:
    types = [LOCAL if w else GLOBAL for w in m.layer_windows()]
    local = {"rope_type": "default", "rope_theta": m.rope_local_theta or m.rope_theta}
    out = decoder_config(m, "hidden_activation", "gelu_pytorch_tanh")
    out.update({"rope_parameters": {GLOBAL: rope_parameters(m), LOCAL: local}, "layer_types": types,
                "sliding_window": m.sliding_window or None,
                "query_pre_attn_scalar": _scalar((m.attn_scale or m.head_dim ** -0.5) ** -2),
                "final_logit_softcapping": None, "attn_logit_softcapping": None, "attention_bias": False,
                "use_bidirectional_attention": False})
    return out
