"""DeepSeek-V3 (``deepseek_v3``) against `transformers` itself: Multi-head Latent Attention (low-rank queries or
one query projection, the compressed KV latent with its decoupled RoPE key, interleaved RoPE pairs, YaRN with
``mscale_all_dim``), sigmoid routing with the selection-only correction bias, group-limited top-k, scaled
gates, a shared expert and dense first layers.

References, all independent of jaxpar: transformers' forward (fp32 logits < 1e-4; on one device and on expert
x data, expert x tensor, pipe x expert under 1F1B, and MLA's heads over tensor with the sequence over seq in
each context-parallel strategy), the float64 numpy cross-entropy of those logits (the training loss),
transformers' router module (experts and gates), transformers' greedy ``generate``, the input safetensors
(an unmodified import exports bit-identically), and a hand count of MLA's cache bytes read from the
compiled decode program.
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
BASE = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
            rms_norm_eps=1e-5, tie_word_embeddings=False, intermediate_size=48, moe_intermediate_size=16,
            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, kv_lora_rank=12, num_nextn_predict_layers=0)
MODELS = {
    # V3's shape: low-rank queries, one dense layer then MoE ones, 8 experts in 4 groups (2 chosen), top-3,
    # renormalised and scaled gates, a shared expert
    "v3": dict(num_hidden_layers=3, first_k_dense_replace=1, q_lora_rank=20, n_routed_experts=8,
               num_experts_per_tok=3, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
               norm_topk_prob=True),
    # V2-Lite-sized choices: one query projection, no dense layer, no groups, raw gates, two shared experts,
    # YaRN RoPE whose mscale_all_dim scales the scores
    "lite": dict(num_hidden_layers=2, first_k_dense_replace=0, q_lora_rank=None, n_routed_experts=4,
                 num_experts_per_tok=2, n_shared_experts=2, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                 norm_topk_prob=False,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "mscale": 0.707, "mscale_all_dim": 0.707}),
}
LAYOUTS = {
    "1": [],
    "ed": ["parallel.expert=2", "parallel.data=2"],
    "et": ["parallel.expert=2", "parallel.tensor=2"],
    "pe": ["parallel.pipe=2", "parallel.expert=2", "parallel.pipeline_schedule=1f1b", "parallel.microbatches=2"],
    # MLA's heads over tensor, the sequence over seq: each context-parallel strategy
    "ring": ["parallel.seq=2", "parallel.tensor=2", "parallel.seq_attention=ring"],
    "gather": ["parallel.seq=2", "parallel.expert=2", "parallel.seq_attention=all_gather"],
    "ulysses": ["parallel.seq=2", "parallel.tensor=2", "parallel.seq_attention=ulysses"],
}
SLOW = pytest.mark.slow

_dirs: dict = {}
_imported: dict = {}


def build(name: str):
    """A small ``transformers`` DeepSeek-V3 with every weight random (norms, routers and the correction bias
    included); its experts run by the eager loop (the reference)."""
    libs()
    torch.manual_seed(len(name))
    conf = transformers.DeepseekV3Config(**BASE, **MODELS[name], experts_implementation="eager")
    model = randomize(transformers.DeepseekV3ForCausalLM(conf))
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def hf_dir(name: str, tmp_path_factory):
    if name not in _dirs:
        model = build(name)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        _dirs[name] = (d, model)
    return _dirs[name]


def importer(name: str, layout: str, tmp_path_factory):
    if (name, layout) not in _imported:
        d, _ = hf_dir(name, tmp_path_factory)
        cfg = load_config(None, [f"model.init_from=hf:{d}", f"model.seq_len={T}", f"train.batch_size={B}",
                                 "data.tokenizer=byte", *LAYOUTS[layout]])
        trainer = Trainer(cfg)
        _imported[name, layout] = (trainer, hf.load_params(trainer, d))
    return _imported[name, layout]


def tokens(b=B, seed=0, t=T + 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (b, t)).astype(np.int32)


CASES = [("v3", "1"), ("lite", "1")] + [pytest.param(n, lay, marks=SLOW) for n, lay in [
    ("v3", "ed"), ("v3", "et"), ("v3", "pe"), ("lite", "pe"), ("v3", "ring"), ("lite", "gather"), ("v3", "ulysses")]]


@pytest.mark.parametrize("name,layout", CASES)
def test_import_matches_transformers(tmp_path_factory, name, layout):
    """Logits equal transformers' forward and the training loss (each layout's own path) the float64
    cross-entropy of transformers' logits."""
    _, model = hf_dir(name, tmp_path_factory)
    seq = tokens()
    ref = torch_logits(model, seq[:, :-1])
    trainer, params = importer(name, layout, tmp_path_factory)
    m, e = trainer.cfg.model, trainer.cfg.moe
    assert (m.kv_lora_rank, m.head_dim, m.v_head_dim, e.first_dense, e.score, e.router_bias) == (
        12, 24, 12, MODELS[name]["first_k_dense_replace"], "sigmoid", True)
    got = np.asarray(trainer.logits(params, jnp.asarray(seq[:, :-1])))[..., :V]
    assert np.max(np.abs(got - ref)) < 1e-4, np.max(np.abs(got - ref))
    batch = trainer.place_batch({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    _, aux = jax.jit(trainer.loss_fn)(params, batch)
    want = ce64(ref, seq[:, 1:])
    assert abs(float(aux["ce_loss"]) - want) < 1e-5 * want


def test_yarn_mscale_sets_the_attention_scale(tmp_path_factory):
    """``mscale_all_dim`` multiplies the scores by ``(0.1 * mscale_all_dim * ln(factor) + 1)^2`` (a hand
    value here), and RoPE's cos and sin by the ratio of the two mscales (1 when equal)."""
    d, _ = hf_dir("lite", tmp_path_factory)
    cfg = load_config(None, [f"model.init_from=hf:{d}"])
    m = 0.1 * 0.707 * np.log(4.0) + 1
    assert cfg.model.attn_scale == pytest.approx(24 ** -0.5 * m * m)
    assert cfg.model.rope_scaling == "yarn" and cfg.model.yarn_attention_factor() == pytest.approx(1.0)


def test_router_chooses_transformers_experts_and_gates(tmp_path_factory):
    """For random hidden states, jaxpar's routing of the imported router and correction bias picks
    transformers' router's experts (as a set: its top-k is unsorted) with their gates: sigmoid scores,
    the bias choosing only, group-limited, renormalised and scaled."""
    from jaxpar.layers.moe import route

    for name in MODELS:
        _, model = hf_dir(name, tmp_path_factory)
        trainer, params = importer(name, "1", tmp_path_factory)
        c = trainer.cfg.moe
        h = np.random.default_rng(7).normal(size=(64, 32)).astype(np.float32)
        mlp = params["blocks"]["moe"]["mlp"]
        routers, biases = np.asarray(mlp["router"]), np.asarray(mlp["router_bias"])
        moe_layers = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")]
        assert len(moe_layers) == len(routers) and np.any(biases != 0)
        for block, w, bias in zip(moe_layers, routers, biases):
            with torch.no_grad():
                _, gates, experts = block.gate(torch.as_tensor(h))
            logits = jnp.einsum("gd,de->ge", jnp.asarray(h), jnp.asarray(w))
            r = route(logits, c.top_k, len(h), c.renormalize, c.score, jnp.asarray(bias), c.n_group, c.topk_group,
                      c.routed_scaling_factor)
            order = np.argsort(experts.numpy(), axis=-1)
            mine = np.argsort(np.asarray(r.experts), axis=-1)
            np.testing.assert_array_equal(np.take_along_axis(np.asarray(r.experts), mine, -1),
                                          np.take_along_axis(experts.numpy(), order, -1))
            np.testing.assert_allclose(np.take_along_axis(np.asarray(r.gates), mine, -1),
                                       np.take_along_axis(gates.numpy(), order, -1), rtol=1e-5, atol=1e-6)


@SLOW
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_generation_matches_transformers(tmp_path_factory, name):
    """Greedy tokens from the compressed cache equal transformers' greedy ``generate`` (its cache holds full
    keys and values), 20 tokens past prompts of 3 and 6."""
    d, model = hf_dir(name, tmp_path_factory)
    prompts = [[5, 17, 33, 2, 250, 7], [9, 9, 100]]
    assert jaxpar_greedy(d, prompts, 20, V, "model.seq_len=32") == hf_greedy(model, prompts, 20)


def test_compressed_cache_equals_full_attention_and_holds_the_latent_only(tmp_path_factory):
    """The cache path (prefill, then one token at a time through the absorbed projections) gives the
    logits of the training forward (full K/V), and the compiled decode program's cache arguments grow by
    (kv_lora_rank + rope_head_dim) x 4 bytes per position, row and layer: 20 x 4 here, against
    2 x heads x head_dim x 4 = 768 for full keys and values."""
    from flax import nnx

    from jaxpar.generate import empty_cache, forward

    trainer, params = importer("v3", "1", tmp_path_factory)
    model = trainer.adapter.model(params)
    seq = jnp.asarray(tokens(b=2, t=12))
    full = np.asarray(model(seq))[..., :V]
    cache = empty_cache(model, 2, 16)
    logits, cache = forward(model, seq[:, :5], jnp.broadcast_to(jnp.arange(5), (2, 5)), cache)
    steps = [np.asarray(logits)]
    for i in range(5, 12):
        logits, cache = forward(model, seq[:, i:i + 1], jnp.full((2, 1), i), cache)
        steps.append(np.asarray(logits))
    got = np.concatenate(steps, axis=1)[..., :V]
    assert np.max(np.abs(got - full)) < 2e-5, np.max(np.abs(got - full))

    graphdef, state = nnx.split(model)

    def arg_bytes(positions: int) -> int:
        def step(state, tok, pos, cache):
            return forward(nnx.merge(graphdef, state), tok, pos, cache)

        c = empty_cache(model, 2, positions)
        compiled = jax.jit(step).lower(state, seq[:, :1], jnp.zeros((2, 1), jnp.int32), c).compile()
        return compiled.memory_analysis().argument_size_in_bytes

    per_position = (arg_bytes(48) - arg_bytes(16)) / (32 * 2 * 3)  # positions, rows, layers
    assert per_position == (12 + 8) * 4


def test_mtp_layers_are_skipped_with_a_note(tmp_path_factory, tmp_path, capfd):
    """A checkpoint with DeepSeek's multi-token-prediction layer (``num_nextn_predict_layers``: tensors of
    ``model.layers.{num_hidden_layers}``) imports the next-token model, the same logits, noting the skip."""
    from safetensors.numpy import load_file, save_file

    d, model = hf_dir("v3", tmp_path_factory)
    tensors = load_file(str(d / "model.safetensors"))
    tensors.update({"model.layers.3.eh_proj.weight": np.ones((32, 64), np.float32),
                    "model.layers.3.enorm.weight": np.ones(32, np.float32)})
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads((d / "config.json").read_text())
    conf["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(conf))
    cfg = load_config(None, [f"model.init_from=hf:{tmp_path}", f"model.seq_len={T}", f"train.batch_size={B}",
                             "data.tokenizer=byte"])
    trainer = Trainer(cfg)
    params = hf.load_params(trainer, tmp_path)
    assert "2 tensor(s) of its multi-token-prediction layer(s) (model.layers.3" in capfd.readouterr().err
    seq = tokens()[:, :-1]
    got = np.asarray(trainer.logits(params, jnp.asarray(seq)))[..., :V]
    assert np.max(np.abs(got - torch_logits(model, seq))) < 1e-4
    conf["num_nextn_predict_layers"] = 0  # the same tensors without the field: a model jaxpar would not build
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="2 tensor\\(s\\) that a DeepseekV3ForCausalLM"):
        hf.load_params(trainer, tmp_path)


@pytest.mark.parametrize("name,layout", [("v3", "pe"), pytest.param("lite", "et", marks=SLOW)])
def test_export_is_bit_identical_and_trained_export_loads(tmp_path_factory, tmp_path, name, layout):
    """An unmodified import (pipeline stages with the dense first layer on the first; experts over expert x
    tensor) exports the input's tensors bit for bit (RoPE columns interleaved again), its ``config.json`` is
    the same model, and after two training steps the export loads in transformers with jaxpar's logits."""
    d, _ = hf_dir(name, tmp_path_factory)
    trainer, params = importer(name, layout, tmp_path_factory)
    hf.export(trainer, params, tmp_path / "same")
    assert_same_safetensors(d, tmp_path / "same")
    conf = json.loads((tmp_path / "same" / "config.json").read_text())
    assert conf["architectures"] == ["DeepseekV3ForCausalLM"] and conf["rope_interleave"] is True
    for have, want in zip(hf.config_keys(conf), hf.config_keys(json.loads((d / "config.json").read_text()))):
        assert have.keys() == want.keys()
        for k in have:  # (YaRN's mscale_all_dim is written back from the scale: equal up to round-off)
            assert have[k] == (pytest.approx(want[k], rel=1e-12) if isinstance(want[k], float) else want[k]), k

    state = trainer.init_state(params)
    for i in range(2):
        seq = tokens(seed=10 + i)
        state, _ = trainer.step(state, trainer.place_batch({"inputs": seq[:, :-1], "targets": seq[:, 1:]}))
    hf.export(trainer, state["params"], tmp_path / "trained")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32,
                                                              experts_implementation="eager").eval()
    seq = tokens(seed=3)[:, :-1]
    got = np.asarray(trainer.logits(state["params"], jnp.asarray(seq)))[..., :V]
    assert np.max(np.abs(got - torch_logits(model, seq))) < 1e-4


def test_what_jaxpar_cannot_express_is_one_error_naming_the_field(tmp_path_factory, tmp_path):
    """Attention biases, softmax scoring, another top-k method, MoE on every other layer, no MoE layer at
    all, KV heads that are not the heads: one ConfigError naming the field. MLA's keys without MLA, and MLA
    with a switch it cannot take, are refused by key; a DeepSeek model with QK-norm cannot be exported."""
    d, _ = hf_dir("v3", tmp_path_factory)
    for change, field in [({"attention_bias": True}, "attention_bias=True"),
                          ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
                          ({"topk_method": "greedy"}, "topk_method='greedy'"),
                          ({"moe_layer_freq": 2}, "moe_layer_freq=2"),
                          ({"first_k_dense_replace": 3}, "first_k_dense_replace=3"),
                          ({"num_key_value_heads": 2}, "num_key_value_heads=2")]:
        with pytest.raises(ConfigError, match=field) as e:
            load_config(None, [with_config(tmp_path, d, change)])
        assert str(e.value).count("\n") == 0
    with pytest.raises(ConfigError, match="model.q_lora_rank=8 configures Multi-head Latent Attention"):
        load_config(None, ["model.style=llama", "model.q_lora_rank=8"])
    mla = ["model.style=llama", "model.kv_lora_rank=8", "model.rope_head_dim=8", "model.head_dim=24"]
    for over, key in [(["model.qk_norm=true"], "model.qk_norm"), (["model.n_kv_heads=2"], "model.n_kv_heads"),
                      (["model.rope_head_dim=24"], "model.rope_head_dim")]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [*mla, *over])
    with pytest.raises(ConfigError, match="moe.first_dense=4 leaves no MoE layer"):
        load_config(None, ["model.arch=moe", *mla, "moe.first_dense=4"])


# DeepSeek-V3's switches on a tiny model: MLA, a dense first layer, sigmoid group-limited routing with bias
# balancing, a shared expert; router losses off (they are per routing group, and a pipeline's groups are its
# microbatches: see test_moe)
SWITCHES = dict(model__arch="moe", model__n_layers=3, model__head_dim=16, model__kv_lora_rank=12,
                model__q_lora_rank=20, model__rope_head_dim=8, model__v_head_dim=12, moe__n_experts=8, moe__top_k=2,
                moe__first_dense=1, moe__score="sigmoid", moe__n_group=4, moe__topk_group=2,
                moe__routed_scaling_factor=2.5, moe__shared_experts=1, moe__bias_update_rate=0.01, moe__dropless=True,
                moe__dispatch="sorted", moe__aux_loss_weight=0.0, moe__z_loss_weight=0.0)


@pytest.mark.parametrize("layout", [
    pytest.param(dict(parallel__expert=2, parallel__data=2, parallel__zero=1), id="expert2-data2-zero1"),
    pytest.param(dict(parallel__expert=2, parallel__data=2, parallel__zero=3), id="expert2-data2-zero3", marks=SLOW),
    pytest.param(dict(parallel__expert=2, parallel__tensor=2, parallel__pipe=2, parallel__pipeline_schedule="1f1b",
                      parallel__microbatches=2), id="pipe2-expert2-tensor2-1f1b", marks=SLOW)])
def test_switches_train_on_every_axis_as_one_device(layout):
    """Three AdamW steps with the routing bias moved after each: losses and parameters (the routing biases
    included, which move by the batch's loads) equal one device's."""
    from helpers import assert_params_close, config, run

    ref = run(config("llama", **SWITCHES), steps=3)
    got = run(config("llama", **SWITCHES, **layout), steps=3)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=2e-6)
    bias = ref["params"]["blocks"]["moe"]["mlp"]["router_bias"]
    assert np.any(bias != 0)  # the bias moved
    np.testing.assert_array_equal(got["params"]["blocks"]["moe"]["mlp"]["router_bias"], bias)
    assert_params_close(got["params"], ref["params"])
