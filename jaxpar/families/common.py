"""What the Llama-style families share: their ``config.json`` fields and RoPE settings."""

from __future__ import annotations

import math
from typing import Any, Callable

from jaxpar.errors import ConfigError

# every switch of a decoder at its plain value: a family sets what it uses, so that an import pins every
# switch and an export of a model that uses one its family lacks is refused by name
PLAIN = {"model.qkv_bias": False, "model.qk_norm": False, "model.norm_placement": "pre", "model.norm_plus_one": False,
         "model.embed_scale": False, "model.attn_scale": 0.0, "model.sliding_window": 0, "model.global_every": 0,
         "model.rope_local_theta": 0.0, "model.rope_scaling": "none", "model.kv_lora_rank": 0, "model.q_lora_rank": 0,
         "model.rope_head_dim": 0, "model.v_head_dim": 0, "model.attn_sinks": False, "model.rope_truncate": True}

# every MoE switch at its plain value (a MoE family sets what it uses)
MOE_PLAIN = {"moe.every": 1, "moe.first_dense": 0, "moe.score": "softmax", "moe.shared_experts": 0,
             "moe.router_bias": False, "moe.router_logit_bias": False, "moe.expert_bias": False, "moe.n_group": 1,
             "moe.topk_group": 1, "moe.routed_scaling_factor": 1.0}

ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}


def require(hf: dict, where: str, key: str, ok: Callable[[Any], bool], want: str, default=None) -> None:
    if not ok(hf.get(key, default)):
        raise ConfigError(f"{where}: {key}={hf.get(key, default)!r} is not supported by jaxpar (needs {want})")


def rope_keys(rope: dict, where: str, field: str, theta_default: float = 10000.0,
              max_positions: int | None = None) -> dict[str, Any]:
    """jaxpar's RoPE keys of one ``rope_parameters`` dict (``field`` names it in errors): the base and the
    scaling (``default``, ``linear``, ``llama3``, ``yarn``: its attention factor resolved as transformers
    does, from ``attention_factor``, ``mscale`` / ``mscale_all_dim`` or the factor; the dynamic kinds are
    refused by name). ``max_positions``: the ``config.json``'s ``max_position_embeddings``."""
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: {field}.rope_type={kind!r} is not supported by jaxpar (choose one of "
                          f"{', '.join(ROPE_TYPES)})")
    partial = rope.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"{where}: {field}.partial_rotary_factor={partial!r} is not supported by jaxpar (RoPE over "
                          "the whole head only: 1.0)")
    keys: dict[str, Any] = {"model.rope_theta": float(rope.get("rope_theta", theta_default)),
                            "model.rope_scaling": ROPE_TYPES[kind]}
    if kind in ("linear", "llama3"):
        keys["model.rope_factor"] = float(rope["factor"])
    if kind == "llama3":
        keys.update({"model.rope_low_freq_factor": float(rope.get("low_freq_factor", 1.0)),
                     "model.rope_high_freq_factor": float(rope.get("high_freq_factor", 4.0)),
                     "model.rope_original_context": int(rope.get("original_max_position_embeddings", 8192))})
    if kind == "yarn":
        keys.update(_yarn_keys(rope, where, field, max_positions))
    return keys


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's ``mscale``: ``0.1 m ln(scale) + 1`` (1 for a scale <= 1), as transformers computes it."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def _yarn_keys(rope: dict, where: str, field: str, max_positions: int | None) -> dict[str, Any]:
    """YaRN's keys, resolved as transformers' ``_compute_yarn_parameters`` does."""
    if rope.get("truncate", True) not in (True, False):
        raise ConfigError(f"{where}: {field}.truncate={rope.get('truncate')!r} is not supported by jaxpar (true or "
                          "false)")
    original = rope.get("original_max_position_embeddings") or max_positions
    if not original:
        raise ConfigError(f"{where}: {field} of rope_type yarn names no original_max_position_embeddings")
    factor = rope.get("factor") or (max_positions or original) / original
    attention = rope.get("attention_factor")
    if attention is None:
        ms, ms_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = yarn_mscale(factor, ms) / yarn_mscale(factor, ms_all) if ms and ms_all else yarn_mscale(factor)
    return {"model.rope_factor": float(factor), "model.rope_original_context": int(original),
            "model.rope_truncate": bool(rope.get("truncate", True)),
            "model.rope_beta_fast": float(rope.get("beta_fast") or 32), "model.rope_beta_slow":
            float(rope.get("beta_slow") or 1), "model.rope_attention_factor": float(attention)}


def rope_of(hf: dict) -> dict:
    """The RoPE dict of a ``config.json`` (transformers 5's ``rope_parameters``, or the older ``rope_scaling``
    with a top-level ``rope_theta``)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in hf:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return rope


def rope_field(hf: dict) -> str:
    return "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"


def rope_parameters(m) -> dict:
    """A resolved model config's RoPE as a ``rope_parameters`` dict (the global layers')."""
    out: dict[str, Any] = {"rope_type": {v: k for k, v in ROPE_TYPES.items()}[m.rope_scaling],
                           "rope_theta": m.rope_theta}
    if m.rope_scaling in ("linear", "llama3"):
        out["factor"] = m.rope_factor
    if m.rope_scaling == "llama3":
        out.update({"low_freq_factor": m.rope_low_freq_factor, "high_freq_factor": m.rope_high_freq_factor,
                    "original_max_position_embeddings": m.rope_original_context})
    if m.rope_scaling == "yarn":
        out.update({"factor": m.rope_factor, "original_max_position_embeddings": m.rope_original_context,
                    "beta_fast": m.rope_beta_fast, "beta_slow": m.rope_beta_slow,
                    "attention_factor": m.yarn_attention_factor()})
        if not m.rope_truncate:
            out["truncate"] = False
    return out


def decoder_keys(hf: dict, where: str, act_field: str = "hidden_act", act: str = "silu") -> dict[str, Any]:
    """The keys every Llama-style decoder's ``config.json`` sets (sizes, RoPE, untied or tied head)."""
    require(hf, where, act_field, lambda v: v == act, act, act)
    heads = hf["num_attention_heads"]
    keys = {"model.style": "llama", "model.positions": "rope", "model.norm": "rmsnorm", "model.mlp": "swiglu",
            "model.bias": False, "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "model.n_layers": hf["num_hidden_layers"], "model.d_model": hf["hidden_size"], "model.n_heads": heads,
            "model.n_kv_heads": hf.get("num_key_value_heads") or heads,
            "model.head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "model.d_ff": hf["intermediate_size"],
            "model.vocab_size": hf["vocab_size"], "model.norm_eps": hf.get("rms_norm_eps", 1e-6), **PLAIN}
    keys.update(rope_keys(rope_of(hf), where, rope_field(hf), max_positions=hf.get("max_position_embeddings")))
    return keys


def full_attention_only(hf: dict, where: str) -> None:
    """Families whose sliding-window layers jaxpar does not build (Qwen2/3's ``max_window_layers`` split)."""
    types = hf.get("layer_types") or []
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in types):
        field = "use_sliding_window" if hf.get("use_sliding_window") else "layer_types"
        raise ConfigError(f"{where}: {field}={hf.get(field)!r} is not supported by jaxpar (sliding-window layers from "
                          "max_window_layers on; every layer full attention is)")


def decoder_config(m, act_field: str = "hidden_act", act: str = "silu") -> dict[str, Any]:
    """The ``config.json`` fields of a resolved Llama-style model config."""
    return {"num_hidden_layers": m.n_layers, "hidden_size": m.d_model, "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads, "head_dim": m.head_dim, "intermediate_size": m.d_ff,
            "vocab_size": m.vocab_size, "max_position_embeddings": max(m.max_positions, m.seq_len),
            "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_parameters": rope_parameters(m),
            act_field: act, "tie_word_embeddings": m.tie_embeddings}
