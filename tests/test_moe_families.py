"""Qwen3-MoE (``qwen3_moe``) against `transformers` itself: Qwen3's attention (QK-norm, a head width of its
own) with a softmax top-k router over SwiGLU experts, the gates renormalised (``norm_topk_prob``) or not,
every layer MoE (``decoder_sparse_step=1``) or dense and MoE layers alternating (2: ``moe.every``).

References, all independent of jaxpar: transformers' forward (fp32 logits < 1e-4, on one device and on
expert x data, expert x tensor and pipe x expert under 1F1B), the float64 numpy cross-entropy of those
logits (the training loss), transformers' own ``load_balancing_loss_func`` of each MoE layer's router
logits (the balance loss), transformers' router module (the experts chosen and their gates), transformers'
greedy ``generate``, and the input safetensors (an unmodified import exports bit-identically).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import hf
from jaxpar.config import ConfigError, load_config
from helpers import assert_same_safetensors, ce64, hf_greedy, jaxpar_greedy, randomize, torch_logits, with_config
from helpers import trainer as Trainer

torch = transformers = None


def libs() -> None:
    global torch, transformers
    if torch is None:
        torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")


V, T, B = 300, 16, 8
BASE = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
MODELS = {
    # every layer MoE: top-2 of 8, renormalised
    "every1": dict(num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=24, num_experts=8,
                   num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, router_aux_loss_coef=0.02),
    # dense, MoE, dense, MoE: top-3 of 4, the chosen probabilities as they are
    "every2": dict(num_hidden_layers=4, intermediate_size=40, moe_intermediate_size=16, num_experts=4,
                   num_experts_per_tok=3, norm_topk_prob=False, decoder_sparse_step=2, router_aux_loss_coef=0.01),
}
LAYOUTS = {
    "1": [],
    "ed": ["parallel.expert=2", "parallel.data=2"],
    "et": ["parallel.expert=2", "parallel.tensor=2"],
    "pe": ["parallel.pipe=2", "parallel.expert=2", "parallel.pipeline_schedule=1f1b", "parallel.microbatches=2"],
}
SLOW = pytest.mark.slow  # multi-axis layouts and generation (the one-device cases stay in the quick tier)

_dirs: dict = {}
_imported: dict = {}


def build(name: str):
    """A small ``transformers`` Qwen3-MoE with every weight random (norms, QK-norms and routers included)."""
    libs()
    torch.manual_seed(len(name))
    return randomize(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**BASE, **MODELS[name])))


def hf_dir(name: str, tmp_path_factory):
    """The model saved by ``save_pretrained`` (once per process), and the model."""
    if name not in _dirs:
        model = build(name)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        _dirs[name] = (d, model)
    return _dirs[name]


def importer(name: str, layout: str, tmp_path_factory):
    """``(trainer, params)`` of the saved model imported on ``layout`` (once per process)."""
    if (name, layout) not in _imported:
        d, _ = hf_dir(name, tmp_path_factory)
        cfg = load_config(None, [f"model.init_from=hf:{d}", f"model.seq_len={T}", f"train.batch_size={B}",
                                 "data.tokenizer=byte", *LAYOUTS[layout]])
        trainer = Trainer(cfg)
        _imported[name, layout] = (trainer, hf.load_params(trainer, d))
    return _imported[name, layout]


def tokens(b=B, seed=0, t=T + 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (b, t)).astype(np.int32)


CASES = [("every1", "1"), ("every2", "1"), pytest.param("every1", "ed", marks=SLOW),
         pytest.param("every2", "ed", marks=SLOW), pytest.param("every1", "et", marks=SLOW),
         pytest.param("every2", "et", marks=SLOW), pytest.param("every1", "pe", marks=SLOW),
         pytest.param("every2", "pe", marks=SLOW)]


@pytest.mark.parametrize("name,layout", CASES)
def test_import_matches_transformers(tmp_path_factory, name, layout):
    """Logits equal transformers' forward; the training loss (each layout's own path: expert all-to-all
    rounds, 1F1B) equals the float64 cross-entropy of transformers' logits; on one device, each MoE
    layer's balance loss is transformers' ``load_balancing_loss_func`` of that layer over top_k."""
    d, model = hf_dir(name, tmp_path_factory)
    seq = tokens()
    with torch.no_grad():
        out = model(torch.as_tensor(seq[:, :-1], dtype=torch.long), output_router_logits=True)
    ref = out.logits.numpy()
    trainer, params = importer(name, layout, tmp_path_factory)
    cfg = trainer.cfg
    assert (cfg.model.arch, cfg.model.qk_norm, cfg.moe.every) == ("moe", True, MODELS[name]["decoder_sparse_step"])
    got = np.asarray(trainer.logits(params, jnp.asarray(seq[:, :-1])))[..., :V]
    assert np.max(np.abs(got - ref)) < 1e-4, np.max(np.abs(got - ref))
    batch = trainer.place_batch({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    _, aux = jax.jit(trainer.loss_fn)(params, batch)
    want = ce64(ref, seq[:, 1:])
    assert abs(float(aux["ce_loss"]) - want) < 1e-5 * want
    if layout != "1":
        return
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    k, e = MODELS[name]["num_experts_per_tok"], MODELS[name]["num_experts"]
    per_layer = [float(load_balancing_loss_func((g,), e, k)) for g in out.router_logits]  # one MoE layer each
    assert len(per_layer) == MODELS[name]["num_hidden_layers"] // cfg.moe.every
    np.testing.assert_allclose(k * float(aux["moe_aux_loss"]), np.mean(per_layer), rtol=1e-5)
    # the weight: router_aux_loss_coef * top_k / (MoE layers), exact for one layer, at balance for any
    assert cfg.moe.aux_loss_weight == pytest.approx(MODELS[name]["router_aux_loss_coef"] * k / len(per_layer))


def test_router_chooses_transformers_experts_and_gates(tmp_path_factory):
    """For random hidden states, jaxpar's routing (:func:`jaxpar.layers.moe.route` of the imported router)
    picks transformers' router's experts, best first, with its gates (renormalised or not)."""
    from jaxpar.layers.moe import route

    for name in MODELS:
        _, model = hf_dir(name, tmp_path_factory)
        trainer, params = importer(name, "1", tmp_path_factory)
        m = trainer.cfg.moe
        h = np.random.default_rng(7).normal(size=(64, 32)).astype(np.float32)
        routers = np.asarray(params["blocks"]["moe"]["mlp"]["router"])  # [MoE layers, d, E], layer order
        moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        assert len(moe_layers) == len(routers)
        for block, w in zip(moe_layers, routers):
            with torch.no_grad():
                _, gates, experts = block.gate(torch.as_tensor(h))
            logits = jnp.einsum("gd,de->ge", jnp.asarray(h), jnp.asarray(w))
            r = route(logits, m.top_k, len(h), m.renormalize, m.score)
            np.testing.assert_array_equal(np.asarray(r.experts), experts.numpy())
            np.testing.assert_allclose(np.asarray(r.gates), gates.numpy(), rtol=1e-5, atol=1e-6)
        if not m.renormalize:
            assert float(np.max(np.asarray(r.gates).sum(-1))) < 1 - 1e-3  # (the gates are the raw probabilities)


@SLOW
def test_greedy_generation_matches_transformers(tmp_path_factory):
    """Greedy tokens equal transformers' greedy ``generate``, 20 tokens past prompts of 3 and 6 (dense and
    MoE layers alternating, the gates not renormalised)."""
    d, model = hf_dir("every2", tmp_path_factory)
    prompts = [[5, 17, 33, 2, 250, 7], [9, 9, 100]]
    assert jaxpar_greedy(d, prompts, 20, V, "model.seq_len=32") == hf_greedy(model, prompts, 20)


@pytest.mark.parametrize("name,layout", [("every1", "et"), ("every2", "pe")])
def test_export_is_bit_identical_and_loads_in_transformers(tmp_path_factory, tmp_path, name, layout):
    """An unmodified import (experts split over expert x tensor; pipeline stages of dense and MoE layers)
    exports the input's tensors bit for bit (names included: the published per-expert names), its
    ``config.json`` is the same model (the same jaxpar keys, the same transformers config), and
    transformers loads the export with the input's logits."""
    d, model = hf_dir(name, tmp_path_factory)
    trainer, params = importer(name, layout, tmp_path_factory)
    hf.export(trainer, params, tmp_path)
    assert_same_safetensors(d, tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "np") as f:  # the published per-expert names
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in f.keys())
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["architectures"] == ["Qwen3MoeForCausalLM"] and conf["model_type"] == "qwen3_moe"
    given = json.loads((d / "config.json").read_text())
    assert hf.config_keys(conf) == hf.config_keys(given)
    a, b = (transformers.AutoConfig.from_pretrained(str(x)).to_dict() for x in (d, tmp_path))
    for key in ("num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                "decoder_sparse_step", "mlp_only_layers", "norm_topk_prob", "head_dim", "rope_parameters",
                "use_sliding_window", "sliding_window", "tie_word_embeddings", "max_position_embeddings"):
        assert a[key] == b[key], key
    assert b["router_aux_loss_coef"] == pytest.approx(a["router_aux_loss_coef"])
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    seq = tokens(seed=3)[:, :-1]
    np.testing.assert_array_equal(torch_logits(again, seq), torch_logits(model, seq))


def test_patterns_jaxpar_cannot_express_are_one_error_naming_the_field(tmp_path_factory, tmp_path):
    """``mlp_only_layers`` that makes a MoE layer dense, a step that leaves dense layers after the last MoE
    one, sliding windows, a model without experts: one ConfigError naming the field. ``mlp_only_layers``
    naming layers the step makes dense anyway is the same model. A MoE model no family expresses is
    refused by the export, by key."""
    d1, _ = hf_dir("every1", tmp_path_factory)
    d2, _ = hf_dir("every2", tmp_path_factory)
    for d, change, field in [(d1, {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\]"),
                             (d2, {"mlp_only_layers": [0, 1]}, r"mlp_only_layers=\[0, 1\]"),
                             (d2, {"decoder_sparse_step": 3}, "decoder_sparse_step=3"),
                             (d1, {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window=True"),
                             (d1, {"num_experts": 0, "num_local_experts": 0}, "num_experts=0"),
                             (d1, {"attention_bias": True}, "attention_bias=True")]:
        with pytest.raises(ConfigError, match=field) as e:
            load_config(None, [with_config(tmp_path, d, change)])
        assert str(e.value).count("\n") == 0
    same = load_config(None, [with_config(tmp_path, d2, {"mlp_only_layers": [0, 2]})])
    assert (same.moe.every, same.model.d_ff, same.moe.d_ff) == (2, 40, 16)
    for over, key in [(["moe.shared_experts=1"], "moe.shared_experts"), (["moe.score=sigmoid"], "moe.score"),
                      (["model.sliding_window=8"], "model.sliding_window")]:
        cfg = load_config(None, ["model.arch=moe", "model.style=llama", "model.qk_norm=true", *over])
        with pytest.raises(ConfigError, match=f"{key}=.* cannot be exported: a Hugging Face qwen3_moe model"):
            hf.hf_config(cfg)
    # Mixtral's has no dense layers: a MoE model without QK-norm and with them is refused by that key
    with pytest.raises(ConfigError, match="moe.every=2 cannot be exported: a Hugging Face mixtral model"):
        hf.hf_config(load_config(None, ["model.arch=moe", "model.style=llama", "model.n_layers=4", "moe.every=2"]))
