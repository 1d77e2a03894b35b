"""Every byte accounted for: the compiled step's collectives against the analytic model of
jaxpar.comm, strategy by strategy and for five axes at once, in wire bytes per device.

The model's ``platform="cpu"`` form predicts XLA:CPU's program (no reduce-scatter creation, no
all-reduce folding or reassociation, no loop code motion); its ``"gpu"`` form is the theory, which
XLA's GPU/TPU collective passes reach. Each (collective kind, mesh axes) entry must match within
5%, entries under 1% of the step's bytes (norm-scale gradients, loss statistics) within 1% of it.
The five-axis layouts are checked in tests/test_plan.py's 32-device process.

Both sides of that check go through jaxpar.hlo's byte convention, so an error in it cancels: the second half of
this file holds both jaxpar.hlo and jaxpar.comm to wire bytes written by hand (parameter counts, activation
shapes, ring formulas) and to the compiled program read by a parser of its own."""

import math
import re

import pytest

from helpers import config, trainer
from jaxpar import comm, hlo

MIN_BYTES = 1024  # collectives of scalars and statistics: left out of both sides

MLA = dict(model__head_dim=16, model__kv_lora_rank=12, model__q_lora_rank=20, model__rope_head_dim=8,
           model__v_head_dim=12)

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
    # (a schedule that runs its own backward: the forward's residuals kept by default; with
    # parallel.stage_remat=true, where set below, each backward runs its chunk's forward and its collectives again)
    "pipe-1f1b": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4,
                                parallel__pipeline_schedule="1f1b", parallel__microbatches=4,
                                parallel__stage_remat=True)),
    "pipe-1f1b-kept": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4,
                                     parallel__pipeline_schedule="1f1b", parallel__microbatches=4)),
    # ZeRO-1: the embedding / head gradients are reduced over data first, then only the shard summed over pipe
    "pipe-zero1": ("llama", dict(parallel__pipe=2, parallel__data=4, parallel__zero=1, model__n_layers=4)),
    # interleaved: one-layer chunks (XLA drops the recompute's MLP-down all-reduce)
    "pipe-1f1b-interleaved": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4,
                                            parallel__pipeline_schedule="1f1b", parallel__pipeline_repeats=2,
                                            parallel__microbatches=4, parallel__stage_remat=True)),
    # one-layer chunks under remat: the layer's recompute is the chunk's (XLA merges them), with Megatron-SP's
    # all-gathers and the K/V all-gathers of seq
    "pipe-1f1b-one-layer-remat-sp-seq": ("llama", dict(parallel__pipe=2, parallel__seq=2, parallel__tensor=2,
                                                      parallel__megatron_sp=True, parallel__seq_attention="all_gather",
                                                      parallel__pipeline_schedule="1f1b", parallel__microbatches=4,
                                                      model__remat="full", parallel__stage_remat=True)),
    # M > 2S: the embedding's weight gradients taken every C = 2S microbatches in the loop (embed_chunk), tied
    # (the table's head part reduced apart) and untied
    "pipe-1f1b-embed-chunks": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2,
                                             model__n_layers=4, parallel__pipeline_schedule="1f1b",
                                             parallel__microbatches=8, train__batch_size=16)),
    "pipe-1f1b-embed-chunks-tied": ("gpt2", dict(parallel__pipe=2, parallel__data=4, model__n_layers=2,
                                                 parallel__pipeline_schedule="1f1b", parallel__microbatches=8,
                                                 train__batch_size=32)),
    "pipe-1f1b-moe-tied": ("gpt2", dict(parallel__pipe=2, parallel__data=2, parallel__expert=2, model__n_layers=4,
                                        model__arch="moe", moe__n_experts=4, parallel__pipeline_schedule="1f1b")),
    # uneven stages (5 layers as 2 + 3; 7 as 3 + 4 under 1F1B): every stage runs the longer stage's slots
    "pipe-uneven": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=5)),
    "pipe-1f1b-uneven": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=7,
                                       parallel__stage_layers="3,4", parallel__pipeline_schedule="1f1b")),
    # DeepSeek's shape: MLA (the attention's input gradient reduced over tensor as the latents'), a dense first
    # layer on the first stage (the lead-in, per microbatch) and 3 uneven MoE groups
    "pipe-1f1b-mla-lead-in-uneven": ("llama", dict(model__arch="moe", model__n_layers=4, moe__first_dense=1,
                                                   moe__n_experts=4, moe__shared_experts=1, parallel__pipe=2,
                                                   parallel__expert=2, parallel__tensor=2,
                                                   parallel__pipeline_schedule="1f1b", **MLA)),
    # the zero-bubble grids: every branch of every slot (XLA:CPU's static count), the slots' send patterns
    "pipe-zb_h1": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4,
                                 parallel__pipeline_schedule="zb_h1", parallel__microbatches=4,
                                 parallel__stage_remat=True)),
    "pipe-zb_h1-tied-remat-chunks": ("gpt2", dict(parallel__pipe=2, parallel__data=4, model__n_layers=2,
                                                  parallel__pipeline_schedule="zb_h1", parallel__microbatches=8,
                                                  model__remat="full", train__batch_size=32)),
    "pipe-zb_h1-moe-lead-in-sp": ("llama", dict(model__arch="moe", model__n_layers=3, moe__first_dense=1,
                                                moe__n_experts=4, parallel__pipe=2, parallel__expert=2,
                                                parallel__tensor=2, parallel__megatron_sp=True,
                                                parallel__pipeline_schedule="zb_h1")),
    "pipe-zb_v": ("llama", dict(parallel__pipe=2, parallel__data=2, parallel__tensor=2, model__n_layers=4,
                                parallel__pipeline_schedule="zb_v", parallel__pipeline_repeats=2,
                                parallel__microbatches=4, parallel__stage_remat=True)),
    "pipe-zb_v-sorted-save-dots": ("llama", dict(model__arch="moe", model__n_layers=4, moe__n_experts=4,
                                                 moe__dropless=True, moe__dispatch="sorted", parallel__pipe=2,
                                                 parallel__expert=4, model__remat="save_dots",
                                                 parallel__pipeline_schedule="zb_v", parallel__pipeline_repeats=2)),
    "mla-tensor": ("llama", dict(model__arch="moe", moe__n_experts=4, parallel__data=2, parallel__expert=2,
                                 parallel__tensor=2, **MLA)),
    "pipe-gpipe-lead-in": ("llama", dict(model__arch="moe", model__n_layers=3, moe__first_dense=1, moe__n_experts=4,
                                         parallel__pipe=2, parallel__expert=2, parallel__data=2,
                                         model__remat="full")),
    "expert": ("gpt2", dict(model__arch="moe", parallel__data=2, parallel__expert=4, moe__n_experts=4)),
    # the sorted dispatch under save_dots: the experts' matmul outputs are kept, the exchange is not redone
    "expert-sorted-save-dots": ("llama", dict(model__arch="moe", parallel__data=2, parallel__expert=4,
                                              moe__n_experts=4, moe__dropless=True, model__remat="save_dots")),
    "expert-tensor": ("gpt2", dict(model__arch="moe", parallel__data=2, parallel__expert=2, parallel__tensor=2,
                                   moe__n_experts=4, moe__shared_experts=1, moe__score="sigmoid")),
    "expert-sp-shared": ("llama", dict(model__arch="moe", parallel__expert=2, parallel__tensor=4,
                                       parallel__megatron_sp=True, moe__n_experts=4, moe__shared_experts=2)),
    # MoE in every other layer (the second of two): the all-to-alls count per MoE layer, not per layer
    "expert-zero3-every2": ("gpt2", dict(model__arch="moe", parallel__data=2, parallel__expert=4, moe__n_experts=4,
                                         parallel__zero=3, moe__every=2)),
    # the sorted dispatch's exchange rounds (remat: the forward's rounds again), a dense first layer and a shared
    # expert (DeepSeek-V3's: the MoE layers are the last 2 of 3)
    "expert-sorted-first-dense": ("llama", dict(model__arch="moe", model__n_layers=3, parallel__data=2,
                                                parallel__expert=4, moe__n_experts=8, moe__dropless=True,
                                                moe__dispatch="sorted", moe__first_dense=1, model__remat="full")),
    "expert-tensor-sorted-shared": ("llama", dict(model__arch="moe", parallel__tensor=2, parallel__expert=4,
                                                  moe__n_experts=8, moe__dropless=True, moe__dispatch="sorted",
                                                  moe__shared_experts=1, moe__first_dense=2, model__n_layers=4)),
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


# ---------------------------------------------------------------------------------------------------------------
# Independent of jaxpar.hlo and jaxpar.comm: the expected wire bytes written by hand from the model's parameter
# count and the ring formulas, and the compiled program's collectives read with a parser of this file's own.
# A wrong byte convention, trip count or group size in jaxpar.hlo, or a wrong count in jaxpar.comm, can no
# longer cancel between the two sides of the check above.

F32 = 4
L, D, FF, V = 2, 64, 128, 256  # the tiny llama of tests/helpers.py (vocabulary 250 padded to 256); H hd = d
B, T = 16, 16  # sequences per step, tokens per sequence
NORMS = 2 * L * D + D  # RMSNorm scales: the only weights without a d_model x something matrix shape


def n_params(layers: int) -> int:
    """QKV 3 d^2 + out d^2 + SwiGLU 3 d ff + two norm scales per layer; embedding and head V d each; final norm."""
    return layers * (4 * D * D + 3 * D * FF + 2 * D) + 2 * V * D + D


assert n_params(2) == 115008


# Bytes one device sends, bandwidth-optimal (ring) algorithms over g devices, S the result on a device:
def all_reduce(g, s):  # a reduce-scatter then an all-gather, each (g-1)/g of S
    return 2 * (g - 1) / g * s


def all_gather(g, s):  # S the gathered array: each device passes g-1 shards of S/g along the ring
    return (g - 1) / g * s


def reduce_scatter(g, s):  # S the shard a device keeps: it sends the g-1 other shards' partial sums
    return (g - 1) * s


def all_to_all(g, s):  # keeps 1/g of its input, sends the rest
    return (g - 1) / g * s


WIRE = {"all-reduce": all_reduce, "all-gather": all_gather, "reduce-scatter": reduce_scatter,
        "all-to-all": all_to_all, "collective-permute": lambda g, s: s}
PERMUTE = ("collective-permute", None)  # a permute's cost does not depend on a group size


def _act(rows):  # one [rows, T, d] float32 activation
    return F32 * rows * T * D


HAND_COMM = {
    # data=8: one all-reduce of every gradient
    "dp8": ("llama", dict(parallel__data=8), {("all-reduce", 8): all_reduce(8, F32 * n_params(L))}),
    # ZeRO-1 over data=8 on XLA:CPU: the gradients all-reduced whole (no reduce-scatter creator there) and sliced,
    # then the updated shards of every weight with a d_model dim all-gathered
    "zero1-dp8": ("llama", dict(parallel__data=8, parallel__zero=1),
                  {("all-reduce", 8): all_reduce(8, F32 * n_params(L)),
                   ("all-gather", 8): all_gather(8, F32 * (n_params(L) - NORMS))}),
    # Megatron tensor=2 x data=4 (4 sequences per device): per layer 2 all-reduces of the [4, T, d] residual
    # forward (attention out, MLP down) and 2 backward (input gradients of QKV and MLP up), the vocabulary-
    # parallel lookup's and the loss's input gradient; the loss's max / sum / target logit, [4, T] each.
    # Gradients over data=4: the matrices' halves and the whole norm scales
    "tensor2-data4": ("llama", dict(parallel__tensor=2, parallel__data=4),
                      {("all-reduce", 2): (4 * L + 2) * all_reduce(2, _act(4)) + 3 * all_reduce(2, F32 * 4 * T),
                       ("all-reduce", 4): all_reduce(4, F32 * ((n_params(L) - NORMS) / 2 + NORMS))}),
    # Ulysses over seq=4: per layer q, k, v in and the output back forward, their transposes backward: 8
    # all-to-alls of [B, T/4, H, hd] = [B, T/4, d]; every gradient all-reduced over seq
    "ulysses-seq4": ("llama", dict(parallel__seq=4, parallel__seq_attention="ulysses"),
                     {("all-to-all", 4): 8 * L * all_to_all(4, F32 * B * T // 4 * D),
                      ("all-reduce", 4): all_reduce(4, F32 * n_params(L))}),
    # GPipe, 4 layers on pipe=2, M = 2 microbatches of 8: M + S - 1 = 3 iterations, each shifting one
    # [8, T, d] activation forward and one gradient backward; the embedding, head and final norm (on every
    # stage, each used on one) have their gradients summed over the stages
    "gpipe-pipe2": ("llama", dict(parallel__pipe=2, model__n_layers=4),
                    {PERMUTE: 2 * (2 + 2 - 1) * _act(B // 2), ("all-reduce", 2): all_reduce(2, F32 * (2 * V * D + D))}),
}

_KIND = "|".join(WIRE)
_HEAD = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")  # a computation's first line, at column 0
_COLLECTIVE = re.compile(r"=\s*(\([^()]*\)|\S+)\s+(" + _KIND + r")(-start)?\(")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\]")
_WIDTH = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8,
          "s64": 8, "u64": 8}


def _group_size(line: str, n_devices: int) -> int:
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)  # explicit groups {{0,1},{2,3}}
    if m:
        return len(m.group(1).split(","))
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", line)  # mesh['axis_0'=8,...] {'axis_0'}
    if m:
        sizes = dict((a, int(n)) for a, n in re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(sizes[a] for a in re.findall(r"'(\w+)'", m.group(2)))
    m = re.search(r"replica_groups=\[([\d,]+)\]<=", line)  # iota groups [2,4]<=[8]: groups of 4
    if m:
        return int(m.group(1).split(",")[-1])
    assert "replica_groups={}" in line, line[:300]
    return n_devices


def hand_collectives(text: str, n_devices: int) -> dict:
    """``{(kind, group size): wire bytes per device per step}`` of an optimised HLO module, each collective times
    the trip counts of the while loops around it (a scan's body is printed once)."""
    comps: dict = {}
    entry = cur = None
    for line in text.splitlines():
        h = _HEAD.match(line)
        if h:
            cur = comps.setdefault(h.group(2), [])
            entry = h.group(2) if h.group(1) else entry
        elif cur is not None and line.startswith(" "):
            cur.append(line)
    mult: dict = {}

    def visit(name, times):
        mult[name] = mult.get(name, 0) + times
        for line in comps[name]:
            if " while(" in line:
                trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
                assert trip, f"a loop without a known trip count: {line[:200]}"
                visit(re.search(r"body=%?([\w.\-]+)", line).group(1), times * int(trip.group(1)))
            for branches in re.findall(r"branch_computations=\{([^}]*)\}", line):
                for b in re.findall(r"%?([\w.\-]+)", branches):
                    visit(b, times)
            for b in re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line):
                visit(b, times)
            if re.search(r"\s(call|async-start)\(", line):
                visit(re.search(r"(?:to_apply|calls)=%?([\w.\-]+)", line).group(1), times)

    visit(entry, 1)
    out: dict = {}
    for name, times in mult.items():
        for line in comps[name]:
            m = _COLLECTIVE.search(line.split(", metadata=")[0])
            if not m:
                continue
            assert not m.group(3), "asynchronous collectives: XLA:CPU emits none (their result is the -done's)"
            kind = m.group(2)
            size = sum(_WIDTH[dt] * math.prod(int(x) for x in dims.split(",") if x)
                       for dt, dims in _SHAPE.findall(m.group(1)))
            key = PERMUTE if kind == "collective-permute" else (kind, _group_size(line, n_devices))
            g = 2 if key == PERMUTE else key[1]
            out[key] = out.get(key, 0.0) + times * WIRE[kind](g, size)
    return out


def _close(got: dict, want: dict, what: str):
    """Each entry within 1% of its expectation, plus 0.1% of the step's bytes (scalars: loss sums, counts)."""
    total = sum(want.values())
    for key in set(got) | set(want):
        a, b = got.get(key, 0.0), want.get(key, 0.0)
        assert abs(a - b) <= 0.01 * b + 1e-3 * total, (what, key, a, b)


@pytest.mark.parametrize("name", list(HAND_COMM))
def test_wire_bytes_match_a_hand_count(name):
    """The compiled step's collectives, read by this file's own HLO parser, move the bytes written by hand from
    the parameter count and the ring formulas (``HAND_COMM``); jaxpar.hlo reads the same totals from the same
    program, and jaxpar.comm's XLA:CPU model predicts them."""
    style, layout, want = HAND_COMM[name]
    t = trainer(config(style, **layout))
    text = t.hlo_text()
    got = hand_collectives(text, t.mesh.size)
    print(f"{name}: parsed {got}\n  by hand {want}")
    _close(got, want, "compiled program vs hand count")
    by_kind = {}
    for (kind, _), v in got.items():
        by_kind[kind] = by_kind.get(kind, 0.0) + v
    theirs = hlo.collectives(text, t.sizes)
    for kind in WIRE:  # jaxpar.hlo: the same program, the same bytes (to round-off)
        assert abs(theirs[kind]["wire_bytes"] - by_kind.get(kind, 0.0)) <= 1e-9 * sum(by_kind.values()), (
            kind, theirs[kind]["wire_bytes"], by_kind.get(kind))
    model: dict = {}
    for term in comm.traffic(t.cfg, t.sizes, comm.leaves_of(t), platform="cpu"):
        key = PERMUTE if term.kind == "collective-permute" else (term.kind, math.prod(t.sizes[a] for a in term.axes))
        model[key] = model.get(key, 0.0) + term.wire_bytes
    _close(model, want, "jaxpar.comm (XLA:CPU) vs hand count")


def test_zero1_theory_is_a_reduce_scatter_and_an_all_gather():
    """jaxpar.comm's GPU/TPU form of ZeRO-1 over data=8, by hand: each weight with a d_model dim reduce-scattered
    (each device sends 7 partial-sum shards of 1/8) and its updated shard all-gathered; the norm scales
    all-reduced. Together the bytes of one all-reduce of every gradient."""
    t = trainer(config("llama", parallel__data=8, parallel__zero=1))
    sharded = F32 * (n_params(L) - NORMS)
    want = {("reduce-scatter", 8): reduce_scatter(8, sharded / 8), ("all-gather", 8): all_gather(8, sharded),
            ("all-reduce", 8): all_reduce(8, F32 * NORMS)}
    assert abs(sum(want.values()) - all_reduce(8, F32 * n_params(L))) < 1e-6
    model: dict = {}
    for term in comm.traffic(t.cfg, t.sizes, comm.leaves_of(t), platform="gpu"):
        key = (term.kind, math.prod(t.sizes[a] for a in term.axes))
        model[key] = model.get(key, 0.0) + term.wire_bytes
    _close(model, want, "jaxpar.comm (GPU/TPU) vs hand count")
