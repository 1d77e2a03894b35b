"""Today's dense families against `transformers` itself: Llama 3.x (llama3 RoPE scaling), Qwen2.5 (Q/K/V
biases, tied), Qwen3 (QK-norm, a head width of its own), Mistral (sliding window) and Gemma 3 (GeGLU,
(1 + w) sandwich norms, QK-norm, scaled embeddings and scores, local layers with their own RoPE base
interleaved with global ones under linear RoPE scaling), and Qwen2.5 with YaRN RoPE scaling (its ramp and
its attention factor on cos and sin).

References, all independent of jaxpar: transformers' forward (fp32 logits < 1e-4), the cross-entropy of
those logits in float64 numpy (the training loss under each layout's own path: 1F1B, ring, ...),
transformers' greedy ``generate`` (past the sliding window), the input safetensors (an unmodified import
exports bit-identically), and a one-device run (the gradients on every layout).
"""

import json

import jax
import numpy as np
import pytest

from jaxpar import hf
from jaxpar.config import ConfigError, load_config
from helpers import assert_trees_close, ce64, torch_logits, with_config
from helpers import trainer as Trainer

torch = transformers = None


def libs() -> None:
    global torch, transformers
    if torch is None:
        torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")


V, T, B = 300, 16, 8
BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def build(family: str):
    """A small ``transformers`` model of ``family`` with every weight random (norms and biases included)."""
    libs()
    torch.manual_seed(len(family))
    if family == "llama3":  # original context 16: the scaling changes every band of this head width
        rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, rope_parameters=rope))
    elif family == "qwen2_yarn":  # YaRN over an original context of 16: the ramp and the attention factor both act
        rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 16}
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**BASE, rope_parameters=rope))
    elif family == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**{**BASE, "tie_word_embeddings": True},
                                                                       rope_theta=1e6))
    elif family == "qwen3":  # head_dim 16, not hidden / heads = 8
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**BASE, head_dim=16))
    elif family == "mistral":
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**BASE, sliding_window=5))
    else:
        rope = {LOCAL: {"rope_type": "default", "rope_theta": 10000.0},
                GLOBAL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}
        cfg = transformers.Gemma3TextConfig(**{**BASE, "num_hidden_layers": 6, "tie_word_embeddings": True},
                                            head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
                                            layer_types=[LOCAL, LOCAL, GLOBAL] * 2, rope_parameters=rope)
        model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            one = "norm" in name and name.endswith("weight") and family != "gemma3"  # Gemma stores w of (1 + w)
            p.copy_(float(one) + 0.2 * torch.randn_like(p))
    return model.eval()


FAMILIES = ("llama3", "qwen2", "qwen3", "mistral", "gemma3", "qwen2_yarn")
CLASSES = {"llama3": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen2_yarn": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM",
           "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}
LAYOUTS = {
    "1": [],
    "dt": ["parallel.data=2", "parallel.tensor=2"],
    "pt": ["parallel.pipe=2", "parallel.tensor=2", "parallel.pipeline_schedule=1f1b", "parallel.microbatches=2"],
    "st": ["parallel.seq=2", "parallel.tensor=2", "parallel.seq_attention=ring"],
    # Gemma 3 (every switch at once) also on these
    "dtz3": ["parallel.data=2", "parallel.tensor=2", "parallel.zero=3"],
    "msp": ["parallel.data=2", "parallel.tensor=2", "parallel.megatron_sp=true"],
    "su": ["parallel.seq=2", "parallel.data=2", "parallel.seq_attention=ulysses"],
    "sa": ["parallel.seq=2", "parallel.tensor=2", "parallel.seq_attention=all_gather"],
    "circ": ["parallel.pipe=2", "parallel.pipeline_repeats=3", "parallel.microbatches=2", "parallel.data=2"],
    # tensor=4 > the 2 KV heads: each KV head copied to the two devices that share it
    "t4": ["parallel.data=2", "parallel.tensor=4"],
    "t4sp": ["parallel.data=2", "parallel.tensor=4", "parallel.megatron_sp=true"],
}
CASES = [(f, lay) for f in FAMILIES for lay in ("1", "dt", "pt", "st")] + [
    ("gemma3", lay) for lay in ("dtz3", "msp", "su", "sa", "circ", "t4sp")] + [("qwen2", "t4")]

_dirs: dict = {}


def hf_dir(family: str, tmp_path_factory):
    """The family's model saved by ``save_pretrained`` (once per process), and the model."""
    if family not in _dirs:
        model = build(family)
        d = tmp_path_factory.mktemp(family)
        model.save_pretrained(d)
        _dirs[family] = (d, model)
    return _dirs[family]


def tokens(b=B, seed=0, t=T + 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (b, t)).astype(np.int32)


def importer(d, layout, *extra):
    cfg = load_config(None, [f"model.init_from=hf:{d}", f"model.seq_len={T}", f"train.batch_size={B}",
                             "data.tokenizer=byte", *LAYOUTS[layout], *extra])
    trainer = Trainer(cfg)
    return trainer, hf.load_params(trainer, d)


_one_device: dict = {}


@pytest.mark.parametrize("family,layout", CASES)
def test_import_matches_transformers(tmp_path_factory, family, layout):
    """Logits equal transformers' forward; the training loss (the layout's own path: 1F1B, ring, ...)
    equals the float64 cross-entropy of transformers' logits; gradients equal one device's."""
    d, model = hf_dir(family, tmp_path_factory)
    seq = tokens()
    ref = torch_logits(model, seq[:, :-1])
    trainer, params = importer(d, layout)
    if layout in ("1", "dt", "pt", "st"):  # the others: the training path below (loss and gradients)
        got = np.asarray(trainer.logits(params, jax.numpy.asarray(seq[:, :-1])))[..., :V]
        assert np.max(np.abs(got - ref)) < 1e-4, np.max(np.abs(got - ref))
    batch = trainer.place_batch({"inputs": seq[:, :-1], "targets": seq[:, 1:]})
    loss, _, grads = jax.jit(trainer.grads)(params, batch)
    assert abs(float(loss) - ce64(ref, seq[:, 1:])) < 1e-5 * ce64(ref, seq[:, 1:])
    grads = jax.device_get(grads)
    inverse = np.argsort(trainer.layer_order(trainer.cfg.model.n_layers))  # storage -> layer order (circular)
    grads["blocks"] = jax.tree.map(lambda a: a[inverse], grads["blocks"])
    if layout == "1":
        _one_device[family] = grads
    if family not in _one_device:
        one, p1 = importer(d, "1")
        _one_device[family] = jax.device_get(jax.jit(one.grads)(p1, one.place_batch(
            {"inputs": seq[:, :-1], "targets": seq[:, 1:]}))[2])
    assert_trees_close(grads, _one_device[family], 2e-5, f"{family} {layout} grads ")
    if layout.startswith("t4"):  # the stored KV heads are whole on each tensor device; the query heads split
        spec = trainer.state_shardings["params"]["blocks"]["attn"]["qkv"]["kernel"].spec
        assert "tensor" not in jax.tree.leaves(tuple(spec)), spec
        assert "tensor" in jax.tree.leaves(tuple(trainer.state_shardings["params"]["blocks"]["attn"]["o"]["kernel"].spec))


@pytest.mark.parametrize("family,layout", [(f, "1") for f in FAMILIES] + [("gemma3", "dt"), ("mistral", "pt"),
                                                                          ("qwen2", "t4")])
def test_greedy_generation_matches_transformers(tmp_path_factory, family, layout):
    """Greedy tokens equal transformers' greedy ``generate``, 22 tokens past prompts of 3-6 (the sliding
    windows are 5 positions: most steps attend through them)."""
    d, model = hf_dir(family, tmp_path_factory)
    prompts, n = [[5, 17, 33, 2, 250, 7], [9, 9, 100]], 22
    ref = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        ref.append(out[0, len(p):].tolist())
    from jaxpar.generate import Sampling, for_trainer

    cfg = load_config(None, [f"model.init_from=hf:{d}", "model.seq_len=32", f"train.batch_size={B}",
                             "data.tokenizer=byte", *LAYOUTS[layout]])
    trainer = Trainer(cfg)
    got = for_trainer(trainer)(hf.load_params(trainer, d), prompts, n, Sampling(temperature=0.0), vocab=V)
    assert got == ref


@pytest.mark.parametrize("family", FAMILIES)
def test_export_is_bit_identical_and_trained_export_loads(tmp_path_factory, tmp_path, family):
    """An unmodified import exports the input's tensors bit for bit (names included) under the same
    family; after two training steps on data x tensor (Gemma 3, Qwen2.5) the export loads in
    transformers with jaxpar's logits."""
    from safetensors.numpy import load_file

    d, _ = hf_dir(family, tmp_path_factory)
    trainer, params = importer(d, "dt")
    hf.export(trainer, params, tmp_path / "same")
    orig, back = load_file(str(d / "model.safetensors")), load_file(str(tmp_path / "same" / "model.safetensors"))
    assert sorted(orig) == sorted(back)
    for name in orig:
        assert orig[name].dtype == back[name].dtype and np.array_equal(orig[name], back[name]), name
    conf = json.loads((tmp_path / "same" / "config.json").read_text())
    assert conf["architectures"] == [CLASSES[family]]
    assert conf["max_position_embeddings"] == 64  # the input's (build()), not the training context T
    if family not in ("gemma3", "qwen2"):  # the trained export: the two that use the most switches
        return

    state = trainer.init_state(params)
    for i in range(2):
        seq = tokens(seed=10 + i)
        state, _ = trainer.step(state, trainer.place_batch({"inputs": seq[:, :-1], "targets": seq[:, 1:]}))
    hf.export(trainer, state["params"], tmp_path / "trained")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).eval()
    seq = tokens(seed=3)[:, :-1]
    got = np.asarray(trainer.logits(state["params"], jax.numpy.asarray(seq)))[..., :V]
    assert np.max(np.abs(got - torch_logits(model, seq))) < 1e-4


@pytest.mark.parametrize("family,change,field", [
    ("llama3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 4.0}},
     "rope_parameters.rope_type='dynamic'"),
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "truncate": "yes",
                                    "original_max_position_embeddings": 16}},
     "rope_parameters.truncate='yes'"),
    ("llama3", {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5"),
    ("llama3", {"attention_bias": True}, "attention_bias=True"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("qwen3", {"layer_types": [GLOBAL, GLOBAL, LOCAL, LOCAL]}, "layer_types="),
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0"),
    ("gemma3", {"layer_types": [LOCAL, GLOBAL, GLOBAL, LOCAL, LOCAL, GLOBAL]}, "layer_types="),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("mistral", {"model_type": "phi3"}, "model_type='phi3'"),
    ("mistral", {"-hidden_size": None}, "field 'hidden_size' is missing"),
])
def test_unsupported_fields_are_one_error_naming_them(tmp_path_factory, tmp_path, family, change, field):
    d, _ = hf_dir(family, tmp_path_factory)
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [with_config(tmp_path, d, change)])


def test_switches_that_no_family_has_refuse_to_export():
    """A model whose switches no family combines is refused by name, never exported as another model."""
    for over, key in [(["model.qk_norm=true", "model.sliding_window=8"], "model.sliding_window"),
                      (["model.qkv_bias=true", "model.qk_norm=true"], "model.qkv_bias"),
                      (["model.norm_placement=sandwich"], "model.mlp"),
                      (["model.rope_scaling=llama3", "model.norm_placement=sandwich", "model.norm_plus_one=true",
                        "model.embed_scale=true", "model.mlp=geglu", "model.qk_norm=true", "model.tie_embeddings=true",
                        "model.sliding_window=4", "model.global_every=2"], "model.rope_local_theta")]:
        cfg = load_config(None, ["model.style=llama", *over])
        with pytest.raises(ConfigError, match=f"{key}=.* cannot be exported"):
            hf.hf_config(cfg)


def test_generate_cli_and_documents_frame_text_as_the_tokenizer_does(tmp_path_factory, tmp_path, capsys):
    """A tokenizer.json whose post-processor puts a BOS before each text (as Llama 3's and Gemma's do):
    ``python -m jaxpar.generate hf:DIR`` feeds the prompt as transformers' tokenizer frames it and prints
    transformers' greedy completion; training documents are framed ``BOS text EOS``."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from jaxpar.data.tokenizer import BPETokenizer, encode_documents
    from jaxpar.generate import main

    d, model = hf_dir("gemma3", tmp_path_factory)
    out = tmp_path / "hf"
    shutil.copytree(d, out)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the king and queen of a small land rode to sea while bells rang"] * 50,
                            trainers.BpeTrainer(vocab_size=V, special_tokens=["<eos>", "<bos>"], show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos, eos = tok.token_to_id("<bos>"), tok.token_to_id("<eos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", bos)])
    tok.save(str(out / "tokenizer.json"))
    prompt, n = "the queen rode", 12
    ids = transformers.PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))(prompt)["input_ids"]
    assert ids[0] == bos and len(ids) > 1
    ref = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None)[0, len(ids):].tolist()
    capsys.readouterr()
    assert main([f"hf:{out}", "--prompt", prompt, "--tokens", str(n), "--temperature", "0", "model.seq_len=32",
                 "parallel.data=-1"]) == 0  # the 8 devices of the test process
    assert capsys.readouterr().out.split("\n---")[0] == prompt + tok.decode(ref, skip_special_tokens=False)

    mine = BPETokenizer.load(out / "tokenizer.json")
    assert mine.bos_ids == (bos,) and mine.eos_id == eos
    docs = ["the king rode", "bells rang"]
    want = [i for doc in docs for i in [bos, *tok.encode(doc, add_special_tokens=False).ids, eos]]
    assert encode_documents(mine, docs).tolist() == want


@pytest.mark.parametrize("rope", [dict(factor=4.0), dict(factor=8.0, beta_fast=16, beta_slow=2),
                                  dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707),
                                  dict(factor=4.0, attention_factor=1.3), dict(factor=32.0, truncate=False)],
                         ids=["default", "betas", "deepseek-mscale", "attention-factor", "gpt-oss-untruncated"])
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    """YaRN's inverse frequencies and its cos/sin factor (from attention_factor, mscale / mscale_all_dim, or the
    factor) as jaxpar imports them equal transformers' ``rope_type=yarn`` initialisation."""
    libs()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxpar.config import ModelConfig
    from jaxpar.families.common import rope_keys
    from jaxpar.layers.attention_ops import rope_frequencies

    params = {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 64, **rope}
    cfg = transformers.Qwen2Config(**BASE, head_dim=32, rope_parameters=params)
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    keys = rope_keys(params, "config.json", "rope_parameters", max_positions=BASE["max_position_embeddings"])
    m = ModelConfig(head_dim=32, **{k.split(".")[1]: v for k, v in keys.items()})
    inv = rope_frequencies(32, m.rope_theta, m.rope_scaling, m.rope_factor, original_context=m.rope_original_context,
                           beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow, truncate=m.rope_truncate)
    np.testing.assert_allclose(inv, inv_hf.numpy(), rtol=1e-6)
    if rope.get("truncate") is False:  # (the rounded range gives other frequencies: the case tests something)
        assert not np.allclose(rope_frequencies(32, m.rope_theta, "yarn", m.rope_factor, original_context=64), inv,
                               rtol=1e-3)
    assert abs(m.yarn_attention_factor() - factor_hf) <= 1e-6 * factor_hf
