"""Per-device memory of the compiled step: what ZeRO-3 and tensor parallelism save."""

import jax
import numpy as np
import pytest

from helpers import config, trainer
from jaxpar.config import ConfigError

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


def _live_bytes(state, which):
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state[which]))


def _formula(t):
    """fp32 Adam: 4 bytes of parameter per weight over the shards its parameter layout splits it
    into, 8 bytes of moments over the optimizer layout's (gradients, transient, as the optimizer's)."""
    sizes = t.sizes

    def shards(spec):
        return int(np.prod([sizes[a] for e in spec if e for a in ((e,) if isinstance(e, str) else e)]))

    p = o = 0.0
    for (a, ax) in _leaves(t):
        n = int(np.prod(a.shape))
        p += 4 * n / shards(t.rules.params.spec(ax, a.shape))
        o += 8 * n / shards(t.rules.opt.spec(ax, a.shape))
    return p, o


@pytest.mark.parametrize("layout", [
    dict(parallel__data=8), dict(parallel__data=8, parallel__zero=1), dict(parallel__data=8, parallel__zero=3),
    dict(parallel__tensor=8), dict(parallel__data=2, parallel__seq=2, parallel__tensor=2, parallel__zero=1),
    dict(parallel__pipe=2, parallel__data=4, parallel__zero=1, model__n_layers=4),
    dict(model__arch="moe", moe__n_experts=4, parallel__data=2, parallel__expert=4, parallel__zero=3)],
    ids=["dp8", "zero1", "zero3", "tensor8", "data2-seq2-tensor2-zero1", "pipe2-data4-zero1", "moe-data2-expert4-zero3"])
def test_state_bytes_per_device_match_the_formula(layout):
    """The live arrays' per-device bytes of parameters and Adam moments equal the formula (4 + 8
    bytes per weight over the shards that hold it) within 5%; nothing is silently replicated."""
    t = trainer(config("llama", **layout))
    state = t.init_state()
    p, o = _formula(t)
    got_p, got_o = _live_bytes(state, "params"), _live_bytes(state, "opt")
    print(f"{layout}: params {got_p} B (formula {p:.0f}), optimizer {got_o} B (formula {o:.0f})")
    assert abs(got_p / p - 1) <= 0.05 and abs(got_o / o - 1) <= 0.05


def test_zero3_splits_dense_weights_over_data_and_expert():
    """MoE with data=2 x expert=4, zero=3: the dense weights (attention, embedding) are split over all
    8 devices (ZeRO over every axis that splits the batch), the experts over expert and then data."""
    t = trainer(config("gpt2", model__arch="moe", moe__n_experts=4, parallel__data=2, parallel__expert=4,
                       parallel__zero=3))
    state = t.init_state()
    p = state["params"]
    for leaf in (p["embed"]["embedding"], p["blocks"]["moe"]["attn"]["qkv"]["kernel"]):
        assert leaf.addressable_shards[0].data.size * 8 == leaf.size
    w_in = p["blocks"]["moe"]["mlp"]["w_in"]
    assert w_in.addressable_shards[0].data.size * 8 == w_in.size  # experts / 4, embed / 2


def test_replication_report_and_guard():
    dp = trainer(config("llama", parallel__data=8)).replication()
    assert abs(dp["fraction"] - 7 / 8) < 1e-9  # eight full replicas
    z3 = trainer(config("llama", parallel__data=8, parallel__zero=3)).replication()
    assert z3["fraction"] < 0.05  # only the norm scales stay replicated
    with pytest.raises(ConfigError, match=r"parallel.max_replicated_fraction=0.5: this layout keeps 87.5%"):
        trainer(config("llama", parallel__data=8, parallel__max_replicated_fraction=0.5))
    trainer(config("llama", parallel__data=8, parallel__zero=3, parallel__max_replicated_fraction=0.05))
