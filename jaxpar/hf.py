"""Hugging Face checkpoints in and out: the families of :mod:`jaxpar.families` (GPT-2, Llama 1-3.x, Mistral,
Qwen2.5, Qwen3, Gemma 3, Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS).

**Import.** ``python train.py model.init_from=hf:/path/to/dir ...`` starts a run from a local Hugging
Face model directory (``config.json`` and ``model.safetensors`` or a sharded
``model.safetensors.index.json``; nothing is downloaded). :mod:`jaxpar.hf_config` turns ``config.json`` into
jaxpar keys (``model.*``, and ``moe.*`` for the MoE families), which :func:`jaxpar.config.load_config` applies
over the YAML file's: a command-line override that contradicts one is an error naming both values, and
a ``config.json`` option jaxpar does not implement (dynamic RoPE scaling, biases in Llama attention,
Gemma's soft-capping, router jitter, ...) is an error naming the field, never a silently different
model. The import keeps what the checkpoint is: GPT-2's whole position table (``model.max_positions`` =
``n_positions``), while ``model.seq_len`` (default ``n_positions``, at most that) only limits the training
context. Keys that are training choices stay the user's: ``model.seq_len``, dtypes, remat, the attention
kernel. Mixtral and Qwen3-MoE import as ``moe.dropless=true`` (what
Hugging Face computes) unless set, and ``moe.aux_loss_weight`` from ``router_aux_loss_coef`` (see
:mod:`jaxpar.layers.moe` for the conversion); Qwen3-MoE's dense layers between its MoE ones
(``decoder_sparse_step``) are ``moe.every``'s. A ``tokenizer.json`` in the directory becomes
``data.tokenizer`` unless an override names one.

:func:`load_params` first checks the files against each other (:class:`jaxpar.hf_files.Safetensors`: an
index naming a missing or truncated shard, tensors missing or unaccounted for, a single file beside an
index: one line naming the directory and the file), then places the weights straight onto the run's mesh with
``jax.make_array_from_callback``: each device's callback reads, lazily from the memory-mapped
safetensors files (bfloat16 ones included), only the layers its shard holds (a pipeline stage reads only
its stage's layers), builds them in jaxpar's layout (fused QKV ``[embed, kv_heads, group + 2, head_dim]``,
fused gate/up, padded vocabulary) and keeps its slice; no host ever holds the whole model. A tensor in the
files that the mapping does not use is an error (a model jaxpar would load incompletely).

**Export.** ``python -m jaxpar.hf RUN_DIR OUT_DIR`` (or :func:`export`) writes a run's newest checkpoint,
from any mesh, as a directory that ``transformers`` loads with ``from_pretrained``: ``config.json``,
safetensors files of at most ``--shard-gb`` (with an index when there are several) in the checkpoint's
parameter dtype, the tokenizer's special-token ids (``bos_token_id``/``eos_token_id``, null where the
tokenizer has none, in ``config.json`` and ``generation_config.json``: see :func:`special_tokens`),
``tokenizer.json`` when the run trained or loaded one (with the ``tokenizer_config.json`` and
``special_tokens_map.json`` of the model directory it came from), and ``jaxpar_export.json`` (the run,
the step, the files). ``OUT_DIR`` is new, empty, or this run's previous export, which is replaced whole
and at once (written beside it, then swapped in by renames: never files of two models, and a failure
leaves it as it was); anything else (the Hugging Face model the run was imported from, a folder with
other files, a file) is refused in one line before the checkpoint is read, exit 2 (an IO fault: 1).
``--overwrite`` replaces any directory the same way, except the run, its checkpoints, data and
tokenizer, and the model it was imported from (:mod:`jaxpar.hf_files`). A model no family expresses
(a Llama with biases, QK-norm with a sliding window, a MoE with shared experts or a routing bias, ...) is
an error naming the key. GPT-2's key bias is written as zeros:
jaxpar has none there because a key bias adds the same ``q . b_k`` to every score of a query, which
softmax ignores (with RoPE or QK-norm after it, Qwen2.5's, it matters and is kept).

Long by design: the weight layouts, GPT-2's own table and one Llama-style table for every other family
whose entries follow from the switches (Q/K/V biases, QK-norm weights, Gemma's sandwich norms;
the MoE families' experts, named by their family module's ``MOE_NAMES``; a MoE stack's dense and MoE
layers), both directions side by side (each import rule next to its export rule).
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from jaxpar.cli import SIZE, ArgumentParser, command
from jaxpar.config import Config, ConfigError, ModelConfig
from jaxpar.families import FAMILIES, for_model
from jaxpar.hf_config import CLASSES, _arch, config_keys, directory, read_config
from jaxpar.hf_files import (INDEX, SINGLE, ExportError, Safetensors, Target, protected, save, source_of,
                             special_tokens, target, write)
from jaxpar.trainer import _get as _at
from jaxpar.trainer import _nest
from jaxpar.layers.stack import layer_positions

# tensors some checkpoints carry that are buffers, not weights (causal masks, RoPE tables)
_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def _effective(key: str, value, m: ModelConfig):
    """A key's value as the model computes with it (defaults spelled out), for comparing configs."""
    if key == "model.attn_scale":
        return value or m.head_dim ** -0.5
    if key == "model.v_head_dim":
        return value or m.head_dim
    if key == "model.rope_local_theta" and not value and m.rope_scaling == "none":
        return m.rope_theta  # the local layers' RoPE is the global one
    return value


def hf_config(cfg: Config) -> dict:
    """The ``config.json`` of the Hugging Face model that computes what ``cfg``'s model computes; a model
    that no supported family can express is an error naming the key. The family is chosen by the
    switches the model uses (:func:`jaxpar.families.for_model`); its ``config.json`` is translated back
    and every architecture key compared with ``cfg``'s."""
    m = cfg.model.resolved()
    fam = for_model(m, m.arch)
    hf = fam.to_hf(m, cfg.moe if m.arch == "moe" else None)
    dtype = m.param_dtype
    hf.update({"model_type": fam.MODEL_TYPE, "architectures": [fam.CLASS], "torch_dtype": dtype, "dtype": dtype})
    hard, _ = config_keys(hf)
    if m.arch == "moe" and hard["moe.every"] == 1 and not hard["moe.first_dense"]:  # every layer MoE: the dense
        del hard["model.d_ff"]                          # width is unused (the experts' is moe.d_ff or it)
    for key, want in hard.items():
        section, name = key.split(".")
        have = getattr(m if section == "model" else cfg.moe, name)
        have = have or m.d_ff if key == "moe.d_ff" else have
        have, want = _effective(key, have, m), _effective(key, want, m)
        if have != want and not (isinstance(want, float) and math.isclose(have, want)):
            raise ConfigError(f"{key}={have!r} cannot be exported: a Hugging Face {fam.MODEL_TYPE} model has "
                              f"{key}={want!r}")
    return hf


# ---------------------------------------------------------------------------------------------
# The weight layouts. Each architecture maps every jaxpar parameter (one layer's slice for a stacked
# one) to a function of the Hugging Face tensors (``t(name)``, layer-relative names), and back.

def _decoder_extras(m: ModelConfig) -> dict[tuple, str]:
    """A Llama-style layer's norms, Q/K/V biases and QK-norm weights: ``{jaxpar path: HF name}``, as the
    switches say (Gemma's sandwich norms: its post-attention norm is the attention output's, and the
    MLP's input norm is ``pre_feedforward_layernorm``)."""
    out: dict[tuple, str] = {("norm1", "scale"): "input_layernorm.weight"}
    if m.norm_placement == "sandwich":
        out.update({("post_norm1", "scale"): "post_attention_layernorm.weight",
                    ("norm2", "scale"): "pre_feedforward_layernorm.weight",
                    ("post_norm2", "scale"): "post_feedforward_layernorm.weight"})
    else:
        out[("norm2", "scale")] = "post_attention_layernorm.weight"
    if m.qkv_bias:
        out.update({("attn", "q_bias"): "self_attn.q_proj.bias", ("attn", "v_bias"): "self_attn.v_proj.bias"})
        if m.positions == "rope" or m.qk_norm:  # the key bias exists where it can matter (Attention)
            out[("attn", "k_bias")] = "self_attn.k_proj.bias"
    if m.qk_norm:
        out.update({("attn", "q_norm", "scale"): "self_attn.q_norm.weight",
                    ("attn", "k_norm", "scale"): "self_attn.k_norm.weight"})
    if m.attn_sinks:
        out[("attn", "sinks")] = "self_attn.sinks"
    if m.bias and not m.latent:  # the out-projection's bias (GPT-OSS)
        out[("attn", "o", "bias")] = "self_attn.o_proj.bias"
    return out


def _layer_prefix(arch: str, layer: int) -> str:
    return f"h.{layer}." if arch == "gpt2" else f"model.layers.{layer}."


Stacks = dict[tuple, tuple[bool, int, Callable[[int], int | list[int]]]]


def _stacks(m: ModelConfig, mc) -> Stacks:
    """The stacked subtrees: ``{path prefix: (moe, entries, layers)}``; ``layers(g)`` is the Hugging Face layer
    of stacked entry ``g`` (of ``entries``), or a list of them stacked on the next axis. A MoE model (``mc``: its
    ``moe`` config) stacks its ``moe.first_dense`` dense first layers (``first``), then groups of ``every``
    layers (``moe.every``, :mod:`models.moe`): ``every - 1`` dense ones (``blocks/dense``), then the MoE one.
    The ``blocks`` stacks are in the layout's storage order (:meth:`jaxpar.trainer.Trainer.layer_order`)."""
    if m.arch != "moe":
        return {("blocks",): (False, m.n_layers, lambda g: g)}
    every, first = mc.every, mc.first_dense
    groups = mc.groups(m.n_layers)
    out: Stacks = {("blocks", "moe"): (True, groups, lambda g: first + g * every + every - 1)}
    if every > 1:
        out[("blocks", "dense")] = (False, groups, lambda g: [first + g * every + s for s in range(every - 1)])
    if first:
        out[("first",)] = (False, first, lambda g: g)
    return out


def _rope_columns(p: int, inverse: bool = False) -> np.ndarray:
    """DeepSeek's interleaved RoPE pairs as jaxpar's halves (:mod:`jaxpar.families.deepseek_v3`): the
    published column order's even entries, then its odd ones (``inverse``: back)."""
    order = np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)])
    return np.argsort(order) if inverse else order


def _latent_columns(m: ModelConfig, rope: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The query head's and the KV down projection's output columns with their RoPE part in ``rope`` order."""
    hd, r, p = m.head_dim, m.kv_lora_rank, m.rope_head_dim
    return np.concatenate([np.arange(hd - p), hd - p + rope]), np.concatenate([np.arange(r), r + rope])


def _latent_to_jaxpar(m: ModelConfig, interleaved: bool) -> dict[tuple, Callable]:
    """MLA's projections (:class:`~jaxpar.layers.latent_attention.LatentAttention`) from DeepSeek's names."""
    d, h, hd, r, p, v = m.d_model, m.n_heads, m.head_dim, m.kv_lora_rank, m.rope_head_dim, m.v_head_dim
    q_cols, kv_cols = _latent_columns(m, _rope_columns(p) if interleaved else np.arange(p))
    out: dict[tuple, Callable] = {
        ("attn", "kv_down", "kernel"): lambda t: t("self_attn.kv_a_proj_with_mqa.weight").T[:, kv_cols],
        ("attn", "kv_norm", "scale"): lambda t: t("self_attn.kv_a_layernorm.weight"),
        ("attn", "kv_up", "kernel"): lambda t: t("self_attn.kv_b_proj.weight").T.reshape(r, h, hd - p + v),
        ("attn", "o", "kernel"): lambda t: t("self_attn.o_proj.weight").T.reshape(h, v, d)}
    if m.q_lora_rank:
        out.update({
            ("attn", "q_down", "kernel"): lambda t: t("self_attn.q_a_proj.weight").T,
            ("attn", "q_norm", "scale"): lambda t: t("self_attn.q_a_layernorm.weight"),
            ("attn", "q_up", "kernel"): lambda t: t("self_attn.q_b_proj.weight").T.reshape(-1, h, hd)[..., q_cols]})
    else:
        out[("attn", "q_up", "kernel")] = lambda t: t("self_attn.q_proj.weight").T.reshape(d, h, hd)[..., q_cols]
    return out


def _latent_to_hf(m: ModelConfig) -> dict[str, Callable]:
    """MLA's projections under DeepSeek's names, its RoPE columns interleaved again (``rope_interleave``)."""
    d, h, r, p, v = m.d_model, m.n_heads, m.kv_lora_rank, m.rope_head_dim, m.v_head_dim
    q_cols, kv_cols = _latent_columns(m, _rope_columns(p, inverse=True))
    q_up = ("attn", "q_up", "kernel")
    out: dict[str, Callable] = {
        "self_attn.kv_a_proj_with_mqa.weight": lambda a: a(("attn", "kv_down", "kernel"))[:, kv_cols].T,
        "self_attn.kv_a_layernorm.weight": lambda a: a(("attn", "kv_norm", "scale")),
        "self_attn.kv_b_proj.weight": lambda a: a(("attn", "kv_up", "kernel")).reshape(r, -1).T,
        "self_attn.o_proj.weight": lambda a: a(("attn", "o", "kernel")).reshape(h * v, d).T}
    if m.q_lora_rank:
        out.update({"self_attn.q_a_proj.weight": lambda a: a(("attn", "q_down", "kernel")).T,
                    "self_attn.q_a_layernorm.weight": lambda a: a(("attn", "q_norm", "scale")),
                    "self_attn.q_b_proj.weight": lambda a: a(q_up)[..., q_cols].reshape(m.q_lora_rank, -1).T})
    else:
        out["self_attn.q_proj.weight"] = lambda a: a(q_up)[..., q_cols].reshape(d, -1).T
    return out


def _to_jaxpar(arch: str, m: ModelConfig, mc, moe: bool = False, interleaved: bool = True) -> dict[tuple, Callable]:
    """``{path: fn(t)}``: each parameter's builder of one layer, a dense or (``moe``) a MoE one (``mc``: the
    ``moe`` config; ``interleaved``: MLA's RoPE columns published in interleaved pairs)."""
    n_experts = mc.n_experts
    d, h, kv, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    g = h // kv
    if arch == "gpt2":
        def c_attn(t):
            return t("attn.c_attn.weight").reshape(d, 3, h, hd).transpose(0, 2, 1, 3)

        return {
            ("attn", "qkv", "kernel"): c_attn,
            ("attn", "q_bias"): lambda t: t("attn.c_attn.bias")[:d].reshape(h, hd),
            ("attn", "v_bias"): lambda t: t("attn.c_attn.bias")[2 * d:].reshape(h, hd),
            ("attn", "o", "kernel"): lambda t: t("attn.c_proj.weight").reshape(h, hd, d),
            ("attn", "o", "bias"): lambda t: t("attn.c_proj.bias"),
            ("mlp", "up", "kernel"): lambda t: t("mlp.c_fc.weight"),
            ("mlp", "up", "bias"): lambda t: t("mlp.c_fc.bias"),
            ("mlp", "down", "kernel"): lambda t: t("mlp.c_proj.weight"),
            ("mlp", "down", "bias"): lambda t: t("mlp.c_proj.bias"),
            ("norm1", "scale"): lambda t: t("ln_1.weight"), ("norm1", "bias"): lambda t: t("ln_1.bias"),
            ("norm2", "scale"): lambda t: t("ln_2.weight"), ("norm2", "bias"): lambda t: t("ln_2.bias"),
        }

    def qkv(t):
        q = t("self_attn.q_proj.weight").T.reshape(d, kv, g, hd)
        k = t("self_attn.k_proj.weight").T.reshape(d, kv, 1, hd)
        v = t("self_attn.v_proj.weight").T.reshape(d, kv, 1, hd)
        return np.concatenate([q, k, v], axis=2)

    def read(name: str, shape: tuple | None) -> Callable:
        return lambda t: t(name) if shape is None else t(name).reshape(shape)

    layer: dict[tuple, Callable] = (_latent_to_jaxpar(m, interleaved) if m.latent else {
        ("attn", "qkv", "kernel"): qkv,
        ("attn", "o", "kernel"): lambda t: t("self_attn.o_proj.weight").T.reshape(h, hd, d)})
    for path, name in _decoder_extras(m).items():
        layer[path] = read(name, {"q_bias": (h, hd), "k_bias": (kv, hd), "v_bias": (kv, hd)}.get(path[-1]))
    if not moe:
        layer[("mlp", "up", "kernel")] = lambda t: np.stack([t("mlp.gate_proj.weight").T, t("mlp.up_proj.weight").T],
                                                            axis=1)
        layer[("mlp", "down", "kernel")] = lambda t: t("mlp.down_proj.weight").T
        return layer
    family = FAMILIES[arch]
    if getattr(family, "EXPERTS", None) == "interleaved":  # GPT-OSS: fused, gate and up columns interleaved
        layer.update(_interleaved_to_jaxpar(mc))
        return layer
    # the experts: per expert gate, up, down as published (the family's MOE_NAMES), or transformers 5's fused
    # layout (the same names in every family)
    block, gate, up, down = family.MOE_NAMES

    def expert(t, i: int, w: str):
        return t(f"{block}.experts.{i}.{w}.weight").T

    def w_in(t):
        if t.has("mlp.experts.gate_up_proj"):
            gu = t("mlp.experts.gate_up_proj")  # [E, 2 ff, d]: gate rows, then up rows
            return gu.transpose(0, 2, 1).reshape(gu.shape[0], d, 2, gu.shape[1] // 2)
        return np.stack([np.stack([expert(t, i, gate), expert(t, i, up)], axis=1) for i in range(n_experts)])

    def w_out(t):
        if t.has("mlp.experts.down_proj"):
            return t("mlp.experts.down_proj").transpose(0, 2, 1)
        return np.stack([expert(t, i, down) for i in range(n_experts)])

    def router(t):
        return (t("mlp.gate.weight") if t.has("mlp.gate.weight") else t(f"{block}.gate.weight")).T

    layer.update({("mlp", "router"): router, ("mlp", "w_in"): w_in, ("mlp", "w_out"): w_out})
    if mc.shared_experts:
        sh = family.SHARED
        layer[("mlp", "shared", "up", "kernel")] = lambda t: np.stack([t(f"{sh}.gate_proj.weight").T,
                                                                       t(f"{sh}.up_proj.weight").T], axis=1)
        layer[("mlp", "shared", "down", "kernel")] = lambda t: t(f"{sh}.down_proj.weight").T
    if mc.router_bias or mc.bias_update_rate > 0:
        layer[("mlp", "router_bias")] = lambda t: t(family.ROUTER_BIAS)
    return layer


def _to_hf(arch: str, m: ModelConfig, mc, moe: bool = False) -> dict[str, Callable]:
    """``{layer-relative HF name: fn(p)}`` of a dense or (``moe``) a MoE layer, ``p(path)`` being one layer's
    jaxpar parameter (``mc``: the ``moe`` config)."""
    n_experts = mc.n_experts
    d, h, kv, hd = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    if arch == "gpt2":
        def c_attn_bias(p):
            return np.concatenate([p(("attn", "q_bias")).reshape(-1), np.zeros(d, p(("attn", "q_bias")).dtype),
                                   p(("attn", "v_bias")).reshape(-1)])

        return {"attn.c_attn.weight": lambda p: p(("attn", "qkv", "kernel")).transpose(0, 2, 1, 3).reshape(d, 3 * d),
                "attn.c_attn.bias": c_attn_bias,
                "attn.c_proj.weight": lambda p: p(("attn", "o", "kernel")).reshape(h * hd, d),
                "attn.c_proj.bias": lambda p: p(("attn", "o", "bias")),
                "mlp.c_fc.weight": lambda p: p(("mlp", "up", "kernel")),
                "mlp.c_fc.bias": lambda p: p(("mlp", "up", "bias")),
                "mlp.c_proj.weight": lambda p: p(("mlp", "down", "kernel")),
                "mlp.c_proj.bias": lambda p: p(("mlp", "down", "bias")),
                "ln_1.weight": lambda p: p(("norm1", "scale")), "ln_1.bias": lambda p: p(("norm1", "bias")),
                "ln_2.weight": lambda p: p(("norm2", "scale")), "ln_2.bias": lambda p: p(("norm2", "bias"))}
    g = h // kv

    def qkv_part(lo: int, hi: int):
        return lambda p: p(("attn", "qkv", "kernel"))[:, :, lo:hi].reshape(d, -1).T

    out = _latent_to_hf(m) if m.latent else {
        "self_attn.q_proj.weight": qkv_part(0, g), "self_attn.k_proj.weight": qkv_part(g, g + 1),
        "self_attn.v_proj.weight": qkv_part(g + 1, g + 2),
        "self_attn.o_proj.weight": lambda p: p(("attn", "o", "kernel")).reshape(h * hd, d).T}
    for path, name in _decoder_extras(m).items():
        out[name] = lambda p, path=path: p(path).reshape(-1) if path[-1].endswith("_bias") else p(path)
    if not moe:
        out.update({"mlp.gate_proj.weight": lambda p: p(("mlp", "up", "kernel"))[:, 0].T,
                    "mlp.up_proj.weight": lambda p: p(("mlp", "up", "kernel"))[:, 1].T,
                    "mlp.down_proj.weight": lambda p: p(("mlp", "down", "kernel")).T})
        return out
    family = FAMILIES[arch]
    if getattr(family, "EXPERTS", None) == "interleaved":
        out.update(_interleaved_to_hf(mc))
        return out
    block, gate, up, down = family.MOE_NAMES
    out[f"{block}.gate.weight"] = lambda p: p(("mlp", "router")).T
    for i in range(n_experts):
        out[f"{block}.experts.{i}.{gate}.weight"] = lambda p, i=i: p(("mlp", "w_in"))[i, :, 0].T
        out[f"{block}.experts.{i}.{up}.weight"] = lambda p, i=i: p(("mlp", "w_in"))[i, :, 1].T
        out[f"{block}.experts.{i}.{down}.weight"] = lambda p, i=i: p(("mlp", "w_out"))[i].T
    if mc.shared_experts:
        out.update({f"{family.SHARED}.gate_proj.weight": lambda p: p(("mlp", "shared", "up", "kernel"))[:, 0].T,
                    f"{family.SHARED}.up_proj.weight": lambda p: p(("mlp", "shared", "up", "kernel"))[:, 1].T,
                    f"{family.SHARED}.down_proj.weight": lambda p: p(("mlp", "shared", "down", "kernel")).T})
    if mc.router_bias or mc.bias_update_rate > 0:
        out[family.ROUTER_BIAS] = lambda p: p(("mlp", "router_bias"))
    return out


def _interleaved_to_jaxpar(mc) -> dict[tuple, Callable]:
    """GPT-OSS's MoE layer: ``mlp.router`` (weight and logit bias) and fused experts whose ``gate_up_proj [E, d,
    2F]`` (and its bias) interleave the gate (even columns) and up (odd) projections."""
    def split(a: np.ndarray) -> np.ndarray:  # [..., 2F] -> [..., 2, F]
        return np.stack([a[..., 0::2], a[..., 1::2]], axis=-2)

    out: dict[tuple, Callable] = {
        ("mlp", "router"): lambda t: t("mlp.router.weight").T,
        ("mlp", "w_in"): lambda t: split(t("mlp.experts.gate_up_proj")),
        ("mlp", "w_out"): lambda t: t("mlp.experts.down_proj")}
    if mc.router_logit_bias:
        out[("mlp", "router_logit_bias")] = lambda t: t("mlp.router.bias")
    if mc.expert_bias:
        out.update({("mlp", "b_in"): lambda t: split(t("mlp.experts.gate_up_proj_bias")),
                    ("mlp", "b_out"): lambda t: t("mlp.experts.down_proj_bias")})
    return out


def _interleaved_to_hf(mc) -> dict[str, Callable]:
    """:func:`_interleaved_to_jaxpar`'s tensors back, gate and up interleaved again."""
    def join(a: np.ndarray) -> np.ndarray:  # [..., 2, F] -> [..., 2F], gate at even columns
        return np.stack([a[..., 0, :], a[..., 1, :]], axis=-1).reshape(*a.shape[:-2], -1)

    out: dict[str, Callable] = {
        "mlp.router.weight": lambda p: p(("mlp", "router")).T,
        "mlp.experts.gate_up_proj": lambda p: join(p(("mlp", "w_in"))),
        "mlp.experts.down_proj": lambda p: p(("mlp", "w_out"))}
    if mc.router_logit_bias:
        out["mlp.router.bias"] = lambda p: p(("mlp", "router_logit_bias"))
    if mc.expert_bias:
        out.update({"mlp.experts.gate_up_proj_bias": lambda p: join(p(("mlp", "b_in"))),
                    "mlp.experts.down_proj_bias": lambda p: p(("mlp", "b_out"))})
    return out


def _layer_kinds(m: ModelConfig, mc) -> list[tuple[bool, tuple, tuple]]:
    """Each Hugging Face layer's ``(moe, stack prefix, index in the stacked parameters)``."""
    out: dict[int, tuple[bool, tuple, tuple]] = {}
    for prefix, (moe, entries, layers) in _stacks(m, mc).items():
        for g in range(entries):
            at = layers(g)
            out.update({at: (moe, prefix, (g,))} if isinstance(at, int) else
                       {i: (moe, prefix, (g, s)) for s, i in enumerate(at)})
    return [out[i] for i in range(m.n_layers)]


def _top_names(arch: str, tied: bool) -> list[str]:
    if arch == "gpt2":
        return ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    return ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])


# transformers 5's fused experts (its in-memory layout, in every MoE family; its save_pretrained writes the
# published names)
_FUSED = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# ---------------------------------------------------------------------------------------------
# Import.

class _Files:
    """The safetensors files of a model directory (:class:`jaxpar.hf_files.Safetensors`: checked against
    each other when opened), read tensor by tensor by their names with or without GPT-2's prefix."""

    def __init__(self, d: Path):
        self.d, self.files = d, Safetensors(d)
        self.where = self.files.where
        # GPT-2 checkpoints are saved with or without the GPT2LMHeadModel prefix
        self.prefix = "transformer." if any(k.startswith("transformer.") for k in self.where) else ""

    def name(self, name: str) -> str:
        full = name if name.startswith(("lm_head.", "model.")) else self.prefix + name
        if full not in self.where:
            where = INDEX if (self.d / INDEX).is_file() else SINGLE
            raise ConfigError(f"{self.d}: tensor {full!r} is missing from {where}; copy the complete model")
        return full

    def has(self, name: str) -> bool:
        return (name if name.startswith(("lm_head.", "model.")) else self.prefix + name) in self.where

    def __call__(self, name: str) -> np.ndarray:
        return self.files.read(self.name(name))


class _Layer:
    """One layer's view of :class:`_Files`: ``t("attn.c_attn.weight")``, ``t.has(name)``."""

    def __init__(self, files: _Files, prefix: str):
        self.files, self.prefix = files, prefix

    def __call__(self, name: str) -> np.ndarray:
        return self.files(self.prefix + name)

    def has(self, name: str) -> bool:
        return self.files.has(self.prefix + name)


def _pad(a: np.ndarray, size: int, axis: int) -> np.ndarray:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return np.pad(a, widths)


def _skipped(files: _Files, hf: dict, arch: str) -> list[str]:
    """The files' tensors that are not the model (the family's ``skipped``: DeepSeek-V3's multi-token
    prediction), noted on stderr once."""
    import sys

    prefixes = tuple(getattr(FAMILIES[arch], "skipped", lambda _: [])(hf))
    out = sorted(n for n in files.where if prefixes and n.startswith(prefixes))
    if out:
        print(f"note: {files.d}: {len(out)} tensor(s) of its multi-token-prediction layer(s) "
              f"({', '.join(p.rstrip('.') for p in prefixes)}: e.g. {out[0]}) are not part of the next-token model and "
              "are not loaded", file=sys.stderr)
    return out


def _check_names(files: _Files, arch: str, m: ModelConfig, mc, skipped: list[str]) -> None:
    """Every tensor in the files is one the mapping reads (else jaxpar would build a different model), but
    the family's ``skipped`` ones."""
    kinds = [moe for moe, _, _ in _layer_kinds(m, mc)]
    names = {moe: set(_to_hf(arch, m, mc, moe)) for moe in set(kinds)}
    known = {files.prefix + n if arch == "gpt2" else n for n in _top_names(arch, bool(m.tie_embeddings))}
    known |= {(files.prefix if arch == "gpt2" else "") + _layer_prefix(arch, i) + n
              for i, moe in enumerate(kinds) for n in names[moe] | (set(_FUSED) if moe else set())}
    if arch == "gpt2" or m.tie_embeddings:
        known.add("lm_head.weight")  # tied: the same matrix as the embedding
    known |= set(skipped)
    # (tensors with no element hold no weight: transformers' DeepSeek-V3 keeps 0-wide shared experts when it has none)
    extra = sorted(n for n in files.where if n not in known and not n.endswith(_BUFFERS)
                   and 0 not in files.files.shape(n))
    if extra:
        raise ConfigError(f"{files.d}: {len(extra)} tensor(s) that a {CLASSES[arch]} as jaxpar builds it does not "
                          f"have, e.g. {extra[0]!r}: refusing to load a different model")
    # ... and every tensor the mapping reads is in them (checked here, not half-way through placing)
    for name in _top_names(arch, bool(m.tie_embeddings)):
        files.name(name)
    for i, moe in enumerate(kinds):
        view = _Layer(files, _layer_prefix(arch, i))
        need = names[moe]
        if moe and view.has("mlp.experts.gate_up_proj") and not hasattr(FAMILIES[arch], "EXPERTS"):  # transformers
            # 5's fused experts
            block = FAMILIES[arch].MOE_NAMES[0]
            need = {n for n in need if n != f"{block}.gate.weight" and not n.startswith(f"{block}.experts.")}
            need |= set(_FUSED)
        for n in sorted(need):
            files.name(view.prefix + n)


def load_params(trainer, d: str | Path) -> dict:
    """The parameters of the Hugging Face model in ``d``, placed with ``trainer``'s shardings in its
    storage order (see the module docstring: each device reads only the layers it holds)."""
    d = Path(d)
    cfg = trainer.cfg
    m = cfg.model.resolved()
    hf = read_config(d)
    arch = _arch(hf, f"{d}/config.json")
    files = _Files(d)
    _check_names(files, arch, m, cfg.moe, _skipped(files, hf, arch))
    interleaved = bool(hf.get("rope_interleave", True))
    stacks = {prefix: (_to_jaxpar(arch, m, cfg.moe, moe, interleaved), layers, prefix[0] == "blocks")
              for prefix, (moe, _, layers) in _stacks(m, cfg.moe).items()}
    order = trainer.layer_order(cfg.moe.groups(m.n_layers) if m.arch == "moe" else m.n_layers)
    embed = "wte.weight" if arch == "gpt2" else "model.embed_tokens.weight"
    vp = trainer.adapter.abstract["embed"]["embedding"].shape[0]
    norm = ("ln_f" if arch == "gpt2" else "model.norm") + ".weight"
    top: dict[tuple, Callable[[], np.ndarray]] = {
        ("embed", "embedding"): lambda: _pad(files(embed), vp, 0),
        ("norm_f", "scale"): lambda: files(norm),
        ("norm_f", "bias"): lambda: files("ln_f.bias"),
        ("pos_embed",): lambda: files("wpe.weight"),  # all n_positions rows (model.max_positions)
        ("head", "kernel"): lambda: _pad(files("lm_head.weight").T, vp, 1),
    }
    shardings = trainer.state_shardings["params"]
    stored = trainer.stored_shapes(trainer.adapter.abstract)  # uneven stages: the stacked layers padded

    def entry(fn: Callable, layers: Callable[[int], int | list[int]]) -> Callable[[int], np.ndarray]:
        """Stacked entry g's parameter: its layer's, or its layers' stacked (a MoE group's dense ones)."""
        def build(g: int) -> np.ndarray:
            at = layers(g)
            if isinstance(at, int):
                return fn(_Layer(files, _layer_prefix(arch, at)))
            return np.stack([fn(_Layer(files, _layer_prefix(arch, i))) for i in at])

        return build

    out = []
    for path in trainer.adapter.paths:
        a = _at(stored, path)
        prefix = next((p for p in stacks if path[: len(p)] == p), None)
        if prefix is None:
            out.append((path, _place(a, _at(shardings, path), top[path], None)))
        else:
            per_layer, layers, ordered = stacks[prefix]
            out.append((path, _place(a, _at(shardings, path), entry(per_layer[path[len(prefix):]], layers),
                                     order if ordered else np.arange(a.shape[0]))))
    return _nest(out)


def _place(a, sharding, build, order):
    """One parameter as a global array; the callback builds the stacked entries of a device's shard
    (``build(g)``: layer g, or a MoE model's group g; ``build()``: an unstacked parameter; ``order`` the
    entry at each stored position, -1 for uneven stages' padding, zeros), once per distinct slice, and
    cuts the device's slice out of them."""
    import jax

    cache: dict = {}

    def shard(index):
        key = None if order is None else tuple(int(i) for i in order[index[0]])
        if key not in cache:
            cache.clear()
            full = build() if key is None else np.stack([build(g) if g >= 0 else np.zeros(a.shape[1:], a.dtype)
                                                         for g in key])
            cache[key] = np.asarray(full).astype(a.dtype)
        return cache[key][index if key is None else (slice(None),) + tuple(index[1:])]

    return jax.make_array_from_callback(a.shape, sharding, shard)


# ---------------------------------------------------------------------------------------------
# Export.

def _host(a) -> np.ndarray:
    """A global array on the host (gathered from every process when it spans several)."""
    if a.is_fully_addressable:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def hf_tensors(trainer, params: dict):
    """``(name, array)`` of the Hugging Face checkpoint of ``params`` (``trainer``'s storage order),
    one tensor at a time; the parameters are fetched to the host once."""
    cfg = trainer.cfg
    hf = hf_config(cfg)
    arch, m = hf["model_type"], cfg.model.resolved()
    inverse = layer_positions(trainer.layer_order(cfg.moe.groups(m.n_layers) if m.arch == "moe" else m.n_layers))
    host = {p: _host(_at(params, p)) for p in trainer.adapter.paths}
    host = {p: a[inverse] if p[0] == "blocks" else a for p, a in host.items()}
    v = m.vocab_size
    if arch == "gpt2":
        top = {"wte.weight": host["embed", "embedding"][:v], "wpe.weight": host[("pos_embed",)],
               "ln_f.weight": host["norm_f", "scale"], "ln_f.bias": host["norm_f", "bias"]}
        yield from (("transformer." + k, a) for k, a in top.items())
    else:
        yield "model.embed_tokens.weight", host["embed", "embedding"][:v]
        yield "model.norm.weight", host["norm_f", "scale"]
        if not m.tie_embeddings:
            yield "lm_head.weight", host["head", "kernel"][:, :v].T
    kinds = _layer_kinds(m, cfg.moe)
    per_layer = {moe: _to_hf(arch, m, cfg.moe, moe) for moe in {moe for moe, _, _ in kinds}}
    for i, (moe, prefix, at) in enumerate(kinds):
        name = ("transformer." if arch == "gpt2" else "") + _layer_prefix(arch, i)
        for k, fn in per_layer[moe].items():
            yield name + k, fn(lambda path, prefix=prefix, at=at: host[prefix + path][at])


def export_target(cfg: Config, out: str | Path, run: str | Path | None = None, overwrite: bool = False) -> Target:
    """Where :func:`export` would write ``out`` for the run (or ``hf:DIR``) ``run`` (default: the config's
    ``train.out_dir``), or the one-line refusal (:func:`jaxpar.hf_files.target`)."""
    source = source_of(cfg.train.out_dir if run is None else run)
    return target(out, source, overwrite, protected(cfg, source))


def export(trainer, params: dict, out: str | Path, tokenizer=None, shard_bytes: int = 4 << 30, *,
           run: str | Path | None = None, step: int | None = None, overwrite: bool = False) -> list[Path]:
    """Write ``params`` as a Hugging Face model directory ``out`` (see the module docstring: a new or
    empty directory, or the previous export of the same ``run``, replaced at once; ``overwrite`` replaces
    any other directory too); only process 0 writes. ``run``: the run directory (or ``hf:DIR``) the
    export comes from, recorded with ``step`` in ``jaxpar_export.json`` (default: the config's
    ``train.out_dir``). Returns the files written, the marker last."""
    import jax

    cfg = trainer.cfg
    hf = hf_config(cfg)  # before anything is written: a model HF cannot express is an error
    main = jax.process_index() == 0
    failed: Exception | None = None
    try:
        where = export_target(cfg, out, run, overwrite) if main else None
    except (ConfigError, ExportError) as e:
        failed = e
    if jax.process_count() > 1:  # every process gathers the weights below, or none does
        from jax.experimental import multihost_utils

        if not multihost_utils.broadcast_one_to_all(np.int32(failed is None)) and failed is None:
            failed = ExportError(f"{out}: process 0 refused the export (its error line says why)")
    if failed is not None:
        raise failed
    shards: list[dict[str, np.ndarray]] = [{}]
    size = total = 0
    for name, a in hf_tensors(trainer, params):
        a = np.ascontiguousarray(a)
        if size and size + a.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
        total += a.nbytes
    if where is None:
        return []
    names = [SINGLE] if len(shards) == 1 else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                               for i in range(len(shards))]
    writers: dict[str, Callable[[Path], object]] = {
        n: functools.partial(save, tensors=t, metadata={"format": "pt"}) for n, t in zip(names, shards)}

    def text(s: str) -> Callable[[Path], object]:
        return lambda path: path.write_text(s)

    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": {k: n for n, t in zip(names, shards) for k in t}}
        writers[INDEX] = text(json.dumps(index, indent=2))
    ids, copies = special_tokens(tokenizer, cfg.model.vocab_size)
    hf.update(ids)
    writers["config.json"] = text(json.dumps(hf, indent=2))
    if any(v is not None for v in ids.values()):
        writers["generation_config.json"] = text(json.dumps({k: v for k, v in ids.items() if v is not None}, indent=2))
    if tokenizer is not None and hasattr(tokenizer, "to_str"):
        writers["tokenizer.json"] = text(tokenizer.to_str())
        for n, src in copies.items():
            writers[n] = functools.partial(shutil.copyfile, src)
    marker = {"source": source_of(cfg.train.out_dir if run is None else run), "step": step,
              "class": hf["architectures"][0]}
    return write(where, writers, marker)


def run_config(run: str | Path, overrides: list[str]) -> Config:
    """The config of a run directory (its ``config.yaml``, read without its ``model.init_from``: the
    checkpoint holds the weights) or of a Hugging Face model directory given as ``hf:DIR``, with
    ``overrides``."""
    from jaxpar.config import load_config

    if str(run).startswith("hf:"):
        d = directory(str(run))
        given = {o.split("=", 1)[0].strip() for o in overrides}
        missing = ConfigError(f"{d} has no tokenizer.json: give data.tokenizer=PATH (a tokenizer.json) or "
                              "data.tokenizer=byte")
        if "data.tokenizer" not in given and not (d / "tokenizer.json").is_file():
            raise missing  # (before load_config's note says the same)
        cfg = load_config(None, [f"model.init_from={run}", *overrides])
        if cfg.data.tokenizer == "bpe":
            raise missing
        return cfg
    run = Path(run)
    if not run.is_dir():
        raise ConfigError(f"{run} is not a run directory (it {'is a file' if run.exists() else 'does not exist'}); "
                          "give the train.out_dir of a run with a checkpoint, or hf:DIR for a Hugging Face model "
                          "directory")
    if not (run / "config.yaml").is_file():
        raise ConfigError(f"{run} is not a run directory (no config.yaml); give a train.out_dir of a finished "
                          "or saved run, or hf:DIR for a Hugging Face model directory")
    return load_config(run / "config.yaml", ["model.init_from=", *overrides])


def open_run(run: str | Path, overrides: list[str]) -> tuple:
    """``(trainer, params, step, tokenizer)`` of a run directory's newest checkpoint (``step``), or of a
    Hugging Face model directory given as ``hf:DIR`` (``step`` None), on the mesh the config and
    ``overrides`` describe (simulated on a host without accelerators, as by ``train.py``)."""
    from jaxpar.checkpoint import CheckpointError, Checkpointer
    from jaxpar.data.sources import make_source
    from jaxpar.mesh import setup_devices
    from jaxpar.trainer import Trainer

    cfg = run_config(run, overrides)
    setup_devices(cfg.parallel, cfg.distributed)
    if str(run).startswith("hf:"):
        from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer

        trainer = Trainer(cfg)
        tokenizer = ByteTokenizer() if cfg.data.tokenizer == "byte" else BPETokenizer.load(cfg.data.tokenizer)
        return trainer, load_params(trainer, directory(cfg.model.init_from)), None, tokenizer
    ckdir = Path(cfg.checkpoint.dir or Path(run) / "checkpoints")
    again = "train the run until it saves one (checkpoint.enabled=true)"
    if not ckdir.is_dir():  # (a Checkpointer would create it)
        raise CheckpointError(f"{ckdir} does not exist: the run holds no checkpoint to read; {again}")
    ckpt = Checkpointer(ckdir, keep=cfg.checkpoint.keep, async_save=False)
    steps = ckpt.steps()
    if not steps:
        ckpt.close()
        raise CheckpointError(f"{ckdir} holds no complete checkpoint to read; {again}")
    trainer = Trainer(cfg)
    now = cfg.to_dict()
    del now["model"]["init_from"]  # (cleared above on purpose: not a change a refusal should name)
    state = trainer.state_from_layer_order(ckpt.restore(steps[-1], trainer.abstract_layer_state, now)[0])
    ckpt.close()
    return trainer, state["params"], steps[-1], make_source(cfg, trainer.local_rows(), lambda *_: None).tokenizer


@command("nothing was written")
def main(argv: list[str] | None = None) -> int:
    """``python -m jaxpar.hf RUN_DIR OUT_DIR [--overwrite] [key=value ...]``: write a run's newest checkpoint
    (or ``hf:DIR``'s weights) as a Hugging Face model directory (``config.json``, safetensors,
    ``tokenizer.json``); OUT_DIR new, empty or this run's previous export, replaced at once."""
    import sys

    from jaxpar.checkpoint import CheckpointError
    from jaxpar.distributed import ClusterError
    from jaxpar.mesh import PlatformError

    ap = ArgumentParser(prog="python -m jaxpar.hf", description=main.__doc__)
    ap.add_argument("run", help="a run directory (train.out_dir) with checkpoints, or hf:DIR")
    ap.add_argument("out", help="the Hugging Face model directory to write: new, empty, or this run's export")
    ap.add_argument("--shard-gb", type=SIZE, default=4.0, help="largest safetensors file, in GiB (default 4)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace OUT_DIR whatever it holds (all of it, at once); never the run, its checkpoints, "
                         "data or tokenizer, or the model it was imported from")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.data=1 (the mesh to load on)")
    a = ap.parse_intermixed_args(argv)
    try:
        cfg = run_config(a.run, a.overrides)
        hf_config(cfg)  # a model no family expresses, and a target to refuse: before the checkpoint is read
        export_target(cfg, a.out, a.run, a.overwrite)
        trainer, params, step, tokenizer = open_run(a.run, a.overrides)
        files = export(trainer, params, a.out, tokenizer, shard_bytes=int(a.shard_gb * 2**30), run=a.run,
                       step=step, overwrite=a.overwrite)
    except (ConfigError, CheckpointError, ExportError, PlatformError, ClusterError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    print(f"wrote {a.run}{'' if step is None else f' step {step}'} as {CLASSES[hf_config(trainer.cfg)['model_type']]} "
          f"to {a.out}: " + ", ".join(f.name for f in files))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
