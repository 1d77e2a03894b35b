"""The step-time model of :mod:`jaxpar.plan`: one train step's seconds on a device, term by term.

A step's time is the sum of the terms below, each the part of a device's critical path it names. The
runs come from :func:`jaxpar.comm.step_runs` (how often the schedule runs each layer, the head and the
lookup, bubble iterations included), the bytes from :func:`jaxpar.comm.traffic` (the model that tests
hold to the compiled HLO); the hardware from a :class:`Hardware` (a ``--cluster`` preset, or fitted to a
run by ``--calibrate``).

=============  ==========================================================================================
``compute``    the model flops (:mod:`jaxpar.flops`, the numerator of MFU) at ``efficiency`` x peak
``recompute``  the forwards the backward runs again: the remat policy's share of each layer
               (``full``: all of it), 1F1B's recompute of each stage for its backward, and ring
               attention's blocks, each computed again in its backward (whatever the policy: the blocks'
               custom derivative keeps only their inputs)
``bubble``     what a pipeline's lock-step iterations compute beyond the model: the warm-up and
               cool-down iterations (on zeros; in the zero-bubble grids, which run no pass on zeros, the
               stages' waits for each other with the passes' real lengths: F a chunk's forward, B its
               forward again, the remat share and the backward but the matmuls' weight gradients, W
               those; :func:`jaxpar.layers.zero_bubble.stretch`), the padding slots of uneven stages, and the head and
               loss, which the last stage runs on the whole batch while the others wait (their matmuls
               run on that stage only, :mod:`jaxpar.layers.onstage`, but the step waits for them: the
               last stage's head is on every stage's critical path, against one S-th of it in the ideal)
``overhead``   flops the program runs that the model does not count: the masked half of causal
               attention where the kernel computes the whole square (``xla``; flash kernels skip it;
               under ``seq``, ring's XLA blocks and the K/V all-gather's shifted mask, on the device
               that computes the most) and the padded vocabulary's columns
``memory``     elementwise work, bound by the HBM bandwidth: the activations each layer writes and reads
               (the bytes the planner's memory model keeps per token without remat, twice in a forward,
               four times in a backward), and AdamW's update (28 bytes per parameter of the optimizer's
               shard: the float32 parameter, gradient and two moments read, three written)
``moe tiles``  the sorted MoE dispatch's grouped matmul where it is a loop over row tiles (GPU: XLA:GPU
               has no grouped GEMM, :func:`jaxpar.layers.moe_dispatch.grouped_matmul_impl`): each tile's
               matmuls are kernels of their own, ``tile_us`` per tile forward and backward (a third
               forward), over every tile of the padded buffer (:func:`jaxpar.layers.moe_dispatch.tile_rows`)
               in each MoE layer run, the forward again under remat
``offload``    ``model.remat=offload``: the saved matmul outputs to the host and back at ``host_gbs``,
               overlapped with the layer's compute (what exceeds it)
``comm <axes>``  each collective's wire bytes (:attr:`jaxpar.comm.Term.wire_bytes`) at the bandwidth of its
               group (inter-node when the group spans nodes), plus ``latency_us`` per collective, minus
               what overlaps:

               * gradient reductions (data / ZeRO): outside a pipeline, overlapped with the last
                 microstep's backward (XLA's pipelined all-reduce / reduce-scatter,
                 :mod:`jaxpar.xla_options`) except one layer's bucket; after a pipeline's loops, exposed
               * ZeRO-3 weight gathers: prefetched a layer ahead, exposed beyond the layers' compute (the
                 first layer's gather always)
               * pipeline shifts: GPipe's and the zero-bubble grids' are exposed (the next iteration or slot
                 reads them); in 1F1B a forward's shift overlaps the iteration's backward and a backward's
                 the forward
               * ring attention's K/V hops: overlapped with the block's attention (the ring sends the
                 next block before it computes this one), exposed beyond it
               * everything else (tensor and Megatron-SP collectives, Ulysses and K/V all-gathers, the
                 experts' all-to-alls, the embedding and loss, ZeRO-1's parameter all-gather after the
                 update): exposed
=============  ==========================================================================================

The overlaps are what the compiler's passes jaxpar enables on GPU aim for; they are not measured on a
GPU here. ``python -m jaxpar.plan --calibrate RUN_DIR`` fits the efficiency and bandwidths to a real run
of the user's cluster (:func:`fit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from jaxpar.mesh import AXES


@dataclass(frozen=True)
class Hardware:
    """A cluster: devices per node (the fast interconnect's domain), memory (GiB), dense bf16 peak
    (TFLOP/s), HBM bandwidth, bandwidth per device one way inside a node and across nodes, host link
    (GB/s), latency of one collective inside a node and across nodes (µs), and the fraction of peak the
    matmuls reach (``efficiency``)."""

    name: str
    per_node: int
    hbm_gib: float
    peak_tflops: float
    intra_gbs: float
    inter_gbs: float
    hbm_gbs: float = 2000.0
    host_gbs: float = 25.0
    intra_us: float = 10.0
    inter_us: float = 25.0
    efficiency: float = 0.68  # fitted to Megatron-LM's Table 1 on A100 (docs: the planner)
    tile_us: float = 0.0  # the tiled MoE grouped matmul's cost per tile, forward and backward (0: ragged_dot)
    cudnn_head_dim: int = 128  # the largest head dim of cuDNN's flash attention (Hopper and later: 256)

    def with_(self, **kw) -> "Hardware":
        return replace(self, **kw)


# the terms a collective's `what` (jaxpar.comm.traffic) falls in, for its overlap
OVERLAP = {
    "gradient all-reduce": "grads", "gradient reduce-scatter": "grads",
    "Megatron-SP replicated-weight gradient": "grads", "embedding / head gradients summed over stages": "grads",
    "ZeRO-3 weight all-gather": "zero3", "stage shift (forward, backward)": "shift", "1F1B stage shifts": "f1b",
    "zero-bubble stage shifts": "shift",
    "ring K/V hops": "ring",
}
EXPOSED = ("ZeRO-1 parameter all-gather", "Megatron block all-reduces", "MLA latents' gradient all-reduces",
           "shared experts' all-reduces", "vocab-parallel lookup", "loss input gradient",
           "loss max / sum / target over the vocabulary", "Megatron-SP column-layer input all-gathers",
           "Megatron-SP row-layer reduce-scatters", "Megatron-SP shared experts' reduce-scatters",
           "Megatron-SP lookup reduce-scatter", "Megatron-SP lookup backward", "Megatron-SP head input all-gather",
           "Megatron-SP head input gradient", "MoE sorted-dispatch exchange rounds", "MoE dispatch / combine",
           "K/V all-gather", "K/V gradient reduce-scatter", "Ulysses q in, output back", "Ulysses k, v in")


def overlap_class(what: str) -> str:
    """The overlap rule of a collective (:data:`OVERLAP`, else exposed); an unknown one is an error, so that a
    new collective in :mod:`jaxpar.comm` is classified on purpose."""
    if what in OVERLAP:
        return OVERLAP[what]
    if what in EXPOSED:
        return "exposed"
    raise KeyError(f"jaxpar.steptime: no overlap rule for the collective {what!r} (add it to OVERLAP or EXPOSED)")


@dataclass
class Flops:
    """Flops one device runs per step, by kind (see the module docstring)."""

    model: float
    recompute: float
    bubble: float
    overhead: float
    forward: float  # the layers' forwards a device runs per step, as executed (the overlap windows)
    attention_fwd: float  # of which attention's QK^T and PV
    backward: float  # the last microstep's backward (the gradient reductions' window)


def flops(cfg, sizes: dict, ru, recompute_share: float, kernel: str, n_devices: int) -> Flops:
    """The executed flops of one step on one device, from the runs ``ru`` (:func:`jaxpar.comm.step_runs`)."""
    from jaxpar import flops as fl

    m = cfg.model.resolved()
    t, s_ = sizes["tensor"], sizes["pipe"]
    moe = m.arch == "moe"
    dv = m.v_head_dim or m.head_dim
    # per token, one layer's forward on this device: its matmuls (split over tensor) and attention over the
    # whole context (causal: T/2 keys on average; the xla kernel computes the whole square)
    attn_model = m.seq_len * m.n_heads / t * (m.head_dim + dv)
    attn = attn_model * (2 if kernel == "xla" else 1)
    n_seq = sizes.get("seq", 1)
    ring = n_seq > 1 and cfg.parallel.seq_attention == "ring"
    if ring:  # XLA blocks whatever the kernel: zig-zag computes the causal half and its diagonal blocks whole
        # ((1 + 1/N) x the causal half on every device); without it each lock-step hop waits for a whole block
        attn = attn_model * ((1 + 1 / n_seq) if cfg.parallel.seq_zigzag else 2)
    elif n_seq > 1 and cfg.parallel.seq_attention == "all_gather":  # local queries over every key, the causal
        # mask shifted by the device's offset: cuDNN takes it as a mask tensor and computes the whole [T/N, T]
        # rows; Pallas' static masks skip the hidden blocks, and the last device (N - 1/2 of N/2 blocks' worth)
        # sets the pace of the lock-step layers
        attn = attn_model * ((2 - 1 / n_seq) if kernel == "pallas" else 2)
    dense = 2 * fl.layer_matmul_params(cfg, False) / t + attn
    sparse = 2 * fl.layer_matmul_params(cfg, True) / t + attn if moe else dense
    tokens = ru.layer_rows * ru.tl  # per layer run
    n_moe_runs = (ru.moe_fwd, ru.moe_bwd, ru.moe_redo)
    # 1F1B and B of the zero-bubble grids run each stage's forward again for its backward (parallel.stage_remat)
    again = (ru.f1b or ru.zb) and ru.again
    f1b_redo = ru.bwd if again else 0.0
    fwd_runs = ru.fwd - f1b_redo

    def layer(runs, moe_runs):
        return tokens * ((runs - moe_runs) * dense + moe_runs * sparse)

    fwd = layer(fwd_runs, n_moe_runs[0] - (n_moe_runs[1] if again else 0))
    bwd = 2 * layer(ru.bwd, n_moe_runs[1])
    redo = (layer(f1b_redo, n_moe_runs[1] if again else 0) + recompute_share * layer(ru.redo, n_moe_runs[2]))
    ring_redo = tokens * attn * ru.bwd if ring else 0.0  # each backward computes its blocks' forward again
    redo += ring_redo
    vocab = -(-m.vocab_size // (m.vocab_multiple * t)) * m.vocab_multiple  # a device's padded vocabulary slice
    head_tokens = ru.k * ru.rows * ru.tl  # the last stage's, once per microbatch (under 1F1B too: not in the bubble)
    head = 6 * m.d_model * vocab * head_tokens
    model = fl.model_flops_per_step(cfg) / n_devices
    # the same work without a pipeline's extras: the device's share of the layers, and of the head (one stage's)
    stage_tokens = ru.k * ru.rows * ru.tl
    share = s_ if s_ > 1 else 1
    n_moe = (cfg.moe.groups(m.n_layers) if moe else 0) / share
    ideal = (3 * stage_tokens * ((m.n_layers / share - n_moe) * dense + n_moe * sparse)
             + 6 * m.d_model * vocab * stage_tokens / share)
    executed = fwd + bwd + redo + head
    recompute = redo
    bubble = max(0.0, executed - recompute - ideal)
    if ru.zb:  # the grid runs no pass on zeros: its stages wait for each other (zero_bubble.stretch) with the
        # passes' real lengths, in a chunk's forwards: F 1, W its matmuls' weight gradients (w, a forward's
        # matmuls), B the chunk's forward again, the remat policy's share and the rest of the backward (2 - w)
        from jaxpar.layers import zero_bubble as zb

        w = 1 - attn / dense
        costs = {"F": 1.0, "B": float(again) + recompute_share + (2 - w) + (attn / dense if ring else 0.0), "W": w}
        lengths = zb.lengths_for(cfg.parallel.stage_remat)  # the lengths the order is built for
        bubble += (zb.stretch(cfg.parallel.pipeline_schedule, s_, ru.microbatches, costs, lengths) - 1) * (
            fwd + bwd + redo)
    return Flops(model=model, recompute=recompute, bubble=bubble, overhead=max(0.0, ideal - model),
                 forward=fwd, attention_fwd=tokens * attn * fwd_runs, backward=(bwd + redo) / ru.k)


def tile_loop(cfg, sizes: dict, ru) -> int:
    """Tiles of one MoE layer run's grouped-matmul loop on a device (the sorted dispatch on an accelerator):
    the device's ``top_k x tokens`` assignments, with ``expert > 1`` the ``expert x ceil(capacity_factor x
    A / expert)`` rows of one exchange round, over its local experts, each expert's rows padded to
    :func:`~jaxpar.layers.moe_dispatch.tile_rows`; 0 without MoE layers or the sorted dispatch."""
    from jaxpar.layers.moe_dispatch import round_rows, tile_count, tile_rows

    e = cfg.moe
    if cfg.model.arch != "moe" or e.dispatch_path() != "sorted":
        return 0
    ep = sizes["expert"]
    rows = ru.layer_rows * ru.tl * e.top_k
    if ep > 1:
        rows = ep * round_rows(rows, ep, e.capacity_factor)
    local = e.n_experts // ep
    return tile_count(rows, local, tile_rows(rows, local, "gpu"))


def moe_tiles(cfg, sizes: dict, ru, hw: Hardware, recompute_share: float) -> float:
    """Seconds of the ``moe tiles`` term (the module docstring): a tile costs ``hw.tile_us`` forward and
    backward, a third of it forward; 0 where the grouped matmul is not a tile loop (``hw.tile_us`` = 0, or
    ``moe.grouped_matmul=ragged_dot``)."""
    if not hw.tile_us or cfg.moe.grouped_matmul == "ragged_dot":
        return 0.0
    calls = (ru.moe_fwd + recompute_share * ru.moe_redo) / 3 + 2 * ru.moe_bwd / 3
    return tile_loop(cfg, sizes, ru) * calls * hw.tile_us * 1e-6


def bandwidth(hw: Hardware, label: str, sizes: dict, nodes: int) -> tuple[float, float]:
    """(GB/s, µs latency) of a collective over the axes ``label`` (``data+expert``): the inter-node link
    when its group spans nodes (the mesh fills ``tensor``, the innermost axis, first)."""
    axes = label.split("+")
    outer = min(AXES.index(a) for a in axes)
    span = math.prod(sizes[a] for a in AXES[outer:])  # consecutive devices the group reaches
    if span > hw.per_node and nodes > 1:
        return hw.inter_gbs, hw.inter_us
    return hw.intra_gbs, hw.intra_us


def step_time(cfg, sizes: dict, terms: list, ru, hw: Hardware, nodes: int, *, recompute_share: float,
              kernel: str, kept_bytes: float, saved_bytes: float, opt_params: float, n_devices: int,
              stored_bytes: float = 0.0) -> dict:
    """``{term: seconds}`` of one step (the module docstring), its sum under ``"step"``. ``kept_bytes``: what a
    layer writes per token without remat (the memory model's), ``saved_bytes``: what ``offload`` moves to the
    host per token and layer, ``stored_bytes``: what the remat policy keeps per token and layer (with
    ``parallel.stage_remat=false`` copied into a pipeline stash's slot and out of it again),
    ``opt_params``: parameters in this device's optimizer shard."""
    f = flops(cfg, sizes, ru, recompute_share, kernel, n_devices)
    rate = hw.peak_tflops * 1e12 * hw.efficiency
    out = {"compute": f.model / rate, "recompute": f.recompute / rate, "bubble": f.bubble / rate,
           "overhead": f.overhead / rate}
    tokens = ru.layer_rows * ru.tl
    passes = ru.fwd + 2 * ru.bwd + recompute_share * ru.redo  # a layer's bytes once per forward, twice per backward
    stash = 2 * ru.bwd * stored_bytes if (ru.f1b or ru.zb) and not ru.again else 0.0  # kept residuals: in, out
    out["memory"] = (tokens * (passes * kept_bytes + stash) + 28 * opt_params) / (hw.hbm_gbs * 1e9)
    out["moe tiles"] = moe_tiles(cfg, sizes, ru, hw, recompute_share)
    if cfg.model.resolved().remat == "offload":
        moved = 2 * tokens * ru.bwd * saved_bytes / (hw.host_gbs * 1e9)
        out["offload"] = max(0.0, moved - f.forward / rate)
    # the windows the overlapped collectives hide behind
    fwd_s, bwd_s = f.forward / rate, f.backward * ru.k / rate
    by: dict[tuple[str, str], float] = {}
    links: dict[str, tuple[float, float]] = {}
    for term in terms:
        if term.label not in links:
            links[term.label] = bandwidth(hw, term.label, sizes, nodes)
        gbs, us = links[term.label]
        key = (overlap_class(term.what), term.label)
        by[key] = by.get(key, 0.0) + term.wire_bytes / (gbs * 1e9) + term.count * us * 1e-6
    layer_runs = max(1.0, ru.fwd + ru.bwd)
    for (cls, label), sec in sorted(by.items()):
        if cls == "grads":  # overlapped with the last microstep's backward, but its last layer's bucket
            exposed = sec if ru.pipelined else max(sec / cfg.model.n_layers, sec - f.backward / rate)
        elif cls == "zero3":  # prefetched one layer ahead: the first gather, and what exceeds the layers' compute
            exposed = max(sec * ru.k / layer_runs, sec - (fwd_s + bwd_s))
        elif cls == "f1b":  # the forward shift behind the iteration's backward, and the reverse
            exposed = max(0.0, sec / 2 - bwd_s) + max(0.0, sec / 2 - fwd_s)
        elif cls == "ring":  # behind the blocks' attention: forward, backward (twice the forward's flops) and
            # the blocks' forward again in the backward
            exposed = max(0.0, sec - 4 * f.attention_fwd / rate)
        else:
            exposed = sec
        out[f"comm {label}"] = out.get(f"comm {label}", 0.0) + exposed
    out["step"] = sum(out.values())
    return out


def fit(samples: list[tuple[dict, float]], hw: Hardware) -> Hardware:
    """``hw`` with its efficiency, HBM and link bandwidths scaled to fit measured step times: ``samples`` are
    (the model's ``{term: seconds}`` at ``hw``, measured seconds). One run fits one factor (the matmul
    efficiency, every time scaled alike); two fit compute and the rest (memory and communication) apart;
    three or more fit compute, memory and communication apart (least squares, each factor kept positive)."""
    import numpy as np

    groups = [("compute", "recompute", "bubble", "overhead", "moe tiles"), ("memory", "offload"), ("comm",)]
    if len(samples) == 1:
        groups = [tuple(g for grp in groups for g in grp)]
    elif len(samples) == 2:
        groups = [groups[0], groups[1] + groups[2]]

    def part(terms: dict, grp: tuple) -> float:
        return sum(v for k, v in terms.items() if k != "step" and (k in grp or k.split(" ")[0] in grp))

    a = np.array([[part(t, g) for g in groups] for t, _ in samples])
    y = np.array([s for _, s in samples])
    scale, *_ = np.linalg.lstsq(a, y, rcond=None)
    scale = [float(x) for x in np.clip(scale, 1e-3, None)]  # a time can only be slower or faster, never free
    c, mem, comm = (scale * 3)[:3] if len(scale) == 1 else (scale[0], scale[1], scale[-1])
    return hw.with_(**_efficiency(hw, hw.efficiency / c), hbm_gbs=hw.hbm_gbs / mem, host_gbs=hw.host_gbs / mem,
                    intra_gbs=hw.intra_gbs / comm, inter_gbs=hw.inter_gbs / comm, intra_us=hw.intra_us * comm,
                    inter_us=hw.inter_us * comm, name=f"{hw.name} (calibrated)")


def _efficiency(hw: Hardware, e: float) -> dict:
    """A fitted efficiency above 1 (the preset's peak below what the device reached) raises the peak instead."""
    return {"efficiency": min(1.0, e), "peak_tflops": hw.peak_tflops * max(1.0, e)}
