"""Qwen3-MoE: Qwen3's attention (QK-norm, a head width of its own, no biases) with a Mixture-of-Experts
feed-forward: a softmax router (``mlp.gate``) choosing ``num_experts_per_tok`` of ``num_experts`` SwiGLU
experts of width ``moe_intermediate_size``, the gates renormalised over the chosen ones when
``norm_topk_prob``, no shared expert.

Layer i is MoE when ``(i + 1) % decoder_sparse_step == 0`` and i is not in ``mlp_only_layers``, the
others dense SwiGLU MLPs of ``intermediate_size``: jaxpar's ``moe.every = decoder_sparse_step`` (groups
of ``every - 1`` dense layers and one MoE layer, :mod:`models.moe`). A pattern that is not that (a step
that does not divide the layers, ``mlp_only_layers`` naming a layer the step makes MoE) is refused by
name; entries of ``mlp_only_layers`` that are dense anyway change nothing and are accepted.

``router_aux_loss_coef`` c: transformers' ``load_balancing_loss_func`` here is Mixtral's (top_k x jaxpar's
balance for one layer, the MoE layers' tokens pooled), so ``moe.aux_loss_weight = c * top_k / L`` with L
the number of MoE layers, ``num_hidden_layers / decoder_sparse_step`` (see :mod:`jaxpar.layers.moe`).
"""

from __future__ import annotations

from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.families.common import MOE_PLAIN, decoder_config, decoder_keys, full_attention_only, require

MODEL_TYPE, CLASS = "qwen3_moe", "Qwen3MoeForCausalLM"

# the MoE layer's weight names (jaxpar.hf): the module holding the router (``{module}.gate.weight``) and the
# experts (``{module}.experts.{i}.{w}.weight``), and each expert's gate, up and down projection (w)
MOE_NAMES = ("mlp", "gate_proj", "up_proj", "down_proj")


def _every(hf: dict, where: str) -> int:
    """``moe.every`` of the MoE layers' pattern (``decoder_sparse_step``, ``mlp_only_layers``)."""
    n, step = hf["num_hidden_layers"], hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1 or n % step:
        raise ConfigError(f"{where}: decoder_sparse_step={step!r} with num_hidden_layers={n} is not supported by "
                          "jaxpar (moe.every makes layers every-1, 2*every-1, ... MoE and needs the step to divide "
                          "the layers: no dense layers after the last MoE one)")
    only = hf.get("mlp_only_layers") or []
    moved = sorted(i for i in only if isinstance(i, int) and 0 <= i < n and (i + 1) % step == 0)
    if moved:
        raise ConfigError(f"{where}: mlp_only_layers={only!r} is not supported by jaxpar (it makes layer(s) {moved} "
                          f"dense where decoder_sparse_step={step} puts a MoE layer; jaxpar's moe.every builds "
                          "layers every-1, 2*every-1, ... as MoE and the others dense: needs [])")
    return step


def config_keys(hf: dict, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    full_attention_only(hf, where)
    require(hf, where, "attention_bias", lambda v: not v, "false", False)
    experts = hf.get("num_experts", hf.get("num_local_experts", 128))
    require(hf, where, "num_experts", lambda v: v >= 1, ">= 1; a model without experts is a qwen3 one", experts)
    every, k = _every(hf, where), hf.get("num_experts_per_tok", 8)
    hard = {"model.arch": "moe", **MOE_PLAIN, **decoder_keys(hf, where), "model.qk_norm": True,
            "moe.n_experts": experts, "moe.top_k": k, "moe.every": every,
            "moe.d_ff": hf.get("moe_intermediate_size", 768), "moe.score": "softmax",
            "moe.renormalize": bool(hf.get("norm_topk_prob", False)), "moe.shared_experts": 0,
            "moe.bias_update_rate": 0.0}
    n_moe = hf["num_hidden_layers"] // every
    soft = {"moe.dropless": True, "moe.aux_loss_weight": hf.get("router_aux_loss_coef", 0.001) * k / n_moe}
    return hard, soft


def to_hf(m, moe) -> dict[str, Any]:
    return {**decoder_config(m), "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "num_experts": moe.n_experts, "num_experts_per_tok": moe.top_k, "moe_intermediate_size": moe.d_ff or m.d_ff,
            "decoder_sparse_step": moe.every, "mlp_only_layers": [], "norm_topk_prob": moe.renormalize,
            "router_aux_loss_coef": moe.aux_loss_weight * (m.n_layers // moe.every) / moe.top_k}
