"""The plain-JAX benchmark baseline (benchmarks/plain_jax.py) computes the same loss, gradients and
AdamW steps as jaxpar, on one device, in float32."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_params_close, assert_trees_close, batches, config, rel_err, trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plain_jax  # noqa: E402

STEPS = 3  # step 0 runs at lr 0 (warm-up from 0): the later steps are the ones that move the weights


@pytest.fixture(scope="module", params=["gpt2", "llama_gqa"])
def ref(request):
    """jaxpar on one device: initial params, loss and grads of batch 0, then STEPS train steps."""
    cfg = config(request.param)
    t = trainer(cfg)
    state = t.init_state()
    data = batches(cfg, STEPS)
    (loss, _), grads = jax.jit(jax.value_and_grad(t.loss_fn, has_aux=True))(state["params"], t.place_batch(data[0]))
    out = {"cfg": cfg, "data": data, "params0": jax.device_get(state["params"]), "loss0": float(loss),
           "grads0": jax.device_get(grads), "losses": []}
    for b in data:
        state, m = t.step(state, t.place_batch(b))
        out["losses"].append(float(m["loss"]))
    out["params"] = jax.device_get(state["params"])
    return out


def _build(cfg, remat="none"):
    return plain_jax.build(cfg.model, cfg.train, compute_dtype=jnp.float32, attention="xla", remat=remat)


def _batch(b):
    return {k: jnp.asarray(v, jnp.int32) for k, v in b.items()}


def test_loss_and_grads_match_jaxpar(ref):
    cfg = ref["cfg"]
    params = plain_jax.params_from_jaxpar(ref["params0"], cfg.model)
    loss, grads = jax.jit(jax.value_and_grad(_build(cfg).loss))(params, _batch(ref["data"][0]))
    assert rel_err(loss, ref["loss0"]) <= 1e-5
    assert_trees_close(jax.device_get(grads), jax.device_get(plain_jax.params_from_jaxpar(ref["grads0"], cfg.model)),
                       1e-5, "grads ")


def test_steps_match_jaxpar(ref):
    cfg = ref["cfg"]
    b = _build(cfg)
    params = plain_jax.params_from_jaxpar(ref["params0"], cfg.model)
    opt_state = b.opt.init(params)
    for i, batch in enumerate(ref["data"]):
        params, opt_state, loss = b.step(params, opt_state, _batch(batch))
        assert rel_err(loss, ref["losses"][i]) <= 1e-5, f"step {i}"
    want = jax.device_get(plain_jax.params_from_jaxpar(ref["params"], cfg.model))
    assert_params_close(jax.device_get(params), want)


def test_remat_same_loss_and_grads():
    cfg = config("llama_gqa")
    base = _build(cfg)
    params = base.init(jax.random.key(1))
    batch = _batch(batches(cfg, 1)[0])
    want = jax.jit(jax.value_and_grad(base.loss))(params, batch)
    for remat in ("full", "save_dots"):
        got = jax.jit(jax.value_and_grad(_build(cfg, remat).loss))(params, batch)
        assert rel_err(got[0], want[0]) <= 1e-6, remat
        assert_trees_close(jax.device_get(got[1]), jax.device_get(want[1]), 1e-6, f"remat={remat} grads ")


def test_init_layout_matches_converter():
    """init() and params_from_jaxpar give the same tree structure and shapes."""
    for style in ("gpt2", "llama_gqa"):
        cfg = config(style)
        t = trainer(cfg)
        conv = jax.eval_shape(lambda p: plain_jax.params_from_jaxpar(p, cfg.model), t.adapter.abstract)
        mine = jax.eval_shape(_build(cfg).init, jax.random.key(0))
        assert jax.tree.structure(conv) == jax.tree.structure(mine)
        assert jax.tree.map(lambda a: a.shape, conv) == jax.tree.map(lambda a: a.shape, mine)
        assert np.all([a.dtype == jnp.float32 for a in jax.tree.leaves(mine)])
