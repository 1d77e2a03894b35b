"""jaxpar.plan: the layout planner's analytic model against the compiled program (state and collectives
per device, total memory), its rules of thumb, and its errors.

References: the compiled train step of each layout on 8 simulated CPU devices (32 for all five axes;
``memory_analysis`` and the HLO collectives), and the textbook choices (data parallel for a small
model, tensor parallel inside a node for a wide one, a pipeline across nodes for a deep one, sequence
parallel for 32k tokens, expert parallel for a MoE).
"""

import dataclasses

import pytest

from helpers import run_script, trainer
from jaxpar import comm
from jaxpar.config import load_config
from jaxpar.plan import CLUSTERS, Planner, main

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


def test_cli_prints_the_best_layout_and_an_impossible_request_is_one_line(capsys):
    assert main(["--config", "configs/gpt2_124m.yaml", "--cluster", "h100x8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "best: python train.py --config configs/gpt2_124m.yaml" in out and "parallel.data=8" in out
    assert main(["--config", "configs/gpt3_175b.yaml", "--cluster", "a100x8", "--nodes", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no layout of 8 devices fits 80 GiB per device: the smallest estimate is ")
    assert err.count("\n") == 1
