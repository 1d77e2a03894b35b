"""The zero-bubble grids (jaxpar.layers.zero_bubble) against the paper's slot counts and against a check of
their dependencies written here: every pass once, after the passes it needs, one pass per stage and slot."""

import numpy as np
import pytest

from helpers import batches, config, trainer
from jaxpar.layers.zero_bubble import (BWD, FWD, IDLE, KINDS, SENDS, WGT, idle_fraction, in_flight, lengths_for,
                                       passes_for, schedule_zero_bubble, stretch, tables)


def check_grid(kind: str, grid, stages: int, microbatches: int) -> dict:
    """The slot of every pass (kind, microbatch, chunk), after checking the grid: each stage runs at most one
    pass per slot, on chunks it holds, every pass of every chunk once, each after what it needs."""
    n = stages if kind == "zb_h1" else 2 * stages
    at = {}
    for s, row in enumerate(grid):
        for t, cell in enumerate(row):
            assert len(cell) <= 1, (s, t, cell)
            for p, m, r in cell:
                c = s if r == 0 else 2 * stages - 1 - s  # zb_v: the second chunk of stage s is on the way up
                assert r == 0 or kind == "zb_v", cell
                assert (p, m, c) not in at, (p, m, c)
                at[(p, m, c)] = t
    assert set(at) == {(p, m, c) for p in "FBW" for m in range(microbatches) for c in range(n)}
    for (p, m, c), t in at.items():
        if p == "F" and c > 0:
            assert at[("F", m, c - 1)] < t  # the previous chunk's output, shifted between slots
        if p == "B":
            assert at[("F", m, c)] < t
            if c < n - 1:
                assert at[("B", m, c + 1)] < t  # the next chunk's input cotangent
        if p == "W":
            assert at[("B", m, c)] < t
    return at


def test_idle_fractions_at_four_stages_and_eight_microbatches():
    """Issue 37's acceptance: at S = 4, M = 8, ZB-H1 idles at most half of 1F1B's share and ZB-V at most a
    quarter. 1F1B in the same slots (F, and B + W as one pass of two slots): 3M + 3(S - 1) slots, of which
    each stage idles 3(S - 1), a share of (S-1)/(M+S-1)."""
    s_, m_ = 4, 8
    one_f_one_b = (s_ - 1) / (m_ + s_ - 1)
    for kind, bound in (("zb_h1", 1 / 2), ("zb_v", 1 / 4)):
        grid = schedule_zero_bubble(kind, s_, m_)
        check_grid(kind, grid, s_, m_)
        print(f"\n{kind}: {len(grid[0])} slots, idle {idle_fraction(grid):.3f} (1F1B {one_f_one_b:.3f})")
        for row in grid:
            print(" ".join(f"{c[0][0]}{c[0][1]}{chr(39) if c[0][2] else ' '}" if c else ".  " for c in row))
        assert idle_fraction(grid) <= bound * one_f_one_b


@pytest.mark.parametrize("stages", [2, 3, 4, 5, 8])
def test_slots_and_memory_are_the_papers(stages):
    """ZB-H1 takes 3M + S - 1 slots (the paper's bubble (S-1)(T_F + T_B - T_W) at equal times); ZB-V 6M + S - 1
    slots of a chunk's pass where M is a multiple of S (the last device's S - 1 slots before its first input
    are its only idle ones; one slot more at S = 5, M > S), never more than 1F1B's 6M + 6(S - 1). Both hold
    at most 1F1B's peak of S stage inputs (ZB-V: 2S chunk inputs, each half a stage's) from a microbatch's F
    to its W."""
    for m_ in (stages, stages + 1, 2 * stages, 4 * stages):
        h1, v = (schedule_zero_bubble(k, stages, m_) for k in KINDS)
        check_grid("zb_h1", h1, stages, m_)
        check_grid("zb_v", v, stages, m_)
        assert len(h1[0]) == 3 * m_ + stages - 1
        assert max(in_flight(h1)) == stages
        assert max(in_flight(v)) <= 2 * stages
        assert 6 * m_ + stages - 1 <= len(v[0]) < 6 * m_ + 6 * (stages - 1)
        if m_ % stages == 0:
            assert len(v[0]) - (6 * m_ + stages - 1) in ((0, 1) if stages == 5 else (0,)), (stages, m_, len(v[0]))


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="'zb_x': choose one of zb_h1, zb_v"):
        schedule_zero_bubble("zb_x", 4, 8)
    with pytest.raises(ValueError, match="microbatches >= stages; got stages=4, microbatches=3"):
        schedule_zero_bubble("zb_v", 4, 3)


@pytest.mark.parametrize("kind, stages, microbatches, forward_only", [
    ("zb_h1", 2, 2, False), ("zb_h1", 4, 8, False), ("zb_h1", 3, 5, False), ("zb_v", 4, 8, False),
    ("zb_v", 2, 4, False), ("zb_v", 3, 7, False), ("zb_h1", 4, 8, True), ("zb_v", 4, 8, True), ("zb_v", 2, 3, True)])
def test_executor_program_replays_the_grid(kind, stages, microbatches, forward_only):
    """The executor's tables, replayed here slot by slot with buffers of their sizes: every pass reads what its
    grid predecessor wrote into the slot it names (a chunk input from the F before it, or the embedding; an
    output cotangent from the next chunk's B; a B's taps for the W), nothing is overwritten before it is read,
    and each chunk output crosses to its neighbour stage once (sent by the pattern of its slot)."""
    replay(tables(kind, stages, microbatches, forward_only), kind, stages, microbatches, forward_only)


@pytest.mark.parametrize("stages, microbatches", [(4, 8), (2, 4), (3, 7), (4, 16)])
def test_executor_program_replays_the_order_built_for_b_twice_f(stages, microbatches):
    """The same replay for ZB-V's order built for B = 2F (parallel.stage_remat=true)."""
    replay(tables("zb_v", stages, microbatches, lengths=lengths_for(True)), "zb_v", stages, microbatches, False)


def replay(tab: dict, kind: str, stages: int, microbatches: int, forward_only: bool) -> None:
    """Replays the executor's tables ``tab`` (test_executor_program_replays_the_grid)."""
    n = stages if kind == "zb_h1" else 2 * stages
    dev = [c if kind == "zb_h1" or c < stages else 2 * stages - 1 - c for c in range(n)]
    bufs = {b: [[None] * tab["sizes"][b] for _ in range(stages)] for b in ("x", "g", "w")}
    sent = 0
    for t in range(tab["slots"]):
        outs = {}
        for d in range(stages):
            op, m = tab["op"][t, d], tab["m"][t, d]
            c = next((c for c in range(n) if dev[c] == d and (c >= stages) == bool(tab["loc"][t, d])), None)
            if op == FWD:
                if tab["first"][t, d]:
                    assert c == 0
                    bufs["x"][d][tab["x"][t, d]] = ("x", m, 0)
                assert bufs["x"][d][tab["x"][t, d]] == ("x", m, c), (t, d)
                outs[d] = ("x", m, c + 1)
            elif op == BWD:
                assert bufs["x"][d][tab["x"][t, d]] == ("x", m, c), (t, d)
                assert tab["last"][t, d] == (c == n - 1)
                if c < n - 1:
                    assert bufs["g"][d][tab["g"][t, d]] == ("g", m, c), (t, d)
                bufs["w"][d][tab["w"][t, d]] = ("w", m, c)
                outs[d] = ("g", m, c - 1)
            elif op == WGT:
                assert bufs["w"][d][tab["w"][t, d]] == ("w", m, c), (t, d)
        for d, value in outs.items():  # a chunk's output to its own device's next chunk: a local write
            for b in ("x", "g"):
                if tab[f"self_{b}"][t, d] >= 0:
                    assert value[0] == b and dev[value[2]] == d
                    bufs[b][d][tab[f"self_{b}"][t, d]] = value
        for k, (p, step) in enumerate(SENDS):
            for src, dst in tab["patterns"][k][tab["pattern"][k][t]]:
                value = outs[src]
                assert value[0] == ("x" if p == "F" else "g") and dst == src + step and dev[value[2]] == dst
                bufs[value[0]][dst][tab["recv"][k][t, dst]] = value
                sent += 1
    assert sent == (1 if forward_only else 2) * microbatches * sum(dev[c] != dev[c + 1] for c in range(n - 1))
    ops = sorted((int(tab["op"][t, d]), int(tab["m"][t, d])) for t in range(tab["slots"]) for d in range(stages)
                 if tab["op"][t, d] != IDLE)
    assert ops == sorted((op, m) for op in ((FWD,) if forward_only else (FWD, BWD, WGT)) for m in range(microbatches)
                         for _ in range(n))  # every pass of every chunk once


@pytest.mark.parametrize("kind", KINDS)
def test_zero_bubble_crosses_pipe_once_per_activation_and_gradient(kind):
    """From the compiled program (llama, pipe = 4 x data = 2, M = 8): every collective-permute over pipe sits in
    a branch of a conditional chosen per slot, one microbatch's activations each, its pairs one neighbour
    step apart and a pattern of the executor's tables; none runs unconditionally. Replaying the tables' choice
    per slot, each microbatch's activations cross each stage boundary on its way once forward and its
    gradient once backward: 2M(S-1) transfers for ZB-H1, the minimum; 2M(2S-2) for ZB-V (down and back up,
    the turn on one device)."""
    from jaxpar import hlo

    s_, m_ = 4, 8
    r_ = 2 if kind == "zb_v" else 1
    cfg = config("llama", model__n_layers=4 * r_, parallel__pipe=s_, parallel__data=2, parallel__microbatches=m_,
                 train__batch_size=2 * m_, parallel__pipeline_schedule=kind, parallel__pipeline_repeats=r_)
    t = trainer(cfg)
    text = t.hlo_text()
    comps, _ = hlo.parse_computations(text)
    always, conds = hlo.conditional_branches(text)
    pipe_of = {int(dv.id): int(np.argwhere(t.mesh.devices == dv)[0][list(t.mesh.axis_names).index("pipe")])
               for dv in t.mesh.devices.flat}
    act = (2 * m_ // m_) // 2 * cfg.model.seq_len * cfg.model.d_model * 4  # one microbatch per data shard, f32

    def permutes(names):
        return [i for c in names for i in comps[c] if i.opcode.removesuffix("-start") == "collective-permute"]

    assert not permutes(always)
    tab = tables(kind, s_, m_, lengths=lengths_for(cfg.parallel.stage_remat))  # (ZB-V: its order for B = 2F)
    compiled = []
    for _, branches in conds:
        per = [permutes(b) for b in branches]
        if not any(per):
            continue
        assert not per[0] and all(len(p) == 1 for p in per[1:]), per
        pats = []
        for (ins,) in per[1:]:
            assert hlo.type_bytes(ins.type) == act, ins.type
            pairs = {(pipe_of[a], pipe_of[b]) for a, b in hlo.replica_groups(ins.text, len(pipe_of))}
            assert len({b - a for a, b in pairs}) == 1, pairs
            pats.append(frozenset(pairs))
        compiled.append(pats)
    wanted = [[frozenset(p) for p in tab["patterns"][k][1:]] for k in range(len(SENDS)) if len(tab["patterns"][k]) > 1]
    assert sorted(map(sorted, compiled), key=str) == sorted(map(sorted, wanted), key=str)
    transfers = sum(len(tab["patterns"][k][i]) for k in range(len(SENDS)) for i in tab["pattern"][k])
    assert transfers == 2 * m_ * (s_ - 1) * r_


@pytest.mark.parametrize("style, over", [("gpt2", []), ("llama", ["model.compute_dtype=bfloat16"]),
                                         ("llama", ["model.mlp=geglu", "model.remat=full"])])
def test_b_and_w_add_up_to_the_backward(style, over):
    """A stage of 3 real blocks (the stack's scan, its remat policy): B (``wgrad.vjp``: the input's cotangent
    and every weight's but the deferred kernels') plus W (``wgrad.weight_grads`` from B's taps) equal
    ``jax.vjp``'s gradients, computed here in float64 numpy terms of tolerance; B alone leaves the deferred
    kernels at zero, and every kernel of a block's attention and MLP is deferred."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from helpers import TINY
    from jaxpar.config import load_config
    from jaxpar.layers import wgrad
    from jaxpar.layers.stack import Stack
    from models.gpt import Block

    over_d = {**TINY[style], "model.n_layers": 3, **dict(o.split("=") for o in over)}
    cfg = load_config(None, over_d).model.resolved()
    layers = Stack.create(lambda r: Block(cfg, rngs=r), 3, nnx.Rngs(0))
    stack = Stack(layers, remat=cfg.remat)
    graphdef, state, _ = stack._state()
    run = stack._stage_fn(graphdef, (None,), False)

    def stage(p, x):
        return run(p, x, select=(0, 3))

    x = jax.random.normal(jax.random.key(1), (2, cfg.seq_len, cfg.d_model), jnp.float32)
    g = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    _, vjp = jax.vjp(stage, state, x)
    want_p, want_x = vjp(g)
    found = wgrad.sites(stage, state, x)
    assert {p[-1] for p in found} == {"qkv", "o", "up", "down"}, found
    out, pullback = wgrad.vjp(stage, found, 3, state, x)
    got_p, got_x, taps = pullback(g)
    index = wgrad.kernel_leaves(state, found)
    got = jax.tree.leaves(got_p)
    for path, i in index.items():
        assert not np.any(np.asarray(got[i])), path  # B leaves the deferred kernels to W
    for path, dk in wgrad.weight_grads(found, taps).items():
        got[index[path]] = got[index[path]] + dk
    tol = 2e-2 if "bfloat16" in str(over) else 1e-5
    for a, b in zip(got, jax.tree.leaves(want_p)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= tol * max(np.linalg.norm(b), 1e-12), (a.shape,)
    np.testing.assert_allclose(np.asarray(got_x, np.float64), np.asarray(want_x, np.float64), rtol=tol, atol=tol)


def test_the_run_log_line_and_bubble():
    """train.py's line and the bubble_fraction it records, in slots of one pass: ZB-H1 (S-1)/(3M+S-1), ZB-V's
    51 slots of a chunk at S = 4, M = 8 (6M + S - 1), 3 idle per stage."""
    from jaxpar.layers.zero_bubble import describe

    lines: list[str] = []
    assert abs(describe("zb_h1", 4, 8, lines.append) - 3 / 27) < 1e-12
    assert abs(describe("zb_v", 4, 8, lines.append) - 3 / 51) < 1e-12
    assert len(lines) == 2 and "ZB-H1" in lines[0] and "27 slots" in lines[0] and "4 stage inputs" in lines[0]
    assert "ZB-V" in lines[1] and "51 slots of one pass of a chunk" in lines[1], lines
    # a run whose B runs the forward again (parallel.stage_remat=true) is told what its deferred Ws hold, and so is
    # one whose remat policy recomputes the matmuls' inputs (the taps hold them); a default one is not
    for stage_remat, remat, told in ((True, "none", "parallel.stage_remat=false"),
                                     (False, "full", "model.remat=none or save_dots"),
                                     (False, "none", None), (False, "save_dots", None)):
        lines.clear()
        describe("zb_h1", 4, 8, lines.append, *passes_for(stage_remat, remat))
        if told is None:
            assert len(lines) == 1, lines
        else:
            assert len(lines) == 2 and told in lines[1] and "more memory than 1F1B" in lines[1], lines


@pytest.mark.parametrize("remat", ["none", "save_dots", "minimal", "full", "save_dots_except_mlp", "save_qkv_proj"])
def test_the_policies_whose_residuals_hold_the_matmul_inputs(remat, monkeypatch):
    """``passes_for`` (the run log, the planner's buffers) says W reads its matmuls' inputs from the kept
    residuals exactly for the policies under which the executor's own search (``inputs_from_residuals``: B's
    pullback cut to the inputs, no matmul left) finds them there."""
    import jax

    from jaxpar.layers import zero_bubble

    found = []
    real = zero_bubble.inputs_from_residuals
    monkeypatch.setattr(zero_bubble, "inputs_from_residuals", lambda *a: found.append(real(*a)) or found[-1])
    cfg = config("llama", model__n_layers=2, model__remat=remat, parallel__pipe=2, parallel__microbatches=2,
                 parallel__pipeline_schedule="zb_h1", train__batch_size=4)
    t = trainer(cfg, 2)
    jax.eval_shape(t._step, t.abstract_state, t.place_batch(batches(cfg, 1)[0]))
    assert found and (found[0] is not None) == (passes_for(False, remat)[1] == "W"), (remat, found)


def test_stretch_with_the_passes_real_lengths():
    """With equal passes the stretch is the grid's (1 / (1 - idle)); with B twice F and W (jaxpar's B runs the
    chunk's forward again), ZB-H1 at S = 2, M = 2 by hand: stage 1 runs F0 [1, 2], B0 [2, 4], F1 [4, 5], B1 [5, 7],
    W0 [7, 8], W1 [8, 9]; stage 0 F0 [0, 1], F1 [1, 2], B0 [4, 6] (after stage 1's B0), W0 [6, 7], B1 [7, 9],
    W1 [9, 10]: 10 over a stage's busy 8."""
    from jaxpar.layers.zero_bubble import stretch

    for kind, s_, m_ in (("zb_h1", 4, 8), ("zb_h1", 3, 7), ("zb_v", 4, 8), ("zb_v", 2, 6)):
        idle = idle_fraction(schedule_zero_bubble(kind, s_, m_))
        assert abs(stretch(kind, s_, m_, {"F": 1, "B": 1, "W": 1}) - 1 / (1 - idle)) < 1e-12
    assert stretch("zb_h1", 2, 2, {"F": 1, "B": 2, "W": 1}) == 10 / 8
    # a longer B stretches more, never less than the equal passes' grid
    assert stretch("zb_h1", 4, 8, {"F": 1, "B": 3, "W": 1}) > stretch("zb_h1", 4, 8, {"F": 1, "B": 1, "W": 1})


@pytest.mark.parametrize("kind", KINDS)
def test_the_communication_model_counts_what_each_device_runs(kind):
    """jaxpar.comm's GPU / TPU flavour of a zero-bubble step (only the branch a device takes runs): each device
    runs M R forwards of a chunk and M R Bs (each its backward and, with ``parallel.stage_remat=true``, its
    chunk's forward again), and one collective-permute per slot and direction with a sender, counted here from
    the grid (a pass sends when its neighbouring chunk sits on another device); XLA:CPU's static count (every
    branch in every slot) is held to the compiled program in tests/test_comm.py."""
    from jaxpar import comm

    s_, m_, layers = 4, 8, 8
    r_ = 1 if kind == "zb_h1" else 2
    sizes = {"data": 2, "tensor": 1, "pipe": s_, "expert": 1, "seq": 1}
    per_chunk = layers // (s_ * r_)
    for again in (True, False):
        cfg = config("gpt2", model__n_layers=layers, parallel__pipe=s_, parallel__microbatches=m_, parallel__data=2,
                     parallel__pipeline_schedule=kind, parallel__pipeline_repeats=r_, parallel__stage_remat=again)
        ru = comm.step_runs(cfg, sizes, "gpu")
        assert (ru.fwd, ru.bwd, ru.redo) == ((1 + again) * m_ * r_ * per_chunk, m_ * r_ * per_chunk, 0), again
    grid = schedule_zero_bubble(kind, s_, m_)
    n = s_ * r_
    dev = [c if c < s_ else 2 * s_ - 1 - c for c in range(n)]
    sends = 0
    for t in range(len(grid[0])):
        moves = set()
        for s in range(s_):
            for p, m, r in grid[s][t]:
                c = s if r == 0 else 2 * s_ - 1 - s
                to = c + 1 if p == "F" else c - 1 if p == "B" else -1
                if 0 <= to < n and dev[to] != s:
                    moves.add((p, dev[to] - s))
        sends += len(moves)
    assert ru.sends == sends
    terms = [x for x in comm.traffic(cfg, sizes, [], platform="gpu") if x.axes == ("pipe",)]
    assert [x.count for x in terms] == [sends]


def test_kept_residuals_hold_zero_bubble_memory_near_1f1b():
    """By default (the forwards' residuals kept, ``parallel.stage_remat=false``; ``model.remat=none``: what the
    paper compares, no schedule running a forward twice), the compiled step's temporaries of ZB-H1 and ZB-V are
    within 1.15x of 1F1B's at the same S and M once 1F1B's stash is full (pipe=2, M = 8 >= 2S - 1, 4 sequences
    per microbatch): between a microbatch's F and its W a zero-bubble stage holds its residuals (W reads its
    matmuls' inputs from them) and, from B, B's taps (the deferred matmuls' output cotangents); at most S
    microbatches between F and W against lock-step 1F1B's 2S - 1 between F and B; and at the issue's S = 4,
    M = 8 (8 layers: ZB-H1 0.86x, ZB-V 0.90x when measured). At M = S = 2, where 1F1B holds only the M there
    are, ZB-V still is (4.4 against 4.4 MiB) and ZB-H1 1.13x (4.9 MiB): lock-step, every stage holds the
    first stage's S residual slots and the last stage's S taps slots (its Ws deferred into the cool-down).
    B's loop over the layers reads each layer's residuals from the slot (``Residuals.apply_reading``):
    given the slot whole, XLA copied it as the loop's operand (ZB-H1 at M = S = 2: 5.2 MiB, 1.20x)."""
    temp = {}
    for s_, m in ((2, 2), (2, 8), (4, 8)):
        for sched, r in (("1f1b", 1), ("zb_h1", 1), ("zb_v", 2)):
            cfg = config("llama", model__n_layers=2 * s_, model__d_model=64, model__n_heads=8, model__n_kv_heads=8,
                         model__d_ff=128, model__vocab_size=250, model__seq_len=16, model__remat="none",
                         parallel__pipe=s_, parallel__microbatches=m, parallel__pipeline_schedule=sched,
                         parallel__pipeline_repeats=r, train__batch_size=4 * m)
            temp[sched, s_, m] = trainer(cfg, s_).compile()["memory"]["temp_size"]
    print({k: f"{v / 2**20:.2f} MiB" for k, v in temp.items()})
    for s_, m in ((2, 2), (2, 8), (4, 8)):
        assert temp["zb_h1", s_, m] <= 1.15 * temp["1f1b", s_, m], temp
        assert temp["zb_v", s_, m] <= 1.15 * temp["1f1b", s_, m], temp
    # W reads its matmuls' inputs from the kept residuals, the taps are the output cotangents alone (0.96x
    # when the taps held the inputs too), and B reads the residuals a layer at a time (0.90x when it did not)
    assert temp["zb_h1", 4, 8] <= 0.88 * temp["1f1b", 4, 8], temp


@pytest.mark.parametrize("stages, microbatches", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_zb_v_order_built_for_the_passes_lengths(stages, microbatches):
    """ZB-V's order for a B twice as long as F (it runs its chunk's forward again: ``parallel.stage_remat``, the
    default) and W as long as F: every pass once, after what it needs, one per stage and slot; at most 2S chunk
    inputs held per stage, as the paper's order; and, timed with those lengths, a stage's time stretched less
    by the bubble than ZB-H1's and than 1F1B's ((M + S - 1) / M, in forward + backward time), where the order
    built for equal passes is stretched more than ZB-H1's. With equal lengths the order is the paper's: its
    grid has 6M + S - 1 slots where S divides M."""
    s_, m_ = stages, microbatches
    lengths = lengths_for(True)
    assert lengths == (2.0, 1.0) and lengths_for(False) == (1.0, 1.0)
    grid = schedule_zero_bubble("zb_v", s_, m_, lengths)
    check_grid("zb_v", grid, s_, m_)
    assert max(in_flight(grid)) <= 2 * s_
    assert len(schedule_zero_bubble("zb_v", s_, m_)[0]) == 6 * m_ + s_ - 1
    costs = {"F": 1.0, "B": 2.0, "W": 1.0}
    built = stretch("zb_v", s_, m_, costs, lengths)
    h1 = stretch("zb_h1", s_, m_, costs)
    assert built < h1 < (m_ + s_ - 1) / m_, (built, h1)
    assert stretch("zb_v", s_, m_, costs) > h1
    print(f"S={s_} M={m_}: built for B = 2F {built:.3f}, for equal passes {stretch('zb_v', s_, m_, costs):.3f}, "
          f"ZB-H1 {h1:.3f}, 1F1B {(m_ + s_ - 1) / m_:.3f}")


def test_w_reads_the_matmul_inputs_from_the_residuals_where_no_matmul_makes_them():
    """``wgrad.inputs_from``: the taps' inputs of a pullback-like function, everything else (the cotangents'
    matmuls, here a backward loop over layers) cut out by JAX's dead-code elimination: equal to the inputs
    (numpy), whatever the cotangent passed (zeros at W); None where an input itself needs a matmul (a remat
    policy's recompute), so the taps keep it."""
    import jax
    import jax.numpy as jnp

    from jaxpar.layers import wgrad

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(3, 4, 5)).astype(np.float32)   # a kept residual: 3 layers' matmul inputs [4, 5]
    w = rng.normal(size=(3, 5, 5)).astype(np.float32)
    ct = rng.normal(size=(4, 5)).astype(np.float32)

    def taps_of(res, ct):  # B: the cotangent back through the layers (matmuls), each layer's (x, dy) tapped
        def layer(g, inp):
            x, k = inp
            return g @ k.T, (x * 1.0, g)
        _, (x, dy) = jax.lax.scan(layer, ct, (res[0], res[1]), reverse=True)
        return {"kernel": (x, dy)}

    found = {"kernel": None}
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    fn = wgrad.inputs_from(taps_of, found, (spec(xs), spec(w)), spec(ct))
    assert fn is not None
    got = fn((jnp.asarray(xs), jnp.asarray(w)), jnp.zeros_like(ct))["kernel"]
    np.testing.assert_array_equal(np.asarray(got), xs)
    # an input that a matmul makes (recomputed under a remat policy): not read from the residuals
    assert wgrad.inputs_from(lambda res, ct: {"kernel": (res[0] @ res[1], ct)}, found, (spec(xs), spec(w)),
                             spec(ct)) is None


def test_a_backward_reads_its_kept_residuals_a_layer_at_a_time():
    """``Residuals.apply_reading``: the pullback of a stage (a scan over its layers inside a ``jit``, each layer
    a ``jit`` too, and a residual used outside the loop) with its kept residuals left in a buffer of slots
    gives the cotangents of ``jax.vjp`` of the stage itself; the residuals the layers' loop scans are read a
    layer at a time (``read(i, j)``, never whole), the others whole."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxpar.layers.residuals import Residuals, slot_reader

    n_layers, d = 3, 8

    @jax.jit
    def layer(h, w):
        return jnp.tanh(h @ w) * h

    def stage(w, x):
        h = jax.jit(lambda w, x: jax.lax.scan(lambda h, wi: (layer(h, wi), None), x, w)[0])(w, x)
        return jnp.sin(h) * x  # x kept outside the loop

    w = jax.random.normal(jax.random.key(0), (n_layers, d, d)) * 0.3
    x = jax.random.normal(jax.random.key(1), (4, d))
    res = Residuals(lambda k, x: jax.vjp(lambda x: stage(k, x), x), w, x)
    out, kept = res.forward(w, x)
    slots, slot = 3, 1
    bufs = [jnp.stack([k + 7.0 * s for s in range(slots)]) - 7.0 * slot for k in kept]  # the slot holds kept
    calls = []

    def read(i, j):
        calls.append((i, j is None))
        return slot_reader(bufs, slot)(i, j)

    ct = jax.random.normal(jax.random.key(2), out.shape)
    (got,) = res.apply_reading(w, read, lambda p, ct: p(ct), ct)
    (want,) = jax.vjp(lambda x: stage(w, x), x)[1](ct)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    stacked = {i for i, k in enumerate(kept) if k.shape[:1] == (n_layers,) and k.ndim == 3}
    assert stacked and all(not whole for i, whole in calls if i in stacked), calls
    assert any(whole for i, whole in calls if i not in stacked), calls
