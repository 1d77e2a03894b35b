"""Hugging Face model families as data: each family is a config translation in one small file.

A family module names its ``config.json`` ``model_type`` (``MODEL_TYPE``) and its transformers class
(``CLASS``), and has two functions:

* ``config_keys(hf, where) -> (hard, soft)``: the jaxpar keys of a ``config.json``; ``hard`` keys define
  the architecture (every switch of :class:`jaxpar.config.ModelConfig`, so that a model another family
  would build is never taken for this one), ``soft`` ones are defaults the user may change. A field the
  family's model uses and jaxpar does not implement is a :class:`~jaxpar.errors.ConfigError` naming it.
* ``to_hf(m, moe) -> dict``: the ``config.json`` of a resolved model config (the exporter checks it by
  translating it back with ``config_keys``: a model the family cannot express is an error naming the key).

The weights' names follow from the switches, not from the family (:mod:`jaxpar.hf`): GPT-2 has its own
table; every other family uses the Llama names, with Q/K/V biases, QK-norm weights and Gemma's
sandwich norms where the switches say so, and for the MoE decoder the experts' names its family module
gives (``MOE_NAMES``: Mixtral's ``block_sparse_moe.experts.{i}.w1``, Qwen3-MoE's ``mlp.experts.{i}.gate_proj``;
DeepSeek-V3's also ``SHARED`` experts and ``ROUTER_BIAS``), and MLA's projections where ``model.kv_lora_rank``
says so. A family may name tensors of its checkpoints that are not the model (``skipped(hf)``: DeepSeek-V3's
multi-token-prediction layers), which the import leaves out with a note.
"""

from __future__ import annotations

from jaxpar.errors import ConfigError
from jaxpar.families import deepseek_v3, gemma3, gpt2, gpt_oss, llama, mistral, mixtral, qwen2, qwen3, qwen3_moe

FAMILIES = {f.MODEL_TYPE: f for f in (gpt2, llama, mistral, qwen2, qwen3, gemma3, mixtral, qwen3_moe, deepseek_v3,
                                        gpt_oss)}
CLASSES = {k: f.CLASS for k, f in FAMILIES.items()}


def family(hf: dict, where: str):
    """The family module of a ``config.json``."""
    kind = hf.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError(f"{where}: model_type={kind!r} is not supported; jaxpar imports {', '.join(FAMILIES)}")
    return FAMILIES[kind]


def for_model(m, arch: str):
    """The family that expresses a resolved model config ``m`` (``arch``: gpt or moe): the first whose
    distinguishing switch it uses, in this order (the exporter then checks every other switch)."""
    if m.positions == "learned":
        return gpt2
    if m.latent:
        return deepseek_v3
    if m.attn_sinks:
        return gpt_oss
    if arch == "moe":
        return qwen3_moe if m.qk_norm else mixtral
    if m.norm_placement == "sandwich" or m.norm_plus_one or m.embed_scale or m.mlp == "geglu" or m.global_every:
        return gemma3
    if m.qk_norm:
        return qwen3
    if m.qkv_bias and not m.bias:
        return qwen2
    if m.sliding_window:
        return mistral
    return llama
