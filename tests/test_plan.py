"""jaxpar.plan: the layout planner's analytic model against the compiled program (state and collectives
per device, total memory), its rules of thumb, and its errors.

References: the compiled train step of each layout on 8 simulated CPU devices (32 for all five axes;
``memory_analysis`` and the HLO collectives), and the textbook choices (data parallel for a small
model, tensor parallel inside a node for a wide one, a pipeline across nodes for a deep one, sequence
parallel for 32k tokens, expert parallel for a MoE).
"""

import dataclasses
import itertools
import math

import pytest

from helpers import run_script, trainer
from jaxpar import comm
from jaxpar.config import ConfigError, load_config
from jaxpar.plan import CLUSTERS, GIB, Planner, layouts, main

TINY = ["model.style=llama", "model.n_layers=4", "model.d_model=64", "model.n_heads=8", "model.n_kv_heads=4",
        "model.seq_len=64", "model.vocab_size=512", "train.batch_size=16", "model.remat=full"]
LAYOUTS = [  # every strategy alone and combined on 8 devices: 12 layouts, and all five axes on 32 (FIVE_AXES)
    ("gpt", dict(data=8, zero=1)), ("gpt", dict(data=8, zero=3, grad_accum=2)), ("gpt", dict(data=2, tensor=4)),
    ("gpt", dict(data=2, tensor=4, megatron_sp=True)), ("gpt", dict(data=4, pipe=2, microbatches=4)),
    ("gpt", dict(data=2, pipe=2, pipeline_repeats=2, tensor=2, microbatches=4)), ("moe", dict(data=2, expert=4)),
    ("gpt", dict(data=2, seq=4, seq_attention="ring")), ("gpt", dict(data=2, seq=4, seq_attention="ulysses")),
    ("gpt", dict(data=2, pipe=2, tensor=2, zero=1, microbatches=4, pipeline_schedule="1f1b")),
    ("moe", dict(expert=2, seq=2, tensor=2, zero=1)), ("moe", dict(data=1, pipe=2, expert=2, tensor=2, microbatches=2)),
]
FIVE = dict(data=2, pipe=2, expert=2, seq=2, tensor=2, microbatches=2)
FIVE_AXES = [("gpt", dict(FIVE, seq_attention="ring")),
             ("moe", dict(FIVE, seq_attention="ulysses", pipeline_schedule="1f1b"))]


def layout(arch, par, extra=()):
    """A layout's base config (``TINY`` + ``extra``; ``grad_accum`` in ``par`` is ``train.grad_accum``) and
    its planner overrides."""
    par = dict(par)
    accum = [f"train.grad_accum={par.pop('grad_accum')}"] if "grad_accum" in par else []
    moe = ["model.arch=moe", "moe.n_experts=4"] if arch == "moe" else []
    cfg = load_config(None, TINY + list(extra) + accum + moe)
    return cfg, {f"parallel.{k}": v for k, v in par.items()}


def check_layout(arch, par, nodes=1):
    """The planner's state (exact), collective bytes (2%) and total memory (10%) for ``par`` against the
    compiled train step on the simulated devices."""
    cfg, ov = layout(arch, par)
    planner = Planner(cfg, CLUSTERS["cpu"], nodes, platform="cpu")
    est = planner.estimate(ov)
    t = trainer(planner.config(ov))
    rep = t.compile()
    state = t.per_device_bytes("params") + t.per_device_bytes("opt")
    assert abs((est.memory["params"] + est.memory["opt"]) / state - 1) < 1e-3
    got = comm.measured(rep["collectives"])
    assert abs(sum(est.comm.values()) / comm.total(got) - 1) < 0.02
    mem = rep["memory"]
    total = mem["argument_size"] + mem["output_size"] + mem["temp_size"] - mem["alias_size"]
    assert 0.9 < est.memory["total"] / total < 1.1, (par, est.memory, total)
    return t, est.memory["total"] / total


@pytest.mark.parametrize("arch,par", LAYOUTS, ids=["-".join(f"{k}{v}" for k, v in p.items()) + f"-{a}"
                                                   for a, p in LAYOUTS])
def test_model_matches_the_compiled_step(arch, par):
    check_layout(arch, par)


def test_model_matches_the_compiled_step_on_five_axes():
    # 32 devices: a subprocess (the dense model with ring attention and GPipe, the MoE with Ulysses and
    # 1F1B); their collectives also match jaxpar.comm per kind and mesh axes (tests/test_comm.py)
    script = ("from test_plan import FIVE_AXES, check_layout\n"
              "from test_comm import check\n"
              "for arch, par in FIVE_AXES:\n"
              "    t, ratio = check_layout(arch, par, nodes=4)\n"
              "    print(arch, 'predicted / compiled memory', round(ratio, 3))\n"
              "    check(t, f'five axes, {arch}')\n"
              "print('five axes ok')\n")
    print(run_script(script, devices=32, done="five axes ok"))


def best(path, overrides, cluster, nodes):
    cfg = load_config(path, overrides)
    planner = Planner(dataclasses.replace(cfg, parallel=type(cfg.parallel)()), CLUSTERS[cluster], nodes)
    ok, _ = planner.plan()
    return planner, {k.split(".")[1]: v for k, v in ok[0].overrides.items()}


def test_rules_of_thumb_fall_out_of_the_model():
    # a small model on one node: pure data parallelism
    _, b = best("configs/gpt2_124m.yaml", [], "h100x8", 1)
    assert b["data"] == 8, b
    # a wide model (8192 wide, 28672 MLP) on 4 nodes: tensor parallel inside a node
    p, b = best("configs/llama_1b.yaml", ["model.d_model=8192", "model.n_heads=64", "model.d_ff=28672",
                                          "model.n_layers=8", "train.batch_size=256", "train.grad_accum=8"],
                "h100x8", 4)
    assert 1 < b["tensor"] <= 8 and p._bandwidth("tensor", b) == CLUSTERS["h100x8"].intra_gbs, b
    # a deep one (96 layers) on 8 nodes: pipeline stages across the nodes
    p, b = best("configs/llama_1b.yaml", ["model.n_layers=96", "model.d_model=4096", "model.d_ff=16384",
                                          "train.batch_size=512", "train.grad_accum=8"], "h100x8", 8)
    assert b["pipe"] > 1 and p._bandwidth("pipe", b) == CLUSTERS["h100x8"].inter_gbs, b
    # 32k-token sequences, 4 of them per step on 8 GPUs: the sequence split
    _, b = best("configs/llama_1b.yaml", ["model.seq_len=32768", "train.batch_size=4", "train.grad_accum=1"],
                "h100x8", 1)
    assert b["seq"] > 1, b
    # a Mixture of Experts on 4 nodes: expert parallelism (on 32 nodes, with 1F1B holding O(S) microbatches,
    # a 32-stage pipeline x seq=8 without any gradient reduction comes out 2% faster than data x expert)
    _, b = best("configs/mixtral_8x7b.yaml", [], "h100x8", 4)
    assert b["expert"] > 1, b


def test_table_fits_120_columns_with_a_legend_and_the_log_s_bubble():
    """The ranked table of a 96-layer model on 8 nodes (pipelines among the top layouts): every line at most 120
    columns, each layout written whole, its communication listed axis by axis (none cut off), the bubble as the
    training log prints it ((S-1)/(M+S-1), jaxpar.layers.pipeline.bubble_fraction, in %), and a legend naming
    every column."""
    from jaxpar.layers.pipeline import bubble_fraction
    from jaxpar.plan import LEGEND, describe, table

    cfg = load_config("configs/llama_1b.yaml", ["model.n_layers=96", "model.d_model=4096", "model.d_ff=16384",
                                                  "train.batch_size=512", "train.grad_accum=8"])
    ok, _ = Planner(dataclasses.replace(cfg, parallel=type(cfg.parallel)()), CLUSTERS["h100x8"], 8).plan()
    ests = ok[:10]
    text = table(ests)
    assert all(len(line) <= 120 for line in text.splitlines()), max(text.splitlines(), key=len)
    piped = [e for e in ests if e.overrides["parallel.pipe"] > 1]
    assert piped, [describe(e.overrides) for e in ests]
    for e in ests:
        row = next(line for line in text.splitlines() if line.endswith(describe(e.overrides)))
        s_, m_ = e.overrides["parallel.pipe"], e.overrides.get("parallel.microbatches") or e.overrides["parallel.pipe"]
        want = 100 * bubble_fraction(s_, m_) if s_ > 1 else 0.0
        assert f"{want:5.1f}%" in row, (row, want)
    flat = " ".join(text.split())
    for e in ests:
        for axes, b in e.comm.items():
            if b > 0:
                assert f"{axes} {b / 2**30:.3g}" in flat, (axes, b)
    for column in ("mem GiB", "state", "act", "bubble", "step s", "MFU", "comm"):
        assert f"{column}:" in LEGEND


def test_cli_prints_the_best_layout_and_an_impossible_request_is_one_line(capsys):
    assert main(["--config", "configs/gpt2_124m.yaml", "--cluster", "h100x8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best: python train.py --config configs/gpt2_124m.yaml" in out and "parallel.data=8" in out
    assert main(["--config", "configs/gpt3_175b.yaml", "--cluster", "a100x8", "--nodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no layout of 8 devices fits 80 GiB per device: the smallest estimate is ")
    assert err.count("\n") == 1


# ``TINY`` by hand: L = 4 layers, d = 64, H = 8 heads and KV = 4 of hd = 8, SwiGLU d_ff = 192 (llama's default:
# 8d/3 rounded up to a multiple of 64), vocabulary 512, 16 sequences of 64 tokens, float32 weights.
L_, D_, H_, KV_, HD_, FF_, V_, B_, T_ = 4, 64, 8, 4, 8, 192, 512, 16, 64
LAYER = D_ * (H_ + 2 * KV_) * HD_ + H_ * HD_ * D_ + 3 * D_ * FF_  # QKV, out-projection, gate / up / down
NORMS = 2 * L_ * D_ + D_  # two norm scales per layer and the final one: never split but by stages
TABLES = 2 * V_ * D_  # embedding and head
N_ = L_ * LAYER + TABLES + NORMS


def _ring_all_reduce(g, s):
    return 2 * (g - 1) / g * s


# Per layout (planned for XLA:CPU, i.e. float32 activations): parameter and Adam-moment bytes per device, and the
# wire bytes per device per step by mesh axes, written from the device counts.
HAND_PLAN = {
    "data8": (dict(data=8), 4 * N_, 8 * N_, {"data": _ring_all_reduce(8, 4 * N_)}),
    # ZeRO-1: the moments of every weight with a d_model dim / 8; XLA:CPU all-reduces the gradients whole, then
    # all-gathers the updated shards ((g-1)/g of the gathered bytes)
    "data8-zero1": (dict(data=8, zero=1), 4 * N_, 8 * ((N_ - NORMS) / 8 + NORMS),
                    {"data": _ring_all_reduce(8, 4 * N_) + 7 / 8 * 4 * (N_ - NORMS)}),
    # tensor=4 splits every matrix (heads, KV heads, d_ff, vocabulary) / 4; with remat=full a layer's Megatron
    # all-reduces of the [8, 64, d] residual are 2 forward, 2 backward and the attention-out's again in the
    # recompute; + the lookup's and the loss's input gradient; + the loss's 3 statistics of [8, 64]
    "data2-tensor4": (dict(data=2, tensor=4), 4 * ((N_ - NORMS) / 4 + NORMS), 8 * ((N_ - NORMS) / 4 + NORMS),
                      {"data": _ring_all_reduce(2, 4 * ((N_ - NORMS) / 4 + NORMS)),
                       "tensor": (5 * L_ + 2) * _ring_all_reduce(4, 4 * 8 * T_ * D_)
                       + 3 * _ring_all_reduce(4, 4 * 8 * T_)}),
    # pipe=2: each stage holds half the layers; M = 4 microbatches of 1 sequence per data shard: M + S - 1 = 5
    # iterations of a forward and a backward shift of [1, 64, d]; the embedding / head / final norm gradients
    # summed over the stages; XLA:CPU reduces a stage's gradients over data in each of the 5 iterations
    "data4-pipe2": (dict(data=4, pipe=2, microbatches=4), 4 * ((L_ * LAYER + 2 * L_ * D_) / 2 + TABLES + D_),
                    8 * ((L_ * LAYER + 2 * L_ * D_) / 2 + TABLES + D_),
                    {"pipe": 2 * 5 * 4 * T_ * D_ + _ring_all_reduce(2, 4 * (TABLES + D_)),
                     "data": _ring_all_reduce(4, 4 * (5 * (L_ * LAYER + 2 * L_ * D_) / 2 + TABLES + D_))}),
}


@pytest.mark.parametrize("name", list(HAND_PLAN))
def test_planner_state_and_traffic_match_a_hand_count(name):
    """The planner's per-device parameters, Adam moments and gradients (XLA:CPU: whole, in the parameters'
    layout) and its wire bytes by mesh axes equal the counts written by hand from the model's dims and the
    ring formulas (``HAND_PLAN``), not from the partitioning rules or jaxpar.comm it uses; the compiled program
    holds the planner to the same numbers in ``test_model_matches_the_compiled_step``."""
    par, params, opt, traffic = HAND_PLAN[name]
    assert N_ == 262720
    cfg, ov = layout("gpt", par)
    est = Planner(cfg, CLUSTERS["cpu"], 1, platform="cpu").estimate(ov)
    print(name, est.memory, est.comm)
    assert est.memory["params"] == pytest.approx(params, rel=1e-12)
    assert est.memory["opt"] == pytest.approx(opt, rel=1e-12)
    assert est.memory["grads"] == pytest.approx(params, rel=1e-12)
    # the pipeline's bubble stretches the compute: 4 microbatches on 2 stages take 4 + 2 - 1 = 5 slots of 4
    assert est.bubble == (5 / 4 if name == "data4-pipe2" else 1.0)
    assert est.comm.keys() == traffic.keys()
    for axes, b in traffic.items():
        assert est.comm[axes] == pytest.approx(b, rel=1e-9), axes


def _hand_layouts(n: int, moe: bool) -> list[dict]:
    """Every layout of ``n`` devices the planner's docstring promises, enumerated here: sizes of data, pipe,
    expert, seq, tensor with product n (expert only for a MoE); ZeRO 0, 1, 3 (1 and 3 only with an axis that
    splits the batch); remat none and full; with a pipeline, M = S, 2S, 4S and the GPipe or 1F1B schedule."""
    out = []
    for sizes in itertools.product(range(1, n + 1), repeat=5):
        data, pipe, expert, seq, tensor = sizes
        if math.prod(sizes) != n or (expert > 1 and not moe):
            continue
        for zero, remat in itertools.product((0, 1, 3), ("none", "full")):
            if zero and data * expert * seq == 1:
                continue
            for mb, sched in (itertools.product((pipe, 2 * pipe, 4 * pipe), ("gpipe", "1f1b")) if pipe > 1
                              else [(0, None)]):
                ov = {"parallel.data": data, "parallel.pipe": pipe, "parallel.expert": expert, "parallel.seq": seq,
                      "parallel.tensor": tensor, "parallel.zero": zero, "parallel.microbatches": mb,
                      "model.remat": remat}
                out.append(ov if sched is None else {**ov, "parallel.pipeline_schedule": sched})
    return out


def _key(ov: dict) -> tuple:
    return tuple(sorted(ov.items()))


def test_plan_picks_the_fastest_fitting_layout_of_a_hand_enumeration():
    """A brute force over a hand enumeration of the 8-device layouts: the planner enumerates the same set (dense
    and MoE), and with a device memory just below what the fastest layout needs, it rejects that one and returns
    the fastest of the layouts whose estimate fits, every other one rejected for a check or for its memory."""
    for moe in (False, True):
        hand = _hand_layouts(8, moe)
        assert len(hand) == len({_key(o) for o in hand})
        assert sorted(map(_key, hand)) == sorted(map(_key, layouts(8, moe=moe))), moe
    cfg = load_config(None, [o for o in TINY if not o.startswith("model.remat")])
    base = dataclasses.replace(cfg, parallel=type(cfg.parallel)())
    estimates, invalid, planner = {}, 0, Planner(base, CLUSTERS["h100x8"], 1)
    for ov in _hand_layouts(8, False):
        try:
            estimates[_key(ov)] = planner.estimate(ov)
        except ConfigError:
            invalid += 1
    fastest = min(estimates.values(), key=lambda e: e.step_seconds)
    limit = fastest.memory["total"] * (1 - 1e-9)  # the fastest no longer fits
    fits = [e for e in estimates.values() if e.memory["total"] <= limit]
    assert fits and len(fits) < len(estimates)
    best = min(fits, key=lambda e: (e.step_seconds, e.memory["total"]))
    cluster = dataclasses.replace(CLUSTERS["h100x8"], hbm_gib=limit / GIB)
    ok, rejected = Planner(base, cluster, 1).plan()
    print("hand:", best.overrides, best.step_seconds, "planner:", ok[0].overrides, ok[0].step_seconds)
    tied = {_key(e.overrides) for e in fits if (e.step_seconds, e.memory["total"]) == (best.step_seconds,
                                                                                    best.memory["total"])}
    assert _key(ok[0].overrides) in tied
    assert [e.step_seconds for e in ok] == sorted(e.step_seconds for e in fits)
    assert len(rejected) == invalid + len(estimates) - len(fits)
