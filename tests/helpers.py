"""Shared test helpers: tiny configs, meshes over a subset of devices, and 1-device references."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np

from jaxpar.config import load_config
from jaxpar.data import SyntheticSource
from jaxpar.mesh import make_mesh
from jaxpar.trainer import Trainer

TINY = {
    "gpt2": {"model.style": "gpt2", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 8,
             "model.vocab_size": 250, "model.seq_len": 16},
    # GQA: 8 query heads, 4 KV heads (tensor=8 needs kv_heads divisible by 8 -> covered by MHA gpt2)
    "llama": {"model.style": "llama", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 8,
              "model.n_kv_heads": 8, "model.d_ff": 128, "model.vocab_size": 250, "model.seq_len": 16},
    "llama_gqa": {"model.style": "llama", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 8,
                  "model.n_kv_heads": 4, "model.d_ff": 128, "model.vocab_size": 250, "model.seq_len": 16},
    # every switch of Gemma 3 at once: local (window 4, own RoPE base) and global layers alternating, linear
    # RoPE scaling on the global ones, QK-norm, sandwich (1 + w) norms, GeGLU, scaled embeddings and scores
    "gemma3": {"model.style": "llama", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 8,
               "model.n_kv_heads": 4, "model.head_dim": 16, "model.d_ff": 128, "model.vocab_size": 250,
               "model.seq_len": 16, "model.mlp": "geglu", "model.qk_norm": True, "model.norm_placement": "sandwich",
               "model.norm_plus_one": True, "model.embed_scale": True, "model.attn_scale": 0.2,
               "model.sliding_window": 4, "model.global_every": 2, "model.rope_theta": 1e6,
               "model.rope_scaling": "linear", "model.rope_local_theta": 1e4, "model.tie_embeddings": True},
}
BASE = {"train.batch_size": 16, "train.steps": 3, "train.warmup_steps": 1, "train.lr": 1e-2,
        "train.out_dir": "/tmp/jaxpar-test-run"}


@functools.lru_cache(maxsize=None)
def token_store() -> Path:
    """A small byte-tokenizer token store (about 200 k tokens of generated sentences), made once per
    machine in the temp folder (its name is the hash of its text; concurrent makers are safe)."""
    import hashlib
    import tempfile

    from jaxpar.data.prepare import write_stream_store
    from jaxpar.data.tokenizer import ByteTokenizer

    rng = np.random.default_rng(0)
    words = np.array("the king and queen of a small land rode to sea while bells rang over fields".split())
    text = ".\n".join(" ".join(words[rng.integers(0, len(words), rng.integers(4, 14))]) for _ in range(4000))
    cut = text.rfind("\n", 0, int(len(text) * 0.9)) + 1
    tok = ByteTokenizer()
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    from jaxpar.data.store import VERSION

    out = Path(tempfile.gettempdir()) / f"jaxpar-test-store-v{VERSION}-{digest}"
    return write_stream_store(out, tok.encode(text[:cut]), tok.encode(text[cut:]), tok, {"key": digest})


def config(style: str = "gpt2", **over):
    over = {k.replace("__", "."): v for k, v in over.items()}
    return load_config(None, {**BASE, **TINY[style], **over})


def trainer(cfg, n_devices: int | None = None) -> Trainer:
    devs = jax.devices()[: n_devices or _mesh_size(cfg)]
    return Trainer(cfg, mesh=make_mesh(cfg.parallel, devs))


def _mesh_size(cfg) -> int:
    p = cfg.parallel
    return p.data * p.tensor * p.pipe * p.expert * p.seq


def batches(cfg, n: int):
    src = SyntheticSource(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size)
    return [src.batch(i) for i in range(n)]


def first_step(cfg) -> dict:
    """Trainer, initial state, and the loss / aux metrics / gradients of batch 0 (gradients as numpy)."""
    t = trainer(cfg)
    state = t.init_state()
    loss, aux, grads = jax.jit(t.grads)(state["params"], t.place_batch(batches(cfg, 1)[0]))
    return {"trainer": t, "state": state, "loss": float(loss), "aux": jax.device_get(aux),
            "grads": jax.device_get(grads)}


def loss_grads(cfg):
    """``(loss, grads)`` of batch 0 at initialisation."""
    r = first_step(cfg)
    return r["loss"], r["grads"]


def run(cfg, steps: int = 3):
    """Loss/grads at init on batch 0, and losses + params after ``steps`` AdamW steps (numpy)."""
    first = first_step(cfg)
    t, state = first["trainer"], first["state"]
    out = {"init_params": jax.device_get(state["params"]), "loss0": first["loss"], "grads": first["grads"]}
    losses = []
    for b in batches(cfg, steps):
        state, m = t.step(state, t.place_batch(b))
        losses.append(float(m["loss"]))
    out["losses"] = losses
    out["params"] = jax.device_get(state["params"])
    return out


@functools.lru_cache(maxsize=None)
def reference(style: str, **over):
    """The same run on a single device (all axes 1, no ZeRO)."""
    over = dict(over)
    for k in ("parallel__data", "parallel__tensor", "parallel__zero", "parallel__expert"):
        over.pop(k, None)
    return run(config(style, **over))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_close(a, b, rtol: float = 1e-5, what: str = ""):
    """Per leaf: ||a - b|| <= rtol * ||b||, where leaves below 1e-6 of the whole tree's norm count as
    that floor (a leaf that is zero in exact arithmetic holds only round-off)."""
    floor = 1e-6 * float(np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in jax.tree.leaves(b))))
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb], f"{what}: tree structures differ"
    for (p, x), (_, y) in zip(la, lb):
        assert np.shape(x) == np.shape(y), f"{what}{jax.tree_util.keystr(p)}: shape {np.shape(x)} vs {np.shape(y)}"
        e = float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64))
                  / max(np.linalg.norm(np.asarray(y, np.float64)), floor, 1e-30))
        assert e <= rtol, f"{what}{jax.tree_util.keystr(p)}: relative error {e:.2e} > {rtol}"


def tree_rel_err(a, b) -> float:
    """Relative error of the whole tree seen as one vector."""
    fa = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
    fb = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)])
    return rel_err(fa, fb)


def assert_params_close(a, b, what: str = "params "):
    """Parameters after AdamW steps: the whole vector within 1e-5 relative, each leaf within 1e-4.

    Adam divides each coordinate's step by its own gradient scale, so for a zero-initialised leaf
    (a GPT-2 norm bias) a coordinate with a tiny gradient turns float32 reduction-order round-off
    into a visible relative change of that leaf; a wrong layout gives errors of order 1.
    """
    e = tree_rel_err(a, b)
    assert e <= 1e-5, f"{what}: relative error of the whole parameter vector {e:.2e} > 1e-5"
    assert_trees_close(a, b, 1e-4, what)


@functools.lru_cache(maxsize=None)
def per_microbatch_reference(style: str, m: int, **over):
    """One device, batch 0 cut into ``m`` microbatches run one at a time: ``(loss, aux, grads, params)`` with
    loss, metrics and gradients the float64 mean over the microbatches, ``params`` the initial ones (layer order)."""
    cfg = config(style, **over)
    t = trainer(config(style, **{**over, "train__batch_size": cfg.train.batch_size // m}))
    params = t.init_state()["params"]
    grads_fn = jax.jit(t.grads)
    batch = batches(cfg, 1)[0]
    per_mb = [jax.device_get(grads_fn(params, t.place_batch({k: v[i::m] for k, v in batch.items()})))
              for i in range(m)]
    mean = jax.tree.map(lambda *xs: np.mean([np.asarray(x, np.float64) for x in xs], axis=0), *per_mb)
    return float(mean[0]), mean[1], mean[2], jax.device_get(params)


def check_moe_against_reference(cfg, got_loss, got_aux, got_grads, ref, m: int | None = None):
    """Loss, MoE metrics and gradients of a pipelined (or accumulated: ``m`` microsteps) MoE run against
    :func:`per_microbatch_reference`; the router losses are on and move the loss by far more than the tolerance."""
    m = m or cfg.parallel.microbatches
    ref_loss, ref_aux, ref_grads, _ = ref
    n_moe = cfg.moe.groups(cfg.model.n_layers)  # MoE layers: one per stacked group
    w_aux, w_z = cfg.moe.aux_loss_weight, cfg.moe.z_loss_weight
    router = n_moe * (w_aux * ref_aux["moe_aux_loss"] + w_z * ref_aux["moe_z_loss"])  # metrics: per-layer means
    assert abs(ref_loss - ref_aux["ce_loss"] - router) <= 1e-6 * ref_loss
    assert router > 100 * 1e-5 * ref_loss, router  # the router losses are far above the tolerance
    assert rel_err(got_loss, ref_loss) <= 1e-5, (got_loss, ref_loss)
    for key in ("ce_loss", "moe_aux_loss", "moe_z_loss", "moe_expert_load"):
        assert rel_err(got_aux[key], ref_aux[key]) <= 1e-5, (key, got_aux[key], ref_aux[key])
    if cfg.moe.capacity_factor >= cfg.moe.n_experts / cfg.moe.top_k:  # capacity E/k: none drop
        assert float(got_aux["moe_drop_fraction"]) == 0.0 == ref_aux["moe_drop_fraction"]
    else:  # the same assignments drop: each microbatch is one routing group on both sides
        assert ref_aux["moe_drop_fraction"] > 0.005 and rel_err(got_aux["moe_drop_fraction"],
                                                               ref_aux["moe_drop_fraction"]) <= 1e-6
    # every token's k assignments, per MoE layer and microbatch (a hand count)
    assert np.sum(got_aux["moe_expert_load"]) == cfg.train.batch_size // m * cfg.model.seq_len * cfg.moe.top_k
    assert_trees_close(got_grads, ref_grads, 1e-5, "grads ")


def ce64(logits: np.ndarray, targets: np.ndarray) -> float:
    """Mean next-token cross-entropy in float64 numpy."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-np.mean(np.take_along_axis(logp, targets[..., None].astype(np.int64), -1)))


def torch_logits(model, toks) -> np.ndarray:
    """A ``transformers`` model's float logits of ``toks`` (numpy)."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(toks, dtype=torch.long)).logits.numpy()


def command_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a command a test runs (train.py, ``python -m jaxpar.X``, an example): this one's,
    less the simulated device count (``devices``, else the command's own default) and the user's XLA_FLAGS,
    with the tests' XLA flags (conftest.py) and compilation cache; ``extra`` set last."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=os.environ["JAXPAR_TEST_XLA_FLAGS"])
    if devices is not None:
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
    env.update(extra)
    return env


def run_script(script: str, devices: int, done: str, timeout: int = 900) -> str:
    """Run ``script`` (which may import these helpers) in a fresh process with ``devices`` simulated
    CPU devices; assert it exits 0 printing ``done``; returns its output."""
    env = command_env(devices)
    tests = Path(__file__).resolve().parent
    p = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(tests)!r})\n" + script],
                       capture_output=True, text=True, env=env, timeout=timeout)
    assert p.returncode == 0 and done in p.stdout, p.stdout[-3000:] + p.stderr[-4000:]
    return p.stdout


# -- Hugging Face parity (tests of the families against transformers) ----------------------------------------

def randomize(model, scale: float = 0.2):
    """Every parameter of a ``transformers`` model random (norm weights around 1), since its initialisation
    leaves biases and norms at 0 and 1 and would hide a wrong mapping; returns the model in eval mode."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(float("norm" in n and n.endswith("weight")) + scale * torch.randn_like(p))
    return model.eval()


def hf_greedy(model, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy ``generate``: the ``n`` tokens after each prompt (no stop token)."""
    import torch

    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
        out.append(ids[0, len(p):].tolist())
    return out


def jaxpar_greedy(d, prompts: list[list[int]], n: int, vocab: int, *overrides: str) -> list[list[int]]:
    """jaxpar's greedy generation from the Hugging Face directory ``d`` imported on one device."""
    from jaxpar import hf
    from jaxpar.generate import Sampling, for_trainer

    t = trainer(load_config(None, [f"model.init_from=hf:{d}", "data.tokenizer=byte", *overrides]))
    return for_trainer(t)(hf.load_params(t, d), prompts, n, Sampling(temperature=0.0), vocab=vocab)


def with_config(tmp_path, d, change: dict, name: str = "bad") -> str:
    """A ``model.init_from`` override naming a copy of ``d``'s ``config.json`` with ``change`` applied (a key
    ``-k`` with value None removes ``k``)."""
    import json

    bad = tmp_path / name
    bad.mkdir(exist_ok=True)
    conf = json.loads((Path(d) / "config.json").read_text())
    for k, v in change.items():
        if v is None and k.startswith("-"):
            conf.pop(k[1:], None)
        else:
            conf[k] = v
    (bad / "config.json").write_text(json.dumps(conf))
    return f"model.init_from=hf:{bad}"


def assert_same_safetensors(a, b) -> None:
    """Two model directories' ``model.safetensors``: the same names, dtypes and bits."""
    from safetensors.numpy import load_file

    x, y = load_file(str(Path(a) / "model.safetensors")), load_file(str(Path(b) / "model.safetensors"))
    assert sorted(x) == sorted(y)
    for n in x:
        assert x[n].dtype == y[n].dtype and np.array_equal(x[n], y[n]), n
