"""Per-device memory of the compiled step: what ZeRO-3 and tensor parallelism save."""

import jax
import numpy as np

from helpers import config, trainer

F32 = 4


def _leaves(t):
    axes = jax.tree.leaves(t.adapter.axes, is_leaf=lambda x: isinstance(x, tuple))
    return list(zip(jax.tree.leaves(t.adapter.abstract), axes))


def test_zero3_argument_bytes_are_an_eighth():
    """zero=3, data=8: params + Adam moments per device <= 1/8 of the whole + the small leaves that
    have no d_model dim to split (norm scales), which stay replicated; plus the batch shard."""
    t = trainer(config("llama", parallel__data=8, parallel__zero=3))
    mem = t.compile()["memory"]
    whole = sum(int(np.prod(a.shape)) for a, _ in _leaves(t)) * F32 * 3  # params, mu, nu
    small = sum(int(np.prod(a.shape)) for a, ax in _leaves(t) if "embed" not in ax) * F32 * 3
    cfg = t.cfg
    batch = 2 * cfg.train.batch_size * cfg.model.seq_len * 4 // 8
    scalars = 64  # step, Adam count
    assert small < whole / 50
    assert mem["argument_size"] <= whole / 8 + small + batch + scalars, (mem["argument_size"], whole / 8, small)


def test_tensor8_matrices_are_an_eighth():
    """tensor=8: every matrix holds 1/8 of its elements per device (checked on the live arrays)."""
    for style in ("gpt2", "llama"):
        t = trainer(config(style, parallel__tensor=8))
        state = t.init_state()
        flat = jax.tree_util.tree_flatten_with_path(state["params"])[0]
        for (path, x), (_, ax) in zip(flat, _leaves(t)):
            name = jax.tree_util.keystr(path)
            if sum(a not in ("layers",) for a in ax) < 2 or "positions" in ax:
                continue  # vectors, and GPT-2's [seq_len, d_model] position table (replicated, small)
            assert x.addressable_shards[0].data.size * 8 == x.size, (style, name)
        mem = t.compile()["memory"]
        whole = sum(int(np.prod(a.shape)) for a, _ in _leaves(t)) * F32 * 3
        assert mem["argument_size"] < whole / 4  # vectors and positions replicated, matrices / 8
