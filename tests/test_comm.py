"""Every byte accounted for: the compiled step's collectives against the analytic model of
jaxpar.comm, strategy by strategy and for five axes at once, in wire bytes per device.

The model's ``platform="cpu"`` form predicts XLA:CPU's program (no reduce-scatter creation, no
all-reduce folding or reassociation, no loop code motion); its ``"gpu"`` form is the theory, which
XLA's GPU/TPU collective passes reach. Each (collective kind, mesh axes) entry must match within
5%, entries under 1% of the step's bytes (norm-scale gradients, loss statistics) within 1% of it.
The five-axis layouts are checked in tests/test_plan.py's 32-device process."""

import pytest

from helpers import config, trainer
from jaxpar import comm, hlo

MIN_BYTES = 1024  # collectives of scalars and statistics: left out of both sides

LAYOUTS = {
    "dp8": ("llama", dict(parallel__data=8)),
    "zero1": ("llama", dict(parallel__data=8, parallel__zero=1)),
    "zero3-remat": ("llama", dict(parallel__data=8, parallel__zero=3, model__remat="full")),
    "tied-dp8": ("gpt2", dict(parallel__data=8)),
    "grad-accum": ("gpt2", dict(parallel__tensor=2, parallel__data=4, train__grad_accum=2)),
    "tp8": ("gpt2", dict(parallel__tensor=8)),
    "tp4-remat": ("llama", dict(parallel__tensor=4, parallel__data=2, model__remat="save_qkv_proj")),
    "megatron-sp": ("llama", dict(parallel__tensor=4, parallel__data=2, parallel__megatron_sp=True,
                                  model__remat="save_dots")),
    "seq-all_gather": ("llama", dict(parallel__seq=4, parallel__data=2, parallel__seq_attention="all_gather")),
    "seq-ring": ("llama", dict(parallel__seq=4, parallel__data=2, parallel__seq_attention="ring",
                               model__remat="full")),
    "seq-ulysses": ("llama", dict(parallel__seq=4, parallel__data=2, parallel__seq_attention="ulysses",
                                  model__remat="save_dots")),
    "zero1-seq-sp": ("llama", dict(parallel__seq=2, parallel__data=2, parallel__tensor=2, parallel__zero=1,
                                   parallel__megatron_sp=True)),
    "pipe-gpipe": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4)),
    "pipe-circular": ("llama", dict(parallel__pipe=2, parallel__data=4, parallel__pipeline_repeats=2,
                                    parallel__microbatches=2, model__n_layers=4)),
    "pipe-seq-sp": ("llama_gqa", dict(parallel__pipe=2, parallel__seq=2, parallel__tensor=2,
                                      parallel__megatron_sp=True, model__n_layers=4)),
    "pipe-1f1b": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4,
                                parallel__pipeline_schedule="1f1b", parallel__microbatches=4)),
    # ZeRO-1: the embedding / head gradients are reduced over data first, then only the shard summed over pipe
    "pipe-zero1": ("llama", dict(parallel__pipe=2, parallel__data=4, parallel__zero=1, model__n_layers=4)),
    # interleaved: one-layer chunks (XLA drops the recompute's MLP-down all-reduce)
    "pipe-1f1b-interleaved": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4,
                                            parallel__pipeline_schedule="1f1b", parallel__pipeline_repeats=2,
                                            parallel__microbatches=4)),
    "pipe-1f1b-moe-tied": ("gpt2", dict(parallel__pipe=2, parallel__data=2, parallel__expert=2, model__n_layers=4,
                                        model__arch="moe", moe__n_experts=4, parallel__pipeline_schedule="1f1b")),
    "expert": ("gpt2", dict(model__arch="moe", parallel__data=2, parallel__expert=4, moe__n_experts=4)),
    "expert-tensor": ("gpt2", dict(model__arch="moe", parallel__data=2, parallel__expert=2, parallel__tensor=2,
                                   moe__n_experts=4, moe__shared_experts=1, moe__score="sigmoid")),
    "expert-sp-shared": ("llama", dict(model__arch="moe", parallel__expert=2, parallel__tensor=4,
                                       parallel__megatron_sp=True, moe__n_experts=4, moe__shared_experts=2)),
    "expert-zero3": ("gpt2", dict(model__arch="moe", parallel__data=2, parallel__expert=4, moe__n_experts=4,
                                  parallel__zero=3)),
}


def check(t, label: str) -> dict:
    """Assert the compiled step of trainer ``t`` (compiled by ``hlo_text`` unless it was) matches the CPU
    model; returns both totals and the GPU model's."""
    got = comm.measured(hlo.collectives(t.hlo_text(), t.sizes, min_bytes=MIN_BYTES))
    leaves = comm.leaves_of(t)
    model = comm.summarize([x for x in comm.traffic(t.cfg, t.sizes, leaves, platform="cpu")
                            if x.result_bytes >= MIN_BYTES])
    gpu = comm.total(comm.summarize(comm.traffic(t.cfg, t.sizes, leaves, platform="gpu")))
    total = comm.total(got)
    print(f"{label}: measured {total:,.0f} B/device/step, model (XLA:CPU) {comm.total(model):,.0f}, "
          f"model (GPU/TPU passes) {gpu:,.0f}")
    for (kind, axes), (a, b) in comm.compare(model, got).items():
        print(f"  {kind:18s} {axes:26s} measured {a:10,.0f}  model {b:10,.0f}")
        if max(a, b) < 0.01 * total:
            assert abs(a - b) <= 0.01 * total, (label, kind, axes, a, b)
        else:
            assert b and 0.95 <= a / b <= 1.05, (label, kind, axes, a, b)
    return {"measured": total, "model": comm.total(model), "gpu": gpu}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collectives_match_the_model(name):
    style, layout = LAYOUTS[name]
    check(trainer(config(style, **layout)), name)


def test_zero1_moves_what_data_parallelism_moves():
    """With XLA's GPU/TPU passes ZeRO-1 reduce-scatters the gradients and all-gathers the updated
    parameters: the bytes of plain data parallelism's one all-reduce. XLA:CPU all-reduces instead
    (the model's documented exception): 1.5x."""
    model = {}
    for name in ("dp8", "zero1"):
        t = trainer(config("llama", **LAYOUTS[name][1]))
        leaves = comm.leaves_of(t)
        model[name] = {p: comm.total(comm.summarize(comm.traffic(t.cfg, t.sizes, leaves, platform=p)))
                       for p in ("gpu", "cpu")}
    assert abs(model["zero1"]["gpu"] / model["dp8"]["gpu"] - 1) < 0.05, model
    assert abs(model["zero1"]["cpu"] / model["dp8"]["cpu"] - 1.5) < 0.05, model
