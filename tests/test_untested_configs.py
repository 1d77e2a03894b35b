"""Configurations that real runs use and the rest of the suite leaves unchecked (issue 33): defaults that are
on in a real run (gradient clipping, weight decay, the warm-up + cosine learning rate), the ``lr`` and
``grad_norm`` metrics checked only for their presence, and a circular pipeline's layer order where it leaves
the program (Hugging Face export and import) at a size where that order is not its own inverse.

Router losses through the pipeline, circular schedules at pipe=2 x repeats=3 and MoE evaluation:
tests/test_pipeline.py and tests/test_moe.py."""

import math

import jax
import numpy as np

from helpers import assert_params_close, assert_trees_close, batches, config, rel_err, trainer


def _norm(tree) -> float:
    return math.sqrt(sum(float(np.sum(np.square(np.asarray(g, np.float64)))) for g in jax.tree.leaves(tree)))


def _hand_lr(step: int, peak: float, warmup: int, steps: int, min_ratio: float) -> float:
    """Linear warm-up from 0 over ``warmup`` steps, then half a cosine from ``peak`` to ``peak * min_ratio``
    at step ``steps``."""
    if step < warmup:
        return peak * step / warmup
    end = peak * min_ratio
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))


def _decayed(path: tuple) -> bool:
    """GPT-2's weight matrices, by name: the token and position tables and every layer's kernels (not the norms'
    scales and biases, nor the linear biases)."""
    return path[-1] in ("kernel", "embedding") or path == ("pos_embed",)


def test_adamw_steps_with_clipping_and_weight_decay_against_numpy():
    """Four steps of the Trainer on data=2 x tensor=2 with ZeRO-1 (the optimizer state split over data), with
    the defaults of a real run (gradient clipping at 1.0, active here: the gradient norm is above it; weight
    decay 0.1 on the matrices; warm-up then cosine decay to 0.1 x lr): the parameters after each step equal a
    float64 numpy AdamW applied to the step's gradients, and the step's ``lr`` and ``grad_norm`` metrics are
    the hand-computed learning rate (0, peak, then the cosine) and the norm of the gradients before clipping."""
    cfg = config("gpt2", train__steps=4, parallel__data=2, parallel__tensor=2, parallel__zero=1)
    tr = cfg.train
    assert (tr.grad_clip, tr.weight_decay, tr.min_lr_ratio, tr.beta1, tr.beta2) == (1.0, 0.1, 0.1, 0.9, 0.95)
    t = trainer(cfg)
    state = t.init_state()
    grads_fn = jax.jit(t.grads)
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), jax.device_get(state["params"]))
    paths = {p: _decayed(p) for p in t.adapter.paths}
    flat = lambda tree: {p: np.asarray(_at(tree, p), np.float64) for p in paths}  # noqa: E731
    p64, mu, nu = flat(params), {p: 0.0 for p in paths}, {p: 0.0 for p in paths}
    norms = []
    for step, b in enumerate(batches(cfg, tr.steps)):
        batch = t.place_batch(b)
        g = flat(jax.device_get(grads_fn(state["params"], batch)[2]))
        norm = _norm(list(g.values()))
        norms.append(norm)
        scale = min(1.0, tr.grad_clip / norm)
        lr = _hand_lr(step, tr.lr, tr.warmup_steps, tr.steps, tr.min_lr_ratio)
        for p in paths:
            gc = g[p] * scale
            mu[p] = tr.beta1 * mu[p] + (1 - tr.beta1) * gc
            nu[p] = tr.beta2 * nu[p] + (1 - tr.beta2) * gc * gc
            u = (mu[p] / (1 - tr.beta1 ** (step + 1))) / (np.sqrt(nu[p] / (1 - tr.beta2 ** (step + 1))) + tr.eps)
            p64[p] = p64[p] - lr * (u + (tr.weight_decay * p64[p] if paths[p] else 0.0))
        state, m = t.step(state, batch)
        assert rel_err(float(m["lr"]), lr) <= 1e-6 if lr else float(m["lr"]) == 0.0, (step, float(m["lr"]), lr)
        assert rel_err(float(m["grad_norm"]), norm) <= 1e-5, (step, float(m["grad_norm"]), norm)
        got = flat(jax.device_get(state["params"]))
        assert_params_close([got[p] for p in paths], [p64[p] for p in paths], f"params after step {step} ")
    assert norms[0] > tr.grad_clip and norms[1] > tr.grad_clip, norms  # clipping did act
    lrs = [_hand_lr(s, tr.lr, tr.warmup_steps, tr.steps, tr.min_lr_ratio) for s in range(tr.steps)]
    assert lrs[0] == 0 and abs(lrs[1] - tr.lr) < 1e-12 and lrs[1] > lrs[2] > lrs[3] > tr.lr * tr.min_lr_ratio


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


# pipe=2 x pipeline_repeats=3, 6 layers: position p of the stacked layer dim holds layer ORDER[p] (stage 0 holds
# groups 0, 2, 4, stage 1 groups 1, 3, 5, stage-major); not its own inverse (pipe=2 x repeats=2's [0, 2, 1, 3] is).
ORDER = [0, 2, 4, 1, 3, 5]


def test_circular_layout_imports_and_exports_hugging_face_in_layer_order(tmp_path):
    """A GPT-2 checkpoint written by one device (random weights, every layer different) and read onto
    pipe=2 x repeats=3 (``hf.load_params``): storage position p holds layer ORDER[p] (the hand-made order, not
    its own inverse); exported again from that layout (``hf.hf_tensors``) every tensor is the file's, by name."""
    from jaxpar import hf

    model = dict(model__n_layers=6)
    assert ORDER != list(np.argsort(ORDER))
    one = trainer(config("gpt2", **model))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: rng.normal(size=a.shape).astype(a.dtype), one.adapter.abstract)
    hf.export(one, jax.device_put(params, one.state_shardings["params"]), tmp_path / "hf")
    circ = trainer(config("gpt2", **model, parallel__pipe=2, parallel__pipeline_repeats=3, parallel__data=2))
    assert list(circ.layer_order(6)) == ORDER
    loaded = jax.device_get(hf.load_params(circ, tmp_path / "hf"))
    # the vocabulary rows beyond model.vocab_size are padding: zeros after an import
    want = jax.tree.map(lambda a, ax: a[ORDER] if ax[:1] == ("layers",) else a, params, one.adapter.axes,
                        is_leaf=lambda x: isinstance(x, np.ndarray))
    v = config("gpt2").model.vocab_size
    want["embed"]["embedding"][v:] = 0
    assert_trees_close(loaded, want, 0.0, "imported params ")
    back = dict(hf.hf_tensors(circ, jax.device_put(loaded, circ.state_shardings["params"])))
    mine = dict(hf.hf_tensors(one, jax.device_put(params, one.state_shardings["params"])))
    assert sorted(back) == sorted(mine) and len(mine) > 6 * 10
    for name, a in mine.items():
        np.testing.assert_array_equal(back[name], a, err_msg=name)
