"""Pipeline parallelism: numbers equal one device, the schedule's collectives and flops, memory,
errors, and the schedule chart."""

import functools
import math

import jax
import numpy as np
import pytest

from helpers import (assert_trees_close, batches, check_moe_against_reference, config, first_step,
                     per_microbatch_reference, rel_err, trainer)
from jaxpar.config import ConfigError
from jaxpar.layers.pipeline import (bubble_fraction, in_flight, schedule, schedule_1f1b, stage_major_order,
                                    stash_rows, stash_slots)

L4 = dict(model__n_layers=4)


def loss_grads(cfg):
    first = first_step(cfg)
    t, loss, grads = first["trainer"], first["loss"], first["grads"]
    s, r = t.sizes["pipe"], cfg.parallel.pipeline_repeats
    v = cfg.parallel.pipeline_schedule == "zb_v"  # (ZB-V: each stage's second group on the way back up)
    if s > 1 and r > 1:  # circular storage is stage-major: put the layers (MoE: groups) back in order
        grads = jax.tree.map(lambda g, ax: g[np.argsort(stage_major_order(g.shape[0], s, r, v=v))]
                             if ax[:1] == ("layers",) else g, grads, t.adapter.axes,
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
    ("gpt2", dict(parallel__pipe=2, parallel__microbatches=8)),
    ("llama_gqa", dict(parallel__pipe=2, parallel__tensor=2, parallel__data=2)),
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=2)),
    ("gpt2", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=4, parallel__data=2)),
    # the embedding and head on their stage only (jaxpar.layers.onstage) with ZeRO-1 and accumulation
    ("gpt2", dict(parallel__pipe=2, parallel__tensor=2, parallel__data=2, parallel__zero=1, train__grad_accum=2)),
    # (seq x tensor with Megatron-SP, and ZeRO-1 with gradient accumulation: under 1F1B below; the schedules
    # share the stage function and the optimizer step)
    ("moe", dict(parallel__pipe=2, parallel__expert=2, parallel__microbatches=4)),
    # MoE groups of [dense, MoE]: the group's inner stack is a plain scan inside its stage
    ("moe_every2", dict(parallel__pipe=2, parallel__data=2)),
    # 1F1B: pipe 2 and 4, M = S, 2S, 4S, with data, tensor, seq + Megatron-SP, ZeRO-1 + accumulation, MoE
    ("gpt2", dict(parallel__pipe=2, parallel__pipeline_schedule="1f1b")),
    ("gpt2", dict(parallel__pipe=2, parallel__microbatches=8, parallel__pipeline_schedule="1f1b")),
    ("gpt2", dict(parallel__pipe=4, parallel__microbatches=8, parallel__data=2, parallel__pipeline_schedule="1f1b")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__tensor=2, parallel__data=2, parallel__microbatches=4,
                       parallel__pipeline_schedule="1f1b", model__remat="save_dots")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__seq=2, parallel__tensor=2, parallel__megatron_sp=True,
                       parallel__pipeline_schedule="1f1b")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__data=4, parallel__zero=1, train__grad_accum=2,
                       parallel__pipeline_schedule="1f1b")),
    ("moe_every2", dict(parallel__pipe=2, parallel__expert=2, parallel__microbatches=4,
                        parallel__pipeline_schedule="1f1b")),
    # interleaved 1F1B (2 chunks per stage): M = S, 2S, with data and tensor, MoE
    ("gpt2", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__pipeline_schedule="1f1b")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=4, parallel__data=2,
                       parallel__tensor=2, parallel__pipeline_schedule="1f1b")),
    ("moe", dict(parallel__pipe=2, parallel__expert=2, parallel__pipeline_repeats=2, parallel__microbatches=4,
                 parallel__pipeline_schedule="1f1b")),
    # ZB-H1 (B and W apart, the weight gradients of the deferred matmuls from their kept inputs and cotangents):
    # pipe 2 and 4, M = S, 2S, 4S, with data, tensor (+ Megatron-SP, seq with Ulysses), ZeRO-1 + accumulation,
    # every remat policy's kind, MoE with capacity and sorted dispatch, MoE groups whose inner stack keeps its
    # gradients in B
    ("gpt2", dict(parallel__pipe=2, parallel__pipeline_schedule="zb_h1")),
    ("gpt2", dict(parallel__pipe=4, parallel__microbatches=8, parallel__data=2, parallel__pipeline_schedule="zb_h1",
                  model__remat="full")),
    ("gpt2", dict(parallel__pipe=4, parallel__microbatches=16, parallel__pipeline_schedule="zb_h1")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__tensor=2, parallel__data=2, parallel__microbatches=4,
                       parallel__zero=1, train__grad_accum=2, parallel__pipeline_schedule="zb_h1",
                       model__remat="save_dots")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__seq=2, parallel__tensor=2, parallel__megatron_sp=True,
                       parallel__seq_attention="ulysses", parallel__pipeline_schedule="zb_h1")),
    ("moe", dict(parallel__pipe=2, parallel__expert=2, parallel__microbatches=4, parallel__pipeline_schedule="zb_h1")),
    ("moe_every2", dict(parallel__pipe=2, parallel__data=2, parallel__microbatches=8, moe__dropless=True,
                        moe__dispatch="sorted", parallel__pipeline_schedule="zb_h1")),
    # ZB-V (two chunks per stage in a V, stored so): M = S, 4S, with data and tensor, MoE (pipe 4 with M = 2S:
    # tests/test_uneven_stages.py, its 9 layers in 8 groups)
    ("gpt2", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__pipeline_schedule="zb_v")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=8,
                       parallel__tensor=2, parallel__data=2, parallel__pipeline_schedule="zb_v",
                       model__remat="full")),
    ("moe", dict(parallel__pipe=2, parallel__expert=2, parallel__pipeline_repeats=2, parallel__microbatches=4,
                 parallel__pipeline_schedule="zb_v")),
    # parallel.stage_remat=false (the default, which the cases above do not take: the test sets
    # parallel.stage_remat=true where a case leaves it unset, each stage's forward run again for its backward):
    # each backward from the residuals its forward kept (those of the weights alone computed again), under every
    # schedule that runs its own backward, every remat policy's kind, with data, tensor (+ Megatron-SP, seq),
    # ZeRO-1 + accumulation, MoE with capacity and sorted dispatch
    ("gpt2", dict(parallel__pipe=2, parallel__microbatches=4, parallel__pipeline_schedule="1f1b",
                  parallel__stage_remat=False, model__remat="none")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=4, parallel__data=2,
                       parallel__tensor=2, parallel__pipeline_schedule="1f1b", parallel__stage_remat=False,
                       model__remat="save_dots")),
    ("moe", dict(parallel__pipe=2, parallel__expert=2, parallel__microbatches=4, parallel__pipeline_schedule="1f1b",
                 parallel__stage_remat=False, model__remat="none")),
    ("gpt2", dict(parallel__pipe=4, parallel__microbatches=8, parallel__data=2, parallel__pipeline_schedule="zb_h1",
                  parallel__stage_remat=False, model__remat="none")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, parallel__zero=1, train__grad_accum=2,
                       parallel__microbatches=4, parallel__pipeline_schedule="zb_h1", parallel__stage_remat=False,
                       model__remat="full")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__seq=2, parallel__tensor=2, parallel__megatron_sp=True,
                       parallel__seq_attention="ulysses", parallel__pipeline_schedule="zb_h1",
                       parallel__stage_remat=False)),
    ("moe_every2", dict(parallel__pipe=2, parallel__data=2, parallel__microbatches=8, moe__dropless=True,
                        moe__dispatch="sorted", parallel__pipeline_schedule="zb_h1", parallel__stage_remat=False,
                        model__remat="none")),
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=8, parallel__tensor=2,
                       parallel__data=2, parallel__pipeline_schedule="zb_v", parallel__stage_remat=False,
                       model__remat="none")),
]
# MoE through the pipeline: router losses weighted 0 (their batch-mean products change with the
# microbatching); nothing drops (capacity factor E/k), so cross-entropy and gradients are exact.
MOE = dict(model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__capacity_factor=2.0, moe__d_ff=64,
           moe__aux_loss_weight=0.0, moe__z_loss_weight=0.0)


@pytest.mark.parametrize("style, layout", CASES, ids=[f"{s}-{'-'.join(f'{k[10:]}={v}' for k, v in l.items())}"
                                                       for s, l in CASES])
def test_loss_and_grads_match_single_device(single, style, layout):
    if layout.get("parallel__pipeline_schedule", "gpipe") != "gpipe":  # (ids without it: the layouts' own keys)
        layout = {"parallel__stage_remat": True, **layout}
    if style.startswith("moe"):
        cfg = config("gpt2", **L4, **MOE, **({"moe__every": 2} if style == "moe_every2" else {}), **layout)
    else:
        cfg = config(style, **L4, **layout)
    loss, grads = loss_grads(cfg)
    assert rel_err(loss, single[style][0]) <= 1e-5
    assert_trees_close(grads, single[style][1], 1e-5, "grads ")


@pytest.mark.parametrize("style, layout", [
    ("gpt2", dict(parallel__pipe=2, parallel__data=2, parallel__pipeline_schedule="1f1b")),
    ("moe_every2", dict(parallel__pipe=2, parallel__expert=2, parallel__pipeline_schedule="1f1b")),
    ("gpt2", dict(parallel__pipe=2, parallel__data=2, parallel__pipeline_repeats=2, parallel__microbatches=4,
                  parallel__pipeline_schedule="zb_v"))])
def test_evaluation_loss_matches_single_device(single, style, layout):
    """The loss without gradients (evaluation): under 1F1B it is ``pipeline_loss`` (the GPipe schedule
    with the embedding and the head inside the pipeline's ``shard_map``), equal to one device's."""
    moe = dict(MOE, moe__every=2) if style == "moe_every2" else {}
    cfg = config("gpt2", **L4, **moe, **layout)
    t = trainer(cfg)
    loss = float(t.eval_loss(t.init_state()["params"], t.place_batch(batches(cfg, 1)[0])))
    assert rel_err(loss, single[style][0]) <= 1e-5, (loss, single[style][0])


def test_microbatches_not_a_multiple_of_stages():
    """M = 3 on 2 stages: the numbers are the single device's; no schedule splits the batch over pipe
    (the embedding and head run inside the pipeline, on its first and last stage)."""
    from jaxpar.partitioning import make_rules

    base = dict(train__batch_size=12)
    loss, grads = loss_grads(config("gpt2", **base, parallel__pipe=2, parallel__microbatches=3))
    ref = loss_grads(config("gpt2", **base))
    assert rel_err(loss, ref[0]) <= 1e-5
    assert_trees_close(grads, ref[1], 1e-5, "grads ")
    batch = lambda **p: make_rules(config("gpt2", **p).parallel).params.table["batch"]  # noqa: E731
    for m, sched in [(3, "gpipe"), (4, "gpipe"), (4, "1f1b")]:
        assert "pipe" not in batch(parallel__pipe=2, parallel__microbatches=m, parallel__pipeline_schedule=sched)


def _report(**layout):
    return trainer(config("llama", **L4, **layout)).compile()


@pytest.mark.parametrize("sched", [dict(), dict(parallel__pipeline_repeats=2),
                                   dict(parallel__pipeline_schedule="1f1b"),
                                   dict(parallel__pipeline_schedule="1f1b", parallel__pipeline_repeats=2)],
                         ids=["gpipe", "circular", "1f1b", "interleaved_1f1b"])
def test_pipe_traffic_is_point_to_point(sched):
    """What crosses ``pipe`` per step, counted in the compiled program at M = S and M = 8S (S = 2):
    nothing of the batch crosses pipe but the stage shifts (collective-permutes), within 1.1x of the
    minimum at M = 8S (each microbatch's boundary activation once forward and its gradient once backward,
    R times round the ring); no all-gather; the all-reduces over pipe, the same at every M, sum the
    embedding's and head's weight gradients (each nonzero on one stage) and the loss; the stage weights
    never move."""
    cfg = config("llama", **L4)
    act = 2 * cfg.model.seq_len * cfg.model.d_model * 4  # 2 rows per microbatch and data shard, float32
    reduces = {}
    r = sched.get("parallel__pipeline_repeats", 1)
    f1b = "parallel__pipeline_schedule" in sched
    for m in (2, 16):
        c = trainer(config("llama", model__n_layers=2 * r, parallel__pipe=2, parallel__data=2, parallel__tensor=2,
                           parallel__microbatches=m, train__batch_size=2 * m * 2, **sched)).compile()["collectives"]
        cp, ag = c["collective-permute"]["by_axes"]["pipe"], c["all-gather"]
        assert ag["count"] == 0, ag
        if f1b:  # forwards in every iteration, backwards in the steady loop's (M R + S - 1)
            count = (m * r + r * 2 + 2 - 2) + (m * r + 2 - 1)
        else:  # one shift each way per iteration, M R + S - 1 iterations
            count = 2 * (m * r + 2 - 1)
        assert cp["count"] == count and cp["bytes"] == count * act, (cp, count)
        if m == 16:
            assert cp["bytes"] <= 1.1 * (2 * m * r * act), (cp["bytes"], 2 * m * r * act)
        reduces[m] = c["all-reduce"]["by_axes"]["pipe"]
    # the weights outside the stack, nothing of the batch: float32, the embedding and the untied head
    # (vocabulary padded to 256, split over tensor = 2) and the final norm
    outer = 4 * (256 * cfg.model.d_model * 2 // 2 + cfg.model.d_model)
    assert reduces[2] == reduces[16] and reduces[2]["count"] <= 6, reduces
    assert outer <= reduces[2]["bytes"] <= 1.01 * outer, (reduces, outer)


@pytest.mark.parametrize("sched, tensor", [("gpipe", 2), ("1f1b", 2), ("1f1b", 1), ("zb_h1", 2), ("zb_v", 2)])
def test_head_and_embedding_run_on_their_stage_only(sched, tensor):
    """The head's matmuls (every ``dot`` with a dimension of a device's vocabulary slice, 384 of a padded 768
    split over tensor = 2, or 768 on pipe alone: no other dimension of the model) and the embedding's gather
    from the table and its gradient's scatter into it sit only inside one branch of conditionals
    (``jaxpar.hlo.conditional_branches``),
    never where every device runs them; the other branch holds none of them, and no branch holds a collective
    (jaxpar.layers.onstage: the devices that take different branches still issue the same collectives)."""
    from jaxpar import hlo

    cfg = config("llama_gqa", **L4, model__vocab_size=700, parallel__pipe=2, parallel__tensor=tensor,
                 parallel__data=tensor, parallel__microbatches=4, parallel__pipeline_schedule=sched,
                 parallel__pipeline_repeats=2 if sched == "zb_v" else 1)
    text = trainer(cfg).hlo_text()
    v, d = 768 // tensor, cfg.model.d_model
    comps, _ = hlo.parse_computations(text)
    always, conds = hlo.conditional_branches(text)

    def holds(c, what):
        types = {i.name: i.type for i in comps[c]}
        for i in comps[c]:
            shapes = [hlo._dims(i.type)] + [hlo._dims(types.get(o, "")) for o in i.operands]
            if what == "dot" and i.opcode == "dot" and any(v in sh for sh in shapes):
                return True
            if what == "table" and i.opcode in ("gather", "scatter") and [v, d] in shapes:
                return True
        return False

    for what in ("dot", "table"):
        where = {c for c in comps if holds(c, what)}
        assert where and not where & always, (what, where & always)
        for name, branches in conds:
            n = [bool(b & where) for b in branches]
            assert sum(n) <= 1, (what, name)  # one branch does the work, the other none of it
        assert where <= set().union(*(b for _, bs in conds for b in bs)), what
    collective = lambda c: any(i.opcode.removesuffix("-start") in hlo.KINDS for i in comps[c])  # noqa: E731
    for name, branches in conds:
        if any(holds(c, w) for b in branches for c in b for w in ("dot", "table")):
            assert not any(collective(c) for b in branches for c in b), name


def test_a_branch_taken_per_device_holds_no_collective():
    """jaxpar.layers.onstage.when runs its function where the predicate holds (here the second stage) and the
    other elsewhere; it refuses a branch that communicates (a psum, or a cast to varying of an operand, whose
    transpose is a psum), and one traced where an axis is left to XLA's partitioner; without a predicate it is
    the function itself."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.layers.onstage import when

    mesh = jax.make_mesh((2, 2), ("pipe", "tensor"), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x = jax.numpy.arange(8.0)

    def run(fn, axis_names=("pipe", "tensor"), check_vma=False):
        body = lambda x: when(jax.lax.axis_index("pipe") == 1, fn, lambda x: x, x)  # noqa: E731
        t = "tensor" if "tensor" in axis_names else None
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(t), out_specs=P(("pipe", t) if t else "pipe"),
                                     axis_names=set(axis_names), check_vma=check_vma))(x)

    got = np.asarray(run(lambda x: 2 * x))
    np.testing.assert_array_equal(got, np.concatenate([np.arange(8.0), 2 * np.arange(8.0)]))
    with pytest.raises(ValueError, match=r"collectives \['psum'\]"):
        run(lambda x: jax.lax.psum(x, "tensor"))
    with pytest.raises(ValueError, match=r"collectives \['pcast'\]|collectives \['pvary'\]"):
        run(lambda x: x * jax.lax.pcast(x.sum(), ("pipe",), to="varying"), check_vma=True)
    with pytest.raises(RuntimeError, match="manual over every mesh axis"):
        run(lambda x: 2 * x, axis_names=("pipe",))
    assert when(None, lambda x: 2 * x, lambda x: x, 3.0) == 6.0


def test_stage_weights_are_split_over_pipe():
    for s in (2, 4):
        t = trainer(config("llama", **L4, parallel__pipe=s))
        state = t.init_state()
        for leaf in jax.tree.leaves(state["params"]["blocks"]):
            assert leaf.addressable_shards[0].data.size * s == leaf.size


@functools.lru_cache(maxsize=None)
def _stack_flops(**lay):
    """Matmul flops of 4 layers (an 8-layer minus a 4-layer model: embedding and head cancel)."""
    f = [trainer(config("llama", model__n_layers=n, **lay)).compile()["matmul_flops"] for n in (4, 8)]
    return f[1] - f[0]


@pytest.mark.parametrize("sched, remat", [("1f1b", "none"), ("zb_h1", "none"), ("1f1b", "full")])
def test_a_backward_from_kept_residuals_runs_no_forward_again(sched, remat):
    """``parallel.stage_remat=false``: per device, the stack's matmul flops fall by exactly the forwards the
    backwards ran again, one chunk's forward of one microbatch per backward slot of the loop: 1F1B's M + S - 1
    steady iterations, ZB-H1's every one of its T slots (XLA:CPU's program holds every pass in every slot and
    counts it so). One chunk's forward of one microbatch is 1/(M S) of the unpipelined stack's forward, itself
    a third of that stack's matmul flops under ``remat=none`` (the backward's are two: the input's and the
    weights'). Under ``remat=full`` too: the stage's forward run again keeps each layer's input only, and its
    backward runs each layer's forward once more (the planner searches kept residuals under every policy)."""
    from jaxpar.layers.zero_bubble import tables

    s, m = 2, 2
    lay = dict(parallel__pipe=s, parallel__microbatches=m, parallel__pipeline_schedule=sched, model__remat=remat)
    saved = _stack_flops(**lay, parallel__stage_remat=True) - _stack_flops(**lay, parallel__stage_remat=False)
    runs = m + s - 1 if sched == "1f1b" else tables(sched, s, m)["slots"]
    forward = _stack_flops(model__remat="none") / 3
    assert abs(saved / forward - runs / (m * s)) < 1e-3, (saved / forward, runs / (m * s))


@pytest.mark.parametrize("s, m, r", [(2, 2, 2)])
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


def test_1f1b_schedule():
    """Every microbatch's forward on stage s at t = m + s and its backward at m + 2(S-1) - s: forwards
    move down the stages and backwards up, one stage per iteration; a stage never holds more than
    2S - 1 microbatches (min(M, 2(S-1-s) + 1)); the busy share in forward + backward time is GPipe's."""
    for s_, m_ in [(2, 2), (4, 4), (4, 16), (3, 5)]:
        grid = schedule_1f1b(s_, m_)
        assert all(len(row) == m_ + 2 * (s_ - 1) for row in grid)
        for m in range(m_):
            f = [next(t for t, c in enumerate(row) if ("F", m, 0) in c) for row in grid]
            b = [next(t for t, c in enumerate(row) if ("B", m, 0) in c) for row in grid]
            assert f == list(range(f[0], f[0] + s_)) and b == list(range(b[0], b[0] - s_, -1))
            assert b[s_ - 1] == f[s_ - 1] and all(bs > fs for bs, fs in zip(b[:-1], f[:-1]))
        assert in_flight(s_, m_) == [min(m_, 2 * (s_ - 1 - s) + 1) for s in range(s_)]
        assert max(in_flight(s_, m_)) <= stash_slots(s_)
        assert max(in_flight(s_, m_)) == stash_slots(s_, 1, m_) == stash_rows(s_, m_).max() + 1  # no row unused
        # time: iterations with only forwards cost F, only backwards B, both F + B; with B = 2F
        cost = sum(3 if {op for row in grid for op, _, _ in row[t]} == {"F", "B"} else
                   (1 if all(op == "F" for row in grid for op, _, _ in row[t]) else 2) for t in range(len(grid[0])))
        assert abs(1 - 3 * m_ / cost - bubble_fraction(s_, m_)) < 1e-12


def test_interleaved_1f1b_schedule():
    """R chunks per stage: every (microbatch, chunk) runs forward and backward once per stage; a forward
    is on the next stage (chunk r + 1 on stage 0 after chunk r on the last) exactly one iteration after
    the previous one (a shift arrives for one iteration only), a backward likewise in reverse, the last
    stage's last chunk starts a backward in the iteration of its forward; a stage does at most one of
    each per iteration, holds at most (R + 1) S - 1 chunk inputs whatever M (the executor's stash rows exactly
    as many), and idles (S-1)/(MR+S-1) of the
    time in chunk forward + backward units (the circular schedule's bubble)."""
    for s_, m_, r_ in [(2, 2, 2), (2, 8, 2), (4, 8, 2), (3, 6, 3), (4, 32, 2)]:
        grid = schedule_1f1b(s_, m_, r_)
        assert all(len(row) == m_ * r_ + r_ * s_ + s_ - 2 for row in grid)
        at = {(op, m, r, s): t for s, row in enumerate(grid) for t, cell in enumerate(row) for op, m, r in cell}
        assert len(at) == 2 * m_ * r_ * s_
        assert all(sum(op == k for op, _, _ in cell) <= 1 for row in grid for cell in row for k in "FB")
        for m in range(m_):
            hops = [(r, s) for r in range(r_) for s in range(s_)]  # the virtual stages, in order
            f = [at["F", m, r, s] for r, s in hops]
            b = [at["B", m, r, s] for r, s in hops]
            assert f == list(range(f[0], f[0] + r_ * s_)) and b == list(range(b[0], b[0] - r_ * s_, -1))
            assert b[-1] == f[-1]
        assert max(in_flight(s_, m_, r_)) == stash_slots(s_, r_, m_) == stash_rows(s_, m_, r_).max() + 1
        assert stash_slots(s_, r_, m_) <= (r_ + 1) * s_ - 1 < 2 * r_ * s_ - 1  # a ring of forward slots: 2RS - 1
        cost = sum(3 if {op for row in grid for op, _, _ in row[t]} == {"F", "B"} else
                   (1 if all(op == "F" for row in grid for op, _, _ in row[t]) else 2) for t in range(len(grid[0])))
        assert abs(1 - 3 * m_ * r_ / cost - bubble_fraction(s_, m_, r_)) < 1e-12
    assert in_flight(4, 32, 2) == in_flight(4, 8, 2)  # flat in M


@pytest.mark.parametrize("stage_remat", [True, False], ids=["inputs", "kept"])
def test_bfloat16_stash_is_written_in_place(stage_remat):
    """A bfloat16 1F1B stash (the stage inputs, or with ``parallel.stage_remat=false`` the residuals) is held
    as its bits: the compiled step has it as uint16 and never as a float32 copy (XLA:CPU ran a bfloat16
    row update as a conversion of the whole stash to float32 and back), and the step's loss and gradients
    are the float32 stash's within bfloat16's rounding of the layers' work (the bits round-trip exactly)."""
    import jax

    over = dict(L4, parallel__pipe=2, parallel__pipeline_schedule="1f1b", parallel__microbatches=4,
                parallel__stage_remat=stage_remat, model__remat="save_dots", model__compute_dtype="bfloat16")
    cfg = config("llama", **over)
    got = first_step(cfg)
    rows, m = stash_slots(2, 1, 4), cfg.model.resolved()
    mb = cfg.train.batch_size // 4
    stash = f"[{rows},{mb},{m.seq_len},{m.d_model}]" if stage_remat else f"[{rows},2,{mb},{m.seq_len},{m.d_model}]"
    text = got["trainer"].hlo_text()
    assert f"u16{stash}" in text and f"f32{stash}" not in text and f"bf16{stash}" not in text, stash
    ref = first_step(config("llama", **{**over, "parallel__stage_remat": False, "parallel__pipe": 1,
                                         "parallel__pipeline_schedule": "gpipe", "parallel__microbatches": 0}))
    assert abs(got["loss"] - ref["loss"]) <= 2e-2 * abs(ref["loss"])
    for a, b in zip(jax.tree.leaves(got["grads"]), jax.tree.leaves(ref["grads"])):
        assert rel_err(a, b) <= 0.1


def test_1f1b_memory_stays_flat_in_microbatches():
    """Per-device temporaries of the compiled step at a fixed microbatch size (pipe=2): 1F1B at M = 8S within
    1.3x of M = S (its stages hold at most 2S - 1 microbatches), interleaved 1F1B too (2 chunks per stage:
    at most (R + 1) S - 1 chunk inputs), and with a MoE model's dense first layers (the lead-in: run per microbatch
    on the first stage, forward and backward; taken over the whole batch after the loops they made M = 8S 7.7x
    M = S here); GPipe's grow with M (all of them)."""
    temp = {}
    lead = dict(model__arch="moe", moe__n_experts=4, moe__first_dense=2, model__n_layers=4, model__seq_len=128)
    for sched, r, over in (("gpipe", 1, {}), ("1f1b", 1, {}), ("1f1b", 2, {}), ("1f1b-lead", 1, lead)):
        for m in (2, 16):
            t = trainer(config("llama", **{"model__n_layers": 2 * r, **over}, parallel__pipe=2,
                               parallel__microbatches=m, parallel__pipeline_repeats=r,
                               parallel__pipeline_schedule=sched.split("-")[0], train__batch_size=4 * m,
                               **({} if sched == "gpipe" else {"parallel__stage_remat": True})), 2)
            temp[sched + "x" * (r - 1), m] = t.compile()["memory"]["temp_size"]
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temp.items()})
    assert temp["1f1b", 16] <= 1.3 * temp["1f1b", 2], temp
    assert temp["1f1bx", 16] <= 1.3 * temp["1f1bx", 2], temp
    assert temp["1f1b-lead", 16] <= 1.3 * temp["1f1b-lead", 2], temp
    assert temp["gpipe", 16] >= 3 * temp["gpipe", 2], temp


@pytest.mark.slow
@pytest.mark.parametrize("model", ["moe", "bfloat16", "sorted-bfloat16"])
def test_stage_keeps_no_copy_of_its_weights_per_iteration(model):
    """Under ``remat=none`` a pipeline stage keeps no copy of its layers' weights for the backward, which selects
    them again (:data:`jaxpar.layers.remat._SELECTION`): not a MoE layer's (its experts run in a ``shard_map``
    over ``data``, which casts its replicated inputs to device-varying), not their bfloat16 casts. Weights
    dominate these models (16 experts of width 256; a dense MLP of width 1024; 16 tokens), so a copy per loop
    iteration shows: GPipe at M = 8 against M = 2 (the same batch, 6 iterations more) and 1F1B without remat
    against ``full`` (one sequence per microbatch) each grow by less than a quarter of the stage's weights
    (MoE: they grew by 5.5 and 1.1 stage copies when the varying cast was kept; bfloat16: by 5.2 and 1.1 when
    the casts were; the sorted dispatch's: by 3.4 and 0.7 when the reshape of its cast weights was)."""
    if model == "moe":
        over = dict(model__arch="moe", moe__n_experts=16, moe__top_k=2, moe__d_ff=256)
    elif model == "sorted-bfloat16":  # the sorted dispatch reshapes the experts' cast weights for its tiles
        over = dict(model__arch="moe", moe__n_experts=16, moe__top_k=2, moe__d_ff=256, moe__dropless=True,
                    moe__dispatch="sorted", model__compute_dtype="bfloat16")
    else:
        over = dict(model__d_model=256, model__n_heads=4, model__n_kv_heads=4, model__d_ff=1024,
                    model__compute_dtype="bfloat16")
    temp = {}
    for sched, remat, m in (("gpipe", "none", 2), ("gpipe", "none", 8), ("1f1b", "none", 2), ("1f1b", "full", 2),
                            ("1f1b-kept", "none", 2)):
        t = trainer(config("llama", **over, model__n_layers=4, model__seq_len=16, parallel__data=2, parallel__pipe=2,
                           parallel__microbatches=m, parallel__pipeline_schedule=sched.split("-")[0],
                           model__remat=remat, parallel__stage_remat=sched == "1f1b",
                           train__batch_size=16 if sched == "gpipe" else 4), 4)
        temp[sched, remat, m] = t.compile()["memory"]["temp_size"]
    stage = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # the stage's stacked matrices
                for x in jax.tree.leaves(t.abstract_state["params"]) if x.ndim >= 3)
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temp.items()}, f"stage {stage / 2**20:.2f} MiB")
    assert temp["gpipe", "none", 8] - temp["gpipe", "none", 2] < stage / 4, temp
    assert temp["1f1b", "none", 2] - temp["1f1b", "full", 2] < stage / 4, temp
    # parallel.stage_remat=false: the stash's 3 slots hold the residuals that depend on the microbatch only, the
    # selected, cast weights among them computed again in the backward (jaxpar.layers.residuals): a copy of the
    # weights per slot would add 3 stages; the activations of 3 microbatches add less than half of one (MoE: 2.2
    # MiB against the stage's 6.1, its experts' capacity buffers)
    assert temp["1f1b-kept", "none", 2] - temp["1f1b", "none", 2] < stage / 2, temp


def test_schedule_chart(tmp_path):
    from jaxpar.plots import main, plot_schedule

    plot_schedule(4, 8, 2, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 5000
    assert main(["--stages", "4", "--microbatches", "8", "--schedule", "1f1b", "--out", str(tmp_path / "f.png")]) == 0
    assert (tmp_path / "f.png").stat().st_size > 5000
    assert main(["--stages", "4", "--microbatches", "8", "--schedule", "1f1b", "--repeats", "2",
                 "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").stat().st_size > 5000
    assert main(["--stages", "4", "--microbatches", "6", "--schedule", "1f1b", "--repeats", "2",
                 "--out", str(tmp_path / "h.png")]) == 2
    for kind in ("zb_h1", "zb_v"):
        assert main(["--stages", "4", "--microbatches", "8", "--schedule", kind, "--out", str(tmp_path / "z.png")]) == 0
        assert (tmp_path / "z.png").stat().st_size > 5000
        (tmp_path / "z.png").unlink()


@pytest.mark.parametrize("layout, needle", [
    (dict(model__n_layers=3, parallel__pipe=4), "3 layers: fewer than the parallel.pipe = 4 stages"),
    (dict(**L4, parallel__pipe=2, parallel__pipeline_repeats=4),
     "4 layers: fewer than the parallel.pipe x parallel.pipeline_repeats = 8 layer groups"),
    (dict(**L4, parallel__pipe=4, parallel__microbatches=2), "parallel.microbatches=2 is fewer than the 4"),
    (dict(**L4, parallel__pipe=2, parallel__microbatches=3), "must split into parallel.microbatches=3"),
    (dict(**L4, parallel__pipe=2, parallel__data=4, parallel__microbatches=8), "each divisible by the batch-parallel"),
    (dict(**L4, parallel__pipe=2, parallel__data=2, parallel__zero=3), "parallel.zero=3 with parallel.pipe > 1"),
    (dict(**L4, parallel__pipe=2, parallel__pipeline_repeats=2, parallel__microbatches=3,
          parallel__pipeline_schedule="1f1b"), "needs parallel.microbatches to be a multiple of parallel.pipe=2"),
    (dict(**L4, model__arch="moe", moe__every=2, parallel__pipe=2, parallel__pipeline_repeats=2),
     "2 layers (a MoE model: groups of moe.every layers): fewer than the parallel.pipe x parallel.pipeline_repeats"),
    (dict(**L4, parallel__pipeline_schedule="1f1b"),
     "parallel.pipeline_schedule=1f1b has no effect with parallel.pipe=1"),
    (dict(**L4, parallel__pipe=2, parallel__pipeline_schedule="pipedream"), "parallel.pipeline_schedule"),
    (dict(**L4, parallel__pipe=2, parallel__stage_remat=True),
     "parallel.stage_remat=true has no effect with parallel.pipeline_schedule=gpipe"),
    (dict(**L4, parallel__stage_remat=True), "parallel.stage_remat=true has no effect with parallel.pipe=1"),
])
def test_bad_pipeline_input(layout, needle):
    with pytest.raises(ConfigError) as e:
        trainer(config("gpt2", **layout))
    assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("batch, micro, fits", [(12, 0, [3]), (16, 3, [2, 4]), (10, 0, [])])
def test_a_batch_that_does_not_split_names_the_microbatch_counts_that_do(batch, micro, fits):
    """pipe=2 x data=4: a batch the microbatches cannot split evenly over ``data`` is refused with the counts
    that split it (each then builds), or, where none does, the batch multiple that would; an unset
    ``parallel.microbatches`` is named as the default it is (one per stage)."""
    import re

    over = dict(**L4, parallel__pipe=2, parallel__data=4, train__batch_size=batch)
    with pytest.raises(ConfigError) as e:
        trainer(config("gpt2", **over, parallel__microbatches=micro))
    msg = str(e.value)
    assert ("(unset: one per stage)" in msg) == (micro == 0), msg
    if fits:
        listed = [int(k) for k in re.search(r"set parallel\.microbatches to (?:one of )?([\d, ]+)", msg)[1].split(",")]
        assert listed == fits, msg
        for k in fits:
            trainer(config("gpt2", **over, parallel__microbatches=k))
    else:
        assert "a multiple of 8 (parallel.pipe x data x expert)" in msg, msg
        trainer(config("gpt2", **{**over, "train__batch_size": 16}))


# --- the router losses on, as in a real run ---------------------------------------------------------
# A pipeline of M microbatches adds each microbatch's router losses, averaged over the microbatches: the balance
# loss E sum_i f_i P_i is a product of two batch means, so this is not the whole batch's value. The reference is
# one device run on each microbatch alone (rows m, m+M, ...: the pipeline's and train.grad_accum's split), its
# losses, metrics and gradients averaged here by hand.
MOE_ON = dict(model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__capacity_factor=2.0, moe__d_ff=64)
MOE6 = dict(model__n_layers=6, **MOE_ON)  # 6 layers: also the circular test's below (one shared reference)


@pytest.mark.parametrize("sched", ["gpipe", "1f1b", "gpipe_default_capacity", "gpipe_sorted", "1f1b_sorted",
                                   "interleaved_sorted"])
def test_pipelined_moe_with_router_losses_on_matches_one_device_per_microbatch(sched):
    """MoE through the pipeline (6 layers, pipe=2 x expert=2, M = 4) with the balance and z-losses at their defaults
    (0.01, 0.001: on, as in a real run; the other pipeline tests weigh them 0): the loss, the reported
    ``ce_loss``, ``moe_aux_loss``, ``moe_z_loss``, ``moe_expert_load``, ``moe_drop_fraction`` and the
    gradients equal one device's averaged over the 4 microbatches run one at a time; the evaluation loss
    (``Trainer.eval_loss``, what the validation hook calls) is the cross-entropy alone, one device's.
    ``gpipe_default_capacity``: the default capacity factor 1.25 (< E/k: tokens drop, as in a real run; the
    other pipeline tests never drop) on pipe=2 alone, so that each microbatch is one routing group as on the
    one device: the same assignments drop (``moe_drop_fraction`` > 0, equal). ``*_sorted``: the dropless
    sorted dispatch (grouped matmuls and all-to-all rounds in the layer's own ``shard_map``) in every
    schedule, interleaved 1F1B included, against the same per-microbatch reference."""
    model = dict(MOE6)
    layout = dict(parallel__pipe=2, parallel__expert=2, parallel__microbatches=4, parallel__pipeline_schedule=sched)
    if sched == "gpipe_default_capacity":
        del model["moe__capacity_factor"], layout["parallel__expert"]
        layout["parallel__pipeline_schedule"] = "gpipe"
    if sched.endswith("_sorted"):
        model.update(moe__dispatch="sorted", moe__dropless=True)
        layout["parallel__pipeline_schedule"] = "gpipe" if sched == "gpipe_sorted" else "1f1b"
        if sched == "interleaved_sorted":
            layout["parallel__pipeline_repeats"] = 3
    cfg = config("gpt2", **model, **layout)
    assert (cfg.moe.aux_loss_weight, cfg.moe.z_loss_weight) == (0.01, 0.001)  # the defaults
    assert cfg.moe.capacity_factor == (1.25 if sched == "gpipe_default_capacity" else 2.0)
    ref = per_microbatch_reference("gpt2", 4, **model)
    first = first_step(cfg)
    if sched == "interleaved_sorted":  # the circular storage order of the stacked layers
        ref = (*ref[:2], first["trainer"].to_storage_order(ref[2]), ref[3])
    check_moe_against_reference(cfg, first["loss"], first["aux"], first["grads"], ref)
    if sched == "gpipe":  # (1F1B evaluates with the same program: its loss without gradients is GPipe's)
        t = first["trainer"]
        val = float(t.eval_loss(first["state"]["params"], t.place_batch(batches(cfg, 1)[0])))
        assert rel_err(val, ref[1]["ce_loss"]) <= 1e-5, (val, ref[1]["ce_loss"])


# --- a circular storage order that is not its own inverse ---------------------------------------------
# pipe=2 x pipeline_repeats=2 (every other circular test) stores the layers as [0, 2, 1, 3]: a swap, its own
# inverse, so code applying the inverse permutation where it should apply the permutation (or the reverse)
# passes there. pipe=2 x repeats=3 with 6 one-layer groups: stage 0 runs groups 0, 2, 4 and stage 1 groups
# 1, 3, 5, stored stage-major, so storage position p holds layer ORDER_2x3[p] (by hand, from the schedule
# in jaxpar/layers/pipeline.py's docstring): a 4-cycle (positions 1 -> 2 -> 4 -> 3 -> 1), not its own inverse.
ORDER_2x3 = [0, 2, 4, 1, 3, 5]
INVERSE_2x3 = [0, 3, 1, 4, 2, 5]  # layer i sits at position INVERSE_2x3[i]


def _circular_case(case: str):
    """``(style, model overrides, pipelined layout, microbatches)`` of a circular case."""
    lay = dict(parallel__pipe=2, parallel__pipeline_repeats=3)
    if case == "gpipe_circular":  # Gemma 3's switches: local (window 4) and global layers alternate (per-layer values)
        return "gemma3", dict(model__n_layers=6), dict(lay, parallel__microbatches=2), 2
    return "gpt2", MOE6, dict(lay, parallel__expert=2, parallel__microbatches=4, parallel__pipeline_schedule="1f1b"), 4


@pytest.mark.parametrize("case", ["gpipe_circular", "interleaved_1f1b_moe"])
def test_circular_pipeline_whose_storage_order_is_not_its_own_inverse(case):
    """pipe=2 x pipeline_repeats=3, 6 layers (groups of one): the GPipe-circular schedule (M = 2) on Gemma 3's
    switches (local and global layers alternate: the per-layer windows must follow the layers into storage
    order), and interleaved 1F1B (M = 4) on the MoE model with its router losses on. The storage order is the
    hand-made ORDER_2x3, which differs from its inverse (a 4-cycle of positions; pipe=2 x repeats=2's
    [0, 2, 1, 3] is a swap, its own inverse, so a permutation applied the wrong way round passes there). The
    loss and the gradients (put back in layer order by hand) equal one device's (MoE: averaged over the
    microbatches run alone); the initial parameters, in storage order and brought back to layer order as
    checkpoints hold them (``state_to_layer_order``), are one device's exactly."""
    assert ORDER_2x3 != INVERSE_2x3 and [ORDER_2x3[i] for i in INVERSE_2x3] == list(range(6))
    style, model, layout, m = _circular_case(case)
    cfg = config(style, **model, **layout)
    if case == "gpipe_circular":
        windows = cfg.model.layer_windows()
        assert windows == [4, 0] * 3 and [windows[p] for p in ORDER_2x3] != [windows[p] for p in INVERSE_2x3]
        first = first_step(config(style, **model))
        ref = first["loss"], None, first["grads"], jax.device_get(first["state"]["params"])
    else:
        ref = per_microbatch_reference(style, m, **model)
    got = first_step(cfg)
    t = got["trainer"]
    assert list(stage_major_order(6, 2, 3)) == ORDER_2x3 and list(t.layer_order(6)) == ORDER_2x3

    def layer_order(tree):  # storage -> layer order, by the hand-made permutation
        return jax.tree.map(lambda a, ax: np.asarray(a)[INVERSE_2x3] if ax[:1] == ("layers",) else a, tree,
                            t.adapter.axes, is_leaf=lambda x: isinstance(x, np.ndarray))

    grads = layer_order(got["grads"])
    if case == "gpipe_circular":
        assert rel_err(got["loss"], ref[0]) <= 1e-5, (got["loss"], ref[0])
        assert_trees_close(grads, ref[2], 1e-5, "grads ")
    else:
        check_moe_against_reference(cfg, got["loss"], got["aux"], grads, ref)
    assert_trees_close(layer_order(jax.device_get(got["state"]["params"])), ref[3], 0.0, "stored params ")
    assert_trees_close(jax.device_get(t.state_to_layer_order(got["state"])["params"]), ref[3], 0.0,
                       "checkpointed params ")
