"""Hugging Face checkpoints in and out (jaxpar.hf) against `transformers` itself (torch, CPU, float32).

Every parameter gets random values, biases and norm weights included (HF's own initialisation leaves
them at 0 and 1, which would hide a wrong mapping). The reference is transformers' forward pass.
"""

import json
import logging
import os

import jax
import numpy as np
import pytest

from jaxpar import hf
from jaxpar.config import ConfigError, load_config
from helpers import trainer as Trainer  # (a mesh of the devices the layout names)

# torch and transformers are imported by the first test that needs them, not when pytest collects this
# module: a worker that imported torch runs XLA a few per cent slower for the rest of the session
torch = transformers = None


def libs() -> None:
    global torch, transformers
    if torch is None:
        torch, transformers = pytest.importorskip("torch"), pytest.importorskip("transformers")

V, T = 300, 16


def hf_model(arch: str, **extra):
    """A small random ``transformers`` model: GPT-2, Llama (GQA, untied) or Mixtral (top-2 of 4)."""
    libs()
    torch.manual_seed({"gpt2": 0, "llama": 1, "mixtral": 2}[arch])
    if arch == "gpt2":
        cfg = transformers.GPT2Config(**{**dict(vocab_size=V, n_positions=32, n_embd=32, n_layer=2, n_head=4), **extra})
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        kw = {**dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     rope_theta=5e5), **extra}
        if arch == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
        else:
            model = transformers.MixtralForCausalLM(transformers.MixtralConfig(num_local_experts=4,
                                                                               num_experts_per_tok=2, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = "ln" in name or "norm" in name
            p.copy_((1.0 if norm and name.endswith("weight") else 0.0) + 0.2 * torch.randn_like(p))
    return model.eval()


def hf_logits(model_or_dir, tokens: np.ndarray) -> np.ndarray:
    libs()
    model = model_or_dir
    if not hasattr(model, "forward"):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(model_or_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.numpy()


def tokens(b=4, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (b, T)).astype(np.int32)


LAYOUTS = {"1": [], "dt": ["parallel.data=2", "parallel.tensor=2"]}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for arch in ("gpt2", "llama", "mixtral"):
        d = tmp_path_factory.mktemp(arch)
        model = hf_model(arch)
        model.save_pretrained(d)
        out[arch] = (d, hf_logits(model, tokens()))
    return out


def jaxpar_logits(trainer, params, toks) -> np.ndarray:
    return np.asarray(trainer.logits(params, jax.numpy.asarray(toks)))[..., :V]


@pytest.mark.parametrize("layout", ["1", "dt"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_import_matches_transformers(hf_dirs, arch, layout):
    d, ref = hf_dirs[arch]
    extra = LAYOUTS[layout] + (["parallel.expert=2"] if arch == "mixtral" and layout == "dt" else [])
    cfg = load_config(None, [f"model.init_from=hf:{d}", f"model.seq_len={T}", "train.batch_size=8", *extra])
    assert cfg.model.arch == ("moe" if arch == "mixtral" else "gpt")
    trainer = Trainer(cfg)
    params = hf.load_params(trainer, d)
    got = jaxpar_logits(trainer, params, tokens())
    assert np.max(np.abs(got - ref)) < 1e-4, np.max(np.abs(got - ref))


def randomised(trainer, state, seed=0):
    """``state["params"]`` with every leaf random (biases and norm scales included), on its shardings."""
    leaves, treedef = jax.tree.flatten(state["params"])
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    new = [jax.device_put(0.5 * jax.random.normal(k, a.shape, a.dtype), a.sharding) for k, a in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, new)


@pytest.mark.parametrize("layout", ["1", "dt"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "mixtral"])
def test_export_loads_in_transformers(tmp_path, arch, layout):
    style = {"gpt2": ["model.style=gpt2"],
             "llama": ["model.style=llama", "model.n_kv_heads=2", "model.rope_theta=500000.0"],
             "mixtral": ["model.arch=moe", "model.style=llama", "model.n_kv_heads=2", "moe.n_experts=4",
                         "moe.dropless=true"]}[arch]
    extra = LAYOUTS[layout] + (["parallel.expert=2"] if arch == "mixtral" and layout == "dt" else [])
    cfg = load_config(None, [*style, "model.n_layers=2", "model.d_model=32", "model.n_heads=4", f"model.vocab_size={V}",
                             f"model.seq_len={T}", "train.batch_size=8", *extra])
    trainer = Trainer(cfg)
    params = randomised(trainer, trainer.init_state())
    files = hf.export(trainer, params, tmp_path)
    assert {f.name for f in files} == {"model.safetensors", "config.json", "jaxpar_export.json"}
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [hf.CLASSES[arch]]
    toks = tokens(seed=1)
    got, ref = jaxpar_logits(trainer, params, toks), hf_logits(tmp_path, toks)
    assert np.max(np.abs(got - ref)) < 1e-4, np.max(np.abs(got - ref))
    # and back: the exported directory imports to the same parameters (the vocabulary's padding aside)
    again = Trainer(load_config(None, [f"model.init_from=hf:{tmp_path}", f"model.seq_len={T}", "train.batch_size=8",
                                       *extra]))
    back = dict(hf.hf_tensors(again, hf.load_params(again, tmp_path)))
    for name, a in hf.hf_tensors(trainer, params):
        np.testing.assert_array_equal(a, back.pop(name), err_msg=name)
    assert not back


@pytest.mark.parametrize("layers, layout, order", [
    (4, ["parallel.pipeline_repeats=2"], [0, 2, 1, 3]),
    (5, [], [0, 1, -1, 2, 3, 4]),  # uneven stages: 2 + 3 layers in 2 x 3 slots, the padding zero
], ids=["circular", "uneven"])
def test_circular_pipeline_import_and_sharded_export(tmp_path, layers, layout, order):
    """A tied Llama imported onto a circular pipeline (stacked layers stored stage-major, each stage
    reading only its layers) or onto uneven stages (padded) gives transformers' logits; its tensors
    are the checkpoint's bit for bit; exported from there in several safetensors files with an index, it
    loads back in transformers."""
    model = hf_model("llama", num_hidden_layers=layers, tie_word_embeddings=True)
    model.save_pretrained(tmp_path / "in")
    ref = hf_logits(model, tokens())
    cfg = load_config(None, [f"model.init_from=hf:{tmp_path / 'in'}", f"model.seq_len={T}", "train.batch_size=8",
                             "parallel.pipe=2", "parallel.data=2", *layout])
    trainer = Trainer(cfg)
    assert list(trainer.layer_order(layers)) == order and cfg.model.tie_embeddings
    params = hf.load_params(trainer, tmp_path / "in")
    assert np.max(np.abs(jaxpar_logits(trainer, params, tokens()) - ref)) < 1e-4
    from safetensors.numpy import load_file

    original = load_file(str(tmp_path / "in" / "model.safetensors"))
    exported = dict(hf.hf_tensors(trainer, params))
    assert set(exported) == set(original)
    for name, a in exported.items():
        np.testing.assert_array_equal(a, original[name], err_msg=name)
    files = hf.export(trainer, params, tmp_path / "out", shard_bytes=20_000)
    assert (tmp_path / "out" / "model.safetensors.index.json") in files and len(files) > 4
    np.testing.assert_allclose(hf_logits(tmp_path / "out", tokens()), ref, atol=1e-5)


class Warnings(logging.Handler):
    """The warnings transformers logs (its logger does not propagate to pytest's capture), those it logs
    once per process included (its ``warning_once`` cache is cleared: an earlier test may have logged one)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]  (added by transformers)
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def load_quietly(d):
    """``from_pretrained(d)`` and the warnings it logged."""
    libs()
    with Warnings() as w:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    return model, w.messages


def safetensors_of(d) -> dict:
    from safetensors.numpy import load_file

    return {k.removeprefix("transformer."): v for k, v in load_file(str(d / "model.safetensors")).items()}


def test_import_train_export(tmp_path, hf_dirs, capsys):
    """An HF GPT-2 (32 positions) trained 10 steps at seq_len 16 on Shakespeare by train.py's run, exported
    by the CLI, loads in transformers with jaxpar's logits and no warning (null BOS/EOS: the byte tokenizer
    has none, not GPT-2's 50256); the position table keeps its 32 rows, the 16 never trained bit-identical
    to the source's (with weight decay, which AdamW would otherwise apply to them too). A second export replaces the first
    whole; the model the run was imported from is never a target."""
    from jaxpar.hf import open_run
    from jaxpar.run import run

    d, _ = hf_dirs["gpt2"]
    out = tmp_path / "run"
    cfg = load_config(None, [f"model.init_from=hf:{d}", "data.source=shakespeare", "data.tokenizer=byte",
                             f"data.cache_dir={tmp_path / 'cache'}", "train.steps=10", "train.batch_size=8",
                             "train.eval_batches=1", f"model.seq_len={T}", "parallel.data=4", "parallel.tensor=2",
                             "sample.tokens=0", f"train.out_dir={out}", "checkpoint.async_save=false",
                             "train.weight_decay=0.1"])
    summary = run(cfg, log=lambda *a, **k: None)
    assert np.isfinite(summary["final_loss"]) and summary["steps"] == 10
    assert hf.main([str(out), str(tmp_path / "hf")]) == 0
    trainer, params, step, _ = open_run(out, [])
    assert step == 10
    trained = np.asarray(params["blocks"]["mlp"]["up"]["kernel"])
    assert not np.allclose(trained, np.asarray(hf.load_params(trainer, d)["blocks"]["mlp"]["up"]["kernel"]))
    toks = tokens(b=8, seed=2)
    model, warned = load_quietly(tmp_path / "hf")
    assert warned == []
    got, ref = jaxpar_logits(trainer, params, toks), hf_logits(model, toks)
    assert np.max(np.abs(got - ref)) < 1e-4
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["n_positions"] == 32 and conf["bos_token_id"] is None and conf["eos_token_id"] is None
    src, new = safetensors_of(d)["wpe.weight"], safetensors_of(tmp_path / "hf")["wpe.weight"]
    assert new.shape == src.shape == (32, 32)
    np.testing.assert_array_equal(new[T:], src[T:])
    assert not np.any(np.all(new[:T] == src[:T], axis=1))  # every trained row moved
    # the same run again: replaced whole (here by a sharded export: no model.safetensors left)
    assert hf.main([str(out), str(tmp_path / "hf"), "--shard-gb", "0.00002"]) == 0
    names = set(os.listdir(tmp_path / "hf"))
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    np.testing.assert_allclose(hf_logits(tmp_path / "hf", toks), ref, atol=1e-5)
    # the directory the run was imported from: refused, --overwrite or not, every byte kept
    before = {f: (d / f).read_bytes() for f in os.listdir(d)}
    capsys.readouterr()
    for extra in ([], ["--overwrite"]):
        assert hf.main([str(out), str(d), *extra]) == 2
        assert {f: (d / f).read_bytes() for f in os.listdir(d)} == before
    # an override the checkpoint cannot be read with: one line, nothing written
    assert hf.main([str(out), str(tmp_path / "other"), "model.n_layers=3"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err), err  # the two above, and this one
    assert "belongs to another model" in err[2] and "model.n_layers: 2 in the checkpoint, 3 now)" in err[2], err
    assert not (tmp_path / "other").exists()


def test_gpt2_round_trip_keeps_positions_and_special_tokens(tmp_path):
    """A GPT-2 with 64 positions and its tokenizer (BOS = EOS = id 0, tokenizer_config.json), imported at
    seq_len 16 and exported by ``python -m jaxpar.hf hf:DIR``: the 64-row table and the embedding
    bit-identical, n_positions 64, the special-token ids and tokenizer files kept, transformers loads it
    without a warning, and on 40 tokens (past seq_len) its logits are the source's."""
    from jaxpar.data.tokenizer import BPETokenizer

    model = hf_model("gpt2", n_positions=64, bos_token_id=0, eos_token_id=0)
    src, out = tmp_path / "src", tmp_path / "out"
    model.save_pretrained(src)
    BPETokenizer.train(["to be or not to be, that is the question\n" * 40], V, src / "tokenizer.json")
    transformers.PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"), bos_token="<|endoftext|>",
                                         eos_token="<|endoftext|>").save_pretrained(src)
    assert hf.main([f"hf:{src}", str(out), f"model.seq_len={T}", "parallel.data=8"]) == 0
    a, b = safetensors_of(src), safetensors_of(out)
    assert b["wpe.weight"].shape == (64, 32)
    for name in ("wpe.weight", "wte.weight"):
        np.testing.assert_array_equal(b[name], a[name])
    conf, gen = (json.loads((out / f).read_text()) for f in ("config.json", "generation_config.json"))
    assert conf["n_positions"] == 64
    assert [conf["bos_token_id"], conf["eos_token_id"], gen["bos_token_id"], gen["eos_token_id"]] == [0, 0, 0, 0]
    assert (out / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    again, warned = load_quietly(out)
    assert warned == [] and again.config.eos_token_id == 0
    assert transformers.AutoTokenizer.from_pretrained(str(out)).eos_token == "<|endoftext|>"
    long = np.random.default_rng(5).integers(0, V, (2, 40))
    np.testing.assert_allclose(hf_logits(again, long), hf_logits(model, long), atol=1e-5)
    # the capture is live: the same model without its ids falls back to GPT-2's 50256 and warns
    del conf["bos_token_id"], conf["eos_token_id"]
    (out / "config.json").write_text(json.dumps(conf))
    os.remove(out / "generation_config.json")
    assert any("bos_token_id" in w for w in load_quietly(out)[1])


def test_config_errors(tmp_path, hf_dirs):
    d, _ = hf_dirs["llama"]
    with pytest.raises(ConfigError, match=r"model.d_model=64 contradicts .*hidden|model.d_model=64 contradicts"):
        load_config(None, [f"model.init_from=hf:{d}", "model.d_model=64"])
    with pytest.raises(ConfigError, match="no config.json"):
        load_config(None, [f"model.init_from=hf:{tmp_path}"])
    for change, field in [({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 8.0}},
                           "rope_parameters.rope_type='dynamic'"),
                          ({"attention_bias": True}, "attention_bias=True"),
                          ({"model_type": "qwen2_moe"}, "model_type='qwen2_moe'"),
                          ({"hidden_act": "gelu"}, "hidden_act='gelu'")]:
        bad = tmp_path / field.split("=")[0]
        bad.mkdir()
        conf = json.loads((d / "config.json").read_text())
        conf.update(change)
        (bad / "config.json").write_text(json.dumps(conf))
        with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace(".", r"\.")):
            load_config(None, [f"model.init_from=hf:{bad}"])
    # a model HF cannot express
    cfg = load_config(None, ["model.style=llama", "model.bias=true"])
    with pytest.raises(ConfigError, match="model.bias=True cannot be exported"):
        hf.hf_config(cfg)
