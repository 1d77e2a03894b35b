"""GPT-OSS (``gpt_oss``) against `transformers` itself: attention sinks (a learned logit per head in the
softmax), Q/K/V/O biases, sliding-window and full layers alternating in a MoE stack, YaRN without truncation,
a router with a logit bias, experts with biases and the clamped SwiGLU.

References, all independent of jaxpar: transformers' forward (fp32 logits < 1e-4; on one device and on expert
x data, expert x tensor, pipe x expert under 1F1B, the sinks' heads over tensor with the sequence over seq
in each context-parallel strategy, and the sorted dispatch with the experts' biases), the float64 numpy
cross-entropy of those logits (the training loss), transformers' router (experts and gates), transformers' greedy ``generate`` past the window, and the input
safetensors (an unmodified import exports bit-identically).
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
CONFIG = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=4, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
              max_position_embeddings=64, rms_norm_eps=1e-5, router_aux_loss_coef=0.01, swiglu_limit=1.5,
              rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 16})
LAYOUTS = {
    "1": [],
    "ed": ["parallel.expert=2", "parallel.data=2"],
    "et": ["parallel.expert=2", "parallel.tensor=2"],
    "pe": ["parallel.pipe=2", "parallel.expert=2", "parallel.pipeline_schedule=1f1b", "parallel.microbatches=2"],
    "ring": ["parallel.seq=2", "parallel.tensor=2", "parallel.seq_attention=ring"],
    "gather": ["parallel.seq=2", "parallel.expert=2", "parallel.seq_attention=all_gather"],
    "ulysses": ["parallel.seq=2", "parallel.expert=2", "parallel.seq_attention=ulysses"],
    # the sorted (dropless) dispatch with the experts' biases: one device's grouped matmul, the exchange
    # rounds over expert, and the experts' hidden units over tensor
    "sorted": ["moe.dispatch=sorted"],
    "sorted_et": ["moe.dispatch=sorted", "parallel.expert=2", "parallel.tensor=2"],
}
SLOW = pytest.mark.slow
_state: dict = {}


def hf_dir(tmp_path_factory):
    """A small ``transformers`` GPT-OSS, every weight random (sinks, biases, norms, router), saved once; its
    clamp limit low enough that the clamps act on these activations."""
    if "dir" not in _state:
        libs()
        torch.manual_seed(3)
        model = randomize(transformers.GptOssForCausalLM(transformers.GptOssConfig(**CONFIG)), 0.3)
        d = tmp_path_factory.mktemp("gpt_oss")
        model.save_pretrained(d)
        _state["dir"] = (d, model)
    return _state["dir"]


def importer(layout: str, tmp_path_factory):
    if layout not in _state:
        d, _ = hf_dir(tmp_path_factory)
        cfg = load_config(None, [f"model.init_from=hf:{d}", f"model.seq_len={T}", f"train.batch_size={B}",
                                 "data.tokenizer=byte", *LAYOUTS[layout]])
        trainer = Trainer(cfg)
        _state[layout] = (trainer, hf.load_params(trainer, d))
    return _state[layout]


def tokens(b=B, seed=0, t=T + 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (b, t)).astype(np.int32)


@pytest.mark.parametrize("layout", ["1"] + [pytest.param(x, marks=SLOW) for x in LAYOUTS if x != "1"])
def test_import_matches_transformers(tmp_path_factory, layout):
    """Logits equal transformers' forward and the training loss the float64 cross-entropy of its logits."""
    _, model = hf_dir(tmp_path_factory)
    seq = tokens()
    ref = torch_logits(model, seq[:, :-1])
    trainer, params = importer(layout, tmp_path_factory)
    m, e = trainer.cfg.model, trainer.cfg.moe
    assert (m.attn_sinks, m.mlp, m.sliding_window, m.global_every, m.rope_truncate) == (
        True, "clamped_swiglu", 5, 2, False)
    assert (e.router_logit_bias, e.expert_bias) == (True, True)
    got = np.asarray(trainer.logits(params, jnp.asarray(seq[:, :-1])))[..., :V]
    assert np.max(np.abs(got - ref)) < 1e-4, np.max(np.abs(got - ref))
    batch = trainer.place_batch({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    _, aux = jax.jit(trainer.loss_fn)(params, batch)
    want = ce64(ref, seq[:, 1:])
    assert abs(float(aux["ce_loss"]) - want) < 1e-5 * want


def test_clamps_act_and_sinks_matter(tmp_path_factory):
    """The test model exercises what it tests: its SwiGLU clamps bind on these tokens (transformers' experts
    differ when the limit is lifted) and its sinks change the logits (zeroed sinks differ)."""
    d, model = hf_dir(tmp_path_factory)
    seq = tokens()[:, :-1]
    ref = torch_logits(model, seq)
    for layer in model.model.layers:
        layer.mlp.experts.limit = 1e9
    try:
        assert np.max(np.abs(torch_logits(model, seq) - ref)) > 1e-2
    finally:
        for layer in model.model.layers:
            layer.mlp.experts.limit = CONFIG["swiglu_limit"]
    trainer, params = importer("1", tmp_path_factory)
    no_sinks = jax.tree.map(lambda a: a, params)
    attn = no_sinks["blocks"]["moe"]["attn"]
    attn["sinks"] = jnp.full_like(attn["sinks"], -1e9)
    got = np.asarray(trainer.logits(no_sinks, jnp.asarray(seq)))[..., :V]
    assert np.max(np.abs(got - ref)) > 1e-2


def test_router_chooses_transformers_experts_and_gates(tmp_path_factory):
    """jaxpar's routing of the imported router (its logit bias included) picks transformers' experts, best
    first, with its gates (the softmax of the chosen logits)."""
    from jaxpar.layers.moe import route

    _, model = hf_dir(tmp_path_factory)
    trainer, params = importer("1", tmp_path_factory)
    c = trainer.cfg.moe
    h = np.random.default_rng(7).normal(size=(64, 32)).astype(np.float32)
    mlp = params["blocks"]["moe"]["mlp"]
    for layer, w, b in zip(model.model.layers, np.asarray(mlp["router"]), np.asarray(mlp["router_logit_bias"])):
        with torch.no_grad():
            _, gates, experts = layer.mlp.router(torch.as_tensor(h))
        logits = jnp.einsum("gd,de->ge", jnp.asarray(h), jnp.asarray(w)) + b
        r = route(logits, c.top_k, len(h), c.renormalize, c.score)
        np.testing.assert_array_equal(np.asarray(r.experts), experts.numpy())
        np.testing.assert_allclose(np.asarray(r.gates), gates.numpy(), rtol=1e-5, atol=1e-6)


@SLOW
def test_greedy_generation_matches_transformers(tmp_path_factory):
    """Greedy tokens equal transformers' greedy ``generate``, 20 tokens past prompts of 3 and 6 (past the
    window of 5: the sliding layers' cache and the sinks in decode)."""
    d, model = hf_dir(tmp_path_factory)
    prompts = [[5, 17, 33, 2, 250, 7], [9, 9, 100]]
    assert jaxpar_greedy(d, prompts, 20, V, "model.seq_len=32") == hf_greedy(model, prompts, 20)


@pytest.mark.parametrize("layout", ["pe", pytest.param("et", marks=SLOW)])
def test_export_is_bit_identical_and_trained_export_loads(tmp_path_factory, tmp_path, layout):
    """An unmodified import exports the input's tensors bit for bit (gate and up interleaved again), its
    ``config.json`` is the same model, and after two training steps the export loads in transformers with
    jaxpar's logits."""
    d, _ = hf_dir(tmp_path_factory)
    trainer, params = importer(layout, tmp_path_factory)
    hf.export(trainer, params, tmp_path / "same")
    assert_same_safetensors(d, tmp_path / "same")
    conf = json.loads((tmp_path / "same" / "config.json").read_text())
    assert conf["architectures"] == ["GptOssForCausalLM"]
    assert hf.config_keys(conf) == hf.config_keys(json.loads((d / "config.json").read_text()))

    state = trainer.init_state(params)
    for i in range(2):
        seq = tokens(seed=10 + i)
        state, _ = trainer.step(state, trainer.place_batch({"inputs": seq[:, :-1], "targets": seq[:, 1:]}))
    hf.export(trainer, state["params"], tmp_path / "trained")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).eval()
    seq = tokens(seed=3)[:, :-1]
    got = np.asarray(trainer.logits(state["params"], jnp.asarray(seq)))[..., :V]
    assert np.max(np.abs(got - torch_logits(model, seq))) < 1e-4


def test_what_jaxpar_cannot_express_is_one_error_naming_the_field(tmp_path_factory, tmp_path):
    """An MXFP4 checkpoint (refused, naming how to dequantise), a layer pattern no global_every gives, another
    activation: one ConfigError line naming the field. Sinks in a kernel that cannot take them are refused by
    name; sinks with MLA are refused by key."""
    d, _ = hf_dir(tmp_path_factory)
    for change, field in [({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method='mxfp4'.*dequantize"),
                          ({"layer_types": ["full_attention", "sliding_attention"] * 2}, "layer_types="),
                          ({"hidden_act": "gelu"}, "hidden_act='gelu'")]:
        with pytest.raises(ConfigError, match=field) as e:
            load_config(None, [with_config(tmp_path, d, change)])
        assert str(e.value).count("\n") == 0
    from jaxpar.layers.attention_ops import attention

    q = jnp.zeros((1, 128, 2, 8))
    for kernel in ("cudnn", "pallas"):
        with pytest.raises(ConfigError, match="sinks"):
            attention(q, q, q, kernel, sinks=jnp.zeros(2))
    with pytest.raises(ConfigError, match="model.attn_sinks"):
        load_config(None, ["model.style=llama", "model.attn_sinks=true", "model.kv_lora_rank=8",
                           "model.rope_head_dim=8", "model.head_dim=24"])
