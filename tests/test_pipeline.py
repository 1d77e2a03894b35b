"""Pipeline parallelism: numbers equal one device, the schedule's collectives and flops, memory,
errors, and the schedule chart."""

import functools

import jax
import numpy as np
import pytest

from helpers import assert_trees_close, config, first_step, rel_err, trainer
from jaxpar.config import ConfigError
from jaxpar.layers.pipeline import bubble_fraction, schedule, stage_major_order

L4 = dict(model__n_layers=4)


def loss_grads(cfg):
    first = first_step(cfg)
    t, loss, grads = first["trainer"], first["loss"], first["grads"]
    s, r = t.sizes["pipe"], cfg.parallel.pipeline_repeats
    if s > 1 and r > 1:  # circular storage is stage-major: put the layers back in order
        inv = np.argsort(stage_major_order(cfg.model.n_layers, s, r))
        grads = jax.tree.map(lambda g, ax: g[inv] if ax[:1] == ("layers",) else g, grads, t.adapter.axes,
                             is_leaf=lambda x: isinstance(x, np.ndarray))
    return float(loss), grads


@pytest.fixture(scope="module")
def single():
    out = {s: loss_grads(config(s, **L4)) for s in ("gpt2", "llama_gqa")}
    out["moe"] = loss_grads(config("gpt2", **L4, **MOE))
    out["moe_every2"] = loss_grads(config("gpt2", **L4, **MOE, moe__every=2))
    return out


CASES = [
    ("gpt2", dict(parallel__pipe=2)),
    ("gpt2", dict(parallel__pipe=4)),
    ("gpt2", dict(parallel__pipe=2, parallel__microbatches=4)),
    ("gpt2", dict(parallel__pipe=2, parallel__microbatches=8)),
    ("llama_gqa", dict(parallel__pipe=2, parallel__tensor=2, parallel__data=2)),
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=2)),
    ("gpt2", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=4, parallel__data=2)),
    ("llama_gqa", dict(parallel__pipe=2, parallel__seq=2, parallel__tensor=2, parallel__megatron_sp=True)),
    ("llama_gqa", dict(parallel__pipe=2, parallel__data=4, parallel__zero=1, train__grad_accum=2)),
    ("moe", dict(parallel__pipe=2, parallel__expert=2, parallel__microbatches=4)),
    # MoE groups of [dense, MoE]: the group's inner stack is a plain scan inside its stage
    ("moe_every2", dict(parallel__pipe=2, parallel__data=2)),
]
# MoE through the pipeline: router losses weighted 0 (their batch-mean products change with the
# microbatching); nothing drops (capacity factor E/k), so cross-entropy and gradients are exact.
MOE = dict(model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__capacity_factor=2.0, moe__d_ff=64,
           moe__aux_loss_weight=0.0, moe__z_loss_weight=0.0)


@pytest.mark.parametrize("style, layout", CASES, ids=[f"{s}-{'-'.join(f'{k[10:]}={v}' for k, v in l.items())}"
                                                       for s, l in CASES])
def test_loss_and_grads_match_single_device(single, style, layout):
    if style.startswith("moe"):
        cfg = config("gpt2", **L4, **MOE, **({"moe__every": 2} if style == "moe_every2" else {}), **layout)
    else:
        cfg = config(style, **L4, **layout)
    loss, grads = loss_grads(cfg)
    assert rel_err(loss, single[style][0]) <= 1e-5
    assert_trees_close(grads, single[style][1], 1e-5, "grads ")


def _report(**layout):
    return trainer(config("llama", **L4, **layout)).compile()


@pytest.mark.parametrize("repeats", [1, 2])
def test_collective_permutes_and_no_weight_gathers(repeats):
    """Each iteration shifts one microbatch's activations; the stage weights never move: no
    all-gather at all, also of the tensor-split weights (a stage keeps them split) and when a
    circular pipeline picks each iteration's layer group."""
    rep = _report(parallel__pipe=2, parallel__data=2, parallel__tensor=2, parallel__pipeline_repeats=repeats)
    c = rep["collectives"]
    cp = c["collective-permute"]["by_axes"]["pipe"]
    m = 2  # microbatches default to the stage count
    assert cp["count"] == 2 * (m * repeats + 2 - 1)  # each iteration: the shift forward, and its transpose backward
    assert c["all-gather"]["count"] == 0, c["all-gather"]
    cfg = config("llama", **L4)
    act = (cfg.train.batch_size // m // 2) * cfg.model.seq_len * cfg.model.d_model * 4  # microbatch / data
    assert c["collective-permute"]["max_bytes"] == act


def test_stage_weights_are_split_over_pipe():
    for s in (2, 4):
        t = trainer(config("llama", **L4, parallel__pipe=s))
        state = t.init_state()
        for leaf in jax.tree.leaves(state["params"]["blocks"]):
            assert leaf.addressable_shards[0].data.size * s == leaf.size


@functools.lru_cache(maxsize=None)
@functools.lru_cache(maxsize=None)
def _stack_flops(**lay):
    """Matmul flops of 4 layers (an 8-layer minus a 4-layer model: embedding and head cancel)."""
    f = [trainer(config("llama", model__n_layers=n, **lay)).compile()["matmul_flops"] for n in (4, 8)]
    return f[1] - f[0]


@pytest.mark.parametrize("s, m, r", [(2, 2, 1), (2, 2, 2)])
def test_flops_follow_the_schedule(s, m, r):
    """Bubble iterations compute (on zeros): per device, the layer stack's matmul flops are
    (M*R+S-1)/(M*R) x 1/S of the non-pipelined stack's."""
    ratio = _stack_flops(parallel__pipe=s, parallel__microbatches=m, parallel__pipeline_repeats=r) / _stack_flops()
    assert abs(ratio - (m * r + s - 1) / (m * r * s)) < 1e-3, ratio


def test_schedule_and_bubble():
    for s, m, r in [(4, 4, 1), (4, 8, 1), (2, 4, 3)]:
        grid = schedule(s, m, r)
        iters = m * r + s - 1
        assert all(len(row) == iters for row in grid)
        for row in grid:
            assert sorted(c for c in row if c) == sorted((mb, rr) for mb in range(m) for rr in range(r))
        idle = sum(c is None for row in grid for c in row) / (s * iters)
        assert abs(idle - bubble_fraction(s, m, r)) < 1e-12 and abs(idle - (s - 1) / (m * r + s - 1)) < 1e-12
        # a microbatch moves one stage per iteration, and comes back to stage 0 only after leaving stage S-1
        for mb in range(m):
            for rr in range(r):
                ts = [row.index((mb, rr)) for row in grid]
                assert ts == list(range(ts[0], ts[0] + s))
                if rr:
                    assert ts[0] > grid[s - 1].index((mb, rr - 1))


def test_schedule_chart(tmp_path):
    from jaxpar.plots import plot_schedule

    plot_schedule(4, 8, 2, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 5000


@pytest.mark.parametrize("layout, needle", [
    (dict(model__n_layers=3, parallel__pipe=2), "model.n_layers=3 is not divisible by parallel.pipe"),
    (dict(**L4, parallel__pipe=2, parallel__pipeline_repeats=4), "not divisible by parallel.pipe x parallel.pipeline_repeats"),
    (dict(**L4, parallel__pipe=4, parallel__microbatches=2), "parallel.microbatches=2 is fewer than the 4"),
    (dict(**L4, parallel__pipe=2, parallel__microbatches=3), "must split into parallel.microbatches=3"),
    (dict(**L4, parallel__pipe=2, parallel__data=4, parallel__microbatches=8), "each divisible by the batch-parallel"),
    (dict(**L4, parallel__pipe=2, parallel__data=2, parallel__zero=3), "parallel.zero=3 with parallel.pipe > 1"),
])
def test_bad_pipeline_input(layout, needle):
    with pytest.raises(ConfigError) as e:
        trainer(config("gpt2", **layout))
    assert needle in str(e.value), str(e.value)
