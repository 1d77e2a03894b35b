"""Model options: rematerialisation does not change the math, depth does not grow the program,
bfloat16 compute stays close to float32, and the padded vocabulary is masked."""

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_close, config, loss_grads, rel_err, trainer


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_remat_same_loss_and_grads(remat):
    ref = loss_grads(config("llama", parallel__data=2))
    got = loss_grads(config("llama", parallel__data=2, model__remat=remat))
    assert rel_err(got[0], ref[0]) <= 1e-6
    assert_trees_close(got[1], ref[1], 1e-5, f"remat={remat} grads ")


def test_layer_scan_keeps_program_size_flat_in_depth():
    def static_ops(n_layers):
        t = trainer(config("gpt2", parallel__tensor=2, model__n_layers=n_layers))
        c = t.compile()["collectives"]["all-reduce"]
        return c["static_count"], c["count"]

    (s2, c2), (s6, c6) = static_ops(2), static_ops(6)
    assert s2 == s6  # the same program text
    assert c6 > c2  # but the loop runs more iterations


def test_bfloat16_compute_is_close_to_float32():
    f32 = loss_grads(config("llama", parallel__tensor=2))[0]
    bf16 = loss_grads(config("llama", parallel__tensor=2, model__compute_dtype="bfloat16"))[0]
    assert abs(bf16 - f32) / f32 < 2e-2


def test_padded_vocabulary_is_masked():
    """vocab 250 is padded to 256; the loss equals a float64 softmax over the 250 real columns."""
    t = trainer(config("gpt2"))
    assert t.adapter.abstract["embed"]["embedding"].shape[0] == 256
    state = t.init_state()
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, 250, size=(2, 16)), jnp.int32)
    logits = np.asarray(t.logits(state["params"], toks), np.float64)
    real = logits[..., :250]
    lse = np.log(np.exp(real - real.max(-1, keepdims=True)).sum(-1)) + real.max(-1)
    want = np.mean(lse - np.take_along_axis(real, np.asarray(toks)[..., None], -1)[..., 0])
    got = float(t.loss_fn(state["params"], {"inputs": toks, "targets": toks})[0])
    assert abs(got - want) / want < 1e-5
