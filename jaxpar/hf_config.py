"""Hugging Face ``config.json`` -> jaxpar keys, for ``model.init_from=hf:DIR`` (applied by
:func:`jaxpar.config.load_config`; the weights are :mod:`jaxpar.hf`'s).

:func:`config_keys` turns a GPT-2, Llama or Mixtral ``config.json`` into the ``model.*`` (and
``moe.*``) keys of the same model: ``hard`` ones define the architecture, ``soft`` ones are defaults
the user may change. An option jaxpar does not implement is a :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from jaxpar.errors import ConfigError

PREFIX = "hf:"
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}

def directory(init_from: str) -> Path:
    """The model directory of a ``model.init_from`` value (``hf:DIR``)."""
    if not init_from.startswith(PREFIX):
        raise ConfigError(f"model.init_from={init_from!r}: expected hf:/path/to/a/hugging/face/model/dir")
    d = Path(init_from[len(PREFIX):]).expanduser()
    if not (d / "config.json").is_file():
        raise ConfigError(f"model.init_from={init_from!r}: {d} has no config.json (a local Hugging Face model "
                          "directory is needed; nothing is downloaded)")
    return d


def read_config(d: Path) -> dict:
    try:
        return json.loads((Path(d) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{d}/config.json cannot be read: {e}") from None


def _arch(hf: dict, where: str) -> str:
    kind = hf.get("model_type")
    if kind not in CLASSES:
        raise ConfigError(f"{where}: model_type={kind!r} is not supported; jaxpar imports {', '.join(CLASSES)}")
    return kind


def _require(hf: dict, where: str, key: str, ok: Callable[[Any], bool], want: str, default=None) -> None:
    if not ok(hf.get(key, default)):
        raise ConfigError(f"{where}: {key}={hf.get(key, default)!r} is not supported by jaxpar (needs {want})")


def _rope_theta(hf: dict, where: str) -> float:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        field = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        raise ConfigError(f"{where}: {field}.rope_type={kind!r} is not supported by jaxpar (plain RoPE only: "
                          "rope_type default)")
    return float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_keys(hf: dict, where: str = "config.json") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hard, soft)`` jaxpar keys of a Hugging Face ``config.json``: ``hard`` define the architecture
    (a conflicting user value is an error), ``soft`` are defaults the user may change."""
    arch = _arch(hf, where)
    if arch == "gpt2":
        _require(hf, where, "activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"),
                 "the tanh GELU: gelu_new", "gelu_new")
        _require(hf, where, "scale_attn_weights", bool, "true", True)
        for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            _require(hf, where, key, lambda v: not v, "false", False)
        d = hf["n_embd"]
        hard = {"model.arch": "gpt", "model.style": "gpt2", "model.positions": "learned", "model.norm": "layernorm",
                "model.mlp": "gelu", "model.bias": True, "model.tie_embeddings": True, "model.n_layers": hf["n_layer"],
                "model.d_model": d, "model.n_heads": hf["n_head"], "model.n_kv_heads": hf["n_head"],
                "model.head_dim": d // hf["n_head"], "model.d_ff": hf.get("n_inner") or 4 * d,
                "model.vocab_size": hf["vocab_size"], "model.norm_eps": hf.get("layer_norm_epsilon", 1e-5)}
        return hard, {"model.seq_len": hf["n_positions"]}
    _require(hf, where, "hidden_act", lambda v: v == "silu", "silu", "silu")
    for key in ("attention_bias", "mlp_bias"):
        _require(hf, where, key, lambda v: not v, "false", False)
    heads = hf["num_attention_heads"]
    hard = {"model.style": "llama", "model.positions": "rope", "model.norm": "rmsnorm", "model.mlp": "swiglu",
            "model.bias": False, "model.tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "model.n_layers": hf["num_hidden_layers"], "model.d_model": hf["hidden_size"], "model.n_heads": heads,
            "model.n_kv_heads": hf.get("num_key_value_heads") or heads,
            "model.head_dim": hf.get("head_dim") or hf["hidden_size"] // heads, "model.d_ff": hf["intermediate_size"],
            "model.vocab_size": hf["vocab_size"], "model.norm_eps": hf.get("rms_norm_eps", 1e-6),
            "model.rope_theta": _rope_theta(hf, where)}
    soft: dict[str, Any] = {}
    if arch == "llama":
        return {"model.arch": "gpt", **hard}, soft
    _require(hf, where, "router_jitter_noise", lambda v: not v, "0", 0.0)
    k, n = hf.get("num_experts_per_tok", 2), hf["num_hidden_layers"]
    hard.update({"model.arch": "moe", "moe.n_experts": hf.get("num_local_experts", 8), "moe.top_k": k,
                 "moe.every": 1, "moe.d_ff": hf["intermediate_size"], "moe.score": "softmax",
                 "moe.renormalize": True, "moe.shared_experts": 0, "moe.bias_update_rate": 0.0})
    soft.update({"moe.dropless": True, "moe.aux_loss_weight": hf.get("router_aux_loss_coef", 0.001) * k / n})
    return hard, soft


def check_window(hf: dict, seq_len: int, where: str) -> None:
    """A sliding window at least as long as the sequence changes nothing; a shorter one is not implemented."""
    w = hf.get("sliding_window")
    if w is not None and w < seq_len:
        raise ConfigError(f"{where}: sliding_window={w} is shorter than model.seq_len={seq_len}; jaxpar has no "
                          f"sliding-window attention (use model.seq_len<={w})")


# ---------------------------------------------------------------------------------------------
# Config integration (called by jaxpar.config.load_config).

def apply(tree: dict, init_from: str, get, put, given: set[str]) -> dict[str, Any]:
    """Set the keys of ``init_from``'s ``config.json`` in the config ``tree`` (YAML values below the
    command line): architecture keys replace the file's, defaults fill what neither sets, and its
    ``tokenizer.json`` becomes ``data.tokenizer`` unless the command line names one. Returns the
    architecture keys, which a command-line override may not contradict."""
    d = directory(init_from)
    hard, soft = config_keys(read_config(d), f"{d}/config.json")
    for key, value in hard.items():
        put(tree, key, value)
    for key, value in soft.items():
        if get(tree, key) is None and key not in given:
            put(tree, key, value)
    if "data.tokenizer" not in given:
        if (d / "tokenizer.json").is_file():
            put(tree, "data.tokenizer", str(d / "tokenizer.json"))
        elif get(tree, "data.tokenizer") in (None, "bpe"):
            print(f"note: {d} has no tokenizer.json; data.tokenizer=bpe would train a new tokenizer whose ids mean "
                  "nothing to the imported weights (set data.tokenizer to the model's tokenizer.json)", file=sys.stderr)
    return hard


def check(cfg) -> None:
    """Checks of a config built with ``model.init_from`` that need its final values."""
    d = directory(cfg.model.init_from)
    hf = read_config(d)
    where = f"{d}/config.json"
    if hf.get("model_type") == "gpt2" and cfg.model.seq_len > hf["n_positions"]:
        raise ConfigError(f"model.seq_len={cfg.model.seq_len} exceeds the {hf['n_positions']} learned positions of "
                          f"{where} (n_positions)")
    check_window(hf, cfg.model.seq_len, where)
